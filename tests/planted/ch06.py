"""Planted wrong answers to chapter 06's exercises: each must be rejected with the hint key it names."""
import os

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler


def sum_only(model):  # 06.1 -> missing_division
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def halve(model):  # 06.1 -> wrong_divisor: divides by a fixed 2, the check runs 3 processes
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= 2


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
    ("06.2", "forgot_set_epoch", shares_without_set_epoch),
    ("06.3", "missing_barrier", save_without_barrier),
    ("06.3", "not_atomic", save_in_place),
]

# Also rejected with their hints (checked by hand): left out of PLANTED because each costs a start of fresh processes
# in the generic tests.
EXTRA_PLANTED = [
    ("06.1", "wrong_divisor", halve),
    ("06.2", "different_orders", shares_seeded_by_rank),
    ("06.3", "module_prefix", save_wrapper),
]
