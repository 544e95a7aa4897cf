"""Wrong answers to chapter 03's exercises, each with the hint key its check must choose."""
import torch

from mparlib.parallel import gather, parallel_apply, replicate, scatter


def scatter_by_key(batch, devices):
    return {k: (v.chunk(len(devices)) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def scatter_balanced(batch, devices):
    chunks = {k: v.tensor_split(len(devices)) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    return [{k: (chunks[k][i] if k in chunks else v) for k, v in batch.items()} for i in range(len(devices))]


def scatter_tensors_only(batch, devices):
    chunks = {k: v.chunk(len(devices)) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    n = len(next(iter(chunks.values())))
    return [{k: chunks[k][i] for k in chunks} for i in range(n)]


def dp_dim0(module, x, devices, dim):
    replicas = replicate(module, devices)
    inputs = scatter(x, devices)
    return gather(parallel_apply(replicas[:len(inputs)], inputs), devices[0])


def dp_one_module(module, x, devices, dim):
    inputs = scatter(x, devices, dim)
    return gather(parallel_apply([module] * len(inputs), inputs), devices[0], dim)


def dp_all_replicas(module, x, devices, dim):
    replicas = replicate(module, devices)
    inputs = scatter(x, devices, dim)
    return gather(parallel_apply(replicas, inputs), devices[0], dim)


def losses_mean_of_means(chunk_losses, chunk_sizes):
    return sum(chunk_losses) / len(chunk_losses)


def losses_sum(chunk_losses, chunk_sizes):
    return sum(chunk_losses)


def losses_not_divided(chunk_losses, chunk_sizes):
    return sum(loss * n for loss, n in zip(chunk_losses, chunk_sizes))


def losses_detached(chunk_losses, chunk_sizes):
    return torch.tensor(sum(loss.item() * n for loss, n in zip(chunk_losses, chunk_sizes)) / sum(chunk_sizes),
                        dtype=torch.float64)


PLANTED = [
    ("03.1", "transposed", scatter_by_key),
    ("03.1", "empty_chunks", scatter_balanced),
    ("03.1", "non_tensor", scatter_tensors_only),
    ("03.2", "wrong_dim", dp_dim0),
    ("03.2", "no_replicas", dp_one_module),
    ("03.2", "too_many_replicas", dp_all_replicas),
    ("03.3", "mean_of_means", losses_mean_of_means),
    ("03.3", "sum_of_means", losses_sum),
    ("03.3", "not_divided", losses_not_divided),
    ("03.3", "detached", losses_detached),
]
