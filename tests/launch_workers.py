"""Worker functions for the launcher's tests: importable by the spawned processes (the tests folder is on sys.path)."""
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def one_step(x, y, lr=0.1, seed=0, model="mlp"):
    """One SGD step of DDP where rank r trains on its contiguous slice of ``x, y``; returns the new parameters."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mparlib.ddp_train import make_model

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    net = make_model(model)
    ddp_net = DDP(net)
    share = len(y) // world
    xs, ys = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    optimizer = torch.optim.SGD(ddp_net.parameters(), lr=lr)
    nn.functional.cross_entropy(ddp_net(xs), ys).backward()
    optimizer.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def rank_sum(offset=0):
    """All-reduce (rank + offset) over the group; every rank returns the sum."""
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()}: sum {t.item():g}", flush=True)
    return t.item()


def echo_arguments(*args, **kwargs):
    """Return what the worker received: the launcher's own option names must reach it untouched."""
    return {"args": args, "kwargs": kwargs, "rank": dist.get_rank(), "world": dist.get_world_size()}


def failing(rank_that_fails=1):
    """Rank ``rank_that_fails`` raises after printing a line; the others wait in a barrier."""
    if dist.get_rank() == rank_that_fails:
        print("about to fail", flush=True)
        raise ValueError(f"rank {rank_that_fails} cannot go on")
    dist.barrier()


def course_error():
    """Rank 1 raises one of the course's errors: it must come back as that class and message."""
    from mparlib.errors import ConfigError

    if dist.get_rank() == 1:
        raise ConfigError("epochs=0: use an int >= 1.")
    dist.barrier()


def course_error_at_once():
    """Rank 0 raises one of the course's errors at once; the others return at once, sending nothing."""
    from mparlib.errors import ConfigError

    if dist.get_rank() == 0:
        raise ConfigError("planted at once")
    return dist.get_rank()


def returns_at_once():
    """Every rank returns at once, sending nothing: no rank may end while another is still joining."""
    return dist.get_rank()


def killed_mid_run(victim=1):
    """Rank ``victim`` prints, then is killed by SIGKILL while the others wait in a collective."""
    if dist.get_rank() == victim:
        print("working on step 3", flush=True)
        time.sleep(0.2)
        os.kill(os.getpid(), 9)
    dist.barrier()


def sleeper(folder):
    """Write this rank's pid into ``folder`` and then wait forever (for the orphan tests)."""
    Path(folder, f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(0.1)


def skips_collective(timeout_expected=True):
    """Rank 1 skips an all-reduce that rank 0 enters: rank 0 waits until the group's timeout."""
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(600)  # far longer than any timeout the tests give


def listening_addresses(launcher):
    """Rank 0 returns the local addresses on which the launcher (pid ``launcher``) and every rank listen for
    connections."""
    import psutil

    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    found = []
    if dist.get_rank() == 0:
        for pid in [launcher, *pids]:
            found += [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN]
    dist.barrier()
    return {"listening": found, "store_port": int(os.environ["MASTER_PORT"])}


def exits_early(who=0, code=7, how="os"):
    """Rank ``who`` ends its process in the middle of the run (``os._exit`` or ``sys.exit``); the others then wait in
    a collective that can never complete."""
    import sys

    if dist.get_rank() == who:
        print("leaving early", flush=True)
        time.sleep(0.2)
        if how == "os":
            os._exit(code)
        sys.exit(code)
    dist.barrier()
    dist.all_reduce(torch.ones(1))
    return "finished"


def returns_unpicklable():
    """Every rank returns a value that pickle cannot carry (a lambda)."""
    dist.barrier()
    return {"scale": lambda x: 2 * x}


def runs_forever_without_collectives(folder=None):
    """Never returns and never calls a collective: only a wall-clock limit ends it."""
    if folder is not None:
        Path(folder, f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(0.1)


def starts_children(folder, fail=False):
    """Each rank starts a child in a session of its own and a daemon (double fork) that outlives that child, writes
    their pids, then returns (or rank 1 raises): neither may outlive the run."""
    import subprocess
    import sys

    rank = dist.get_rank()
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    daemon = subprocess.Popen([sys.executable, "-c", "import os, subprocess, sys; "
                               "p = subprocess.Popen(['sleep', '600'], start_new_session=True, "
                               "stdout=subprocess.DEVNULL); print(p.pid)"],
                              stdout=subprocess.PIPE, text=True)
    orphan = int(daemon.communicate()[0])  # its parent has exited: the sleeper is an orphan now
    Path(folder, f"children{rank}.pid").write_text(f"{child.pid} {orphan}")
    dist.barrier()
    if fail and rank == 1:
        raise RuntimeError("rank 1 fails after starting its children")
    return "done"


def forks_then_dies(folder):
    """Rank 1 starts a child in a session of its own and is killed at once (SIGKILL: no clean-up of its own runs), faster
    than any polling launcher looks; rank 0 waits for it at a barrier. The child may not outlive the run."""
    import signal
    import subprocess

    if dist.get_rank() == 1:
        child = subprocess.Popen(["sleep", "600"], start_new_session=True)
        Path(folder, "orphan.pid").write_text(str(child.pid))
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def puts_rank(queue):
    """Put this rank into a ``multiprocessing`` queue that the launcher passed in (spawn carries queues)."""
    queue.put(dist.get_rank())
    return dist.get_rank()


def hand_started_group():
    """Run as a script with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set by hand (no torchrun, no launch): join
    through process_group, all-reduce, and on rank 0 print the addresses this process listens on, as JSON."""
    import json

    import psutil

    from mparlib.rendezvous import process_group

    with process_group("gloo", timeout=60) as info:
        t = torch.ones(1) * (info["rank"] + 1)
        dist.all_reduce(t)
        listening = [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        dist.barrier()
    if info["rank"] == 0:
        print(json.dumps({"sum": t.item(), "listening": listening}))


if __name__ == "__main__":
    hand_started_group()


def returns_after(seconds, value):
    """Every rank waits ``seconds``, then rank 0 returns ``value`` (time for another process to write into the store)."""
    time.sleep(seconds)
    dist.barrier()
    return value


def fails_after(seconds, rank_that_fails=1):
    """``rank_that_fails`` raises after ``seconds``; the others wait in a barrier for it."""
    time.sleep(seconds)
    if dist.get_rank() == rank_that_fails:
        raise ValueError(f"rank {rank_that_fails} fails on purpose")
    dist.barrier()


def big_result(nbytes):
    """Rank 0 returns a tensor of ``nbytes`` bytes (more than a TCPStore value may hold: 8 MiB)."""
    return torch.arange(nbytes // 8, dtype=torch.float64)


def catches_everything(seconds=1000):
    """Sleeps forever, swallowing every exception and ignoring SIGTERM and SIGALRM: only SIGKILL ends it."""
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    while True:
        try:
            time.sleep(seconds)
        except BaseException:  # noqa: BLE001 - the point of this worker
            pass


def _gathered(value):
    """``value`` of every rank, in rank order."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def what_the_rank_sees(variable, module):
    """What a rank starts from: an environment variable, an importable module, the default dtype, the first random
    number of each rank, the working folder, its number of threads, and the debug level PyTorch read at import."""
    import importlib

    return {"variable": os.environ.get(variable), "module": importlib.import_module(module).VALUE,
            "dtype": torch.get_default_dtype(), "random": _gathered(torch.rand(1).item()), "cwd": os.getcwd(),
            "threads": torch.get_num_threads(), "debug": str(dist.get_debug_level())}
