"""Context parallelism from send/recv: ring attention over a sequence split across the ranks of a process group.

Each rank holds a slice of the sequence of the queries, keys and values, ``(B, H, T / N, d)``. The key/value blocks
travel once around the ring of ranks (:func:`ring_exchange`, posted before the block's compute so that the two can
overlap); every rank attends its queries to each block as it passes (:func:`block_attention`) and folds the partial
results together with the log-sum-exp rule of online softmax (:func:`merge`). The backward pass is a second ring
pass in which the key/value gradients travel with their blocks and arrive back home. Causal attention skips the
blocks that lie wholly in a query's future; :func:`chunks_of` says which part of the sequence a rank holds, either
one contiguous slice (``"contiguous"``, unbalanced under a causal mask) or two chunks of ``2N``, ``r`` and
``2N - 1 - r`` (``"balanced"``, the head-tail split of Megatron-LM and PyTorch).
Explained in 11_sequence_context_experts.
"""
import math

import torch
import torch.distributed as dist

from .checks import flag, one_of
from .errors import ConfigError
from .lang import tr
from .timing import measure, measure_each, slowest_rank

SPLITS = ("contiguous", "balanced")


def chunks_of(rank, world, split="contiguous"):
    """The global chunk numbers a rank holds, and how many chunks the sequence has. Explained in 11_sequence_context_experts.

    ``"contiguous"``: ``N`` chunks, rank ``r`` holds chunk ``r``. ``"balanced"``: ``2N`` chunks, rank ``r`` holds
    chunks ``r`` and ``2N - 1 - r``, one early and one late, so that under a causal mask every rank does the same work.
    """
    split = one_of(split, "split", SPLITS, "chunks_of")
    return ([rank], world) if split == "contiguous" else ([rank, 2 * world - 1 - rank], 2 * world)


def _chunk_size(length, count, where):
    if length % count:
        raise ConfigError(tr(f"{where}: a sequence of {length} tokens does not split into {count} equal chunks. Use a "
                             f"length that is a multiple of {count}, or another number of ranks.",
                             f"{where}: 長さ {length} の系列は {count}個の等しいチャンクに分けられません。{count} の"
                             "倍数の長さにするか、ランクの数を変えてください。"))
    return length // count


def shard_sequence(x, rank, world, split="contiguous", dim=2):
    """This rank's part of a whole sequence ``x`` along ``dim`` (its chunks, in order). Explained in 11_sequence_context_experts."""
    chunks, count = chunks_of(rank, world, split)
    c = _chunk_size(x.shape[dim], count, "shard_sequence")
    return torch.cat([x.narrow(dim, i * c, c) for i in chunks], dim=dim)


def unshard_sequence(pieces, split="contiguous", dim=2):
    """The whole sequence again from every rank's part, ``pieces[r]`` from rank ``r``. Explained in 11_sequence_context_experts."""
    world = len(pieces)
    parts = {}
    for rank, piece in enumerate(pieces):
        chunks, _ = chunks_of(rank, world, split)
        for i, part in zip(chunks, piece.chunk(len(chunks), dim=dim)):
            parts[i] = part
    return torch.cat([parts[i] for i in sorted(parts)], dim=dim)


def merge(out_a, lse_a, out_b, lse_b):
    """Combine two partial attentions of the same queries over disjoint keys. Explained in 11_sequence_context_experts.

    ``out`` is ``softmax(scores) @ v`` over one set of keys and ``lse`` the log of the sum of ``exp(scores)`` over
    it, per query. Over both sets, the softmax weights of set ``a`` shrink by ``exp(lse_a - lse)`` with
    ``lse = log(exp(lse_a) + exp(lse_b))``; ``lse_a = -inf`` (nothing seen yet) gives weight 0. Returns ``(out, lse)``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    return (out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1)), lse


def block_attention(q, k, v, scale=None, diagonal=False):
    """Attention of queries to one block of keys: ``(out, lse)`` for :func:`merge`. Explained in 11_sequence_context_experts.

    ``diagonal=True`` applies the causal mask inside the block (queries and keys at the same positions: key ``j``
    is visible to query ``i`` when ``j <= i``). The scores block ``(B, H, Tq, Tk)`` exists only inside this call.
    """
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if diagonal:
        scores = scores.masked_fill(_future(scores), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def _future(scores):
    """True above the diagonal of the last two dimensions: the keys a causal query may not see."""
    t_q, t_k = scores.shape[-2:]
    return torch.ones(t_q, t_k, dtype=torch.bool, device=scores.device).triu(1)


def ring_exchange(tensors, group=None):
    """Post the sends of ``tensors`` to the next rank and the receives from the previous one. Explained in 11_sequence_context_experts.

    Returns ``(received, requests)``: fresh tensors that are filled once every request in ``requests`` has been
    waited for. Nothing blocks here, so the caller can compute while the messages travel.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer((rank + 1) % world), group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, peer((rank - 1) % world), group) for t in received]
    return received, dist.batch_isend_irecv(ops)


