"""Sharding: what the memory of training holds, and how N ranks split it (ZeRO, FSDP). Explained in 09_sharding.

Data parallelism keeps everything on every rank: the parameters, their gradients and the optimizer's state.
Sharding keeps 1/N of some of it on each rank and fetches the rest by communication when it is needed. This module
holds what the chapter, its tests and its benchmark share:

- the arithmetic: bytes per parameter for a precision and an optimizer, and what each ZeRO stage leaves per rank,
- the accounting: the bytes a rank really holds, counted from its tensors (a DTensor counts its local shard),
- :class:`ShardedOptimizer`: ZeRO-1 from primitives (reduce-scatter the gradients, update the local shard,
  all-gather the parameters), and :class:`Zero2Optimizer`, ZeRO-2, whose gradients are reduce-scattered bucket by
  bucket during the backward pass,
- :class:`CollectiveLog`: which collectives ran inside a ``with`` block, and how many bytes each moved,
- :class:`PeakMemory`: the peak of the training state a rank holds during a step, counted after every operator,
- :func:`fsdp_memory_worker` and :func:`peak_memory_worker`: what one rank holds after a step of FSDP2, and the
  peaks of DDP, ZeRO-1, ZeRO-2 and FSDP2 (for the benchmark, the tests and the chapter).

Sharded checkpoints are :mod:`mparlib.sharded_checkpoint`.
"""
import contextlib
import math
import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from .checks import int_in, one_of, positive_int
from .errors import ConfigError
from .lang import tr
from .rendezvous import device as rank_device
from .timing import measure, slowest_rank, synchronize
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



def tensor_collectives(namespace=dist):
    """``(reduce_scatter, all_gather)``, the tensor forms under the names this torch has. Explained in 09_sharding.

    torch 2.13 renamed them ``reduce_scatter_single`` and ``all_gather_single`` (and deprecated the old names
    ``reduce_scatter_tensor`` and ``all_gather_into_tensor``, which warn); earlier releases, such as 2.11, know only
    the old names. Both take ``(output, input)`` in the same order. ``namespace`` is ``torch.distributed`` or any
    object with those attributes; one that has neither name is refused with a clear error.
    """
    for new, old in (("reduce_scatter_single", "reduce_scatter_tensor"), ("all_gather_single", "all_gather_into_tensor")):
        if not (hasattr(namespace, new) or hasattr(namespace, old)):
            raise ConfigError(tr(f"this torch.distributed has neither {new} nor {old}: ZeRO needs torch 2.6 or newer "
                                 "(pip install 'torch>=2.6').",
                                 f"この torch.distributed には {new} も {old} もありません。ZeRO には torch 2.6 以降が"
                                 "必要です（pip install 'torch>=2.6'）。"))
    return (getattr(namespace, "reduce_scatter_single", None) or namespace.reduce_scatter_tensor,
            getattr(namespace, "all_gather_single", None) or namespace.all_gather_into_tensor)


_reduce_scatter, _all_gather = tensor_collectives()


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


