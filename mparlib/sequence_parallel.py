"""Sequence parallelism from primitives: tensor parallelism whose replicated parts work on a slice of the sequence.

Between the tensor-parallel regions of a transformer block (the LayerNorms, the residual additions, dropout) every
rank of plain tensor parallelism holds the whole activation ``(B, T, dim)`` and does the same work. Sequence
parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022) cuts those
parts along the sequence: rank ``r`` of ``n`` holds tokens ``r T / n`` to ``(r + 1) T / n``. The conjugate pair
``f`` / ``g`` of :mod:`mparlib.tensor_parallel` becomes :func:`gather_sequence` (all-gather along the sequence
forward, reduce-scatter backward) entering a region and :func:`scatter_sequence` (reduce-scatter forward,
all-gather backward) leaving it. :func:`split_block` cuts an :class:`mparlib.vit.Block` this way.
Explained in 11_sequence_context_experts.
"""
import copy

import torch
import torch.distributed as dist
from torch import nn

from .errors import ConfigError, LaunchError
from .lang import tr
from .sharding import tensor_collectives
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, split_attention

_REDUCE_SCATTER, _ALL_GATHER = tensor_collectives()  # the tensor forms under the names this torch has
SEQ_DIM = 1  # (B, T, dim): the sequence is dimension 1


def _world(group, what):
    if not (dist.is_available() and dist.is_initialized()):
        raise LaunchError(tr(f"{what} cuts a sequence across the ranks of a process group, and this process is in "
                             "none. Call it inside a worker started by mparlib.launch.launch (or torchrun).",
                             f"{what} は系列をプロセスグループのランクに分割しますが、このプロセスはどの"
                             "プロセスグループにも属していません。mparlib.launch.launch（または torchrun）で起動した"
                             "ワーカーの中で呼んでください。"))
    return dist.get_world_size(group)


def _check_divides(length, world, what):
    if length % world:
        raise ConfigError(tr(f"{what}: a sequence of {length} tokens does not divide by {world} ranks. "
                             f"Use a sequence length that is a multiple of {world}.",
                             f"{what}: {length} トークンの系列は {world}個のランクで割り切れ"
                             f"ません。系列長を {world} の倍数にしてください。"))


def _gather(x, group, dim):
    """All-gather along ``dim``: (..., T / n, ...) on every rank -> (..., T, ...) on every rank."""
    world = _world(group, "gather_sequence")
    front = x.movedim(dim, 0).contiguous()  # the collectives concatenate along dimension 0
    out = front.new_empty((world * front.shape[0], *front.shape[1:]))
    _ALL_GATHER(out, front, group=group)
    return out.movedim(0, dim).contiguous()  # a dense tensor: linear layers would each save a copy of a view


def _reduce_scatter(x, group, dim):
    """Sum over the ranks and keep this rank's slice along ``dim``: (..., T, ...) -> (..., T / n, ...)."""
    world = _world(group, "scatter_sequence")
    _check_divides(x.shape[dim], world, "scatter_sequence")
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    _REDUCE_SCATTER(out, front, group=group)
    return out.movedim(0, dim).contiguous()  # a dense tensor: linear layers would each save a copy of a view


class _GatherSequence(torch.autograd.Function):
    """Entering the tensor-parallel region: all-gather forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ScatterSequence(torch.autograd.Function):
    """Leaving the tensor-parallel region: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim), None, None


def gather_sequence(x, group=None, dim=SEQ_DIM):
    """All-gather the sequence forward, reduce-scatter the gradient backward. Explained in 11_sequence_context_experts.

    Replaces ``f`` where a sequence-sharded tensor enters a tensor-parallel region: every rank needs all tokens,
    and backward every rank holds a partial gradient for all tokens, of which the sum of this rank's slice is
    what its own tokens need.
    """
    return _GatherSequence.apply(x, group, dim)


def scatter_sequence(x, group=None, dim=SEQ_DIM):
    """Reduce-scatter the sequence forward, all-gather the gradient backward. Explained in 11_sequence_context_experts.

    Replaces ``g`` where partial sums leave a tensor-parallel region: the sum over the ranks is needed only for
    this rank's tokens; backward every rank's partial product needs the gradient of all tokens.
    """
    return _ScatterSequence.apply(x, group, dim)


def shard_sequence(x, group=None, dim=SEQ_DIM):
    """This rank's slice of a tensor that is the same on every rank, along the sequence. Explained in 11_sequence_context_experts."""
    world = _world(group, "shard_sequence")
    _check_divides(x.shape[dim], world, "shard_sequence")
    return x.chunk(world, dim=dim)[dist.get_rank(group)]


class SequenceParallelBlock(nn.Module):
    """A pre-norm transformer block whose norms and residuals work on this rank's tokens. Explained in 11_sequence_context_experts.

    ``(B, T / n, dim) -> (B, T / n, dim)``. Built by :func:`split_block` from an :class:`mparlib.vit.Block`: the
    LayerNorms are whole copies (their weights and the row-parallel biases are ``replicated``: each rank's gradient
    covers its own tokens only, and :func:`sync_replicated_grads` adds them up); attention and MLP are split as in
    chapter 10, with ``gather_sequence`` in front and ``scatter_sequence`` behind.
    """

    def __init__(self, block, group=None):
        super().__init__()
        self.group = group
        self.norm1, self.norm2 = block.norm1, block.norm2
        self.attn = split_attention(block.attn, group)  # this rank's heads; then q, k, v without f, out without g:
        for name in ("q", "k", "v"):  # the gathered input is whole on every rank, so its gradient needs no f
            setattr(self.attn, name, ColumnParallelLinear(getattr(block.attn, name), group, copy_input=False))
        self.attn.out = RowParallelLinear(block.attn.out, group, reduce=scatter_sequence)
        mlp = type(block.mlp).__new__(type(block.mlp))
        nn.Module.__init__(mlp)
        mlp.fc1 = ColumnParallelLinear(block.mlp.fc1, group, copy_input=False)
        mlp.fc2 = RowParallelLinear(block.mlp.fc2, group, reduce=scatter_sequence)
        self.mlp = mlp

    def forward(self, x):  # x: this rank's tokens (B, T / n, dim)
        x = x + self.attn(gather_sequence(self.norm1(x), self.group))
        return x + self.mlp(gather_sequence(self.norm2(x), self.group))

    def replicated(self):
        """The parameters that every rank holds whole and whose gradients are partial sums over the tokens."""
        return [*self.norm1.parameters(), *self.norm2.parameters(), self.attn.out.bias, self.mlp.fc2.bias]


