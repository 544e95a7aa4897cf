"""Worker functions for tests/test_experts.py: importable by the spawned ranks.

Every rank builds the same full layer (or model) from one seed and the same tokens; rank r holds group r of them,
which the one-process layer built with ``groups = world`` routes as its group r.
"""
import torch
import torch.distributed as dist
from torch.nn import functional as F

from mparlib import experts as ep
from mparlib.vit import ViTConfig

CONFIG = ViTConfig(dim=16, depth=2, heads=2, hidden=32, patch=7)  # 16 tokens per image


def layer_vs_one_process(capacity_factor, experts=8, k=2, dim=8, hidden=16, tokens=12, seed=0):
    """An expert-parallel layer against the one-process layer: differences, drops, bytes counted and predicted."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    full = ep.MoE(dim, hidden, experts, k, capacity_factor, groups=world).double()
    x = torch.randn(world, tokens, dim, dtype=torch.float64)
    w = torch.randn(world, tokens, dim, dtype=torch.float64)
    x_full = x.clone().requires_grad_()
    y_full = full(x_full)
    (y_full * w).sum().backward()
    part = ep.ExpertParallelMoE(full)
    x_mine = x[rank].clone().requires_grad_()
    y = part(x_mine)
    (y * w[rank]).sum().backward()
    dist.all_reduce(part.router.weight.grad)  # the router is replicated: its gradient sums every rank's tokens
    grads = {f"experts.{part.first + i}.{n}": p.grad
             for i, e in enumerate(part.experts) for n, p in e.named_parameters()}
    grads["router.weight"] = part.router.weight.grad
    ref = dict(full.named_parameters())
    dropped = torch.tensor([part.last["dropped"]])
    dist.all_reduce(dropped)
    return {"output": (y - y_full[rank]).abs().max().item(),
            "input grad": (x_mine.grad - x_full.grad[rank]).abs().max().item(),
            "grads": {n: (g - ref[n].grad).abs().max().item() for n, g in grads.items()},
            "experts here": len(part.experts), "dropped": int(dropped), "dropped one process": full.last["dropped"],
            "counted": {t["what"]: t["bytes"] for t in part.traffic},
            "calls": [t["what"] for t in part.traffic], "leaving": {t["what"]: t["leaving"] for t in part.traffic},
            "predicted": ep.predicted_traffic(full.last["per_group"], dim, 8, rank),
            "per_group": full.last["per_group"].tolist()}


def layer_checks():
    """The layer without drops (capacity factor = experts) and with drops (0.5), and the uneven split refused."""
    out = {"no drops": layer_vs_one_process(8.0), "drops": layer_vs_one_process(0.5)}
    try:
        ep.ExpertParallelMoE(ep.MoE(4, 8, experts=3))
    except Exception as e:  # noqa: BLE001 - the test checks the type and the message
        out["uneven"] = (type(e).__name__, str(e))
    return out


def train_steps(images, labels, steps=3, lr=0.05, aux_weight=0.01, seed=0):
    """SGD steps of the expert-parallel MoE ViT on rank r's share of each batch; the loss of every step (all ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = ep.expert_parallel(ep.moe_vit(CONFIG, experts=4, capacity_factor=1.0, groups=world))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    b = len(labels[0]) // world
    losses = []
    for X, y in zip(images[:steps], labels[:steps], strict=True):
        X, y = X[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
        loss = F.cross_entropy(model(X), y) + aux_weight * ep.aux_loss(model)
        opt.zero_grad()
        loss.backward()
        ep.average_gradients(model)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses
