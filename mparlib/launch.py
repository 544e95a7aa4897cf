"""Starting N cooperating processes from Python or a notebook, and getting rank 0's result back.

:func:`launch` does torchrun's job from Python. It stands on PyTorch's own tools: ``torch.multiprocessing``
starts the processes, waits for them and stops them all at the first failure, and the launcher hosts the rendezvous
``TCPStore`` that the ranks meet at, as torchrun's agent does. The ranks leave their result or their error as files in
a folder that only this user can open (``mkdtemp``, mode 0700), never in the store: the store has no authentication,
so anything another local process could write there is never unpickled here, and results of any size come back. A notebook
writes its own worker module with the ``%%worker`` cell magic (:mod:`mparlib.workers`). Explained in 06_ddp.
"""
import contextlib
import contextvars
import ctypes
import errno
import functools
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import forkserver
from pathlib import Path

try:
    import resource
except ImportError:  # Windows
    resource = None

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from .checks import positive_int, seconds
from .errors import ConfigError, LaunchError, MparlibError, WorkerFailed
from .lang import tr
from .progress import in_kernel
from .rendezvous import check_port, choose_backend, interface_of, listening_store, process_group
from .workers import register_magic

# Files in the run's private folder: rank 0's result; a rank's error: error{r}; a rank whose function returned: done{r}.
RESULT, ERROR, DONE = "result", "error", "done"


@dataclass(frozen=True)
class _Run:
    """What every rank of one launch receives: the worker's call, and how to meet the others."""
    call: functools.partial  # the worker with its arguments
    nproc: int
    host: str
    port: int
    backend: str
    threads: int
    timeout: float | None  # seconds a collective may wait
    logs: tuple  # the log file of each rank
    parent: int  # the launcher's pid
    interface: str | None  # the network interface holding ``host``, for gloo's connections between the ranks
    limit: float | None  # seconds the whole run may take
    box: str  # the run's private folder (0700): results, errors and "done" marks, written by the ranks alone
    env: dict  # the launcher's environment at this call (a forked rank starts from the fork server's)


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
        f"The worker {name!r} is defined {where}, so the new processes cannot find it. A new process starts without this "
        "kernel's variables: it receives the function as 'module name + function name' (pickle) and imports it, and "
        "a notebook's __main__ exists only in this kernel. In a notebook, run `%load_ext mparlib.launch` once and "
        "start the worker's cell with `%%worker my_workers`; then `from my_workers import worker` and launch that. "
        "In a script, put the worker in a module of its own.",
        f"ワーカー関数 {name!r} は{where}で定義されているため、新しいプロセスからは見つけられません。新しいプロセスは"
        "このカーネルの変数を持たずに始まり、関数を「モジュール名 + 関数名」として受け取り（pickle）、インポート"
        "します。ノートブックの __main__ はこのカーネルの中にしかありません。ノートブックでは `%load_ext mparlib.launch` "
        "を一度実行し、ワーカーのセルを `%%worker my_workers` で始めてから、`from my_workers import worker` で"
        "インポートしたものを launch に渡してください。スクリプトでは、ワーカーを専用のモジュールに書きます。"))


def _listening_store(host, port, nproc):
    """The rendezvous server on ``host`` alone (:func:`~mparlib.rendezvous.listening_store`), with a clear error
    when the process has run out of file descriptors."""
    _check_files()
    try:
        return listening_store(host, port, nproc)
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise _too_few_files(e.strerror) from None
        raise


FILES_NEEDED = 64  # open files (sockets, pipes, logs) the launcher and each rank may need at once, with room to spare


def _too_few_files(why):
    return LaunchError(tr(
        f"Too few open files are allowed to start the processes ({why}): the launcher and every rank need several "
        "sockets, pipes and log files. Close what holds them (a loop that opens files without closing them), "
        "restart the kernel, or raise the limit (`ulimit -n 4096` in the shell that starts Jupyter or Python).",
        f"プロセスを起動するのに、同時に開けるファイルの数が足りません（{why}）。ランチャーと各ランクは、ソケット、"
        "パイプ、ログファイルをいくつも必要とします。ファイルを開いたままにしているもの（閉じずに開き続けるループなど）"
        "を閉じるか、カーネルを再起動するか、上限を上げてください（Jupyter や Python を起動するシェルで "
        "`ulimit -n 4096`）。"))


