"""Starting N cooperating processes: the rendezvous, the process group, and a launcher for notebooks.

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` and starts one process per device;
:func:`process_group` joins those processes into a group (nccl on GPUs, gloo on CPUs) and always leaves it again.
:func:`launch` does torchrun's job from Python, so that a notebook can run a worker function in N local processes
and get rank 0's result back. Explained in 06_ddp.
"""
import contextlib
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from .devices import num_gpus
from .lang import tr

RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DDPError(RuntimeError):
    """A distributed run cannot start or continue; the message says why and how to fix it. Explained in 06_ddp."""


# ---------------------------------------------------------------------------------------------------------------
# Backend, ports and the rendezvous variables
# ---------------------------------------------------------------------------------------------------------------

def choose_backend(backend="auto"):
    """``"nccl"`` when CUDA GPUs exist, ``"gloo"`` otherwise; an explicit choice is checked. Explained in 06_ddp."""
    if backend == "auto":
        return "nccl" if num_gpus() > 0 and dist.is_nccl_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise DDPError(tr(f"backend={backend!r} is not supported here: use 'auto', 'gloo' (CPU) or 'nccl' (GPUs).",
                          f"backend={backend!r} には対応していません。'auto'、'gloo'（CPU）、'nccl'（GPU）のいずれかを"
                          "指定してください。"))
    if backend == "nccl" and num_gpus() == 0:
        raise DDPError(tr("The nccl backend needs CUDA GPUs and PyTorch sees none on this machine: "
                          "use backend 'gloo' (or 'auto', which picks gloo here).",
                          "nccl バックエンドには CUDA の GPU が必要ですが、このマシンでは PyTorch から GPU が見えません。"
                          "バックエンドに 'gloo'（または、ここでは gloo を選ぶ 'auto'）を指定してください。"))
    return backend


def check_gpus(backend, nproc):
    """With nccl every process of this machine needs its own GPU: raise if ``nproc`` exceeds them. Explained in 06_ddp."""
    if backend == "nccl" and nproc > num_gpus():
        choose_backend("nccl")  # no GPU at all: that message
        n = num_gpus()
        raise DDPError(tr(f"{nproc} processes were asked for on this machine, but it has {n} GPU(s) and the nccl "
                          f"backend needs one GPU per process. Use at most {n} processes (--nproc {n} or torchrun "
                          f"--nproc_per_node={n}), or the gloo backend to run the processes on the CPU.",
                          f"このマシンで {nproc}個のプロセスが指定されましたが、GPU は {n}枚しかありません。nccl "
                          f"バックエンドでは 1個のプロセスに 1枚の GPU が必要です。プロセスを {n}個以下にする（--nproc {n} "
                          f"または torchrun --nproc_per_node={n}）か、gloo バックエンドで CPU 上のプロセスとして動かして"
                          "ください。"))


