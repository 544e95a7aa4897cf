"""Wrong answers to chapter 01's exercises, each with the hint key its check must choose."""
import math

import torch
from torch import nn

from mparlib.parallel import data_parallel


def chunk_sizes_balanced(batch, k):
    return [batch // k + (1 if i < batch % k else 0) for i in range(min(k, batch))]


def chunk_sizes_with_idle(batch, k):
    size = math.ceil(batch / k)
    sizes = [min(size, max(0, batch - i * size)) for i in range(k)]
    return sizes


def chunk_sizes_floor(batch, k):
    size = batch // k
    return [size] * (k - 1) + [batch - (k - 1) * size]


def warmup_lr_none(step, base_lr, k, warmup_steps):
    return base_lr * k


def warmup_lr_unscaled(step, base_lr, k, warmup_steps):
    return base_lr


def warmup_lr_from_zero(step, base_lr, k, warmup_steps):
    return base_lr * k * min(1.0, step / warmup_steps) if warmup_steps else base_lr * k


def step_chunk_losses(model, X, Y, devices, lr):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss = sum(nn.functional.mse_loss(data_parallel(model, x, devices), y)
               for x, y in zip(X.chunk(len(devices)), Y.chunk(len(devices))))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def step_not_split(model, X, Y, devices, lr):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    nn.functional.mse_loss(model(X), Y).backward()
    optimizer.step()


def step_forgotten(model, X, Y, devices, lr):
    nn.functional.mse_loss(data_parallel(model, X, devices), Y).backward()


def step_scaled_lr(model, X, Y, devices, lr):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * len(devices))
    nn.functional.mse_loss(data_parallel(model, X, devices), Y).backward()
    optimizer.step()


PLANTED = [
    ("01.1", "balanced", chunk_sizes_balanced),
    ("01.1", "idle_devices", chunk_sizes_with_idle),
    ("01.1", "floor", chunk_sizes_floor),
    ("01.2", "no_warmup", warmup_lr_none),
    ("01.2", "unscaled", warmup_lr_unscaled),
    ("01.2", "from_zero", warmup_lr_from_zero),
    ("01.3", "chunk_losses", step_chunk_losses),
    ("01.3", "not_split", step_not_split),
    ("01.3", "no_step", step_forgotten),
    ("01.3", "lr_scaled", step_scaled_lr),
]
