"""Collective communication from point-to-point messages: the ring all-reduce, its schedule, and what it costs.

:func:`ring_all_reduce` sums a tensor over a process group with sends and receives alone, in the two phases that
gloo and nccl use for large messages: :func:`ring_reduce_scatter`, after which rank ``r`` holds the full sum of
chunk ``r`` (the layout of ``dist.reduce_scatter_tensor``), then :func:`ring_all_gather`, which passes the finished
chunks round the ring (the layout of ``dist.all_gather_into_tensor``). :func:`ring_schedule` is the chunk arithmetic
they follow (the figures of :mod:`mparlib.diagrams` are drawn from it too). :func:`time_collective` (built on
:func:`mparlib.timing.measure`), :func:`bandwidth_worker` and :func:`fit_alpha_beta` measure what a collective costs
and fit the latency-bandwidth model ``t = alpha + n * beta`` to it. Explained in 08_collectives.
"""
import threading
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .checks import one_of, positive_int
from .errors import ConfigError, LaunchError
from .lang import tr
from .rendezvous import device as rank_device
from .timing import measure


def chunk_bounds(n, k):
    """``n`` elements cut into ``k`` contiguous chunks ``[(start, stop), ...]``. Explained in 08_collectives.

    Sizes differ by at most one: the first ``n % k`` chunks are one element longer (as ``torch.tensor_split``
    cuts); with ``n < k`` some chunks are empty.
    """
    positive_int(n, "n", 10, "chunk_bounds", minimum=0)
    positive_int(k, "k", 4, "chunk_bounds")
    size, extra = divmod(n, k)
    starts = [c * size + min(c, extra) for c in range(k + 1)]  # the first `extra` chunks are one element longer
    return list(zip(starts[:-1], starts[1:]))


@dataclass(frozen=True)
class RingStep:
    """One step of the ring: rank ``r`` sends chunk ``send[r]`` to rank ``r+1`` and receives ``recv[r]`` from ``r-1``.

    Ranks count modulo ``k``. In the ``"reduce-scatter"`` phase the received chunk is added to the local one, in
    the ``"all-gather"`` phase it replaces it. Chunk ``c`` is ``bounds[c]`` (start, stop) of the flattened tensor.
    Explained in 08_collectives.
    """

    phase: str
    send: tuple
    recv: tuple
    bounds: tuple

    def label(self):
        """The phase's name as a reader of the current language calls it (GLOSSARY.md), for the tables and the
        figures of the ring. Explained in 08_collectives."""
        if self.phase == "reduce-scatter":
            return tr("reduce-scatter", "リデュース・スキャッター")
        return tr("all-gather", "オールギャザー")


def ring_schedule(n, k):
    """The ``2(k-1)`` steps of a ring all-reduce of ``n`` elements over ``k`` ranks. Explained in 08_collectives.

    Reduce-scatter, step ``s``: rank ``r`` sends chunk ``(r - s - 1) % k`` and adds the received chunk
    ``(r - s - 2) % k``; after ``k - 1`` steps rank ``r`` holds the full sum of chunk ``r``, the layout of
    ``dist.reduce_scatter_tensor``. All-gather, step ``s``: rank ``r`` sends chunk ``(r - s) % k`` (its own
    finished chunk first) and stores the received ``(r - s - 1) % k``, the layout of ``dist.all_gather_into_tensor``.
    What a rank receives is what its left neighbour sends: ``recv[r] == send[(r - 1) % k]``.
    """
    bounds = tuple(chunk_bounds(n, k))
    ranks = range(k)
    steps = [RingStep("reduce-scatter", tuple((r - s - 1) % k for r in ranks), tuple((r - s - 2) % k for r in ranks),
                      bounds) for s in range(k - 1)]
    steps += [RingStep("all-gather", tuple((r - s) % k for r in ranks), tuple((r - s - 1) % k for r in ranks),
                       bounds) for s in range(k - 1)]
    return steps


def ring_contents(k):
    """Which ranks' data each chunk of each rank holds, step by step through the ring. Explained in 08_collectives.

    Returns ``2(k-1) + 1`` states; ``states[t][r][c]`` is the frozenset of ranks summed into chunk ``c`` of rank
    ``r`` after ``t`` steps (``t = 0``: before the first). Simulated from :func:`ring_schedule`, with no messages.
    """
    state = [[frozenset({r}) for _ in range(k)] for r in range(k)]
    states = [state]
    for step in ring_schedule(k, k):
        new = [row[:] for row in state]
        for r in range(k):
            left, c = (r - 1) % k, step.recv[r]
            incoming = state[left][step.send[left]]
            new[r][c] = state[r][c] | incoming if step.phase == "reduce-scatter" else incoming
        states.append(new)
        state = new
    return states


def collective_patterns(k):
    """Where each collective puts whose data, for ``k`` ranks: ``{name: (before, after)}``. Explained in 08_collectives.

    The root of ``broadcast`` and ``reduce`` is rank 0. ``before[r][j]`` and ``after[r][j]`` are the frozensets
    of ``(rank, chunk)`` pieces summed into position ``j`` of rank ``r``'s tensor, or ``None`` where the collective
    reads or writes nothing (or leaves it unspecified). Rank ``r``'s own data is ``(r, j)`` at position ``j``; in
    ``all_gather`` each rank contributes one piece, ``(r, r)``, and ``reduce_scatter`` leaves rank ``r`` with
    position ``r`` only. ``tests/test_collectives.py`` checks these patterns against torch.distributed.
    """
    positive_int(k, "k", 4, "collective_patterns")
    ranks = range(k)
    own = [[frozenset({(r, j)}) for j in ranks] for r in ranks]
    total = [frozenset((q, j) for q in ranks) for j in ranks]  # position j summed over all ranks
    diagonal = [[frozenset({(r, r)}) if j == r else None for j in ranks] for r in ranks]
    return {
        "broadcast": (own, [list(own[0]) for _ in ranks]),
        "reduce": (own, [list(total) if r == 0 else [None] * k for r in ranks]),
        "all_reduce": (own, [list(total) for _ in ranks]),
        "reduce_scatter": (own, [[total[r] if j == r else None for j in ranks] for r in ranks]),
        "all_gather": (diagonal, [[frozenset({(j, j)}) for j in ranks] for _ in ranks]),
        "all_to_all": (own, [[frozenset({(j, r)}) for j in ranks] for r in ranks]),
    }


def _ring_ranks(group, where):
    if not dist.is_available() or not dist.is_initialized():
        raise LaunchError(tr(f"{where} needs a process group, and this process has none: run it inside a worker "
                             "started by mparlib.launch.launch (or torchrun) after init_process_group.",
                             f"{where} にはプロセスグループが必要ですが、このプロセスにはありません。"
                             "mparlib.launch.launch（または torchrun）で起動したワーカーの中で、init_process_group の"
                             "あとに呼び出してください。"))
    k, me = dist.get_world_size(group), dist.get_rank(group)
    if me < 0:
        raise ConfigError(tr(f"This process (global rank {dist.get_rank()}) is not a member of the group it was given: "
                             f"call {where} only on the ranks of the group.",
                             f"このプロセス（グローバルなランク {dist.get_rank()}）は、渡されたグループに属していません。"
                             f"{where} はグループのランクでだけ呼び出してください。"))
    group_ = group if group is not None else dist.group.WORLD
    return k, me, dist.get_global_rank(group_, (me + 1) % k), dist.get_global_rank(group_, (me - 1) % k)


PIECE_BYTES = 4 * 2**20  # a chunk larger than this travels as several messages, all posted in the same step
IN_USE = "in use"  # the key under which a running ring call marks the caller's `buffers` dict


def _receive_buffer(numel, dtype, device, buffers):
    """A 1-D buffer of at least ``numel`` elements for received chunks: the caller's ``buffers`` keep it, if given.

    Memory that was never touched costs a page fault for every page on its first write, which is what a receive
    into a fresh buffer does. Libraries keep their communication buffers for the same reason.
    """
    if buffers is None:  # allocated for this call, freed after it
        return torch.empty(numel, dtype=dtype, device=device)
    key = (device, dtype)
    if key not in buffers or buffers[key].numel() < numel:  # grown when a larger chunk comes
        buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffers[key]


