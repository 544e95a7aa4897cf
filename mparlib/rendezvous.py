"""How cooperating processes find each other: the backend, the rendezvous variables and the process group.

``torchrun`` starts one process per device and sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in
each; :func:`process_group` joins such processes into a group (nccl on GPUs, gloo on CPUs) and always leaves it.
:mod:`mparlib.launch` starts the processes from Python or a notebook and re-exports these names. Explained in 06_ddp.
"""
import contextlib
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from .devices import num_gpus
from .errors import ConfigError, LaunchError
from .lang import tr

RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def choose_backend(backend="auto", nproc=1):
    """The backend for ``nproc`` processes on this machine: ``"nccl"`` or ``"gloo"``. Explained in 06_ddp.

    ``"auto"`` takes nccl when the machine has a GPU for each of the ``nproc`` processes, and gloo (processes on the
    CPU) otherwise. An explicit choice is checked: nccl needs one GPU per process.
    """
    if backend == "auto":
        return "nccl" if dist.is_nccl_available() and num_gpus() >= nproc else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ConfigError(tr(f"backend={backend!r} is not supported here: use 'auto', 'gloo' (CPU) or 'nccl' (GPUs).",
                             f"backend={backend!r} には対応していません。'auto'、'gloo'（CPU）、'nccl'（GPU）のいずれかを"
                             "指定してください。"))
    if backend == "nccl":
        check_gpus("nccl", nproc)
    return backend


def describe(nproc, backend="auto"):
    """One sentence saying how ``nproc`` processes would run here, and why. Explained in 08_collectives."""
    chosen, gpus = choose_backend(backend, nproc), num_gpus()
    procs = f"{nproc} process" + ("es" if nproc != 1 else "")
    if chosen == "nccl":
        return tr(f"{procs}, one per GPU, with nccl.", f"GPU 1枚につき 1個、計 {nproc}個のプロセスを nccl で動かします。")
    if gpus == 0:
        why_en, why_ja = "this machine has no GPU", "このマシンには GPU がありません"
    elif backend == "gloo":
        why_en, why_ja = "gloo was asked for", "gloo が指定されました"
    else:
        why_en, why_ja = f"nccl needs one GPU per process and this machine has {gpus}", \
            f"nccl には 1個のプロセスに GPU が 1枚必要ですが、このマシンの GPU は {gpus}枚です"
    return tr(f"{procs} on the CPU with gloo ({why_en}).",
              f"{nproc}個のプロセスを CPU 上で gloo を使って動かします（{why_ja}）。")


def _max_cpu_processes():
    """The most CPU (gloo) processes :func:`launch` starts here: 4 per core, and at least 8."""
    return max(8, 4 * (os.cpu_count() or 1))


def check_gpus(backend, nproc):
    """With nccl every process of this machine needs its own GPU: raise if ``nproc`` exceeds them. Explained in 06_ddp."""
    n = num_gpus()
    if backend != "nccl" or nproc <= n:
        return
    if n == 0:
        raise LaunchError(tr("The nccl backend needs CUDA GPUs and PyTorch sees none on this machine: use backend "
                             "'gloo' (or 'auto', which picks gloo here).",
                             "nccl バックエンドには CUDA の GPU が必要ですが、このマシンでは PyTorch から GPU が見えません。"
                             "バックエンドに 'gloo'（または、ここでは gloo を選ぶ 'auto'）を指定してください。"))
    raise LaunchError(tr(f"{nproc} processes were asked for on this machine, but it has {n} GPU(s) and the nccl backend "
                         f"needs one GPU per process. Use at most {n} processes (--nproc {n} or torchrun "
                         f"--nproc_per_node={n}), or the gloo backend to run the processes on the CPU.",
                         f"このマシンで {nproc}個のプロセスが指定されましたが、GPU は {n}枚しかありません。nccl バックエンド"
                         f"では 1個のプロセスに GPU が 1枚必要です。プロセスを {n}個以下にする（--nproc {n} または "
                         f"torchrun --nproc_per_node={n}）か、gloo バックエンドで CPU 上のプロセスとして動かしてください。"))


def free_port(host="127.0.0.1"):
    """A TCP port that is free right now, found by letting the system choose one (bind to port 0). Explained in 06_ddp."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_in_use(port, host, why=""):
    other = free_port(host)
    return LaunchError(tr(
        f"Port {port} on {host} is already in use{why}: another training run or program listens there, and the "
        f"rendezvous server must open on it. Pick another port, e.g. --port {other} (free right now; "
        f"MASTER_PORT={other} in the environment works too), or --port 0 to let the system choose a free one. "
        "`ss -ltnp` shows which program holds a port.",
        f"{host} のポート {port} はすでに使われています{why}。別の訓練やプログラムがそこで待ち受けていますが、ランデブーの"
        f"サーバーはこのポートで開く必要があります。別のポートを選んでください。例えば --port {other}（今は空いています。"
        f"環境変数 MASTER_PORT={other} でも指定できます）、または --port 0 で空いているポートをシステムに選ばせます。"
        "どのプログラムがポートを使っているかは `ss -ltnp` でわかります。"))


def check_port(port, host="127.0.0.1"):
    """Raise a clear error if a rendezvous server could not listen on ``host:port`` (bind test). Explained in 06_ddp."""
    if not (isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536):
        raise ConfigError(tr(f"MASTER_PORT={port!r} is not a TCP port: use a number between 1024 and 65535, e.g. 29500.",
                             f"MASTER_PORT={port!r} は TCP ポートではありません。1024 から 65535 までの数（例: 29500）を"
                             "指定してください。"))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is usable; a listening one is not
        try:
            s.bind((host, port))
        except OSError as e:
            raise _port_in_use(port, host, f" ({e.strerror})") from None


def rendezvous_env(environ=None):
    """Read the variables torchrun sets for each process (rank, world size, master address and port). Explained in 06_ddp.

    Without them a process cannot know who it is or where to meet the others, so this raises an error that says
    how to start the program instead.
    """
    env = os.environ if environ is None else environ
    missing = [k for k in RENDEZVOUS_VARS if not env.get(k)]
    if missing:
        raise LaunchError(tr(
            f"The rendezvous variables {', '.join(missing)} are not set, so this process does not know its rank or "
            "where to meet the others. Start it with torchrun, which sets them for every process:\n"
            "    torchrun --nproc_per_node=2 -m mparlib.ddp [options]\n"
            "or let mparlib start the processes itself:\n"
            "    python -m mparlib.ddp --nproc 2 [options]      (from Python: mparlib.launch.launch(fn, 2))",
            f"ランデブーの環境変数 {', '.join(missing)} が設定されていないため、このプロセスは自分のランクも、"
            "他のプロセスと落ち合う場所もわかりません。各プロセスに変数を設定する torchrun で起動してください:\n"
            "    torchrun --nproc_per_node=2 -m mparlib.ddp [options]\n"
            "または mparlib 自身にプロセスを起動させます:\n"
            "    python -m mparlib.ddp --nproc 2 [options]      （Python からは mparlib.launch.launch(fn, 2)）"))
    try:
        info = {k.lower(): int(env[k]) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
        info["local_rank"] = int(env.get("LOCAL_RANK", info["rank"]))
        info["local_world_size"] = int(env.get("LOCAL_WORLD_SIZE", info["world_size"]))
    except ValueError as e:
        raise ConfigError(tr(f"A rendezvous variable is not an integer ({e}); RANK, LOCAL_RANK, WORLD_SIZE and "
                             "MASTER_PORT must be numbers.",
                             f"ランデブーの環境変数に整数でない値があります（{e}）。RANK、LOCAL_RANK、WORLD_SIZE、"
                             "MASTER_PORT は数でなければなりません。")) from None
    info["master_addr"] = env["MASTER_ADDR"]
    if not 0 <= info["rank"] < info["world_size"]:
        raise ConfigError(tr(f"RANK={info['rank']} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={info['world_size']}).",
                             f"RANK={info['rank']} が 0 から WORLD_SIZE-1 の範囲外です（WORLD_SIZE={info['world_size']}）。"))
    return info


def _seconds(timeout):
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ConfigError(tr(f"timeout={timeout!r}: give the seconds a collective may wait, e.g. 30, or None.",
                             f"timeout={timeout!r}: 集団通信が待てる秒数を 30 のように指定するか、None にしてください。"))
    return timedelta(seconds=timeout)


@contextlib.contextmanager
def process_group(backend="auto", timeout=None, store=None):
    """Join the process group described by the rendezvous variables; always leave it on exit. Explained in 06_ddp.

    Yields a dict ``rank, world_size, local_rank, local_world_size, backend, device``. ``timeout`` (seconds) bounds
    how long a collective waits for the other ranks (PyTorch's default is 30 minutes). ``destroy_process_group`` runs
    on success and on error, so a failing rank does not leave its communicator behind.
    """
    info = rendezvous_env()
    info["backend"] = backend = choose_backend(backend, info["local_world_size"])
    check_gpus(backend, info["local_world_size"])
    if backend == "nccl":
        torch.cuda.set_device(info["local_rank"])
        info["device"] = torch.device("cuda", info["local_rank"])
    else:
        info["device"] = torch.device("cpu")
    extra = {"timeout": _seconds(timeout)} if timeout is not None else {}
    if store is not None:
        extra["store"] = store
    dist.init_process_group(backend, rank=info["rank"], world_size=info["world_size"], **extra)
    try:
        yield info
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def device():
    """This rank's device: ``cuda:LOCAL_RANK`` in an nccl group, the CPU in a gloo group. Explained in 08_collectives."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")
