"""Layouts of the course ViT on a device mesh: built from the chapters' pieces, trained and measured. Explained in 12_planning.

A layout says how many ways each form of parallelism splits the work: ``dp`` (data parallel, plain with
``zero=0`` or fully sharded with ``zero=3``), ``tp`` (tensor parallel inside each block), ``cp`` (context
parallel: the tokens split, ring attention), ``pp`` (pipeline stages). The ranks form a mesh
``(pp, dp, cp, tp)``, tensor parallelism innermost and the pipeline outermost, as the planner assumes. This
module builds a layout from the pieces of chapters 09-11 (FSDP2's ``fully_shard``, DTensor's
``parallelize_module``, ``torch.distributed.pipelining``, :func:`mparlib.ring_attention.ring_attention`), runs
training steps on it, and measures a step's peak memory (:class:`StepMemory`) and time
(:func:`mparlib.timing.measure`), plus the planner's inputs on the same ranks (:func:`measure_inputs`).
"""
import collections
import functools
import math
import os
import threading
import time
import weakref
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from . import schedules
from .checks import one_of, positive_int
from .collectives import fit_alpha_beta, time_collective
from .errors import ConfigError
from .lang import tr
from .planner import Cluster, Collective, Layout, ModelShape, by_kind, collectives, memory_per_rank, step_time, tp_layers
from .rendezvous import device
from .ring_attention import ring_attention, ring_exchange, shard_sequence
from .sharding import CollectiveLog, tensor_collectives, training_tensors
from .timing import measure
from .vit import SIZES, vit

MESH_DIMS = ("pp", "dp", "cp", "tp")  # outermost first: ranks next to each other share a tp group
STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}  # DTensor's form of each style of planner.TP_PLAN
DEFAULTS = {"dp": 1, "zero": 0, "tp": 1, "cp": 1, "pp": 1, "micro_batches": 1, "schedule": "1f1b"}


def check_layout(layout, world=None):
    """The layout dict with every field filled in and checked. Explained in 12_planning.

    Fields (as :class:`mparlib.planner.Layout` names them): ``dp``, ``zero`` (0 or 3: FSDP), ``tp``, ``cp``,
    ``pp``, ``micro_batches`` (of each data-parallel share, for the pipeline) and ``schedule``. ``zero=0`` averages
    the gradients in one all-reduce after the backward pass, as DDP does without its overlap. ``world``, if given,
    must equal ``pp x dp x cp x tp``.
    """
    if not isinstance(layout, dict) or set(layout) - set(DEFAULTS):
        raise ConfigError(tr(f"layout={layout!r}: give a dict with some of the fields {list(DEFAULTS)}, "
                             "e.g. {'dp': 4, 'zero': 3, 'tp': 2}.",
                             f"layout={layout!r}: {list(DEFAULTS)} のいくつかをキーに持つ dict を渡してください"
                             "（例: {'dp': 4, 'zero': 3, 'tp': 2}）。"))
    out = {**DEFAULTS, **layout}
    for name in ("dp", "tp", "cp", "pp", "micro_batches"):
        positive_int(out[name], name, DEFAULTS[name], "layout")
    one_of(out["zero"], "zero", (0, 3), "layout")
    one_of(out["schedule"], "schedule", ("gpipe", "1f1b"), "layout")
    size = math.prod(out[d] for d in MESH_DIMS)
    if world is not None and size != world:
        raise ConfigError(tr(f"layout {name_of(out)} uses {size} ranks, but {world} are running; choose degrees "
                             f"whose product pp x dp x cp x tp is {world}.",
                             f"レイアウト {name_of(out)} はランクを {size}個使いますが、動いているのは {world}個です。"
                             f"積 pp x dp x cp x tp が {world} になる次数を選んでください。"))
    if out["zero"] == 3 and out["cp"] > 1:
        raise ConfigError(tr("layout: FSDP (zero=3) shards over dp only, and context-parallel ranks need their "
                             "gradients summed too; use zero=0 (gradients averaged over dp x cp) with cp > 1.",
                             "layout: FSDP（zero=3）は dp の向きにしかシャーディングしませんが、コンテキスト並列の"
                             "ランクも勾配を足し合わせる必要があります。cp > 1 では zero=0（dp x cp で勾配を平均）を使って"
                             "ください。"))
    if out["zero"] == 0 and out["tp"] > 1:
        raise ConfigError(tr("layout: zero=0 averages plain gradients in one flat all-reduce, and tensor-parallel "
                             "parameters are DTensors; combine tp > 1 with zero=3 (FSDP).",
                             "layout: zero=0 はふつうのテンソルの勾配を 1つの平たいオールリデュースで平均しますが、"
                             "テンソル並列のパラメータは DTensor です。tp > 1 は zero=3（FSDP）と組み合わせてください。"))
    if out["pp"] == 1 and out["micro_batches"] > 1:
        raise ConfigError(tr(f"layout: micro_batches={out['micro_batches']} splits each share for a pipeline, and "
                             "pp=1 has none (the layouts do not accumulate gradients); use micro_batches=1 or pp > 1.",
                             f"layout: micro_batches={out['micro_batches']} はパイプラインのために各分担を分けますが、"
                             "pp=1 にはパイプラインがありません（レイアウトは勾配を蓄積しません）。micro_batches=1 に"
                             "するか pp を 2 以上にしてください。"))
    if out["pp"] > 1 and out["schedule"] == "1f1b" and out["micro_batches"] < out["pp"]:
        raise ConfigError(tr(f"layout: 1F1B needs at least pp={out['pp']} micro-batches, not "
                             f"{out['micro_batches']}; raise micro_batches or use schedule='gpipe'.",
                             f"layout: 1F1B には pp={out['pp']}個以上のマイクロバッチが必要です"
                             f"（{out['micro_batches']}個ではなく）。micro_batches を増やすか schedule='gpipe' に"
                             "してください。"))
    return out


