"""Training images per second of ``nn.DataParallel`` and of DDP, same model and global batch. Explained in 06_ddp.

Both time the course's training step (:func:`mparlib.step.train_step`) on random images (from a generator of their
own: the global random state is not reseeded) with :func:`mparlib.timing.measure`, the course's one way to time:
a warm-up, then at least a given number of steps and 50 ms, the clock synchronised; DDP's steps last as long as the
slowest rank's.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .checks import positive_int
from .ddp_train import make_model
from .devices import check_devices, try_all_gpus
from .rendezvous import device as rank_device
from .step import train_step
from .timing import measure, slowest_rank


def _time_steps(model, n, steps, warmup, device, seed=0, ranks=False):
    """:class:`~mparlib.timing.Timing` of SGD steps on ``n`` random images (``warmup`` untimed, then >= ``steps``).

    :func:`mparlib.timing.measure` times them: at least ``steps`` steps and 50 ms; with ``ranks``, a barrier before
    each step and the slowest rank's time (every rank stops after the same step).
    """
    steps = positive_int(steps, "steps", 3)
    warmup = positive_int(warmup, "warmup", 1, minimum=0)
    g = torch.Generator().manual_seed(seed)  # timing needs no real data: images (n, 1, 28, 28) in [0, 1], labels (n,)
    x, y = torch.rand(n, 1, 28, 28, generator=g).to(device), torch.randint(0, 10, (n,), generator=g).to(device)
    optimizer, loss_fn = torch.optim.SGD(model.parameters(), lr=0.01), nn.CrossEntropyLoss()
    options = {"before": dist.barrier, "across": slowest_rank} if ranks else {}
    return measure(lambda: train_step(model, x, y, loss_fn, optimizer), warmup=warmup, min_repeats=steps,
                   device=device, **options)


def _rates(images, timing):
    """Images per second from the median step, and from the slowest and the fastest step (the spread)."""
    return {"images_per_s": images / timing.median,
            "images_per_s_min_max": [images / max(timing.times), images / min(timing.times)],
            "step_s": timing.summary()}


def ddp_worker(model="resnet18", per_rank_batch=16, steps=3, warmup=1):
    """Images per second of DDP over all ranks (run it with ``launch``). Explained in 06_ddp.

    Each step's time is the slowest rank's; the rate comes from the median step (``images_per_s_min_max``: from the
    slowest and the fastest step), after ``warmup`` untimed steps, over at least ``steps`` steps and 50 ms.
    """
    positive_int(per_rank_batch, "per_rank_batch", 16)
    world, device = dist.get_world_size(), rank_device()
    # DDP broadcasts rank 0's weights when it wraps the model: the ranks start alike without a common seed
    net = DDP(make_model(model).to(device), device_ids=[device.index] if device.type == "cuda" else None)
    timing = _time_steps(net, per_rank_batch, steps, warmup, device, seed=dist.get_rank(), ranks=True)
    return {**_rates(per_rank_batch * world, timing), "world_size": world, "per_rank_batch": per_rank_batch,
            "backend": dist.get_backend(), "threads": torch.get_num_threads()}


def dataparallel(model="resnet18", batch_size=32, steps=3, warmup=1, devices=None):
    """Images per second of ``nn.DataParallel`` in this process (the chapter-5 way). Explained in 06_ddp.

    On a machine without GPUs ``DataParallel`` simply calls the model: one process using the CPU's threads. Timed as
    :func:`ddp_worker` times its steps (the median step; at least ``steps`` steps and 50 ms).
    """
    positive_int(batch_size, "batch_size", 32)
    devices = check_devices(devices or try_all_gpus())
    net = make_model(model).to(devices[0])
    net = nn.DataParallel(net, device_ids=[d.index for d in devices] if devices[0].type == "cuda" else None)
    timing = _time_steps(net, batch_size, steps, warmup, devices[0])
    return {**_rates(batch_size, timing), "devices": [str(d) for d in devices], "threads": torch.get_num_threads()}
