"""mparlib.launch: N processes from Python or a notebook, results back, failures named, and no rank left behind.

The workers live in tests/launch_workers.py, which the spawned processes import like any module. Every run is tiny
(gloo on the CPU, one thread per process); the orphan tests kill the launcher in the three ways a learner's machine
does (SIGKILL, SIGTERM, a restarted notebook kernel) and check that no rank outlives it by more than 10 s.
"""
import logging
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from launch_workers import (big_result, catches_everything, fails_after, returns_after, course_error, course_error_at_once, echo_arguments, exits_early, failing, killed_mid_run,
                            listening_addresses, rank_sum, returns_at_once, returns_unpicklable, what_the_rank_sees,
                            runs_forever_without_collectives, skips_collective, starts_children, forks_then_dies)
from mparlib import launch, rendezvous
from mparlib.errors import ConfigError, LaunchError, WorkerFailed

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@pytest.mark.slow
def test_every_rank_takes_part_and_rank_0s_result_comes_back(capsys):
    assert launch.launch(rank_sum, 3, args=(10,)) == 0 + 1 + 2 + 3 * 10
    out = capsys.readouterr().out
    assert out.splitlines() == ["rank 0: sum 33"]  # rank 0's lines are echoed; the others stay in their logs


@pytest.mark.slow
def test_launcher_options_never_shadow_the_workers_arguments():
    got = launch.launch(echo_arguments, 2, args=(1, "two"), kwargs={"port": 5, "backend": "mine", "echo": "x"},
                        echo=False)
    assert got == {"args": (1, "two"), "kwargs": {"port": 5, "backend": "mine", "echo": "x"}, "rank": 0, "world": 2}


@pytest.mark.slow
def test_logs_are_kept_per_rank_and_appended(tmp_path):
    for _ in range(2):
        launch.launch(rank_sum, 2, log_dir=tmp_path, echo=False)
    assert (tmp_path / "rank1.log").read_text().count("rank 1: sum 1") == 2


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo"])
def test_a_log_that_leads_elsewhere_is_refused_and_left_alone(tmp_path, kind):
    target = tmp_path / "notes.txt"
    target.write_text("mine\n")
    logs = tmp_path / "logs"
    logs.mkdir()
    {"symlink": lambda p: p.symlink_to(target), "hardlink": lambda p: os.link(target, p),
     "fifo": lambda p: os.mkfifo(p)}[kind](logs / "rank0.log")
    with pytest.raises(LaunchError, match=r"rank0\.log is not a log file of this launcher"):
        launch.launch(rank_sum, 2, log_dir=logs, echo=False)
    assert target.read_text() == "mine\n"


@pytest.mark.slow
def test_a_failing_rank_is_named_with_the_end_of_its_log_and_the_others_stopped():
    t = time.monotonic()
    with pytest.raises(WorkerFailed) as e:
        launch.launch(failing, 3, args=(1,), echo=False)
    message = str(e.value)
    assert message.startswith("rank 1 failed with ValueError: rank 1 cannot go on; the other processes were stopped")
    assert "about to fail" in message and "Traceback" in message  # the end of rank 1's own log
    assert time.monotonic() - t < 60


@pytest.mark.slow
def test_a_course_error_in_a_worker_comes_back_as_itself():
    with pytest.raises(ConfigError, match=r"^epochs=0: use an int >= 1\.$"):
        launch.launch(course_error, 2, echo=False)


@pytest.mark.slow
def test_a_course_error_raised_at_once_is_what_comes_back_while_the_other_ranks_return():
    """Every rank has joined before any worker runs, and a rank that fails after the first one is recorded after it:
    the course's error is what comes back. (Once, on torch 2.11, a rank still joining saw its links close as the rank
    with the error left, and was named instead.)"""
    for _ in range(3):
        with pytest.raises(ConfigError, match=r"^planted at once$"):
            launch.launch(course_error_at_once, 4, echo=False, timeout=60)


