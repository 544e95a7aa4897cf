"""Worker functions for tests/test_lang_timing.py: importable by the spawned ranks (the tests folder is on sys.path)."""
import time

import torch.distributed as dist

from mparlib.timing import measure, slowest_rank


def _everyone(value):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def slowest_of(values_by_rank):
    """Every rank's result of slowest_rank on its own row of values_by_rank."""
    return _everyone(slowest_rank(values_by_rank[dist.get_rank()]))


def timed_sleeps(seconds_by_rank, min_seconds):
    """Each rank times its own sleep; returns every rank's (Timing times, local times read from its own clock)."""
    readings = []

    def clock():  # the real clock, remembered: consecutive pairs of readings are this rank's own times
        readings.append(time.perf_counter())
        return readings[-1]

    pause = seconds_by_rank[dist.get_rank()]
    t = measure(lambda: time.sleep(pause), warmup=1, min_seconds=min_seconds, min_repeats=3, clock=clock,
                before=dist.barrier, across=slowest_rank)
    local = [b - a for a, b in zip(readings[::2], readings[1::2])]
    return _everyone((list(t.times), local))