def check_split(config, layout, global_batch):
    """Refuse, before anything is built, a checked layout the ViT ``config`` or the batch cannot take. Explained in 12_planning.

    The planner's :meth:`~mparlib.planner.Layout.check` (heads and MLP width by ``tp``, tokens by ``cp``, the
    global batch into ``dp x micro_batches`` equal micro-batches), and the blocks into ``pp`` stages of equal
    size: the planner counts a stage's collectives and memory for equal stages.
    """
    model = _shape_of(config)
    Layout(**layout).check(model, global_batch)
    if model.layers % layout["pp"]:
        fits = [str(p) for p in range(1, model.layers + 1) if model.layers % p == 0]
        raise ConfigError(tr(f"layout: the model's {model.layers} blocks do not split into pp={layout['pp']} stages "
                             f"of equal size; use a pp that divides {model.layers} ({', '.join(fits)}).",
                             f"layout: モデルの {model.layers}個のブロックは、同じ大きさのステージに pp={layout['pp']} "
                             f"で分けられません。{model.layers} を割り切る pp（{'、'.join(fits)}）を使ってください。"))


def block_plan(model):
    """DTensor's plan for a block of the ViT ``model``, built from ``planner.TP_PLAN``. Explained in 12_planning.

    ``{"attn.q": ColwiseParallel(), ..., "mlp.fc2": RowwiseParallel()}``: the planner counts its collectives from
    the same table (:func:`mparlib.planner.collectives`), so what runs and what is predicted cannot drift apart.
    """
    return {layer: STYLES[style]() for layer, style in tp_layers(ModelShape.from_vit(model.config)).items()}


def name_of(layout):
    """A short name such as ``"fsdp 4 x tp 2"`` (degrees of 1 left out). Explained in 12_planning."""
    layout = {**DEFAULTS, **layout}
    parts = [f"{'fsdp' if layout['zero'] == 3 else 'dp'} {layout['dp']}"] if layout["dp"] > 1 or layout["zero"] else []
    parts += [f"{d} {layout[d]}" for d in ("tp", "cp", "pp") if layout[d] > 1]
    return " x ".join(parts) or "1"


class SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over ``group`` forward, and of the gradient backward. Explained in 12_planning."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class LayoutStage(nn.Module):
    """Stage ``s`` of ``p`` of a ViT, its tokens split over ``cp_group``. Explained in 12_planning.

    The first stage embeds the images ``(B, 1, 28, 28)`` and keeps this rank's slice of the tokens
    ``(B, T / cp, dim)``; the last one takes the mean over all ``T`` tokens (a sum over the context-parallel ranks)
    and classifies: ``(B, classes)``. With ``p = 1`` it is the whole model.
    """

    def __init__(self, model, s, p, cp_group=None):
        super().__init__()
        depth = len(model.blocks)
        self.first, self.last, self.cp_group = s == 0, s == p - 1, cp_group
        self.tokens = model.pos.shape[1]
        self.blocks = model.blocks[depth * s // p:depth * (s + 1) // p]
        if self.first:
            self.embed, self.pos = model.embed, model.pos
        if self.last:
            self.norm, self.head = model.norm, model.head

    def forward(self, x):
        cp = self.cp_group
        if self.first:  # (B, 1, 28, 28) -> (B, T, dim) -> this rank's (B, T / cp, dim)
            x = self.embed(x).flatten(2).transpose(1, 2) + self.pos
            if cp is not None:
                x = shard_sequence(x, dist.get_rank(cp), dist.get_world_size(cp), dim=1)
        for block in self.blocks:
            x = block(x)
        if not self.last:
            return x.contiguous()  # sent to the next stage: gloo sends dense tensors only
        total = self.norm(x).sum(dim=1)  # (B, dim): this rank's tokens
        if cp is not None:
            total = SumOverGroup.apply(total, cp)
        return self.head(total / self.tokens)


def _storage(t):
    """``(key, storage, bytes)`` of the memory behind a tensor (a DTensor: its local shard; a pending collective's
    result: the tensor it wraps), or None where there is no readable storage."""
    if isinstance(t, AsyncCollectiveTensor):
        t = t.elem
    if hasattr(t, "to_local"):
        t = t.to_local()
    try:
        s = t.untyped_storage()
        return ((s.device, s.data_ptr()) if s.data_ptr() else ("empty", id(s))), s, s.nbytes()
    except (RuntimeError, NotImplementedError):
        return None


class StepMemory(TorchDispatchMode):
    """The peak of every byte a rank holds inside ``with StepMemory(model, optimizer):``. Explained in 12_planning.

    The idea of chapter 09's :class:`~mparlib.sharding.PeakMemory`, made cheap enough for thousands of operators
    on 8 processes: the storages of the training state when the block starts (parameters, gradients, optimizer
    state: :func:`~mparlib.sharding.training_tensors`) and every storage an operator creates inside it are kept in
    a running total, each removed when it is freed (weak references); ``peak`` is the largest total after any
    operator and ``peak_op`` the operator's number. The total only grows when an operator creates a storage, so
    this is the exact peak of what lives across operators. Pass ``parts_at=peak_op`` in a second, identical step to
    get ``parts``, the split at that moment into ``params``, ``grads``, ``optimizer`` and ``other`` (activations,
    temporaries, buffers of collectives). ``sizes_at_peak``: how many storages of each size were live at the peak,
    ``{bytes: count}``, which names the buffers a peak is made of. DTensors count their local shards, as everywhere
    in the course.

    A collective's buffer is freed by whichever thread lets go of it last: gloo's worker thread may still hold it
    for a moment after the call has returned, and then frees it (and this count drops it) there, later. The total
    is kept under a lock for that reason, and two identical steps may differ by such a buffer at their peaks.
    """

    def __init__(self, model, optimizer=None, parts_at=None):
        super().__init__()
        self.model, self.optimizer, self.parts_at = model, optimizer, parts_at
        self.live, self.total, self.ops, self.peak, self.peak_op, self.parts = {}, 0, 0, 0, 0, None
        self.sizes_at_peak = {}
        self.lock = threading.RLock()  # re-entrant: a storage may be freed on this thread while it adds another

    def _add(self, t):
        found = _storage(t) if isinstance(t, torch.Tensor) else None
        if found is None or not found[2]:
            return
        key, storage, nbytes = found
        with self.lock:
            if key in self.live:
                return
            self.live[key] = nbytes
            self.total += nbytes
        weakref.finalize(storage, self._drop, key)

    def _sizes(self):
        with self.lock:
            return dict(collections.Counter(self.live.values()))

    def _drop(self, key):
        with self.lock:
            self.total -= self.live.pop(key, 0)

    def split(self):
        """The bytes live now, split into params, grads, optimizer (each storage once) and other."""
        parts, seen = {}, set()
        for part, tensors in training_tensors(self.model, self.optimizer).items():
            parts[part] = 0
            for t in tensors:
                found = _storage(t) if t is not None else None
                if found is not None and found[0] not in seen:
                    seen.add(found[0])
                    parts[part] += found[2]
        parts["other"] = self.total - sum(parts.values())
        return parts

    def __enter__(self):
        out = super().__enter__()
        for tensors in training_tensors(self.model, self.optimizer).values():
            for t in tensors:
                self._add(t)
        self.peak, self.sizes_at_peak = self.total, self._sizes()
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            self._add(t)
        self.ops += 1
        if self.total > self.peak:
            self.peak, self.peak_op, self.sizes_at_peak = self.total, self.ops, self._sizes()
        if self.ops == self.parts_at:
            self.parts = self.split()
        return out


def _groups_over(mesh, dims):
    """This rank's group spanning the mesh dimensions ``dims`` (the other coordinates fixed)."""
    grid = mesh.mesh.permute(*[MESH_DIMS.index(d) for d in MESH_DIMS if d not in dims],
                             *[MESH_DIMS.index(d) for d in dims])
    lists = grid.reshape(-1, math.prod(grid.shape[-len(dims):])).tolist()
    mine, _ = dist.new_subgroups_by_enumeration(lists)
    return mine


def build(model, layout, mesh):
    """Split ``model`` (the same on every rank) as ``layout`` says, on ``mesh``. Explained in 12_planning.

    Returns ``(module, stage)``: the module this rank trains (its pipeline stage, tensor-parallel, sharded by FSDP
    with ``zero=3``) and its ``PipelineStage`` (None without a pipeline). With ``zero=0`` the gradients are
    averaged after the backward pass by :func:`average_gradients` (the :class:`Trainer` does it).
    """
    dev = device()
    cp_group = mesh["cp"].get_group() if layout["cp"] > 1 else None
    if cp_group is not None:
        for block in model.blocks:
            block.attn.attend = functools.partial(ring_attention, group=cp_group)
    if layout["tp"] > 1:
        for block in model.blocks:
            block.attn.heads //= layout["tp"]  # each tp rank computes its share of the heads
            parallelize_module(block, mesh["tp"], block_plan(model))
    s = mesh["pp"].get_local_rank()
    module = LayoutStage(model, s, layout["pp"], cp_group).to(dev)
    if layout["zero"] == 3:
        for block in module.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
    stage = None
    if layout["pp"] > 1:
        stage = PipelineStage(module, s, layout["pp"], dev, group=mesh["pp"].get_group())
    return module, stage


def make_mesh(layout):
    """The ``(pp, dp, cp, tp)`` device mesh of a checked layout. Explained in 12_planning."""
    return init_device_mesh(device().type, tuple(layout[d] for d in MESH_DIMS), mesh_dim_names=MESH_DIMS)


def average_gradients(module, group, size):
    """Average the gradients over ``group`` of ``size`` ranks: one all-reduce of a flat vector. Explained in 12_planning.

    The data-parallel step of ``zero=0`` (chapter 11's ``average_gradients`` on a group). Context-parallel ranks
    are in the group too: each holds the gradient of its own tokens, and the sum over the ring of
    :class:`SumOverGroup`'s backward multiplied the loss's gradient by ``cp``, which the division by
    ``size = dp x cp`` undoes.
    """
    grads = [p.grad for p in module.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads]).div_(size)  # (number of parameters,): one buffer
    dist.all_reduce(flat, group=group)
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


