"""Mixture of experts: a feed-forward layer of many small MLPs, each token sent to a few of them, and its parallel form.

A router (one linear layer) scores every token against every expert; the token goes to its ``k`` best experts and
their outputs are mixed with the softmax gates (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch
Transformer, Fedus et al. 2021). Each expert accepts at most ``capacity = ceil(capacity_factor * tokens * k /
experts)`` tokens of a group; the rest are dropped (their residual connection carries them on unchanged). The
auxiliary load-balancing loss of the Switch Transformer, ``experts * sum_i f_i P_i``, pushes the router towards an
even load. :class:`MoE` runs in one process; :class:`ExpertParallelMoE` puts the experts on different ranks and
moves tokens to them and back with ``all_to_all_single``. Explained in 11_sequence_context_experts.
"""
import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .checks import finite_float, int_in, positive_int
from .errors import ConfigError, LaunchError
from .lang import tr
from .vit import MLP, ViT


def capacity(tokens, experts, k=1, capacity_factor=1.25):
    """How many tokens of a group one expert accepts: ``ceil(capacity_factor * tokens * k / experts)``. Explained in 11_sequence_context_experts."""
    return math.ceil(capacity_factor * tokens * k / experts)


@dataclass
class Routing:
    """Where the tokens of one group go: the kept assignments, sorted by expert. Explained in 11_sequence_context_experts."""

    token: torch.Tensor  # (kept,) row of the group's token of each kept assignment
    expert: torch.Tensor  # (kept,) its expert, ascending
    gate: torch.Tensor  # (kept,) its weight in the mix (differentiable)
    kept: torch.Tensor  # (experts,) kept assignments per expert
    routed: torch.Tensor  # (experts,) assignments per expert before the capacity cut
    dropped: int  # assignments over capacity
    aux_loss: torch.Tensor  # the Switch load-balancing loss of the group
    capacity: int


def route(logits, k=1, capacity_factor=1.25):
    """Top-``k`` routing of a group's router scores ``(tokens, experts)`` with a capacity cut. Explained in 11_sequence_context_experts.

    Gates are the softmax probabilities of the chosen experts (renormalised over the ``k`` when ``k > 1``, as in
    GShard). Assignments fill the experts in order of choice (every token's first choice before any second
    choice), then of token: those past ``capacity`` are dropped. The auxiliary loss is ``E * sum_i f_i P_i`` with
    ``f_i`` the share of tokens whose first choice is expert ``i`` and ``P_i`` the mean router probability of ``i``
    (Switch Transformer, eq. 4): 1 for a perfectly even router, up to ``E`` when all go to one expert.
    """
    tokens, experts = logits.shape
    probs = F.softmax(logits, dim=-1)
    gate, expert = probs.topk(k, dim=-1)  # (tokens, k)
    if k > 1:
        gate = gate / gate.sum(dim=-1, keepdim=True)
    e_flat, g_flat = expert.t().reshape(-1), gate.t().reshape(-1)  # choice-major: all first choices first
    t_flat = torch.arange(tokens, device=logits.device).repeat(k)
    onehot = F.one_hot(e_flat, experts)
    position = (onehot.cumsum(0) - 1).gather(1, e_flat[:, None]).squeeze(1)  # place in its expert's queue
    cap = capacity(tokens, experts, k, capacity_factor)
    keep = (position < cap).nonzero().squeeze(1)
    keep = keep[torch.argsort(e_flat[keep], stable=True)]  # grouped by expert, token order inside
    share = F.one_hot(expert[:, 0], experts).to(probs.dtype).mean(0)
    return Routing(token=t_flat[keep], expert=e_flat[keep], gate=g_flat[keep],
                   kept=torch.bincount(e_flat[keep], minlength=experts), routed=onehot.sum(0),
                   dropped=int(len(e_flat) - len(keep)), aux_loss=experts * (share * probs.mean(0)).sum(),
                   capacity=cap)


def _run_experts(experts, rows, counts):
    """Rows grouped by expert (``counts[e]`` rows for expert ``e``) through their experts, in the same order."""
    pieces = rows.split([int(c) for c in counts])
    return torch.cat([expert(piece) for expert, piece in zip(experts, pieces, strict=True)])