def _pieces(start, stop, size):
    """``[start, stop)`` cut into consecutive ranges of at most ``size`` elements (one, maybe empty, if shorter)."""
    return [(a, min(a + size, stop)) for a in range(start, stop, size)] or [(start, stop)]


def _dtype_code(dtype):
    return zlib.crc32(str(dtype).encode())  # the same number in every process (hash() of a str is not)


def _check_agreement(tensor, group, k, where):
    """One small all-gather of (numel, dtype code): a clear error, naming the ranks, when the ranks disagree."""
    mine = torch.tensor([tensor.numel(), _dtype_code(tensor.dtype), int(tensor.dtype.is_floating_point)],
                        dtype=torch.int64, device=tensor.device)
    everyone = [torch.empty_like(mine) for _ in range(k)]
    dist.all_gather(everyone, mine, group=group)
    seen = [tuple(t.tolist()) for t in everyone]
    if len(set(seen)) == 1:
        return
    names = {_dtype_code(getattr(torch, n)): f"torch.{n}" for n in (
        "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
        "complex64", "complex128") if hasattr(torch, n)}
    kinds = {}
    for rank, (numel, code, _) in enumerate(seen):
        kinds.setdefault((numel, names.get(code, f"dtype code {code}")), []).append(str(rank))
    what = "; ".join(f"rank(s) {', '.join(r)}: {n} elements of {d}" for (n, d), r in kinds.items())
    what_ja = "。".join(f"ランク {'、'.join(r)}: {d} の要素 {n}個" for (n, d), r in kinds.items())
    mixed = len({f for _, _, f in seen}) > 1
    raise ConfigError(tr(f"{where}: the ranks disagree on the tensor ({what}). Every rank must pass a tensor with the "
                         "same number of elements and the same dtype"
                         + (" (integer and floating-point tensors cannot be summed together)" if mixed else "")
                         + "; cast or resize it on the ranks that differ.",
                         f"{where}: ランクによってテンソルが違います（{what_ja}）。すべてのランクが、要素数も dtype も"
                         "同じテンソルを渡す必要があります"
                         + ("（整数のテンソルと浮動小数点数のテンソルは足し合わせられません）" if mixed else "")
                         + "。違うランクで型か大きさをそろえてください。"))


