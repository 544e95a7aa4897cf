"""Writing files so that a crash never leaves a half-written one. Explained in 02_wrapped_attributes.

A file is written under a hidden temporary name in the same folder, flushed to disk, then renamed over the target
(``os.replace`` is atomic): a reader sees the old file or the new one, never a torn mix. The temporary name carries
the host and the process id of its writer, ``.model.pt.<host>.<pid>.<random>.tmp``, so that a file left behind by a
writer that was killed can be told apart from one that a live process is still writing: the next write of the same
target removes the dead writer's leftovers and never touches a live one's.
"""
import contextlib
import os
import re
import secrets
import socket
from pathlib import Path


def _host():
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user: alive
        pass
    return True


def _remove_stale(path):
    """Remove the temporary files of ``path`` whose writer on this host has exited (killed mid-write, say).

    Files of live writers, of other hosts (a shared network folder) and of any other name are never touched.
    """
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.[0-9a-f]+\.tmp$")
    try:
        names, host = os.listdir(path.parent), _host()
    except OSError:  # a folder that may be written but not listed: nothing to clean
        return
    for m in filter(None, map(pattern.match, names)):
        if m["host"] == host and int(m["pid"]) != os.getpid() and not _alive(int(m["pid"])):
            with contextlib.suppress(FileNotFoundError):  # another writer may have removed it first
                (path.parent / m[0]).unlink()


def _naming_target(exc, path):
    """The same OS error, naming the target file instead of the hidden temporary one."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return type(exc)(exc.errno, exc.strerror, str(path))
    return exc


def atomic_write_bytes(path, data):
    """Write ``data`` to ``path`` through a temporary file and an atomic rename. Explained in 02_wrapped_attributes.

    On an error the temporary file is removed, the old file (if any) is left as it was, and the error is raised
    again; an ``OSError`` then names ``path``, not the temporary file.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(path)
        # O_EXCL: never reuse a name; mode 0o666 filtered by the umask gives the usual permissions of a new file.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise _naming_target(e, path) from e
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        new = _naming_target(e, path)
        if new is e:
            raise
        raise new from e
    with contextlib.suppress(OSError):  # make the rename itself durable; not possible on every file system
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
