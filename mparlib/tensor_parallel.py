"""Tensor parallelism from primitives: one layer's matrices split across the ranks of a process group.

Megatron-LM's recipe needs two communication operators that are each other's mirror image. ``f``
(:func:`copy_to_parallel`) is the identity in the forward pass and an all-reduce of the gradient in the backward
pass; ``g`` (:func:`reduce_from_parallel`) is an all-reduce in the forward pass and the identity in the backward
pass. A :class:`ColumnParallelLinear` (output features split, ``f`` on its input) followed by a
:class:`RowParallelLinear` (input features split, ``g`` on its output) computes a two-layer block with one
all-reduce forward and one backward. :func:`split_mlp` and :func:`split_attention` cut the blocks of
:mod:`mparlib.vit` this way (attention by heads); :func:`gather_full` puts the pieces back together so that the
split block can be compared with the unsplit one. Explained in 10_model_parallel.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .errors import ConfigError, LaunchError
from .lang import tr


def _group_info(group, what):
    """(rank, world size) of this process in ``group``; a clear error outside a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise LaunchError(tr(f"{what} splits a layer across the ranks of a process group, and this process is in "
                             "none. Call it inside a worker started by mparlib.launch.launch (or torchrun).",
                             f"{what} は層をプロセスグループのランクに分割しますが、このプロセスはどのプロセス"
                             "グループにも属していません。mparlib.launch.launch（または torchrun）で起動した"
                             "ワーカーの中で呼んでください。"))
    return dist.get_rank(group), dist.get_world_size(group)


def _piece(size, rank, world, what):
    """The slice of ``range(size)`` that ``rank`` of ``world`` holds (equal pieces, refused otherwise)."""
    if size % world:
        raise ConfigError(tr(f"{what}: {size} does not divide by the {world} ranks; each rank must hold an equal "
                             f"piece. Use a size that is a multiple of {world}, or another number of ranks.",
                             f"{what}: {size} は {world}個のランクで割り切れません。各ランクは同じ大きさの部分を持つ"
                             f"必要があります。{world} の倍数の大きさにするか、ランクの数を変えてください。"))
    step = size // world
    return slice(rank * step, (rank + 1) * step)


class _Copy(torch.autograd.Function):
    """f: the identity forward, the sum of the gradient over the ranks backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)  # the same numbers; a new tensor so that autograd calls backward below

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # all_reduce works in place on a dense tensor
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    """g: the sum over the ranks forward, the identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_parallel(x, group=None):
    """``f``: identity forward, all-reduce (sum) of the gradient backward. Explained in 10_model_parallel.

    Put it where a replicated tensor enters split work: every rank computes part of what depends on ``x``, so each
    holds only part of ``x``'s gradient, and the all-reduce adds the parts up.
    """
    return _Copy.apply(x, group)


def reduce_from_parallel(x, group=None):
    """``g``: all-reduce (sum) forward, identity backward. Explained in 10_model_parallel.

    Put it where split work ends in partial sums: the all-reduce adds them into the full result on every rank;
    its gradient is already the same on every rank, so nothing flows between ranks backwards.
    """
    return _Reduce.apply(x, group)


