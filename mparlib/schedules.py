"""Pipeline schedules across processes, timed: when every stage works on every micro-batch, and the bubble.

Chapter 04's :class:`mparlib.hybrid.PipelineModel` runs the stages in one process, one device after another; here
``torch.distributed.pipelining`` runs a model cut into stages, one per rank, under a schedule such as GPipe or
1F1B. :class:`StageTimes` wraps a ``PipelineStage`` so that it notes when each forward and backward of a
micro-batch starts and ends; :func:`bubble_fraction` turns the notes of all ranks into the share of time the
ranks sat idle, to set beside :func:`bubble_formula`, ``(p - 1) / (m + p - 1)``;
:func:`mparlib.diagrams.draw_timeline` draws the notes. :func:`measure_bubble` is the experiment of the chapter and
of ``benchmarks/pipeline.py``: stages of equal compute (:func:`uniform_stage`), every schedule and number of
micro-batches, busy intervals measured on each rank.
Explained in 10_model_parallel.
"""
import time
from statistics import median

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .checks import one_of, positive_int
from .errors import ConfigError
from .lang import tr
from .rendezvous import device as rank_device
from .timing import synchronize


def schedule_class(name):
    """The ``torch.distributed.pipelining`` schedule called ``"gpipe"`` or ``"1f1b"``. Explained in 10_model_parallel."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe  # 2 s to import: only when a pipeline runs

    schedules = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    return schedules[one_of(name, "schedule", tuple(schedules), "schedule_class")]


BUBBLE_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "zbv")  # the schedules bubble_formula knows


def bubble_formula(num_stages, micro_batches, *, schedule="1f1b", stages_per_rank=None):
    """The idle share of a step for equal stages under ``schedule``. Explained in 10_model_parallel.

    ``num_stages`` is the number of pipeline ranks ``p``; each holds ``stages_per_rank`` (``v``) stages (left out:
    the schedule's own number, 2 for ``"zbv"``, else 1). For
    ``"gpipe"`` and ``"1f1b"`` (``v = 1``) it is ``(p - 1) / (m + p - 1)``: each rank is busy for ``m`` micro-batches'
    worth of forward and backward work out of a step that lasts ``m + p - 1`` of them (the first micro-batch needs
    ``p - 1`` steps to reach the last stage, and its gradient as many to come back); 1F1B keeps fewer activations
    alive, not a smaller bubble. ``"interleaved1f1b"`` fills and drains the pipeline with stages ``v`` times
    smaller: idle ``(p - 1) / v`` against busy ``m``, a share of ``(p - 1) / (v m + p - 1)`` (the "(p - 1) / (v m)"
    of Narayanan et al., 2021, is the same idle time divided by the busy time). ``"zbv"`` (zero bubble, V placement,
    ``v = 2``) is ``0``: with the backward split into an input-gradient pass B and a weight-gradient pass W, the W
    passes fill the gaps, exactly so when F, B and W take the same time (Qi et al., 2024). Explained further in
    12_planning.
    """
    positive_int(num_stages, "num_stages", 4, "bubble_formula")
    positive_int(micro_batches, "micro_batches", 8, "bubble_formula")
    one_of(schedule, "schedule", BUBBLE_SCHEDULES, "bubble_formula")
    fixed = {"gpipe": 1, "1f1b": 1, "zbv": 2}.get(schedule)
    if stages_per_rank is None:
        stages_per_rank = fixed or 1
    v = positive_int(stages_per_rank, "stages_per_rank", 2, "bubble_formula")
    if fixed is not None and v != fixed:
        raise ConfigError(tr(f"bubble_formula: schedule={schedule!r} places {fixed} stage(s) on each rank, not "
                             f"stages_per_rank={v}; leave stages_per_rank out.",
                             f"bubble_formula: schedule={schedule!r} では各ランクのステージは {fixed}個で、"
                             f"stages_per_rank={v} ではありません。stages_per_rank を省いてください。"))
    if schedule == "zbv":
        return 0.0
    p, m = num_stages, micro_batches
    return (p - 1) / (v * m + p - 1)


class StageTimes:
    """Wraps a ``PipelineStage`` to note when each forward and backward starts and ends. Explained in 10_model_parallel.

    The schedule calls the stage's ``forward_one_chunk`` and ``backward_one_chunk`` once per micro-batch; the
    wrapped methods append ``(kind, micro_batch, start, end)`` to :attr:`records`, ``kind`` ``"F"`` or ``"B"``,
    times in seconds of ``time.perf_counter`` (one clock shared by all processes of a machine). Only the stage's
    computation is timed, not the sends and receives around it. On a GPU the device is synchronised before each
    reading, so that the interval holds the kernels and not just their launch.
    """

    def __init__(self, stage, device=None):
        self.stage, self.records, self.device = stage, [], device
        for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B")):
            self._wrap(method, kind)

    def _now(self):
        if self.device is not None:
            synchronize(self.device)
        return time.perf_counter()

    def _wrap(self, method, kind):
        inner = getattr(self.stage, method)

        def timed(chunk_id, *args, **kwargs):
            start = self._now()
            out = inner(chunk_id, *args, **kwargs)
            self.records.append((kind, chunk_id, start, self._now()))
            return out

        setattr(self.stage, method, timed)  # the schedule looks the method up on the stage object

    def clear(self):
        """Forget what was recorded (call before each step you mean to measure)."""
        self.records = []


def bubble_fraction(records_per_rank):
    """The idle share of one step, from every rank's ``(kind, micro_batch, start, end)`` notes. Explained in 10_model_parallel.

    The step lasts from the first start to the last end over all ranks; each rank is busy for the sum of its
    intervals; the bubble is ``1 - total busy / (ranks x step)``. Waiting for a message counts as idle.
    """
    records = [r for rank in records_per_rank for r in rank]
    if not records or any(not rank for rank in records_per_rank):
        raise ConfigError(tr("bubble_fraction needs the notes of every rank, each with at least one interval.",
                             "bubble_fraction には、すべてのランクの記録（それぞれ 1つ以上の区間）が必要です。"))
    span = max(r[3] for r in records) - min(r[2] for r in records)
    busy = sum(r[3] - r[2] for r in records)
    return 1 - busy / (len(records_per_rank) * span)


def uniform_stage(width, layers):
    """A stage of ``layers`` x (``Linear(width, width)``, tanh): equal, non-trivial work per stage. Explained in 10_model_parallel.

    ``(B, width) -> (B, width)``. Every stage of the bubble experiment is one of these, so that forward and backward
    of a micro-batch take the same time on every rank, as the formula assumes.
    """
    return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())))


def measure_bubble(schedules=("gpipe", "1f1b"), micro_batches=(1, 2, 4, 8), width=512, layers=4,
                   micro_batch_size=32, steps=3, warmup=1, seed=0):
    """Worker: measure the bubble of each schedule and number of micro-batches. Explained in 10_model_parallel.

    Run it in ``p`` processes (``launch(measure_bubble, p, ...)``): rank ``r`` holds stage ``r`` of ``p`` equal
    stages (:func:`uniform_stage`). For every schedule and ``m`` it builds a fresh ``PipelineStage``, runs
    ``warmup`` untimed steps (the first one exchanges shapes), then ``steps`` timed ones, each between barriers,
    with ``m`` micro-batches of ``micro_batch_size`` rows (the micro-batch stays the same size, so the work per
    interval does not change with ``m``). Rank 0 returns ``{schedule: {m: {"measured", "formula", "steps",
    "records"}}}``: the median bubble over the timed steps, the formula's value, each step's bubble, and the
    notes of every rank in the last step, with times in seconds from that step's first start. 1F1B needs at least
    as many micro-batches as stages: smaller ``m`` are left out of its entry.
    """
    from torch.distributed.pipelining import PipelineStage

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = rank_device()
    torch.manual_seed(seed + rank)
    stage_module = uniform_stage(width, layers).to(dev)
    results = {}
    for name in schedules:
        results[name] = {}
        for m in micro_batches:
            if name == "1f1b" and m < world:  # 1F1B refuses fewer micro-batches than stages
                continue
            stage = PipelineStage(stage_module, rank, world, dev)
            timer = StageTimes(stage, dev)
            schedule = schedule_class(name)(stage, n_microbatches=m, loss_fn=F.mse_loss)
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(m * micro_batch_size, width, generator=gen).to(dev)
            target = torch.randn(m * micro_batch_size, width, generator=gen).to(dev)
            bubbles, notes = [], None
            for step in range(warmup + steps):
                timer.clear()
                dist.barrier()
                if rank == 0:
                    schedule.step(x)
                elif rank == world - 1:
                    schedule.step(target=target)
                else:
                    schedule.step()
                stage_module.zero_grad(set_to_none=True)
                notes = [None] * world
                dist.all_gather_object(notes, timer.records)
                if step >= warmup:
                    bubbles.append(bubble_fraction(notes))
            zero = min(r[2] for rank_notes in notes for r in rank_notes)
            notes = [[(k, i, s - zero, e - zero) for k, i, s, e in rank_notes] for rank_notes in notes]
            results[name][m] = {"measured": median(bubbles), "formula": bubble_formula(world, m),
                                "steps": bubbles, "records": notes}
    return results if rank == 0 else None