def _prepare(tensor, group, buffers, piece_bytes, check, where):
    """The checks every ring call makes; ``(k, elements per message)``."""
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(tr(f"{where} needs a torch.Tensor, not {type(tensor).__name__}.",
                             f"{where} には torch.Tensor を渡してください（{type(tensor).__name__} ではなく）。"))
    if buffers is not None and not isinstance(buffers, dict):
        raise ConfigError(tr(f"{where}: buffers={type(buffers).__name__}; pass a dict that you keep between "
                             "calls (buffers={}), or None.",
                             f"{where}: buffers={type(buffers).__name__} です。呼び出しをまたいで持ち続ける"
                             " dict（buffers={}）か None を渡してください。"))
    piece_bytes = positive_int(piece_bytes, "piece_bytes", PIECE_BYTES, where)
    k = _ring_ranks(group, where)[0]
    if check and k > 1:
        _check_agreement(tensor, group, k, where)
    return k, max(1, piece_bytes // tensor.element_size())


def _contiguous(tensor, where):
    if not tensor.is_contiguous():
        raise ConfigError(tr(f"{where} works on the chunks of a contiguous tensor; pass tensor.contiguous() "
                             "(and copy the result back if you need it in the original).",
                             f"{where} は連続したテンソルのチャンクを扱います。tensor.contiguous() を渡してください"
                             "（元のテンソルに結果が必要なら、あとでコピーしてください）。"))
    return tensor.view(-1)


def run_ring_steps(flat, steps, group=None, *, buffers=None, piece=PIECE_BYTES // 4):
    """Run ring ``steps`` on a 1-D tensor in place: send, receive, add or copy. Explained in 08_collectives.

    ``steps``: :class:`RingStep` s from :func:`ring_schedule` (one phase or both). ``piece``: elements per message.
    ``buffers``: see :func:`ring_all_reduce`; while the steps run it is marked in use, and a second call that finds
    the mark (another thread) is refused, because two ring calls at once on one group pair up each other's messages.
    """
    k, me, right, left = _ring_ranks(group, "run_ring_steps")
    if k == 1 or flat.numel() == 0 or not steps:
        return flat
    token = ("run_ring_steps", threading.get_ident())  # a new object on every call
    if buffers is not None and buffers.setdefault(IN_USE, token) is not token:
        raise ConfigError(tr(f"the buffers dict is already in use by a ring call that has not finished (thread "
                             f"{buffers[IN_USE][1]}). Ring calls on one group must run one after the other: two at "
                             "once would pair up each other's messages; give each thread its own group and buffers.",
                             f"buffers の dict は、まだ終わっていないリングの呼び出し（スレッド {buffers[IN_USE][1]}）が"
                             "使っています。1つのグループでのリングの呼び出しは 1つずつ順に行ってください。同時に行うと"
                             "互いのメッセージが入れ違います。スレッドごとに別のグループと buffers を使ってください。"))
    try:
        bounds = steps[0].bounds
        incoming = _receive_buffer(max(b - a for a, b in bounds), flat.dtype, flat.device, buffers)  # (n / k,)
        for step in steps:
            (s0, s1), (r0, r1) = bounds[step.send[me]], bounds[step.recv[me]]
            # the left neighbour cuts the chunk it sends into the same pieces, so the messages pair up in order
            ops = [dist.P2POp(dist.isend, flat[a:b], right, group) for a, b in _pieces(s0, s1, piece)]
            ops += [dist.P2POp(dist.irecv, incoming[a - r0:b - r0], left, group) for a, b in _pieces(r0, r1, piece)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            if step.phase == "reduce-scatter":
                flat[r0:r1].add_(incoming[:r1 - r0])  # add the left neighbour's partial sum to ours
            else:
                flat[r0:r1].copy_(incoming[:r1 - r0])  # a finished chunk: keep it
    finally:
        if buffers is not None and buffers.get(IN_USE) is token:
            del buffers[IN_USE]
    return flat


def _phase(flat, k, name):
    return [step for step in ring_schedule(flat.numel(), k) if step.phase == name]


def ring_reduce_scatter(tensor, group=None, *, buffers=None, piece_bytes=PIECE_BYTES, check=True):
    """The ring's first phase: rank ``r`` ends with chunk ``r`` summed; returns that chunk. Explained in 08_collectives.

    ``tensor`` (contiguous) is cut into ``k`` chunks by :func:`chunk_bounds`; after ``k - 1`` steps chunk ``r`` of
    rank ``r``'s tensor holds the sum over the ranks (the other chunks hold partial sums) and the returned 1-D view
    is that chunk: what ``dist.reduce_scatter_tensor(out, tensor)`` writes to ``out`` when ``k`` divides the size.
    The arguments are those of :func:`ring_all_reduce`.
    """
    k, piece = _prepare(tensor, group, buffers, piece_bytes, check, "ring_reduce_scatter")
    flat = _contiguous(tensor, "ring_reduce_scatter")
    run_ring_steps(flat, _phase(flat, k, "reduce-scatter"), group, buffers=buffers, piece=piece)
    a, b = chunk_bounds(flat.numel(), k)[dist.get_rank(group)]
    return flat[a:b]


def ring_all_gather(tensor, group=None, *, buffers=None, piece_bytes=PIECE_BYTES, check=True):
    """The ring's second phase: chunk ``r`` of rank ``r`` copied to every rank, in place. Explained in 08_collectives.

    Rank ``r`` contributes chunk ``r`` of its (contiguous) ``tensor`` (by :func:`chunk_bounds`); after ``k - 1``
    steps every rank's tensor holds every rank's chunk in rank order, what ``dist.all_gather_into_tensor(tensor,
    chunk)`` gives. Returns ``tensor``. After :func:`ring_reduce_scatter` on the same tensor, it completes a
    :func:`ring_all_reduce`. The arguments are those of :func:`ring_all_reduce`.
    """
    k, piece = _prepare(tensor, group, buffers, piece_bytes, check, "ring_all_gather")
    flat = _contiguous(tensor, "ring_all_gather")
    run_ring_steps(flat, _phase(flat, k, "all-gather"), group, buffers=buffers, piece=piece)
    return tensor


def ring_all_reduce(tensor, group=None, *, buffers=None, piece_bytes=PIECE_BYTES, check=True):
    """Sum ``tensor`` over the group in place with sends and receives only; return it. Explained in 08_collectives.

    The same contract as ``dist.all_reduce(tensor)`` with the default SUM: every rank calls it with a tensor of the
    same shape and dtype on its own device (``mparlib.rendezvous.device()``), and afterwards every rank holds the sum.
    It is :func:`ring_reduce_scatter` followed by :func:`ring_all_gather`: ``2(k-1)`` steps for ``k`` ranks
    (:func:`ring_schedule`), run by :func:`run_ring_steps`. A chunk of more than ``piece_bytes`` travels as several
    messages posted in the same step (a choice made by timing the function on a 2-core CPU with gloo; no benchmark
    of the course re-measures it). Every rank takes part in every step, with empty chunks when the tensor has fewer
    elements than there are ranks. Floating-point sums may differ from ``dist.all_reduce`` in the last bits: the
    additions happen in another order.

    ``check``: first compare every rank's element count and dtype with one small all-gather, and fail naming the
    ranks that differ (without it, mismatched ranks hang or mix data). ``buffers``: a dict the caller keeps between
    calls, in which the receive buffer stays (one per device and dtype); without it the buffer is allocated for the
    call and freed. Ring calls on one group must not run at the same time (from two threads): their messages would
    pair up wrongly; two calls that share one ``buffers`` dict at once are refused with an error.
    """
    k, piece = _prepare(tensor, group, buffers, piece_bytes, check, "ring_all_reduce")
    flat = tensor.contiguous().view(-1)  # (n,): tensor itself when it is contiguous, else a copy
    run_ring_steps(flat, _phase(flat, k, "reduce-scatter"), group, buffers=buffers, piece=piece)  # rank r: chunk r
    run_ring_steps(flat, _phase(flat, k, "all-gather"), group, buffers=buffers, piece=piece)  # every chunk everywhere
    if not tensor.is_contiguous():  # the sums were made in a copy
        tensor.copy_(flat.view(tensor.shape))
    return tensor


# What communication costs: timing, bandwidth, and the alpha-beta model --------------------------------------------

def bus_bandwidth(algorithm_bandwidth, k):
    """Bus bandwidth of an all-reduce: algorithm bandwidth x ``2(k-1)/k``. Explained in 08_collectives.

    The convention of nccl-tests: a ring all-reduce moves ``2(k-1)/k`` times the message over each link, so the
    bus bandwidth is comparable between world sizes and with the links' own speed.
    """
    return algorithm_bandwidth * 2 * (k - 1) / k


def time_collective(fn, numel, dtype=torch.float32, *, warmup=1, min_seconds=0.05, min_repeats=5,
                    max_repeats=10_000):
    """Time ``fn(tensor)`` on ``numel`` elements with :func:`mparlib.timing.measure`. Explained in 08_collectives.

    Run inside a worker: every rank calls it. Before each call the input is refilled with ones and the ranks meet at a
    barrier (untimed); the clock is read after the device has finished (CUDA synchronised), each call's time is the
    slowest rank's, and all ranks stop after the same repeat: the first at which every rank has timed at least
    ``min_repeats`` calls and ``min_seconds`` in all. Returns the :class:`mparlib.timing.Timing` (the same on every
    rank, except the load averages, which each rank reads for itself).
    """
    positive_int(numel, "numel", 1024, "time_collective", minimum=0)
    device = rank_device()
    x = torch.ones(numel, dtype=dtype, device=device)

    def before():
        x.fill_(1)
        dist.barrier()

    def slowest(values):  # elementwise maximum over the ranks
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    return measure(lambda: fn(x), warmup=warmup, min_seconds=min_seconds, min_repeats=min_repeats,
                   max_repeats=max_repeats, device=device, before=before, across=slowest)


METHODS = ("all_reduce", "ring")


def bandwidth_worker(sizes, methods=METHODS, *, warmup=1, min_seconds=0.05, min_repeats=5):
    """Time all-reduces of float32 messages of ``sizes`` bytes: a row per method and size. Explained in 08_collectives.

    ``methods``: ``"all_reduce"`` (the backend's own) and ``"ring"`` (:func:`ring_all_reduce` without its input
    check, its receive buffers kept for the whole run, as a library keeps its own). Each point is timed by
    :func:`time_collective`. Each row has the median seconds, the spread (``min``, ``max``, ``q1``, ``q3``, ``iqr``),
    the number of timed calls, every call's time, the algorithm and bus bandwidths (bytes / s, from the median),
    and rank 0's load average before and after the point with its ``busy`` flag.
    """
    for method in methods:
        one_of(method, "methods", METHODS, "bandwidth_worker")
    buffers = {}
    calls = {"all_reduce": dist.all_reduce, "ring": lambda x: ring_all_reduce(x, buffers=buffers, check=False)}
    k, rows = dist.get_world_size(), []
    for size in sizes:
        nbytes = positive_int(size, "size", 4096, "bandwidth_worker", minimum=4) // 4 * 4  # whole float32 elements
        for method in methods:
            timing = time_collective(calls[method], nbytes // 4, warmup=warmup, min_seconds=min_seconds,
                                     min_repeats=min_repeats)
            seconds = timing.median
            rows.append({"method": method, "bytes": nbytes, "seconds": seconds, **timing.summary(),
                         "all_seconds": list(timing.times), "algbw": nbytes / seconds,
                         "busbw": bus_bandwidth(nbytes / seconds, k), "world_size": k,
                         "backend": dist.get_backend()})
    return rows


def fit_alpha_beta(nbytes, seconds):
    """Fit ``t = alpha + n * beta`` to measured times, least squares on relative errors. Explained in 08_collectives.

    ``alpha`` is the latency (seconds per message), ``beta`` the seconds per byte (1 / bandwidth); both are kept
    >= 0 (a constrained least-squares fit). Relative errors weigh a 4 KiB message as much as a 256 MiB one.
    Returns ``alpha``, ``beta``, ``bandwidth`` (bytes / s) and ``relative_errors`` ((model - measured) / measured).
    """
    points = [(float(n), float(t)) for n, t in zip(nbytes, seconds)]
    if len(points) < 2 or len({n for n, _ in points}) < 2 or any(t <= 0 or n < 0 for n, t in points):
        raise ConfigError(tr("fit_alpha_beta needs at least two different message sizes with positive times.",
                             "fit_alpha_beta には、正の時間を持つ 2種類以上のメッセージサイズが必要です。"))

    def sse(a, b):  # sum of squared relative errors
        return sum(((a + b * n) / t - 1) ** 2 for n, t in points)

    # minimise sum_i (alpha u_i + beta v_i - 1)^2 with u_i = 1 / t_i, v_i = n_i / t_i: 2x2 normal equations
    u, v = [1 / t for _, t in points], [n / t for n, t in points]
    s00, s01, s11 = sum(a * a for a in u), sum(a * b for a, b in zip(u, v)), sum(b * b for b in v)
    b0, b1 = sum(u), sum(v)
    det = s00 * s11 - s01 * s01
    candidates = [(b0 / s00, 0.0), (0.0, b1 / s11)]  # on the edges alpha >= 0, beta >= 0 of the feasible region
    if det > 0:
        a, b = (b0 * s11 - b1 * s01) / det, (b1 * s00 - b0 * s01) / det
        if a >= 0 and b >= 0:
            candidates.append((a, b))
    alpha, beta = min(candidates, key=lambda ab: sse(*ab))
    return {"alpha": alpha, "beta": beta, "bandwidth": 1 / beta if beta > 0 else float("inf"),
            "relative_errors": [(alpha + beta * n) / t - 1 for n, t in points]}


def predict_seconds(fit, nbytes):
    """The alpha-beta model's time for one message: ``alpha + nbytes * beta``. Explained in 08_collectives."""
    return fit["alpha"] + nbytes * fit["beta"]
