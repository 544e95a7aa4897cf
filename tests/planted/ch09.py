"""Planted wrong answers to chapter 09's exercises: each must be rejected with the hint key it names."""
import math

import torch
import torch.distributed as dist


def bytes_shifted(n_params, world, stage, per_parameter):  # 09.1 -> stage_shift: > where >= is meant
    sharded = {"optimizer": stage > 1, "grads": stage > 2, "params": stage > 3}
    return sum(n_params * per_parameter[p] / (world if sharded[p] else 1) for p in sharded)


def bytes_all_sharded(n_params, world, stage, per_parameter):  # 09.1 -> all_sharded
    return sum(n_params * b / world for b in per_parameter.values())


def shard_unpadded(tensors, rank, world):  # 09.2 -> no_padding
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return flat.tensor_split(world)[rank]


def shard_of_next_rank(tensors, rank, world):  # 09.2 -> wrong_slice
    flat = torch.cat([t.reshape(-1) for t in tensors])
    size = math.ceil(flat.numel() / world)
    padded = torch.cat([flat, flat.new_zeros(size * world - flat.numel())])
    r = (rank + 1) % world
    return padded[r * size:(r + 1) * size]


def unshard_flat_pieces(shards, shapes):  # 09.3 -> shape_lost
    flat = torch.cat(list(shards))
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset:offset + n])
        offset += n
    return out


def flat_of(params, world, values):
    total = sum(p.numel() for p in params)
    size = math.ceil(total / world)
    buffer = torch.zeros(size * world, dtype=params[0].dtype)
    buffer[:total] = torch.cat([v.reshape(-1) for v in values])
    return buffer, size


def write_back(params, flat):
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def zero_step_summed(params, lr):  # 09.4 -> missing_average
    rank, world = dist.get_rank(), dist.get_world_size()
    grads, size = flat_of(params, world, [p.grad for p in params])
    shard = torch.empty(size, dtype=grads.dtype)
    dist.reduce_scatter_tensor(shard, grads)
    flat, _ = flat_of(params, world, [p.detach() for p in params])
    dist.all_gather_into_tensor(flat, flat[rank * size:(rank + 1) * size] - lr * shard)
    write_back(params, flat)


def zero_step_over_three(params, lr):  # 09.4 -> wrong_divisor: a hard-coded world size, right only on 3 ranks
    rank, world = dist.get_rank(), dist.get_world_size()
    grads, size = flat_of(params, world, [p.grad for p in params])
    shard = torch.empty(size, dtype=grads.dtype)
    dist.reduce_scatter_tensor(shard, grads)
    flat, _ = flat_of(params, world, [p.detach() for p in params])
    dist.all_gather_into_tensor(flat, flat[rank * size:(rank + 1) * size] - lr * shard / 3)
    write_back(params, flat)


def zero_step_without_gather(params, lr):  # 09.4 -> ranks_differ: only the own slice is updated
    rank, world = dist.get_rank(), dist.get_world_size()
    grads, size = flat_of(params, world, [p.grad for p in params])
    shard = torch.empty(size, dtype=grads.dtype)
    dist.reduce_scatter_tensor(shard, grads)
    flat, _ = flat_of(params, world, [p.detach() for p in params])
    flat[rank * size:(rank + 1) * size] -= lr * shard / world
    write_back(params, flat)


PLANTED = [
    ("09.4", "ranks_differ", zero_step_without_gather),
    ("09.4", "wrong_divisor", zero_step_over_three),
    ("09.1", "stage_shift", bytes_shifted),
    ("09.1", "all_sharded", bytes_all_sharded),
    ("09.2", "no_padding", shard_unpadded),
    ("09.2", "wrong_slice", shard_of_next_rank),
    ("09.3", "shape_lost", unshard_flat_pieces),
    ("09.4", "missing_average", zero_step_summed),
]
