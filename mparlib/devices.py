"""Which devices this machine has, and how big the course's experiments should be on it.

Device choice lives here, in one place; every chapter asks these functions. Explained in 00_setup.
"""
import importlib.metadata
import os
import platform
import re

import torch

from .checks import one_of, positive_int
from .errors import ConfigError, DeviceError
from .lang import table, tr

PROFILES = ("smoke", "full")


def num_gpus():
    """Number of CUDA GPUs PyTorch can use (0 on a laptop without one). Explained in 00_setup."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def try_gpu(i=0):
    """Return ``cuda:i`` if that GPU exists, else the CPU. Explained in 00_setup.

    This is a convenience with a silent fallback. When a chapter *needs* ``i + 1`` GPUs, use
    :func:`require_gpus`, which says so instead of quietly running on the CPU.
    """
    return torch.device(f"cuda:{i}") if num_gpus() >= i + 1 else torch.device("cpu")


def try_all_gpus():
    """All GPUs, or ``[cpu]`` when there are none. Explained in 00_setup.

    d2l 1.0.3's function of the same name returns ``[]`` on a machine without a GPU (its docstring
    promises ``[cpu]``), which makes ``devices[0]`` fail; this one always returns at least one device.
    """
    n = num_gpus()
    return [torch.device(f"cuda:{i}") for i in range(n)] or [torch.device("cpu")]


def require_gpus(n):
    """Return the first ``n`` GPUs, or raise a clear error if the machine has fewer. Explained in 05_multi_gpu_resnet."""
    n = positive_int(n, "n", 2, "require_gpus")
    have = num_gpus()
    if n > have:
        fix_en = (f"Ask for at most {have}, or pass" if have else "Run it on a machine with GPUs, or pass")
        fix_ja = (f"{have}枚以下を指定するか、" if have else "GPU のあるマシンで実行するか、")
        raise DeviceError(tr(
            f"This run asks for {n} GPU(s) but PyTorch sees {have}. {fix_en} devices=mparlib.try_all_gpus() to use "
            "what exists (the CPU when there is no GPU).",
            f"GPU が {n}枚必要ですが、PyTorch から見える GPU は {have}枚です。{fix_ja}devices=mparlib.try_all_gpus() で"
            "使えるデバイス（GPU がなければ CPU）を使ってください。"))
    return [torch.device(f"cuda:{i}") for i in range(n)]


def _parse_device(device, what):
    """``device`` as a ``torch.device`` (ints: GPU numbers, ``-1`` the CPU), not yet checked to exist."""
    if isinstance(device, bool):
        device = repr(device)  # True/False are ints to Python, never devices
    try:
        if isinstance(device, int):
            return torch.device("cpu") if device == -1 else torch.device("cuda", device)
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise DeviceError(tr(f"{what}={device!r} is not a device; use e.g. 'cpu', 'cuda:0' or the GPU number 0.",
                             f"{what}={device!r} はデバイスではありません。'cpu'、'cuda:0'、または GPU の番号 0 のように"
                             "指定してください。")) from None


def check_device(device, what="device"):
    """One device as a ``torch.device`` that exists on this machine, or a clear error. Explained in 03_primitives.

    Accepts ``torch.device``, strings (``"cpu"``, ``"cuda:1"``) and ints: ``i`` is GPU ``i`` and ``-1`` the CPU, as in
    ``torch.nn.parallel``. ``"cuda"`` without an index means the current GPU. This is the course's one device check:
    every function that takes devices calls it (directly or through :func:`check_devices`).
    """
    device = _parse_device(device, what)
    if device.type == "cuda":
        have = num_gpus()
        index = device.index if device.index is not None else (torch.cuda.current_device() if have else 0)
        if index >= have:
            names = ", ".join(f"cuda:{i}" for i in range(have))
            here = (tr(f"this machine has {have} CUDA GPU(s) ({names})",
                       f"このマシンの CUDA の GPU は {have}枚（{names}）です") if have else
                    tr("this machine has no CUDA GPU", "このマシンには CUDA の GPU がありません"))
            raise DeviceError(tr(
                f"{what}=cuda:{index} does not exist: {here}. Use the devices from mparlib.try_all_gpus(), "
                "or ['cpu'] * k to simulate k devices on the CPU.",
                f"{what}=cuda:{index} は存在しません（{here}）。mparlib.try_all_gpus() が返すデバイスを使うか、"
                "['cpu'] * k で CPU 上に k 個のデバイスを模擬してください。"))
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise DeviceError(tr(
            f"{what}={str(device)!r}: the course runs on CUDA GPUs and the CPU only; use 'cuda:N' or 'cpu'.",
            f"{what}={str(device)!r}: このコースが使うのは CUDA の GPU と CPU だけです。'cuda:N' か 'cpu' を指定して"
            "ください。"))
    return device


def check_devices(devices, what="devices", *, mixed=False):
    """A non-empty list of existing devices, all of one kind (GPUs, or the CPU listed k times). Explained in 05_multi_gpu_resnet.

    This is the course's one rule for a list of devices; every entry point that takes one calls it once per call.
    Data parallelism splits a batch over devices of one kind: all GPUs (``mparlib.try_all_gpus()``) or, to simulate
    ``k`` devices on a laptop, ``["cpu"] * k``. ``mixed=True`` lets the kinds differ, for models whose parts sit on
    different devices (one device per stage, chapter 04). A single device (not in a list) is refused, because it
    usually means ``devices=torch.device("cuda")`` was meant as ``[torch.device("cuda")]``.
    """
    if isinstance(devices, (str, int, torch.device)):
        raise DeviceError(tr(
            f"{what} must be a list of devices such as ['cuda:0', 'cuda:1'] or ['cpu'] * 2, not the single "
            f"device {devices!r}: write [{devices!r}].",
            f"{what} には ['cuda:0', 'cuda:1'] や ['cpu'] * 2 のようなデバイスのリストを渡してください。1つのデバイス "
            f"{devices!r} ではなく [{devices!r}] と書きます。"))
    try:
        items = list(devices)
    except TypeError:
        raise DeviceError(tr(f"{what}={devices!r} is not a list of devices; use e.g. mparlib.try_all_gpus().",
                             f"{what}={devices!r} はデバイスのリストではありません。mparlib.try_all_gpus() などを"
                             "渡してください。")) from None
    if not items:
        raise DeviceError(tr(
            f"{what} is empty (d2l.try_all_gpus() returns [] on a machine without a GPU). "
            "Pass mparlib.try_all_gpus(), which falls back to [cpu].",
            f"{what} が空です（GPU のないマシンでは d2l.try_all_gpus() が [] を返します）。"
            "CPU だけのときは [cpu] を返す mparlib.try_all_gpus() を渡してください。"))
    names = [f"{what}[{i}]" if mixed else what for i in range(len(items))]  # mixed: each device has its own role
    parsed = [_parse_device(d, name) for d, name in zip(items, names)]
    kinds = {d.type for d in parsed}
    if len(kinds) > 1 and not mixed:
        shown = ", ".join(str(d) for d in parsed)
        raise DeviceError(tr(
            f"Expected a non cpu device, but got: cpu. The list [{shown}] mixes kinds of device; data parallelism "
            "needs one kind: all GPUs (mparlib.try_all_gpus()) or the CPU listed k times (['cpu'] * k) to simulate "
            "k devices.",
            f"Expected a non cpu device, but got: cpu（PyTorch のメッセージ）。リスト [{shown}] には種類の違うデバイスが"
            "混ざっています。データ並列に使うデバイスは 1種類にそろえます。すべて GPU（mparlib.try_all_gpus()）にするか、"
            "CPU を k 回並べて（['cpu'] * k）k 個のデバイスを模擬してください。"))
    return [check_device(d, name) for d, name in zip(parsed, names)]


def profile():
    """The course profile: ``"smoke"`` (small, fast runs) without a GPU, ``"full"`` with one. Explained in 00_setup.

    Set ``MPARLIB_PROFILE=smoke`` or ``MPARLIB_PROFILE=full`` to override, e.g. to run the real experiment on a
    patient CPU or a quick check on a GPU machine.
    """
    env = os.environ.get("MPARLIB_PROFILE", "").strip().lower()
    if env:
        return one_of(env, "MPARLIB_PROFILE", PROFILES)
    return "full" if num_gpus() > 0 else "smoke"


def profile_line():
    """One sentence saying which profile runs and how to change it (near the top of every notebook). Explained in 00_setup."""
    p = profile()
    other = "full" if p == "smoke" else "smoke"
    return tr(f"Course profile: {p}. To change it, set MPARLIB_PROFILE={other} before starting Jupyter.",
              f"コースのプロファイル: {p}。変更するには Jupyter を起動する前に MPARLIB_PROFILE={other} を設定します。")


def _torch_floor():
    """The oldest torch the course supports, read from the installed package's requirements (pyproject.toml's
    ``torch>=X.Y``), as ``(X, Y)``. Explained in 12_planning."""
    try:
        requires = importlib.metadata.requires("mparlib") or []
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(tr("mparlib is not installed, so its torch requirement is unknown: run `make install` in the "
                             "course's folder.",
                             "mparlib がインストールされていないので、必要な torch のバージョンがわかりません。コースのフォルダで "
                             "`make install` を実行してください。")) from None
    for requirement in requires:
        found = re.fullmatch(r"torch\s*>=\s*(\d+)\.(\d+)[\d.]*", requirement.strip())
        if found:
            return int(found.group(1)), int(found.group(2))
    raise ConfigError(tr(f"mparlib's requirements name no torch>=X.Y floor: {requires}",
                         f"mparlib の依存関係に torch>=X.Y の下限がありません: {requires}"))


def check_torch(chapter):
    """Stop with a clear error when the installed torch is older than the course's floor (:func:`_torch_floor`), before
    a worker fails deep inside an API the old release lacks; ``chapter`` names the notebook. Explained in 12_planning."""
    floor = _torch_floor()
    found = tuple(int(part) for part in re.findall(r"\d+", torch.__version__.split("+")[0])[:2])
    if found < floor:
        need = ".".join(map(str, floor))
        raise ConfigError(tr(f"{chapter} needs torch {need} or newer (this is {torch.__version__}). Upgrade it: "
                             f"pip install 'torch>={need}'.",
                             f"{chapter} には torch {need} 以降が必要です（この環境は {torch.__version__} です）。"
                             f"pip install 'torch>={need}' で更新してください。"))
    return floor


def report():
    """One compact table of the software and hardware a notebook runs on. Explained in 00_setup."""
    rows = [
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("CUDA (build)", torch.version.cuda or "-"),
        ("cuDNN", str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "-"),
        (tr("CPU threads", "CPU スレッド数"), str(torch.get_num_threads())),
        (tr("GPUs", "GPU の数"), str(num_gpus())),
    ]
    for i in range(num_gpus()):
        prop = torch.cuda.get_device_properties(i)
        rows.append((f"cuda:{i}", f"{prop.name}, {prop.total_memory / 2**30:.0f} GiB"))
    rows.append((tr("profile", "プロファイル"), profile()))
    return table(rows, align="<<")
