"""Timing that tells the truth on GPUs: a synchronising stopwatch and a measured matmul peak. Explained in 00_setup.

:func:`measure` is the course's one way to time a short operation (communication, a schedule, a step): warm-up
calls, then repeats until both a minimum total duration and a minimum count are reached, the device synchronised
around each call; it returns a :class:`Timing` with the median, the spread and the machine's load average before
and after, so that a number measured on a busy machine says so.
"""
import itertools
import os
import statistics
import time
from dataclasses import dataclass

import torch

from .checks import finite_float, positive_int
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


BUSY_LOAD_PER_CORE = 0.3  # 1-minute load average per core above which a measurement is marked busy


def load_average():
    """The machine's 1-minute load average, or None where the system has none. Explained in 08_collectives."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # e.g. Windows
        return None


@dataclass(frozen=True)
class Timing:
    """Seconds of repeated calls with their median, spread and the load around them. Explained in 08_collectives.

    ``times``: one entry per timed call (after the warm-up). ``load_before`` / ``load_after``: the 1-minute load
    average when the timing began and ended (None where unknown); ``busy`` is true when either, divided by
    ``cores``, exceeds ``busy_per_core``: other work competed for the processors and the spread is to be trusted
    less. Quartiles are those of ``statistics.quantiles(..., method="inclusive")``.
    """

    times: tuple
    load_before: object = None
    load_after: object = None
    cores: int = 1
    busy_per_core: float = BUSY_LOAD_PER_CORE

    def __post_init__(self):
        if not self.times or any(not (t >= 0) for t in self.times):
            raise ConfigError(tr(f"Timing needs at least one non-negative time, not {list(self.times)[:5]}.",
                                 f"Timing には 0以上の時間が 1つ以上必要です（{list(self.times)[:5]} ではなく）。"))
        object.__setattr__(self, "times", tuple(float(t) for t in self.times))

    @property
    def median(self):
        """The median time in seconds."""
        return statistics.median(self.times)

    @property
    def quartiles(self):
        """``(q1, q3)``, the first and third quartiles in seconds (both the one time when there is one)."""
        if len(self.times) == 1:
            return self.times[0], self.times[0]
        q1, _, q3 = statistics.quantiles(self.times, n=4, method="inclusive")
        return q1, q3

    @property
    def iqr(self):
        """Interquartile range in seconds: ``q3 - q1``."""
        q1, q3 = self.quartiles
        return q3 - q1

    @property
    def load_per_core(self):
        """The larger of the two load averages divided by ``cores``; None if neither is known."""
        loads = [v for v in (self.load_before, self.load_after) if v is not None]
        return max(loads) / self.cores if loads else None

    @property
    def busy(self):
        """Whether the load per core exceeded ``busy_per_core`` before or after the timing."""
        per_core = self.load_per_core
        return per_core is not None and per_core > self.busy_per_core

    def summary(self):
        """A dict for JSON and tables: median, min, max, q1, q3, iqr (seconds), repeats, load and busy."""
        q1, q3 = self.quartiles
        return {"median": self.median, "min": min(self.times), "max": max(self.times), "q1": q1, "q3": q3,
                "iqr": q3 - q1, "repeats": len(self.times), "total": sum(self.times),
                "load_before": self.load_before, "load_after": self.load_after, "cores": self.cores,
                "busy": self.busy}


def measure(fn, *, warmup=1, min_seconds=0.05, min_repeats=5, max_repeats=10_000, device=None, before=None,
            across=None, clock=time.perf_counter, load=load_average, cores=None):
    """Time ``fn()``: warm up, then repeat until >= ``min_seconds`` and >= ``min_repeats``. Explained in 08_collectives.

    ``warmup`` untimed calls first (caches, allocations, connections). Then timed calls, each between two device
    synchronisations (``device``: None synchronises every GPU, a no-op without CUDA), until their total reaches
    ``min_seconds`` *and* there were ``min_repeats`` of them, or ``max_repeats`` were made. ``before()``, if given, runs
    untimed before every call (a barrier, refilling an input). ``across(values) -> values``: for a collective timed
    on every rank, the elementwise maximum over the ranks (:func:`slowest_rank`); every rank then decides to stop at
    the same repeat, and each call's time is the slowest rank's. ``clock`` and ``load`` are ``time.perf_counter`` and
    :func:`load_average` (replaceable, e.g. in tests). Returns a :class:`Timing`.
    """
    return measure_each({"fn": fn}, warmup=warmup, min_seconds=min_seconds, min_repeats=min_repeats,
                        max_repeats=max_repeats, device=device, before=before, across=across, clock=clock,
                        load=load, cores=cores)["fn"]


def measure_each(fns, *, warmup=1, min_seconds=0.05, min_repeats=5, max_repeats=10_000, device=None, before=None,
                 across=None, clock=time.perf_counter, load=load_average, cores=None):
    """Time several functions in turn, round by round, each as :func:`measure` times one. Explained in 11_sequence_context_experts.

    ``fns``: ``{name: fn}``. Each warm-up round and each timed round calls every function once, in order, so that a
    change in the machine's load falls on all of them alike. Rounds go on until there were ``min_repeats`` of them
    and together they took ``min_seconds`` (the sum over all functions: a cheap function does not make the costly
    ones repeat for its sake), or ``max_repeats`` rounds were made. The other options are those of :func:`measure`.
    Returns ``{name: Timing}`` (all with the same load averages, read before and after the rounds).
    """
    if not isinstance(fns, dict) or not fns or not all(callable(f) for f in fns.values()):
        raise ConfigError(tr(f"measure_each needs a dict of {{name: function}} with at least one entry, not {fns!r}.",
                             f"measure_each には 1つ以上の {{名前: 関数}} の dict が必要です（{fns!r} ではなく）。"))
    warmup = positive_int(warmup, "warmup", 1, "measure", minimum=0)
    min_repeats = positive_int(min_repeats, "min_repeats", 5, "measure")
    max_repeats = positive_int(max_repeats, "max_repeats", 10_000, "measure", minimum=min_repeats)
    min_seconds = finite_float(min_seconds, "min_seconds", 0.05, "measure", minimum=0)
    device = None if device is None else check_device(device, "device")
    cores = positive_int(cores if cores is not None else os.cpu_count() or 1, "cores", 2, "measure")
    start_load = load()
    for _ in range(warmup):
        for fn in fns.values():
            if before is not None:
                before()
            fn()
    _wait(device)
    times = {name: [] for name in fns}
    while True:
        for name, fn in fns.items():
            if before is not None:
                before()
            _wait(device)
            start = clock()
            fn()
            _wait(device)
            times[name].append(clock() - start)
        done = len(times[name])
        more = done < max_repeats and (done < min_repeats or sum(map(sum, times.values())) < min_seconds)
        if across is not None and done < max_repeats:
            more = across([1.0 if more else 0.0])[0] > 0  # continue while any rank wants more
        if not more:
            break
    if across is not None:
        times = {name: across(t) for name, t in times.items()}
    end_load = load()
    return {name: Timing(tuple(t), start_load, end_load, cores) for name, t in times.items()}


def slowest_rank(values, group=None):
    """The elementwise maximum of ``values`` over the ranks of ``group``: ``across=`` for :func:`measure`. Explained in 09_sharding.

    Every rank of the process group calls it with as many numbers and gets the same list back: for times, each
    call's time as the slowest rank saw it (a step of synchronous training lasts as long as its slowest rank).
    The numbers travel as float64 on the device the backend needs (a GPU for nccl, else the CPU).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(tr("slowest_rank needs a process group: call it inside a worker started by "
                             "mparlib.launch.launch (or after torch.distributed.init_process_group).",
                             "slowest_rank にはプロセスグループが必要です。mparlib.launch.launch で起動したワーカーの中"
                             "（または torch.distributed.init_process_group のあと）で呼んでください。"))
    on_gpu = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()