def _place(group):
    """(rank, world size) in ``group``; ``(0, 1)`` outside a process group: the whole sequence on this process."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _pairs(rank, source, world, split, causal):
    """(query chunk, key chunk, diagonal) of the blocks ``rank`` computes with the keys from ``source``, local indices."""
    mine, _ = chunks_of(rank, world, split)
    theirs, _ = chunks_of(source, world, split)
    if not causal:
        return [(None, None, False)]  # the whole local block at once
    return [(a, b, i == j) for a, i in enumerate(mine) for b, j in enumerate(theirs) if j <= i]


def _slice(x, index, count):
    """Local chunk ``index`` of ``count`` along the sequence (dim 2); the whole tensor for ``None``."""
    if index is None:
        return x
    c = x.shape[2] // count
    return x[:, :, index * c:(index + 1) * c]


def _record(stats, blocks):
    """Add one ring step's score elements and largest block to ``stats`` (a dict or None)."""
    if stats is None:
        return
    stats.setdefault("score_elements", 0)
    stats.setdefault("largest_block", 0)
    stats.setdefault("blocks_per_step", []).append(len(blocks))
    for scores in blocks:
        stats["score_elements"] += scores
        stats["largest_block"] = max(stats["largest_block"], scores)


class _RingAttention(torch.autograd.Function):
    """Forward: one ring pass of key/value blocks; backward: a second one carrying their gradients home."""

    @staticmethod
    def forward(ctx, q, k, v, causal, split, group, stats):
        rank, world = _place(group)
        count = len(chunks_of(rank, world, split)[0])
        scale = 1 / math.sqrt(q.shape[-1])
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = (k.contiguous(), v.contiguous())  # gloo sends dense tensors only
        for step in range(world):
            if step < world - 1:  # the next block starts travelling before this one is used
                incoming, requests = ring_exchange(kv, group)
            sizes = []
            for a, b, diagonal in _pairs(rank, (rank - step) % world, world, split, causal):
                qa, kb, vb = _slice(q, a, count), _slice(kv[0], b, count), _slice(kv[1], b, count)
                o, s = block_attention(qa, kb, vb, scale, diagonal)
                sizes.append(qa.shape[0] * qa.shape[1] * qa.shape[2] * kb.shape[2])
                rows = slice(None) if a is None else slice(a * qa.shape[2], (a + 1) * qa.shape[2])
                out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, s)
            _record(stats, sizes)
            if step < world - 1:
                for request in requests:
                    request.wait()
                kv = tuple(incoming)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.setup = (causal, split, group, scale, count)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        causal, split, group, scale, count = ctx.setup
        rank, world = _place(group)
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(dim=-1)  # D_i = sum_d dO_id O_id, the softmax's correction term
        dq = torch.zeros_like(q)
        kv = (k.contiguous(), v.contiguous())
        dkv = (torch.zeros_like(kv[0]), torch.zeros_like(kv[1]))
        for step in range(world):
            if step < world - 1:
                incoming, requests = ring_exchange(kv, group)
            for a, b, diagonal in _pairs(rank, (rank - step) % world, world, split, causal):
                grads = _block_backward(*(_slice(t, a, count) for t in (q, grad_out, lse, delta)),
                                        _slice(kv[0], b, count), _slice(kv[1], b, count), scale, diagonal)
                _slice(dq, a, count).add_(grads[0])
                _slice(dkv[0], b, count).add_(grads[1])
                _slice(dkv[1], b, count).add_(grads[2])
            if world > 1:  # the gradients go on with their block; after N moves they are home
                travelled, more = ring_exchange(dkv, group)
                for request in (requests if step < world - 1 else []) + more:
                    request.wait()
                dkv = tuple(travelled)
            if step < world - 1:
                kv = tuple(incoming)
        return dq, dkv[0], dkv[1], None, None, None, None


