"""The learner's code in a clean worker process, apart from the check that judges it. Explained in 01_dataparallel.

A check judged apart runs in the kernel and reaches the learner's code only through :func:`run_apart` (which
:func:`~mparlib.exercises.core.call` uses). It sends a *driver* (a function of the check's module, or the learner's
own function) with its arguments to a new process, forked from the fork server that :mod:`mparlib.launch` keeps: a
fresh interpreter that has imported PyTorch and nothing of the kernel, so no thread of the kernel, no CUDA context
and no patch the kernel has seen are in it. The learner's function travels by value (``cloudpickle``), the driver
and anything importable by name. What comes back is plain data only (tensors, numbers, strings, ``None``, and
lists, tuples and dicts of them), read with ``torch.load(weights_only=True)``, which runs no code. The reference,
the expected values and the verdict stay in the kernel: nothing the answer does in its process can reach them, and
nothing it changes there outlives its process, which is new for every call.

The worker and every process it starts (those that call ``setsid`` too: the worker and, while a check runs, the
kernel adopt the orphans) are ended at the exercise's time limit, whatever the answer catches or ignores. What the
answer prints, C-level output included, is shown as it comes. Linux, macOS and Windows alike (``spawn`` where
there is no fork server).
"""
import contextlib
import contextvars
import ctypes
import io
import linecache
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
import types
import warnings
from pathlib import Path

import cloudpickle
import psutil
import torch

from .. import launch
from ..lang import tr

CALL, REPLY, OUTPUT = "call.pkl", "reply.pt", "output.log"
OPAQUE = "__mparlib_opaque__"  # marks a value that cannot come back as plain data (its type and repr come instead)
LEARNER_STATUSES = ("not attempted", "error", "wrong")  # what a worker may report; never "right"

# The monotonic time by which the check being judged apart must end; unset outside such a check (and in a worker).
DEADLINE = contextvars.ContextVar("mparlib_exercise_deadline", default=None)


class Opaque:
    """A value the learner's code returned that is not plain data: its type name and ``repr`` (from the worker)."""

    def __init__(self, type_name, text):
        self.type_name, self.text = type_name, text

    def __repr__(self):
        return self.text

    def __eq__(self, other):
        return False

    __hash__ = None


def apart():
    """True while a check judged apart runs (in the kernel): :func:`~mparlib.exercises.core.call` then goes to a
    worker."""
    return DEADLINE.get() is not None


@contextlib.contextmanager
def judged_apart(limit):
    """Within this block, the learner's code reached through ``call`` runs in workers, all of them together within
    ``limit`` seconds."""
    token = DEADLINE.set((time.monotonic(), time.monotonic() + limit, limit))
    try:
        yield
    finally:
        DEADLINE.reset(token)


# ---- The call, and the learner's source with it ----------------------------------------------------------------------
class _Pickler(cloudpickle.Pickler):
    """``cloudpickle``, keeping the file name of the code it sends by value (cloudpickle writes ``<dynamic-code>``)
    and noting each, so that the worker's tracebacks show the learner's lines."""

    def __init__(self, file):
        super().__init__(file)
        self.files = set()

    def reducer_override(self, obj):
        reduce_code = getattr(cloudpickle.cloudpickle, "_code_reduce", None)
        if isinstance(obj, types.CodeType) and reduce_code is not None:
            self.files.add(obj.co_filename)
            kind, args = reduce_code(obj)
            if "<dynamic-code>" in args:
                args = list(args)
                args[args.index("<dynamic-code>")] = obj.co_filename
                args = tuple(args)
            return kind, args
        return super().reducer_override(obj)


def _dumps(driver, args, kwargs):
    """The call as bytes, with the source lines that this process knows of the files its code came from (a notebook's
    cells live only in this process's ``linecache``)."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump((driver, args, kwargs))
    sources = {name: lines for name in sorted(pickler.files) if (lines := linecache.getlines(name))}
    return cloudpickle.dumps((buffer.getvalue(), sources))


def _loads(data):
    """The call sent by :func:`_dumps`, once its source lines are where tracebacks look for them."""
    call, sources = cloudpickle.loads(data)
    for name, lines in sources.items():
        if isinstance(name, str) and isinstance(lines, list) and not os.path.exists(name):
            linecache.cache[name] = (sum(map(len, lines)), None, lines, name)  # no mtime: never reread
    return cloudpickle.loads(call)


# ---- In the worker --------------------------------------------------------------------------------------------------
def _sendable(value):
    """Whether ``value`` survives ``torch.save`` and a ``weights_only`` load (plain data)."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
        return True
    except Exception:  # noqa: BLE001 - pickling and the weights-only unpickler fail in many ways
        return False