class Trainer:
    """One training step of a built layout on this rank's share of a global batch. Explained in 12_planning.

    ``step(x, y, optimizer)`` takes the whole batch ``(B, 1, 28, 28)``, ``(B,)`` (the same on every rank), keeps
    the rows of this rank's data-parallel share, runs forward and backward (through the pipeline schedule when
    there is one) and the optimizer's step, and returns this share's mean loss on the ranks that compute it
    (the last stage's first cp and tp rank), else None.
    """

    def __init__(self, module, stage, layout, mesh):
        self.module, self.stage, self.layout = module, stage, layout
        self.share, self.dp = mesh["dp"].get_local_rank(), layout["dp"]
        last = mesh["pp"].get_local_rank() == layout["pp"] - 1
        self.reports = last and mesh["cp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
        self.replicas = layout["dp"] * layout["cp"] if layout["zero"] == 0 else 1
        self.group = _groups_over(mesh, ("dp", "cp")) if self.replicas > 1 else None
        self.schedule = None
        if stage is not None:
            self.schedule = schedules.schedule_class(layout["schedule"])(
                stage, n_microbatches=layout["micro_batches"], loss_fn=F.cross_entropy)

    def step(self, x, y, optimizer):
        k = len(y) // self.dp
        dev = device()
        x, y = x[self.share * k:(self.share + 1) * k].to(dev), y[self.share * k:(self.share + 1) * k].to(dev)
        optimizer.zero_grad()
        if self.schedule is None:
            loss = F.cross_entropy(self.module(x), y)
            loss.backward()
        else:
            micro = []
            args = (x,) if self.stage.is_first else ()
            kwargs = {"target": y, "losses": micro} if self.stage.is_last else {}
            self.schedule.step(*args, **kwargs)
            loss = torch.stack(micro).mean() if self.stage.is_last else None
        if self.group is not None:
            average_gradients(self.module, self.group, self.replicas)
        optimizer.step()
        return loss.item() if self.reports else None


def global_losses(mine):
    """The mean over the data-parallel shares of each step's loss, on every rank. Explained in 12_planning.

    ``mine``: this rank's list of losses, or of None where it does not compute the loss.
    """
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    reporting = [r for r in every if r and r[0] is not None]
    return [sum(r[i] for r in reporting) / len(reporting) for i in range(len(reporting[0]))]


def slowest(values):
    """The elementwise maximum of a list of floats over all ranks (``measure``'s ``across``). Explained in 12_planning."""
    t = torch.tensor(values, dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def run_layout(config, layout, batches, *, lr=0.05, adam_lr=1e-3, timed=3, seed=0):
    """Build ``layout`` of the ViT ``config``, check it, and measure it; every rank calls. Explained in 12_planning.

    From the same seed as a one-process reference: SGD steps on ``batches`` (whole global batches) for the parity
    check (``losses``: the global mean loss of each step); then Adam: one warm-up step (Adam creates its state),
    two identical steps inside :class:`StepMemory` (``memory``: the largest rank's ``peak`` of all it holds, the
    split of that peak into parameters, gradients, optimizer state and other, each rank's peak, and each rank's
    peak in the repeated step, the same but for a collective's buffer freed late: :class:`StepMemory`; and each
    rank's ``sizes_at_peak``), one more
    inside chapter 09's :class:`~mparlib.sharding.CollectiveLog` (``collectives``: for each rank its pipeline
    stage and its calls and bytes by kind), and
    ``timed`` steps after one more warm-up, each between barriers (``step``: the summary of a
    :class:`~mparlib.timing.Timing`, the slowest rank's time per step).
    """
    layout = check_layout(layout, dist.get_world_size())
    check_split(config, layout, len(batches[0][1]))
    mesh = make_mesh(layout)
    torch.manual_seed(seed)
    module, stage = build(vit_of(config), layout, mesh)
    trainer = Trainer(module, stage, layout, mesh)
    sgd = torch.optim.SGD(module.parameters(), lr=lr)
    losses = global_losses([trainer.step(x, y, sgd) for x, y in batches])
    adam = torch.optim.Adam(module.parameters(), lr=adam_lr, foreach=False)  # no temporaries of all parameters at once
    x, y = batches[0]
    trainer.step(x, y, adam)
    first = StepMemory(module, adam)
    with first:
        trainer.step(x, y, adam)
    second = StepMemory(module, adam, parts_at=first.peak_op)
    with second:  # the same operators again: the split at the peak
        trainer.step(x, y, adam)
    log = CollectiveLog()
    with log:  # one more identical step: every collective this rank runs
        trainer.step(x, y, adam)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"peak": first.peak, "again": second.peak, "parts": second.parts,
                                   "sizes": first.sizes_at_peak,
                                   "stage": mesh["pp"].get_local_rank(), "collectives": log.summary()})
    top = max(every, key=lambda r: r["peak"])
    timing = measure(lambda: trainer.step(x, y, adam), warmup=0, min_seconds=0, min_repeats=timed,
                     max_repeats=timed, before=dist.barrier, across=slowest)
    return {"layout": layout, "name": name_of(layout), "losses": losses,
            "memory": {"peak": top["peak"], "parts": top["parts"], "per_rank": [r["peak"] for r in every],
                       "repeated": [r["again"] for r in every], "sizes_at_peak": [r["sizes"] for r in every]},
            "collectives": [{"stage": r["stage"], **r["collectives"]} for r in every],
            "step": timing.summary()}


