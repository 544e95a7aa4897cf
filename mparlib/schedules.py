"""Pipeline schedules across processes, timed: when every stage works on every micro-batch, and the bubble.

Chapter 04's :class:`mparlib.hybrid.PipelineModel` runs the stages in one process, one device after another; here
``torch.distributed.pipelining`` runs a model cut into stages, one per rank, under a schedule such as GPipe or
1F1B. :class:`StageTimes` wraps a ``PipelineStage`` so that it notes when each forward and backward of a
micro-batch starts and ends; :func:`bubble_fraction` turns the notes of all ranks into the share of time the
ranks sat idle, to set beside :func:`bubble_formula`, ``(p - 1) / (m + p - 1)``;
:func:`mparlib.diagrams.draw_timeline` draws the notes. :func:`measure_bubble` is the experiment of the chapter and
of ``benchmarks/pipeline.py``: stages of equal compute (:func:`uniform_stage`), every schedule and number of
micro-batches, busy intervals measured on each rank.

Chapter 12 goes beyond one stage per rank: interleaved 1F1B places ``v`` stages on each rank in a loop, the
zero-bubble schedules split the backward into an input-gradient and a weight-gradient pass, and ZBV and DualPipeV
place two stages in a V (:func:`stage_indices`, :func:`check_micro_batches`). :func:`simulate_schedule` replays
torch's order of passes with fixed times; :func:`measure_schedules` runs the schedules on real ranks, checks their
gradients against one process, and measures their bubbles and the activations they hold (:func:`in_flight`,
:func:`saved_bytes`).
Explained in 10_model_parallel.
"""
import time
from statistics import median

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .checks import finite_float, int_in, one_of, positive_int
from .errors import ConfigError
from .lang import tr
from .rendezvous import device as rank_device
from .timing import synchronize


# name: (torch class, placement of a rank's stages, stages per rank)
_SCHEDULES = {"gpipe": ("ScheduleGPipe", "single", 1), "1f1b": ("Schedule1F1B", "single", 1),
              "interleaved1f1b": ("ScheduleInterleaved1F1B", "loop", 2),
              "interleavedzb": ("ScheduleInterleavedZeroBubble", "loop", 2),
              "zbv": ("ScheduleZBVZeroBubble", "v", 2), "dualpipev": ("ScheduleDualPipeV", "v", 2)}


def schedule_class(name):
    """The ``torch.distributed.pipelining`` schedule called ``name`` (``"gpipe"``, ``"1f1b"``...). Explained in 10_model_parallel.

    Chapter 10 runs ``"gpipe"`` and ``"1f1b"`` (one stage per rank); chapter 12 adds ``"interleaved1f1b"`` and
    ``"interleavedzb"`` (stages placed in a loop) and ``"zbv"`` and ``"dualpipev"`` (V placement), which take a list
    of the rank's stages (:func:`stage_indices`). Explained further in 12_planning.
    """
    from torch.distributed import pipelining  # 2 s to import: only when a pipeline runs

    class_name = _SCHEDULES[one_of(name, "schedule", tuple(_SCHEDULES), "schedule_class")][0]
    if not hasattr(pipelining, class_name):
        raise ConfigError(tr(f"schedule {name!r} ({class_name}) is not in torch {torch.__version__}; it came with a "
                             "later release (ScheduleDualPipeV with 2.9). Upgrade torch, or use another schedule.",
                             f"スケジュール {name!r}（{class_name}）は torch {torch.__version__} にありません。"
                             "後のリリースで加わりました（ScheduleDualPipeV は 2.9）。torch を更新するか、別の"
                             "スケジュールを使ってください。"))
    return getattr(pipelining, class_name)