def _block_backward(q, grad_out, lse, delta, k, v, scale, diagonal):
    """Gradients of one block: (dq, dk, dv), recomputing its softmax weights from the saved ``lse``."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if diagonal:
        scores = scores.masked_fill(_future(scores), float("-inf"))
    weights = torch.exp(scores - lse.unsqueeze(-1))  # the block's share of the softmax over all keys
    grad_v = weights.transpose(-2, -1) @ grad_out
    grad_scores = weights * (grad_out @ v.transpose(-2, -1) - delta.unsqueeze(-1)) * scale
    return grad_scores @ k, grad_scores.transpose(-2, -1) @ q, grad_v


def ring_attention(q, k, v, causal=False, split="contiguous", group=None, stats=None):
    """Attention over a sequence split across ``group``: this rank's output slice. Explained in 11_sequence_context_experts.

    ``q``, ``k``, ``v``: this rank's part ``(B, H, T / N, d)`` of the whole sequence, cut by :func:`shard_sequence`
    with the same ``split``. Equal to this rank's part of ``F.scaled_dot_product_attention`` of the whole
    sequence (``is_causal=causal``), gradients included. Outside a process group it is the same computation on one
    process (``N = 1``: one block, the whole sequence). ``stats``, a dict, collects the score elements computed
    (``score_elements``), the largest score block (``largest_block``, elements) and the blocks of each ring step.
    """
    causal, split = flag(causal, "causal", "ring_attention"), one_of(split, "split", SPLITS, "ring_attention")
    if split == "balanced" and q.shape[2] % 2:
        raise ConfigError(tr(f"ring_attention: the balanced split holds two chunks per rank, and {q.shape[2]} local "
                             "tokens do not halve. Use a sequence length that is a multiple of 2N.",
                             f"ring_attention: balanced の分け方では各ランクが 2つのチャンクを持ちますが、ローカルな "
                             f"{q.shape[2]}個のトークンは半分に分けられません。系列の長さを 2N の倍数にしてください。"))
    return _RingAttention.apply(q, k, v, causal, split, group, stats)


class SavedBytes:
    """Count the bytes autograd keeps for the backward pass while active. Explained in 11_sequence_context_experts.

    ``with SavedBytes() as saved: y = f(x)`` then ``saved.bytes``: every tensor saved for backward inside the
    block, each storage counted once (a saved input is counted too: it must stay alive for the backward pass).
    """

    def __init__(self):
        self.bytes, self.storages, self.hooks = 0, set(), None

    def pack(self, tensor):
        """The saved-tensor hook: note the tensor's storage once, keep the tensor unchanged."""
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), tensor.device)
        if key not in self.storages:
            self.storages.add(key)
            self.bytes += storage.nbytes()
        return tensor

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        return False


