# %% [markdown]
# <!-- en -->
# # 10. Model parallelism: tensor and pipeline
#
# Data parallelism (chapters 5 and 6) gives every device the whole model; sharding (chapter 9) stores the model
# in pieces but still runs every layer whole on every device, gathering each layer's parameters just before it
# runs. Model parallelism splits the *computation* itself, in one of two directions:
#
# - **Tensor parallelism** cuts each layer's weight matrices, so every device computes part of every layer and the
#   devices add their parts together inside the layer. Megatron-LM made this practical for transformers.
# - **Pipeline parallelism** cuts the stack of layers into stages, one per device, and streams micro-batches through
#   them. Chapter 4 did this with simulated devices inside one process; here the stages are real processes
#   that send activations and gradients to each other.
#
# This chapter
#
# 1. builds tensor parallelism from two small communication operators and proves, on 2 and 4 processes, that a split
#    MLP and a split attention block compute the same outputs and gradients as the unsplit blocks;
# 2. does the same with PyTorch's `DTensor` and `parallelize_module`, and counts the messages to check that both
#    versions communicate exactly as predicted;
# 3. runs the small Vision Transformer of `mparlib.vit` as a pipeline with `torch.distributed.pipelining` (GPipe and
#    1F1B schedules), checks the losses against one process, and measures the pipeline bubble from timestamps;
# 4. combines sharding and tensor parallelism on a 2 x 2 grid of processes;
# 5. ends with a table that helps you choose.
#
# Everything runs on a laptop: processes on the CPU talk through `gloo`. With a GPU for every process the same
# code runs on the GPUs with `nccl`.
# <!-- ja -->
# # 10. モデル並列: テンソル並列とパイプライン並列
#
# データ並列（5章と 6章）では、どのデバイスもモデル全体を持ちます。シャーディング（9章）ではモデルを分けて保存しますが、計算はどのデバイスでも各層を丸ごと実行し、各層を実行する直前にその層のパラメータを集めます。モデル並列は**計算そのもの**を分けます。分け方には 2つの向きがあります。
#
# - **テンソル並列**は各層の重み行列を切り分けます。どのデバイスもすべての層の一部を計算し、層の中で互いの結果を足し合わせます。Megatron-LM がこの方法を Transformer で実用的なものにしました。
# - **パイプライン並列**は層の積み重ねをステージに切り、デバイスごとに 1つのステージを置いて、マイクロバッチを次々に流します。4章では 1つのプロセスの中の模擬デバイスでこれを行いました。この章のステージは実際のプロセスで、活性化と勾配を互いに送り合います。
#
# この章では次のことを行います。
#
# 1. 2つの小さな通信演算子からテンソル並列を組み立てます。分割した MLP と分割したアテンションのブロックが、分割前のブロックと同じ出力と勾配を計算することを、2個と 4個のプロセスで証明します。
# 2. 同じことを PyTorch の `DTensor` と `parallelize_module` で行います。通信の回数を数え、2つの版が予想どおりに通信することを確かめます。
# 3. `mparlib.vit` の小さな Vision Transformer を `torch.distributed.pipelining` でパイプラインとして動かします（GPipe と 1F1B のスケジュール）。損失を 1個のプロセスの場合と比べ、パイプラインバブルをタイムスタンプから測ります。
# 4. 2 × 2 に並べたプロセスの上で、シャーディングとテンソル並列を組み合わせます。
# 5. 最後に、どの並列化を選ぶかを考えるための表をまとめます。
#
# すべてノート PC で動きます。CPU 上のプロセスは `gloo` で通信します。プロセスごとに GPU があれば、同じコードが GPU 上で `nccl` を使って動きます。

# %% tags=["nbval-ignore-output"]
import inspect
import os
import time

import matplotlib.pyplot as plt
import torch
from torch.nn import functional as F

import mparlib
import mparlib.plot
from mparlib import diagrams, schedules, tensor_parallel
from mparlib.data import load_fashion_mnist
from mparlib.hybrid import pipeline_schedule
from mparlib.lang import join, table, tr
from mparlib.launch import launch
from mparlib.rendezvous import describe
from mparlib.vit import MLP, vit

# %load_ext mparlib.launch

mparlib.plot.use_course_style()  # a font with Japanese glyphs for this notebook's figures
print(mparlib.report())
print(mparlib.profile_line())
PROFILE = mparlib.profile()
CHAPTER_START = time.perf_counter()

# %% [markdown]
# <!-- en -->
# The cells below start groups of 2 and 4 processes. Where the machine has fewer GPUs than processes, they run on
# the CPU with `gloo`; the next cell says which applies here. Every checked output of the chapter is the same
# either way; timings and the tiny rounding differences of floating point are printed in cells whose output
# depends on the machine.
# <!-- ja -->
# このあとのセルでは、2個と 4個のプロセスのグループを起動します。マシンの GPU がプロセスの数より少なければ、プロセスは CPU 上で `gloo` を使って動きます。ここでどちらになるかは次のセルが表示します。この章の検査対象の出力は、どちらの場合も同じです。時間の計測値と、浮動小数点数のごく小さな丸め誤差は、出力がマシンによって変わるセルに表示します。

# %% tags=["nbval-ignore-output"]
for n in (2, 4):
    print(describe(n))

# %% [markdown]
# <!-- en -->
# ## Splitting one layer: columns and rows
#
# A linear layer computes `y = x @ W.T + b` with a weight `W` of shape `(out, in)`. There are two ways to share the
# product among `n` devices.
#
# - **Column-parallel** (split the outputs): device `r` keeps the rows `W[r*out/n:(r+1)*out/n]` of the weight (the
#   columns of `W.T`) and the same slice of `b`, reads the whole input `x` and computes its slice of the output
#   features. Putting the slices side by side gives `y`.
# - **Row-parallel** (split the inputs): device `r` keeps the columns `W[:, r*in/n:(r+1)*in/n]` and needs only the
#   matching slice of the input features. Each device's product is a *partial sum*; adding the partial sums of all
#   devices (an all-reduce) gives `x @ W.T`, and the bias is added once.
#
# The trick of Megatron-LM is to put the two back to back. The MLP of a transformer block is
# `fc2(gelu(fc1(x)))`: split `fc1` by columns and `fc2` by rows. Device `r` then holds features `r*hidden/n` to
# `(r+1)*hidden/n` of the hidden layer, GELU acts on each feature separately, and those features are exactly the
# input slice that `fc2`'s row split on device `r` needs. No communication happens between the two layers; one sum
# at the end completes the block. Here it is in one process, with plain tensor slicing:
# <!-- ja -->
# ## 1つの層の分け方: 列と行
#
# 線形層は、形状 `(out, in)` の重み `W` を使って `y = x @ W.T + b` を計算します。この積を `n` 個のデバイスで分担する方法は 2通りあります。
#
# - **列並列**（出力を分ける）: デバイス `r` は重みの行 `W[r*out/n:(r+1)*out/n]`（`W.T` の列）と、`b` の同じ範囲を持ちます。入力 `x` は全体を読み、出力の特徴のうち自分の範囲を計算します。範囲を横に並べると `y` になります。
# - **行並列**（入力を分ける）: デバイス `r` は列 `W[:, r*in/n:(r+1)*in/n]` を持ち、入力の特徴のうち対応する範囲だけを使います。各デバイスの積は**部分和**です。全デバイスの部分和を足し合わせる、つまりオールリデュース（all-reduce）すると `x @ W.T` になり、バイアスは 1回だけ足します。
#
# Megatron-LM の工夫は、この 2つを続けて並べることです。Transformer のブロックの MLP は `fc2(gelu(fc1(x)))` です。`fc1` を列で、`fc2` を行で分けます。するとデバイス `r` は中間層の特徴 `r*hidden/n` から `(r+1)*hidden/n` を持ちます。GELU は特徴ごとに独立に働くので、その特徴がそのまま、デバイス `r` で `fc2` の行の分割が必要とする入力の範囲になります。2つの層の間では通信がいらず、最後に 1回足し合わせればブロックが完成します。1つのプロセスの中で、テンソルを切り出すだけで確かめてみます。

# %%
torch.manual_seed(0)
n = 2
mlp = MLP(8, 12).double()  # dim 8, hidden 12: fc1 (12, 8), fc2 (8, 12)
x = torch.randn(3, 8, dtype=torch.float64)
W1, b1 = mlp.fc1.weight.detach(), mlp.fc1.bias.detach()
W2, b2 = mlp.fc2.weight.detach(), mlp.fc2.bias.detach()
step = 12 // n
columns = [x @ W1[r * step:(r + 1) * step].T + b1[r * step:(r + 1) * step] for r in range(n)]  # (3, 6) each
torch.testing.assert_close(torch.cat(columns, dim=-1), mlp.fc1(x))  # side by side: fc1's whole output
partial = [F.gelu(columns[r]) @ W2[:, r * step:(r + 1) * step].T for r in range(n)]  # (3, 8) each: partial sums
torch.testing.assert_close(sum(partial) + b2, mlp(x))  # their sum, plus the bias once: the whole MLP
rows1 = [tuple(W1[r * step:(r + 1) * step].shape) for r in range(n)]
cols2 = [tuple(W2[:, r * step:(r + 1) * step].shape) for r in range(n)]
print(tr(f"device r holds rows of fc1.weight {rows1} and columns of fc2.weight {cols2}",
         f"デバイス r が持つもの: fc1.weight の行 {rows1}、fc2.weight の列 {cols2}"))

# %% [markdown]
# <!-- en -->
# ## Two operators that mirror each other
#
# Across processes, the sum at the end is an all-reduce (chapter 8 looks inside it). What about
# the backward pass? Two places need care, and each is the mirror image of the other.
#
# - **Where the replicated input enters, `f`.** Every device reads the whole `x`, but each uses it only for its own
#   columns, so each holds only its own term of `x`'s gradient: the full gradient is the sum over the devices. So
#   `f` is *the identity in the forward pass and an all-reduce of the gradient in the backward pass*.
# - **Where the partial sums leave, `g`.** The all-reduce makes the same output on every device, so the gradient
#   that arrives from later layers is the same on every device too, and the gradient of each partial sum is just
#   that gradient. So `g` is *an all-reduce in the forward pass and the identity in the backward pass*.
#
# Each is an `autograd.Function` of a few lines in `mparlib.tensor_parallel`:
# <!-- ja -->
# ## 互いに鏡像になる 2つの演算子
#
# 複数のプロセスにまたがると、最後の足し合わせはオールリデュースになります（その中身は 8章で扱いました）。では逆伝播はどうでしょうか。注意の要る場所が 2つあり、互いに鏡像の関係にあります。
#
# - **複製された入力が入る場所（`f`）。** どのデバイスも `x` 全体を読みますが、使うのは自分の列のためだけです。そのため各デバイスが持つのは `x` の勾配のうち自分の項だけで、完全な勾配は全デバイスの和です。したがって `f` は「順伝播では恒等写像、逆伝播では勾配のオールリデュース」です。
# - **部分和が出ていく場所（`g`）。** オールリデュースの結果はどのデバイスでも同じなので、後ろの層から届く勾配もどのデバイスでも同じです。各部分和の勾配は、その勾配そのものです。したがって `g` は「順伝播ではオールリデュース、逆伝播では恒等写像」です。
#
# どちらも `mparlib.tensor_parallel` の中の数行の `autograd.Function` です。

