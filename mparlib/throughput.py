"""Training images per second of ``nn.DataParallel`` and of DDP on the same model and global batch.

Both time the course's one training step (:func:`mparlib.train.train_step`) on random images after a warm-up, with
the clock synchronised; DDP's number covers all ranks. Explained in 06_ddp.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .errors import ConfigError
from .lang import tr
from .timing import Timer


def _synthetic_batch(n, side=28, seed=0):
    """``n`` random images ``(n, 1, side, side)`` in [0, 1] and labels ``(n,)``: timing needs no real data. Explained in 06_ddp."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, side, side, generator=g), torch.randint(0, 10, (n,), generator=g)


def _check(steps, warmup, batch):
    for name, value, low in (("steps", steps, 1), ("warmup", warmup, 0), ("batch", batch, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(tr(f"{name}={value!r}: use an int >= {low}.", f"{name}={value!r}: {low} 以上の整数を指定してください。"))


def _time_steps(model, x, y, steps, warmup, device, barrier=None):
    """Seconds for ``steps`` SGD steps after ``warmup`` untimed ones (``barrier`` lines the ranks up first)."""
    from .step import train_step

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    timer = Timer(device)
    for i in range(warmup + steps):
        if i == warmup:
            if barrier is not None:
                barrier()
            timer.start()
        train_step(model, x, y, loss_fn, optimizer)
    if barrier is not None:
        barrier()
    return timer.stop()


def ddp_worker(model="resnet18", per_rank_batch=16, steps=3, warmup=1):
    """Images per second of DDP over all ranks (run it with ``launch``). Explained in 06_ddp."""
    from .ddp import make_model
    from .launch import device as rank_device

    _check(steps, warmup, per_rank_batch)
    world, device = dist.get_world_size(), rank_device()
    torch.manual_seed(0)
    net = DDP(make_model(model).to(device), device_ids=[device.index] if device.type == "cuda" else None)
    x, y = _synthetic_batch(per_rank_batch, seed=dist.get_rank())
    seconds = _time_steps(net, x.to(device), y.to(device), steps, warmup, device, barrier=dist.barrier)
    return {"images_per_s": steps * per_rank_batch * world / seconds, "seconds": seconds, "world_size": world,
            "per_rank_batch": per_rank_batch, "backend": dist.get_backend(), "threads": torch.get_num_threads()}


def dataparallel(model="resnet18", batch_size=32, steps=3, warmup=1, devices=None):
    """Images per second of ``nn.DataParallel`` in this process (the chapter-5 way). Explained in 06_ddp.

    On a machine without GPUs ``DataParallel`` simply calls the model: one process using the CPU's threads.
    """
    from .ddp import make_model
    from .devices import check_devices, try_all_gpus

    _check(steps, warmup, batch_size)
    devices = check_devices(devices or try_all_gpus())
    torch.manual_seed(0)
    net = make_model(model).to(devices[0])
    net = nn.DataParallel(net, device_ids=[d.index for d in devices] if devices[0].type == "cuda" else None)
    x, y = _synthetic_batch(batch_size)
    seconds = _time_steps(net, x.to(devices[0]), y.to(devices[0]), steps, warmup, devices[0])
    return {"images_per_s": steps * batch_size / seconds, "seconds": seconds, "devices": [str(d) for d in devices],
            "threads": torch.get_num_threads()}