def _check_files():
    """Refuse to start when the open-file limit leaves too little room: the ranks would fail with unclear errors."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if resource else -1
    if soft < 0:  # unlimited, or not known here
        return
    used = psutil.Process().num_fds() if hasattr(psutil.Process, "num_fds") else 0
    if soft - used < FILES_NEEDED:
        raise _too_few_files(tr(f"limit {soft}, {used} open already", f"上限 {soft}、すでに {used}個が開いています"))


def _check_logs(paths):
    """Refuse log files that would send a rank's output somewhere else: links, special files, other users' files."""
    for path in paths:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode) or info.st_nlink > 1 \
                or info.st_uid != os.geteuid():
            raise LaunchError(tr(
                f"{path} is not a log file of this launcher (a link, a special file, a file with several names, or "
                "another user's file): the ranks' output would be appended to whatever it points at. It was left as "
                "it is; remove it, or choose another log_dir.",
                f"{path} はこのランチャーのログファイルではありません（リンク、特殊なファイル、複数の名前を持つファイル、"
                "または別のユーザーのファイル）。ランクの出力がその指す先に追記されてしまいます。そのままにしてあるので、"
                "削除するか、別の log_dir を指定してください。"))


class _Discard:
    """A file that forgets what is written to it: pickling into it only checks that pickling works."""

    def write(self, data):
        return len(data)


def _save(box, name, value):
    """Write ``value`` pickled as ``box/name``, whole or not at all (a temporary file, then ``os.replace``)."""
    path = Path(box) / name
    tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with open(fd, "wb") as f:
            pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _load(box, name):
    """What a rank saved as ``box/name`` (:func:`_save`), or None when it saved nothing."""
    path = Path(box) / name
    if not path.exists():
        return None
    with open(os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)), "rb") as f:
        return pickle.load(f)


def _save_result(box, result):
    """Save rank 0's result for the launcher, or raise a course error saying why it cannot travel back."""
    try:
        _save(box, RESULT, result)
    except OSError as e:  # the disk is full, or the folder is gone: not the result's fault
        raise LaunchError(tr(
            f"Rank 0's return value could not be written for the launcher ({e.strerror}): free space in "
            f"{tempfile.gettempdir()} (the system's temporary folder) or return a smaller result.",
            f"ランク 0 の戻り値をランチャーのために書き出せませんでした（{e.strerror}）。システムの一時フォルダー "
            f"{tempfile.gettempdir()} の空きを増やすか、より小さな結果を返してください。")) from None
    except Exception as e:  # noqa: BLE001 - pickle fails in many ways (PicklingError, TypeError, AttributeError...)
        raise LaunchError(tr(
            f"Rank 0's return value (a {type(result).__name__}) cannot be sent back to the launcher: {e}. A result "
            "travels by pickle, so return plain data: tensors, numbers, strings, and lists, tuples and dicts of "
            "them (not lambdas, local functions, open files, locks or generators).",
            f"ランク 0 の戻り値（{type(result).__name__}）をランチャーに送り返せません: {e}。結果は pickle で運ぶ"
            "ので、テンソル、数値、文字列と、それらのリスト、タプル、dict のような素のデータを返してください（lambda、"
            "ローカル関数、開いたファイル、ロック、ジェネレーターは運べません）。")) from None