def free_port(host="127.0.0.1"):
    """A TCP port that is free right now, found by letting the system choose one (bind to port 0). Explained in 06_ddp."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(port, host="127.0.0.1"):
    """Raise a clear error if rank 0 could not listen on ``host:port`` (bind test). Explained in 06_ddp."""
    if not (isinstance(port, int) and 0 < port < 65536):
        raise DDPError(tr(f"MASTER_PORT={port!r} is not a TCP port: use a number between 1024 and 65535, e.g. 29500.",
                          f"MASTER_PORT={port!r} は TCP ポートではありません。1024 から 65535 までの数（例: 29500）を"
                          "指定してください。"))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is usable; a listening one is not
        try:
            s.bind((host, port))
        except OSError as e:
            other = free_port(host)
            raise DDPError(tr(
                f"Port {port} on {host} is already in use ({e.strerror}): another training run or program listens "
                f"there, and rank 0 must open its rendezvous server on it. Pick another port, e.g. --port {other} "
                f"(free right now; MASTER_PORT={other} in the environment works too), or --port 0 to let the "
                "launcher choose a free one. `ss -ltnp` shows which program holds a port.",
                f"{host} のポート {port} はすでに使われています（{e.strerror}）。別の訓練やプログラムがそこで待ち受けて"
                f"いますが、ランク 0 はこのポートでランデブーのサーバーを開く必要があります。別のポートを選んでください。"
                f"例えば --port {other}（今は空いています。環境変数 MASTER_PORT={other} でも指定できます）、または "
                "--port 0 で空いているポートを自動で選ばせます。どのプログラムがポートを使っているかは `ss -ltnp` で"
                "わかります。")) from None


def rendezvous_env(environ=None):
    """Read the variables torchrun sets for each process (rank, world size, master address and port). Explained in 06_ddp.

    Without them a process cannot know who it is or where to meet the others, so this raises an error that says
    how to start the program instead.
    """
    env = os.environ if environ is None else environ
    missing = [k for k in RENDEZVOUS_VARS if not env.get(k)]
    if missing:
        raise DDPError(tr(
            f"The rendezvous variables {', '.join(missing)} are not set, so this process does not know its rank or "
            "where to meet the others. Start it with torchrun, which sets them for every process:\n"
            "    torchrun --nproc_per_node=2 -m mparlib.ddp [options]\n"
            "or let mparlib start the processes itself:\n"
            "    python -m mparlib.ddp --nproc 2 [options]      (from Python: mparlib.ddp.launch(fn, 2, ...))",
            f"ランデブーの環境変数 {', '.join(missing)} が設定されていないため、このプロセスは自分のランクも、"
            "他のプロセスと落ち合う場所もわかりません。各プロセスに変数を設定する torchrun で起動してください:\n"
            "    torchrun --nproc_per_node=2 -m mparlib.ddp [options]\n"
            "または mparlib 自身にプロセスを起動させます:\n"
            "    python -m mparlib.ddp --nproc 2 [options]      （Python からは mparlib.ddp.launch(fn, 2, ...)）"))
    try:
        info = {k.lower(): int(env[k]) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
        info["local_rank"] = int(env.get("LOCAL_RANK", info["rank"]))
        info["local_world_size"] = int(env.get("LOCAL_WORLD_SIZE", info["world_size"]))
    except ValueError as e:
        raise DDPError(tr(f"A rendezvous variable is not an integer ({e}); RANK, LOCAL_RANK, WORLD_SIZE and "
                          "MASTER_PORT must be numbers.",
                          f"ランデブーの環境変数に整数でない値があります（{e}）。RANK、LOCAL_RANK、WORLD_SIZE、"
                          "MASTER_PORT は数でなければなりません。")) from None
    info["master_addr"] = env["MASTER_ADDR"]
    if not 0 <= info["rank"] < info["world_size"]:
        raise DDPError(tr(f"RANK={info['rank']} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={info['world_size']}).",
                          f"RANK={info['rank']} が 0 から WORLD_SIZE-1 の範囲外です（WORLD_SIZE={info['world_size']}）。"))
    return info


@contextlib.contextmanager
def process_group(backend="auto"):
    """Join the process group described by the rendezvous variables; always leave it on exit. Explained in 06_ddp.

    Yields a dict ``rank, world_size, local_rank, backend, device``. ``destroy_process_group`` runs on success and
    on error, so a failing rank does not leave its communicator behind.
    """
    info = rendezvous_env()
    backend = choose_backend(backend)
    check_gpus(backend, info["local_world_size"])
    if backend == "nccl":
        torch.cuda.set_device(info["local_rank"])
        info["device"] = torch.device("cuda", info["local_rank"])
    else:
        info["device"] = torch.device("cpu")
    info["backend"] = backend
    dist.init_process_group(backend, rank=info["rank"], world_size=info["world_size"])  # env:// rendezvous
    try:
        yield info
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# Starting N local processes from Python (and from a notebook)
# ---------------------------------------------------------------------------------------------------------------

class WorkerFailed(DDPError):
    """A process started by :func:`launch` failed; the message holds the end of its log. Explained in 06_ddp."""


def _check_importable(fn):
    """Spawned processes find ``fn`` by module and name: reject functions they cannot import."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn))
    if module in (None, "__main__", "__mp_main__") or "<locals>" in name or "<lambda>" in name:
        in_main = module in ("__main__", "__mp_main__")
        where = tr("in a notebook or script (module __main__)" if in_main else "inside another function or as a lambda",
                   "ノートブックかスクリプト（モジュール __main__）" if in_main else "別の関数の中か lambda")
        raise DDPError(tr(
            f"The worker {name!r} is defined {where}, so the new processes cannot find it. A spawned process is a "
            "fresh Python interpreter: it receives the function as 'module name + function name' (pickle) and "
            "imports it, and a notebook's __main__ exists only in this kernel. Put the worker in a .py file next to "
            "the notebook (e.g. my_workers.py), `from my_workers import worker`, and launch that.",
            f"ワーカー関数 {name!r} は{where}で定義されているため、新しいプロセスからは見つけられません。spawn で"
            "起動したプロセスはまっさらな Python インタプリタで、関数を「モジュール名 + 関数名」として受け取り"
            "（pickle）、インポートします。ノートブックの __main__ はこのカーネルの中にしかありません。ワーカー関数を"
            "ノートブックと同じフォルダの .py ファイル（例: my_workers.py）に書き、`from my_workers import worker` で"
            "インポートしてから launch に渡してください。"))


