"""Planted wrong answers to chapter 06's exercises: each must be rejected with the hint key it names."""
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler


def sum_only(model):  # 06.1 -> missing_division
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def halve(model):  # 06.1 -> wrong_divisor: divides by a fixed 2, right only when the check runs 2 processes
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= 2


def divide_by_three(model):  # 06.1 -> wrong_divisor: a hard-coded world size, right only on 3 processes
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= 3


def copy_from_the_check(model):  # 06.1 -> no_all_reduce: looks for the expected gradients instead of computing them
    """Takes the gradients of any other model in reach (the frames above it, then every object the collector knows):
    a check whose rank held the whole batch's model would be fooled."""
    shapes = [None if p.grad is None else p.grad.shape for p in model.parameters()]
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    found = [v for f in frames for v in f.f_locals.values()] + gc.get_objects()
    for other in found:
        if isinstance(other, torch.nn.Module) and other is not model and sum(1 for _ in other.parameters()):
            grads = [p.grad for p in other.parameters()]
            if [None if g is None else g.shape for g in grads] == shapes:
                for p, g in zip(model.parameters(), grads):
                    if g is not None:
                        p.grad = g.clone()
                return


def forge_the_reply(dataset, num_epochs, seed=0):  # 06.2: replaces the check worker's reply with no runs at all
    """Writes the reply of the worker that started the ranks (whose frames a forked rank shares) and kills that
    worker: a check that compared the runs that came back would find none wrong."""
    frame = sys._getframe()
    while frame.f_globals.get("__name__") != "mparlib.exercises.sandbox" or "box" not in frame.f_locals:
        frame = frame.f_back
    torch.save({"kind": "value", "value": []}, os.path.join(str(frame.f_locals["box"]), "reply.pt"))
    os.kill(os.getppid(), 9)
    return []


def shares_without_set_epoch(dataset, num_epochs, seed=0):  # 06.2 -> forgot_set_epoch
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
    return [list(sampler) for _ in range(num_epochs)]


def shares_seeded_by_rank(dataset, num_epochs, seed=0):  # 06.2 -> different_orders
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed + dist.get_rank())
    out = []
    for epoch in range(num_epochs):
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def save_without_barrier(model, path):  # 06.3 -> missing_barrier
    if dist.get_rank() == 0:
        torch.save(model.module.state_dict(), f"{path}.tmp")
        os.replace(f"{path}.tmp", path)


def save_wrapper(model, path):  # 06.3 -> module_prefix
    if dist.get_rank() == 0:
        torch.save(model.state_dict(), f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
    dist.barrier()


def save_in_place(model, path):  # 06.3 -> not_atomic
    if dist.get_rank() == 0:
        torch.save(model.module.state_dict(), path)
    dist.barrier()


PLANTED = [
    ("06.1", "missing_division", sum_only),
    ("06.1", "wrong_divisor", halve),
    ("06.1", "wrong_divisor", divide_by_three),
    ("06.1", "no_all_reduce", copy_from_the_check),
    ("06.2", "forgot_set_epoch", shares_without_set_epoch),
    ("06.2", "different_orders", shares_seeded_by_rank),
    ("06.3", "missing_barrier", save_without_barrier),
    ("06.3", "not_atomic", save_in_place),
    ("06.3", "module_prefix", save_wrapper),
]