def _check_picklable(fn, args, kwargs):
    """Each new process receives ``fn`` and its arguments by pickle: name the one that cannot travel, and why.

    Called when starting the processes failed; plain pickle stands in for the spawn pickler here. What only a
    process start may carry (a ``multiprocessing`` queue: plain pickle raises ``RuntimeError``) is never blamed.
    """
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        pickle.Pickler(_Discard()).dump(fn)
    except Exception as e:  # noqa: BLE001
        module = getattr(fn, "__module__", "my_workers")
        raise LaunchError(tr(
            f"The worker {name!r} cannot be sent to the new processes ({e}). If its %%worker cell was run again "
            f"after you imported it, import it again (from {module} import {name}) and launch the new version.",
            f"ワーカー関数 {name!r} を新しいプロセスに送れません（{e}）。インポートした後にその %%worker セルを"
            f"もう一度実行したなら、もう一度インポートして（from {module} import {name}）新しい版を launch に渡して"
            "ください。")) from None
    named = [(f"args[{i}]", a) for i, a in enumerate(args)] + [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
    for where, value in named:
        try:
            pickle.Pickler(_Discard()).dump(value)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise ConfigError(tr(
                f"launch: {where} (a {type(value).__name__}) cannot be sent to the new processes: {e}. Arguments "
                "travel by pickle: pass plain data (tensors, numbers, strings, lists and dicts of them) or functions "
                "defined at the top of a module (a %%worker cell), not lambdas, local functions or open files.",
                f"launch: {where}（{type(value).__name__}）を新しいプロセスに送れません: {e}。引数は pickle で運ぶので、"
                "素のデータ（テンソル、数値、文字列と、それらのリストや dict）か、モジュールの最上位で定義した関数"
                "（%%worker セル）を渡してください。lambda、ローカル関数、開いたファイルは運べません。")) from None


def _descendants(pids):
    """``{pid: psutil.Process}`` of every living descendant of the processes ``pids``."""
    found = {}
    for pid in pids:
        try:
            found.update((c.pid, c) for c in psutil.Process(pid).children(recursive=True))
        except psutil.Error:  # ended meanwhile
            pass
    return found


def _end_all(processes):
    """Kill ``processes`` (psutil handles: a pid reused since is never touched) and wait for them briefly."""
    alive = []
    for proc in processes:
        try:
            proc.kill()
            alive.append(proc)
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def _launched_by(launcher):
    """Whether this rank still hangs from ``launcher``: its parent (spawn), or the fork server that forked it, whose
    parent is the launcher. A rank whose fork server has died is adopted by the launcher (a subreaper while it runs)."""
    parent = os.getppid()
    if parent == launcher:
        return True
    try:
        return psutil.Process(parent).ppid() == launcher
    except psutil.Error:
        return False


def _forget_fork_server():
    """Drop the fork server of the process this one was forked from, and close this copy of the pipe that keeps
    that server running; a launch from here then starts a server of its own.

    Runs in every copy made by ``os.fork`` (an exercise check, a ``DataLoader`` worker), and in each rank once
    ``multiprocessing`` has handed it that pipe. The server runs until every holder of the pipe's writing end has
    closed it: a rank that kept its copy would keep the server alive after the launcher died, and the server's
    death is what ends the ranks (their ``PR_SET_PDEATHSIG``). With it closed, a killed launcher takes the server
    with it, and the server its ranks."""
    server = forkserver._forkserver
    alive = server._forkserver_alive_fd
    server.__init__()  # no server, no address, a fresh lock
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_fork_server)


_FORK_HERE = contextvars.ContextVar("mparlib_fork_here", default=False)


@contextlib.contextmanager
def _forking_here():
    """Within this block, a launch from this process forks its ranks from it directly: for a process that is itself a
    fresh copy of a fork server, has one thread and has not computed yet (an exercise's worker starting the ranks of
    a check), where starting a fork server of its own would cost seconds for the same clean state. Only on Linux and
    while the process has one thread (:func:`_start_method` decides at each launch)."""
    token = _FORK_HERE.set(True)
    try:
        yield
    finally:
        _FORK_HERE.reset(token)