def _summary(routings):
    return {"kept": sum(r.kept for r in routings), "routed": sum(r.routed for r in routings),
            "per_group": torch.stack([r.kept for r in routings]),
            "dropped": sum(r.dropped for r in routings), "capacity": routings[0].capacity}


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer in one process: ``(..., dim) -> (..., dim)``. Explained in 11_sequence_context_experts.

    ``experts`` MLPs of width ``hidden`` (:class:`mparlib.vit.MLP`), a bias-free router ``Linear(dim, experts)``.
    The tokens are cut into ``groups`` equal groups, routed and capacity-limited group by group (with ``groups``
    equal to the number of ranks, it computes what :class:`ExpertParallelMoE` computes on ranks that each hold one
    group). After a call, ``aux_loss`` is the mean of the groups' balancing losses and ``last`` counts kept,
    routed and dropped assignments.
    """

    def __init__(self, dim, hidden, experts=4, k=1, capacity_factor=1.25, groups=1):
        super().__init__()
        positive_int(experts, "experts", 4, "MoE")
        int_in(k, "k", 1, experts, 1, "MoE")
        finite_float(capacity_factor, "capacity_factor", 1.25, "MoE")
        self.k, self.capacity_factor, self.groups = k, capacity_factor, positive_int(groups, "groups", 1, "MoE")
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(MLP(dim, hidden) for _ in range(experts))
        self.aux_loss, self.last = None, None

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        if len(flat) % self.groups:
            raise ConfigError(tr(f"MoE: {len(flat)} tokens do not cut into {self.groups} equal groups.",
                                 f"MoE: {len(flat)}個のトークンは {self.groups}個の同じ大きさのグループに分けられません。"))
        outs, routings = [], []
        for chunk in flat.chunk(self.groups):
            r = route(self.router(chunk), self.k, self.capacity_factor)
            y = _run_experts(self.experts, chunk[r.token], r.kept) * r.gate[:, None]
            outs.append(torch.zeros_like(chunk).index_add(0, r.token, y))
            routings.append(r)
        self.aux_loss = torch.stack([r.aux_loss for r in routings]).mean()
        self.last = _summary(routings)
        return torch.cat(outs).view_as(x)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single forward; backward the same exchange with the split sizes swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, log, label):
        ctx.splits, ctx.group, ctx.log, ctx.label = (out_splits, in_splits), group, log, label
        return _exchange(x, out_splits, in_splits, group, log, label)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group, ctx.log, ctx.label + " backward"), *[None] * 5


def _exchange(x, out_splits, in_splits, group, log, label):
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    row = math.prod(x.shape[1:]) * x.element_size()
    mine = in_splits[dist.get_rank(group)]
    log.append({"what": label, "bytes": x.numel() * x.element_size(), "leaving": (sum(in_splits) - mine) * row})
    return out


class ExpertParallelMoE(nn.Module):
    """A :class:`MoE` whose experts live on different ranks; tokens travel by all-to-all. Explained in 11_sequence_context_experts.

    Built from a full ``MoE`` (the same on every rank): rank ``r`` of ``n`` keeps experts ``r E / n`` to
    ``(r + 1) E / n`` and a copy of the router, and routes its own tokens (one group). A forward pass makes three
    all-to-alls: the counts per expert (so every rank knows how many rows it will receive), the tokens to their
    experts, the results back. Backward, the last two run again in reverse. ``traffic`` lists the bytes passed to
    every call of the last step (``bytes``) and the part of them that left this rank (``leaving``).
    """

    def __init__(self, moe, group=None):
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise LaunchError(tr("ExpertParallelMoE places experts on the ranks of a process group, and this process "
                                 "is in none. Build it inside a worker started by mparlib.launch.launch.",
                                 "ExpertParallelMoE はエキスパートをプロセスグループのランクに置きますが、このプロセス"
                                 "はどのプロセスグループにも属していません。mparlib.launch.launch で起動したワーカーの"
                                 "中で作ってください。"))
        rank, world, experts = dist.get_rank(group), dist.get_world_size(group), len(moe.experts)
        if experts % world:
            raise ConfigError(tr(f"ExpertParallelMoE: {experts} experts do not divide by {world} ranks; every rank "
                                 f"holds the same number. Use a multiple of {world} experts.",
                                 f"ExpertParallelMoE: エキスパート {experts}個は {world}個のランクで割り切れません。"
                                 f"各ランクは同じ数を持ちます。エキスパートの数を {world} の倍数にしてください。"))
        self.group, self.world, self.num_experts = group, world, experts
        self.k, self.capacity_factor = moe.k, moe.capacity_factor
        self.router = copy.deepcopy(moe.router)
        per = experts // world
        self.first = rank * per
        self.experts = nn.ModuleList(copy.deepcopy(moe.experts[i]) for i in range(self.first, self.first + per))
        self.aux_loss, self.last, self.traffic = None, None, []

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        r = route(self.router(flat), self.k, self.capacity_factor)
        self.traffic = log = []  # this step's calls (the backward pass adds its two to the same list)
        per, world = len(self.experts), self.world
        # 1. counts: rank s learns how many rows every rank sends to each of its experts, (world * per,)
        recv_counts = _exchange(r.kept, [per] * world, [per] * world, self.group, log, "counts")
        send_splits = [int(c) for c in r.kept.view(world, per).sum(1)]  # rows for each rank (experts are in order)
        recv_splits = [int(c) for c in recv_counts.view(world, per).sum(1)]
        # 2. dispatch: the rows, already grouped by expert and so by rank
        recv = _AllToAll.apply(flat[r.token], recv_splits, send_splits, self.group, log, "dispatch")
        # rows arrive grouped by source rank, then expert: regroup by expert, run, put back in arrival order
        sizes = recv_counts.view(world, per)
        pieces = recv.split([int(c) for c in sizes.reshape(-1)])
        by_expert = [torch.cat([pieces[s * per + e] for s in range(world)]) for e in range(per)]
        outs = [expert(rows) for expert, rows in zip(self.experts, by_expert, strict=True)]
        cut = [o.split([int(c) for c in sizes[:, e]]) for e, o in enumerate(outs)]
        done = torch.cat([cut[e][s] for s in range(world) for e in range(per)])
        # 3. combine: the results go back to the ranks their tokens came from
        back = _AllToAll.apply(done, send_splits, recv_splits, self.group, log, "combine")
        self.aux_loss = r.aux_loss
        self.last = _summary([r]) | {"received": int(recv_counts.sum())}
        return torch.zeros_like(flat).index_add(0, r.token, back * r.gate[:, None]).view_as(x)

    def expert_parameters(self):
        """The parameters only this rank holds (its experts); the router is replicated."""
        return list(self.experts.parameters())


def average_gradients(model, group=None):
    """Data-parallel averaging of gradients in a model with expert-parallel layers. Explained in 11_sequence_context_experts.

    Each rank's loss is the mean over its own batch, and the model's loss the mean over the ranks. Replicated
    parameters: all-reduce the gradients and divide by the ranks. Experts: their gradient already sums what every
    rank's tokens contributed (the all-to-all carried them), so they are only divided. Returns the number of
    all-reduces.
    """
    world = dist.get_world_size(group)
    local = {id(p) for m in model.modules() if isinstance(m, ExpertParallelMoE) for p in m.expert_parameters()}
    count = 0
    for p in model.parameters():
        if p.grad is None:
            continue
        if id(p) not in local:
            dist.all_reduce(p.grad, group=group)
            count += 1
        p.grad /= world
    return count


def moe_vit(config, experts=4, k=1, capacity_factor=1.25, groups=1):
    """An :class:`mparlib.vit.ViT` whose blocks' MLPs are :class:`MoE` layers. Explained in 11_sequence_context_experts."""
    model = ViT(config)
    for block in model.blocks:
        block.mlp = MoE(config.dim, config.hidden, experts, k, capacity_factor, groups)
    return model