@pytest.mark.slow
def test_ranks_that_send_nothing_all_return():
    assert [launch.launch(returns_at_once, 4, echo=False, timeout=60) for _ in range(3)] == [0, 0, 0]


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_the_cause_and_its_log_is_shown():
    with pytest.raises(WorkerFailed, match=r"(?s)^rank 1 was killed by signal SIGKILL.*working on step 3") as e:
        launch.launch(killed_mid_run, 2, args=(1,), echo=False)
    assert e.value.rank == 1 and e.value.cause == "rank 1 was killed by signal SIGKILL"


@pytest.mark.slow
@pytest.mark.parametrize("who, code, how, match", [
    (0, 7, "os", r"^rank 0 exited with code 7;"),
    (1, 0, "os", r"^rank 1 ended with exit code 0 before its function returned"),
    (1, 0, "sys", r"^rank 1 called sys\.exit\(0\) before its function returned"),
    (0, 3, "sys", r"^rank 0 called sys\.exit\(3\) before its function returned"),
])
def test_the_rank_that_ended_its_process_is_blamed(who, code, how, match):
    with pytest.raises(WorkerFailed, match=match) as e:
        launch.launch(exits_early, 2, args=(who, code, how), echo=False, timeout=60)
    assert e.value.rank == who and "leaving early" in str(e.value)


@pytest.mark.slow
def test_a_result_that_cannot_travel_back_is_explained():
    with pytest.raises(LaunchError, match=r"^Rank 0's return value \(a dict\) cannot be sent back.*lambda"):
        launch.launch(returns_unpicklable, 2, echo=False)


@pytest.mark.parametrize("call, match", [
    (dict(args=(1, lambda x: x)), r"^launch: args\[1\] \(a function\) cannot be sent"),
    (dict(kwargs={"log": open(os.devnull)}), r"^launch: kwargs\['log'\] \(a TextIOWrapper\) cannot be sent"),
])
def test_an_argument_that_cannot_travel_is_named_before_any_process_starts(call, match):
    with pytest.raises(ConfigError, match=match):
        launch.launch(rank_sum, 2, echo=False, **call)
    for value in call.get("kwargs", {}).values():
        value.close()


def test_a_stale_worker_from_an_earlier_run_of_its_cell_is_explained():
    from mparlib.workers import write_worker

    old = write_worker("mparlib_test_stale_worker", "def work():\n    return 1\n").work
    write_worker("mparlib_test_stale_worker", "def work():\n    return 2\n")  # the cell is run again
    with pytest.raises(LaunchError, match=r"import it again \(from mparlib_test_stale_worker import work\)"):
        launch.launch(old, 2, echo=False)


@pytest.mark.slow
def test_a_wall_clock_limit_ends_ranks_that_never_call_a_collective(tmp_path):
    import psutil

    with pytest.raises(WorkerFailed, match=r"^the run took longer than limit=10 s, so every rank was stopped"):
        launch.launch(runs_forever_without_collectives, 2, args=(str(tmp_path),), limit=10, timeout=5, echo=False)
    pids = [int(f.read_text()) for f in tmp_path.glob("rank*.pid") if f.read_text()]
    assert len(pids) == 2  # both ranks were running their worker when the limit ended them
    assert not any(_alive(p) for p in pids) and not multiprocessing.active_children()
    assert not _leftovers()


@pytest.mark.slow
def test_a_collective_that_one_rank_skips_ends_at_the_timeout():
    t = time.monotonic()
    with pytest.raises(WorkerFailed, match="rank 0 failed with"):
        launch.launch(skips_collective, 2, timeout=3, echo=False)
    assert time.monotonic() - t < 300  # rank 1 would sleep 600 s: the timeout, not its return, ended the run