def plain(value):
    """``value`` itself when it can come back as plain data, else a marker naming its type and showing its repr."""
    if _sendable(value):
        return value
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - the learner's __repr__ may raise
        text = f"<{type(value).__name__} object>"
    return {OPAQUE: type(value).__name__, "repr": text[:300]}


def plain_parts(value):
    """``value`` with each part that cannot come back as plain data replaced by its marker (see :func:`plain`), at any
    depth of dicts (string keys), lists and tuples: a check still finds the parts it reads where it expects them."""
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: plain_parts(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(plain_parts(v) for v in value)
    return plain(value)


def _reply(driver, args, kwargs):
    """Run the driver; its value, or the outcome the learner's code led to, as plain data."""
    from .core import Stop, learner_error, not_attempted

    try:
        value = driver(*args, **kwargs)
    except Stop as stop:
        o = stop.outcome
        if o.status not in LEARNER_STATUSES:
            o = learner_error(RuntimeError(f"the answer's process reported {o.status!r}"))
        return {"kind": "outcome", "status": o.status, "message": o.message, "hint_key": o.hint_key,
                "details": o.details}
    except NotImplementedError:
        o = not_attempted()
        return {"kind": "outcome", "status": o.status, "message": o.message, "hint_key": None, "details": ""}
    except (SystemExit, KeyboardInterrupt) as e:
        return {"kind": "exit", "what": type(e).__name__}
    except Exception:  # noqa: BLE001 - a driver that broke: the check's own fault
        return {"kind": "check failed", "details": traceback.format_exc()}
    return {"kind": "value", "value": plain(value)}


def _entry(box, parent, env):
    """The worker's whole life: tie it to the kernel, run the driver, leave the reply, end with what it started."""
    code = 1
    try:
        if sys.platform == "linux":
            libc = ctypes.CDLL(None)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: its parent (the fork server) gone, it goes too
            libc.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: what it starts and orphans stays its own
        if not launch._launched_by(parent):
            os._exit(1)
        launch._forget_fork_server()
        os.environ.clear()
        os.environ.update(env)
        torch.seed()  # as a fresh process would be, not the fork server's generator state
        box = Path(box)
        fd = os.open(box / OUTPUT, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        log = open(fd, "a", buffering=1, encoding="utf-8", errors="replace")
        os.dup2(log.fileno(), 1)  # print and C-level output alike, read and shown by the kernel as they come
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = log
        driver, args, kwargs = _loads((box / CALL).read_bytes())
        reply = _reply(driver, args, kwargs)
        part = box / (REPLY + ".part")
        torch.save(reply, part)
        os.replace(part, box / REPLY)
        code = 0
    except BaseException:  # noqa: BLE001 - whatever happened, it is in the output the kernel shows
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        launch._end_all(launch._descendants([os.getpid()]).values())
        os._exit(code)


# ---- In the kernel --------------------------------------------------------------------------------------------------
class _Echo:
    """Print what the worker writes to its output file, whole lines as they come, the rest at the end."""

    def __init__(self, path):
        self.path, self.offset, self.last = path, 0, b"\n"

    def poll(self, everything=False):
        with contextlib.suppress(OSError), open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
            cut = len(data) if everything else data.rfind(b"\n") + 1
            if cut:
                self.offset, self.last = self.offset + cut, data[cut - 1:cut]
                print(data[:cut].decode("utf-8", errors="replace"), end="", flush=True)
        if everything and self.last != b"\n":  # end the learner's last line, so the outcome starts on its own
            print()


def run_apart(driver, *args, **kwargs):
    """``driver(*args, **kwargs)`` in a new clean worker process, within the time left to the check; its value as
    plain data (a non-plain value as an :class:`Opaque`). The learner's failures end the check with their outcome
    (a :class:`~mparlib.exercises.core.Stop`): an exception, "not attempted", a crash with its signal, the time
    limit with the seconds the check waited."""
    from .core import Outcome, Stop, wrong

    started_at, deadline, limit = DEADLINE.get() or (time.monotonic(), time.monotonic() + 30.0, 30.0)
    try:
        payload = _dumps(driver, args, kwargs)
    except Exception as e:  # noqa: BLE001 - cloudpickle fails in many ways
        raise Stop(Outcome("error", tr(
            f"Your function could not be sent to the process that runs it ({type(e).__name__}: {e}). It travels "
            "with everything it uses from the notebook: create what cannot be copied (an open file, a lock, a "
            "generator, a thread) inside the function instead.",
            f"関数を、それを実行するプロセスに送れませんでした（{type(e).__name__}: {e}）。関数は、ノートブックから"
            "使うものごと送られます。コピーできないもの（開いたファイル、ロック、ジェネレーター、スレッド）は関数の"
            "中で作ってください。"))) from None
    with tempfile.TemporaryDirectory(prefix="mparlib-check-") as box:  # 0700: this user's processes alone
        box = Path(box)
        (box / CALL).write_bytes(payload)
        code, ended = _supervise(box, deadline)
        waited = time.monotonic() - started_at
        reply = None
        if (box / REPLY).exists():
            try:
                with warnings.catch_warnings():  # a forged reply may also use a pickle protocol torch does not expect
                    warnings.simplefilter("ignore")
                    reply = torch.load(box / REPLY, weights_only=True)  # plain data: loading it runs no code
            except Exception as e:  # noqa: BLE001 - a reply the answer forged or broke
                raise Stop(Outcome("error", tr(
                    f"Your code damaged the reply of the process that ran it ({type(e).__name__}).",
                    f"あなたのコードが、それを実行したプロセスの返答を壊しました（{type(e).__name__}）。"))) from None
    if not ended:
        raise Stop(wrong(tr(
            f"Your function was still running when the check ended it, {waited:.0f} s after the check started "
            f"(the limit of this exercise is {limit:g} s).",
            f"チェックの開始から {waited:.0f}秒たっても関数が実行中だったので、チェックが終了させました（この練習問題の"
            f"制限時間は {limit:g}秒です）。"), "stuck"))
    return _read(reply, code)


def _read(reply, code):
    """The driver's value from a worker's ``reply`` (``None``: it left none; ``code``: its exit code)."""
    from .core import Outcome, Stop

    kind = reply.get("kind") if isinstance(reply, dict) else None
    if kind == "value":
        return _unmark(reply.get("value"))
    if kind == "outcome" and reply.get("status") in LEARNER_STATUSES:
        raise Stop(Outcome(reply["status"], str(reply.get("message", "")), reply.get("hint_key") or None,
                           str(reply.get("details", ""))))
    if kind == "check failed":
        raise Stop(Outcome("check failed", tr(
            "The check itself failed: this is not a verdict on your answer. Please report it with the text below.",
            "チェック自体が失敗しました。あなたの答えの判定ではありません。下の内容を添えて報告してください。"),
            details=str(reply.get("details", ""))))
    if kind == "exit":
        how = f"{reply.get('what')}"
    elif code is not None and code < 0:
        how = tr(f"killed by signal {signal.Signals(-code).name}", f"シグナル {signal.Signals(-code).name} で強制終了")
    else:
        how = tr(f"exit code {code}", f"終了コード {code}")
    raise Stop(Outcome("error", tr(
        f"Your code ended the process that ran it ({how}) before it returned. Do not call sys.exit, os._exit or "
        "anything that ends Python inside the function; a crash by a signal such as SIGSEGV comes from native code "
        "(an index out of range in a C extension, a tensor freed under a view).",
        f"あなたのコードが、戻る前にそれを実行していたプロセスを終了させました（{how}）。関数の中で sys.exit や "
        "os._exit など Python を終わらせるものを呼ばないでください。SIGSEGV などのシグナルによる異常終了は、ネイティブ"
        "コード（C 拡張での範囲外のインデックス、ビューが残ったまま解放されたテンソルなど）から来ます。")))


def _unmark(value):
    """Replace the worker's markers of non-plain values by :class:`Opaque` objects, at any depth."""
    if isinstance(value, dict):
        if set(value) == {OPAQUE, "repr"} and isinstance(value[OPAQUE], str):
            return Opaque(value[OPAQUE], str(value["repr"]))
        return {k: _unmark(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unmark(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_unmark(v) for v in value)
    return value


def _supervise(box, deadline):
    """Start the worker and wait for it, echoing its output, until it ends or ``deadline``; end everything it started.
    Returns ``(exit code, whether it ended by itself)``."""
    context = multiprocessing.get_context(launch._start_method())
    was_subreaper = launch._subreaper(True)  # orphans of the worker's processes come here while it runs
    known = {c.pid for c in psutil.Process().children()}
    worker = context.Process(target=_entry, args=(str(box), os.getpid(), dict(os.environ)), name="mparlib-check")
    echo = _Echo(box / OUTPUT)
    seen, ended = {}, False
    try:
        worker.start()
        while True:
            worker.join(0.05)
            echo.poll()
            if worker.exitcode is not None:
                ended = True
                break
            seen.update(launch._descendants([worker.pid]))
            if time.monotonic() >= deadline:
                break
    finally:
        if worker.pid is not None and worker.exitcode is None:
            seen.update(launch._descendants([worker.pid]))
            worker.kill()
            worker.join()
        launch._end_all(seen.values())
        if was_subreaper is not None:
            launch._end_adopted(known | ({worker.pid} if worker.pid else set()))
            launch._subreaper(was_subreaper)
        echo.poll(everything=True)
    return worker.exitcode, ended
