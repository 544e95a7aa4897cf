"""One run per output folder: a lock that names the run holding it. Explained in 06_ddp.

Two training runs writing into the same folder would interleave their logs and overwrite each other's checkpoints.
A run therefore holds ``FOLDER/.mparlib.lock`` while it writes there: an operating-system lock (``flock``) on an
open file, which the system releases by itself when the process ends, however it ends, so a crashed run never leaves
a stale lock. The file records who holds it (process id, host, start time, command), which the refusal shows.
"""
import json
import os
import socket
import sys
import time
from pathlib import Path

from .errors import ConfigError, OutputLocked
from .lang import tr

LOCK_NAME = ".mparlib.lock"


class FolderLock:
    """A held lock on an output folder; ``release()`` (or leaving a ``with`` block) gives it up. Explained in 06_ddp."""

    def __init__(self, fd, path):
        self.fd, self.path = fd, path

    def release(self):
        """Give up the lock (the lock file itself stays; it holds no data)."""
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def lock_folder(folder, what="folder"):
    """Create ``folder`` if needed and lock it for this process, or raise ``OutputLocked`` naming the holder. Explained in 06_ddp.

    ``what`` names the option the user set (``"--out"``), so the message can say what to change.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(tr(f"{what} {folder} is a file, not a folder: choose a folder for the run's files.",
                             f"{what} に指定された {folder} はフォルダではなくファイルです。訓練のファイルを置くフォルダを"
                             "指定してください。"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks here; the course's runs are started on Linux and macOS
        return FolderLock(None, path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise OutputLocked(tr(
            f"{what} {folder} is in use by another run ({holder}): two runs in one folder would overwrite each "
            f"other's checkpoints and mix their logs. Wait for it to finish, stop it, or choose another {what}.",
            f"{what} の {folder} は別の訓練が使っています（{holder}）。1つのフォルダで 2つの訓練を動かすと、チェック"
            f"ポイントを上書きし合い、ログも混ざります。その訓練が終わるのを待つか、止めるか、別の {what} を指定して"
            "ください。")) from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv)[:300]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    return FolderLock(fd, path)


def _holder(fd):
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return tr("a process that is starting", "起動中のプロセス")
    return tr(f"process {info.get('pid')} on {info.get('host')}, started {info.get('started')}: {info.get('command')}",
              f"{info.get('host')} のプロセス {info.get('pid')}、{info.get('started')} 開始: {info.get('command')}")
