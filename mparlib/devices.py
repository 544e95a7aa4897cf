"""Which devices this machine has, and how big the course's experiments should be on it.

Device choice lives here, in one place; every chapter asks these functions. Explained in 00_setup.
"""
import os
import platform

import torch

PROFILES = ("smoke", "full")


def num_gpus():
    """Number of CUDA GPUs PyTorch can use (0 on a laptop without one). Explained in 00_setup."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def try_gpu(i=0):
    """Return ``cuda:i`` if that GPU exists, else the CPU. Explained in 00_setup.

    This is a convenience with a silent fallback. When a chapter *needs* ``i + 1`` GPUs, use
    :func:`require_gpus`, which says so instead of quietly running on the CPU.
    """
    if num_gpus() >= i + 1:
        return torch.device(f"cuda:{i}")
    return torch.device("cpu")


def try_all_gpus():
    """All GPUs, or ``[cpu]`` when there are none. Explained in 00_setup.

    d2l 1.0.3's function of the same name returns ``[]`` on a machine without a GPU (its docstring
    promises ``[cpu]``), which makes ``devices[0]`` fail; this one always returns at least one device.
    """
    n = num_gpus()
    return [torch.device(f"cuda:{i}") for i in range(n)] or [torch.device("cpu")]


def require_gpus(n):
    """Return the first ``n`` GPUs, or raise a clear error if the machine has fewer. Explained in 05_multi_gpu_resnet."""
    from .lang import tr

    have = num_gpus()
    if n > have:
        raise RuntimeError(tr(
            f"This run asks for {n} GPU(s) but PyTorch sees {have}. "
            f"Ask for at most {have}, or pass devices=mparlib.try_all_gpus() to use what exists "
            f"(the CPU when there is no GPU).",
            f"{n}枚の GPU が必要ですが、PyTorch から見える GPU は {have}枚です。"
            f"{have}枚以下を指定するか、devices=mparlib.try_all_gpus() で使えるデバイス"
            f"（GPU がなければ CPU）を使ってください。",
        ))
    return [torch.device(f"cuda:{i}") for i in range(n)]


def profile():
    """The course profile: ``"smoke"`` (small, fast runs) without a GPU, ``"full"`` with one. Explained in 00_setup.

    Set ``MPARLIB_PROFILE=smoke`` or ``MPARLIB_PROFILE=full`` to override, e.g. to run the real experiment on a
    patient CPU or a quick check on a GPU machine.
    """
    env = os.environ.get("MPARLIB_PROFILE", "").strip().lower()
    if env:
        if env not in PROFILES:
            raise ValueError(f"MPARLIB_PROFILE={env!r} is not a profile; use 'smoke' or 'full'.")
        return env
    return "full" if num_gpus() > 0 else "smoke"


def profile_line():
    """One sentence saying which profile runs and how to change it (shown near the top of every notebook)."""
    from .lang import tr

    p = profile()
    other = "full" if p == "smoke" else "smoke"
    return tr(
        f"Course profile: {p}. To change it, set MPARLIB_PROFILE={other} before starting Jupyter.",
        f"コースのプロファイル: {p}。変更するには Jupyter を起動する前に MPARLIB_PROFILE={other} を設定します。",
    )


def report():
    """One compact table of the software and hardware a notebook runs on. Explained in 00_setup."""
    rows = [
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("CUDA (build)", torch.version.cuda or "-"),
        ("cuDNN", str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "-"),
        ("CPU threads", str(torch.get_num_threads())),
        ("GPUs", str(num_gpus())),
    ]
    for i in range(num_gpus()):
        prop = torch.cuda.get_device_properties(i)
        rows.append((f"cuda:{i}", f"{prop.name}, {prop.total_memory / 2**30:.0f} GiB"))
    rows.append(("profile", profile()))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
