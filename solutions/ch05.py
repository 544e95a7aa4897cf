"""Instructor solutions to chapter 05's exercises (05_multi_gpu_resnet). Not part of the package or the book."""
import math
import time

import torch
from torch import nn

from mparlib.step import train_step


def init_layer(m):
    """05.1: d2l's N(0, 0.01^2) for the weights of every convolution and linear layer, subclasses included."""
    if isinstance(m, (nn.Linear, nn.Conv2d)):
        nn.init.normal_(m.weight, std=0.01)


def steps_per_epoch(n_images, batch_per_device, k, drop_last):
    """05.2: optimizer steps in one epoch when each of k devices takes batch_per_device images per step."""
    batch = batch_per_device * k
    return n_images // batch if drop_last else math.ceil(n_images / batch)


def images_per_second(net, X, y, steps=20):
    """05.3: training throughput of SGD steps on (X, y), after one warm-up step."""
    optimizer, loss_fn = torch.optim.SGD(net.parameters(), lr=0.01), nn.CrossEntropyLoss()
    train_step(net, X, y, loss_fn, optimizer)
    start = time.perf_counter()
    for _ in range(steps):
        train_step(net, X, y, loss_fn, optimizer)
    return steps * len(y) / (time.perf_counter() - start)


SOLUTIONS = {"05.1": init_layer, "05.2": steps_per_epoch, "05.3": images_per_second}