def split_block(block, group=None):
    """This rank's part of an :class:`mparlib.vit.Block` under sequence parallelism. Explained in 11_sequence_context_experts.

    ``block`` (identical on every rank) is left as it is: the split block copies what it keeps. Per block, forward:
    2 all-gathers and 2 reduce-scatters; backward the same, mirrored; no all-reduce.
    """
    for name in ("norm1", "attn", "norm2", "mlp"):
        if not isinstance(getattr(block, name, None), nn.Module):
            raise ConfigError(tr(f"split_block expects an mparlib.vit.Block (norm1, attn, norm2, mlp); "
                                 f"{type(block).__name__} lacks {name}.",
                                 f"split_block は mparlib.vit.Block（norm1、attn、norm2、mlp）を受け取ります。"
                                 f"{type(block).__name__} には {name} がありません。"))
    return SequenceParallelBlock(copy.deepcopy(block), group)


def sync_replicated_grads(module, group=None):
    """All-reduce (sum) the gradients of the replicated parameters of every split block. Explained in 11_sequence_context_experts.

    Returns the number of all-reduces made: one per replicated parameter (a real implementation would put them
    into one bucket, as DDP does).
    """
    count = 0
    for m in module.modules():
        if isinstance(m, SequenceParallelBlock):
            for p in m.replicated():
                if p is not None and p.grad is not None:
                    dist.all_reduce(p.grad, group=group)
                    count += 1
    return count


def expected_collectives(module):
    """All-gathers and reduce-scatters one forward and one backward pass of split blocks make. Explained in 11_sequence_context_experts.

    Every block gathers twice (attention, MLP) and scatters twice forward; backward each gather becomes a
    reduce-scatter and each scatter an all-gather.
    """
    blocks = sum(isinstance(m, SequenceParallelBlock) for m in module.modules())
    return {"forward": {"all_gather": 2 * blocks, "reduce_scatter": 2 * blocks},
            "backward": {"all_gather": 2 * blocks, "reduce_scatter": 2 * blocks}}


class SavedBytes:
    """Bytes of the activations autograd saves for the backward pass while active. Explained in 11_sequence_context_experts.

    ``with SavedBytes(model) as saved: loss = model(x)...`` then ``saved.bytes``. Each storage is counted once,
    whole: a tensor saved twice, or a view of one already saved (the attention's output and the output projection's
    input, its reshape), keeps no more memory alive. Tensors that share storage with a parameter of ``module`` (a
    weight, or its transpose, saved to compute the input's gradient) are not activations and are skipped.
    """

    def __init__(self, module=None):
        self.bytes, self._seen, self._hooks = 0, set(), None
        params = [] if module is None else list(module.parameters())
        self._params = {self._local(p).untyped_storage().data_ptr() for p in params}

    @staticmethod
    def _local(t):
        if hasattr(t, "to_local"):  # a DTensor: what this rank stores is its local tensor
            with torch.no_grad():
                return t.to_local()
        return t

    def _pack(self, t):
        local = self._local(t)
        storage = local.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._params and ptr not in self._seen:  # a view of a storage already kept costs nothing more
            self._seen.add(ptr)
            self.bytes += storage.nbytes()
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False


def block_plan(prefix=""):
    """PyTorch's sequence-parallel plan for an :class:`mparlib.vit.Block`, for ``parallelize_module``. Explained in 11_sequence_context_experts.

    ``SequenceParallel`` on the norms (input and output sharded along the sequence), ``PrepareModuleInput`` to
    all-gather the sequence in front of attention and MLP, ``ColwiseParallel`` / ``RowwiseParallel`` inside them,
    the row-parallel outputs reduce-scattered back to ``Shard(1)``. ``prefix`` names the block inside a larger
    model (``"blocks.0."``). The block's ``attn.heads`` must be set to the local head count by the caller.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    gather = lambda: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))  # noqa: E731
    plan = {"norm1": SequenceParallel(), "attn": gather(), "norm2": SequenceParallel(), "mlp": gather(),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.out": RowwiseParallel(output_layouts=Shard(1)),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(output_layouts=Shard(1))}
    return {prefix + k: v for k, v in plan.items()}


def collective_counts(mode):
    """``{"all_gather": k, "reduce_scatter": k, "all_reduce": k}`` from a ``CommDebugMode``. Explained in 11_sequence_context_experts.

    PyTorch names the same collective differently in its layers (``all_gather_into_tensor``, ``_allgather_base_``,
    ...); this sums them by kind.
    """
    counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for op, k in mode.get_comm_counts().items():
        name = str(op).replace("_", "").lower()
        for kind in counts:
            if kind.replace("_", "") in name:
                counts[kind] += k
    return counts
