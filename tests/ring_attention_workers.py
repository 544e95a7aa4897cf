"""Worker functions for tests/test_ring_attention.py: importable by the spawned ranks (the tests folder is on sys.path).

Every rank builds the same whole q, k, v from one seed, computes the one-process reference with
``F.scaled_dot_product_attention``, then its own part with :func:`mparlib.ring_attention.ring_attention`; the parts of
the outputs and of the gradients are gathered from every rank and put back in sequence order before comparing.
"""
import torch
import torch.distributed as dist
from torch.nn import functional as F

from mparlib.ring_attention import (SavedBytes, measure_balance, measure_overlap, ring_attention, shard_sequence,
                                    unshard_sequence)
from mparlib.sequence_parallel import collective_counts

CASES = [(False, "contiguous"), (True, "contiguous"), (True, "balanced"), (False, "balanced")]


def _gather(x, split):
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, x.contiguous())
    return unshard_sequence(pieces, split)


def _whole(shape, seed, dtype=torch.float64):
    torch.manual_seed(seed)
    return [torch.randn(*shape, dtype=dtype) for _ in range(4)]  # q, k, v and the weights of the loss


def ring_vs_sdpa(shape=(2, 3, 16, 8), seed=0):
    """Largest differences of output and q/k/v gradients, ring vs one-process SDPA, for every (causal, split)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, w = _whole(shape, seed)
    report = {}
    for causal, split in CASES:
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*full, is_causal=causal)
        (ref * w).sum().backward()
        mine = [shard_sequence(t, rank, world, split).requires_grad_() for t in (q, k, v)]
        stats = {}
        out = ring_attention(*mine, causal=causal, split=split, stats=stats)
        (out * shard_sequence(w, rank, world, split)).sum().backward()
        got = [_gather(out.detach(), split)] + [_gather(t.grad, split) for t in mine]
        want = [ref.detach()] + [t.grad for t in full]
        every = [None] * world
        dist.all_gather_object(every, stats)
        report[(causal, split)] = {"diffs": [(a - b).abs().max().item() for a, b in zip(got, want)],
                                   "stats": every}
    return report


def ring_vs_context_parallel(shape=(2, 3, 16, 8), seed=0):
    """Ring attention and torch's ``context_parallel`` (non-causal, CPU): largest difference of the gathered outputs,
    and the collectives torch ran. Torch's ring kernels are the GPU's; on the CPU SDPA's MATH formula runs on the
    sharded buffers (chapter 11 says so)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, _ = _whole(shape, seed)
    mesh = init_device_mesh("cpu", (world,))
    buffers = [q.clone(), k.clone(), v.clone()]
    comm = CommDebugMode()
    with comm, sdpa_kernel(SDPBackend.MATH), context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
        theirs = F.scaled_dot_product_attention(*buffers)
    assert theirs.shape[2] == shape[2] // world  # the buffers were sharded in place: each rank computed its part
    theirs = context_parallel_unshard(mesh, [theirs], [2])[0]
    ours = _gather(ring_attention(*(shard_sequence(t, rank, world) for t in (q, k, v))), "contiguous")
    return {"diff": (ours - theirs).abs().max().item(),
            "collectives": collective_counts(comm)}


def saved_bytes(lengths=(16, 32), batch=2, heads=2, dim=8):
    """Per rank: {length: (bytes saved for backward, largest score block in elements)} of ring attention."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for length in lengths:
        q, k, v, _ = _whole((batch, heads, length, dim), 0, torch.float32)
        mine = [shard_sequence(t, rank, world).requires_grad_() for t in (q, k, v)]
        stats = {}
        with SavedBytes() as saved:
            ring_attention(*mine, stats=stats)
        out[length] = (saved.bytes, stats["largest_block"])
    every = [None] * world
    dist.all_gather_object(every, out)
    return every


def everything():
    """All the checks of one launch: SDPA parity for every case, context_parallel, saved bytes, the two timings."""
    timing = dict(length=16, batch=2, heads=3, dim=8, min_repeats=3, min_seconds=0.0)  # ring_vs_sdpa's shape
    return {"sdpa": ring_vs_sdpa(), "context_parallel": ring_vs_context_parallel(), "saved": saved_bytes(),
            "overlap": measure_overlap(**timing), "balance": measure_balance(**timing)}
