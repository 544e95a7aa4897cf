"""Instructor solutions to chapter 03's exercises (03_primitives). Not part of the package or the book."""
import torch

from mparlib.parallel import gather, parallel_apply, replicate


def scatter_batch(batch, devices):
    """03.1: one dict per used device: the i-th chunk of every tensor, every other value as it is."""
    chunks = {k: v.chunk(len(devices)) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    n = len(next(iter(chunks.values())))
    return [{k: (chunks[k][i].to(devices[i]) if k in chunks else v) for k, v in batch.items()} for i in range(n)]


def dp_along(module, x, devices, dim):
    """03.2: data_parallel that splits and gathers along `dim`."""
    replicas = replicate(module, devices)
    inputs = [chunk.to(d) for chunk, d in zip(x.chunk(len(devices), dim), devices)]
    outputs = parallel_apply(replicas[:len(inputs)], inputs)
    return gather(outputs, devices[0], dim)


def combine_losses(chunk_losses, chunk_sizes):
    """03.3: the full-batch mean loss from the chunks' mean losses."""
    total = sum(chunk_sizes)
    return sum(loss * n for loss, n in zip(chunk_losses, chunk_sizes)) / total


SOLUTIONS = {"03.1": scatter_batch, "03.2": dp_along, "03.3": combine_losses}
