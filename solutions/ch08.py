"""Instructor solutions of chapter 08's exercises (the first two are worker functions)."""
import torch
import torch.distributed as dist

from mparlib.collectives import chunk_bounds


def all_gather_by_sends(tensor, sizes):
    """08.1: every rank's tensor, in rank order, from sends and receives alone (rank r's has sizes[r] elements)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered = [tensor.clone() if r == rank else torch.empty(sizes[r], dtype=tensor.dtype) for r in range(world)]
    ops = []
    for peer in range(world):
        if peer != rank:  # post everything at once: nobody waits for a partner that is itself waiting
            ops.append(dist.P2POp(dist.isend, tensor, peer))
            ops.append(dist.P2POp(dist.irecv, gathered[peer], peer))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return gathered


def ring_reduce_scatter(tensor):
    """08.2: chunk ``rank`` of the flattened tensor, summed over the ranks, around the ring."""
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = tensor.reshape(-1).clone()
    bounds = chunk_bounds(flat.numel(), world)
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        s0, s1 = bounds[(rank - step - 1) % world]  # one chunk ahead of the chapter's ring: ends on chunk `rank`
        r0, r1 = bounds[(rank - step - 2) % world]
        incoming = torch.empty(r1 - r0, dtype=flat.dtype)
        ops = [dist.P2POp(dist.isend, flat[s0:s1].clone(), right), dist.P2POp(dist.irecv, incoming, left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        flat[r0:r1] += incoming
    start, stop = bounds[rank]
    return flat[start:stop]


def ring_all_reduce_seconds(nbytes, k, alpha, beta):
    """08.3: the alpha-beta time of a ring all-reduce of ``nbytes`` on ``k`` ranks."""
    return 2 * (k - 1) * alpha + 2 * (k - 1) / k * nbytes * beta


def bucket_assignment(grad_bytes, cap_bytes, first_cap_bytes=None):
    """08.4: DDP's buckets: gradients in the order they become ready, a bucket closes once it holds >= its cap."""
    buckets, current, size = [], [], 0
    for i, nbytes in enumerate(grad_bytes):
        current.append(i)
        size += nbytes
        cap = first_cap_bytes if first_cap_bytes is not None and not buckets else cap_bytes
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


SOLUTIONS = {"08.1": all_gather_by_sends, "08.2": ring_reduce_scatter, "08.3": ring_all_reduce_seconds,
             "08.4": bucket_assignment}
