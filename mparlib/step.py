"""One training step in replaceable parts, and the plan that tells the epoch loop which parts to use.

Chapter 05's step is plain SGD on fp32 batches (:func:`classic_plan`); chapter 07's fast path
(``mparlib.fastpath.plan``) swaps in other parts (another optimizer, bf16 autocast, batches in NHWC layout, a
compiled model) and hands the same loop, ``mparlib.train.train``, another :class:`StepPlan`.
Explained in 07_performance.
"""
import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .devices import check_devices
from .lang import tr
from .parallel import data_parallel


def make_optimizer(net, lr):
    """The optimiser of chapter 05: plain minibatch SGD. Explained in 07_performance."""
    return torch.optim.SGD(net.parameters(), lr=lr)


def autocast_context(device, dtype=None):
    """The numeric context of the forward pass: fp32, or ``torch.autocast`` for bf16. Explained in 07_performance."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def move_batch(X, y, device):
    """Move a batch to the device ``nn.DataParallel`` scatters from (``devices[0]``). Explained in 07_performance."""
    return X.to(device, non_blocking=True), y.to(device, non_blocking=True)


def train_step(net, X, y, loss_fn, optimizer, autocast=contextlib.nullcontext):
    """One SGD step on a batch: (loss sum, correct, batch size), no device sync. Explained in 05_multi_gpu_resnet."""
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        y_hat = net(X)  # (B, num_classes)
        loss = loss_fn(y_hat, y)  # mean over the batch
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        return loss.detach() * len(y), (y_hat.argmax(dim=1) == y).sum(), len(y)


@contextlib.contextmanager
def _threads_per_replica(k):
    """Give each of ``k`` replica threads its share of the CPU threads while they run, then restore the count."""
    before = torch.get_num_threads()
    share = max(1, before // max(k, 1))
    if share == before:
        yield
        return
    torch.set_num_threads(share)  # a thread started inside picks up this count (oversubscribed cores crawl)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class SimulatedDataParallel(nn.Module):
    """``nn.DataParallel``'s forward over a device listed several times (``["cpu"] * 2``). Explained in 05_multi_gpu_resnet.

    Each forward pass is ``mparlib.parallel.data_parallel(module, X, devices)``: replicate the module, split the
    batch, run the replicas in threads, gather the outputs on ``devices[0]``. Gradients of all replicas flow back
    into ``module``'s parameters, so the optimiser steps the one model. As with ``nn.DataParallel``, batch norm in
    training mode normalises each replica's part of the batch with that part's statistics, and the running
    statistics are updated from replica 0's part only. ``devices`` is checked here, when the wrapper is built.
    """

    def __init__(self, module, devices):
        super().__init__()
        self.module = module
        self.devices = check_devices(devices)
        self._cpu_replicas = sum(d.type == "cpu" for d in self.devices)  # they share the CPU threads

    def forward(self, *inputs, **kwargs):
        with _threads_per_replica(self._cpu_replicas):
            return data_parallel(self.module, inputs, self.devices, module_kwargs=kwargs)


def _simulated(devices):
    return len(devices) > 1 and len(set(map(torch.device, devices))) < len(devices)


def wrap_model(module, devices):
    """What a step calls on ``devices``: the module itself, ``nn.DataParallel`` over several GPUs, or
    :class:`SimulatedDataParallel` over one device listed several times. Explained in 05_multi_gpu_resnet."""
    if len(devices) == 1:
        return module
    if not _simulated(devices) and all(torch.device(d).type == "cuda" for d in devices):
        return nn.DataParallel(module, device_ids=devices)
    return SimulatedDataParallel(module, devices)


def describe_devices(devices):
    """In words, how a step uses ``devices``, for a notebook to print. Explained in 05_multi_gpu_resnet."""
    k, first = len(devices), torch.device(devices[0])
    if k == 1:
        return tr(f"one device, {first}: no wrapper", f"1つのデバイス（{first}）。ラッパーなし")
    if _simulated(devices):
        return tr(f"{k} simulated devices on {first}: each batch is split by mparlib.parallel.data_parallel",
                  f"{first} 上の {k}つの模擬デバイス。各バッチを mparlib.parallel.data_parallel で分けます")
    return tr(f"{k} GPUs: each batch is split by nn.DataParallel", f"GPU {k}枚。各バッチを nn.DataParallel で分けます")


@dataclass
class StepPlan:
    """How the epoch loop runs one step: what it calls, with which optimizer and numbers. Explained in 07_performance.

    :func:`classic_plan` gives chapter 05's step, ``mparlib.fastpath.plan`` the fast one; the loop is the same.
    """

    model: nn.Module  # what a step calls: the module, its nn.DataParallel, or a compiled module
    optimizer: torch.optim.Optimizer
    loss_fn: nn.Module
    prepare: Callable  # (X, y, device) -> (X, y) on the device, in the layout the model wants
    autocast: Callable  # () -> the context manager of the forward pass
    scheduler: object = None  # stepped after every optimizer step
    batch_size: int = None  # train on batches of exactly this size only (one compiled graph shape); None: all
    plot_points: int = 5  # where the loop reads its sums per epoch: plot, NaN check (0: at the epoch's end only)
    cuda_graphs: bool = False  # mark each step's start for CUDA graphs
    settings: Callable = contextlib.nullcontext  # () -> context manager around the whole run (e.g. cudnn.benchmark)
    info: dict = None  # recorded as History.fast


def classic_plan(model, device, lr):
    """Chapter 05's step as a :class:`StepPlan`: SGD, cross-entropy, fp32. Explained in 07_performance."""
    return StepPlan(model=model, optimizer=make_optimizer(model, lr), loss_fn=nn.CrossEntropyLoss(),
                    prepare=move_batch, autocast=functools.partial(autocast_context, device))