def training_tensors(model, optimizer=None):
    """``{"params", "grads", "optimizer"}``: the tensors of ``model``'s training state now. Explained in 09_sharding.

    The parameters are those the model exposes now (FSDP2 swaps in the gathered, unsharded ones while a unit
    computes) and those the optimizer updates (FSDP2's sharded DTensors, the slices of :class:`ShardedOptimizer`
    and :class:`Zero2Optimizer`); the gradients are theirs, plus the buffers the sharding code keeps for
    gradients; the optimizer part is every tensor in the optimizer's state. ``optimizer`` may be a ``torch.optim``
    optimizer, a ``ZeroRedundancyOptimizer`` (its local optimizer counts), a :class:`ShardedOptimizer` or a
    :class:`Zero2Optimizer`.
    """
    params = list(model.parameters())
    grads, state = [], []
    if isinstance(optimizer, (ShardedOptimizer, Zero2Optimizer)):
        grads += optimizer.gradient_buffers()
        optimizer = optimizer.optimizer
    if optimizer is not None:
        inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its local one in .optim
        params += [p for group in inner.param_groups for p in group["params"]]
        state += [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
    grads = [p.grad for p in params] + grads
    return {"params": params, "grads": grads, "optimizer": state}


def _storage_key(t):
    s = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()  # a DTensor: its local shard
    return ((s.device, s.data_ptr()) if s.data_ptr() else ("empty", id(s))), s.nbytes()


# The parts of a rank's training state as each edition names them in tables (GLOSSARY.md); keys as held_bytes
# returns them, "other" as mparlib.layouts.PeakMemory adds it (activations, buffers, temporaries)
PART_NAMES = {"params": ("params", "パラメータ"), "grads": ("grads", "勾配"),
              "optimizer": ("optimizer state", "オプティマイザの状態"), "other": ("other", "その他")}


def held_bytes(model, optimizer=None):
    """``{"params", "grads", "optimizer"}``: bytes this rank holds for ``model``'s training. Explained in 09_sharding.

    Counts the tensors of :func:`training_tensors`, each storage once and in the first part it appears in (the
    slice a :class:`ShardedOptimizer` updates is a view of the parameters' buffer: it counts as parameters).
    """
    seen, out = set(), {}
    for part, tensors in training_tensors(model, optimizer).items():
        out[part] = 0
        for t in tensors:
            if t is None:
                continue
            key, nbytes = _storage_key(t)
            if key not in seen:
                seen.add(key)
                out[part] += nbytes
    return out


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
        self.flat_grad = None  # the flat copy of all gradients, during step() only

    @torch.no_grad()
    def step(self):
        """Reduce-scatter the gradients, update this rank's slice, all-gather the parameters."""
        self.flat_grad = torch.zeros_like(self.flat)  # (N * S,): while it exists, the gradients exist twice
        torch.cat([torch.zeros_like(p).reshape(-1) if p.grad is None else p.grad.reshape(-1) for p in self.params],
                  out=self.flat_grad[:self.total])
        for p in self.params:
            p.grad = None  # from here on this rank keeps only the gradient of its own slice
        shard_grad = torch.empty_like(self.shard)  # (S,)
        _reduce_scatter(shard_grad, self.flat_grad, op=dist.ReduceOp.SUM, group=self.group)
        self.flat_grad = None
        self.shard.grad = shard_grad.div_(self.world)
        self.optimizer.step()
        _all_gather(self.flat, self.shard.detach().clone(), group=self.group)

    def zero_grad(self, set_to_none=True):
        """Forget the gradients (the model's and this rank's slice)."""
        for p in self.params:
            p.grad = None
        self.shard.grad = None

    def gradient_buffers(self):
        """The gradient tensors this object holds besides the model's ``p.grad``: its slice's, its flat copy."""
        return [self.shard.grad, self.flat_grad]


class _Bucket:
    """Some parameters moved into one flat buffer of ``N S`` elements; rank r updates elements ``[r S, (r+1) S)``."""

    def __init__(self, params, world, rank):
        self.params = params
        self.total = sum(p.numel() for p in params)
        self.size = math.ceil(self.total / world)  # S
        self.flat = torch.zeros(world * self.size, dtype=params[0].dtype, device=params[0].device)  # (N * S,)
        self.offsets, offset = {}, 0
        for p in params:
            piece = self.flat[offset:offset + p.numel()]
            piece.copy_(p.detach().reshape(-1))
            p.data = piece.view_as(p)  # the parameter now lives in the bucket's buffer
            self.offsets[p] = offset
            offset += p.numel()
        self.shard = torch.nn.Parameter(self.flat[rank * self.size:(rank + 1) * self.size])  # (S,), a view
        self.store, self.buffer, self.arrived = None, None, 0  # the gradient buffer while gradients arrive
        self.waiting = []  # parameters whose gradient arrived while the buffer served another bucket


class Zero2Optimizer:
    """ZeRO-2 from primitives: gradients reduce-scattered bucket by bucket in the backward. Explained in 09_sharding.

    The parameters are grouped into buckets of at most ``bucket_bytes`` (a larger parameter gets one of its
    own), in reverse order (the backward pass
    produces the last layers' gradients first); each bucket's parameters move into a flat buffer of ``N S``
    elements and rank r owns slice r of every bucket. A hook on each parameter
    (``register_post_accumulate_grad_hook``) copies its new gradient into the bucket's gradient buffer and frees
    it (``p.grad = None``); when a bucket's last gradient has arrived, the buffer is reduce-scattered (rank r keeps
    the mean of slice r, added to what it already holds, so accumulation over micro-batches works) and the next
    bucket takes it. There is one persistent buffer, the size of the largest bucket; a gradient that arrives for
    another bucket while it is busy (autograd's order is close to, not exactly, the reverse of the parameters')
    waits in ``p.grad`` until the buffer is free. So a rank never holds the full gradient: 1/N of it, one
    bucket, and the few parameter gradients that autograd has just produced. :meth:`step` runs ``optimizer_class(**options)`` on
    the slices and all-gathers every bucket into the parameters. Every rank must compute gradients for the same
    parameters (a parameter without a gradient counts as zero); they share one dtype and device.
    """

    def __init__(self, params, optimizer_class=torch.optim.Adam, bucket_bytes=2**20, group=None, **options):
        self.params = [p for p in params if p.requires_grad]
        if not self.params or len({(p.dtype, p.device) for p in self.params}) != 1:
            raise ConfigError(tr("Zero2Optimizer needs parameters that share one dtype and one device.",
                                 "Zero2Optimizer には、dtype とデバイスがすべて同じパラメータを渡してください。"))
        positive_int(bucket_bytes, "bucket_bytes", 2**20, "Zero2Optimizer")
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.buckets, current, size = [], [], 0
        for p in reversed(self.params):  # a bucket ends before it would exceed bucket_bytes (or holds one big p)
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > bucket_bytes:
                self.buckets.append(_Bucket(current, self.world, self.rank))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(_Bucket(current, self.world, self.rank))
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.pool, self.holder = [], None  # the one gradient buffer when idle; the bucket that has it
        self.reduced = 0  # reduce-scatters done since the last step (the tests and the chapter count them)
        self.optimizer = optimizer_class([b.shard for b in self.buckets], **options)
        self.hooks = [p.register_post_accumulate_grad_hook(self._arrived) for p in self.params]

    @torch.no_grad()
    def _arrived(self, p):
        b = self.bucket_of[p]
        b.waiting.append(p)
        self._fill(b)

    def _fill(self, b):
        """Copy ``b``'s waiting gradients into the gradient buffer, if ``b`` has it or can take it; reduce when full."""
        if b.buffer is None:
            if self.holder is not None:
                return  # the one buffer serves another bucket still: the gradient waits in p.grad
            if not self.pool:
                largest = max(self.world * c.size for c in self.buckets)
                self.pool.append(torch.empty(largest, dtype=self.params[0].dtype, device=self.params[0].device))
            b.store = self.pool.pop()
            b.buffer = b.store[:self.world * b.size].zero_()  # (N * S,): zeros for the padding
            self.holder = b
        for p in b.waiting:
            b.buffer[b.offsets[p]:b.offsets[p] + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None  # the full gradient of p is gone: only the bucket keeps it, until the bucket is reduced
            b.arrived += 1
        b.waiting = []
        if b.arrived == len(b.params):
            self._reduce(b)

    def _reduce(self, b):
        piece = torch.empty_like(b.shard)  # (S,)
        _reduce_scatter(piece, b.buffer, op=dist.ReduceOp.SUM, group=self.group)  # slice r, summed over ranks
        piece.div_(self.world)  # the mean over the ranks, as DDP computes it
        if b.shard.grad is None:
            b.shard.grad = piece
        else:
            b.shard.grad.add_(piece)  # a further micro-batch
        self.pool.append(b.store)
        b.store, b.buffer, b.arrived, self.holder = None, None, 0, None
        self.reduced += 1
        for c in self.buckets:  # a bucket whose gradients arrived while the buffer was busy takes it now
            if c.waiting:
                self._fill(c)
                break

    @torch.no_grad()
    def step(self):
        """Reduce what is still pending, update this rank's slices, all-gather every bucket's parameters."""
        while True:  # buckets with parameters that got no gradient (they count as zero), or still waiting
            pending = [b for b in self.buckets if b.buffer is not None] or [b for b in self.buckets if b.waiting]
            if not pending:
                break
            self._fill(pending[0])
            if pending[0].buffer is not None:
                self._reduce(pending[0])
        self.optimizer.step()
        for b in self.buckets:
            _all_gather(b.flat, b.shard.detach().clone(), group=self.group)
        self.reduced = 0

    def zero_grad(self, set_to_none=True):
        """Forget the gradients (the model's and this rank's slices)."""
        for p in self.params:
            p.grad = None
        for b in self.buckets:
            b.shard.grad = None

    def gradient_buffers(self):
        """The gradient tensors this object holds besides ``p.grad``: its slices' gradients and its buffers."""
        return [b.shard.grad for b in self.buckets] + list(self.pool) + [b.store for b in self.buckets]


# Watching the collectives -----------------------------------------------------------------------------------------

class CollectiveLog(TorchDispatchMode):
    """Record the collectives run inside ``with CollectiveLog() as log:``, with their bytes. Explained in 09_sharding.

    Collectives of ``torch.distributed`` (and so FSDP's and the pipeline's sends and receives) reach PyTorch's
    dispatcher as operators of the ``c10d`` namespace, DTensor's as functional collectives (``_c10d_functional``);
    this mode sees each one and records its kind and the bytes of the whole tensor it works on (the gathered output
    of an all-gather, the unreduced input of a reduce-scatter, what a send sends or a receive receives). Waiting
    for a functional collective is not a call of its own. ``log.calls`` is the list of ``(kind, bytes)``;
    :meth:`summary` totals them by kind. Chapter 12 compares it with the planner's count.
    """

    KINDS = {"_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_":
             "all_gather", "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
             "allreduce_": "all_reduce", "broadcast_": "broadcast", "send": "send", "recv_": "recv",
             "alltoall_base_": "all_to_all", "all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all"}
    NOT_CALLS = ("wait_tensor", "_wrap_tensor_autograd")  # functional collectives' waits and wrappers

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "c10d":
            whole = args[1] if name in ("_reduce_scatter_base_", "reduce_scatter_") else args[0]
            pieces = whole if isinstance(whole, (list, tuple)) else [whole]
            flat = [t for x in pieces for t in (x if isinstance(x, (list, tuple)) else [x]) if torch.is_tensor(t)]
            self.calls.append((self.KINDS.get(name, name), sum(t.numel() * t.element_size() for t in flat)))
        elif func.namespace == "_c10d_functional" and name not in self.NOT_CALLS:
            nbytes = args[0].numel() * args[0].element_size()  # the input: whole but for an all-gather's shard
            whole = nbytes * (args[1] if name == "all_gather_into_tensor" else 1)  # args[1]: the group's size
            self.calls.append((self.KINDS.get(name, name), whole))
        return func(*args, **(kwargs or {}))

    def summary(self):
        """``{kind: {"calls": n, "bytes": total}}`` of what was recorded."""
        out = {}
        for kind, nbytes in self.calls:
            entry = out.setdefault(kind, {"calls": 0, "bytes": 0})
            entry["calls"] += 1
            entry["bytes"] += nbytes
        return out


class PeakMemory(TorchDispatchMode):
    """The high-water mark of a rank's training state inside ``with PeakMemory(model, opt):``. Explained in 09_sharding.

    After every operator that runs inside the block (forward, backward, the collectives, the optimizer's step:
    all of them reach PyTorch's dispatcher), the mode counts the bytes of :func:`training_tensors` (parameters,
    including units FSDP2 has gathered; gradients, including the sharding code's buffers; optimizer state), each
    storage once, and keeps the largest total: ``peak`` (with its parts in ``peak_parts``) is the most this rank
    held at any one moment of the step, not what is left after it. Counting happens between operators, so it is
    exact for tensors that live across at least one operator and deterministic (the same ops in the same order
    every run). ``peak_all`` adds every other tensor created inside the block while it is alive (activations,
    temporaries, communication buffers): the mode follows their storages with weak references.
    """

    def __init__(self, model, optimizer=None):
        super().__init__()
        self.model, self.optimizer = model, optimizer
        self.peak, self.peak_all, self.peak_parts, self.samples = 0, 0, {}, 0
        self.others = {}  # storage key -> bytes, for storages created inside the block and still alive

    def _follow(self, out):
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or hasattr(t, "to_local"):
                continue
            key, nbytes = _storage_key(t)
            if key not in self.others and nbytes:
                self.others[key] = nbytes
                weakref.finalize(t.untyped_storage(), self.others.pop, key, None)

    def sample(self):
        """Count the training state now and update the peaks."""
        seen, parts = set(), {}
        for part, tensors in training_tensors(self.model, self.optimizer).items():
            parts[part] = 0
            for t in tensors:
                if t is not None:
                    key, nbytes = _storage_key(t)
                    if key not in seen:
                        seen.add(key)
                        parts[part] += nbytes
        total = sum(parts.values())
        self.samples += 1
        if total > self.peak:
            self.peak, self.peak_parts = total, parts
        self.peak_all = max(self.peak_all, total + sum(b for k, b in list(self.others.items()) if k not in seen))

    def __enter__(self):
        out = super().__enter__()
        self.sample()
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._follow(out)
        self.sample()
        return out


# One FSDP2 run that reports its memory per rank (the benchmark's worker) ------------------------------------------

def fsdp_memory_worker(size="small", batch=8, steps=1, lr=1e-3, reshard_after_forward=True, seed=0, min_repeats=5,
                       min_seconds=0.05):
    """Train a ViT with FSDP2 for a few steps; per-rank bytes, step times, collectives. Explained in 09_sharding.

    Every block and then the root are wrapped with ``fully_shard``; Adam. The bytes are counted after ``steps``
    training steps, before the gradients are dropped (what a rank holds after the step, not its peak during it).
    Then more steps are timed by :func:`mparlib.timing.measure` (the steps before were the warm-up; at least
    ``min_repeats`` steps and ``min_seconds``; a barrier before each; the slowest rank's time). Each rank trains on its
    own random batch of ``batch`` images: the memory and the time per step do not depend on the pixels. Returns, on
    every rank, a dict with ``bytes_per_rank`` (the largest rank's count of each part), ``per_rank`` (each rank's;
    on a GPU also ``cuda_max_allocated``), ``step_s`` (the :meth:`~mparlib.timing.Timing.summary` of the timed
    steps, with every step's time in ``times``) and the collectives of a step.
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

    def step():
        torch.nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()

    for _ in range(positive_int(steps, "steps", 1, "fsdp_memory_worker")):
        optimizer.zero_grad()
        with CollectiveLog() as log:
            step()
    mine = held_bytes(model, optimizer)
    if dev.type == "cuda":
        mine["cuda_max_allocated"] = torch.cuda.max_memory_allocated(dev)
    timing = measure(step, warmup=0, min_repeats=min_repeats, min_seconds=min_seconds, device=dev,
                     before=lambda: (optimizer.zero_grad(), dist.barrier()), across=slowest_rank)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return {"world_size": world, "device": dev.type, "threads": torch.get_num_threads(),
            "bytes_per_rank": {k: max(r[k] for r in everyone) for k in ("params", "grads", "optimizer")},
            "per_rank": everyone, "step_s": dict(timing.summary(), times=list(timing.times)),
            "collectives_per_step": log.summary()}


# Peak memory per rank of DDP, ZeRO-1, ZeRO-2 and FSDP2 (the chapter's table, the tests and the benchmark) -----------

PEAK_METHODS = ("DDP", "ZeRO-1", "ZeRO-2", "FSDP2")


def data_parallel_method(name, model, lr=1e-3, bucket_bytes=2**17):
    """``(what a step calls, its optimizer)`` for ``model`` under one of PEAK_METHODS. Explained in 09_sharding.

    All use Adam. DDP and ZeRO-1 (``ZeroRedundancyOptimizer``) run with ``gradient_as_bucket_view=True``, DDP's
    leanest setting, where the gradients are views of its communication buckets (by default DDP keeps them a
    second time in the buckets); ZeRO-2 is :class:`Zero2Optimizer`; FSDP2 is ``fully_shard`` on every block and
    at the root. ``"sharded step"`` is :class:`ShardedOptimizer` (ZeRO-1 from primitives).
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    one_of(name, "name", PEAK_METHODS + ("sharded step",), "data_parallel_method")
    if name in ("DDP", "ZeRO-1"):
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
        if name == "DDP":
            return ddp, torch.optim.Adam(model.parameters(), lr=lr)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=lr)
    if name == "ZeRO-2":
        return model, Zero2Optimizer(model.parameters(), torch.optim.Adam, bucket_bytes=bucket_bytes, lr=lr)
    if name == "sharded step":
        return model, ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=lr)
    mesh = init_device_mesh(model.pos.device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def peak_memory_worker(size="smoke", batch=8, methods=PEAK_METHODS, bucket_bytes=2**17, lr=1e-3, seed=0, patch=None):
    """Peak bytes of the training state per rank, for each method, in one step. Explained in 09_sharding.

    For every method: the ViT from ``seed``, one warm-up step (Adam creates its state), then one step (forward,
    backward, optimizer step) inside :class:`PeakMemory`. Returns, on every rank, ``{"world_size", "device",
    "methods": {name: {"peak_bytes_per_rank", "peak_all_bytes_per_rank", "per_rank": [...]}}}``; each rank's
    entry has its ``peak``, the ``parts`` at that moment, ``peak_all``, what it holds ``after`` the step, and on a
    GPU the allocator's peak during the step (``cuda_max_allocated``).
    """
    dev, world, rank = rank_device(), dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(seed + 1 + rank)
    X, y = torch.randn(batch, 1, 28, 28, generator=g).to(dev), torch.randint(0, 10, (batch,), generator=g).to(dev)
    out = {"world_size": world, "device": dev.type, "methods": {}}
    for name in methods:
        torch.manual_seed(seed)
        model = vit(size, **({} if patch is None else {"patch": patch})).to(dev)
        net, optimizer = data_parallel_method(name, model, lr, bucket_bytes)
        for measured in (False, True):
            optimizer.zero_grad()
            synchronize(dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            meter = PeakMemory(model, optimizer)
            with meter if measured else contextlib.nullcontext():
                torch.nn.functional.cross_entropy(net(X), y).backward()
                optimizer.step()
            synchronize(dev)
        mine = {"peak": meter.peak, "parts": meter.peak_parts, "peak_all": meter.peak_all,
                "after": held_bytes(model, optimizer), "samples": meter.samples}
        if dev.type == "cuda":
            mine["cuda_max_allocated"] = torch.cuda.max_memory_allocated(dev)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        out["methods"][name] = {"peak_bytes_per_rank": max(r["peak"] for r in everyone),
                                "peak_all_bytes_per_rank": max(r["peak_all"] for r in everyone), "per_rank": everyone}
    return out
