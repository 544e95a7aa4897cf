"""Sharding: what the memory of training holds, and how N ranks split it (ZeRO, FSDP). Explained in 09_sharding.

Data parallelism keeps everything on every rank: the parameters, their gradients and the optimizer's state.
Sharding keeps 1/N of some of it on each rank and fetches the rest by communication when it is needed. This module
holds what the chapter, its tests and its benchmark share:

- the arithmetic: bytes per parameter for a precision and an optimizer, and what each ZeRO stage leaves per rank,
- the accounting: the bytes a rank really holds, counted from its tensors (a DTensor counts its local shard),
- :class:`ShardedOptimizer`: ZeRO from primitives (reduce-scatter the gradients, update the local shard, all-gather
  the parameters),
- :class:`CollectiveLog`: which collectives ran inside a ``with`` block, and how many bytes each moved,
- :func:`fsdp_memory_worker`: one FSDP2 training run that reports its memory per rank (for the benchmark).

Sharded checkpoints are :mod:`mparlib.sharded_checkpoint`.
"""
import math
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from .checks import int_in, one_of, positive_int
from .errors import ConfigError
from .lang import tr
from .rendezvous import device as rank_device
from .timing import synchronize
from .vit import vit

# Bytes per parameter held while training, by precision: the weights used in the forward pass, their gradients,
# and an fp32 "master" copy of the weights that mixed precision updates. The optimizer adds its own state.
PRECISIONS = {
    "fp32": {"params": 4, "grads": 4, "master": 0, "state": 4},  # everything in float32
    "bf16": {"params": 2, "grads": 2, "master": 0, "state": 2},  # everything in bfloat16, optimizer state too
    "mixed": {"params": 2, "grads": 2, "master": 4, "state": 4},  # bf16 compute, fp32 master weights and state
    "mixed_fp32_grads": {"params": 2, "grads": 6, "master": 4, "state": 4},  # + fp32 gradient accumulation
}
STATES_PER_PARAMETER = {"sgd": 0, "momentum": 1, "adam": 2}  # Adam: first and second moment (exp_avg, exp_avg_sq)
PUBLISHED_SIZES = {"1B": 1e9, "7B": 7e9, "8B": 8e9, "70B": 70e9}  # the sizes the Ultra-Scale Playbook tabulates

# torch 2.13 renamed the tensor forms of reduce-scatter and all-gather (and deprecated reduce_scatter_tensor and
# all_gather_into_tensor); earlier releases know only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def bytes_per_parameter(precision="fp32", optimizer="adam"):
    """Bytes one parameter costs in training, by part: params, grads, optimizer. Explained in 09_sharding.

    ``optimizer`` counts the optimizer's state plus the fp32 master weights of mixed precision, as ZeRO does (its
    stage 1 shards both). fp32 with Adam: 4 + 4 + 8 = 16 bytes.
    """
    p = PRECISIONS[one_of(precision, "precision", tuple(PRECISIONS), "bytes_per_parameter")]
    states = STATES_PER_PARAMETER[one_of(optimizer, "optimizer", tuple(STATES_PER_PARAMETER), "bytes_per_parameter")]
    return {"params": p["params"], "grads": p["grads"], "optimizer": p["master"] + states * p["state"]}


def zero_bytes_per_rank(n_params, world, stage, precision="fp32", optimizer="adam"):
    """Bytes per rank of ``n_params`` parameters on ``world`` ranks under ZeRO ``stage`` 0-3. Explained in 09_sharding.

    Stage 0 is plain data parallelism (DDP); stage 1 shards the optimizer state, stage 2 also the gradients,
    stage 3 also the parameters (FSDP's full sharding).
    """
    int_in(stage, "stage", 0, 3, 1, "zero_bytes_per_rank")
    positive_int(world, "world", 8, "zero_bytes_per_rank")
    per = bytes_per_parameter(precision, optimizer)
    sharded = {"optimizer": stage >= 1, "grads": stage >= 2, "params": stage >= 3}
    return {k: n_params * b / (world if sharded[k] else 1) for k, b in per.items()}


# Counting what a rank holds ---------------------------------------------------------------------------------------