@pytest.mark.slow
def test_nothing_is_left_behind_in_the_launching_process(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the run's (and torch's) temporary files go

    def state():
        return (sorted(t.name for t in threading.enumerate()), len(os.listdir("/proc/self/task")), dict(os.environ),
                signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), multiprocessing.active_children(),
                logging.getLogger("torch.multiprocessing.spawn").level, sorted(tmp_path.iterdir()))

    before = state()
    launch.launch(rank_sum, 2, echo=False)
    port = rendezvous.free_port()
    with pytest.raises(WorkerFailed) as failed:
        launch.launch(failing, 2, args=(1,), port=port, echo=False)
    rendezvous.check_port(port)  # the rendezvous server is closed, though its error (and its frames) is still held
    assert state() == before and failed.value.rank == 1


@pytest.mark.parametrize("bad, match", [
    (dict(nproc=0), "nproc=0"), (dict(nproc=2.0), "nproc=2.0"), (dict(nproc=True), "nproc=True"),
    (dict(args=5), "args=5"), (dict(kwargs=[1]), r"kwargs=\[1\]"), (dict(timeout=-1), "timeout=-1"),
    (dict(timeout=float("nan")), "timeout=nan"), (dict(backend="mpi"), "backend='mpi'"),
    (dict(threads=-3), "threads=-3"), (dict(threads=1.5), "threads=1.5"), (dict(limit=0), "limit=0"),
])
def test_bad_arguments_are_refused_before_any_process_starts(bad, match):
    call = dict(nproc=2) | bad
    with pytest.raises(ConfigError, match=match):
        launch.launch(rank_sum, call.pop("nproc"), **call)


LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


@pytest.mark.slow
def test_nothing_of_a_launch_listens_beyond_loopback():
    got = launch.launch(listening_addresses, 2, args=(os.getpid(),), echo=False)
    assert (any(port == got["store_port"] for _, port in got["listening"])  # the store is among them
            and {ip for ip, _ in got["listening"]} <= LOOPBACK), got


def test_too_low_an_open_file_limit_is_named_before_any_process_starts():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 10, hard))
    try:
        with pytest.raises(LaunchError, match=r"Too few open files .*ulimit -n"):
            launch.launch(rank_sum, 2, echo=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_too_many_cpu_processes_for_this_machine_are_refused():
    most = max(8, 4 * (os.cpu_count() or 1))  # 4 per core, and at least 8
    with pytest.raises(ConfigError, match=f"{most + 1} processes .* CPU core.* Use at most {most} "):
        launch.launch(rank_sum, most + 1, backend="gloo")


def test_describe_says_where_the_ranks_run(monkeypatch):
    monkeypatch.setattr(rendezvous, "num_gpus", lambda: 0)
    assert rendezvous.describe(2) == "2 processes on the CPU with gloo (this machine has no GPU)."
    monkeypatch.setattr(rendezvous, "num_gpus", lambda: 1)
    monkeypatch.setattr(rendezvous.dist, "is_nccl_available", lambda: True)
    assert "nccl needs one GPU per process and this machine has 1" in rendezvous.describe(4)
    assert rendezvous.describe(1) == "1 process, one per GPU, with nccl."
    assert rendezvous.choose_backend("auto", 1) == "nccl" and rendezvous.choose_backend("auto", 2) == "gloo"


# ------------------------------------------------------------------------------------------------ no orphans

def _wait_for_pids(folder, n, deadline=120):
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        files = sorted(Path(folder).glob("rank*.pid"))
        if len(files) == n and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.1)
    raise AssertionError(f"the ranks did not start within {deadline} s")


def _leftovers():
    """Processes below this one that are alive, other than the two servers of ``multiprocessing`` (the fork server,
    which outlives each launch by design, and the resource tracker)."""
    import psutil

    servers = ("from multiprocessing.forkserver import main", "from multiprocessing.resource_tracker import main")
    me = psutil.Process()
    return [p for p in me.children(recursive=True)
            if p.status() != psutil.STATUS_ZOMBIE and not (p.ppid() == me.pid and any(s in " ".join(p.cmdline())
                                                                                       for s in servers))]


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (ended, not yet reaped by its new parent) does not run any more
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pids, seconds=10.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    for p in pids:  # clean up before failing
        if _alive(p):
            os.kill(p, signal.SIGKILL)
    return False