def vit_of(config):
    """The course ViT of ``config``: a dict with an optional ``size`` and ViTConfig fields. Explained in 12_planning."""
    config = dict(config)
    return vit(config.pop("size", "smoke"), **config)


def _shape_of(config):
    """The planner's ``ModelShape`` of the ViT ``config``, without building the model."""
    config = dict(config)
    return ModelShape.from_vit(replace(SIZES[one_of(config.pop("size", "smoke"), "size", tuple(SIZES), "vit")],
                                       **config))


# The planner's inputs, measured on the same ranks -------------------------------------------------------------------

def _kind_calls(group):
    """Each kind of call the layouts make, as ``fn(x)`` on a whole tensor ``x``, in ``group``."""
    g = dist.get_world_size(group)

    def exchange(x):  # chapter 11's ring step: a send to the next rank and a receive from the previous one
        for request in ring_exchange([x], group)[1]:
            request.wait()

    reduce_scatter, all_gather = tensor_collectives()
    return {"all_reduce": lambda x: dist.all_reduce(x, group=group),
            "all_gather": lambda x: all_gather(x, x[:x.numel() // g].clone(), group=group),
            "reduce_scatter": lambda x: reduce_scatter(x[:x.numel() // g].clone(), x, group=group),
            "send": exchange}


def measure_inputs(sizes=(2**12, 2**16, 2**20), groups=(2, 4, 8), matmul=(512, 128, 512), repeats=5):
    """Alpha-beta of each kind of call on groups of each size and the FLOP/s of one rank, all ranks at once. Explained in 12_planning.

    For each group size ``g``, the ranks form ``world / g`` groups of neighbours, and every group calls at the same
    time, as the groups of a layout do (:func:`mparlib.collectives.time_collective`: a barrier before each call,
    the slowest rank's time): all-reduces, all-gathers, reduce-scatters and sends to the next rank (with a receive
    from the previous one), on whole tensors of ``sizes`` bytes. ``fits[g]``: chapter 08's ``fit_alpha_beta`` of
    the all-reduces on the message bytes; ``link``: one fit of the all-reduces over all groups on the bytes each
    rank sends in a ring (``2 (g - 1) / g`` of the message), the form the planner's
    :class:`~mparlib.planner.Cluster` takes; ``kinds``: the same fit for each kind (sent bytes ``(g - 1) / g`` of an
    all-gather's or reduce-scatter's whole tensor, all of a send). ``flops_per_s``: an ``(m, k) x (k, n)`` matrix
    product timed on every rank at once (``2 m k n`` FLOPs over the slowest rank's median).
    """
    rows, world = [], dist.get_world_size()
    for g in groups:
        mine, _ = dist.new_subgroups(group_size=g)
        for kind, fn in _kind_calls(mine).items():
            for n in sizes:
                timing = time_collective(fn, n // 4, min_seconds=0, min_repeats=repeats, max_repeats=repeats)
                sent = Collective("dp", kind, 1, n // 4 * 4, g, g).sent_bytes  # the planner's ring traffic
                rows.append({"kind": kind, "group": g, "groups": world // g, "bytes": n // 4 * 4,
                             "sent_bytes": sent, **timing.summary()})
    fits = {g: fit_alpha_beta([r["bytes"] for r in rows if r["kind"] == "all_reduce" and r["group"] == g],
                              [r["median"] for r in rows if r["kind"] == "all_reduce" and r["group"] == g])
            for g in groups}
    kinds = {kind: fit_alpha_beta([r["sent_bytes"] for r in rows if r["kind"] == kind],
                                  [r["median"] for r in rows if r["kind"] == kind]) for kind in dict.fromkeys(
                                      r["kind"] for r in rows)}
    m, k, n = matmul
    a, b = torch.randn(m, k, device=device()), torch.randn(k, n, device=device())
    timing = measure(lambda: torch.mm(a, b), warmup=1, min_seconds=0, min_repeats=repeats, max_repeats=repeats,
                     before=dist.barrier, across=slowest)
    return {"calls": rows, "fits": fits, "link": kinds["all_reduce"], "kinds": kinds,
            "matmul": {"shape": list(matmul), **timing.summary()}, "flops_per_s": 2 * m * k * n / timing.median,
            "world": world, "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world}


def measured_cluster(inputs, memory_bytes=None):
    """The planner's :class:`~mparlib.planner.Cluster` of this machine from :func:`measure_inputs`. Explained in 12_planning.

    One machine has no link between nodes: both links get the same measured alpha and beta (the all-reduces'), and
    each kind of call its own (``kind_costs``, from ``inputs["kinds"]``). ``memory_bytes`` per rank defaults to the
    machine's memory shared out (``inputs["memory_bytes"]``).
    """
    memory_bytes = inputs["memory_bytes"] if memory_bytes is None else memory_bytes
    link = inputs["link"]
    kinds = tuple((kind, fit["alpha"], fit["beta"]) for kind, fit in inputs["kinds"].items())
    return Cluster(devices_per_node=inputs["world"], memory_bytes=memory_bytes, flops_per_s=inputs["flops_per_s"],
                   alpha_intra=link["alpha"], beta_intra=link["beta"], alpha_inter=link["alpha"],
                   beta_inter=link["beta"], name="this machine", kind_costs=kinds)


def predict(config, layout, global_batch, cluster):
    """The planner's memory per rank and step time for a layout of the ViT ``config``. Explained in 12_planning.

    Returns ``{"memory": {params, grads, optimizer, activations, gathered, flat_copy, total} (bytes), "time":
    {part: seconds, ..., "total"}}``, in fp32 with Adam, as :func:`run_layout` trains.
    """
    model = _shape_of(config)
    plan = Layout(**check_layout(layout))
    memory = memory_per_rank(model, plan, global_batch, precision="fp32", optimizer="adam")
    time = step_time(model, plan, global_batch, cluster, precision="fp32")
    return {"memory": {"params": memory.parameters, "grads": memory.gradients, "optimizer": memory.optimizer,
                       "activations": memory.activations, "gathered": memory.gathered, "flat_copy": memory.flat_copy,
                       "total": memory.total},
            "time": {**{k: getattr(time, k) for k in ("compute", "tp", "cp", "pp", "bubble", "dp", "dp_exposed")},
                     "total": time.total}}


def predicted_collectives(config, layout, global_batch, stage=0):
    """The planner's collectives of pipeline rank ``stage`` in a layout of the ViT ``config``. Explained in 12_planning.

    ``{kind: {"calls": n, "bytes": total}}`` per step (:func:`mparlib.planner.collectives`), the form of
    :meth:`mparlib.sharding.CollectiveLog.summary`.
    """
    model = _shape_of(config)
    return by_kind(collectives(model, Layout(**check_layout(layout)), global_batch, "fp32", stage))


def collective_mismatches(config, result, global_batch, tolerance=0.01):
    """Where the collectives counted on each rank differ from the planner's. Explained in 12_planning.

    ``result``: one of :func:`run_layout`'s results. For every rank and kind, the calls must be equal and the bytes
    within ``tolerance`` of the counted ones; returns the list of ``{"rank", "kind", "predicted", "measured"}`` that
    are not (empty when every rank agrees).
    """
    found, none = [], {"calls": 0, "bytes": 0}
    stages = {c["stage"] for c in result["collectives"]}
    by_stage = {s: predicted_collectives(config, result["layout"], global_batch, s) for s in stages}
    for rank, counted in enumerate(result["collectives"]):
        counted = dict(counted)
        predicted = by_stage[counted.pop("stage")]
        for kind in sorted(set(predicted) | set(counted)):
            p, m = predicted.get(kind, none), counted.get(kind, none)
            if p["calls"] != m["calls"] or abs(p["bytes"] - m["bytes"]) > tolerance * max(m["bytes"], 1):
                found.append({"rank": rank, "kind": kind, "predicted": p, "measured": m})
    return found


def spearman(a, b):
    """Spearman's rank correlation of two lists of distinct values (1: the same order). Explained in 12_planning."""
    rank = lambda v: {x: i for i, x in enumerate(sorted(v))}  # noqa: E731
    ra, rb, n = rank(a), rank(b), len(a)
    if n < 2:
        raise ConfigError(tr("spearman needs at least two values in each list.",
                             "spearman には各リストに 2つ以上の値が必要です。"))
    return 1 - 6 * sum((ra[x] - rb[y]) ** 2 for x, y in zip(a, b)) / (n * (n * n - 1))


def layouts_worker(config, layout_list, batches, *, timed=3, inputs=None):
    """Every layout in turn on the same ranks, then the planner's inputs: one launch. Explained in 12_planning.

    ``inputs``: keyword arguments of :func:`measure_inputs`, or None to skip it. Returns ``{"layouts": [...]
    (:func:`run_layout`'s results, each with its ``wall`` seconds), "inputs": ... or None}``.
    """
    out = []
    for layout in layout_list:
        start = time.perf_counter()
        out.append(run_layout(config, layout, batches, timed=timed))
        dist.barrier()
        out[-1]["wall"] = time.perf_counter() - start
    return {"layouts": out, "inputs": None if inputs is None else measure_inputs(**inputs)}


def compare(config, report, global_batch, memory_goal=0.10, order_goal=0.8):
    """Predicted against measured, per layout, and the two goals. Explained in 12_planning.

    ``report``: :func:`layouts_worker`'s result (with its inputs). Each row has ``layout`` (its name),
    ``predicted_bytes_per_rank`` (the planner's total), ``measured_bytes_per_rank`` (the largest rank's peak),
    ``predicted_ms``, ``measured_ms`` (the median step) and the parts of both. ``goals``: memory within
    ``memory_goal`` of the measurement on every layout, and Spearman's rank correlation of the step times at least
    ``order_goal``.
    """
    cluster = measured_cluster(report["inputs"])
    rows = []
    for r in report["layouts"]:
        p = predict(config, r["layout"], global_batch, cluster)
        rows.append({"layout": r["name"], "predicted_bytes_per_rank": p["memory"]["total"],
                     "measured_bytes_per_rank": r["memory"]["peak"], "predicted_ms": p["time"]["total"] * 1e3,
                     "measured_ms": r["step"]["median"] * 1e3, "measured_iqr_ms": r["step"]["iqr"] * 1e3,
                     "memory_error": p["memory"]["total"] / r["memory"]["peak"] - 1,
                     "predicted_parts": p["memory"], "measured_parts": r["memory"]["parts"],
                     "predicted_time_parts": p["time"], "busy": r["step"]["busy"]})
    rho = spearman([r["predicted_ms"] for r in rows], [r["measured_ms"] for r in rows])
    worst = max(abs(r["memory_error"]) for r in rows)
    return {"rows": rows, "cluster": {k: getattr(cluster, k) for k in ("flops_per_s", "alpha_intra", "beta_intra",
                                                                      "kind_costs")},
            "goals": {"memory_within": {"target": memory_goal, "worst": worst, "met": worst <= memory_goal},
                      "time_order": {"spearman": rho, "target": order_goal, "met": rho >= order_goal}}}