# %%
print(inspect.getsource(tensor_parallel._Copy))
print(inspect.getsource(tensor_parallel._Reduce))

# %% [markdown]
# <!-- en -->
# The functions `copy_to_parallel(x)` (`f`) and `reduce_from_parallel(x)` (`g`) apply them. On top of them sit two
# layers, built from a full `nn.Linear` that is the same on every rank:
# `ColumnParallelLinear` keeps this rank's rows of the weight and applies `f` to its input;
# `RowParallelLinear` keeps this rank's columns and applies `g` to its output, then adds the bias.
# `split_mlp(mlp)` replaces `fc1` and `fc2` of an `mparlib.vit.MLP` with them and keeps the block's own `forward`.
#
# `split_attention(attention)` does the same for `mparlib.vit.Attention`, by heads. Head `h` reads features
# `h*d` to `(h+1)*d` of the query, key and value (`d = dim / heads`), so splitting `q`, `k` and `v` by columns hands
# every rank whole heads, which it computes without talking to the others; `out` is split by rows and sums the
# heads' contributions. The block's `forward` reshapes by `self.heads`, so the split block sets `heads` to the local
# count, `heads / n`.
#
# What should the message count be? One all-reduce per `g` in the forward pass, one per `f` in the backward pass.
# The MLP has one of each. The attention block has one `g` (in `out`), but three projections read the input, each
# with its own `f`: three all-reduces in the backward pass. (Megatron-LM fuses `q`, `k` and `v` into one matrix
# and so needs one; see the first of the more questions at the end.) `expected_all_reduces` counts the operators in a split block.
#
# The worker below builds the full blocks from the same seed on every rank, runs them unsplit as the reference,
# then split, under PyTorch's `CommDebugMode`, which counts every collective operation issued while it is active.
# It compares the outputs, the gradient of the input and the gradient of every parameter, gathered from the
# ranks with `gather_full`, in float64.
# <!-- ja -->
# これらを適用するのが関数 `copy_to_parallel(x)`（`f`）と `reduce_from_parallel(x)`（`g`）です。この 2つの関数の上に、2種類の層が載っています。どちらも、どのランクでも同じ完全な `nn.Linear` から作ります。`ColumnParallelLinear` は重みのうちこのランクの行を持ち、入力に `f` を適用します。`RowParallelLinear` はこのランクの列を持ち、出力に `g` を適用してからバイアスを足します。`split_mlp(mlp)` は `mparlib.vit.MLP` の `fc1` と `fc2` をこれらに置き換え、ブロック自身の `forward` はそのまま使います。
#
# `split_attention(attention)` は `mparlib.vit.Attention` に同じことをヘッド単位で行います。ヘッド `h` はクエリ、キー、バリューの特徴 `h*d` から `(h+1)*d` を読みます（`d = dim / heads`）。そのため `q`、`k`、`v` を列で分けると、各ランクはヘッドを丸ごと受け持ち、他のランクと通信せずに計算できます。`out` は行で分け、各ヘッドの寄与を足し合わせます。ブロックの `forward` は `self.heads` を使って形状を変えるので、分割したブロックでは `heads` をローカルなヘッド数 `heads / n` にします。
#
# 通信は何回になるはずでしょうか。順伝播では `g` 1つにつき 1回、逆伝播では `f` 1つにつき 1回のオールリデュースです。MLP にはそれぞれ 1つずつあります。アテンションのブロックでは `g` は 1つ（`out` の中）ですが、入力を読む射影が 3つあり、それぞれが自分の `f` を持つので、逆伝播のオールリデュースは 3回です（Megatron-LM は `q`、`k`、`v` を 1つの行列にまとめるので 1回で済みます。章末の「その他の問い」の 1つ目を見てください）。`expected_all_reduces` は、分割したブロックの演算子を数えます。
#
# 次のワーカーは、どのランクでも同じシードから完全なブロックを作り、まず分割せずに計算して基準にします。次に分割したブロックを、PyTorch の `CommDebugMode` の中で計算します。`CommDebugMode` は、有効な間に発行された集合通信（collective communication）をすべて数えます。出力、入力の勾配、そして `gather_full` で各ランクから集めたすべてのパラメータの勾配を、float64 で比べます。

# %%
# %%worker tp_workers
import torch
from torch.distributed.tensor.debug import CommDebugMode

from mparlib import tensor_parallel as tp
from mparlib.rendezvous import device
from mparlib.vit import MLP, Attention


def all_reduces(mode):
    """All-reduces seen by a CommDebugMode, whichever layer of PyTorch issued them."""
    return sum(k for op, k in mode.get_comm_counts().items() if "all_reduce" in str(op) or "allreduce" in str(op))


def full_blocks(dim=64, hidden=128, heads=4, seed=0):
    """The unsplit MLP and attention block, and an input and loss weights: the same on every rank (same seed)."""
    torch.manual_seed(seed)
    blocks = {"MLP": MLP(dim, hidden).double(), "Attention": Attention(dim, heads).double()}
    x = torch.randn(2, 49, dim, dtype=torch.float64)  # (B, T, dim): the tokens of two images
    w = torch.randn(2, 49, dim, dtype=torch.float64)  # the loss (y * w).sum() depends on every output
    return blocks, x, w


def run(block, x, w):
    """Output and input gradient of one forward and backward pass; all-reduces counted in each."""
    x = x.clone().requires_grad_()
    with CommDebugMode() as mode:
        y = block(x)
        forward = all_reduces(mode)
        (y * w).sum().backward()
        backward = all_reduces(mode) - forward
    return y.detach(), x.grad, {"forward": forward, "backward": backward}


def compare_split():
    """Split both blocks across the ranks with mparlib.tensor_parallel; compare them with the unsplit blocks."""
    dev = device()
    blocks, x, w = full_blocks()
    x, w = x.to(dev), w.to(dev)
    report = {}
    for name, full in blocks.items():
        full = full.to(dev)
        y_ref, gx_ref, _ = run(full, x, w)
        part = tp.split_mlp(full) if name == "MLP" else tp.split_attention(full)
        y, gx, counts = run(part, x, w)
        grads = tp.gather_full(part, grads=True)  # every parameter's gradient, whole again
        diffs = {"output": (y - y_ref).abs().max().item(), "input grad": (gx - gx_ref).abs().max().item()}
        diffs |= {f"{p_name} grad": (grads[p_name] - p.grad).abs().max().item()
                  for p_name, p in full.named_parameters()}
        report[name] = {"diffs": diffs, "all_reduces": counts, "expected": tp.expected_all_reduces(part),
                        "shapes": {p_name: tuple(p.shape) for p_name, p in part.named_parameters()},
                        "names": sorted(grads) == sorted(p_name for p_name, _ in full.named_parameters()),
                        "heads": getattr(part, "heads", None)}
    return report


# %% [markdown]
# <!-- en -->
# The next section writes the same blocks with PyTorch's own tools. Starting processes costs seconds, so one
# launch per number of processes will run both versions; the results of this section come first.
# <!-- ja -->
# 次の節では、同じブロックを PyTorch 自身の道具で書きます。プロセスの起動には数秒かかるので、プロセス数ごとに 1回の起動で両方の版を実行します。まずこの節の結果を見ます。

# %% [markdown]
# <!-- en -->
# ## The same with DTensor
#
# PyTorch expresses the same ideas with **`DTensor`**, a tensor that knows how it is laid out over a
# **`DeviceMesh`**, the grid of ranks (`init_device_mesh("cpu", (n,))` is a row of `n` ranks). Each `DTensor` has a
# **placement** per mesh dimension:
#
# - `Shard(d)`: each rank holds one piece of the tensor, cut along dimension `d`;
# - `Replicate()`: each rank holds all of it;
# - `Partial()`: each rank holds a tensor of the full shape, and the real value is the *sum* over the ranks, not
#   yet carried out (the partial sums of a row-parallel layer).
#
# `redistribute` changes the placement and sends exactly the messages that this needs, which `CommDebugMode`
# shows: gathering shards is an all-gather, carrying out a pending sum is an all-reduce (the forward of `g`),
# summing and cutting at once is a reduce-scatter, and taking a piece of a replicated tensor needs no message.
#
# `parallelize_module(module, mesh, plan)` applies a plan that names submodules: `ColwiseParallel()` makes a
# linear layer's weight `Shard(0)` (rows of `W`: output features) and `RowwiseParallel()` makes it `Shard(1)`
# (input features), with the input and output placements that make the pair of them an `f ... g` sandwich. The
# attention block again needs `heads` set to the local count, because `DTensor` does not change the block's own
# arithmetic.
# <!-- ja -->
# ## DTensor による同じ分割
#
# PyTorch は同じ考え方を **`DTensor`** で表します。`DTensor` は、ランクを格子状に並べた**デバイスメッシュ**（`DeviceMesh`）の上に自分がどう置かれているかを知っているテンソルです（`init_device_mesh("cpu", (n,))` は `n` 個のランクを 1列に並べます）。`DTensor` はメッシュの次元ごとに 1つの**配置**（placement）を持ちます。
#
# - `Shard(d)`: 各ランクはテンソルを次元 `d` に沿って切った 1片を持ちます。
# - `Replicate()`: 各ランクがテンソル全体を持ちます。
# - `Partial()`: 各ランクは全体と同じ形状のテンソルを持ちますが、本当の値はランク全体での**和**で、その足し算はまだ行われていません（行並列の層の部分和がこれです）。
#
# `redistribute` は配置を変え、そのために必要な通信だけを行います。`CommDebugMode` でそれが見えます。シャードを集めるのはオールギャザー（all-gather）、保留中の和を実行するのはオールリデュース（`g` の順伝播）、足し合わせると同時に切り分けるのはリデュース・スキャッター（reduce-scatter）、複製されたテンソルから 1片を取り出すのに通信はいりません。
#
# `parallelize_module(module, mesh, plan)` は、サブモジュールの名前を並べたプラン（plan）を適用します。`ColwiseParallel()` は線形層の重みを `Shard(0)`（`W` の行、つまり出力の特徴）に、`RowwiseParallel()` は `Shard(1)`（入力の特徴）にし、2つを組み合わせたときに `f ... g` の形になるよう入力と出力の配置を整えます。アテンションのブロックでは、ここでも `heads` をローカルなヘッド数にする必要があります。`DTensor` はブロック自身の計算の中身までは変えないからです。