def _start_method():
    """``forkserver`` where the platform has it, else ``spawn``: see :func:`launch` (``fork`` within
    :func:`_forking_here`).

    The fork server is one process per launcher (a notebook's kernel), started at its first launch: a fresh
    interpreter that imports PyTorch, ``torch._dynamo`` and this module once and then forks a rank per request. A
    rank is then as clean as a spawned one (nothing of the launcher's state, CUDA never touched before it), without
    paying for ``import torch`` again on every launch, nor for ``torch._dynamo``, which DDP, FSDP and DTensor import
    on first use (1.1-1.3 s and 150 MB of memory a process on a 2-core machine here; the import starts no thread).
    It ends with the launcher, and is replaced when a variable read at import has changed since it started (see
    ``_SERVER_ENVIRONMENT``)."""
    if _FORK_HERE.get() and sys.platform == "linux" and threading.active_count() == 1:
        return "fork"
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    server, environment = forkserver._forkserver, _read_at_import()
    if server._forkserver_pid is not None and _SERVER_ENVIRONMENT.get(server._forkserver_pid) != environment:
        _stop_fork_server()  # see _SERVER_ENVIRONMENT
    multiprocessing.set_forkserver_preload([__name__, "torch._dynamo"])
    forkserver.ensure_running()
    _SERVER_ENVIRONMENT.clear()
    _SERVER_ENVIRONMENT[server._forkserver_pid] = environment
    return "forkserver"


# The variables read at import that the fork server was started with, by its pid. A rank sets the launch's whole
# environment when it starts (``_Run.env``), but PyTorch and the libraries it loads read some variables once, at
# import, in the server (TORCH_DISTRIBUTED_DEBUG, TORCH_LOGS, OMP_*, ...): a launch made with other values of
# those than the server's replaces the server, so that each rank sees the environment of the launch that started
# it, as a spawned one does.
_SERVER_ENVIRONMENT = {}
_AT_IMPORT = ("TORCH", "PYTORCH", "OMP_", "KMP_", "MKL_", "GLOO_", "NCCL_", "CUDA", "LD_", "PYTHON", "TRITON")


def _read_at_import():
    """The variables of this process's environment that PyTorch and its libraries may read at import."""
    return {k: v for k, v in os.environ.items() if k.startswith(_AT_IMPORT)}


def _stop_fork_server():
    """End the fork server (it exits when its pipe closes) and forget it; the next launch starts another."""
    server = forkserver._forkserver
    try:
        server._stop()
    except ChildProcessError:  # it had ended and was reaped by other code of this process
        _forget_fork_server()


