"""Starting N cooperating processes from Python or a notebook, and getting rank 0's result back.

:func:`launch` does torchrun's job from Python, so that a notebook can run a worker function in N local processes and
get rank 0's result back. It stands on PyTorch's own tools: ``torch.multiprocessing.start_processes`` starts and
watches the processes, and the launcher hosts the rendezvous ``TCPStore`` that the ranks connect to, as torchrun's
agent does. A notebook writes its own worker module with the ``%%worker`` cell magic (:mod:`mparlib.workers`).
Explained in 06_ddp.
"""
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .errors import ConfigError, LaunchError, MparlibError, WorkerFailed
from .lang import tr
from .rendezvous import (  # noqa: F401  (the group's names, re-exported: a notebook imports them from here)
    RENDEZVOUS_VARS, _max_cpu_processes, _port_in_use, _seconds, check_gpus, check_port, choose_backend, describe,
    device, free_port, process_group, rendezvous_env)

def _check_importable(fn):
    """Spawned processes find ``fn`` by module and name: reject functions they cannot import."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn))
    if callable(fn) and module not in (None, "__main__", "__mp_main__") and "<locals>" not in name \
            and "<lambda>" not in name:
        return
    in_main = module in ("__main__", "__mp_main__")
    where = tr("in a notebook or script (module __main__)" if in_main else "inside another function or as a lambda",
               "ノートブックかスクリプト（モジュール __main__）" if in_main else "別の関数の中か lambda")
    raise LaunchError(tr(
        f"The worker {name!r} is defined {where}, so the new processes cannot find it. A spawned process is a fresh "
        "Python interpreter: it receives the function as 'module name + function name' (pickle) and imports it, and "
        "a notebook's __main__ exists only in this kernel. In a notebook, run `%load_ext mparlib.launch` once and "
        "start the worker's cell with `%%worker my_workers`; then `from my_workers import worker` and launch that. "
        "In a script, put the worker in a module of its own.",
        f"ワーカー関数 {name!r} は{where}で定義されているため、新しいプロセスからは見つけられません。spawn で起動した"
        "プロセスはまっさらな Python インタプリタで、関数を「モジュール名 + 関数名」として受け取り（pickle）、インポート"
        "します。ノートブックの __main__ はこのカーネルの中にしかありません。ノートブックでは `%load_ext mparlib.launch` "
        "を一度実行し、ワーカーのセルを `%%worker my_workers` で始めてから、`from my_workers import worker` で"
        "インポートしたものを launch に渡してください。スクリプトでは、ワーカーを専用のモジュールに書きます。"))


def _die_with_parent(parent):
    """Make sure this process ends when the launcher ``parent`` does, however the launcher ends."""
    try:  # Linux: the kernel sends SIGKILL to this process the moment its parent dies
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)

    def watch():  # other systems, and a second line of defence
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="mparlib-parent-watch", daemon=True).start()


def _entry(rank, fn, args, kwargs, nproc, host, port, backend, threads, timeout, log_paths, run_dir, parent):
    """Body of each spawned process: stay tied to the launcher, log to a file, join the group, run ``fn``."""
    _die_with_parent(parent)
    log = open(log_paths[rank], "a", buffering=1, encoding="utf-8")
    os.dup2(log.fileno(), 1)  # the process's prints (and C++ warnings) go to its log, not to the notebook
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    code, failed_at = 0, []  # failed_at: when fn raised, before leaving the group wakes the other ranks with errors
    try:
        torch.set_num_threads(threads)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                          MASTER_ADDR=host, MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
        # The launcher hosts the rendezvous server; every rank is a client, as under torchrun's agent.
        store = dist.TCPStore(host, port, nproc, is_master=False, timeout=timedelta(seconds=120))
        with process_group(backend, timeout=timeout, store=store):
            try:
                result = fn(*args, **kwargs)
            except BaseException:
                failed_at.append(time.time())
                raise
        if rank == 0:
            torch.save(result, Path(run_dir) / "result.pt")
    except BaseException as e:
        code = 2 if isinstance(e, MparlibError) else 1
        record = {"time": (failed_at or [time.time()])[0], "type": type(e).__name__, "module": type(e).__module__, "message": str(e),
                  "traceback": traceback.format_exc()}
        print(f"error: {e}" if code == 2 else record["traceback"], flush=True)
        Path(run_dir, f"error{rank}.json").write_text(json.dumps(record), encoding="utf-8")
    log.flush()
    os._exit(code)  # the work is saved and the group left: skip the interpreter's teardown of torch's C++ threads


def launch(fn, nproc, args=(), kwargs=None, *, backend="auto", port=None, host="127.0.0.1", threads=None,
           log_dir=None, echo=True, show=None, timeout=None):
    """Run ``fn(*args, **kwargs)`` in ``nproc`` new local processes and return rank 0's result. Explained in 06_ddp.

    Each process is started fresh (``spawn``), gets the variables torchrun would set (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``...), joins the process group and calls ``fn``, which must be importable (in a
    notebook: a ``%%worker`` cell). ``backend="auto"`` takes nccl when there is a GPU per process, else gloo on the
    CPU (:func:`describe` says which). Rank 0's output is echoed here as it comes (``echo``); each rank appends to
    ``log_dir/rank{r}.log`` (a temporary folder by default). ``show`` names a PNG that rank 0 rewrites (an
    :class:`~mparlib.plot.Animator` file): in Jupyter it is shown and updated in the cell. ``port=None`` (or 0) lets
    the system choose the rendezvous port. ``threads`` per process defaults to the CPU cores shared out. ``timeout``
    (seconds) bounds how long a collective waits. If a process fails, all are stopped; an error raised by the course
    in a worker comes back as the same class and message, anything else as :class:`WorkerFailed` naming the rank
    and showing the end of its log. The processes never outlive this call, nor the process that made it.
    """
    _check_importable(fn)
    if not (isinstance(nproc, int) and not isinstance(nproc, bool) and nproc >= 1):
        raise ConfigError(tr(f"nproc={nproc!r}: the number of processes must be a positive int such as 2.",
                             f"nproc={nproc!r}: プロセス数は 2 のような正の整数で指定してください。"))
    if not isinstance(args, (tuple, list)):
        raise ConfigError(tr(f"args={args!r}: pass the worker's positional arguments as a tuple, e.g. args=(x, y).",
                             f"args={args!r}: ワーカーの位置引数は args=(x, y) のようにタプルで渡してください。"))
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigError(tr(f"kwargs={kwargs!r}: pass the worker's keyword arguments as a dict.",
                             f"kwargs={kwargs!r}: ワーカーのキーワード引数は dict で渡してください。"))
    backend = choose_backend(backend, nproc)
    _seconds(timeout)
    cores = os.cpu_count() or 1
    if backend == "gloo" and nproc > _max_cpu_processes():
        raise ConfigError(tr(
            f"{nproc} processes on {cores} CPU core(s) is more than this machine can run well: every process holds "
            f"its own Python, PyTorch and model (about 1 GB each), and they share the cores. Use at most "
            f"{_max_cpu_processes()} (4 per core), or a machine with GPUs for more ranks.",
            f"CPU コア {cores}個で {nproc}個のプロセスは、このマシンでは多すぎます。各プロセスが Python、PyTorch、モデルを"
            f"それぞれ持ち（1個あたり約 1 GB）、コアを取り合います。プロセスは {_max_cpu_processes()}個（コアあたり 4個）"
            "以下にするか、より多くのランクには GPU のあるマシンを使ってください。"))
    if port not in (None, 0):
        check_port(port, host)
    threads = threads or (1 if backend == "nccl" else max(1, cores // nproc))
    try:  # the rendezvous server lives here, so no rank has to win a race for the port
        server = dist.TCPStore(host, port or 0, nproc, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=120))
    except (RuntimeError, OSError) as e:
        raise _port_in_use(port, host, f" ({e})") from None
    with tempfile.TemporaryDirectory(prefix="mparlib-launch-") as run_dir:
        logs = Path(log_dir) if log_dir is not None else Path(run_dir)
        logs.mkdir(parents=True, exist_ok=True)
        log_paths = [logs / f"rank{r}.log" for r in range(nproc)]
        offsets = [p.stat().st_size if p.exists() else 0 for p in log_paths]  # logs are appended to, never erased
        from .workers import _LogEcho as LogEcho

        echoer = LogEcho(log_paths[0] if echo else None, offsets[0], show)
        entry_args = (fn, tuple(args), dict(kwargs or {}), nproc, host, server.port, backend, threads, timeout,
                      [str(p) for p in log_paths], run_dir, os.getpid())
        procs = []
        try:
            procs = mp.start_processes(_entry, args=entry_args, nprocs=nproc, join=False,
                                       start_method="spawn").processes
            ended = _watch(procs, echoer)
        except BaseException:  # Ctrl+C or the notebook's stop button: do not leave processes behind
            _stop(procs)
            raise
        finally:
            del server
        echoer.poll()
        if any(code != 0 for code in ended.values()):
            raise _failure(ended, run_dir, log_paths, offsets)
        result = Path(run_dir) / "result.pt"
        if not result.exists():
            raise WorkerFailed(tr("Rank 0 finished without a result; end of its log:\n",
                                  "ランク 0 は結果を返さずに終了しました。ログの末尾:\n") + _tail(log_paths[0], offsets[0]))
        return torch.load(result, weights_only=False)


def _watch(procs, echoer, grace=2.0):
    """Wait for the ranks; when one fails, give the others ``grace`` seconds to end, then stop them.

    Returns ``{rank: exit code}`` of the ranks that ended by themselves, in the order they ended: the stopped ones
    are left out, since their end is not their failure.
    """
    import multiprocessing.connection

    ended, deadline = {}, None
    while len(ended) < len(procs):
        if deadline is None and any(code != 0 for code in ended.values()):
            deadline = time.monotonic() + grace  # a rank failed: its partners usually notice and end soon
        if deadline is not None and time.monotonic() > deadline:
            break
        multiprocessing.connection.wait([p.sentinel for r, p in enumerate(procs) if r not in ended], timeout=0.2)
        for r, p in enumerate(procs):
            if r not in ended and p.exitcode is not None:
                ended[r] = p.exitcode
        echoer.poll()
    _stop(procs)
    return ended


def _failure(ended, run_dir, log_paths, offsets):
    """The error for a failed run: the rank that failed first, how, and the end of its log."""
    records = {r: json.loads(Path(run_dir, f"error{r}.json").read_text(encoding="utf-8"))
               for r in ended if Path(run_dir, f"error{r}.json").exists()}
    failed = [r for r, code in ended.items() if code != 0]
    signalled = [r for r in failed if ended[r] < 0 and r not in records]  # a signal kills at once: it is the cause
    first = signalled[0] if signalled else min(failed, key=lambda r: records[r]["time"] if r in records else 1e300)
    rec, code = records.get(first), ended[first]
    if rec is not None and rec["module"] == "mparlib.errors":  # a clear message from the course: give it as it is
        import mparlib.errors as errors

        cls = getattr(errors, rec["type"], None)
        if isinstance(cls, type) and issubclass(cls, MparlibError) and cls not in (WorkerFailed,):
            try:
                return cls(rec["message"])
            except TypeError:  # a class with a different constructor: fall through to WorkerFailed
                pass
    if code < 0:
        how = tr(f"rank {first} was killed by signal {signal.Signals(-code).name}",
                 f"ランク {first} がシグナル {signal.Signals(-code).name} で強制終了されました")
    elif rec is not None:
        how = tr(f"rank {first} failed with {rec['type']}: {rec['message']}",
                 f"ランク {first} で {rec['type']} が発生しました: {rec['message']}")
    else:
        how = tr(f"rank {first} exited with code {code}", f"ランク {first} が終了コード {code} で終了しました")
    return WorkerFailed(tr(f"{how}; the other processes were stopped. End of rank {first}'s log:\n",
                           f"{how}。他のプロセスは停止しました。ランク {first} のログの末尾:\n")
                        + _tail(log_paths[first], offsets[first]), rank=first, cause=how)


def _tail(path, offset=0, lines=25):
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return tr("(no log)", "（ログがありません）")
    return "\n".join(text.rstrip().splitlines()[-lines:]) or tr(
        "(its log is empty: it printed nothing before it ended)",
        "（ログは空です。終了するまでに何も出力しませんでした）")


def _stop(processes, grace=5.0):
    """Terminate processes still running (SIGTERM, then SIGKILL after ``grace`` seconds) and reap them all."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in processes:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()


def load_ipython_extension(ipython):
    """``%load_ext mparlib.launch``: the ``%%worker NAME`` cell magic (see :mod:`mparlib.workers`). Explained in 06_ddp."""
    from .workers import register_magic

    register_magic(ipython)
