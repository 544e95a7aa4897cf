"""Timing that tells the truth on GPUs, and a running sum of metrics. Explained in 00_setup."""
import time

import torch


def synchronize(device=None):
    """Wait for queued GPU work so a clock reading includes it (no-op without CUDA). Explained in 00_setup."""
    if torch.cuda.is_available():
        if device is None or torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)


def matmul_tflops(device, dtype=torch.float32, n=4096, repeats=10):
    """Best TFLOP/s of an n x n by n x n matrix product (2 n^3 FLOPs), synchronised. Explained in 07_performance.

    The fastest of ``repeats`` runs after one warm-up: a measured peak for this device and precision, the
    ceiling that the performance chapter and its benchmark compare a training step against.
    """
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e12


class Timer:
    """A stopwatch that synchronises CUDA before each reading. Explained in 00_setup.

    GPU kernels run asynchronously: without a synchronise, ``time.perf_counter()`` measures how long it took
    to *queue* work, not to do it. d2l's ``Timer`` reads the clock directly; this one waits first.
    """

    def __init__(self, device=None):
        self.device = device
        self.times = []
        self._start = None

    def start(self):
        """Start (or restart) the stopwatch."""
        synchronize(self.device)
        self._start = time.perf_counter()

    def stop(self):
        """Stop the stopwatch, record the lap and return its length in seconds."""
        if self._start is None:
            raise RuntimeError("Timer.stop() called before Timer.start().")
        synchronize(self.device)
        self.times.append(time.perf_counter() - self._start)
        self._start = None
        return self.times[-1]

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def avg(self):
        """Mean lap time in seconds."""
        return sum(self.times) / len(self.times) if self.times else 0.0

    def sum(self):
        """Total of all laps in seconds."""
        return sum(self.times)

    def cumsum(self):
        """Running totals of the laps."""
        out, total = [], 0.0
        for t in self.times:
            total += t
            out.append(total)
        return out


class Accumulator:
    """Sums ``n`` running quantities, e.g. (loss sum, correct, count). Explained in 05_multi_gpu_resnet."""

    def __init__(self, n):
        self.data = [0.0] * n

    def add(self, *args):
        if len(args) != len(self.data):
            raise ValueError(f"Accumulator holds {len(self.data)} values, got {len(args)}.")
        self.data = [a + float(b) for a, b in zip(self.data, args)]

    def reset(self):
        self.data = [0.0] * len(self.data)

    def __getitem__(self, i):
        return self.data[i]
