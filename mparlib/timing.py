"""Timing that tells the truth on GPUs: a synchronising stopwatch and a measured matmul peak. Explained in 00_setup."""
import itertools
import time

import torch

from .checks import positive_int
from .devices import check_device
from .errors import ConfigError
from .lang import tr


def synchronize(device=None):
    """Wait for queued GPU work so a clock reading includes it (no-op without CUDA). Explained in 00_setup."""
    _wait(None if device is None else check_device(device, "device"))


def _wait(device):
    """:func:`synchronize` on ``None`` (every GPU) or a checked ``torch.device``."""
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.synchronize(device)


def matmul_tflops(device, dtype=torch.float32, n=4096, repeats=10):
    """Best TFLOP/s of an n x n by n x n matrix product (2 n^3 FLOPs), synchronised. Explained in 07_performance.

    The fastest of ``repeats`` runs after one warm-up: a measured peak for this device and precision, the
    ceiling that the performance chapter and its benchmark compare a training step against.
    """
    device = check_device(device, "device")
    n, repeats = positive_int(n, "n", 4096, "matmul_tflops"), positive_int(repeats, "repeats", 10, "matmul_tflops")
    if not (isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype.is_complex)):
        raise ConfigError(tr(f"matmul_tflops: dtype={dtype!r}; use a floating-point torch dtype such as "
                             "torch.float32 or torch.bfloat16.",
                             f"matmul_tflops: dtype={dtype!r} は使えません。torch.float32 や torch.bfloat16 のような"
                             "浮動小数点の dtype を指定してください。"))
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        _wait(device)
        t = time.perf_counter()
        torch.mm(a, b)
        _wait(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e12


class Timer:
    """A stopwatch that synchronises CUDA before each reading. Explained in 00_setup.

    GPU kernels run asynchronously: without a synchronise, ``time.perf_counter()`` measures how long it took
    to *queue* work, not to do it. d2l's ``Timer`` reads the clock directly; this one waits first. ``device`` is
    checked once, when the timer is made.
    """

    def __init__(self, device=None):
        self.device = None if device is None else check_device(device, "device")
        self.times = []
        self._start = None

    def start(self):
        """Start (or restart) the stopwatch."""
        _wait(self.device)
        self._start = time.perf_counter()

    def stop(self):
        """Stop the stopwatch, record the lap and return its length in seconds."""
        if self._start is None:
            raise ConfigError(tr("Timer.stop() called before Timer.start(); start the stopwatch first (or use "
                                 "`with timer:`).",
                                 "Timer.start() より前に Timer.stop() が呼ばれました。先に計測を始めるか、"
                                 "`with timer:` を使ってください。"))
        _wait(self.device)
        self.times.append(time.perf_counter() - self._start)
        self._start = None
        return self.times[-1]

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def avg(self):
        """Mean lap time in seconds; an error before the first lap (an average of nothing is not 0 s)."""
        if not self.times:
            raise ConfigError(tr("Timer.avg(): no lap was recorded yet; time something first (start/stop or "
                                 "`with timer:`).",
                                 "Timer.avg(): まだ 1回も計測していません。先に start/stop か `with timer:` で"
                                 "計測してください。"))
        return sum(self.times) / len(self.times)

    def sum(self):
        """Total of all laps in seconds."""
        return sum(self.times)

    def cumsum(self):
        """Running totals of the laps."""
        return list(itertools.accumulate(self.times))