# %%
# %%worker dtensor_workers
import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from mparlib.rendezvous import device
from tp_workers import compare_split, full_blocks, run

PLANS = {"MLP": {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()},
         "Attention": {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                       "out": RowwiseParallel()}}


def collectives(mode):
    """{name: count} of what a CommDebugMode saw, e.g. {'all_gather_into_tensor': 1}."""
    return {str(op).split(".")[-1]: k for op, k in mode.get_comm_counts().items()}


def placements_tour():
    """Redistribute a small tensor between placements: what each rank holds, and the messages it took."""
    rank, dev = dist.get_rank(), device()
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),), mesh_dim_names=("tp",))
    t = torch.arange(16.0, device=dev).reshape(4, 4)
    tour = []
    for src, dst in ((Shard(0), Replicate()), (Shard(1), Replicate()), (Replicate(), Shard(0)),
                     (Partial(), Replicate()), (Partial(), Shard(0))):
        if isinstance(src, Partial):  # rank r holds (r + 1) everywhere: the value is the sum over the ranks
            d = DTensor.from_local(torch.full((4, 4), rank + 1.0, device=dev), mesh, [Partial()])
        else:
            d = distribute_tensor(t, mesh, [src])
        with CommDebugMode() as mode:
            e = d.redistribute(mesh, [dst])
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, (d.to_local().tolist(), e.to_local().tolist()))
        tour.append({"from": str(src), "to": str(dst), "messages": collectives(mode), "held": held})
    return tour


def compare_dtensor():
    """The same blocks split by parallelize_module; compared with the unsplit blocks, messages counted."""
    dev, world = device(), dist.get_world_size()
    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("tp",))
    blocks, x, w = full_blocks()
    x, w = x.to(dev), w.to(dev)
    report = {}
    for name, full in blocks.items():
        full = full.to(dev)
        part = copy.deepcopy(full)  # parallelize_module splits a module in place: keep the full one
        y_ref, gx_ref, _ = run(full, x, w)
        if name == "Attention":
            part.heads = full.heads // world  # Attention.forward reshapes by the local head count
        parallelize_module(part, mesh, PLANS[name])
        y, gx, counts = run(part, x, w)
        diffs = {"output": (y - y_ref).abs().max().item(), "input grad": (gx - gx_ref).abs().max().item()}
        diffs |= {f"{p_name} grad": (p.grad.full_tensor() - q.grad).abs().max().item()  # full_tensor: all-gather
                  for (p_name, p), (_, q) in zip(part.named_parameters(), full.named_parameters())}
        report[name] = {"diffs": diffs, "all_reduces": counts,
                        "placements": {p_name: str(p.placements) for p_name, p in part.named_parameters()},
                        "local": {p_name: tuple(p.to_local().shape) for p_name, p in part.named_parameters()}}
    return report


def tensor_parallel_checks(tour=True):
    """Both versions of the split blocks, and (if tour) the tour of placements, in one launch."""
    return {"split": compare_split(), "tour": placements_tour() if tour else None, "dtensor": compare_dtensor()}


# %% [markdown]
# <!-- en -->
# ### Both versions on 2 and 4 processes
#
# One launch per number of processes runs `tensor_parallel_checks`: the version built from primitives, the tour of
# placements (on 2 processes) and the version built with `parallelize_module`. Rank 0's report comes back; the
# weight shapes are those that rank 0 holds. First the version built from primitives:
# <!-- ja -->
# ### プロセス 2個と 4個での両方の版の実行
#
# プロセス数ごとに 1回の起動で `tensor_parallel_checks` を実行します。中身は、プリミティブから組み立てた版、配置を順に見る例（2個のプロセスのとき）、`parallelize_module` で作った版です。戻ってくるのはランク 0 の報告で、重みの形状はランク 0 が持つ部分のものです。まずプリミティブから組み立てた版の結果です。

# %%
from dtensor_workers import tensor_parallel_checks

tp_reports = {n: launch(tensor_parallel_checks, n, kwargs={"tour": n == 2}, timeout=120) for n in (2, 4)}
split_reports = {n: report["split"] for n, report in tp_reports.items()}
dtensor_reports = {n: report["dtensor"] for n, report in tp_reports.items()}
rows = []
for n, report in split_reports.items():
    for name, r in report.items():
        rows.append([f"n={n}", name, join([f"{k} {tuple(v)}" for k, v in r["shapes"].items() if k.endswith("weight")]
                                          + ([f"heads={r['heads']}"] if r["heads"] else []))])
        rows.append(["", "", tr("all-reduces", "オールリデュース") + f": {r['all_reduces']}"])
        rows.append(["", "", tr("predicted", "予想") + f": {r['expected']}"])
print(table(rows, ["", "", ("rank 0 holds", "ランク 0 の持ち分")]))

# %% tags=["nbval-ignore-output"]
print(table([[f"n={n}", name, f"{max(r['diffs'].values()):.1e}"]
             for n, report in split_reports.items() for name, r in report.items()],
            ["", "", ("largest difference to the unsplit block", "分割前のブロックとの最大の差")]))

# %%
for n, report in split_reports.items():
    for name, r in report.items():
        assert r["names"], "the gathered gradients cover every parameter of the unsplit block"
        assert all(d < 1e-12 for d in r["diffs"].values()), (n, name, r["diffs"])
        assert r["all_reduces"] == r["expected"], (n, name)
    assert report["MLP"]["all_reduces"] == {"forward": 1, "backward": 1}
    assert report["Attention"]["all_reduces"] == {"forward": 1, "backward": 3}
    assert report["Attention"]["heads"] == 4 // n
print(tr("split = unsplit on 2 and 4 processes: output, input gradient and every parameter's gradient "
         "(float64, tolerance 1e-12)",
         "2個と 4個のプロセスで、分割したブロックは分割前と一致: 出力、入力の勾配、すべてのパラメータの勾配"
         "（float64、許容誤差 1e-12）"))

# %% [markdown]
# <!-- en -->
# The differences are rounding at the level of float64: a sum over `n` partial products adds its terms in another
# order than one matrix product does. Note what each rank stores: half (or a quarter) of every weight of the
# block, and only the activations of its own hidden features or heads. The price is messages on the critical
# path, each as large as the block's input `(B, T, dim)`: one all-reduce forward and one backward for the MLP, and
# no rank can go on until the sum has arrived.
# <!-- ja -->
# 差は float64 の丸め誤差の大きさです。`n` 個の部分積の和は、1回の行列積とは違う順序で項を足すからです。各ランクが保存するものにも注目してください。ブロックのすべての重みの半分（または 4分の 1）と、自分の中間特徴またはヘッドの活性化だけです。その代わり、計算のクリティカルパス上に通信が入ります。どの通信もブロックの入力 `(B, T, dim)` と同じ大きさで、MLP では順伝播と逆伝播で 1回ずつのオールリデュースです。和が届くまで、どのランクも先に進めません。

# %% [markdown]
# <!-- en -->
# The tour of placements on 2 processes, a 4 x 4 tensor of the numbers 0 to 15 (and, for `Partial`, rank `r`
# holding the value `r + 1` everywhere, so that the sum is 3):
# <!-- ja -->
# 2個のプロセスで配置を順に見ていきます。テンソルは 0 から 15 までの数を並べた 4 × 4 です（`Partial` では、ランク `r` がすべての要素に値 `r + 1` を持つので、和は 3 になります）。

# %%
for step in tp_reports[2]["tour"]:
    print(f"{step['from']:>6} -> {step['to']:<4} " + tr("messages", "通信") + f": {step['messages'] or tr('none', 'なし')}")
    for r, (before, after) in enumerate(step["held"]):
        print(f"        {tr('rank', 'ランク')} {r}: {before} -> {after}")

# %%
tour = {(s["from"], s["to"]): s["messages"] for s in tp_reports[2]["tour"]}
assert tour[("S(0)", "R")] == tour[("S(1)", "R")] == {"all_gather_into_tensor": 1}
assert tour[("P(sum)", "R")] == {"all_reduce": 1} and tour[("P(sum)", "S(0)")] == {"reduce_scatter_tensor": 1}
assert tour[("R", "S(0)")] == {}, "taking a piece of a replicated tensor needs no message"

# %% [markdown]
# <!-- en -->
# Then the two blocks under `parallelize_module`, on 2 and 4 processes, next to what the version built from
# primitives counted:
# <!-- ja -->
# 次に `parallelize_module` で分割した 2つのブロックを 2個と 4個のプロセスで動かし、プリミティブから組み立てた版が数えた回数と並べます。

# %%
print(table([[f"n={n}", name, str(r["all_reduces"]), str(split_reports[n][name]["all_reduces"])]
             for n, report in dtensor_reports.items() for name, r in report.items()],
            ["", "", ("DTensor's all-reduces", "DTensor のオールリデュース"), ("from primitives", "プリミティブ版")]))
print()
print(table([[f"MLP.{p_name}", placement, str(dtensor_reports[2]["MLP"]["local"][p_name])]
             for p_name, placement in dtensor_reports[2]["MLP"]["placements"].items()],
            [("parameter", "パラメータ"), ("placement", "配置"), ("rank 0 holds", "ランク 0 の持ち分")], indent=4))

# %% tags=["nbval-ignore-output"]
print(table([[f"n={n}", name, f"{max(r['diffs'].values()):.1e}"]
             for n, report in dtensor_reports.items() for name, r in report.items()],
            ["", "", ("largest difference to the unsplit block", "分割前のブロックとの最大の差")]))

# %%
for n, report in dtensor_reports.items():
    for name, r in report.items():
        assert all(d < 1e-12 for d in r["diffs"].values()), (n, name, r["diffs"])
        assert r["all_reduces"] == split_reports[n][name]["all_reduces"] == split_reports[n][name]["expected"]
assert dtensor_reports[2]["MLP"]["placements"] == {
    "fc1.weight": "(Shard(dim=0),)", "fc1.bias": "(Shard(dim=0),)",
    "fc2.weight": "(Shard(dim=1),)", "fc2.bias": "(Replicate(),)"}

# %% [markdown]
# <!-- en -->
# `DTensor` does what the hand-written layers do, message for message: one all-reduce forward per row-parallel
# layer, one backward per column-parallel layer that reads a replicated input. The placements say what each rank
# stores: `fc2.bias` is replicated, as in `RowParallelLinear`, where the bias is added once after the sum. What
# `DTensor` adds is bookkeeping: every parameter knows its layout, so `full_tensor()` can reassemble it, an
# optimizer can step on the shards, and a checkpoint can be saved and loaded on a different number of ranks.
# <!-- ja -->
# `DTensor` は、手で書いた層と通信 1回単位まで同じことをします。行並列の層 1つにつき順伝播で 1回、複製された入力を読む列並列の層 1つにつき逆伝播で 1回のオールリデュースです。配置を見ると、各ランクが何を保存しているかがわかります。`fc2.bias` は複製されています。`RowParallelLinear` で、和をとったあとにバイアスを 1回だけ足すのと同じです。`DTensor` が加えるのは、配置を記録して管理する仕組みです。どのパラメータも自分の配置を知っているので、`full_tensor()` で元に戻せますし、オプティマイザはシャードのまま更新でき、チェックポイントは保存したときとは違うランク数でも読み込めます。

# %% [markdown]
# <!-- en -->
# ## Pipelines across processes
#
# Now cut the model the other way: the Vision Transformer of `mparlib.vit` (patch embedding, 4 blocks, norm and
# head) into `p` stages, stage `s` on rank `s`. Each rank holds only its own layers; what crosses between ranks is
# one activation per micro-batch forward and its gradient backward, sent point to point to the neighbour.
#
# `torch.distributed.pipelining` supplies the parts:
#
# - `PipelineStage(module, stage_index, num_stages, device)` wraps the module of one stage and does the sending and
#   receiving. (`pipeline(model, mb_args, split_spec)` can also cut a model automatically by tracing it; we try it
#   below.)
# - A **schedule** decides the order of the work. `ScheduleGPipe` runs the forward passes of all `m` micro-batches,
#   then all backward passes, as chapter 4 described. `Schedule1F1B` ("one forward, one backward") starts each
#   micro-batch's backward pass as early as possible and then alternates, so a rank holds the activations of at most
#   `p` micro-batches instead of `m`. It needs at least as many micro-batches as stages.
# - `schedule.step(x)` on the first rank, `schedule.step(target=y, losses=...)` on the last and `schedule.step()` in
#   between run one training step; the gradients are averaged over the micro-batches, so an optimizer step afterwards
#   equals one step on the whole batch. The averaging is the schedules' `scale_grads=True` default, which
#   `torch.distributed.pipelining` introduced in early 2025; older releases sum the micro-batches' gradients, and code
#   written for them divides the loss by `m` itself.
#
# The stage module is a slice of the ViT. It ends with `.contiguous()`: gloo sends only tensors that are dense in
# memory, and the tokens that leave the patch embedding are a transposed view.
# <!-- ja -->
# ## プロセスをまたぐパイプライン
#
# 今度はモデルをもう一方の向きに切ります。`mparlib.vit` の Vision Transformer（パッチ埋め込み、4つのブロック、正規化と出力層）を `p` 個のステージに切り、ステージ `s` をランク `s` に置きます。各ランクは自分の層だけを持ちます。ランクの間を渡るのは、順伝播ではマイクロバッチごとに 1つの活性化、逆伝播ではその勾配です。どちらも隣のランクへの 1対1通信（point-to-point）で送ります。
#
# `torch.distributed.pipelining` が部品を提供します。
#
# - `PipelineStage(module, stage_index, num_stages, device)` は 1つのステージのモジュールをラップし、送信と受信を受け持ちます（`pipeline(model, mb_args, split_spec)` を使えば、モデルをトレースして自動で切ることもできます。あとで試します）。
# - **スケジュール**が作業の順序を決めます。`ScheduleGPipe` は `m` 個のマイクロバッチの順伝播をすべて済ませてから、逆伝播をすべて行います。4章で説明したとおりです。`Schedule1F1B`（「順伝播 1回、逆伝播 1回」）は、各マイクロバッチの逆伝播をできるだけ早く始め、そのあとは順伝播と逆伝播を交互に行います。そのためランクが保持する活性化は、`m` 個ではなく高々 `p` 個のマイクロバッチ分で済みます。マイクロバッチはステージと同じ数以上必要です。
# - 最初のランクで `schedule.step(x)`、最後のランクで `schedule.step(target=y, losses=...)`、その間のランクで `schedule.step()` を呼ぶと、訓練の 1ステップが進みます。勾配はマイクロバッチについて平均されるので、そのあとのオプティマイザのステップは、バッチ全体での 1ステップと同じになります。この平均は、スケジュールの `scale_grads=True` という既定値によるもので、`torch.distributed.pipelining` に 2025年の初めに入りました。それより前のリリースはマイクロバッチの勾配を足し合わせるだけなので、そうしたリリース向けのコードは損失を自分で `m` で割っています。
#
# ステージのモジュールは ViT の一部を切り出したものです。最後に `.contiguous()` を呼んでいます。gloo が送れるのはメモリ上で連続したテンソルだけで、パッチ埋め込みから出てくるトークンは転置したビューだからです。

# %%
# %%worker pipe_workers
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline
from torch.nn import functional as F

from mparlib import schedules
from mparlib.rendezvous import device
from mparlib.vit import vit


class ViTStage(nn.Module):
    """Stage s of p of a ViT: the patch embedding (first stage), a share of the blocks, norm and head (last)."""

    def __init__(self, model, s, p):
        super().__init__()
        depth = len(model.blocks)
        self.first, self.last = s == 0, s == p - 1
        self.blocks = model.blocks[depth * s // p:depth * (s + 1) // p]
        if self.first:
            self.embed, self.pos = model.embed, model.pos
        if self.last:
            self.norm, self.head = model.norm, model.head

    def forward(self, x):
        if self.first:  # images (B, 1, 28, 28) -> tokens (B, 49, dim), as ViT.forward does
            x = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        for block in self.blocks:
            x = block(x)
        if self.last:
            return self.head(self.norm(x).mean(dim=1))  # (B, 10)
        return x.contiguous()  # sent to the next rank: gloo sends dense tensors only


def train_steps(stage, params, batches, schedule, micro_batches, lr):
    """SGD steps of a pipeline; every rank returns the mean loss of each step (computed on the last rank)."""
    dev, last = device(), dist.get_world_size() - 1
    steps = schedules.schedule_class(schedule)(stage, n_microbatches=micro_batches, loss_fn=F.cross_entropy)
    optimizer = torch.optim.SGD(params, lr=lr)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        micro_losses = []
        args = (x.to(dev),) if stage.is_first else ()
        kwargs = {"target": y.to(dev), "losses": micro_losses} if stage.is_last else {}
        steps.step(*args, **kwargs)
        optimizer.step()
        if stage.is_last:
            losses.append(torch.stack(micro_losses).mean().item())
    box = [losses]
    dist.broadcast_object_list(box, src=last)
    return box[0]


def gather_parameters(named):
    """{name: tensor on the CPU} of every rank's parameters, merged, on every rank."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {n: p.detach().cpu() for n, p in named})
    return {n: t for part in every for n, t in part.items()}


def pipelined_training(batches, micro_batches=4, lr=0.03, traced=False, bubble=None):
    """Train the ViT as a pipeline with GPipe and with 1F1B (and, if traced, with stages cut by pipeline())."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # full float32 on GPUs
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    result = {}
    for schedule in ("gpipe", "1f1b"):
        torch.manual_seed(0)
        model = vit("smoke")  # the whole model, the same on every rank; each rank keeps its stage
        module = ViTStage(model, rank, world).to(dev)
        names = {id(p): n for n, p in model.named_parameters()}
        stage = PipelineStage(module, rank, world, dev)
        losses = train_steps(stage, module.parameters(), batches, schedule, micro_batches, lr)
        params = gather_parameters((names[id(p)], p) for p in module.parameters())
        result[schedule] = {"losses": losses, "params": params, "held": sum(p.numel() for p in module.parameters())}
    if traced:
        torch.manual_seed(0)
        model = vit("smoke")
        depth = len(model.blocks)
        cuts = [depth * s // world for s in range(1, world)]
        for c in cuts:  # the activation that leaves a stage must be dense for gloo, as in ViTStage
            model.blocks[c - 1].register_forward_hook(lambda module, args, out: out.contiguous())
        example = batches[0][0][:len(batches[0][0]) // micro_batches]  # one micro-batch, to trace with
        with warnings.catch_warnings():  # torch 2.11's tracer warns about its own use of LeafSpec; 2.14's does not
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
            pipe = pipeline(model, mb_args=(example,), split_spec={f"blocks.{c}": SplitPoint.BEGINNING for c in cuts})
            stage = pipe.build_stage(rank, dev)
            losses = train_steps(stage, stage.submod.parameters(), batches, "gpipe", micro_batches, lr)
        result["pipeline()"] = {"losses": losses, "params": gather_parameters(stage.submod.named_parameters())}
    if bubble is not None:
        result["bubble"] = schedules.measure_bubble(**bubble)
    return result


# %% [markdown]
# <!-- en -->
# The reference is one process training the same model on the same three batches of Fashion-MNIST, 32 images each,
# with the whole batch at once. The pipelines use 4 micro-batches of 8 images. Three steps are enough to compare;
# how well the ViT learns is not the question here.
# <!-- ja -->
# 基準は、1個のプロセスが同じモデルを、Fashion-MNIST の同じ 3つのバッチ（各 32枚）で、バッチ全体を一度に使って訓練した結果です。パイプラインでは 8枚ずつのマイクロバッチを 4個使います。比べるには 3ステップで十分です。ViT がどこまで学習できるかは、ここでは問いません。

# %%
train_iter, _ = load_fashion_mnist(32, subset=(96, 16), resident=True)
batches = [(x.clone(), y.clone()) for x, y in train_iter]  # 3 batches of 32 images (B, 1, 28, 28)
LR, MICRO = 0.03, 4


def one_process(batches, lr=LR):
    """The reference: plain SGD on the whole batch in this process."""
    torch.manual_seed(0)
    model = vit("smoke")
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


ref_losses, ref_params = one_process(batches)
print(tr("batches:", "バッチ:"), [tuple(x.shape) for x, _ in batches])

# %% [markdown]
# <!-- en -->
# The same launch also runs the bubble experiment described in the next section, so that the processes start once
# for each number of processes; on 2 processes it also tries the stages that `pipeline()` cuts by tracing.
# <!-- ja -->
# プロセスの起動をプロセス数ごとに 1回で済ませるため、同じ起動で次の節のバブルの実験も行います。2個のプロセスでは、`pipeline()` がトレースで切ったステージも試します。

# %%
from pipe_workers import pipelined_training

BUBBLE = (dict(width=512, layers=4, micro_batch_size=32, steps=3) if PROFILE == "smoke"
          else dict(width=1024, layers=8, micro_batch_size=64, steps=5))
pipe_reports = {n: launch(pipelined_training, n, args=(batches,),
                          kwargs=dict(micro_batches=MICRO, lr=LR, traced=n == 2, bubble=BUBBLE), timeout=300)
                for n in (2, 4)}
for n, report in pipe_reports.items():
    print(f"n={n}: " + join([tr("runs", "実行") + f" {[k for k in report if k != 'bubble']}",
                             tr("parameters on rank 0", "ランク 0 のパラメータ数") + f" {report['gpipe']['held']:,}",
                             tr("in the whole model", "モデル全体") + f" {sum(t.numel() for t in ref_params.values()):,}"]))

# %% tags=["nbval-ignore-output"]
RUN_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "pipeline()": "pipeline()"}  # the workers' keys, as printed
rows = [[("one process", "1個のプロセス"), str([f"{v:.6f}" for v in ref_losses]), "-"]]
for n, report in pipe_reports.items():
    for name in RUN_NAMES:
        if name in report:
            worst = max((report[name]["params"][k] - v).abs().max().item() for k, v in ref_params.items())
            rows.append([f"n={n} {RUN_NAMES[name]}", str([f"{v:.6f}" for v in report[name]["losses"]]), f"{worst:.1e}"])
print(table(rows, ["", ("losses", "損失"), ("largest parameter difference", "パラメータの最大の差")]))

# %%
TOL = dict(rtol=1e-5, atol=1e-5)  # float32: micro-batches add the terms of a sum in another order
for n, report in pipe_reports.items():
    for name in ("gpipe", "1f1b", "pipeline()"):
        if name in report:
            torch.testing.assert_close(torch.tensor(report[name]["losses"]), torch.tensor(ref_losses), **TOL)
            assert sorted(report[name]["params"]) == sorted(ref_params)
            for k, v in ref_params.items():
                torch.testing.assert_close(report[name]["params"][k], v, **TOL)
print(tr("pipelines on 2 and 4 processes, GPipe and 1F1B, = one process: losses and all parameters after 3 steps "
         "(float32, tolerance 1e-5)",
         "2個と 4個のプロセスのパイプライン（GPipe と 1F1B）は 1個のプロセスと一致: 3ステップ後の損失とすべての"
         "パラメータ（float32、許容誤差 1e-5）"))

# %% [markdown]
# <!-- en -->
# The pipelines follow the single process to float32 rounding, with both schedules and with the traced stages.
# A schedule changes *when* each micro-batch is computed, never *what*. (As in chapter 4, this needs layers that
# treat each sample on its own: the ViT's layer norms do, batch normalization would not.)
#
# ## The bubble, measured
#
# How much time does a pipeline lose? Chapter 4 counted ticks: with `p` stages of equal cost and `m` micro-batches,
# each rank idles for a fraction `(p - 1) / (m + p - 1)` of the step, the **bubble**. Here we measure it. The
# class `mparlib.schedules.StageTimes` wraps a `PipelineStage` so that its `forward_one_chunk` and
# `backward_one_chunk` (what the schedule calls for each micro-batch) note their start and end. On one machine
# all processes read the same clock, so the notes of all ranks can be laid side by side; the bubble is the idle
# share, `1 - (sum of busy intervals) / (p x length of the step)` (`bubble_fraction`), to set beside the formula
# (`bubble_formula`). Waiting for a message counts as idle.
#
# For the formula to apply, the stages must cost the same, so the experiment (`mparlib.schedules.measure_bubble`)
# does not use the ViT, whose first and last stages carry extra layers: every stage is the same stack of
# `Linear(512, 512)` and tanh (`uniform_stage`), and every micro-batch has 32 rows whatever `m` is, so that one interval is the same
# amount of work in every run.
# <!-- ja -->
# どちらのスケジュールでも、トレースで切ったステージでも、パイプラインは float32 の丸め誤差の範囲で 1個のプロセスと一致します。スケジュールが変えるのは、各マイクロバッチを「いつ」計算するかであって、「何を」計算するかではありません（4章と同じく、これはサンプルを 1つずつ独立に扱う層でだけ成り立ちます。ViT の層正規化はそうですが、バッチ正規化は違います）。
#
# ## バブルの測定
#
# パイプラインはどれだけの時間を失うのでしょうか。4章では時刻を単位に数えました。計算量の等しい `p` 個のステージと `m` 個のマイクロバッチでは、各ランクは 1ステップのうち `(p - 1) / (m + p - 1)` の割合だけ遊んでいます。これが**バブル**です。ここではそれを測ります。`mparlib.schedules.StageTimes` は `PipelineStage` をラップし、スケジュールがマイクロバッチごとに呼ぶ `forward_one_chunk` と `backward_one_chunk` が、自分の開始と終了の時刻を記録するようにします。1台のマシンではすべてのプロセスが同じ時計を読むので、全ランクの記録を並べて比べられます。バブルは遊んでいた割合で、忙しかった区間の合計を「p × ステップの長さ」で割り、1 から引いた値です（`bubble_fraction`）。これを式の値（`bubble_formula`）と並べます。メッセージを待っている時間も遊びに数えます。
#
# 式が当てはまるには、ステージの計算量がそろっている必要があります。そのため実験（`mparlib.schedules.measure_bubble`）では、最初と最後のステージに余分な層が付く ViT は使いません。どのステージも `Linear(512, 512)` と tanh を同じだけ積んだもの（`uniform_stage`）で、マイクロバッチは `m` によらず常に 32行です。こうすると、1つの区間の仕事量がどの実行でも同じになります。

# %% tags=["nbval-ignore-output"]
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B"}  # the names to print
print(table([[n, SCHEDULES[schedule], m, f"{row['measured']:.3f}", f"{row['formula']:.3f}"]
             for n, report in pipe_reports.items() for schedule, rows in report["bubble"].items()
             for m, row in rows.items()],
            ["p", ("schedule", "スケジュール"), "m", ("measured", "測定値"), ("formula", "式")]))
if mparlib.num_gpus() < 4 and (os.cpu_count() or 1) < 4:
    print(tr("4 processes on fewer than 4 cores share them: a rank that waits for a core looks busy, so the "
             "4-process rows are not a test of the formula here.",
             "4個のプロセスが 4つ未満のコアを分け合っています。コアを待っているランクも忙しく見えるので、ここでは "
             "4個のプロセスの行は式の検証になりません。"))

# %% [markdown]
# <!-- en -->
# What the notes say does not depend on the machine: the order in which each rank worked. GPipe does all forward
# passes, then all backward passes. 1F1B on rank `r` does `min(m, p - r)` forward passes to fill the pipeline,
# then alternates one backward and one forward, then drains the remaining backward passes. That order decides the
# memory: a micro-batch's activations live from its forward to its backward pass, so the most micro-batches "in
# flight" on a rank is `m` with GPipe and `p - r` with 1F1B. The cell checks both against the recorded notes:
# <!-- ja -->
# マシンによらず記録からわかることがあります。各ランクが作業した順序です。GPipe は順伝播をすべて済ませてから、逆伝播をすべて行います。1F1B はランク `r` で、まず `min(m, p - r)` 回の順伝播でパイプラインを満たし、そのあとは逆伝播と順伝播を 1回ずつ交互に行い、最後に残った逆伝播を済ませてパイプラインを空にします。この順序がメモリを決めます。マイクロバッチの活性化は順伝播から逆伝播まで保持されるので、ランク上で同時に「処理中」のマイクロバッチの数は、GPipe では最大 `m`、1F1B では最大 `p - r` です。次のセルで、記録した順序と照らし合わせます。

# %%
def expected_order(schedule, r, p, m):
    """The order of work on rank r: ['F0', 'F1', ..., 'B0', ...]."""
    if schedule == "gpipe":
        return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
    warm = min(m, p - r)
    order = [f"F{i}" for i in range(warm)]
    for i in range(m - warm):
        order += [f"B{i}", f"F{warm + i}"]
    return order + [f"B{i}" for i in range(m - warm, m)]


def in_flight(notes):
    """The most micro-batches whose forward pass has run and whose backward pass has not yet."""
    held = most = 0
    for kind, *_ in notes:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


for n, report in pipe_reports.items():
    for schedule, rows in report["bubble"].items():
        for m, row in rows.items():
            for r, notes in enumerate(row["records"]):
                assert [f"{k}{i}" for k, i, *_ in notes] == expected_order(schedule, r, n, m), (n, schedule, m, r)
                assert in_flight(notes) == (m if schedule == "gpipe" else min(m, n - r))
            assert 0 < row["measured"] < 1
    print(f"p={n}: " + tr("most micro-batches in flight on rank 0 with m=8", "m=8 でランク 0 が同時に抱える"
                            "マイクロバッチの最大数") + ": "
          + join([f"GPipe {in_flight(report['bubble']['gpipe'][8]['records'][0])}",
                  f"1F1B {in_flight(report['bubble']['1f1b'][8]['records'][0])}"]))

# %% [markdown]
# <!-- en -->
# Below, the schedules as they really ran on 2 processes with 4 micro-batches, under chapter 4's simulated
# pipeline of the same size (drawn from `mparlib.hybrid.pipeline_schedule`, forward passes only, one tick per stage
# and micro-batch). Bars are numbered by micro-batch; backward passes are hatched. In the measured rows you can see
# the fill and drain of the pipeline, 1F1B's alternation, and the gaps that messages add between intervals.
# <!-- ja -->
# 下の図は、2個のプロセスと 4個のマイクロバッチで実際に動いたスケジュールです。上には、4章の同じ大きさの模擬パイプライン（`mparlib.hybrid.pipeline_schedule` から描いたもの。順伝播のみで、ステージとマイクロバッチの組 1つにつき 1時刻）を並べました。棒の数字はマイクロバッチの番号で、逆伝播には斜線を引いてあります。測定した段では、パイプラインが満ちていく様子と空になっていく様子、1F1B の交互の動き、そして通信が区間の間に挟む隙間が見えます。

# %% tags=["nbval-ignore-output"]
simulated = [[("F", i, t, t + 1) for t, s, i in pipeline_schedule(2, 4) if s == r] for r in range(2)]
fig, axes = plt.subplots(3, 1, figsize=(9, 5.4))
diagrams.draw_timeline(axes[0], simulated, tr("Chapter 4: simulated devices, forward only",
                                              "4章: 模擬デバイス、順伝播のみ"),
                       unit=1, xlabel=tr("tick", "時刻"), row_label=lambda r: tr(f"device {r}", f"デバイス {r}"))
for ax, schedule in zip(axes[1:], ("gpipe", "1f1b")):
    row = pipe_reports[2]["bubble"][schedule][4]
    label = SCHEDULES[schedule]
    diagrams.draw_timeline(ax, row["records"], tr(f"{label} on 2 processes, m=4: bubble {row['measured']:.0%} "
                                                  f"(formula {row['formula']:.0%})",
                                                  f"{label}、プロセス 2個、m=4: バブル {row['measured']:.0%}"
                                                  f"（式では {row['formula']:.0%}）"))
fig.tight_layout()
plt.show()

# %% [markdown]
# <!-- en -->
# What to expect from the numbers:
#
# - The formula counts computation only. The measured bubble is larger, and the gap grows with `m` (the table above):
#   every micro-batch adds messages between the stages and work of the schedule itself, a fixed cost per micro-batch
#   that the formula does not count, while the formula's bubble shrinks towards zero. The smaller the stages, the more
#   these fixed costs weigh; this chapter's stages are small so that it runs quickly. `benchmarks/pipeline.py` uses
#   larger ones (8 layers of width 1024, 64 rows per micro-batch). Its saved run on the course's 2-core machine
#   (`benchmarks/results/pipeline-vm-20261201-141628.json`, which records load averages of 1.1 to 1.8 at the start: the machine was not
#   idle) measured, for `m` = 4 and 8, GPipe 0.265 and 0.178 and 1F1B 0.232 and 0.137, against the formula's 0.200 and
#   0.111, and only 1F1B at `m` = 4 met the goal of coming within 20% of the formula. With devices that compute much
#   faster than their links carry, the gap can be larger still. The GPipe paper reports the bubble to be negligible
#   once `m >= 4p` on its hardware, where a micro-batch's computation dwarfs such fixed costs; in this chapter's run,
#   `m = 4p` still left a measured bubble well above the formula's.
# - In the formula GPipe and 1F1B have the same bubble: 1F1B saves memory, not time. The difference between the
#   two measured rows comes from the costs the formula leaves out. Schedules that cut the bubble itself split
#   each rank's layers into several smaller stages (interleaved 1F1B, `ScheduleInterleaved1F1B`) or the backward
#   pass into two parts (zero-bubble schedules).
# - More micro-batches shrink the bubble, but each one is smaller; on a GPU a small micro-batch uses the device
#   poorly. This is why real pipelines use large global batches.
# - On a machine with fewer cores than processes, the processes take turns on the cores, which no formula about
#   stages knows about.
# <!-- ja -->
# 数値から読み取れることは次のとおりです。
#
# - 式が数えるのは計算だけです。測ったバブルは式より大きく、その差は `m` とともに広がります（上の表）。マイクロバッチが 1つ増えるごとに、ステージ間のメッセージとスケジュール自身の処理が増えます。これはマイクロバッチごとにかかる固定のコストで、式には入っていません。一方、式のバブルは `m` を増やすほど 0 に近づきます。ステージが小さいほど、この固定のコストの比重は大きくなります。この章のステージは、すぐに実行が終わるよう小さくしてあります。`benchmarks/pipeline.py` はもっと大きなステージ（幅 1024 の層を 8つ、マイクロバッチあたり 64行）を使います。その結果は `benchmarks/results/pipeline-vm-20261201-141628.json` に保存してあります（このコースの CPU 2コアのマシンで測ったもので、開始時のロードアベレージは 1.1〜1.8 と、マシンは空いていませんでした）。`m` = 4 と 8 のとき、GPipe で 0.265 と 0.178、1F1B で 0.232 と 0.137 でした。式の値は 0.200 と 0.111 で、式の 20% 以内という目標に入ったのは 1F1B の `m` = 4 だけです。リンクが運ぶ速さに比べてデバイスの計算がずっと速ければ、差はさらに広がることがあります。GPipe の論文は、その論文のハードウェアでは `m >= 4p` ならバブルは無視できると報告しています。そこではマイクロバッチ 1つの計算が、こうした固定のコストよりはるかに大きいからです。この章の実行では、`m = 4p` でも、測ったバブルは式の値を大きく上回りました。
# - 式の上では GPipe と 1F1B のバブルは同じです。1F1B が節約するのはメモリで、時間ではありません。測った 2つの行の違いは、式が数えないコストから来ています。バブルそのものを減らすスケジュールは、各ランクの層をさらに小さな複数のステージに分けたり（インターリーブ 1F1B、`ScheduleInterleaved1F1B`）、逆伝播を 2つの部分に分けたり（ゼロバブルのスケジュール）します。
# - マイクロバッチを増やすとバブルは縮みますが、1つひとつは小さくなります。GPU では小さなマイクロバッチはデバイスを十分に使えません。実際のパイプラインが大きな全体のバッチサイズを使うのはこのためです。
# - プロセスの数よりコアが少ないマシンでは、プロセスが交代でコアを使います。ステージについての式はどれも、このことを考慮していません。

# %% [markdown]
# <!-- en -->
# ## 2D parallelism: sharding along one dimension, tensor parallelism along the other
#
# Large trainings combine the forms. Arrange 4 processes in a 2 x 2 **device mesh** with named dimensions:
# `init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))` puts ranks `[[0, 1], [2, 3]]` in a grid. Along
# `"tp"` (ranks 0 and 1, and 2 and 3) each block is split by tensor parallelism; along `"dp"` (ranks 0 and 2, and 1
# and 3) the model is sharded with FSDP (`fully_shard`, chapter 9) and each pair sees its own half of the batch. A
# parameter then has two placements, one per mesh dimension: cut once by FSDP along `"dp"` and once by tensor
# parallelism along `"tp"`, so each rank stores about a quarter of every block.
#
# The usual layout puts tensor parallelism on the fastest links (the GPUs of one machine, which talk over NVLink),
# because it communicates inside every block, and sharding or data parallelism across machines, which communicate
# once per layer or per step.
# <!-- ja -->
# ## 2次元並列: 一方の次元でシャーディング、もう一方でテンソル並列
#
# 大規模な訓練では、これらの方式を組み合わせます。4個のプロセスを、名前の付いた次元を持つ 2 × 2 の**デバイスメッシュ**に並べます。`init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))` はランクを `[[0, 1], [2, 3]]` の格子に並べます。`"tp"` の向き（ランク 0 と 1、ランク 2 と 3）では各ブロックをテンソル並列で分け、`"dp"` の向き（ランク 0 と 2、ランク 1 と 3）ではモデルを FSDP（`fully_shard`、9章）でシャーディングし、それぞれの組がバッチの半分ずつを受け持ちます。するとパラメータはメッシュの次元ごとに 1つ、計 2つの配置を持ちます。`"dp"` の向きに FSDP で 1回、`"tp"` の向きにテンソル並列でもう 1回切られるので、各ランクが保存するのは各ブロックのおよそ 4分の 1 です。
#
# ふつうは、テンソル並列を最も速いリンク（1台のマシンの中の GPU どうし。NVLink で通信します）に割り当てます。ブロックごとに通信するからです。シャーディングやデータ並列は、層ごとやステップごとにしか通信しないので、マシンの間に割り当てます。

# %%
# %%worker twod_workers
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional as F

from mparlib.rendezvous import device
from mparlib.vit import vit

BLOCK_PLAN = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
              "attn.out": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}


def train_2d(batches, lr=0.03):
    """FSDP along "dp" and tensor parallelism along "tp" of a 2 x 2 mesh: SGD steps, then the full parameters."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # full float32 on GPUs
    dev = device()
    mesh = init_device_mesh(dev.type, (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    torch.manual_seed(0)
    model = vit("smoke").to(dev)  # the same weights as the one-process reference
    for block in model.blocks:
        block.attn.heads //= tp.size()  # each tp rank computes its share of the heads
        parallelize_module(block, tp, BLOCK_PLAN)  # first split each block across "tp" ...
        fully_shard(block, mesh=dp)  # ... then shard what each rank holds across "dp"
    fully_shard(model, mesh=dp)  # the embedding, norm and head: sharded across "dp" only
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    share = dp.get_local_rank()
    losses = []
    for x, y in batches:
        k = len(y) // dp.size()  # this dp pair's half of the batch; both tp ranks of the pair see the same
        loss = F.cross_entropy(model(x[share * k:(share + 1) * k].to(dev)), y[share * k:(share + 1) * k].to(dev))
        optimizer.zero_grad()
        loss.backward()  # FSDP averages the gradients over "dp"; tensor parallelism sums partial gradients in "tp"
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp.get_group())
        losses.append(mean.item() / dp.size())
    full = {}
    for name, p in model.named_parameters():
        if p.device_mesh.ndim == 2:  # gather along "dp" first (as FSDP does before each forward), then along "tp"
            p = p.redistribute(p.device_mesh, [Replicate(), p.placements[1]])
        full[name] = p.full_tensor().cpu()
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, sum(p.to_local().numel() for p in model.parameters()))
    return {"losses": losses, "params": full, "held": held, "mesh": mesh.mesh.tolist(),
            "placements": {n: str(p.placements) for n, p in model.named_parameters()
                           if n.startswith("blocks.0.mlp") or n in ("head.weight", "pos")}}


# %%
from twod_workers import train_2d

report_2d = launch(train_2d, 4, args=(batches,), kwargs={"lr": LR}, timeout=300)
print(tr("mesh (dp x tp):", "メッシュ（dp x tp）:"), report_2d["mesh"])
print(table([[name, placement] for name, placement in report_2d["placements"].items()], indent=4))
total = sum(t.numel() for t in ref_params.values())
print(tr("parameters held per rank:", "ランクごとに保持するパラメータ数:"), report_2d["held"],
      tr(f"of {total}", f"（全体は {total}）"))

# %% tags=["nbval-ignore-output"]
print(tr("one process:", "1個のプロセス:"), [f"{v:.6f}" for v in ref_losses])
print(tr("2D, 4 processes:", "2次元並列、プロセス 4個:"), [f"{v:.6f}" for v in report_2d["losses"]])
print(tr("largest parameter difference:", "パラメータの最大の差:"),
      f"{max((report_2d['params'][k] - v).abs().max().item() for k, v in ref_params.items()):.1e}")

# %%
torch.testing.assert_close(torch.tensor(report_2d["losses"]), torch.tensor(ref_losses), **TOL)
assert sorted(report_2d["params"]) == sorted(ref_params)
for k, v in ref_params.items():
    torch.testing.assert_close(report_2d["params"][k], v, **TOL)
assert report_2d["mesh"] == [[0, 1], [2, 3]]
assert all(h < 0.3 * total for h in report_2d["held"]), "each rank holds about a quarter of the parameters"
print(tr("FSDP x tensor parallelism on a 2 x 2 mesh = one process (float32, tolerance 1e-5)",
         "2 x 2 のメッシュ上の FSDP x テンソル並列は 1個のプロセスと一致（float32、許容誤差 1e-5）"))

# %% [markdown]
# <!-- en -->
# The placements read as "first mesh dimension, then second": `fc1.weight` is cut into rows by tensor parallelism
# along `"tp"`, and those rows are cut again by FSDP along `"dp"` (`_StridedShard` is how `DTensor` records that
# the second cut was made *inside* the first); `fc2.weight` is cut by rows along `"dp"` and by columns along
# `"tp"`. The embedding, the norms and the head are not split along `"tp"`: every tp rank computes them whole on
# the same tokens, so their gradients agree without any message.
#
# ## Choosing a parallelism
#
# What this run measured:
# <!-- ja -->
# 配置は「メッシュの 1つ目の次元、2つ目の次元」の順に読みます。`fc1.weight` は `"tp"` の向きにテンソル並列で行に切られ、その行が `"dp"` の向きに FSDP でさらに切られています（`DTensor` は `_StridedShard` を使って、2回目の切り分けが 1回目の**内側**で行われたことを記録します）。`fc2.weight` は `"dp"` の向きに行で、`"tp"` の向きに列で切られています。埋め込み、正規化、出力層は `"tp"` の向きには分けていません。どの tp ランクも同じトークンから丸ごと計算するので、通信しなくても勾配が一致します。
#
# ## 並列化の選び方
#
# この実行で測ったものは次のとおりです。

# %% tags=["nbval-ignore-output"]
B, T, dim = 32, 49, 64  # a batch of the smoke ViT: every tensor-parallel all-reduce is one (B, T, dim) tensor
mlp_ar, attn_ar = split_reports[2]["MLP"]["all_reduces"], split_reports[2]["Attention"]["all_reduces"]
per_block = {k: mlp_ar[k] + attn_ar[k] for k in mlp_ar}
two = pipe_reports[2]["bubble"]["gpipe"]
rows = [
    (tr("tensor parallel, per block", "テンソル並列、ブロックごと"),
     tr(f"{per_block['forward']} all-reduces forward, {per_block['backward']} backward, "
        f"{B * T * dim * 4 / 2**10:.0f} KiB each (batch {B})",
        f"順伝播で {per_block['forward']}回、逆伝播で {per_block['backward']}回のオールリデュース、1回 "
        f"{B * T * dim * 4 / 2**10:.0f} KiB（バッチ {B}）")),
    (tr("pipeline, 2 processes, GPipe", "パイプライン、プロセス 2個、GPipe"),
     tr("bubble, measured (formula): ", "バブルの測定値（式）: ")
     + join(f"m={m}: {r['measured']:.0%} ({r['formula']:.0%})" for m, r in two.items())),
    (tr("pipeline, per boundary and micro-batch", "パイプライン、境界とマイクロバッチごと"),
     tr(f"one activation of {B // MICRO * T * dim * 4 / 2**10:.0f} KiB forward and its gradient backward",
        f"順伝播で {B // MICRO * T * dim * 4 / 2**10:.0f} KiB の活性化 1つ、逆伝播でその勾配")),
    (tr("2D (FSDP x TP), 4 processes", "2次元並列（FSDP x TP）、プロセス 4個"),
     tr(f"parameters per rank {min(report_2d['held']) / total:.0%} to {max(report_2d['held']) / total:.0%} of the model",
        f"ランクあたりのパラメータはモデルの {min(report_2d['held']) / total:.0%} から {max(report_2d['held']) / total:.0%}")),
]
print(table(rows, align="<<"))
print(tr(f"whole chapter so far: {time.perf_counter() - CHAPTER_START:.0f} s",
         f"ここまでの章全体: {time.perf_counter() - CHAPTER_START:.0f}秒"))

# %% [markdown]
# <!-- en -->
# The earlier chapters measured the rest on your machine: chapter 5 the speed of `DataParallel` over your GPUs,
# chapter 6 `DataParallel` against DDP, chapter 7 how close one device gets to its roofline, chapter 8 the bus
# bandwidth of an all-reduce, chapter 9 the memory per rank under sharding. Put together with published numbers:
#
# | form | what each device holds | what it sends | pays off when | published figures |
# |---|---|---|---|---|
# | data parallel (DDP, chapter 6) | the whole model, gradients and optimizer state | one all-reduce of all gradients per step, overlapped with the backward pass | the model fits on one device and you want more samples per second | Transformers' docs: GPT-2 on 2 TITAN RTX, 200 steps: `DataParallel` 110 s, DDP 101 s, DDP without NVLink 131 s |
# | sharded data parallel (FSDP / ZeRO, chapter 9) | 1/N of parameters, gradients and optimizer state, plus in full the layer that computes and the next one, prefetched | all-gathers of parameters (forward and backward) and reduce-scatters of gradients: 1.5 x DDP's traffic for full sharding, by the ZeRO paper's count | the model's training state does not fit, but a few layers do | *Ultra-Scale Playbook*: 16 bytes per parameter with Adam in mixed precision (1B: 16 GB, 7B: 112 GB, 70B: 1120 GB; its interactive 8B figure does not follow this arithmetic, chapter 9). PyTorch's ZeRO recipe, 2 ranks: peak 1697 MB -> 1361 MB |
# | tensor parallel (this chapter) | 1/N of every layer's weights and of the activations inside a block | all-reduces of activations inside every block, on the critical path | layers are too big or too slow for one device and the devices have fast links (one machine) | Megatron-LM: two all-reduces forward and two backward per transformer layer, with `q`, `k`, `v` fused; kept within the 8 GPUs of one server |
# | pipeline parallel (this chapter) | 1/N of the layers; activations of up to `m` (GPipe) or `p` (1F1B) micro-batches | one activation per micro-batch and boundary, point to point | the model is deep, links are slow (across machines), and a micro-batch's computation is large next to the fixed cost of its messages, so that more micro-batches shrink the bubble | GPipe: bubble `(p - 1) / (m + p - 1)` counting computation only, negligible for `m >= 4p` on its hardware; this chapter measured a larger bubble, further from the formula as `m` grows (the bubble table) |
# | 2D / 3D (this chapter) | the product of the splits | each form on its own mesh dimension | the largest models: TP inside a machine, PP and FSDP/DP across machines | Bekman, *Machine Learning Engineering*: all-reduce bus bandwidth of one 8 x H200 node about 482 GB/s, with NCCL's in-switch reduction (NVLS), not a ring (chapter 8); d2l: 160 MB of gradients in a ring over 8 V100s in about 6 ms |
#
# A rule of thumb in that order: use data parallelism while the model fits; shard when its training state does
# not; add tensor parallelism when single layers are too large or a batch per device too small to keep a device
# busy, but only over fast links; add a pipeline when you must cross slow links or the model is very deep. Each
# step trades memory for communication, and the measurements above tell you what the communication costs on your
# hardware: on the 2-core machine this course was written on, an all-reduce over gloo and loopback reached 1 to 2 GB/s
# of bus bandwidth for large messages (chapter 8 measures yours; `benchmarks/results/collectives-*.json` holds the
# course machine's), and an 8-GPU node moves hundreds of times more.
# <!-- ja -->
# 残りは、これまでの章で手元のマシンを使って測りました。5章は手元の GPU での `DataParallel` の速度、6章は `DataParallel` と DDP の比較、7章は 1つのデバイスがルーフラインにどこまで近づくか、8章はオールリデュースのバス帯域幅、9章はシャーディングでのランクあたりのメモリです。公表されている数値と合わせてまとめます。
#
# | 方式 | 各デバイスが持つもの | 送るもの | 効果が出るとき | 公表されている数値 |
# |---|---|---|---|---|
# | データ並列（DDP、6章） | モデル全体、勾配、オプティマイザの状態 | ステップごとに全勾配のオールリデュース 1回。逆伝播と重ねて行う | モデルが 1つのデバイスに収まり、1秒あたりのサンプル数を増やしたいとき | Transformers のドキュメント: TITAN RTX 2枚で GPT-2、200ステップ: `DataParallel` 110秒、DDP 101秒、NVLink なしの DDP 131秒 |
# | シャーディングしたデータ並列（FSDP / ZeRO、9章） | パラメータ、勾配、オプティマイザの状態の 1/N と、計算中の層と先読みした次の層の完全なパラメータ | パラメータのオールギャザー（順伝播と逆伝播）と勾配のリデュース・スキャッター。ZeRO の論文の計算では、完全なシャーディングで DDP の 1.5倍の通信量 | 訓練の状態は収まらないが、数層分なら収まるとき | 『Ultra-Scale Playbook』: 混合精度で Adam を使うとパラメータ 1つあたり 16バイト（1B で 16 GB、7B で 112 GB、70B で 1120 GB。8B のインタラクティブな図はこの計算と合いません。9章を参照）。PyTorch の ZeRO のレシピ、ランク 2個: ピーク 1697 MB → 1361 MB |
# | テンソル並列（この章） | すべての層の重みと、ブロック内の活性化の 1/N | ブロックごとに活性化のオールリデュース。クリティカルパス上で行う | 層が 1つのデバイスには大きすぎるか遅すぎ、デバイス間のリンクが速い（1台のマシンの中）とき | Megatron-LM: `q`、`k`、`v` をまとめた場合、Transformer の層 1つにつき順伝播で 2回、逆伝播で 2回のオールリデュース。1台のサーバーの GPU 8枚の中で使う |
# | パイプライン並列（この章） | 層の 1/N。活性化は最大 `m` 個（GPipe）または `p` 個（1F1B）のマイクロバッチ分 | 境界とマイクロバッチごとに活性化 1つを 1対1通信で隣のランクへ送る | モデルが深く、リンクが遅く（マシンの間）、マイクロバッチ 1つの計算がその通信の固定のコストより十分に大きいので、マイクロバッチを増やすとバブルが縮むとき | GPipe: 計算だけを数えたバブルは `(p - 1) / (m + p - 1)`、その論文のハードウェアでは `m >= 4p` なら無視できる。この章で測ったバブルはこれより大きく、`m` が増えるほど式との差が広がった（バブルの表） |
# | 2次元 / 3次元並列（この章） | それぞれの分割の積 | 各方式がメッシュの自分の次元で通信する | 最大級のモデル: マシンの中でテンソル並列、マシンの間でパイプライン並列と FSDP / データ並列 | Bekman『Machine Learning Engineering』: H200 8枚のノード 1台のオールリデュースのバス帯域幅は約 482 GB/s（リングではなく、NCCL のスイッチ内での足し算 NVLS による値。8章）。d2l: V100 8枚のリングで 160 MB の勾配を約 6 ms で同期 |
#
# この順に考えるのが目安です。モデルが収まるうちはデータ並列を使います。訓練の状態が収まらなくなったらシャーディングします。1つの層が大きすぎるとき、あるいはデバイスあたりのバッチが小さすぎてデバイスを忙しくできないときは、テンソル並列を加えます。ただし速いリンクの上だけです。遅いリンクをまたぐ必要があるとき、またはモデルがとても深いときは、パイプラインを加えます。どの一歩も、メモリと引き換えに通信を増やします。その通信が手元のハードウェアでどれだけかかるかは、上の測定が教えてくれます。このコースを書いた 2コアのマシンでは、gloo とループバックでのオールリデュースのバス帯域幅は、大きなメッセージで 1〜2 GB/s でした（8章で手元の値を測ります。このコースのマシンの値は `benchmarks/results/collectives-*.json` にあります）。GPU 8枚のノードは、その数百倍を運びます。

# %% [markdown]
# <!-- en -->
# ## Summary
#
# - Tensor parallelism splits a layer's weight by output features (column-parallel) or by input features
#   (row-parallel). A column split followed by a row split needs no message in between and one sum at the end.
# - Two mirror-image operators make the backward pass right: `f` (identity forward, all-reduce backward) where a
#   replicated input enters, `g` (all-reduce forward, identity backward) where partial sums leave. Attention is
#   split by heads; the block's head count becomes the local one.
# - `DTensor` records each tensor's layout on a `DeviceMesh` as `Shard`, `Replicate` or `Partial`;
#   `parallelize_module` with `ColwiseParallel` / `RowwiseParallel` gives the same blocks with the same messages,
#   as `CommDebugMode` shows.
# - `torch.distributed.pipelining` runs stages in separate processes; GPipe and 1F1B compute the same steps as one
#   process. The formula `(p - 1) / (m + p - 1)` gives both the same bubble, counting computation only; the measured
#   bubble was larger, and further from the formula as `m` grew, because every micro-batch adds a fixed cost of
#   messages and scheduling (the bubble table). 1F1B holds fewer micro-batches' activations.
# - A 2D mesh combines FSDP along one dimension with tensor parallelism along the other, and still computes what
#   one process computes.
# <!-- ja -->
# ## まとめ
#
# - テンソル並列は、層の重みを出力の特徴で分ける（列並列）か、入力の特徴で分けます（行並列）。列並列のあとに行並列を続けると、間に通信はいらず、最後に 1回の和で済みます。
# - 互いに鏡像になる 2つの演算子によって、逆伝播が正しく計算されます。複製された入力が入る場所に `f`（順伝播は恒等写像、逆伝播はオールリデュース）、部分和が出ていく場所に `g`（順伝播はオールリデュース、逆伝播は恒等写像）を置きます。アテンションはヘッド単位で分け、ブロックのヘッド数をローカルな数にします。
# - `DTensor` は `DeviceMesh` 上での各テンソルの配置を `Shard`、`Replicate`、`Partial` として記録します。`ColwiseParallel` / `RowwiseParallel` を使った `parallelize_module` は、同じブロックを同じ通信で作ります。`CommDebugMode` で確かめられます。
# - `torch.distributed.pipelining` はステージを別々のプロセスで動かします。GPipe と 1F1B は 1個のプロセスと同じステップを計算します。式 `(p - 1) / (m + p - 1)` は計算だけを数え、どちらのバブルも同じだとしますが、測ったバブルはそれより大きく、`m` が増えるほど式との差が広がりました。マイクロバッチごとに、通信とスケジュールの処理という固定のコストが加わるからです（バブルの表）。1F1B は、活性化を保持するマイクロバッチの数が少なくて済みます。
# - 2次元のメッシュでは、一方の次元の FSDP ともう一方の次元のテンソル並列を組み合わせられます。それでも計算するのは 1個のプロセスと同じものです。

# %% [markdown]
# <!-- en -->
# ## Exercises
#
# Each exercise has a **starter** cell whose function body is `raise NotImplementedError`: replace that line with your
# code, run the cell, then run the check cell below it. The starter of the row-parallel layer is a `%%worker` cell:
# its check starts 2 and then 4 fresh processes that import your function. The check says *not attempted*, *wrong* (the first
# difference and one hint for the likely mistake), *error* (your exception, or your code ending its process), *right*,
# *cannot run here* or *the check itself failed* (never a verdict on your answer); it never prints the answer. A
# one-process exercise runs your function in a fresh worker process and stops it after 30 s; a distributed check stops
# a collective that waits for a partner that never comes after 20 s, naming the waiting rank, and the whole check
# after 240 s. `hint("10.1")` prints the next hint level each time you call it and says when none is left;
# `hint("10.1", 2)` prints a given level.
# <!-- ja -->
# ## 練習問題
#
# 各練習問題には、本体が `raise NotImplementedError` だけの関数を含む**スターター**のセルがあります。その行を自分のコードに置き換えてセルを実行し、すぐ下のチェックのセルを実行してください。行並列の層のスターターは `%%worker` のセルです。そのチェックは新しいプロセスを 2個、次に 4個起動してそこで関数をインポートします。チェックの結果は「未着手」、「不正解」（最初の違いと、ありがちな間違いに合わせたヒント 1つ）、「エラー」（発生した例外、またはコードがプロセスを終了させたこと）、「正解」、「この環境では実行できません」、「チェック自体の不具合」（あなたの答えの判定ではありません）のどれかで、答えそのものは表示しません。1つのプロセスの練習問題では関数を新しいワーカープロセスで実行し、30秒で止めます。分散のチェックでは、来ない相手を待ち続ける集合通信を 20秒で止めて待っていたランクを示し、チェック全体を 240秒で止めます。`hint("10.1")` は呼ぶたびに次の段階のヒントを表示し、もう残っていなければそう伝えます。`hint("10.1", 2)` は指定した段階のヒントを表示します。

# %%
from mparlib.exercises import check, hint

# %% [markdown]
# <!-- en -->
# ### Exercise 10.1: A row-parallel linear layer
#
# Write `row_parallel_linear(x, linear)`, called on every rank with the same whole input `x` (shape `(..., in)`)
# and the same `nn.Linear`: each rank uses only its slice of the input features and the matching columns of the
# weight, and every rank returns `linear(x)`. The check runs 2 and then 4 ranks with a 2-D and a 3-D input and compares
# with `nn.Linear` itself.
# <!-- ja -->
# ### 練習問題 10.1: 行並列の線形層
#
# すべてのランクが同じ入力全体 `x`（形状 `(..., in)`）と同じ `nn.Linear` を渡して呼ぶ `row_parallel_linear(x, linear)` を書いてください。各ランクは入力の特徴の自分のスライスと、それに対応する重みの列だけを使い、どのランクも `linear(x)` を返します。チェックはランク 2個、次に 4個で 2次元と 3次元の入力を使い、`nn.Linear` そのものと比べます。

# %%
# %%worker ex10_row
# Exercise 10.1: starter
import torch
import torch.distributed as dist


def row_parallel_linear(x, linear):
    """`linear(x)` computed with the input features split over the ranks."""
    raise NotImplementedError("10.1")

# %%
from ex10_row import row_parallel_linear

check("10.1", row_parallel_linear)

# %% [markdown]
# <!-- en -->
# ### Exercise 10.2: The 1F1B order of a stage
#
# Write `one_f_one_b(stage, num_stages, micro_batches)`: the order in which stage `stage` of a pipeline of
# `num_stages` stages runs the forward and backward passes of `micro_batches` micro-batches under 1F1B, as a list
# of `("F", i)` and `("B", i)`, the order `Schedule1F1B` follows. The check compares every stage of pipelines of
# 1 to 5 stages.
# <!-- ja -->
# ### 練習問題 10.2: ステージの 1F1B の順序
#
# `num_stages` 個のステージからなるパイプラインのステージ `stage` が、1F1B で `micro_batches` 個のマイクロバッチの順伝播と逆伝播を実行する順序を、`("F", i)` と `("B", i)` のリストで返す `one_f_one_b(stage, num_stages, micro_batches)` を書いてください。`Schedule1F1B` が従う順序です。チェックはステージ数 1〜5 のパイプラインのすべてのステージで比べます。

# %%
# Exercise 10.2: starter
def one_f_one_b(stage, num_stages, micro_batches):
    """Stage `stage`'s order of ("F", i) and ("B", i) under 1F1B."""
    raise NotImplementedError("10.2")


# %%
check("10.2", one_f_one_b)

# %% [markdown]
# <!-- en -->
# ### Exercise 10.3: The bubble
#
# Write `bubble(num_stages, micro_batches)`: the share of a step that a rank of a pipeline of equal stages spends
# idle, counting computation only, without calling `schedules.bubble_formula`. The check compares at random
# points.
# <!-- ja -->
# ### 練習問題 10.3: バブル
#
# 等しいステージからなるパイプラインで、1つのランクがステップのうち何もしていない割合（計算だけを数えます）を返す `bubble(num_stages, micro_batches)` を、`schedules.bubble_formula` を呼ばずに書いてください。チェックはランダムな点で比べます。

# %%
# Exercise 10.3: starter
def bubble(num_stages, micro_batches):
    """The idle share of a step of a pipeline of equal stages."""
    raise NotImplementedError("10.3")


# %%
check("10.3", bubble)

# %% [markdown]
# <!-- en -->
# ### More questions
#
# 1. **One `f` for three projections.** In `tp_workers`, write a module that applies
#    `tensor_parallel.copy_to_parallel` to its input once and then calls a split attention block whose `q`, `k` and
#    `v` were built with `ColumnParallelLinear(..., copy_input=False)`. Launch the comparison again: do the outputs
#    and gradients still match, and how many all-reduces does the backward pass make now? This is what Megatron-LM's
#    fused `qkv` matrix achieves.
# 2. **An uneven split.** Call `launch(compare_split, 3)`. Which check fails, and what does the message suggest?
#    With `MLP(64, 96)` and 3 processes, would the MLP alone work?
# 3. **More micro-batches.** Run `launch(schedules.measure_bubble, 2, kwargs=dict(micro_batches=(2, 4, 8, 16),
#    schedules=("1f1b",)))`. At which `m` does the measured bubble come within 20% of the formula on your machine?
#    Then halve `micro_batch_size`: what happens to the agreement, and why?
# 4. **Swap the mesh.** In `train_2d`, shard along `"tp"` and split along `"dp"` instead (swap `dp` and `tp` in the
#    worker, including the halves of the batch). Does the parity still hold? Which messages would now cross the
#    slower links if the two rows of the mesh were two machines?
# <!-- ja -->
# ### その他の問い
#
# 1. **3つの射影に `f` を 1つだけ。** `tp_workers` に、入力に `tensor_parallel.copy_to_parallel` を 1回だけ適用してから、分割したアテンションのブロックを呼ぶモジュールを書いてください。そのブロックの `q`、`k`、`v` は `ColumnParallelLinear(..., copy_input=False)` で作ります。比較をもう一度起動してください。出力と勾配はまだ一致するでしょうか。逆伝播のオールリデュースは何回になったでしょうか。Megatron-LM が `qkv` を 1つの行列にまとめて得ているのは、この効果です。
# 2. **割り切れない分割。** `launch(compare_split, 3)` を呼んでください。どの検査が失敗し、メッセージは何を勧めているでしょうか。`MLP(64, 96)` を 3個のプロセスで分けるなら、MLP だけは動くでしょうか。
# 3. **マイクロバッチを増やす。** `launch(schedules.measure_bubble, 2, kwargs=dict(micro_batches=(2, 4, 8, 16), schedules=("1f1b",)))` を実行してください。手元のマシンでは、`m` がいくつのとき測ったバブルが式の 20% 以内に入るでしょうか。次に `micro_batch_size` を半分にしてください。一致の度合いはどう変わるでしょうか。それはなぜでしょうか。
# 4. **メッシュの向きを入れ替える。** `train_2d` で、`"tp"` の向きにシャーディングし、`"dp"` の向きに分割してください（ワーカーの中の `dp` と `tp` を、バッチを半分に分けるところも含めて入れ替えます）。一致はまだ保たれるでしょうか。メッシュの 2つの行が 2台のマシンだったとしたら、今度はどの通信が遅いリンクを渡ることになるでしょうか。
