"""Instructor solutions of chapter 09's exercises (the last is a worker function)."""
import math

import torch
import torch.distributed as dist


def bytes_per_rank(n_params, world, stage, per_parameter):
    """09.1: bytes one rank holds under ZeRO ``stage`` (0 = DDP ... 3 = parameters sharded too)."""
    sharded = {"optimizer": stage >= 1, "grads": stage >= 2, "params": stage >= 3}
    return sum(n_params * per_parameter[part] / (world if sharded[part] else 1) for part in sharded)


def shard_flat(tensors, rank, world):
    """09.2: rank's slice of the tensors flattened into one buffer, zero-padded to a multiple of ``world``."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    size = math.ceil(flat.numel() / world)
    padded = torch.zeros(size * world, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    return padded[rank * size:(rank + 1) * size].clone()


def unshard_flat(shards, shapes):
    """09.3: the tensors of ``shapes`` back from all ranks' shards (in rank order), padding dropped."""
    flat = torch.cat(list(shards))
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset:offset + n].reshape(shape))
        offset += n
    return out


def zero_sgd_step(params, lr):
    """09.4: ZeRO: reduce-scatter the flat gradients, SGD on this rank's slice, all-gather the parameters."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = sum(p.numel() for p in params)
    size = math.ceil(total / world)
    grads = torch.zeros(size * world, dtype=params[0].dtype)
    grads[:total] = torch.cat([p.grad.reshape(-1) for p in params])
    shard_grad = torch.empty(size, dtype=params[0].dtype)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(shard_grad, grads)
    shard_grad /= world
    flat = torch.zeros(size * world, dtype=params[0].dtype)
    flat[:total] = torch.cat([p.detach().reshape(-1) for p in params])
    shard = flat[rank * size:(rank + 1) * size] - lr * shard_grad
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(flat, shard)
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


SOLUTIONS = {"09.1": bytes_per_rank, "09.2": shard_flat, "09.3": unshard_flat, "09.4": zero_sgd_step}