LAUNCHER = ("import sys; from launch_workers import sleeper; from mparlib.launch import launch; "
            "launch(sleeper, 2, args=(sys.argv[1],))")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_no_rank_outlives_a_killed_launcher(tmp_path, child_env, sig):
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], env=child_env(TESTS),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pids = _wait_for_pids(tmp_path, 2)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        assert _gone_within(pids), f"ranks {pids} still ran 10 s after the launcher got {sig.name}"
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_no_rank_outlives_a_stopped_then_killed_launcher(tmp_path, child_env):
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], env=child_env(TESTS),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pids = _wait_for_pids(tmp_path, 2)
        proc.send_signal(signal.SIGSTOP)  # Ctrl+Z, then the terminal or its shell goes away
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert _gone_within(pids), f"ranks {pids} still ran 10 s after the stopped launcher was killed"
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
@pytest.mark.parametrize("fail", [False, True])
def test_processes_started_by_the_ranks_end_with_the_run(tmp_path, fail):
    if fail:
        with pytest.raises(WorkerFailed, match="rank 1 failed with RuntimeError"):
            launch.launch(starts_children, 2, args=(str(tmp_path), True), echo=False, limit=300)
    else:
        assert launch.launch(starts_children, 2, args=(str(tmp_path),), echo=False, limit=300) == "done"
    pids = [int(p) for f in sorted(tmp_path.glob("children*.pid")) for p in f.read_text().split()]
    assert len(pids) == 4 and _gone_within(pids), f"processes {pids} started by the ranks outlived the run"


@pytest.mark.slow
def test_a_child_started_just_before_its_rank_is_killed_does_not_outlive_the_run(tmp_path):
    with pytest.raises(WorkerFailed):
        launch.launch(forks_then_dies, 2, args=(str(tmp_path),), echo=False, timeout=60, limit=300)
    pid = int((tmp_path / "orphan.pid").read_text())
    assert _gone_within([pid]), f"process {pid}, started by rank 1 just before it was killed, outlived the run"


@pytest.mark.slow
def test_an_interrupted_launch_stops_every_rank_itself(tmp_path, child_env):
    # Python raises KeyboardInterrupt only where SIGINT is not ignored at its start, and a shell ignores it in
    # what it starts in the background (`make test &`): the child asks for the handler itself, as a kernel does.
    script = ("import signal, sys, time; from launch_workers import sleeper; from mparlib.launch import launch\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "try:\n    launch(sleeper, 2, args=(sys.argv[1],))\nexcept KeyboardInterrupt:\n"
              "    print('interrupted', flush=True)\n    time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], env=child_env(TESTS),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        pids = _wait_for_pids(tmp_path, 2)
        proc.send_signal(signal.SIGINT)  # Ctrl+C, or the notebook's stop button
        assert proc.stdout.readline() == b"interrupted\n"
        assert _gone_within(pids), f"ranks {pids} still ran 10 s after launch was interrupted"
        assert proc.poll() is None  # the launcher stopped them, not its own end
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_no_rank_outlives_a_restarted_notebook_kernel(tmp_path, child_env):
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path), env=child_env(TESTS))
    try:
        kc.execute(f"import sys; sys.path[:0] = [{str(TESTS)!r}, {str(ROOT)!r}]\n" + LAUNCHER.replace(
            "sys.argv[1]", repr(str(tmp_path))))  # the launch runs on; the test restarts the kernel under it
        pids = _wait_for_pids(tmp_path, 2)
        km.restart_kernel(now=True)
        assert _gone_within(pids), f"ranks {pids} still ran 10 s after the kernel restarted"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.slow
