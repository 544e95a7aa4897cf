"""Writing files so that a crash never leaves a half-written one. Explained in 02_wrapped_attributes."""
import io
import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path, data):
    """Write ``data`` to ``path`` through a temporary file in the same folder and an atomic rename.

    Readers see either the old file or the new one, never a torn mix; on error the old file is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600 files; give the usual permissions of a new file
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_torch_save(obj, path):
    """``torch.save`` that is atomic: write to a temporary file, then rename. Explained in 02_wrapped_attributes."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())