def _gather_objects(obj, group=None):
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank; ``[obj]`` outside a process group."""
    if _place(group)[1] == 1:
        return [obj]
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, obj, group=group)
    return every


def _inputs(length, batch, heads, dim, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, length, dim, generator=generator, dtype=dtype).to(device) for _ in range(3)]


def measure_memory(lengths=(16, 196, 784), batch=8, heads=4, dim=16, dtype=torch.float32, device="cpu"):
    """Per rank, per length: attention's bytes saved for backward and its largest score block. Explained in 11_sequence_context_experts.

    Activation bytes = what autograd keeps for the backward pass (counted by :class:`SavedBytes`: this rank's q, k,
    v, output and log-sum-exp) + the largest block of scores that exists at one time during the forward pass
    (``B * H * (T / N)^2`` elements for the non-causal ring). Returns ``[{length: {...}} for each rank]``.
    """
    rank, world = _place(None)
    out = {}
    for length in lengths:
        q, k, v = (shard_sequence(t, rank, world).requires_grad_() for t in _inputs(length, batch, heads, dim,
                                                                                    dtype, device))
        stats = {}
        with SavedBytes() as saved:
            ring_attention(q, k, v, stats=stats)
        block = stats["largest_block"] * q.element_size()
        out[length] = {"saved_bytes": saved.bytes, "score_block_bytes": block, "activation_bytes": saved.bytes + block}
    return _gather_objects(out)


def _timing_options(world, group=None):
    """``measure``'s ``before`` and ``across`` for a timing on every rank: a barrier, then the slowest rank's time."""
    if world == 1:
        return {}
    return {"before": lambda: dist.barrier(group), "across": lambda values: slowest_rank(values, group)}


def measure_overlap(length=784, batch=8, heads=4, dim=16, min_repeats=5, min_seconds=0.05, device="cpu"):
    """Time per ring step of the forward pass: compute alone, send/recv alone, both. Explained in 11_sequence_context_experts.

    ``compute``: this rank's N blocks of attention and merges with no message sent; ``communication``: the N - 1
    moves of the key/value blocks with no compute; ``ring``: :func:`ring_attention` itself. The three are timed in
    turn, round by round, by :func:`mparlib.timing.measure_each` (a barrier before each call, the slowest rank's
    time, at least ``min_repeats`` rounds and ``min_seconds`` for each); each is (median, min, max) divided by N, in
    ms. ``exposed``: what the ring adds to the compute, ``max(0, ring - compute)``; ``hidden``: the share of the
    communication that it did not add, ``1 - exposed / communication``, clipped to [0, 1] (None on one process).
    ``load``: rank 0's load average before and after, and whether the machine was busy.
    """
    rank, world = _place(None)
    q, k, v = (shard_sequence(t, rank, world) for t in _inputs(length, batch, heads, dim, torch.float32, device))

    def compute():
        out, lse = block_attention(q, k, v)
        for _ in range(world - 1):
            out, lse = merge(out, lse, *block_attention(q, k, v))

    def communication():
        kv = (k, v)
        for _ in range(world - 1):
            kv, requests = ring_exchange(kv)
            for request in requests:
                request.wait()

    with torch.no_grad():
        result = measure_each({"compute": compute, "communication": communication,
                               "ring": lambda: ring_attention(q, k, v)}, min_repeats=min_repeats,
                              min_seconds=min_seconds, device=device, **_timing_options(world))
    ms = {name: tuple(1000 * t / world for t in (r.median, min(r.times), max(r.times))) for name, r in result.items()}
    comm, exposed = ms["communication"][0], max(0.0, ms["ring"][0] - ms["compute"][0])
    hidden = min(1.0, max(0.0, 1 - exposed / comm)) if world > 1 and comm > 0 else None
    ring = result["ring"]
    return {"ms_per_step": ms, "exposed_ms": exposed, "hidden": hidden, "ranks": world, "seq_len": length,
            "bytes_per_step": 2 * q.numel() * q.element_size(), "repeats": len(ring.times),
            "load": {"before": ring.load_before, "after": ring.load_after, "busy": ring.busy}}


def measure_balance(length=784, batch=8, heads=4, dim=16, min_repeats=5, min_seconds=0.05, device="cpu"):
    """Per rank, for each split: causal score elements and compute time of its blocks. Explained in 11_sequence_context_experts.

    The compute is timed alone (this rank's blocks of every ring step, forward, no messages), so a rank's time is its
    own work, not its wait for the others, by :func:`mparlib.timing.measure` (at least ``min_repeats`` calls and
    ``min_seconds``). Returns ``{split: [{"score_elements", "ms", "ms_min_max", "busy"} for each rank]}``: the median
    and the spread in ms, and whether that rank saw a busy machine.
    """
    rank, world = _place(None)
    report = {}
    for split in SPLITS:
        q, k, v = (shard_sequence(t, rank, world, split) for t in _inputs(length, batch, heads, dim, torch.float32,
                                                                         device))
        count = len(chunks_of(rank, world, split)[0])
        blocks = [pair for step in range(world) for pair in _pairs(rank, (rank - step) % world, world, split, True)]

        def work():
            for a, b, diagonal in blocks:
                block_attention(_slice(q, a, count), _slice(k, b, count), _slice(v, b, count), diagonal=diagonal)

        elements = sum(_slice(q, a, count).shape[2] * _slice(k, b, count).shape[2] for a, b, _ in blocks)
        with torch.no_grad():
            t = measure(work, min_repeats=min_repeats, min_seconds=min_seconds, device=device)
        mine = {"score_elements": batch * heads * elements, "ms": 1000 * t.median,
                "ms_min_max": (1000 * min(t.times), 1000 * max(t.times)), "busy": t.busy}
        report[split] = _gather_objects(mine)
    return report