def _entry(rank, run):
    """Body of each spawned process: tie it to the launcher, log to a file, join the group, make ``run.call``."""
    code = 1
    try:
        if sys.platform == "linux":  # the kernel sends SIGKILL to this process the moment the launcher dies
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (torch sets SIGINT, which may go unheard)
            ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: the rank's orphaned descendants stay its own
        if not _launched_by(run.parent):  # the launcher died before that took effect
            os._exit(1)
        _forget_fork_server()  # forked by the fork server: let it end with the launcher
        os.environ.clear()
        os.environ.update(run.env)
        torch.seed()  # a forked rank would share the fork server's generator state: seed it anew, as a fresh process
        if "numpy.random" in sys.modules:  # is seeded (Python's random module reseeds itself in a forked child)
            sys.modules["numpy.random"].seed()
        fd = os.open(run.logs[rank], os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        log = open(fd, "a", buffering=1, encoding="utf-8")
        os.dup2(log.fileno(), 1)  # the process's prints (and C++ warnings) go to its log, not to the notebook
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = log
        torch.set_num_threads(run.threads)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(run.nproc), MASTER_ADDR=run.host,
                          LOCAL_WORLD_SIZE=str(run.nproc), MASTER_PORT=str(run.port), OMP_NUM_THREADS=str(run.threads))
        if run.interface and "GLOO_SOCKET_IFNAME" not in os.environ:  # gloo listens there too, not on every interface
            os.environ["GLOO_SOCKET_IFNAME"] = run.interface
        # The launcher hosts the rendezvous server; every rank is a client, as under torchrun's agent.
        store = dist.TCPStore(run.host, run.port, run.nproc, is_master=False, timeout=timedelta(seconds=120))
        try:
            with process_group(run.backend, timeout=run.timeout, store=store):
                # Every rank has joined before any worker can end: a rank still joining would see the links of a
                # rank that ended close under it ("Connection closed by peer").
                dist.barrier(**({"device_ids": [torch.cuda.current_device()]} if run.backend == "nccl" else {}))
                try:
                    result = run.call()
                    if rank == 0:
                        _save_result(run.box, result)
                    _save(run.box, f"{DONE}{rank}", True)
                except BaseException as e:  # recorded before leaving the group wakes the others with errors
                    _record(run.box, rank, e)
                    raise
        except BaseException as e:  # failed to join (or to leave): recorded after any rank that failed before it
            with contextlib.suppress(Exception):  # a folder that is gone leaves the exit code to tell
                if not (Path(run.box) / f"{ERROR}{rank}").exists():
                    _record(run.box, rank, e)
            raise
        code = 0
    except BaseException as e:
        print(f"error: {e}" if isinstance(e, MparlibError) else traceback.format_exc(), flush=True)
    finally:  # the work is saved and the group left: skip the interpreter's teardown of torch's C++ threads (torch's
        sys.stdout.flush()  # wrapper then sees an exit code, never an exception: the rank's record is in the store)
        _end_all(_descendants([os.getpid()]).values())  # processes the worker started end with it
        os._exit(code)