def stage_indices(schedule, rank, world, stages_per_rank=None):
    """The indices of the stages rank ``rank`` of ``world`` holds under ``schedule``. Explained in 12_planning.

    One stage per rank (``"gpipe"``, ``"1f1b"``): ``(rank,)``. Looped (``"interleaved1f1b"``, ``"interleavedzb"``):
    ``rank, rank + world, rank + 2 world, ...``, ``stages_per_rank`` (``v``, 2 by default) of them, so a micro-batch
    goes round the ranks ``v`` times. V (``"zbv"``, ``"dualpipev"``): ``(rank, 2 world - 1 - rank)``, down the ranks
    and back up, so rank 0 holds both the first stage and the last (it computes the loss).
    """
    one_of(schedule, "schedule", tuple(_SCHEDULES), "stage_indices")
    world = positive_int(world, "world", 2, "stage_indices")
    rank = int_in(rank, "rank", 0, world - 1, 0, "stage_indices")
    _, placement, fixed = _SCHEDULES[schedule]
    v = fixed if stages_per_rank is None else positive_int(stages_per_rank, "stages_per_rank", fixed, "stage_indices")
    if placement != "loop" and v != fixed or placement == "loop" and v < 2:
        raise ConfigError(tr(f"stage_indices: schedule={schedule!r} cannot place {v} stage(s) on a rank; "
                             + ("use 2 or more." if placement == "loop" else "leave stages_per_rank out."),
                             f"stage_indices: schedule={schedule!r} では 1つのランクに {v}個のステージは置けません。"
                             + ("2 以上にしてください。" if placement == "loop" else "stages_per_rank を省いてください。")))
    if placement == "single":
        return (rank,)
    if placement == "v":
        return (rank, 2 * world - 1 - rank)
    return tuple(rank + k * world for k in range(v))