def _entry(rank, fn, args, kwargs, nproc, host, port, backend, threads, log_path, result_path):
    """Body of each spawned process: set the variables torchrun would set, join the group, run ``fn``."""
    log = open(log_path, "a", buffering=1, encoding="utf-8")
    os.dup2(log.fileno(), 1)  # the process's prints (and C++ warnings) go to its log, not to the notebook
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    torch.set_num_threads(threads)
    failed_at = []  # when fn failed, before the teardown: the launcher reports the earliest failure as the cause
    try:
        keeper, port = _agree_on_port(rank, host, port, Path(f"{result_path}.port"))  # keeper: kept open until exit
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                          MASTER_ADDR=host, MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
        with process_group(backend):
            try:
                result = fn(*args, **kwargs)
            except BaseException:
                failed_at.append(time.time())
                raise
        if rank == 0:
            torch.save(result, result_path)
    except DDPError as e:  # a clear message: hand it to the launcher as it is
        Path(f"{result_path}.failed{rank}").write_text(repr((failed_at or [time.time()])[0]), encoding="utf-8")
        print(f"error: {e}", flush=True)
        Path(f"{result_path}.error{rank}").write_text(str(e), encoding="utf-8")
        os._exit(2)
    except BaseException:
        Path(f"{result_path}.failed{rank}").write_text(repr((failed_at or [time.time()])[0]), encoding="utf-8")
        traceback.print_exc()
        log.flush()
        os._exit(1)
    log.flush()
    os._exit(0)  # the work is saved and the group left: skip the interpreter's slow teardown of torch (seconds)


def _agree_on_port(rank, host, port, port_file, timeout=300.0):
    """With ``port=0``, rank 0 opens its rendezvous server on a port the system picks and tells the others.

    Choosing a free port in the launcher and opening it seconds later in rank 0 leaves a gap in which another
    program may take it. Here rank 0 binds first (``TCPStore`` on port 0), writes the port to ``port_file`` and
    keeps the server; ``init_process_group`` in the same process reuses it (``multi_tenant``).
    """
    if port:
        return None, port
    if rank == 0:
        from datetime import timedelta

        keeper = dist.TCPStore(host, 0, None, is_master=True, multi_tenant=True, wait_for_workers=False,
                               timeout=timedelta(seconds=timeout))
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(keeper.port), encoding="utf-8")
        os.replace(tmp, port_file)
        return keeper, keeper.port
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise DDPError(tr("Rank 0 did not open its rendezvous server in time.",
                              "ランク 0 が時間内にランデブーのサーバーを開きませんでした。"))
        time.sleep(0.05)
    return None, int(port_file.read_text(encoding="utf-8"))


def _tail(path, offset=0, lines=25):
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:]) or (
        "(empty log: the process failed before running any code, e.g. while importing the worker's module; "
        "its error is printed on the launching program's standard error)")


