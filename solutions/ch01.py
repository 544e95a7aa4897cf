"""Instructor solutions to chapter 01's exercises (01_dataparallel). Not part of the package or the book."""
import math

import torch
from torch import nn

from mparlib.parallel import data_parallel


def chunk_sizes(batch, k):
    """01.1: rows per device under torch.chunk's rule (devices without rows get no chunk)."""
    size = math.ceil(batch / k)
    full, rest = divmod(batch, size)
    return [size] * full + ([rest] if rest else [])


def warmup_lr(step, base_lr, k, warmup_steps):
    """01.2: the linear scaling rule with a linear warm-up from base_lr to k * base_lr."""
    if step >= warmup_steps:
        return base_lr * k
    return base_lr + (k - 1) * base_lr * step / warmup_steps


def dp_sgd_step(model, X, Y, devices, lr):
    """01.3: one SGD step with the batch split over `devices`; one loss on the gathered output."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss = nn.functional.mse_loss(data_parallel(model, X, devices), Y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


SOLUTIONS = {"01.1": chunk_sizes, "01.2": warmup_lr, "01.3": dp_sgd_step}