def check_micro_batches(schedule, world, micro_batches):
    """``micro_batches`` if ``schedule`` can run it on ``world`` ranks, else a clear error. Explained in 12_planning.

    What torch requires, checked before torch is asked: 1F1B at least as many micro-batches as ranks; DualPipeV at
    least as many as stages (``2 world``); the interleaved schedules cut the micro-batches into rounds of
    ``world`` (``max(1, m // world)`` rounds) and need ``m`` to be a whole number of rounds.
    """
    one_of(schedule, "schedule", tuple(_SCHEDULES), "check_micro_batches")
    world = positive_int(world, "world", 2, "check_micro_batches")
    m = positive_int(micro_batches, "micro_batches", 2 * world, "check_micro_batches")
    least = {"1f1b": world, "dualpipev": 2 * world}.get(schedule, 1)
    if m < least:
        raise ConfigError(tr(f"{schedule} on {world} ranks needs at least {least} micro-batches, not "
                             f"micro_batches={m}: with fewer, the pipeline never fills. Use {least} or more.",
                             f"{world}個のランクでの {schedule} には {least}個以上のマイクロバッチが必要で、"
                             f"micro_batches={m} では足りません（パイプラインが満ちません）。{least} 以上にしてください。"))
    rounds = max(1, m // world)
    if schedule.startswith("interleaved") and m % rounds:
        good = [k for k in range(max(1, m - world), m + world + 1) if k % max(1, k // world) == 0]
        raise ConfigError(tr(f"{schedule} on {world} ranks runs micro-batches in rounds of {world}: "
                             f"micro_batches={m} makes {rounds} rounds and {m % rounds} left over. Use a multiple of "
                             f"the rounds, e.g. one of {good}.",
                             f"{world}個のランクでの {schedule} は、マイクロバッチを {world}個ずつの回に分けて流します。"
                             f"micro_batches={m} では {rounds}回に分けて {m % rounds}個が余ります。回数の倍数"
                             f"（例えば {good} のどれか）にしてください。"))
    return m


BUBBLE_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "zbv")  # the schedules bubble_formula knows


def bubble_formula(num_stages, micro_batches, *, schedule="1f1b", stages_per_rank=None):
    """The idle share of a step for equal stages under ``schedule``. Explained in 10_model_parallel.

    ``num_stages`` is the number of pipeline ranks ``p``; each holds ``stages_per_rank`` (``v``) stages (left out:
    the schedule's own number: 2 for ``"zbv"``, else 1, so that interleaved 1F1B is then plain 1F1B). For
    ``"gpipe"`` and ``"1f1b"`` (``v = 1``) it is ``(p - 1) / (m + p - 1)``: each rank is busy for ``m`` micro-batches'
    worth of forward and backward work out of a step that lasts ``m + p - 1`` of them (the first micro-batch needs
    ``p - 1`` steps to reach the last stage, and its gradient as many to come back); 1F1B keeps fewer activations
    alive, not a smaller bubble. ``"interleaved1f1b"`` fills and drains the pipeline with stages ``v`` times
    smaller: idle ``(p - 1) / v`` against busy ``m``, a share of ``(p - 1) / (v m + p - 1)`` (the "(p - 1) / (v m)"
    of Narayanan et al., 2021, is the same idle time divided by the busy time). ``"zbv"`` (zero bubble, V placement,
    ``v = 2``; Qi et al., 2024) splits the backward into an input-gradient pass B and a weight-gradient pass W and
    lets the W passes, which nobody waits for, fill the gaps. With F, B and W of a stage all taking the same time
    ``t``, a rank is busy ``6 m t`` (two stages, three passes each) and, once ``m >= 2p - 1``, idle only ``(p - 1) t``:
    rank ``r`` waits ``r`` forwards for its first input and finishes ``p - 1 - r`` passes before the last rank does.
    That idle time does not grow with ``m``, so the share ``(p - 1) / (6 m + p - 1)`` falls towards 0, the "zero
    bubble" of the paper, which lets the next step start on each rank when it is done. With fewer micro-batches
    torch's order leaves ``2 (2p - 1 - m)`` passes idle instead, when that is more (counted on
    :func:`simulate_schedule`). Explained further in 12_planning.
    """
    positive_int(num_stages, "num_stages", 4, "bubble_formula")
    positive_int(micro_batches, "micro_batches", 8, "bubble_formula")
    one_of(schedule, "schedule", BUBBLE_SCHEDULES, "bubble_formula")
    fixed = {"gpipe": 1, "1f1b": 1, "zbv": 2}.get(schedule)
    v = positive_int((fixed or 1) if stages_per_rank is None else stages_per_rank, "stages_per_rank", 2,
                     "bubble_formula")
    if fixed is not None and v != fixed:
        raise ConfigError(tr(f"bubble_formula: schedule={schedule!r} places {fixed} stage(s) on each rank, not "
                             f"stages_per_rank={v}; leave stages_per_rank out.",
                             f"bubble_formula: schedule={schedule!r} では各ランクのステージは {fixed}個で、"
                             f"stages_per_rank={v} ではありません。stages_per_rank を省いてください。"))
    p, m = num_stages, micro_batches
    if schedule == "zbv":
        idle = max(p - 1, 2 * (2 * p - 1 - m))  # in passes of one stage
        return idle / (idle + 6 * m)
    return (p - 1) / (v * m + p - 1)


class StageTimes:
    """Wraps a ``PipelineStage`` to note when each forward and backward starts and ends. Explained in 10_model_parallel.

    The schedule calls the stage's ``forward_one_chunk`` and ``backward_one_chunk`` once per micro-batch; the
    wrapped methods append ``(kind, micro_batch, start, end)`` to :attr:`records`, times in seconds of
    ``time.perf_counter`` (one clock shared by all processes of a machine). ``kind`` is ``"F"`` (forward), ``"B"``
    (the whole backward), or, under a zero-bubble schedule, which splits the backward in two, ``"I"`` (the gradient
    of the stage's input, ``backward_one_chunk(..., full_backward=False)``, which the previous stage waits for) and
    ``"W"`` (the gradients of the weights, ``backward_weight_one_chunk``, which nobody waits for). One
    ``StageTimes`` per stage: a rank with two stages has two; :func:`rank_notes` merges them. Only the stage's
    computation is timed, not the sends and receives around it. On a GPU the device is synchronised before each
    reading, so that the interval holds the kernels and not just their launch. Explained further in 12_planning.
    """

    def __init__(self, stage, device=None):
        self.stage, self.records, self.device = stage, [], device
        self.stage_index = getattr(stage, "stage_index", None)
        self._wrap("forward_one_chunk", lambda kwargs: "F")
        self._wrap("backward_one_chunk", lambda kwargs: "B" if kwargs.get("full_backward", True) else "I")
        if hasattr(stage, "backward_weight_one_chunk"):  # stages of torch releases with zero-bubble schedules
            self._wrap("backward_weight_one_chunk", lambda kwargs: "W")

    def _now(self):
        if self.device is not None:
            synchronize(self.device)
        return time.perf_counter()

    def _wrap(self, method, kind_of):
        inner = getattr(self.stage, method)

        def timed(chunk_id, *args, **kwargs):
            start = self._now()
            out = inner(chunk_id, *args, **kwargs)
            self.records.append((kind_of(kwargs), chunk_id, start, self._now()))
            return out

        setattr(self.stage, method, timed)  # the schedule looks the method up on the stage object

    def clear(self):
        """Forget what was recorded (call before each step you mean to measure)."""
        self.records = []


def rank_notes(timers):
    """One rank's notes from its stages' :class:`StageTimes`, in time order. Explained in 12_planning.

    Each note is ``(kind, micro_batch, start, end, stage_index)``: the four fields of :attr:`StageTimes.records`
    and the stage it belongs to, so that a rank holding stages 0 and 3 has one list to draw and to count.
    """
    return sorted(((*note, t.stage_index) for t in timers for note in t.records), key=lambda n: n[2])


def bubble_fraction(records_per_rank):
    """The idle share of one step, from every rank's ``(kind, micro_batch, start, end, ...)`` notes. Explained in 10_model_parallel.

    The step lasts from the first start to the last end over all ranks; each rank is busy for the union of its
    intervals (a rank with several stages, merged by :func:`rank_notes` or given as a list of lists, one per stage,
    is still one rank); the bubble is ``1 - total busy / (ranks x step)``. Waiting for a message counts as idle.
    """
    ranks = [[n for part in rank if part for n in ([part] if isinstance(part[0], str) else part)]
             for rank in records_per_rank]  # a note starts with its kind; a stage's list starts with a note
    if not ranks or any(not rank for rank in ranks):
        raise ConfigError(tr("bubble_fraction needs the notes of every rank, each with at least one interval.",
                             "bubble_fraction には、すべてのランクの記録（それぞれ 1つ以上の区間）が必要です。"))
    span = max(n[3] for rank in ranks for n in rank) - min(n[2] for rank in ranks for n in rank)
    busy = 0.0
    for rank in ranks:  # the union of the rank's intervals: overlapping ones are counted once
        reach = None
        for _, _, start, end, *_ in sorted(rank, key=lambda n: n[2]):
            if reach is None or start > reach:
                busy, reach = busy + end - start, end
            elif end > reach:
                busy, reach = busy + end - reach, end
    return 1 - busy / (len(ranks) * span)


def in_flight(notes, release="I"):
    """The most micro-batch activations one rank holds at once, from its notes. Explained in 12_planning.

    A ``(stage, micro_batch)`` pair is held from its forward ``"F"`` until its backward: ``release="I"`` counts it
    until the input-gradient pass (``"I"``, or the whole backward ``"B"``), the count usually quoted for a
    schedule; ``release="W"`` until the weight-gradient pass (``"W"`` or ``"B"``), since the weight gradient still
    needs each layer's input. Only the order of the notes matters, not their times.
    """
    one_of(release, "release", ("I", "W"), "in_flight")
    held, most = set(), 0
    for kind, i, *rest in notes:
        stage = rest[2] if len(rest) > 2 else 0  # notes of rank_notes name their stage; StageTimes' do not
        if kind == "F":
            held.add((stage, i))
            most = max(most, len(held))
        elif kind == "B" or kind == release:
            held.discard((stage, i))
    return most


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


def _order(schedule, world, micro_batches):
    """Each rank's compute actions ``(kind, stage, micro_batch)`` in the order torch runs them."""
    m = micro_batches
    if schedule == "gpipe":
        return [[("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(world)]
    if schedule == "1f1b":  # rank r runs world - r forwards, then one backward and one forward in turn
        orders = []
        for r in range(world):
            warm = min(m, world - r)
            steady = [a for i in range(m - warm) for a in (("B", r, i), ("F", r, warm + i))]
            orders.append([("F", r, i) for i in range(warm)] + steady + [("B", r, i) for i in range(m - warm, m)])
        return orders
    try:
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops  # torch's own planner
    except ImportError:
        raise ConfigError(tr(f"simulate_schedule replays torch's own order of passes, which torch "
                             f"{torch.__version__} does not expose (torch.distributed.pipelining._schedule_visualizer "
                             "came with 2.8). Upgrade torch to replay a schedule.",
                             f"simulate_schedule は torch 自身のパスの順序を再現しますが、torch {torch.__version__} は"
                             "それを公開していません（torch.distributed.pipelining._schedule_visualizer は 2.8 で"
                             "加わりました）。スケジュールを再現するには torch を更新してください。")) from None

    ops = get_schedule_ops(schedule_class(schedule), world, m)
    flat = [[s for a in rank if a is not None for s in (a.sub_actions or (a,))] for rank in ops]
    return [[(str(a.computation_type.value), a.stage_index, a.microbatch_index) for a in rank
             if str(a.computation_type.value) in "FBIW"] for rank in flat]


def simulate_schedule(schedule, world, micro_batches, times=(1.0, 1.0, 1.0)):
    """Every rank's notes of ``schedule`` with fixed pass times and instant messages. Explained in 12_planning.

    The order of each rank's passes is torch's own; a pass starts when its rank is free and what it needs is done
    (the forward of the previous stage, the input gradient of the next one, the stage's own forward; a weight
    gradient after its input gradient). ``times = (t_f, t_b, t_w)`` are a stage's forward, input-gradient and
    weight-gradient times; a whole backward ``"B"`` takes ``t_b + t_w``. Returns notes in the form of
    :func:`rank_notes`, to give to :func:`bubble_fraction`, :func:`in_flight` or ``draw_timeline``.
    """
    world = positive_int(world, "world", 2, "simulate_schedule")
    check_micro_batches(schedule, world, micro_batches)
    t_f, t_b, t_w = (finite_float(t, name, 1.0, "simulate_schedule") for t, name in zip(times, ("t_f", "t_b", "t_w")))
    last = world * _SCHEDULES[schedule][2] - 1
    cost = {"F": t_f, "I": t_b, "W": t_w, "B": t_b + t_w}
    queues, done = _order(schedule, world, micro_batches), {}
    free, notes = [0.0] * world, [[] for _ in range(world)]
    while any(queues):
        moved = False
        for r, queue in enumerate(queues):
            while queue:
                kind, s, i = queue[0]
                needs = {"F": [("F", s - 1, i)] if s > 0 else [],
                         "W": [("I", s, i)]}.get(kind, [("F", s, i)] + ([("I", s + 1, i)] if s < last else []))
                if any(n not in done for n in needs):
                    break
                start = max([free[r]] + [done[n] for n in needs])
                free[r] = start + cost[kind]
                done[(kind, s, i)] = free[r]
                if kind == "B":
                    done[("I", s, i)] = free[r]  # a whole backward gives the input gradient too
                notes[r].append((kind, i, start, free[r], s))
                queue.pop(0)
                moved = True
        if not moved:
            raise RuntimeError(f"simulate_schedule: {schedule} waits on itself (world={world}, m={micro_batches})")
    return notes


def saved_bytes(module, rows, width, dtype=torch.float64):
    """Bytes autograd keeps for the backward of one micro-batch of ``rows`` through ``module``. Explained in 12_planning.

    Counted with ``torch.autograd.graph.saved_tensors_hooks`` on one forward of ``(rows, width)``: every tensor
    saved for the backward, each storage once, the module's parameters left out (they are not activations).
    """
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    device = next(module.parameters()).device
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(torch.randn(rows, width, dtype=dtype, device=device, requires_grad=True))
    return sum(seen.values())


def _parity(full, named_grads, x, target):
    """Largest difference between the pipeline's gradients and one process's on the whole batch (rank 0)."""
    import copy

    whole = copy.deepcopy(full)
    whole.zero_grad(set_to_none=True)
    F.mse_loss(whole(x), target).backward()
    reference = {n: p.grad for n, p in whole.named_parameters()}
    if sorted(named_grads) != sorted(reference):
        return float("inf")
    return max((named_grads[n] - g).abs().max().item() for n, g in reference.items())


def _pass_times(notes_per_rank, statistic):
    kinds = {}
    for notes in notes_per_rank:
        for kind, _, start, end, _ in notes:
            kinds.setdefault(kind, []).append(end - start)
    return {k: statistic(v) for k, v in sorted(kinds.items())}


def without_self_messages(stage):
    """``stage`` without messages from its rank to itself when a schedule opens its links (gloo, torch before 2.14).

    Under the V placement (ZBV, DualPipeV) the middle rank holds two neighbouring stages. Before its first step,
    torch 2.11's schedule sends a one-element tensor to each neighbouring stage to open the links, including the
    neighbour on its own rank, and gloo cannot send from a rank to itself ("Pair is not connected"). torch 2.14
    skips neighbours on the same rank, as this does; between them the schedule hands tensors over in memory.
    :func:`measure_schedules` applies it to every stage. Explained in 12_planning.
    """
    opening = getattr(stage, "_get_init_p2p_neighbors_ops", None)  # a private method: gone in some future release
    if opening is not None:
        me = dist.get_rank(stage.group)
        stage._get_init_p2p_neighbors_ops = lambda: [op for op in opening() if op.group_peer != me]
    return stage


def _run_schedule(full, name, m, x, target, steps, warmup):
    """One schedule on this rank: the notes of every step, the gradients of the first, in-flight counts."""
    from torch.distributed.pipelining import PipelineStage

    rank, world, dev = dist.get_rank(), dist.get_world_size(), x.device
    indices = stage_indices(name, rank, world)
    total = world * len(indices)
    per = len(full) // total  # modules (Linear and tanh) in one stage
    timers = [StageTimes(without_self_messages(PipelineStage(full[k * per:(k + 1) * per], k, total, dev)), dev)
              for k in indices]
    stages = [t.stage for t in timers]
    runner = schedule_class(name)(stages if len(stages) > 1 else stages[0], n_microbatches=m, loss_fn=F.mse_loss)
    args = (x,) if 0 in indices else ()
    kwargs = {"target": target} if total - 1 in indices else {}
    bubbles, grads = [], None
    for step in range(warmup + steps):
        full.zero_grad(set_to_none=True)
        for t in timers:
            t.clear()
        dist.barrier()
        runner.step(*args, **kwargs)
        notes = [None] * world
        dist.all_gather_object(notes, rank_notes(timers))
        if step == 0:  # the gradients of the first step, for the comparison with one process
            grads = [None] * world
            mine = {n: p.grad.cpu() for k in indices for n, p in full[k * per:(k + 1) * per].named_parameters()}
            dist.all_gather_object(grads, mine)
        if step >= warmup:
            bubbles.append(bubble_fraction(notes))
    zero = min(n[2] for rank_notes_ in notes for n in rank_notes_)
    notes = [[(k, i, s - zero, e - zero, st) for k, i, s, e, st in rn] for rn in notes]
    return {"bubbles": bubbles, "notes": notes, "grads": {n: g for part in grads for n, g in part.items()},
            "stage_modules": per}


def measure_schedules(schedules=("1f1b", "interleaved1f1b", "zbv", "dualpipev"), micro_batches=(4, 8), width=256,
                      layers=8, micro_batch_size=32, steps=3, warmup=1, seed=0, dtype=torch.float64):
    """Worker: parity, bubble, timeline and activations in flight of each schedule and ``m``. Explained in 12_planning.

    Run it in ``p`` processes. Every rank builds the same model of ``layers`` x (``Linear(width, width)``, tanh)
    (:func:`uniform_stage`) and keeps the stages :func:`stage_indices` gives it, cut from that one model: under 1F1B
    ``p`` stages of ``layers / p`` layers, under the two-stage schedules ``2p`` stages of half that, so the whole
    model is the same for every schedule (``layers`` must divide by ``2p``). For each ``m`` (micro-batches of
    ``micro_batch_size`` rows) and schedule: ``warmup`` untimed steps, then ``steps`` timed ones between barriers.
    Rank 0 returns ``{schedule: {m: entry}}``, ``entry`` with ``"parity"`` (largest difference of any parameter's
    gradient in the first step from one process on the whole batch, same dtype), ``"measured"`` (median bubble),
    ``"steps"`` (each step's bubble), ``"formula"`` (:func:`bubble_formula`, or ``None`` if it has none),
    ``"simulated"`` (:func:`simulate_schedule` with this run's median pass times), ``"notes"`` (every rank's notes
    of the last step, seconds from its first start), ``"passes"`` and ``"fastest"`` (median and shortest seconds
    per kind of pass; on a shared machine a pass can be slowed, never sped up, so the shortest is the work itself),
    ``"gap_per_pass"`` (how much longer the last step took than its replay with the median pass times, per pass of
    a rank: the time spent between passes, on messages and the schedule's own work),
    ``"in_flight"`` (per rank, until the input gradient and until the weight gradient), ``"saved_bytes"`` (one
    stage, one micro-batch; :func:`saved_bytes`) and ``"stage_layers"``. A schedule that cannot run ``m`` on ``p``
    ranks (:func:`check_micro_batches`) is left out of that ``m``.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    layers = positive_int(layers, "layers", 8, "measure_schedules")
    if layers % (2 * world):
        raise ConfigError(tr(f"measure_schedules: layers={layers} must divide into 2 x {world} equal stages; use a "
                             f"multiple of {2 * world}, e.g. {4 * world}.",
                             f"measure_schedules: layers={layers} を 2 x {world}個の等しいステージに分けられません。"
                             f"{2 * world} の倍数（例えば {4 * world}）にしてください。"))
    if not dist.is_initialized():
        raise ConfigError(tr("measure_schedules is a worker: run it in processes, e.g. "
                             "launch(schedules.measure_schedules, 2).",
                             "measure_schedules はワーカーです。launch(schedules.measure_schedules, 2) のように"
                             "プロセスの中で実行してください。"))
    rank, dev = dist.get_rank(), rank_device()
    torch.manual_seed(seed)
    full = uniform_stage(width, layers).to(dev, dtype)
    results = {}
    for m in micro_batches:
        gen = torch.Generator().manual_seed(seed + m)
        x = torch.randn(m * micro_batch_size, width, generator=gen, dtype=dtype).to(dev)
        target = torch.randn(m * micro_batch_size, width, generator=gen, dtype=dtype).to(dev)
        for name in schedules:
            try:
                check_micro_batches(name, world, m)
            except ConfigError:
                continue
            run = _run_schedule(full, name, m, x, target, steps, warmup)
            if rank == 0:
                results.setdefault(name, {})[m] = _entry(full, name, m, run, x, target, micro_batch_size, width)
    return results if rank == 0 else None


def _entry(full, name, m, run, x, target, rows, width):
    """What rank 0 reports of one schedule and ``m``."""
    world, per = len(run["notes"]), run["stage_modules"]
    passes = _pass_times(run["notes"], median)
    t_f = passes["F"]
    t_b = passes.get("I", passes.get("B", 0.0) / 2)
    t_w = passes.get("W", passes.get("B", 0.0) / 2)
    replay = simulate_schedule(name, world, m, (t_f, t_b, t_w))

    def span(notes):
        return max(n[3] for rank in notes for n in rank) - min(n[2] for rank in notes for n in rank)

    passes_per_rank = sum(len(rank) for rank in run["notes"]) / world
    v = _SCHEDULES[name][2]
    formula = bubble_formula(world, m, schedule=name, stages_per_rank=v) if name in BUBBLE_SCHEDULES else None
    return {"parity": _parity(full, run["grads"], x, target), "measured": median(run["bubbles"]),
            "steps": run["bubbles"], "formula": formula, "simulated": bubble_fraction(replay), "notes": run["notes"],
            "gap_per_pass": (span(run["notes"]) - span(replay)) / passes_per_rank,
            "passes": passes, "fastest": _pass_times(run["notes"], min), "stage_layers": per // 2,
            "in_flight": [{"I": in_flight(n, "I"), "W": in_flight(n, "W")} for n in run["notes"]],
            "saved_bytes": saved_bytes(full[:per], rows, width, x.dtype)}