class ColumnParallelLinear(nn.Module):
    """This rank's share of the output features of a linear layer. Explained in 10_model_parallel.

    Built from a full ``nn.Linear(in, out)`` (the same one on every rank): rank ``r`` of ``n`` keeps rows
    ``r * out / n`` to ``(r + 1) * out / n`` of the weight and bias, and maps ``(..., in)`` to ``(..., out / n)``.
    ``copy_input=True`` applies :func:`copy_to_parallel` to the input first, which makes the input's gradient whole.
    """

    split_dims = {"weight": 0, "bias": 0}  # along which dimension each parameter is cut across the ranks

    def __init__(self, linear, group=None, copy_input=True):
        super().__init__()
        rank, world = _group_info(group, "ColumnParallelLinear")
        rows = _piece(linear.out_features, rank, world, "ColumnParallelLinear (out_features)")
        self.group, self.copy_input = group, copy_input
        self.in_features, self.out_features = linear.in_features, rows.stop - rows.start
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())  # (out / n, in)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[rows].clone())  # (out / n,)

    def forward(self, x):  # (..., in) -> (..., out / n)
        if self.copy_input:
            x = copy_to_parallel(x, self.group)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features} (this rank's columns)"


class RowParallelLinear(nn.Module):
    """This rank's share of the input features of a linear layer, summed over the ranks. Explained in 10_model_parallel.

    Built from a full ``nn.Linear(in, out)``: rank ``r`` of ``n`` keeps columns ``r * in / n`` to ``(r + 1) * in / n``
    of the weight, multiplies its slice of the input ``(..., in / n)`` with them, and :func:`reduce_from_parallel`
    adds the partial products into the full output ``(..., out)``. The bias is added once, after the sum, so every
    rank holds all of it. ``reduce(partial, group)`` may replace the all-reduce by another sum over the ranks (the
    reduce-scatter along the sequence of :mod:`mparlib.sequence_parallel`).
    """

    split_dims = {"weight": 1, "bias": None}  # None: the same whole tensor on every rank

    def __init__(self, linear, group=None, reduce=reduce_from_parallel):
        super().__init__()
        rank, world = _group_info(group, "RowParallelLinear")
        cols = _piece(linear.in_features, rank, world, "RowParallelLinear (in_features)")
        self.group, self.reduce = group, reduce
        self.in_features, self.out_features = cols.stop - cols.start, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone())  # (out, in / n)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())  # (out,)

    def forward(self, x):  # (..., in / n) -> (..., out)
        y = self.reduce(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return f"in_features={self.in_features} (this rank's rows), out_features={self.out_features}"


def _shell(module):
    """An empty module of the same class, without running its constructor (which would allocate full layers)."""
    shell = type(module).__new__(type(module))
    nn.Module.__init__(shell)
    shell.train(module.training)
    return shell


def _check_has(module, names, what):
    missing = [n for n in names if not isinstance(getattr(module, n, None), nn.Linear)]
    if missing:
        raise ConfigError(tr(f"{what} expects a module with the linear layers {', '.join(names)} (as in mparlib.vit); "
                             f"{type(module).__name__} lacks {', '.join(missing)}.",
                             f"{what} は線形層 {', '.join(names)} を持つモジュール（mparlib.vit のもの）を受け取ります。"
                             f"{type(module).__name__} には {', '.join(missing)} がありません。"))


def split_mlp(mlp, group=None):
    """This rank's part of an :class:`mparlib.vit.MLP`: ``fc1`` column-parallel, ``fc2`` row-parallel. Explained in 10_model_parallel.

    ``mlp`` is the full block, identical on every rank (same seed or weights); it is left as it is. The result runs
    the block's own ``forward`` on ``hidden / n`` of the hidden features: one all-reduce in the forward pass (in
    ``fc2``) and one in the backward pass (in ``fc1``).
    """
    _check_has(mlp, ("fc1", "fc2"), "split_mlp")
    part = _shell(mlp)
    part.fc1, part.fc2 = ColumnParallelLinear(mlp.fc1, group), RowParallelLinear(mlp.fc2, group)
    return part


def split_attention(attention, group=None):
    """This rank's heads of an :class:`mparlib.vit.Attention`. Explained in 10_model_parallel.

    Head ``h`` reads features ``h * d`` to ``(h + 1) * d`` of the query, key and value (``d = dim / heads``), so
    splitting ``q``, ``k``, ``v`` by output columns hands each rank whole heads; ``out`` is split by input rows and
    sums the heads' contributions. ``heads`` becomes the local count ``heads / n``. Forward: one all-reduce (in
    ``out``); backward: three (one per projection that reads the input).
    """
    _check_has(attention, ("q", "k", "v", "out"), "split_attention")
    rank, world = _group_info(group, "split_attention")
    if attention.heads % world:
        raise ConfigError(tr(f"split_attention: {attention.heads} heads do not divide by {world} ranks; every rank "
                             f"must hold whole heads. Use a number of heads that is a multiple of {world}.",
                             f"split_attention: ヘッド {attention.heads}個は {world}個のランクで割り切れません。各ランクは"
                             f"ヘッドを丸ごと持つ必要があります。ヘッドの数を {world} の倍数にしてください。"))
    part = _shell(attention)
    part.heads = attention.heads // world  # the local head count, which Attention.forward reads
    part.q, part.k, part.v = (ColumnParallelLinear(getattr(attention, n), group) for n in ("q", "k", "v"))
    part.out = RowParallelLinear(attention.out, group)
    return part


def expected_all_reduces(module):
    """How many all-reduces one forward and one backward pass of a split module make. Explained in 10_model_parallel.

    Returns ``{"forward": number of RowParallelLinear that all-reduce, "backward": number of ColumnParallelLinear that
    copy their input}``: each ``g`` all-reduces once forward, each ``f`` once backward.
    """
    mods = list(module.modules())
    return {"forward": sum(isinstance(m, RowParallelLinear) and m.reduce is reduce_from_parallel for m in mods),
            "backward": sum(isinstance(m, ColumnParallelLinear) and m.copy_input for m in mods)}


def gather_full(module, grads=False):
    """The full parameters (or gradients) of a split module, keyed like the unsplit one's. Explained in 10_model_parallel.

    Every rank takes part (each split tensor is all-gathered along the dimension it was cut) and every rank gets
    the same dict. Parameters that are whole on every rank are returned as they are. ``grads=True`` gathers
    ``.grad`` instead (after a backward pass).
    """
    full = {}
    for mod_name, mod in module.named_modules():
        dims = getattr(mod, "split_dims", {})
        group = getattr(mod, "group", None)
        for p_name, p in mod.named_parameters(recurse=False):
            t = p.grad if grads else p.detach()
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if t is None:
                raise ConfigError(tr(f"gather_full(grads=True): {name} has no gradient yet; run a backward pass first.",
                                     f"gather_full(grads=True): {name} にはまだ勾配がありません。先に逆伝播を"
                                     "実行してください。"))
            if dims.get(p_name) is None:
                full[name] = t.clone()
                continue
            pieces = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(pieces, t.contiguous(), group=group)
            full[name] = torch.cat(pieces, dim=dims[p_name])
    return full