def launch(fn, nproc, args=(), kwargs=None, *, backend="auto", port=None, host="127.0.0.1", threads=None,
           log_dir=None, echo=True, show=None, timeout=None, limit=None):
    """Run ``fn(*args, **kwargs)`` in ``nproc`` new local processes and return rank 0's result. Explained in 06_ddp.

    Each process starts clean: it is forked from a fork server that has imported PyTorch and nothing of the caller's
    state (:func:`_start_method`; ``spawn`` where the platform has no fork server), has the caller's environment,
    module path and working folder as they are at this call, gets the variables torchrun would set (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``...), joins the process group and calls ``fn``, which must be
    importable (in a notebook: a ``%%worker`` cell). ``backend="auto"`` takes nccl when there is a GPU per process, else gloo on the
    CPU (:func:`~mparlib.rendezvous.describe` says which). Rank 0's output is echoed here as it comes (``echo``);
    each rank appends to ``log_dir/rank{r}.log`` (a temporary folder by default). ``show`` names a PNG that rank 0
    rewrites (an :class:`~mparlib.plot.Animator` file): in Jupyter it is shown and updated in the cell. ``port=None``
    (or 0) lets the system choose the rendezvous port. ``threads`` per process defaults to the CPU cores shared out.
    ``timeout`` (seconds) bounds how long one collective waits for the other ranks; ``limit`` (seconds) bounds the
    whole run, which is stopped (every rank) when it takes longer. If a process fails, all are stopped; an error raised by
    the course in a worker comes back as the same class and message, anything else as :class:`WorkerFailed` naming
    the rank and showing the end of its log. The processes never outlive this call, nor the process that made it.
    """
    _check_importable(fn)
    nproc = positive_int(nproc, "nproc", 2, "launch")
    if not isinstance(args, (tuple, list)) or not isinstance(kwargs, (dict, type(None))):
        raise ConfigError(tr(f"args={args!r}, kwargs={kwargs!r}: pass the worker's positional arguments as a tuple "
                             "and its keyword arguments as a dict, e.g. args=(x, y), kwargs={'lr': 0.1}.",
                             f"args={args!r}, kwargs={kwargs!r}: ワーカーの位置引数はタプルで、キーワード引数は dict で"
                             "渡してください（例: args=(x, y), kwargs={'lr': 0.1}）。"))
    backend, timeout = choose_backend(backend, nproc), seconds(timeout, "timeout", "launch")
    limit = seconds(limit, "limit", "launch")
    if threads is not None:
        threads = positive_int(threads, "threads", 1, "launch")
    cores = os.cpu_count() or 1
    most = max(8, 4 * cores)
    if backend == "gloo" and nproc > most:
        raise ConfigError(tr(
            f"{nproc} processes on {cores} CPU core(s) is more than this machine can run well: every process holds "
            f"its own Python, PyTorch and model (about 1 GB each), and they share the cores. Use at most {most} "
            "(4 per core), or a machine with GPUs for more ranks.",
            f"CPU コア {cores}個で {nproc}個のプロセスは、このマシンでは多すぎます。各プロセスが Python、PyTorch、モデルを"
            f"それぞれ持ち（1個あたり約 1 GB）、コアを取り合います。プロセスは {most}個（コアあたり 4個）以下にするか、"
            "より多くのランクには GPU のあるマシンを使ってください。"))
    if port not in (None, 0):
        check_port(port, host)
    # The server lives here, so no rank has to win a race for the port.
    server = _listening_store(host, port or 0, nproc)
    try:
        with tempfile.TemporaryDirectory(prefix="mparlib-launch-") as tmp, \
                tempfile.TemporaryDirectory(prefix="mparlib-results-") as box:  # 0700: this user's processes alone
            logs = Path(tmp if log_dir is None else log_dir)
            logs.mkdir(parents=True, exist_ok=True)
            _check_logs([logs / f"rank{r}.log" for r in range(nproc)])
            run = _Run(functools.partial(fn, *args, **(kwargs or {})), nproc, host, server.port, backend,
                       threads or (1 if backend == "nccl" else max(1, cores // nproc)), timeout,
                       tuple(str(logs / f"rank{r}.log") for r in range(nproc)), os.getpid(), interface_of(host), limit,
                       box, dict(os.environ))
            return _supervise(run, server, echo, show)
    finally:
        del server  # the frames of an exception must not keep the port open


def _subreaper(on):
    """Make this process the one that adopts the orphans of its descendants (``on``), or stop; returns the old state.

    While a run lasts, a process that a rank started and left behind (the rank killed, or its parent ended) becomes a
    child of the launcher instead of init's, so that the launcher still finds it at the end, however late it was
    started. Linux only (``PR_SET_CHILD_SUBREAPER``); elsewhere this does nothing and returns None.
    """
    if sys.platform != "linux":
        return None
    libc, state = ctypes.CDLL(None), ctypes.c_int(0)
    libc.prctl(37, ctypes.byref(state))  # PR_GET_CHILD_SUBREAPER
    libc.prctl(36, 1 if on else 0)  # PR_SET_CHILD_SUBREAPER
    return bool(state.value)


def _end_adopted(known):
    """End and reap every child of this process that is not in ``known`` (its children from before the run, and the
    ranks) nor multiprocessing's resource tracker: the processes the ranks left behind, adopted by
    :func:`_subreaper`. Repeated until none is left, since one may start another while it is being ended."""
    from multiprocessing import resource_tracker

    me = psutil.Process()
    known = known | {getattr(resource_tracker._resource_tracker, "_pid", None)}
    for _ in range(20):
        adopted = [child for child in me.children() if child.pid not in known]
        if not adopted:
            return
        everyone = {p.pid: p for p in adopted} | _descendants([p.pid for p in adopted])
        _end_all(everyone.values())


def _stop(processes):
    """End every rank at once and reap it."""
    for p in processes:
        p.kill()
        p.join()


def _supervise(run, server, echo, show):
    """Start the ranks, echo rank 0's log while torch's ``join`` waits for them, and return rank 0's result.

    At the first failure ``join`` gives the other ranks 2 s to end by themselves, then stops them. A run that goes
    past ``run.limit`` seconds is stopped at once.
    """
    offsets = [os.path.getsize(p) if os.path.exists(p) else 0 for p in run.logs]  # logs are appended to, never erased
    echoer = _LogEcho(run.logs[0] if echo else None, offsets[0], show)
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)  # torch's "Terminating process ..." (in English): our error says so
    was_subreaper = _subreaper(True)
    start_method = _start_method()
    known = {c.pid for c in psutil.Process().children()}  # this process's own children (the fork server among them)
    ranks = set()
    try:
        try:
            ctx = mp.start_processes(_entry, args=(run,), nprocs=run.nproc, join=False,
                                     start_method=start_method)
        except (pickle.PicklingError, AttributeError, TypeError):  # the call cannot travel: name what and why
            _check_picklable(run.call.func, run.call.args, run.call.keywords)
            raise
        end = None if run.limit is None else time.monotonic() + run.limit
        started = {}  # processes the ranks started (seen while the ranks live), ended with the run
        try:
            while not ctx.join(timeout=0.2, grace_period=2.0):
                echoer.poll()
                started.update(_descendants([p.pid for p in ctx.processes if p.is_alive()]))
                if end is not None and time.monotonic() > end:
                    _stop(ctx.processes)
                    echoer.poll()
                    raise _over_limit(run, offsets)
        except ProcessException as e:
            echoer.poll()
            raise _failure(ctx.processes, e.error_index, server, run, offsets) from None
        except BaseException:  # Ctrl+C, the notebook's stop button, the limit: do not leave processes behind
            _stop(ctx.processes)
            raise
        finally:
            _end_all(started.values())
            ranks.update(p.pid for p in ctx.processes)
        echoer.poll()
        if not (Path(run.box) / RESULT).exists():
            raise WorkerFailed(tr("Rank 0 finished without a result; end of its log:\n",
                                  "ランク 0 は結果を返さずに終了しました。ログの末尾:\n") + _tail(run.logs[0], offsets[0]))
        return _load(run.box, RESULT)
    finally:
        spawn_log.setLevel(level)
        if was_subreaper is not None:
            _end_adopted(known | ranks)
            _subreaper(was_subreaper)
        del server  # the frames of an exception must not keep the port open


def _over_limit(run, offsets):
    how = tr(f"the run took longer than limit={run.limit:g} s", f"実行が limit={run.limit:g}秒を超えました")
    return WorkerFailed(tr(
        f"{how}, so every rank was stopped. (limit bounds the whole run; timeout bounds how long one collective "
        "waits.) Give a larger limit, or look for a rank that never finishes. End of rank 0's log:\n",
        f"{how}。そのため、すべてのランクを停止しました（limit は実行全体の、timeout は 1回の集合通信が待つ時間の"
        "上限です）。limit を大きくするか、終わらないランクを探してください。ランク 0 のログの末尾:\n")
        + _tail(run.logs[0], offsets[0]), cause=how, limit=run.limit)


def _record(box, rank, error):
    """Note in the run's folder how ``rank`` failed: (when, "Type: message", the course error or None). ``when`` is
    the system's monotonic clock, which all processes of this machine share: it orders the failures."""
    course = error if isinstance(error, MparlibError) and not isinstance(error, WorkerFailed) else None
    summary = f"sys.exit({error.code!r})" if isinstance(error, SystemExit) else f"{type(error).__name__}: {error}"
    try:
        _save(box, f"{ERROR}{rank}", (time.monotonic_ns(), summary, course))
    except Exception:  # noqa: BLE001 - a course error that cannot be pickled still leaves its summary
        _save(box, f"{ERROR}{rank}", (time.monotonic_ns(), summary, None))


def _failure(processes, seen, server, run, offsets):
    """The error for a failed run: the course error that the rank that failed first raised, as it is; else
    :class:`WorkerFailed` naming that rank, how it failed, and the end of its log. ``seen``: the rank torch saw fail."""
    records = {r: record for r in range(run.nproc)  # (when, "Type: message", course error or None)
               if (record := _load(run.box, f"{ERROR}{r}")) is not None}
    codes = [p.exitcode for p in processes]
    # A rank that ended without a record and before its function returned was ended at once (a signal, os._exit,
    # even with code 0): nothing can have failed before it. SIGTERM is how torch stopped the others.
    silent = [r for r, code in enumerate(codes) if code is not None and code != -signal.SIGTERM
              and r not in records and not (Path(run.box) / f"{DONE}{r}").exists()]
    first = silent[0] if silent else min(records, key=lambda r: records[r][0], default=seen)
    _, summary, course = records.get(first, (None, None, None))
    if course is not None:  # a clear message from the course: give it as it is
        return course
    return WorkerFailed(tr(f"{_how(first, summary, codes[first])}; the other processes were stopped. End of rank "
                           f"{first}'s log:\n",
                           f"{_how(first, summary, codes[first])}。他のプロセスは停止しました。ランク {first} のログの"
                           "末尾:\n")
                        + _tail(run.logs[first], offsets[first]), rank=first, cause=_how(first, summary, codes[first]))


def _how(rank, summary, code):
    """One line saying how ``rank`` ended: its error, its ``sys.exit``, its exit code or the signal that killed it."""
    early = tr("before its function returned: a worker ends by returning its result (or raising an error), never by "
               "ending its process", "関数が戻る前です。ワーカーは結果を返す（またはエラーを送出する）ことで終わり、"
               "プロセスを終了させてはいけません")
    if summary and summary.startswith("sys.exit("):
        return tr(f"rank {rank} called {summary} {early}", f"ランク {rank} が {summary} を呼びました。{early}")
    if summary:
        return tr(f"rank {rank} failed with {summary}", f"ランク {rank} で {summary} が発生しました")
    if code == 0:
        return tr(f"rank {rank} ended with exit code 0 {early} (os._exit?)",
                  f"ランク {rank} が終了コード 0 で終了しました。{early}（os._exit？）")
    if code is not None and code > 0:
        return tr(f"rank {rank} exited with code {code}", f"ランク {rank} が終了コード {code} で終了しました")
    name = signal.Signals(-code).name if code is not None else "?"
    return tr(f"rank {rank} was killed by signal {name}", f"ランク {rank} がシグナル {name} で強制終了されました")


def _tail(path, offset=0, lines=25):
    """The last ``lines`` lines of a rank's log, from ``offset`` on."""
    text = Path(path).read_bytes()[offset:].decode("utf-8", errors="replace") if os.path.exists(path) else ""
    return "\n".join(text.rstrip().splitlines()[-lines:]) or tr(
        "(its log is empty: it printed nothing before it ended)",
        "（ログは空です。終了するまでに何も出力しませんでした）")


class _LogEcho:
    """Print new lines of rank 0's log here, and (in Jupyter) show rank 0's PNG each time it changes."""

    def __init__(self, log_path, offset, png_path):
        self.log_path, self.png_path = log_path, Path(png_path) if png_path else None
        self.offset, self.png_stamp, self.handle, self.kernel = offset, None, None, in_kernel()

    def poll(self):
        """Echo whole lines written since the last call; refresh the figure if its file changed."""
        if self.log_path is not None and os.path.exists(self.log_path):
            with open(self.log_path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
            cut = data.rfind(b"\n") + 1  # whole lines only
            if cut:
                self.offset += cut
                print(data[:cut].decode("utf-8", errors="replace"), end="", flush=True)
        if self.kernel and self.png_path is not None and self.png_path.exists() \
                and self.png_path.stat().st_mtime_ns != self.png_stamp:
            from IPython.display import Image, display

            self.png_stamp = self.png_path.stat().st_mtime_ns
            image = Image(data=self.png_path.read_bytes())
            if self.handle is None:
                self.handle = display(image, display_id=True)
            else:
                self.handle.update(image)


def load_ipython_extension(ipython):
    """``%load_ext mparlib.launch``: the ``%%worker NAME`` cell magic (see :mod:`mparlib.workers`). Explained in 06_ddp."""
    register_magic(ipython)
