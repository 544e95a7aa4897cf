"""What every benchmark saves beside its numbers: the machine, the software, the commit; and how it saves them.

The benchmarks run as scripts (``python benchmarks/NAME.py``), so they import this module as ``record``.
"""
import json
import os
import platform
import socket
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def git_commit():
    """The commit measured, with ``+uncommitted changes`` when tracked files differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (head.stdout.strip() + ("+uncommitted changes" if dirty else "")) or None


def machine(**extra):
    """CPU count and kind, the GPUs' names and the load average when the measurement starts (plus ``extra``)."""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {"cpu_count": os.cpu_count(), "machine": platform.machine(), "processor": platform.processor(),
            "gpus": gpus, "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None, **extra}


def load(start_machine, cores=None):
    """The load average before (from ``machine()``) and after a run, per core, and whether the run was busy.

    ``busy``: the 1-minute load average per core exceeded ``mparlib.timing.BUSY_LOAD_PER_CORE`` (0.3) at the start
    or at the end; other work then competed for the processors, and the run must not be called quiet.
    """
    from mparlib.timing import BUSY_LOAD_PER_CORE, load_average

    cores = cores or os.cpu_count() or 1
    before = (start_machine.get("load_average_at_start") or [None])[0]
    after = load_average()
    known = [v for v in (before, after) if v is not None]
    per_core = max(known) / cores if known else None
    return {"load_1min_before": before, "load_1min_after": after, "cores": cores, "load_per_core": per_core,
            "busy_threshold_per_core": BUSY_LOAD_PER_CORE,
            "busy": per_core is not None and per_core > BUSY_LOAD_PER_CORE}


def software(**extra):
    """Python, torch and CUDA versions and the commit (plus ``extra``)."""
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "git_commit": git_commit(), **extra}


def save(result, folder, stem):
    """Write ``result`` as ``folder/STEM-HOST-DATE-TIME.json`` in one step; return its path."""
    from mparlib.files import atomic_write_bytes

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}-{socket.gethostname()}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    atomic_write_bytes(path, (json.dumps(result, indent=2) + "\n").encode())
    return path