def expert_parallel(model, group=None):
    """Replace every :class:`MoE` of ``model`` (in place) by its :class:`ExpertParallelMoE`. Explained in 11_sequence_context_experts."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, MoE):
                setattr(module, child_name, ExpertParallelMoE(child, group))
    return model


def aux_loss(model):
    """The mean balancing loss of the model's expert layers after a forward pass. Explained in 11_sequence_context_experts."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, (MoE, ExpertParallelMoE))]
    return torch.stack(losses).mean()


def predicted_traffic(kept, dim, element_size, rank):
    """Bytes one rank passes to each all-to-all of a forward and backward pass, from the routing. Explained in 11_sequence_context_experts.

    ``kept`` is a ``(world, experts)`` table: row ``s`` counts the kept assignments of rank ``s``'s tokens per
    expert (experts in order, ``experts / world`` per rank). Rank ``rank`` sends its kept rows, receives the rows
    of all ranks for its own experts, and passes back as many as it received; backward mirrors both. Counts are
    int64.
    """
    world, experts = kept.shape
    per = experts // world
    sent = int(kept[rank].sum())
    received = int(kept[:, rank * per:(rank + 1) * per].sum())
    row = dim * element_size
    return {"counts": experts * 8, "dispatch": sent * row, "combine": received * row,
            "combine backward": sent * row, "dispatch backward": received * row}