def tensor_bytes(tensors):
    """Bytes of memory behind ``tensors`` on this rank, each storage counted once. Explained in 09_sharding.

    A DTensor counts its local shard. Storages, not shapes, are counted: views of one buffer count once, and the
    padding FSDP adds so that every rank's shard has the same size counts too (it is memory the rank holds).
    """
    storages = {}
    for t in tensors:
        if t is None:
            continue
        s = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()  # a DTensor: its local shard
        key = (s.device, s.data_ptr()) if s.data_ptr() else ("empty", id(s))
        storages[key] = s.nbytes()
    return sum(storages.values())


def held_bytes(model, optimizer=None):
    """``{"params", "grads", "optimizer"}``: bytes this rank holds for ``model``'s training. Explained in 09_sharding.

    ``optimizer`` may be a ``torch.optim`` optimizer, a ``ZeroRedundancyOptimizer`` (its local optimizer counts) or
    a :class:`ShardedOptimizer` (its gradient slice counts as grads; its slice of the weights is part of the
    parameters' buffer and counts there).
    """
    params = list(model.parameters())
    grads = [p.grad for p in params]
    state = []
    if isinstance(optimizer, ShardedOptimizer):
        grads.append(optimizer.shard.grad)
        optimizer = optimizer.optimizer
    if optimizer is not None:
        inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its local one in .optim
        state += [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    return {"params": tensor_bytes(params), "grads": tensor_bytes(grads), "optimizer": tensor_bytes(state)}


# ZeRO from primitives ---------------------------------------------------------------------------------------------

class ShardedOptimizer:
    """ZeRO from primitives: each rank updates 1/N of the parameters with its own optimizer. Explained in 09_sharding.

    The parameters move into one flat buffer of ``N S`` elements (each becomes a view of its stretch; the tail is
    padding), and rank r owns elements ``[r S, (r+1) S)``: it keeps the optimizer state and, after :meth:`step`,
    the gradient for them only. ``step()``:

    1. flattens the local gradients and reduce-scatters them: rank r receives the sum over ranks of its slice, and
       divides it by N (the mean, as DDP computes),
    2. runs the wrapped optimizer (``optimizer_class(**options)``) on its slice, in place in the buffer,
    3. all-gathers every rank's slice into the buffer, that is, into every rank's parameters.

    With an optimizer that works element by element (SGD, Adam, AdamW) this is exactly data parallelism with that
    optimizer; one that looks at whole tensors (LAMB, clipping by a global norm) needs more communication. The
    parameters must share one dtype and device; a parameter without a gradient counts as a zero gradient.
    """

    def __init__(self, params, optimizer_class=torch.optim.Adam, group=None, **options):
        self.params = [p for p in params if p.requires_grad]
        if not self.params or len({(p.dtype, p.device) for p in self.params}) != 1:
            raise ConfigError(tr("ShardedOptimizer needs parameters that share one dtype and one device.",
                                 "ShardedOptimizer には、dtype とデバイスがすべて同じパラメータを渡してください。"))
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.total = sum(p.numel() for p in self.params)
        self.shard_size = math.ceil(self.total / self.world)  # S: every rank's slice has the same length
        self.flat = torch.zeros(self.world * self.shard_size, dtype=self.params[0].dtype,
                                device=self.params[0].device)  # (N * S,)
        offset = 0
        for p in self.params:
            piece = self.flat[offset:offset + p.numel()]
            piece.copy_(p.detach().reshape(-1))
            p.data = piece.view_as(p)  # the parameter now lives in the buffer
            offset += p.numel()
        start = self.rank * self.shard_size
        self.shard = torch.nn.Parameter(self.flat[start:start + self.shard_size])  # (S,), a view of the buffer
        self.optimizer = optimizer_class([self.shard], **options)

    @torch.no_grad()
    def step(self):
        """Reduce-scatter the gradients, update this rank's slice, all-gather the parameters."""
        grads = torch.zeros_like(self.flat)  # (N * S,)
        torch.cat([torch.zeros_like(p).reshape(-1) if p.grad is None else p.grad.reshape(-1) for p in self.params],
                  out=grads[:self.total])
        for p in self.params:
            p.grad = None  # from here on this rank keeps only the gradient of its own slice
        shard_grad = torch.empty_like(self.shard)  # (S,)
        _reduce_scatter(shard_grad, grads, op=dist.ReduceOp.SUM, group=self.group)
        self.shard.grad = shard_grad.div_(self.world)
        self.optimizer.step()
        _all_gather(self.flat, self.shard.detach().clone(), group=self.group)

    def zero_grad(self, set_to_none=True):
        """Forget the gradients (the model's and this rank's slice)."""
        for p in self.params:
            p.grad = None
        self.shard.grad = None


# Watching the collectives -----------------------------------------------------------------------------------------

class CollectiveLog(TorchDispatchMode):
    """Record the collectives run inside ``with CollectiveLog() as log:``, with their bytes. Explained in 09_sharding.

    Collectives of ``torch.distributed`` (and so FSDP's) reach PyTorch's dispatcher as operators of the ``c10d``
    namespace; this mode sees each one and records its kind and the bytes of the whole tensor it works on (the
    gathered output of an all-gather, the unreduced input of a reduce-scatter). ``log.calls`` is the list of
    ``(kind, bytes)``; :meth:`summary` totals them by kind.
    """

    KINDS = {"_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_":
             "all_gather", "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
             "allreduce_": "all_reduce", "broadcast_": "broadcast"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func.overloadpacket.__name__
            whole = args[1] if name in ("_reduce_scatter_base_", "reduce_scatter_") else args[0]
            pieces = whole if isinstance(whole, (list, tuple)) else [whole]
            flat = [t for x in pieces for t in (x if isinstance(x, (list, tuple)) else [x]) if torch.is_tensor(t)]
            self.calls.append((self.KINDS.get(name, name), sum(t.numel() * t.element_size() for t in flat)))
        return func(*args, **(kwargs or {}))

    def summary(self):
        """``{kind: {"calls": n, "bytes": total}}`` of what was recorded."""
        out = {}
        for kind, nbytes in self.calls:
            entry = out.setdefault(kind, {"calls": 0, "bytes": 0})
            entry["calls"] += 1
            entry["bytes"] += nbytes
        return out


# One FSDP2 run that reports its memory per rank (the benchmark's worker) ------------------------------------------

def fsdp_memory_worker(size="small", batch=8, steps=3, warmup=1, lr=1e-3, reshard_after_forward=True, seed=0):
    """Train a ViT with FSDP2 for a few steps; per-rank bytes, step times, collectives. Explained in 09_sharding.

    Every block and then the root are wrapped with ``fully_shard``; Adam. The bytes are counted after the last
    step, before the gradients are dropped (what a rank holds after the step, not its peak during it). Each rank
    trains on its own random batch of ``batch`` images: the memory and the time per step do not depend on the pixels. Returns, on
    every rank, a dict with ``bytes_per_rank`` (the largest rank's count of each part), ``per_rank`` (each rank's;
    on a GPU also ``cuda_max_allocated``), ``step_s`` (each timed step, slowest rank) and the collectives of a step.
    """
    dev, world, rank = rank_device(), dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed)
    model = vit(size).to(dev)
    mesh = init_device_mesh(dev.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh)  # the root keeps its default: not resharded, the backward needs it at once
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed + 1 + rank)
    X, y = torch.randn(batch, 1, 28, 28, generator=g).to(dev), torch.randint(0, 10, (batch,), generator=g).to(dev)
    times, log = [], None
    for i in range(warmup + steps):
        optimizer.zero_grad()
        synchronize(dev)
        dist.barrier()
        start = time.perf_counter()
        with CollectiveLog() as log:
            torch.nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()
        synchronize(dev)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    mine = held_bytes(model, optimizer)
    if dev.type == "cuda":
        mine["cuda_max_allocated"] = torch.cuda.max_memory_allocated(dev)
    everyone = [None] * world
    dist.all_gather_object(everyone, {"bytes": mine, "times": times})
    return {"world_size": world, "device": dev.type, "threads": torch.get_num_threads(),
            "bytes_per_rank": {k: max(r["bytes"][k] for r in everyone) for k in ("params", "grads", "optimizer")},
            "per_rank": [r["bytes"] for r in everyone],
            "step_s": [max(r["times"][i] for r in everyone) for i in range(steps)],
            "collectives_per_step": log.summary()}
