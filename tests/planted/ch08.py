"""Planted wrong answers to chapter 08's exercises: each must be rejected with the hint key it names."""
import torch
import torch.distributed as dist

from mparlib import collectives
from mparlib.collectives import chunk_bounds


def gather_rotated(tensor, sizes):  # 08.1 -> rank_order: entry r holds rank r + 1's tensor
    rank, world = dist.get_rank(), dist.get_world_size()
    out = [tensor.clone() if r == rank else torch.empty(sizes[r]) for r in range(world)]
    ops = []
    for peer in range(world):
        if peer != rank:
            ops += [dist.P2POp(dist.isend, tensor, peer), dist.P2POp(dist.irecv, out[peer], peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out[1:] + out[:1]


def gather_with_collective(tensor, sizes):  # 08.1 -> used_collective
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, tensor)
    return out


def both_receive_first(tensor, sizes):  # 08.1 -> hang: every rank waits in recv, nobody sends
    rank, world = dist.get_rank(), dist.get_world_size()
    out = [tensor.clone() if r == rank else torch.empty(sizes[r]) for r in range(world)]
    for peer in range(world):
        if peer != rank:
            dist.recv(out[peer], src=peer)
    for peer in range(world):
        if peer != rank:
            dist.send(tensor, dst=peer)
    return out


def ring_rotated(tensor):  # 08.2 -> rotated: ends with chunk rank + 1
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = tensor.reshape(-1).clone()
    bounds = chunk_bounds(flat.numel(), world)
    for step in range(world - 1):
        s0, s1 = bounds[(rank - step) % world]
        r0, r1 = bounds[(rank - step - 1) % world]
        incoming = torch.empty(r1 - r0)
        ops = [dist.P2POp(dist.isend, flat[s0:s1].clone(), (rank + 1) % world),
               dist.P2POp(dist.irecv, incoming, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        flat[r0:r1] += incoming
    start, stop = bounds[(rank + 1) % world]
    return flat[start:stop]


def ring_of_the_chapter(tensor):  # 08.2 -> chapter_function: hands the work to mparlib's own ring
    return collectives.ring_reduce_scatter(tensor)


def ring_without_adding(tensor):  # 08.2 -> no_sum: receives, but keeps its own values
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = tensor.reshape(-1).clone()
    bounds = chunk_bounds(flat.numel(), world)
    for step in range(world - 1):
        s0, s1 = bounds[(rank - step - 1) % world]
        r0, r1 = bounds[(rank - step - 2) % world]
        incoming = torch.empty(r1 - r0)
        ops = [dist.P2POp(dist.isend, flat[s0:s1].clone(), (rank + 1) % world),
               dist.P2POp(dist.irecv, incoming, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    start, stop = bounds[rank]
    return flat[start:stop]


def ring_seconds_one_phase(nbytes, k, alpha, beta):  # 08.3 -> one_phase
    return (k - 1) * alpha + (k - 1) / k * nbytes * beta


def ring_seconds_whole_message(nbytes, k, alpha, beta):  # 08.3 -> whole_message
    return 2 * (k - 1) * (alpha + nbytes * beta)


def buckets_never_above_cap(grad_bytes, cap_bytes, first_cap_bytes=None):  # 08.4 -> closes_early
    buckets, current, size = [], [], 0
    for i, n in enumerate(grad_bytes):
        cap = first_cap_bytes if first_cap_bytes is not None and not buckets else cap_bytes
        if current and size + n > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    return buckets + [current] if current else buckets


def buckets_one_cap(grad_bytes, cap_bytes, first_cap_bytes=None):  # 08.4 -> first_bucket
    buckets, current, size = [], [], 0
    for i, n in enumerate(grad_bytes):
        current.append(i)
        size += n
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + [current] if current else buckets


PLANTED = [
    ("08.2", "no_sum", ring_without_adding),
    ("08.1", "rank_order", gather_rotated),
    ("08.1", "used_collective", gather_with_collective),
    ("08.2", "rotated", ring_rotated),
    ("08.2", "chapter_function", ring_of_the_chapter),
    ("08.3", "one_phase", ring_seconds_one_phase),
    ("08.3", "whole_message", ring_seconds_whole_message),
    ("08.4", "closes_early", buckets_never_above_cap),
    ("08.4", "first_bucket", buckets_one_cap),
]

# Also rejected with its hint (checked by hand): left out of PLANTED because it waits out the checks' 20 s collective
# timeout (test_exercises ends the same deadlock at a 5 s timeout).
EXTRA_PLANTED = [
    ("08.1", "hang", both_receive_first),
]
