"""Wrong answers to chapter 05's exercises, each with the hint key its check must choose."""
import math
import time

import torch
from torch import nn

from mparlib.step import train_step


def init_exact_type(m):
    if type(m) in [nn.Linear, nn.Conv2d]:
        nn.init.normal_(m.weight, std=0.01)


def init_variance(m):
    if isinstance(m, (nn.Linear, nn.Conv2d)):
        nn.init.normal_(m.weight, std=0.01 ** 2)


def init_every_weight(m):
    if getattr(m, "weight", None) is not None:
        nn.init.normal_(m.weight, std=0.01)


def steps_one_device(n_images, batch_per_device, k, drop_last):
    return n_images // batch_per_device if drop_last else math.ceil(n_images / batch_per_device)


def steps_floor(n_images, batch_per_device, k, drop_last):
    return n_images // (batch_per_device * k)


def steps_ignore_drop_last(n_images, batch_per_device, k, drop_last):
    return math.ceil(n_images / (batch_per_device * k))


def _timed(net, X, y, steps=20):
    optimizer, loss_fn = torch.optim.SGD(net.parameters(), lr=0.01), nn.CrossEntropyLoss()
    train_step(net, X, y, loss_fn, optimizer)
    start = time.perf_counter()
    for _ in range(steps):
        train_step(net, X, y, loss_fn, optimizer)
    return steps, time.perf_counter() - start


def throughput_steps(net, X, y):
    steps, seconds = _timed(net, X, y)
    return steps / seconds


def throughput_milliseconds(net, X, y):
    steps, seconds = _timed(net, X, y)
    return steps * len(y) / (seconds * 1000)


def throughput_inverted(net, X, y):
    steps, seconds = _timed(net, X, y)
    return seconds / (steps * len(y))


PLANTED = [
    ("05.1", "exact_type", init_exact_type),
    ("05.1", "std", init_variance),
    ("05.1", "too_much", init_every_weight),
    ("05.2", "per_device", steps_one_device),
    ("05.2", "floor", steps_floor),
    ("05.2", "drop_last", steps_ignore_drop_last),
    ("05.3", "per_step", throughput_steps),
    ("05.3", "units", throughput_milliseconds),
    ("05.3", "inverted", throughput_inverted),
]