def launch(fn, nproc, *args, backend="auto", port=None, host="127.0.0.1", threads=None, log_dir=None,
           echo=True, show=None, **kwargs):
    """Run ``fn(*args, **kwargs)`` in ``nproc`` new local processes and return rank 0's result. Explained in 06_ddp.

    Each process is started fresh (``spawn``), gets the variables torchrun would set (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``...), joins the process group and calls ``fn``, which must be importable
    (defined in a module, not in the notebook). Rank 0's output is echoed here as it comes (``echo``); each rank
    appends to ``log_dir/rank{r}.log`` (a temporary folder by default). ``show`` names a PNG that rank 0 rewrites
    (an :class:`~mparlib.plot.Animator` file): inside Jupyter it is displayed and updated live in the cell.
    ``port=None`` (or 0) lets rank 0 take a free port; a given port is checked first. ``threads`` per process defaults to the CPU
    cores divided among the processes. If a process fails, the others are stopped and the error says which rank
    failed and how (a :class:`DDPError` raised by the worker comes back as it is, anything else as
    :class:`WorkerFailed` with the end of that rank's log).
    """
    import multiprocessing
    import multiprocessing.connection

    _check_importable(fn)
    if not (isinstance(nproc, int) and not isinstance(nproc, bool) and nproc >= 1):
        raise DDPError(tr(f"nproc={nproc!r}: the number of processes must be a positive int such as 2.",
                          f"nproc={nproc!r}: プロセス数は 2 のような正の整数で指定してください。"))
    backend = choose_backend(backend)
    check_gpus(backend, nproc)
    if port in (None, 0):
        port = 0  # rank 0 lets the system pick a free port and passes it on (see _agree_on_port)
    else:
        check_port(port, host)
    if threads is None:
        threads = 1 if backend == "nccl" else max(1, (os.cpu_count() or 1) // nproc)
    with tempfile.TemporaryDirectory(prefix="mparlib-ddp-") as tmp:
        logs = Path(log_dir) if log_dir is not None else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        log_paths = [logs / f"rank{r}.log" for r in range(nproc)]
        offsets = [p.stat().st_size if p.exists() else 0 for p in log_paths]  # logs are appended to, never erased
        result_path = Path(tmp) / "result.pt"
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_entry, name=f"ddp-rank{r}",
                             args=(r, fn, args, kwargs, nproc, host, port, backend, threads, log_paths[r], result_path))
                 for r in range(nproc)]
        watcher = _Watcher(log_paths[0] if echo else None, offsets[0], show)
        ended = []  # ranks that have ended
        try:
            for p in procs:
                p.start()
            while len(ended) < nproc and all(procs[r].exitcode == 0 for r in ended):
                multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.25)
                ended += [r for r, p in enumerate(procs) if p.exitcode is not None and r not in ended]
                watcher.poll()
            if any(procs[r].exitcode != 0 for r in ended):
                time.sleep(0.5)  # let the partners of a failed rank notice and stop on their own
                ended += [r for r, p in enumerate(procs) if p.exitcode is not None and r not in ended]
        except BaseException:  # Ctrl+C or the notebook's stop button: do not leave processes behind
            _stop(procs)
            raise
        codes = {r: procs[r].exitcode for r in ended}  # read before _stop: its own SIGTERMs are not failures
        _stop(procs)
        watcher.poll()
        failed = sorted((r for r in ended if codes[r] != 0), key=lambda r: _failed_at(result_path, r, codes[r]))
        if failed:
            for r in failed:
                err = Path(f"{result_path}.error{r}")
                if err.exists():
                    raise DDPError(err.read_text(encoding="utf-8"))
            first = failed[0]
            how = tr(", then ", "。").join(_how(r, codes[r]) for r in failed)
            raise WorkerFailed(tr(f"{how}; the other processes were stopped. End of rank {first}'s log "
                                  f"({log_paths[first]}):\n{_tail(log_paths[first], offsets[first])}",
                                  f"{how}。他のプロセスは停止しました。ランク {first} のログの末尾"
                                  f"（{log_paths[first]}）:\n{_tail(log_paths[first], offsets[first])}"))
        if not result_path.exists():
            raise WorkerFailed(tr("Rank 0 finished without a result; end of its log:\n",
                                  "ランク 0 は結果を返さずに終了しました。ログの末尾:\n") + _tail(log_paths[0], offsets[0]))
        return torch.load(result_path, weights_only=False)


def _failed_at(result_path, rank, code):
    """When a rank failed: a signal kills at once (it is the cause), an exception is stamped by ``_entry``."""
    if code < 0:
        return float("-inf")
    try:
        return float(Path(f"{result_path}.failed{rank}").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return float("inf")


def _how(rank, code):
    if code < 0:
        name = signal.Signals(-code).name
        return tr(f"rank {rank} was killed by signal {name}", f"ランク {rank} がシグナル {name} で強制終了されました")
    return tr(f"rank {rank} exited with code {code}", f"ランク {rank} が終了コード {code} で終了しました")


def _stop(procs, grace=5.0):
    """Terminate processes still running (SIGTERM, then SIGKILL after ``grace`` seconds) and reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()


class _Watcher:
    """Echo new text of rank 0's log, and (in Jupyter) show rank 0's plot file each time it changes."""

    def __init__(self, log_path, offset, png_path):
        self.log_path, self.png_path = log_path, Path(png_path) if png_path else None
        self.offset, self.png_stamp, self.handle = offset, None, None
        from .plot import in_kernel

        self.kernel = in_kernel()

    def poll(self):
        if self.log_path is not None and self.log_path.exists():
            with open(self.log_path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
            cut = data.rfind(b"\n") + 1  # whole lines only
            if cut:
                self.offset += cut
                print(data[:cut].decode("utf-8", errors="replace"), end="", flush=True)
        if self.kernel and self.png_path is not None and self.png_path.exists():
            stamp = self.png_path.stat().st_mtime_ns
            if stamp != self.png_stamp:
                self.png_stamp = stamp
                from IPython.display import Image, display

                image = Image(data=self.png_path.read_bytes())
                if self.handle is None:
                    self.handle = display(image, display_id=True)
                else:
                    self.handle.update(image)