def test_a_notebook_defines_its_worker_with_the_worker_magic(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        "%load_ext mparlib.launch",
        "%%worker my_workers\nimport torch.distributed as dist\n\n\ndef times_rank(k):\n    return [dist.get_rank() * k]\n",
        "from my_workers import times_rank\nfrom mparlib.launch import launch\nprint(launch(times_rank, 2, args=(7,)))",
        "%%worker my_workers\nimport torch.distributed as dist\n\n\ndef times_rank(k):\n    return [dist.get_rank() + k]\n",
        "from my_workers import times_rank\nprint(launch(times_rank, 2, args=(7,)))",
        "import os, my_workers\nprint(str(tmp) in my_workers.__file__ or os.listdir(tmp))".replace("tmp", repr(str(tmp_path))),
    )]
    NotebookClient(nb, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    texts = ["".join(o.get("text", "") for o in c.outputs) for c in nb.cells]
    assert texts[:2] == ["", ""]  # the magic prints nothing
    assert texts[2] == "[0]\n" and texts[4] == "[7]\n"  # rank 0's result; the edited cell replaced the module
    assert texts[5] == "[]\n"  # nothing was written into the notebook's folder


def test_worker_names_that_would_hide_a_module_are_refused():
    from mparlib.workers import write_worker

    for name in ("torch", "json", "not a name", "class"):
        with pytest.raises(ConfigError):
            write_worker(name, "x = 1\n")
    module = write_worker("mparlib_test_worker_ok", "def f():\n    return 3\n")
    assert module.f() == 3
    assert torch.__name__ == "torch"


@pytest.mark.slow
def test_a_group_started_by_hand_listens_on_loopback_only(tmp_path):
    """RANK/WORLD_SIZE/MASTER_* set by hand, as a tutorial would: rank 0's store and gloo stay on 127.0.0.1."""
    import json

    from children import make_child_env

    port = rendezvous.free_port()
    script = str(Path(__file__).with_name("launch_workers.py"))
    procs = []
    for rank in range(2):
        env = make_child_env(RANK=rank, WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        env.pop("GLOO_SOCKET_IFNAME", None)
        procs.append(subprocess.Popen([sys.executable, script], env=env, stdout=subprocess.PIPE, text=True))
    try:
        out = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], out
    got = json.loads(out[0].strip().splitlines()[-1])
    assert got["sum"] == 3.0
    assert any(p == port for _, p in got["listening"]), got  # rank 0 serves the store itself
    assert {ip for ip, _ in got["listening"]} <= LOOPBACK, got


# ------------------------------------------------------------------ another local process writing into the store
class _RunsCode:
    """A pickle that creates ``marker`` when it is unpickled."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _write_into_store(port, marker, stop):
    """Keep writing code-running pickles under every key a launcher ever read, as another local user could."""
    from datetime import timedelta

    import torch.distributed as dist

    payload = pickle.dumps(_RunsCode(marker))
    record = pickle.dumps((0, "ValueError: forged", _RunsCode(marker)))
    store = None
    while store is None and not stop.is_set():
        try:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
        except Exception:  # noqa: BLE001 - not listening yet
            time.sleep(0.05)
    while not stop.is_set():
        try:
            for key in ("mparlib/result", "result"):
                store.set(key, payload)
            for r in range(2):
                for key in (f"mparlib/error{r}", f"error{r}"):
                    store.set(key, record)
        except Exception:  # noqa: BLE001 - the run is over and its store gone
            return
        time.sleep(0.02)


def _beside_a_writer(tmp_path, run):
    port, marker, stop = rendezvous.free_port(), tmp_path / "MARKER", threading.Event()
    writer = threading.Thread(target=_write_into_store, args=(port, marker, stop), daemon=True)
    writer.start()
    try:
        return run(port), marker
    finally:
        stop.set()
        writer.join(10)


@pytest.mark.slow
def test_a_result_written_into_the_store_by_another_process_is_never_run_nor_returned(tmp_path):
    got, marker = _beside_a_writer(tmp_path, lambda port: launch.launch(
        returns_after, 2, args=(3.0, {"answer": 42}), port=port, echo=False))
    assert got == {"answer": 42}
    assert not marker.exists()


@pytest.mark.slow
def test_an_error_written_into_the_store_by_another_process_is_never_run_nor_reported(tmp_path):
    def run(port):
        with pytest.raises(WorkerFailed) as e:
            launch.launch(fails_after, 2, args=(3.0, 1), port=port, echo=False, timeout=30)
        return str(e.value)

    message, marker = _beside_a_writer(tmp_path, run)
    assert "rank 1 fails on purpose" in message and "forged" not in message
    assert not marker.exists()


@pytest.mark.slow
def test_the_results_folder_is_private_and_gone_after_the_run():
    import stat

    before = set(Path(tempfile.gettempdir()).glob("mparlib-results-*"))
    assert launch.launch(rank_sum, 2, echo=False) == 1
    assert set(Path(tempfile.gettempdir()).glob("mparlib-results-*")) == before
    with tempfile.TemporaryDirectory(prefix="mparlib-results-") as box:  # made as the launcher makes it
        assert stat.S_IMODE(os.stat(box).st_mode) == 0o700


@pytest.mark.slow
@pytest.mark.parametrize("mib", [20, 100])
def test_a_result_larger_than_a_store_value_comes_back_whole(mib):
    got = launch.launch(big_result, 2, args=(mib << 20,), echo=False)
    assert got.numel() == (mib << 20) // 8 and got[-1].item() == got.numel() - 1


@pytest.mark.slow
def test_the_limit_ends_ranks_that_catch_every_exception_and_ignore_signals():
    start = time.monotonic()
    with pytest.raises(WorkerFailed, match="limit=5 s"):
        launch.launch(catches_everything, 2, echo=False, limit=5)
    assert time.monotonic() - start < 5 + 10


@pytest.mark.slow
def test_each_launch_starts_its_ranks_from_the_launchers_state_at_that_call(tmp_path, monkeypatch):
    # The ranks are forked from one server per launcher, started at the first launch: what the launcher changed
    # since (its environment, even what PyTorch reads at import, its module path, its folder) must still reach them,
    # and nothing else of its state.
    launch.launch(rank_sum, 2, echo=False)  # the fork server is up before the changes below
    (tmp_path / "mparlib_test_late_module.py").write_text("VALUE = 'written after the first launch'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("MPARLIB_TEST_LATE", "set after the first launch")
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # read once, when torch.distributed is imported
    monkeypatch.chdir(tmp_path)
    before = torch.get_default_dtype()
    with torch.random.fork_rng():
        torch.manual_seed(1234)  # the launcher's own state reaches no rank: each draws from a seed of its own
        seeded = torch.rand(1).item()
        torch.set_default_dtype(torch.float64)
        try:
            got, again = (launch.launch(what_the_rank_sees, 2, args=("MPARLIB_TEST_LATE", "mparlib_test_late_module"),
                                        echo=False) for _ in range(2))
        finally:
            torch.set_default_dtype(before)
    draws = got.pop("random") + again.pop("random")
    assert len(set(draws)) == 4 and seeded not in draws, draws  # not the launcher's, not shared between ranks or runs
    assert got == again == {"variable": "set after the first launch", "module": "written after the first launch",
                            "dtype": torch.float32, "cwd": str(tmp_path),
                            "threads": max(1, (os.cpu_count() or 1) // 2), "debug": "DebugLevel.DETAIL"}


@pytest.mark.slow
def test_a_killed_fork_server_is_started_again_by_the_next_launch():
    import psutil
    from multiprocessing import forkserver

    launch.launch(rank_sum, 2, echo=False)
    server = psutil.Process(forkserver._forkserver._forkserver_pid)
    server.kill()  # as the kernel's out-of-memory killer would; left for multiprocessing to reap, as it does
    deadline = time.monotonic() + 10
    while server.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert launch.launch(rank_sum, 2, echo=False) == 1.0
    assert forkserver._forkserver._forkserver_pid != server.pid and not psutil.pid_exists(server.pid)
