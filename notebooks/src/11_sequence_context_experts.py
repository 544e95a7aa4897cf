# %% [markdown]
# <!-- en -->
# # 11. Long sequences and many experts: sequence, context and expert parallelism
#
# Chapters 8 to 10 split a model's state (sharding) and its layers (tensor and pipeline parallelism). Training
# today's transformers adds three more ways to divide the work, each along a different axis of the data:
#
# - **Sequence parallelism** keeps tensor parallelism's split of the weights, and splits along the sequence the
#   activations between the tensor-parallel regions (layer norms, dropout, residual additions), which tensor
#   parallelism alone keeps whole on every rank.
# - **Context parallelism** splits the sequence everywhere, attention included. Attention needs every key for
#   every query, so the keys and values travel around a ring of ranks: **ring attention**.
# - **Expert parallelism** places the experts of a mixture-of-experts layer on different ranks and sends each
#   token to the experts a router chose for it, with all-to-all messages.
#
# This chapter builds each one from point-to-point and collective messages, proves it computes what one process
# computes, measures what it saves and what it costs, and then
#
# 1. trains a Vision Transformer with context parallelism, and a mixture-of-experts model with expert parallelism,
#    and checks that both learn;
# 2. ends with a table of all the dimensions of the course: what each one splits, what it sends and when it pays off.
#
# The sequences are Fashion-MNIST's images cut into finer patches: 4 x 4 pixels give 49 tokens, 2 x 2 give 196,
# single pixels 784. As before, everything runs on a laptop (CPU processes talking through `gloo`), and on the GPUs
# with `nccl` when there is one for every process.
# <!-- ja -->
# # 11. 長い系列と多数のエキスパート: シーケンス並列、コンテキスト並列、エキスパート並列
#
# 8〜10章では、モデルの状態（シャーディング）と層（テンソル並列とパイプライン並列）を分けました。現在の Transformer の訓練では、これに加えて 3つの分け方を使います。どれもデータの別の軸に沿って仕事を分けます。
#
# - **シーケンス並列**は、テンソル並列による重みの分割はそのままにして、テンソル並列の領域の間にある活性化（層正規化、ドロップアウト、残差の足し算）を系列に沿って分けます。テンソル並列だけでは、これらはどのランクでも丸ごと持ちます。
# - **コンテキスト並列**は、アテンションも含めてどこでも系列を分けます。アテンションでは、どのクエリにもすべてのキーが必要です。そこでキーとバリューをランクのリングに沿って回します。これが**リングアテンション**です。
# - **エキスパート並列**は、MoE（Mixture of Experts）の層のエキスパートを別々のランクに置き、ルーターが選んだエキスパートへ各トークンをオールツーオール（all-to-all）通信で送ります。
#
# この章では、それぞれを 1対1通信（point-to-point）と集合通信（collective communication）から組み立て、1個のプロセスと同じものを計算することを証明し、何が減って何がかかるかを測ります。そのうえで、
#
# 1. コンテキスト並列で Vision Transformer を、エキスパート並列で MoE のモデルを訓練し、どちらも学習することを確かめます。
# 2. 最後に、このコースで扱ったすべての次元について、何を分け、何を送り、いつ得をするかを表にまとめます。
#
# 系列には Fashion-MNIST の画像をより細かいパッチに切ったものを使います。4 x 4 ピクセルのパッチなら 49トークン、2 x 2 なら 196トークン、1ピクセルずつなら 784トークンです。これまでと同じく、すべてノート PC で動きます（CPU 上のプロセスが `gloo` で通信します）。プロセスごとに GPU があれば、GPU 上で `nccl` を使って動きます。

# %% tags=["nbval-ignore-output"]
import inspect
import time

import matplotlib.pyplot as plt
import torch
from torch.nn import functional as F

import mparlib
import mparlib.plot
from mparlib import experts, sequence_parallel
from mparlib import ring_attention as ra
from mparlib.ddp_train import load_split_tensors
from mparlib.data import load_fashion_mnist, to_float
from mparlib.lang import join, table, tr
from mparlib.launch import launch
from mparlib.rendezvous import describe
from mparlib.ring_attention import SavedBytes, block_attention, chunks_of, measure_memory, merge
from mparlib.vit import vit

# %load_ext mparlib.launch

mparlib.plot.use_course_style()  # a font with Japanese glyphs for this notebook's figures
print(mparlib.report())
print(mparlib.profile_line())
PROFILE = mparlib.profile()
CHAPTER_START = time.perf_counter()
VERSIONS = {"mine": ("from primitives", "プリミティブ版"), "pytorch": ("parallelize_module", "parallelize_module")}
SPLITS = {"contiguous": ("contiguous", "連続した分割"), "balanced": ("balanced", "負荷を均した分割")}

# %% [markdown]
# <!-- en -->
# The cells below start groups of 2 and 4 processes. Where the machine has fewer GPUs than processes, they run on
# the CPU with `gloo`; the next cell says which applies here. Checked outputs are the same either way; timings are
# printed in cells whose output depends on the machine.
# <!-- ja -->
# この後のセルでは、2個と 4個のプロセスのグループを起動します。マシンの GPU がプロセスの数より少なければ、プロセスは CPU 上で `gloo` を使って動きます。ここでどちらになるかは次のセルが表示します。検査される出力はどちらの場合も同じです。時間の計測値は、マシンによって変わる出力のセルに表示します。

# %% tags=["nbval-ignore-output"]
for n in (2, 4):
    print(describe(n))

# %% [markdown]
# <!-- en -->
# ## Sequence parallelism: the rest of the block cut along the tokens
#
# Tensor parallelism (chapter 10) splits attention by heads and the MLP by hidden features, but between them every
# rank still holds the whole activation `(B, T, dim)`: both LayerNorms, both residual additions (and dropout, where
# a model has it) run identically on every rank, and each rank stores their inputs for the backward pass. For long
# sequences these replicated parts dominate the activation memory. **Sequence parallelism** (Korthikanti et al.,
# *Reducing Activation Recomputation in Large Transformer Models*, 2022) cuts them along the sequence instead:
# rank `r` of `n` keeps tokens `r*T/n` to `(r+1)*T/n` outside the tensor-parallel regions. LayerNorm and dropout
# treat each token on its own, so they need nothing from the other ranks.
#
# The mirror-image pair `f` / `g` of chapter 10 changes with it. An all-reduce is a reduce-scatter followed by an
# all-gather (chapter 8), and sequence parallelism simply places the two halves on either side of the replicated
# part:
#
# - **Entering a region** (was `f`): the block needs all tokens, so *all-gather along the sequence* forward.
#   Backward, every rank holds a partial gradient for all tokens; each rank needs the sum for its own tokens only:
#   a *reduce-scatter*.
# - **Leaving a region** (was `g`): the partial sums of the row-parallel layer are needed only for this rank's
#   tokens: a *reduce-scatter* forward, and an *all-gather* of the gradient backward.
#
# The bytes on the wire are those of chapter 10's all-reduces (a ring all-reduce is exactly these two halves), but
# the LayerNorms compute `1/n` of the tokens and store `1/n` of their inputs. In `mparlib.sequence_parallel` the
# pair is `gather_sequence` and `scatter_sequence`:
# <!-- ja -->
# ## シーケンス並列: ブロックの残りのトークン方向の分割
#
# テンソル並列（10章）は、アテンションをヘッドで、MLP を中間の特徴で分けます。しかしその間では、どのランクも活性化 `(B, T, dim)` 全体を持っています。2つの LayerNorm と 2つの残差の足し算（モデルにあればドロップアウトも）はどのランクでも同じように実行され、各ランクがその入力を逆伝播のために保存します。系列が長いと、この複製された部分が活性化のメモリの大半を占めます。**シーケンス並列**（Korthikanti ら、『Reducing Activation Recomputation in Large Transformer Models』、2022年）は、この部分を系列の向きに切ります。ランク `r`（`n` 個中）は、テンソル並列の領域の外ではトークン `r*T/n` から `(r+1)*T/n` だけを持ちます。LayerNorm とドロップアウトはトークンを 1つずつ独立に扱うので、他のランクから何も受け取る必要がありません。
#
# それに合わせて、10章の鏡像の対 `f` / `g` も変わります。オールリデュース（all-reduce）はリデュース・スキャッター（reduce-scatter）の後にオールギャザー（all-gather）を続けたものです（8章）。シーケンス並列は、この 2つの半分を複製された部分の両側に置くだけです。
#
# - **領域に入る場所**（もとの `f`）: ブロックはすべてのトークンを必要とするので、順伝播では**系列の向きにオールギャザー**します。逆伝播では、各ランクがすべてのトークンについて部分的な勾配を持ち、必要なのは自分のトークンの和だけなので、**リデュース・スキャッター**です。
# - **領域から出る場所**（もとの `g`）: 行並列の層の部分和は、このランクのトークンの分だけあれば足ります。順伝播は**リデュース・スキャッター**、逆伝播は勾配の**オールギャザー**です。
#
# 通信するバイト数は 10章のオールリデュースと同じです（リングのオールリデュースはちょうどこの 2つの半分でできています）。一方、LayerNorm が計算するのはトークンの `1/n` で、保存する入力も `1/n` です。`mparlib.sequence_parallel` では、この対は `gather_sequence` と `scatter_sequence` です。

# %%
print(inspect.getsource(sequence_parallel._GatherSequence))
print(inspect.getsource(sequence_parallel._ScatterSequence))

# %% [markdown]
# <!-- en -->
# `split_block(block)` cuts an `mparlib.vit.Block` this way and returns a `SequenceParallelBlock`: the LayerNorms
# are whole copies that run on this rank's tokens, attention and MLP are split as in chapter 10, but their
# column-parallel layers skip `f` (`ColumnParallelLinear(..., copy_input=False)`: the gathered input is already
# whole) and their row-parallel layers reduce with `scatter_sequence` instead of an all-reduce
# (`RowParallelLinear(..., reduce=scatter_sequence)`). Its `forward` is two lines:
# <!-- ja -->
# `split_block(block)` は `mparlib.vit.Block` をこのように切り、`SequenceParallelBlock` を返します。LayerNorm は丸ごとのコピーで、このランクのトークンに対して動きます。アテンションと MLP は 10章と同じように分けますが、列並列の層は `f` を省きます（`ColumnParallelLinear(..., copy_input=False)`。集めた入力はすでに全体がそろっているからです）。行並列の層はオールリデュースの代わりに `scatter_sequence` で足し合わせます（`RowParallelLinear(..., reduce=scatter_sequence)`）。`forward` は 2行です。

# %%
print(inspect.getsource(sequence_parallel.SequenceParallelBlock.forward))

# %% [markdown]
# <!-- en -->
# One thing is new. The LayerNorm weights, and the biases that the row-parallel layers add after the sum, are
# replicated parameters that now see only this rank's tokens, so each rank's gradient is a partial sum over the
# tokens. `sync_replicated_grads` all-reduces them after the backward pass (Megatron-LM does the same, in one
# bucket). PyTorch's version keeps them as `Partial` gradients and carries out the sum when the gradient is
# read whole.
#
# What should `CommDebugMode` count? Per block, forward: 2 all-gathers (before attention and before the MLP) and 2
# reduce-scatters (after each); backward the same, mirrored; no all-reduce (`expected_collectives`). For the MLP
# alone that is 2 all-gathers and 2 reduce-scatters over a forward and a backward pass where chapter 10 had 2
# all-reduces. Compare the whole block in chapter 10: 2 all-reduces forward and 4 backward, because there each of `q`, `k` and `v` had its own
# `f`. Here the three projections read one gathered tensor, so their gradients are added on the rank before the
# single reduce-scatter: the first of chapter 10's more questions, for free.
#
# PyTorch expresses the same plan with `parallelize_module` (`block_plan` writes it for a `Block`):
# `SequenceParallel()` on the norms (input and output `Shard(1)`, the sequence dimension), `PrepareModuleInput`
# to turn `Shard(1)` into `Replicate()` in front of attention and MLP (the all-gather), `ColwiseParallel` inside,
# and `RowwiseParallel(output_layouts=Shard(1))` at the exits (the reduce-scatter). The worker below checks both
# versions against the unsplit block in float64: the output, the input's gradient and every parameter's gradient,
# with the tokens of 8 images cut into 7 x 7-pixel patches (`T = 16`, which divides by 2 and 4; the 49 tokens of
# the 4 x 4 patches would not).
# <!-- ja -->
# 新しい点が 1つあります。LayerNorm の重みと、行並列の層が和の後に足すバイアスは複製されたパラメータですが、今はこのランクのトークンしか見ません。そのため各ランクの勾配は、トークンについての部分和です。`sync_replicated_grads` は逆伝播の後にこれらをオールリデュースします（Megatron-LM も同じことを 1つのバケットで行います）。PyTorch の版では、これらの勾配は `Partial` のまま保たれ、勾配を全体として読むときに和が実行されます。
#
# `CommDebugMode` は何回と数えるはずでしょうか。ブロックごとに、順伝播でオールギャザー 2回（アテンションの前と MLP の前）とリデュース・スキャッター 2回（それぞれの後）、逆伝播でも鏡像の形で同じ回数、オールリデュースはなしです（`expected_collectives`）。MLP だけを見ると、順伝播と逆伝播を合わせてオールギャザー 2回とリデュース・スキャッター 2回で、10章ではここがオールリデュース 2回でした。ブロック全体では、10章は順伝播で 2回、逆伝播で 4回のオールリデュースでした。`q`、`k`、`v` がそれぞれ自分の `f` を持っていたからです。ここでは 3つの射影が集めた 1つのテンソルを読むので、その勾配はランクの中で足し合わされてから 1回のリデュース・スキャッターに渡ります。10章の「その他の問い」の 1つ目が、何もしなくても実現しています。
#
# PyTorch は同じプランを `parallelize_module` で表します（`block_plan` が `Block` 用に書きます）。正規化には `SequenceParallel()`（入力と出力は系列の次元の `Shard(1)`）、アテンションと MLP の前には `Shard(1)` を `Replicate()` にする `PrepareModuleInput`（オールギャザー）、中には `ColwiseParallel`、出口には `RowwiseParallel(output_layouts=Shard(1))`（リデュース・スキャッター）を置きます。次のワーカーは両方の版を分割前のブロックと float64 で比べます。出力、入力の勾配、すべてのパラメータの勾配です。入力は、画像 8枚を 7 x 7 ピクセルのパッチに切ったトークンです（`T = 16` は 2 でも 4 でも割り切れます。4 x 4 のパッチの 49トークンでは割り切れません）。

# %%
# %%worker sp_workers
import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

from mparlib import sequence_parallel as sp
from mparlib import tensor_parallel as tp
from mparlib.rendezvous import device
from mparlib.vit import Block

B, T, DIM, HEADS, HIDDEN = 8, 16, 64, 4, 128  # 8 images of 16 tokens (7 x 7-pixel patches)


def setup(dtype=torch.float64, seed=0):
    """The unsplit block, an input and loss weights: the same on every rank (same seed)."""
    torch.manual_seed(seed)
    block = Block(DIM, HEADS, HIDDEN).to(device(), dtype)
    x, w = (torch.randn(B, T, DIM, dtype=dtype).to(device()) for _ in range(2))
    return block, x, w


def reference(block, x, w):
    x = x.clone().requires_grad_()
    y = block(x)
    (y * w).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


def run_split(part, x, w):
    """This rank's tokens through a split block, collectives counted; output and input gradient gathered back."""
    x_mine = sp.shard_sequence(x).clone().requires_grad_()
    with CommDebugMode() as mode:
        y = part(x_mine)
        forward = sp.collective_counts(mode)
        (y * sp.shard_sequence(w)).sum().backward()
        both = sp.collective_counts(mode)
    counts = {"forward": forward, "backward": {k: both[k] - forward[k] for k in both}}
    return sp.gather_sequence(y.detach()), sp.gather_sequence(x_mine.grad), counts


def differences(y, gx, grads, ref):
    y_ref, gx_ref, g_ref = ref
    diffs = {"output": (y - y_ref).abs().max().item(), "input grad": (gx - gx_ref).abs().max().item()}
    return diffs | {f"{n} grad": (grads[n] - g_ref[n]).abs().max().item() for n in g_ref}


def saved_bytes():
    """Activation bytes saved for backward on this rank (float32): unsplit, tensor parallel, sequence parallel."""
    block, x, _ = setup(torch.float32)
    tp_block = copy.deepcopy(block)
    tp_block.attn, tp_block.mlp = tp.split_attention(tp_block.attn), tp.split_mlp(tp_block.mlp)
    out = {}
    for name, module, inp in (("unsplit", block, x), ("tensor", tp_block, x),
                              ("sequence", sp.split_block(block), sp.shard_sequence(x))):
        with sp.SavedBytes(module) as saved:
            module(inp.clone().requires_grad_())
        out[name] = saved.bytes
    return out


def sequence_checks():
    """Both versions against the unsplit block, and the saved bytes, in one launch."""
    full, x, w = setup()
    ref = reference(full, x, w)
    mine = sp.split_block(full)
    y, gx, counts = run_split(mine, x, w)
    synced = sp.sync_replicated_grads(mine)  # the norms' and the exit biases' gradients: partial sums over tokens
    report = {"mine": {"diffs": differences(y, gx, tp.gather_full(mine, grads=True), ref), "counts": counts,
                       "expected": sp.expected_collectives(mine), "synced": synced}}
    theirs = copy.deepcopy(full)
    theirs.attn.heads //= dist.get_world_size()  # Attention.forward reshapes by the local head count
    parallelize_module(theirs, init_device_mesh(device().type, (dist.get_world_size(),)), sp.block_plan())
    y, gx, counts = run_split(theirs, x, w)
    grads = {n: p.grad.full_tensor() for n, p in theirs.named_parameters()}  # Partial -> summed here
    report["pytorch"] = {"diffs": differences(y, gx, grads, ref), "counts": counts}
    return report | {"saved": saved_bytes(), "device": device().type}

# %% [markdown]
# <!-- en -->
# One launch each on 2 and 4 processes:
# <!-- ja -->
# 2個と 4個のプロセスで 1回ずつ起動します。

# %%
from sp_workers import B, DIM, HEADS, HIDDEN, T, sequence_checks

sp_reports = {n: launch(sequence_checks, n, timeout=300) for n in (2, 4)}
print(table([[f"n={n}", VERSIONS[version], str(report[version]["counts"]["forward"]),
              str(report[version]["counts"]["backward"])]
             for n, report in sp_reports.items() for version in ("mine", "pytorch")],
            ["", "", ("forward", "順伝播"), ("backward", "逆伝播")]))
for n, report in sp_reports.items():
    print(f"n={n}: " + tr("replicated gradients all-reduced after the backward pass",
                          "逆伝播の後にオールリデュースした複製パラメータの勾配") + f": {report['mine']['synced']}")

# %% tags=["nbval-ignore-output"]
print(table([[f"n={n}", VERSIONS[version], f"{max(report[version]['diffs'].values()):.1e}"]
             for n, report in sp_reports.items() for version in ("mine", "pytorch")],
            ["", "", ("largest difference to the unsplit block", "分割前のブロックとの最大の差")]))

# %%
per_pass = {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 0}
for n, report in sp_reports.items():
    for version in ("mine", "pytorch"):
        r = report[version]
        assert all(d < 1e-12 for d in r["diffs"].values()), (n, version, r["diffs"])
        assert r["counts"] == {"forward": per_pass, "backward": per_pass}, (n, version)
    assert {k: {**v, "all_reduce": 0} for k, v in report["mine"]["expected"].items()} == report["mine"]["counts"]
    assert report["mine"]["synced"] == 6  # norm1, norm2 (weight, bias), attn.out.bias, mlp.fc2.bias
print(tr("sequence parallel = unsplit block on 2 and 4 processes, both versions: output, input gradient and every "
         "parameter's gradient (float64, tolerance 1e-12); 2 all-gathers + 2 reduce-scatters each way, no all-reduce",
         "2個と 4個のプロセスで、両方の版のシーケンス並列は分割前のブロックと一致: 出力、入力の勾配、すべての"
         "パラメータの勾配（float64、許容誤差 1e-12）。各向きにオールギャザー 2回とリデュース・スキャッター 2回、"
         "オールリデュースなし"))

# %% [markdown]
# <!-- en -->
# ### Activation memory
#
# What does a rank store for the backward pass? `SavedBytes` counts the tensors that autograd saves while it is
# active (through `torch.autograd.graph.saved_tensors_hooks`), each storage once, and skips the weights. From the
# shapes (float32, `B = 8`, `T = 16`, `dim = 64`, `hidden = 128`, 4 heads) we can predict every byte:
#
# - split by heads or hidden features under both forms: `q`, `k`, `v` and the attention output (4 x `BTd`; the
#   output projection saves its input again, but that input is a view of the attention output's storage), the inputs of GELU and of `fc2` (2 x `BTh`), attention's log-sum-exp (`B x heads x T`);
# - whole on every rank under tensor parallelism: the inputs of the two norms and their outputs (4 x `BTd`) and the
#   norms' means and inverse deviations (4 x `BT`);
# - under sequence parallelism the norms' inputs and statistics shrink by `n`; their outputs, gathered, are what the
#   column-parallel layers save, and stay whole.
# <!-- ja -->
# ### 活性化のメモリ
#
# ランクは逆伝播のために何を保存しているでしょうか。`SavedBytes` は、有効な間に autograd が保存するテンソルを数えます（`torch.autograd.graph.saved_tensors_hooks` を使います）。同じストレージは 1回だけ数え、重みは数えません。形状（float32、`B = 8`、`T = 16`、`dim = 64`、`hidden = 128`、ヘッド 4つ）から、すべてのバイトを予想できます。
#
# - どちらの方式でもヘッドまたは中間の特徴で分かれるもの: `q`、`k`、`v` とアテンションの出力（4 x `BTd`。出力の射影も自分の入力を保存しますが、その入力はアテンションの出力と同じストレージのビューです）、GELU と `fc2` の入力（2 x `BTh`）、アテンションの log-sum-exp（`B x heads x T`）。
# - テンソル並列ではどのランクでも丸ごと持つもの: 2つの正規化の入力と出力（4 x `BTd`）、正規化の平均と標準偏差の逆数（4 x `BT`）。
# - シーケンス並列では、正規化の入力と統計量が `n` 分の 1 になります。正規化の出力は集めた後のものを列並列の層が保存するので、丸ごとのままです。

# %%
def predicted_saved(n, form, size=4):
    """Bytes a block saves for backward on one of n ranks (form: unsplit, tensor or sequence)."""
    btd, bth, bt, bht = B * T * DIM, B * T * HIDDEN, B * T, B * HEADS * T
    split = 4 * btd + 2 * bth + bht
    if form == "unsplit":
        return size * (split + 4 * btd + 4 * bt)
    if form == "tensor":
        return size * (split / n + 4 * btd + 4 * bt)
    return size * (split / n + 2 * btd + (2 * btd + 4 * bt) / n)


FORMS = {"unsplit": tr("unsplit", "分割なし"), "tensor": tr("tensor parallel", "テンソル並列"),
         "sequence": tr("sequence parallel", "シーケンス並列")}
print(table([[n, label, f"{report['saved'][form] / 2**10:.1f} KiB", f"{predicted_saved(n, form) / 2**10:.1f} KiB",
              f"{report['saved'][form] / report['saved']['unsplit']:.0%}"]
             for n, report in sp_reports.items() for form, label in FORMS.items()],
            ["n", ("form", "方式"), ("measured", "測定値"), ("predicted", "予想"), ("of unsplit", "分割なしに対する割合")]))
for n, report in sp_reports.items():
    if report["device"] == "cpu":  # GPU attention kernels save other tensors than the CPU's
        for form, measured in report["saved"].items():
            assert measured == predicted_saved(n, form), (n, form)
    assert report["saved"]["sequence"] < report["saved"]["tensor"] < report["saved"]["unsplit"]

# %% [markdown]
# <!-- en -->
# Every byte is where the shapes say. Sequence parallelism saves less than tensor parallelism alone, and the gap
# grows with `n`, but it does not reach `1/n`: the gathered inputs of the column-parallel layers (2 x `BTd`) are
# still whole on every rank. Megatron-LM goes one step further: it saves only the rank's slice of that input and
# all-gathers it again in the backward pass, when the weight gradient needs it, which trades one more all-gather
# per region for the rest of the memory. (Its paper counts `34 / n` of the per-token activations of a layer, plus
# the attention scores, with sequence parallelism.)
#
# `loss_parallel`, PyTorch's companion for the end of a tensor-parallel model, is not used here: it computes the
# cross-entropy from logits that are sharded along the class dimension, which pays off for a language model's
# vocabulary of tens of thousands of classes. Our ViT averages its tokens and has 10 classes; its head is
# replicated and the loss is an ordinary `F.cross_entropy`.
# <!-- ja -->
# すべてのバイトが、形状から予想したとおりの場所にあります。シーケンス並列はテンソル並列だけの場合より保存が少なく、その差は `n` とともに広がります。ただし `1/n` には届きません。列並列の層が集めた入力（2 x `BTd`）は、まだどのランクでも丸ごとだからです。Megatron-LM はもう一歩進めます。その入力のうちランクの分だけを保存し、重みの勾配が必要とする逆伝播のときにもう一度オールギャザーします。領域ごとにオールギャザー 1回を増やす代わりに、残りのメモリも減らすわけです（その論文は、シーケンス並列で層のトークンあたりの活性化を `34 / n` とアテンションのスコアの分と数えています）。
#
# PyTorch がテンソル並列のモデルの最後のために用意している `loss_parallel` は、ここでは使いません。これはクラスの次元でシャーディングされたロジットからクロスエントロピーを計算するもので、言語モデルの数万クラスの語彙で効果があります。この ViT はトークンを平均し、クラスは 10個です。出力層は複製され、損失はふつうの `F.cross_entropy` です。

# %% [markdown]
# <!-- en -->
# ## Context parallelism: attention over a split sequence
#
# Attention is the one layer of a transformer that mixes tokens: every query scores every key, `scores = q @ k.T /
# sqrt(d)`, and takes a softmax-weighted sum of the values. Its intermediate, the score matrix, has `B x H x T x T`
# entries for a batch of `B` sequences of `T` tokens with `H` heads: it grows with the square of the sequence
# length. At `T = 784` (one token per pixel), batch 8 and 4 heads, that is 19.7 million numbers, 79 MB in float32,
# for one layer.
#
# Context parallelism gives each of `N` ranks a slice of `T / N` tokens of everything, the queries, keys and values
# of attention included. A rank's queries still need every key, and the keys are spread over the ranks. Ring
# attention (Liu, Zaharia and Abbeel, 2023) solves this without ever gathering the whole sequence anywhere: the
# ranks form a ring, and in `N` steps every rank's block of keys and values visits every other rank. Each rank
# attends its queries to the block it holds, passes the block on, and folds the partial results together. The
# score block a rank computes at one time is `(T / N) x (T / N)`: `N^2` times smaller.
#
# ## Combining partial attentions: the log-sum-exp rule
#
# Folding partial results together is the trick that FlashAttention uses inside one device, and it is exact. For
# one query and a set of keys, write `lse = log(sum(exp(scores)))` (the log of the softmax's denominator) and
# `out = softmax(scores) @ v`. For two disjoint sets of keys `a` and `b`, the softmax over both sets has the
# denominator `exp(lse_a) + exp(lse_b)`, so
#
# `lse = log(exp(lse_a) + exp(lse_b))`, `out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)`.
#
# Each partial output is rescaled by the share of the total weight its keys carry. `torch.logaddexp` computes `lse`
# without overflow; a query that has seen no key yet has `lse = -inf`, which gives its (empty) partial output the
# weight 0. That is all of `merge`:
# <!-- ja -->
# ## コンテキスト並列: 分割した系列の上のアテンション
#
# Transformer の中でトークンを混ぜる層はアテンションだけです。どのクエリもすべてのキーとのスコア `scores = q @ k.T / sqrt(d)` を計算し、ソフトマックスの重みでバリューを足し合わせます。途中に現れるスコア行列は、`T` トークンの系列 `B` 本のバッチ、`H` 個のヘッドで `B x H x T x T` 個の要素を持ちます。系列長の 2乗で増えるわけです。`T = 784`（1ピクセルが 1トークン）、バッチ 8、ヘッド 4個なら 1970万個、float32 で 79 MB になり、これが層 1つ分です。
#
# コンテキスト並列では、`N` 個のランクのそれぞれが、アテンションのクエリ、キー、バリューも含めてすべてを `T / N` トークンずつ持ちます。ランクのクエリには依然としてすべてのキーが必要ですが、キーはランクに散らばっています。リングアテンション（Liu、Zaharia、Abbeel、2023年）は、系列全体をどこにも集めずにこれを解決します。ランクはリングを作り、`N` ステップの間に、各ランクのキーとバリューのブロックが他のすべてのランクを訪れます。各ランクは手元のブロックに自分のクエリのアテンションを計算し、ブロックを次へ渡し、部分的な結果を合わせていきます。ランクが一度に計算するスコアのブロックは `(T / N) x (T / N)` で、`N^2` 分の 1 の大きさです。
#
# ## 部分的なアテンションの合わせ方: log-sum-exp の規則
#
# 部分的な結果を合わせる方法は、FlashAttention が 1つのデバイスの中で使う工夫と同じで、誤差なく成り立ちます。1つのクエリとキーの集合について、`lse = log(sum(exp(scores)))`（ソフトマックスの分母の対数）と `out = softmax(scores) @ v` を考えます。重ならない 2つのキーの集合 `a` と `b` について、両方の集合にわたるソフトマックスの分母は `exp(lse_a) + exp(lse_b)` です。したがって
#
# `lse = log(exp(lse_a) + exp(lse_b))`、`out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)`
#
# となります。部分的な出力のそれぞれを、そのキーが全体の重みのうちどれだけを占めるかで拡大縮小するわけです。`torch.logaddexp` はオーバーフローせずに `lse` を計算します。まだどのキーも見ていないクエリは `lse = -inf` で、その（空の）部分的な出力の重みは 0 になります。`merge` の中身はこれだけです。

# %%
print(inspect.getsource(merge))

# %% [markdown]
# <!-- en -->
# `block_attention(q, k, v)` returns the pair `(out, lse)` for one block of keys. Attending to two halves of the
# keys and merging gives PyTorch's attention over all of them, in one process:
# <!-- ja -->
# `block_attention(q, k, v)` は、キーのブロック 1つに対する組 `(out, lse)` を返します。キーを半分ずつに分けてアテンションを計算し、`merge` で合わせると、1個のプロセスの中で、すべてのキーに対する PyTorch のアテンションと一致します。

# %%
torch.manual_seed(0)
q, k, v = (torch.randn(2, 4, 12, 16, dtype=torch.float64) for _ in range(3))  # (B, H, T, d)
halves = [block_attention(q, k[:, :, s], v[:, :, s]) for s in (slice(0, 6), slice(6, 12))]
out, lse = merge(*halves[0], *halves[1])
torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=1e-12, atol=1e-12)
print(tr(f"two halves of the keys, merged = attention over all 12 keys; output shape {tuple(out.shape)}",
         f"キーの半分 2つを合わせた結果 = 12個すべてのキーに対するアテンション。出力の形状 {tuple(out.shape)}"))

# %% [markdown]
# <!-- en -->
# ## The ring, forward and backward
#
# `ring_attention(q, k, v)` takes this rank's slice `(B, H, T / N, d)` of the queries, keys and values and returns
# its slice of the output. At step `s` a rank holds the block that started on rank `r - s`. Before it computes with
# that block, it posts the send of the block to rank `r + 1` and the receive of the next one from rank `r - 1`
# (`ring_exchange`, with `dist.batch_isend_irecv`), so the messages can travel while it computes; it waits for them
# only after its own block is merged. After `N - 1` moves, every rank has seen every block.
#
# The backward pass is a second trip around the ring. Every rank keeps only its own slices and the output's `lse`;
# with them it recomputes each block's softmax weights. The gradient of its queries accumulates at home, but the
# gradients of a block's keys and values collect contributions from the queries of every rank: they travel with
# their block, each rank adds its part, and after `N` moves they arrive back on the rank that owns the block. Here
# is the forward pass:
# <!-- ja -->
# ## リングの順伝播と逆伝播
#
# `ring_attention(q, k, v)` は、このランクが持つクエリ、キー、バリューのスライス `(B, H, T / N, d)` を受け取り、出力のうち自分のスライスを返します。ステップ `s` で、ランク `r` はランク `r - s` から出発したブロックを持っています。そのブロックで計算する前に、ブロックをランク `r + 1` へ送る操作と、次のブロックをランク `r - 1` から受け取る操作を発行します（`ring_exchange`。中では `dist.batch_isend_irecv` を使います）。こうすると、計算している間にメッセージが運ばれます。待つのは、自分のブロックを合わせ終えてからです。`N - 1` 回の移動で、どのランクもすべてのブロックを見たことになります。
#
# 逆伝播はリングをもう 1周します。各ランクが保存しているのは自分のスライスと、出力の `lse` だけです。これらから、各ブロックのソフトマックスの重みを計算し直します。クエリの勾配は手元にたまっていきます。一方、ブロックのキーとバリューの勾配には、すべてのランクのクエリからの寄与が集まります。そこで勾配はブロックと一緒に回り、各ランクが自分の寄与を足し、`N` 回の移動でブロックの持ち主のランクに戻ってきます。順伝播は次のとおりです。

# %%
print(inspect.getsource(ra._RingAttention.forward))

# %% [markdown]
# <!-- en -->
# ## Causal attention and the balanced split
#
# A model that predicts the next token must not look ahead: query `i` may see key `j` only when `j <= i`. With the
# sequence cut into contiguous slices, the rank that holds the first slice needs only its own block (its queries
# see no later key), while the last rank needs the blocks of all ranks. The blocks that lie wholly in the future
# are skipped, so the last rank does about `N` times the work of the first, and the others wait for it at every
# step.
#
# The remedy used by Megatron-LM and by PyTorch's `context_parallel` cuts the sequence into `2N` chunks and gives
# rank `r` chunks `r` and `2N - 1 - r`: one early and one late chunk, whose work adds up to the same on every rank.
# `chunks_of` gives the split and `shard_sequence` cuts a rank's part. The figure shows, for 4 ranks, which rank
# computes each block of the causal score matrix (a row of chunks is a query chunk, a column a key chunk):
# <!-- ja -->
# ## 因果的アテンションと負荷を均した分割
#
# 次のトークンを予測するモデルは先を見てはいけません。クエリ `i` がキー `j` を見てよいのは `j <= i` のときだけです。系列を連続したスライスに切ると、最初のスライスを持つランクには自分のブロックしかいりません（そのクエリはどの後ろのキーも見ないからです）。一方、最後のランクにはすべてのランクのブロックが必要です。完全に未来にあるブロックは飛ばすので、最後のランクは最初のランクのおよそ `N` 倍の仕事をし、他のランクはどのステップでもそれを待ちます。
#
# Megatron-LM と PyTorch の `context_parallel` が使う解決策では、系列を `2N` 個のチャンクに切り、ランク `r` にチャンク `r` と `2N - 1 - r` を渡します。前の方のチャンクと後ろの方のチャンクを 1つずつ持つので、仕事の合計がどのランクでも同じになります。分け方は `chunks_of` が決め、ランクの取り分は `shard_sequence` が切り出します。下の図は、ランク 4個のとき、因果的なスコア行列のどのブロックをどのランクが計算するかを示します（チャンクの行がクエリのチャンク、列がキーのチャンクです）。

# %% tags=["nbval-ignore-output"]
def owner_grid(world, split):
    """(2N x 2N) grid: the rank that computes each (query chunk, key chunk) block, NaN for skipped blocks."""
    grid = torch.full((2 * world, 2 * world), float("nan"))
    for rank in range(world):
        chunks, count = chunks_of(rank, world, split)
        per = 2 * world // count  # grid cells per chunk of this split
        for c in chunks:
            for row in range(c * per, (c + 1) * per):
                grid[row, :row + 1] = rank
    return grid


fig, axes = plt.subplots(1, 2, figsize=(8, 3.6))
for ax, split in zip(axes, ("contiguous", "balanced")):
    image = ax.imshow(owner_grid(4, split), cmap="viridis", vmin=0, vmax=3)
    ax.set(title=tr(f"{split} split", "連続した分割" if split == "contiguous" else "負荷を均した分割"),
           xlabel=tr("key chunk", "キーのチャンク"), ylabel=tr("query chunk", "クエリのチャンク"))
fig.colorbar(image, ax=axes, label=tr("rank", "ランク"), ticks=range(4))
plt.show()

# %% [markdown]
# <!-- en -->
# ## Ring attention on 2 and 4 processes
#
# The worker below checks the ring against one process. Every rank builds the same whole `q`, `k`, `v` from one
# seed, computes PyTorch's `F.scaled_dot_product_attention` of the whole sequence as the reference, then its own
# part with `ring_attention`; outputs and gradients are gathered from the ranks and put back in sequence order
# (`unshard_sequence`). This runs in float64, so the only differences are rounding. It also runs PyTorch's own
# context parallelism, `context_parallel` from `torch.distributed.tensor.experimental`, which shards the buffers
# it is given in place and replaces SDPA inside its `with` block. Its ring is written for the GPU's attention
# kernels (flash, memory-efficient, cuDNN), and by default it does not pass the keys and values from rank to rank
# at all: it all-gathers them (`set_rotate_method("alltoall")` switches to a ring of exchanges). None of those
# kernels runs on the CPU, so there the worker asks SDPA for its plain formula (`SDPBackend.MATH`), whose matrix
# products DTensor computes on the shards by all-gathering the keys and the values: the two collectives that
# `CommDebugMode` counts below. On the CPU, then, torch's result checks our output, but it is not a second ring;
# and causal attention does not run that way at all (the causal mask is a plain tensor that cannot be added to the
# sharded scores), one more reason to build the ring ourselves. The same launch measures memory, the time of the
# ring's steps and the balance of the causal splits, which the next sections read.
# <!-- ja -->
# ## 2個と 4個のプロセスでのリングアテンション
#
# 次のワーカーは、リングを 1個のプロセスと比べます。どのランクも同じシードから同じ `q`、`k`、`v` の全体を作り、系列全体に対する PyTorch の `F.scaled_dot_product_attention` を基準として計算します。次に `ring_attention` で自分の部分を計算します。出力と勾配を各ランクから集め、系列の順に並べ直して（`unshard_sequence`）比べます。float64 で計算するので、違いは丸め誤差だけです。さらに、PyTorch 自身のコンテキスト並列である `torch.distributed.tensor.experimental` の `context_parallel` も動かします。これは渡したバッファをその場でシャーディングし、`with` ブロックの中で SDPA を置き換えます。そのリングは GPU のアテンションのカーネル（flash、memory-efficient、cuDNN）のために書かれています。しかも既定では、キーとバリューをランクからランクへ回さず、オールギャザーで集めます（`set_rotate_method("alltoall")` にすると、交換を繰り返すリングになります）。これらのカーネルはどれも CPU では動かないので、CPU ではワーカーが SDPA に定義どおりの計算（`SDPBackend.MATH`）を使わせます。その行列積を DTensor がシャードの上で計算し、そのためにキーとバリューをオールギャザーで集めます。下で `CommDebugMode` が数える 2回の集合通信がこれです。つまり CPU では、PyTorch の結果は私たちの出力の検査にはなりますが、2つ目のリングではありません。また、因果的アテンションはこの方法では動きません（因果マスクはふつうのテンソルなので、シャーディングされたスコアに足せません）。これも、リングを自分で組み立てる理由の 1つです。同じ起動で、メモリ、リングの各ステップの時間、因果的な分割の負荷の釣り合いも測ります。これらは後の節で読みます。

# %%
# %%worker cp_workers
import torch
import torch.distributed as dist
from torch.nn import functional as F

from mparlib import ring_attention as ra
from mparlib.rendezvous import device
from mparlib.sequence_parallel import collective_counts

CASES = [(False, "contiguous"), (True, "contiguous"), (True, "balanced")]


def gather_sequence(x, split):
    """Every rank's part of a sequence (dim 2), put back in order, on every rank."""
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, x.contiguous())
    return ra.unshard_sequence(pieces, split)


def check_ring(shape=(2, 4, 32, 16)):
    """Largest difference of output and q/k/v gradients, ring vs one-process SDPA, for each case (float64)."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    torch.manual_seed(0)
    q, k, v, w = (torch.randn(*shape, dtype=torch.float64, device=dev) for _ in range(4))
    diffs = {}
    for causal, split in CASES:
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        reference = F.scaled_dot_product_attention(*whole, is_causal=causal)
        (reference * w).sum().backward()  # w: random weights, so that every output element has its own gradient
        mine = [ra.shard_sequence(t, rank, world, split).requires_grad_() for t in (q, k, v)]
        out = ra.ring_attention(*mine, causal=causal, split=split)
        (out * ra.shard_sequence(w, rank, world, split)).sum().backward()
        got = [gather_sequence(out.detach(), split)] + [gather_sequence(t.grad, split) for t in mine]
        want = [reference.detach()] + [t.grad for t in whole]
        diffs[("causal " if causal else "full ") + split] = max((a - b).abs().max().item() for a, b in zip(got, want))
    return diffs


def check_context_parallel(shape=(2, 4, 32, 16)):
    """Ring attention vs torch's context_parallel (non-causal, float32): largest difference, collectives torch ran."""
    from contextlib import nullcontext

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rank, world, dev = dist.get_rank(), dist.get_world_size(), device()
    torch.manual_seed(0)
    q, k, v = (torch.randn(*shape, device=dev) for _ in range(3))
    mesh = init_device_mesh(dev.type, (world,))
    buffers = [q.clone(), k.clone(), v.clone()]
    kernel = sdpa_kernel(SDPBackend.MATH) if dev.type == "cpu" else nullcontext()  # torch's ring has no CPU kernel
    comm = CommDebugMode()
    with comm, kernel, context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):  # buffers: shards now
        theirs = F.scaled_dot_product_attention(*buffers)
    theirs = context_parallel_unshard(mesh, [theirs], [2])[0]
    ours = gather_sequence(ra.ring_attention(*(ra.shard_sequence(t, rank, world) for t in (q, k, v))), "contiguous")
    return {"diff": (ours - theirs).abs().max().item(), "collectives": collective_counts(comm)}


def context_parallel_report(lengths, timing, overlap=True):
    """The checks, then memory per rank, the ring's step times (if overlap) and the causal balance."""
    torch.backends.cuda.matmul.allow_tf32 = False  # full float32 on GPUs, as on the CPU
    report = {"device": device().type, "diffs": check_ring(), "context_parallel": check_context_parallel(),
              "memory": ra.measure_memory(lengths, device=device()),
              "balance": ra.measure_balance(**timing, device=device())}
    if overlap:
        report["overlap"] = ra.measure_overlap(**timing, device=device())
    return report

# %%
from cp_workers import context_parallel_report

LENGTHS = (16, 196, 784)  # tokens of 7x7, 2x2 and 1x1 patches; 49 (4x4 patches) does not split into 2 or 4 slices
TIMING = dict(length=784, batch=8, heads=4, dim=16, min_repeats=5 if PROFILE == "smoke" else 20)
cp_reports = {n: launch(context_parallel_report, n, args=(LENGTHS, TIMING), kwargs={"overlap": n == 2}, timeout=300)
              for n in (2, 4)}
CASE_NAMES = {"full contiguous": ("non-causal, contiguous", "非因果的・連続した分割"),
              "causal contiguous": ("causal, contiguous", "因果的・連続した分割"),
              "causal balanced": ("causal, balanced", "因果的・負荷を均した分割")}  # the workers' keys, as printed
print(tr("cases checked:", "検査した場合:"), join(CASE_NAMES[case] for case in cp_reports[2]["diffs"]))

# %% tags=["nbval-ignore-output"]
print(table([[f"n={n}", case, f"{d:.1e}"] for n, report in cp_reports.items()
             for case, d in ((CASE_NAMES[c], d) for c, d in report["diffs"].items())],
            ["", ("case", "場合"), ("largest difference to one process", "1個のプロセスとの最大の差")]))
for n, report in cp_reports.items():
    print(f"n={n}: " + tr(f"context_parallel differs by {report['context_parallel']['diff']:.1e} and ran ",
                          f"context_parallel との差 {report['context_parallel']['diff']:.1e}。PyTorch が使った集合通信 ")
          + str(report["context_parallel"]["collectives"]))

# %%
for n, report in cp_reports.items():
    assert all(d < 1e-10 for d in report["diffs"].values()), (n, report["diffs"])
    assert report["context_parallel"]["diff"] < 1e-5, (n, report["context_parallel"])  # float32, another order
    if report["device"] == "cpu":  # DTensor computes SDPA's formula on the shards by gathering the keys and the values
        assert report["context_parallel"]["collectives"] == {"all_gather": 2, "reduce_scatter": 0, "all_reduce": 0}, \
            report["context_parallel"]
print(tr("ring attention on 2 and 4 processes = one-process attention: output and the gradients of q, k and v, "
         "non-causal and causal with both splits (float64, tolerance 1e-10); non-causal = context_parallel "
         "(float32, tolerance 1e-5)",
         "2個と 4個のプロセスのリングアテンションは 1個のプロセスのアテンションと一致: 出力と q、k、v の勾配。"
         "非因果的、および 2つの分け方での因果的（float64、許容誤差 1e-10）。非因果的な場合は context_parallel とも一致"
         "（float32、許容誤差 1e-5）"))

# %% [markdown]
# <!-- en -->
# ## Memory per rank
#
# What does a rank hold for attention? We count two things, both deterministic. First, the bytes autograd keeps for
# the backward pass, counted by `SavedBytes`, a `torch.autograd.graph.saved_tensors_hooks` context that adds up
# every saved tensor's storage once: for the ring, this rank's `q`, `k`, `v`, output and `lse`. Second, the largest
# score block that exists at one time in the forward pass, `B x H x (T / N)^2` numbers for the non-causal ring
# (`stats["largest_block"]`). Their sum is what `measure_memory` reports as the activation bytes; the arriving
# key/value block, `2 x B x H x (T / N) x d` numbers, is small beside it and not counted. The one-process row is the
# same code on one process (`ring_attention` outside a process group computes the whole sequence as a single
# block). For comparison, PyTorch's attention in one process, measured the same way: its `math` backend keeps the
# whole softmax matrix for the backward pass, while its fused CPU kernel keeps only `q`, `k`, `v`, output and `lse`
# and computes the scores in tiles it never stores, the same idea as the ring inside one device.
# <!-- ja -->
# ## ランクあたりのメモリ
#
# アテンションのためにランクは何を持つのでしょうか。どちらも決定的な 2つの量を数えます。1つめは、autograd が逆伝播のために保存するバイト数です。`SavedBytes` が数えます。これは `torch.autograd.graph.saved_tensors_hooks` を使うコンテキストで、保存されたテンソルのストレージを 1回ずつ足し合わせます。リングでは、このランクの `q`、`k`、`v`、出力、`lse` です。2つめは、順伝播の間に一度に存在するスコアのブロックのうち最大のものです。非因果的なリングでは `B x H x (T / N)^2` 個の数です（`stats["largest_block"]`）。この 2つの和を、`measure_memory` は活性化のバイト数として報告します。届いてくるキーとバリューのブロック（`2 x B x H x (T / N) x d` 個の数）は、これに比べて小さいので数えません。1個のプロセスの行は、同じコードを 1個のプロセスで動かしたものです（`ring_attention` はプロセスグループの外では系列全体を 1つのブロックとして計算します）。比較のために、1個のプロセスでの PyTorch のアテンションも同じ方法で測ります。`math` バックエンドはソフトマックスの行列全体を逆伝播のために保存します。CPU の融合カーネルは `q`、`k`、`v`、出力、`lse` だけを保存し、スコアは保存しないタイルに分けて計算します。これは、リングと同じ考え方を 1つのデバイスの中で使ったものです。

# %%
from torch.nn.attention import SDPBackend, sdpa_kernel

one = measure_memory(LENGTHS)[0]  # this process alone: N = 1
sdpa = {}
for length in LENGTHS:
    x = [torch.randn(8, 4, length, 16, requires_grad=True) for _ in range(3)]
    for name, backend in (("math", SDPBackend.MATH), ("fused", SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel(backend), SavedBytes() as saved:
            F.scaled_dot_product_attention(*x)
        sdpa.setdefault(name, {})[length] = saved.bytes
memory = {1: one, **{n: max(r["memory"], key=lambda m: m[LENGTHS[-1]]["activation_bytes"])
                     for n, r in cp_reports.items()}}  # the largest rank
print(table([[(f"ring, N={n}, per rank", f"リング、N={n}、ランクあたり")]
              + [f"{rows[t]['activation_bytes'] / 2**20:.2f} MiB" for t in LENGTHS] for n, rows in memory.items()]
            + [[(f"SDPA {name}, 1 process, saved only", f"SDPA {name}、プロセス 1個、保存分のみ")]
               + [f"{rows[t] / 2**20:.2f} MiB" for t in LENGTHS] for name, rows in sdpa.items()],
            [""] + [f"T={t}" for t in LENGTHS]))

# %%
longest = LENGTHS[-1]
for n in (2, 4):
    ratio = memory[n][longest]["activation_bytes"] / (one[longest]["activation_bytes"] / n)
    assert ratio <= 1.15, (n, ratio)
    for r in cp_reports[n]["memory"]:
        assert r[longest]["saved_bytes"] * n == one[longest]["saved_bytes"]  # q, k, v, out, lse: exactly 1/N
        assert r[longest]["score_block_bytes"] * n * n == one[longest]["score_block_bytes"]  # the block: 1/N^2
assert sdpa["math"][longest] > one[longest]["score_block_bytes"]  # the math backend keeps the T x T weights
print(tr(f"at T={longest}: activation bytes per rank / (one process / N) = "
         f"{memory[2][longest]['activation_bytes'] / (one[longest]['activation_bytes'] / 2):.2f} (N=2), "
         f"{memory[4][longest]['activation_bytes'] / (one[longest]['activation_bytes'] / 4):.2f} (N=4); goal <= 1.15",
         f"T={longest} で、ランクあたりの活性化のバイト数 /（1個のプロセスの値 / N）= "
         f"{memory[2][longest]['activation_bytes'] / (one[longest]['activation_bytes'] / 2):.2f}（N=2）、"
         f"{memory[4][longest]['activation_bytes'] / (one[longest]['activation_bytes'] / 4):.2f}（N=4）。目標は 1.15 以下"))

# %% [markdown]
# <!-- en -->
# The saved tensors shrink exactly by `N`, and the score block by `N^2`, so the activation bytes per rank fall
# *faster* than `1/N` at long sequences, where the score block dominates. (The ring does not beat the fused kernel
# at its own game: a tiled kernel inside each rank, as FlashAttention does on GPUs, would shrink the score block
# further. The two ideas compose: ring attention between devices, tiles inside each.)
#
# ## Time per ring step and overlap
#
# Does the sending hide behind the computing? `measure_overlap` times the forward pass at `T = 784` three ways, each
# the median of the slowest rank's times, divided by the `N` steps of the ring: the blocks' compute and merges
# alone, the key/value moves alone, and the ring itself. If the messages were perfectly hidden, the ring would take
# as long as the compute alone; `hidden` is the share of the communication time that the ring did not add
# (`1 - max(0, ring - compute) / communication`, between 0 and 1). The timing follows chapter 8's rules with
# `mparlib.timing.measure_each`, which times several functions in turn, round by round, so that a change in the
# machine's load falls on all of them alike: a warm-up round, then at least 5 rounds and 50 ms of them in all, a
# barrier before each call and the slowest rank's time for each.
# <!-- ja -->
# 保存されるテンソルはちょうど `N` 分の 1 に、スコアのブロックは `N^2` 分の 1 になります。そのため、スコアのブロックが大半を占める長い系列では、ランクあたりの活性化のバイト数は `1/N` より**速く**減ります（融合カーネルの得意なことでリングが勝つわけではありません。GPU の FlashAttention のように各ランクの中でもタイルに分けるカーネルを使えば、スコアのブロックはさらに小さくなります。2つの考え方は組み合わせられます。デバイスの間ではリングアテンション、各デバイスの中ではタイルです）。
#
# ## リングの 1ステップの時間と重なり
#
# 送信は計算の陰に隠れるのでしょうか。`measure_overlap` は `T = 784` の順伝播の時間を 3通りに測ります。どれも、いちばん遅いランクの時間の中央値を、リングの `N` ステップで割ったものです。ブロックの計算と合わせ込みだけ、キーとバリューの移動だけ、そしてリングそのものです。メッセージが完全に隠れるなら、リングの時間は計算だけの時間と同じになります。`hidden` は、通信の時間のうちリングが上乗せしなかった割合です（`1 - max(0, ring - compute) / communication`。0 から 1 の間の値です）。計測は 8章と同じ規則に従い、`mparlib.timing.measure_each` を使います。これは複数の関数を 1回ずつ順番に測ることを繰り返すので、マシンの負荷の変化が 3つに同じように効きます。ウォームアップを 1巡したあと、5巡以上、全体で 50 ms 以上になるまで巡回し、各呼び出しの前にバリアで待ち合わせ、いちばん遅いランクの時間をとります。

# %% tags=["nbval-ignore-output"]
overlap = cp_reports[2]["overlap"]
print(table([[label, f"{overlap['ms_per_step'][name][0]:.2f}",
              f"{overlap['ms_per_step'][name][1]:.2f}-{overlap['ms_per_step'][name][2]:.2f}"]
             for name, label in (("compute", ("compute alone", "計算だけ")),
                                 ("communication", ("send/recv alone", "送受信だけ")),
                                 ("ring", ("ring (both)", "リング（両方）")))],
            ["", ("ms per step", "ステップあたり ms"), ("min-max ms", "最小-最大 ms")]))
load, busy = overlap["load"], overlap["load"]["busy"]
print(tr(f"{overlap['repeats']} rounds; load average (1 min) {load['before']:.2f} before, {load['after']:.2f} after: "
         + ("busy (above 0.3 per core)" if busy else "not busy"),
         f"{overlap['repeats']}巡。ロードアベレージ（1分）: 計測前 {load['before']:.2f}、計測後 {load['after']:.2f}。"
         + ("混んでいます（コアあたり 0.3 超）" if busy else "空いています")))
print(tr(f"block of keys and values per step: {overlap['bytes_per_step'] / 2**20:.2f} MiB; the ring adds "
         f"{overlap['exposed_ms']:.2f} ms per step to the compute; hidden share of the communication: "
         f"{overlap['hidden']:.0%}",
         f"1ステップで送るキーとバリューのブロック: {overlap['bytes_per_step'] / 2**20:.2f} MiB。リングが計算に上乗せした"
         f"時間: 1ステップあたり {overlap['exposed_ms']:.2f} ms。通信のうち隠れた割合: {overlap['hidden']:.0%}"))

# %%
assert overlap["ranks"] == 2 and overlap["seq_len"] == 784
assert overlap["bytes_per_step"] == 2 * 8 * 4 * 392 * 16 * 4  # k and v: B x H x T/N x d float32 numbers each
assert all(low <= median <= high and median > 0 for median, low, high in overlap["ms_per_step"].values())
assert overlap["repeats"] >= TIMING["min_repeats"] and 0 <= overlap["hidden"] <= 1

# %% [markdown]
# <!-- en -->
# On two processes on one machine the blocks travel through memory over loopback, and a 1.5 MiB block takes a
# fraction of the time its attention takes to compute, so there is little to hide. When several processes share
# few cores, the times are noisy (see the spread in brackets), and the ring can even take longer than compute plus
# communication measured apart: gloo's sending thread then competes with the computing thread for the same cores. On GPUs the roles change: the compute of a block is fast, the link is the limit, and overlapping the two is
# what keeps ring attention efficient. The condition is that a block's compute, `~4 B H (T/N)^2 d` floating-point
# operations, takes longer than sending its `2 B H (T/N) d` numbers: the ratio grows with `T / N`, so the longer
# the slice, the easier it is to hide the ring.
#
# ## The causal balance, measured
#
# `measure_balance` runs, on each rank, only the blocks that the causal mask leaves for it, without messages, and
# times them with `measure` (the median per rank, and in brackets the fastest and slowest call); it also counts the
# score elements the rank computes, a proxy for its work that does not depend on the machine.
# <!-- ja -->
# 1台のマシンの 2個のプロセスでは、ブロックはループバックを通ってメモリの中を運ばれます。1.5 MiB のブロックを送る時間は、そのアテンションの計算時間のごく一部なので、隠すものがほとんどありません。少ないコアを複数のプロセスで分け合うと、時間はばらつきます（括弧の中の幅を見てください）。リングの時間が、別々に測った計算と通信の時間の和より長くなることさえあります。そのときは gloo の送信スレッドが計算のスレッドと同じコアを取り合っています。GPU では役割が入れ替わります。ブロックの計算は速く、リンクが律速になるので、2つを重ねることがリングアテンションの効率を保つ鍵になります。条件は、ブロックの計算（約 `4 B H (T/N)^2 d` 回の浮動小数点演算）が、その `2 B H (T/N) d` 個の数を送る時間より長いことです。この比は `T / N` とともに大きくなります。スライスが長いほど、リングは隠しやすくなります。
#
# ## 因果的な負荷の釣り合いの測定
#
# `measure_balance` は、因果マスクが各ランクに残すブロックだけを、通信なしで計算して `measure` で時間を測ります（ランクごとの中央値と、括弧の中に最も速い呼び出しと最も遅い呼び出しの時間を示します）。あわせて、ランクが計算するスコアの要素の数も数えます。これはマシンによらない仕事量の目安です。

# %% tags=["nbval-ignore-output"]
rows = []
for n, report in cp_reports.items():
    for split, ranks in report["balance"].items():
        ms = [r["ms"] for r in ranks]
        busy = tr(" (busy)", "（混んだマシン）") if any(r["busy"] for r in ranks) else ""
        rows.append([f"n={n}", SPLITS[split], f"{max(ms) / (sum(ms) / len(ms)):.2f}{busy}"]
                    + [f"{r['ms']:.1f} ({r['ms_min_max'][0]:.1f}-{r['ms_min_max'][1]:.1f})" for r in ranks])
print(table(rows, ["", "", ("slowest / mean", "最も遅いランク / 平均")]
            + [(f"rank {r} ms", f"ランク {r} の ms") for r in range(max(len(row) - 3 for row in rows))]))

# %%
for n, report in cp_reports.items():
    naive = [r["score_elements"] for r in report["balance"]["contiguous"]]
    balanced = [r["score_elements"] for r in report["balance"]["balanced"]]
    assert len(set(balanced)) == 1, (n, balanced)  # every rank computes the same number of scores
    assert naive == sorted(naive) and naive[-1] == n * naive[0], (n, naive)  # rank r: r + 1 blocks
    print(tr(f"n={n}: score elements per rank, contiguous {naive}, balanced {balanced}",
             f"n={n}: ランクごとのスコアの要素数。連続した分割 {naive}、負荷を均した分割 {balanced}"))

# %% [markdown]
# <!-- en -->
# The element counts are exact: with the contiguous split rank `r` computes `r + 1` blocks (the last one half
# masked), so the last rank does `N` times the first one's work; with the balanced split every rank computes the
# same number. The counts are a proxy, not a clock: a diagonal block costs more per element than a full one (it
# also builds and applies the mask), and on a machine whose cores are shared by more processes than it has, or busy
# with other work, the times are noisy enough to hide even a factor of two. That is why the chapter asserts the
# counts and only prints the times; `benchmarks/long_context.py` records them with the machine's load beside them.
# (The balanced split also computes fewer elements in total: its diagonal blocks are half the size, so less work is
# wasted on masked entries.)
#
# ## Training a Vision Transformer with context parallelism
#
# Now the whole model. The ViT of `mparlib.vit` with 2 x 2 patches reads an image as 196 tokens. With context
# parallelism on 2 ranks, each rank holds 98 of them from the patch embedding on, and every layer except attention
# works on its tokens alone:
#
# - `model.tokens(images)` embeds the patches and adds the position embedding; each rank keeps its slice with
#   `shard_sequence(..., dim=1)`.
# - Every block's attention calls `ring_attention` instead of `F.scaled_dot_product_attention`: `Attention.attend`
#   is the function it uses.
# - The classifier reads the mean token. Each rank sums its tokens, and an all-reduce adds the sums. Its backward
#   pass must be an all-reduce too: every rank computes the same loss from the same mean, and each rank's tokens
#   need the gradient from all of them.
# - Every rank then holds a gradient for every parameter, computed from its own tokens; the gradients are averaged
#   over the ranks, as in data parallelism.
#
# Both ranks read the same images; what is split is each image's sequence. The worker checks nothing itself: the
# parity with one process is checked in this notebook from the first losses, and the learning from the curve and
# the test accuracy.
# <!-- ja -->
# 要素の数は正確です。連続した分割では、ランク `r` は `r + 1` 個のブロックを計算します（最後の 1つは半分がマスクされています）。そのため最後のランクは最初のランクの `N` 倍の仕事をします。負荷を均した分割では、どのランクも同じ数を計算します。要素の数は仕事量の目安であって、時計ではありません。対角のブロックは、マスクを作って適用する分だけ、要素 1つあたりの費用が完全なブロックより高くなります。また、コアの数より多いプロセスがコアを分け合うマシンや、他の仕事で忙しいマシンでは、時間のばらつきが 2倍の差さえ隠してしまいます。そのためこの章では、要素の数を検査し、時間は表示するだけにしています。`benchmarks/long_context.py` は、時間をマシンの負荷と一緒に記録します（負荷を均した分割は、計算する要素の合計も少なくなります。対角のブロックが半分の大きさなので、マスクされる要素に費やす無駄な計算が減るからです）。
#
# ## コンテキスト並列での Vision Transformer の訓練
#
# 次はモデル全体です。`mparlib.vit` の ViT は、2 x 2 のパッチで画像を 196トークンとして読みます。ランク 2個のコンテキスト並列では、パッチ埋め込みから後、各ランクがそのうち 98トークンを持ち、アテンション以外のどの層も自分のトークンだけで計算します。
#
# - `model.tokens(images)` はパッチを埋め込み、位置の埋め込みを足します。各ランクは `shard_sequence(..., dim=1)` で自分のスライスを残します。
# - どのブロックのアテンションも、`F.scaled_dot_product_attention` の代わりに `ring_attention` を呼びます。`Attention.attend` が、ブロックの使う関数です。
# - 分類器は平均のトークンを読みます。各ランクが自分のトークンを足し、オールリデュース（all-reduce）で和を合わせます。その逆伝播もオールリデュースでなければなりません。どのランクも同じ平均から同じ損失を計算し、各ランクのトークンには、すべてのランクからの勾配が必要だからです。
# - その後、どのランクも、自分のトークンから計算したすべてのパラメータの勾配を持っています。データ並列と同じように、勾配をランクの間で平均します。
#
# 2つのランクは同じ画像を読みます。分けるのは各画像の系列です。ワーカー自身は何も検査しません。1個のプロセスとの一致は最初の損失からこのノートブックで検査し、学習できたかどうかは曲線とテスト精度で確かめます。

# %%
# %%worker cp_training
import torch
import torch.distributed as dist
from torch.nn import functional as F

from mparlib.lang import tr
from mparlib.plot import Animator
from mparlib.rendezvous import device
from mparlib.ring_attention import ring_attention, shard_sequence
from mparlib.vit import vit


class SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward, and all-reduce of the gradient backward: every rank's loss reads the sum."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad


def make_model(config, ring=True, seed=0):
    """The ViT of ``config`` (fields of mparlib.vit), the same on every rank; its attention is ring attention."""
    torch.manual_seed(seed)
    model = vit("smoke", **config)
    if ring:
        for block in model.blocks:
            block.attn.attend = ring_attention  # (B, H, T/N, d) slices in, this rank's slice out
    return model


def cp_forward(model, images):
    """Logits of the ViT with this rank's slice of the tokens; the mean token comes from all ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = shard_sequence(model.tokens(images), rank, world, dim=1)  # (B, T, dim) -> (B, T / N, dim)
    for block in model.blocks:
        x = block(x)
    mean = SumOverRanks.apply(model.norm(x).sum(dim=1)) / model.pos.shape[1]  # (B, dim): the mean of all T tokens
    return model.head(mean)


def average_gradients(model):
    """Average every parameter's gradient over the ranks, in one all-reduce of a flat vector."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads]) / dist.get_world_size()
    dist.all_reduce(flat)
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


def batch_rows(n, batch, steps, seed=0):
    """The rows of every step's batch: the same on every rank and in the one-process reference."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(n, (batch,), generator=generator) for _ in range(steps)]


def accuracy(model, forward, images, labels, batch=250):
    with torch.no_grad():
        right = sum((forward(model, images[i:i + batch]).argmax(1) == labels[i:i + batch]).sum().item()
                    for i in range(0, len(images), batch))
    return right / len(images)


def train_cp(data, config, steps, batch, lr, plot=None):
    """AdamW on Fashion-MNIST with context parallelism; the loss of every step and the test accuracy."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # full float32 on GPUs
    dev = device()
    images, labels, test_images, test_labels = (t.to(dev) for t in data)
    model = make_model(config).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    show = dist.get_rank() == 0 and plot is not None
    animator = Animator(xlabel=tr("step", "ステップ"), legend=[tr("training loss", "訓練損失")], xlim=[1, steps],
                        path=plot, display=False, echo=False) if show else None
    losses = []
    for rows in batch_rows(len(images), batch, steps):
        loss = F.cross_entropy(cp_forward(model, images[rows]), labels[rows])
        optimizer.zero_grad()
        loss.backward()
        average_gradients(model)
        optimizer.step()
        losses.append(loss.item())
        if animator is not None and len(losses) % 10 == 0:
            animator.add(len(losses), sum(losses[-10:]) / 10)
    return {"losses": losses, "accuracy": accuracy(model, cp_forward, test_images, test_labels),
            "tokens_per_rank": model.pos.shape[1] // dist.get_world_size()}

# %% [markdown]
# <!-- en -->
# The model is a narrower ViT than chapter 9's, so that the 196-token run stays short on a CPU: width 32, 2 blocks
# of 2 heads. The curve below is drawn by rank 0 while the processes train.
# <!-- ja -->
# CPU でも 196トークンの実行が短く済むように、モデルは 9章より細い ViT にします。幅 32、ヘッド 2個のブロックが 2つです。下の曲線は、プロセスが訓練している間にランク 0 が描きます。

# %% tags=["nbval-ignore-output"]
import tempfile
from pathlib import Path

from cp_training import batch_rows, cp_forward, make_model, train_cp

CP_VIT = dict(patch=2, dim=32, depth=2, heads=2, hidden=64)  # 196 tokens
TRAIN = (dict(images=2000, tests=500, steps=80, batch=64, lr=4e-3) if PROFILE == "smoke"
         else dict(images=20000, tests=2000, steps=800, batch=64, lr=2e-3))
X, y = load_split_tensors("train", TRAIN["images"])
X_test, y_test = load_split_tensors("test", TRAIN["tests"])
data = (to_float(X), y, to_float(X_test), y_test)
plot_dir = tempfile.TemporaryDirectory(prefix="mparlib-cp-")
cp_run = launch(train_cp, 2, args=(data, CP_VIT, TRAIN["steps"], TRAIN["batch"], TRAIN["lr"]),
                kwargs={"plot": str(Path(plot_dir.name) / "curve.png")}, show=Path(plot_dir.name) / "curve.png",
                timeout=600)
print(tr(f"tokens per image {(28 // CP_VIT['patch']) ** 2}, per rank {cp_run['tokens_per_rank']}; "
         f"test accuracy after {TRAIN['steps']} steps: {cp_run['accuracy']:.1%}",
         f"画像あたりのトークン {(28 // CP_VIT['patch']) ** 2}個、ランクあたり {cp_run['tokens_per_rank']}個。"
         f"{TRAIN['steps']}ステップ後のテスト精度: {cp_run['accuracy']:.1%}"))

# %% [markdown]
# <!-- en -->
# The reference: the same model in this process, with PyTorch's attention over all 196 tokens and the plain mean,
# trained on the same batches for the first steps.
# <!-- ja -->
# 基準は、このプロセスの同じモデルです。196トークンすべてに PyTorch のアテンションを使い、ふつうの平均を取って、同じバッチで最初の数ステップを訓練します。

# %%
PARITY = 5  # steps compared


def one_process_losses(steps=PARITY):
    model = make_model(CP_VIT, ring=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN["lr"])
    losses = []
    for rows in batch_rows(len(data[0]), TRAIN["batch"], steps):
        loss = F.cross_entropy(model(data[0][rows]), data[1][rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


ref_losses = one_process_losses()

# %% tags=["nbval-ignore-output"]
print(tr("one process:", "1個のプロセス:"), [f"{v:.6f}" for v in ref_losses])
print(tr("2 ranks, ring:", "ランク 2個、リング:"), [f"{v:.6f}" for v in cp_run["losses"][:PARITY]])
curve = cp_run["losses"]
print(tr(f"mean loss of the first 20 steps {sum(curve[:20]) / 20:.3f}, of the last 20 {sum(curve[-20:]) / 20:.3f}",
         f"最初の 20ステップの平均損失 {sum(curve[:20]) / 20:.3f}、最後の 20ステップ {sum(curve[-20:]) / 20:.3f}"))
print(tr(f"whole chapter so far: {time.perf_counter() - CHAPTER_START:.0f} s",
         f"ここまでの章全体: {time.perf_counter() - CHAPTER_START:.0f}秒"))

# %%
torch.testing.assert_close(torch.tensor(cp_run["losses"][:PARITY]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
assert sum(curve[-20:]) / 20 < 0.75 * sum(curve[:20]) / 20, "the loss falls"
assert cp_run["accuracy"] > 0.35, cp_run["accuracy"]  # chance is 10%
print(tr(f"context parallelism on 2 ranks = one process for the first {PARITY} steps (float32, tolerance 1e-5); "
         "the loss falls by more than a quarter and the test accuracy is above 35% (chance: 10%)",
         f"ランク 2個のコンテキスト並列は最初の {PARITY}ステップで 1個のプロセスと一致（float32、許容誤差 1e-5）。"
         "損失は 4分の 1 より多く下がり、テスト精度は 35% を超える（偶然なら 10%）"))

# %% [markdown]
# <!-- en -->
# A causal model of the same size (ImageGPT-style: predict each pixel from the ones before it, 784 tokens) would
# use `ring_attention(..., causal=True, split="balanced")` in the same places; the loss would then be computed on
# each rank's own tokens and summed, with no all-reduce of a mean token. This chapter does not train one: the
# ring, the balanced split and their gradients are checked above, and the rest of the training loop is unchanged.
# <!-- ja -->
# 同じ大きさの因果的なモデル（ImageGPT のように、前のピクセルから各ピクセルを予測するモデル。784トークン）なら、同じ場所で `ring_attention(..., causal=True, split="balanced")` を使います。そのとき損失は各ランクが自分のトークンについて計算して足し合わせるので、平均のトークンのオールリデュースはいりません。この章ではそのモデルは訓練しません。リング、負荷を均した分割、その勾配は上で検査しており、訓練ループの残りは変わりません。

# %% [markdown]
# <!-- en -->
# ## Expert parallelism: many MLPs, each token sent to a few
#
# A **mixture of experts** (MoE) replaces the MLP of a block by `E` smaller MLPs, the **experts**, and a
# **router**, one linear layer that scores every token against every expert (Shazeer et al. 2017; GShard, Lepikhin
# et al. 2020; Switch Transformer, Fedus et al. 2021). Each token goes to its `k` best experts and their outputs
# are mixed with the router's softmax probabilities, the **gates**. The model holds `E` times the MLP's parameters,
# yet each token pays for `k` of them: parameters grow without the computation per token.
#
# Two details make it trainable on real hardware.
#
# - **Capacity.** Every expert accepts at most `capacity = ceil(capacity_factor x tokens x k / E)` tokens of a
#   group, so that the shapes are fixed. Tokens past the capacity are **dropped**: the expert layer adds nothing
#   for them, and the residual connection carries them on unchanged.
# - **The auxiliary load-balancing loss.** A router left alone tends to send most tokens to a few experts, which
#   then drop them. The Switch Transformer (eq. 4) adds `E x sum_i f_i P_i` to the loss, where `f_i` is the share
#   of tokens whose first choice is expert `i` and `P_i` the router's mean probability for `i`. It is 1 when the
#   load is even and grows to `E` when everything goes to one expert; only `P_i` carries a gradient.
#
# `mparlib.experts.route` does the routing of one group (top-`k` gates, capacity, drops, the loss) and returns a
# `Routing`, the kept assignments sorted by expert; `MoE` is
# the layer in one process. A case small enough to check by hand: 4 experts, a router that is 10 times the
# identity, so that a token with a 1 in feature `e` goes to expert `e`; 5 tokens for expert 0 and 3 for expert 1.
# With capacity factor 1.0 each expert takes `ceil(1.0 x 8 x 1 / 4) = 2` tokens:
# <!-- ja -->
# ## エキスパート並列: 多数の MLP と、トークンごとの送り先
#
# **MoE（Mixture of Experts）**、混合エキスパートは、ブロックの MLP を `E` 個の小さな MLP（**エキスパート**）と **ルーター**に置き換えます。ルーターは 1つの線形層で、すべてのトークンをすべてのエキスパートに対して採点します（Shazeer ら 2017年、GShard: Lepikhin ら 2020年、Switch Transformer: Fedus ら 2021年）。各トークンは点数の高い `k` 個のエキスパートに送られ、その出力をルーターの softmax の確率（**ゲート**）で混ぜ合わせます。モデルは MLP の `E` 倍のパラメータを持ちますが、トークン 1つが払う計算は `k` 個分です。トークンあたりの計算を増やさずにパラメータを増やせます。
#
# 実際のハードウェアで訓練できるようにするための工夫が 2つあります。
#
# - **容量**。形状を固定するため、各エキスパートはグループのトークンを最大 `capacity = ceil(capacity_factor x tokens x k / E)` 個までしか受け付けません。容量を超えたトークンは**ドロップ**されます。エキスパートの層はそのトークンに何も足さず、残差接続がそのまま先へ運びます。
# - **負荷分散の補助損失**。ルーターを放っておくと、大半のトークンを少数のエキスパートに送りがちで、送られた側はそれをドロップします。Switch Transformer（式 4）は損失に `E x sum_i f_i P_i` を足します。`f_i` は第 1希望がエキスパート `i` のトークンの割合、`P_i` はルーターが `i` に与える確率の平均です。負荷が均等なら 1、すべてが 1つのエキスパートに行くと `E` になります。勾配が流れるのは `P_i` だけです。
#
# `mparlib.experts.route` は 1つのグループのルーティング（上位 `k` 個のゲート、容量、ドロップ、補助損失）を行い、受け付けた割り当てをエキスパート順に並べた `Routing` を返します。`MoE` は 1個のプロセスで動く層です。手で確かめられるほど小さな例で試します。エキスパートは 4個、ルーターは単位行列の 10倍なので、特徴 `e` が 1 のトークンはエキスパート `e` に行きます。エキスパート 0 に 5トークン、エキスパート 1 に 3トークンです。容量係数 1.0 では、各エキスパートが受け付けるのは `ceil(1.0 x 8 x 1 / 4) = 2` トークンです。

# %%
torch.manual_seed(0)
moe = experts.MoE(4, 8, experts=4, k=1, capacity_factor=1.0)
with torch.no_grad():
    moe.router.weight.copy_(10 * torch.eye(4))
tokens = torch.zeros(8, 4)
tokens[:5, 0], tokens[5:, 1] = 1.0, 1.0
out = moe(tokens)
print(tr("capacity", "容量"), moe.last["capacity"], "|", tr("routed per expert", "エキスパートごとの割り当て"),
      moe.last["routed"].tolist(), "|", tr("kept", "受け付けた数"), moe.last["kept"].tolist(), "|",
      tr("dropped", "ドロップ"), moe.last["dropped"])
print(tr("tokens whose output is zero (dropped):", "出力が 0 のトークン（ドロップされたもの）:"),
      [i for i in range(8) if out[i].abs().sum() == 0], "|", tr("balancing loss", "補助損失"),
      f"{moe.aux_loss.item():.4f}")
assert moe.last["dropped"] == 3 + 1 and moe.last["kept"].tolist() == [2, 2, 0, 0]
assert [i for i in range(8) if out[i].abs().sum() == 0] == [2, 3, 4, 7]  # first come, first served
assert abs(moe.aux_loss.item() - 4 * (5 / 8 * 5 / 8 + 3 / 8 * 3 / 8)) < 1e-3  # the gates are almost 1

# %% [markdown]
# <!-- en -->
# Expert 0 keeps its first two tokens and drops the other three, expert 1 drops its third: 4 dropped. The
# balancing loss is about `4 x (5/8 x 5/8 + 3/8 x 3/8) = 2.125` (the gates are almost 1), far from the 1 of an even
# load.
#
# ### Experts on different ranks
#
# With **expert parallelism** rank `r` of `n` holds experts `r E / n` to `(r + 1) E / n` and a copy of the router,
# and works on its own tokens, as in data parallelism. A token's expert may live on any rank, so every layer
# exchanges tokens, all ranks with all ranks: an **all-to-all**. `ExpertParallelMoE` makes three per forward pass,
# all with `dist.all_to_all_single`:
#
# 1. **counts**: each rank sends every other rank how many rows it will get for each of its experts (`E`
#    integers). The sizes of the next message are not known in advance, and every rank must allocate what it
#    receives;
# 2. **dispatch**: the rows of the kept tokens, sorted by expert (and so by rank), with split sizes from step 1;
# 3. **combine**: the experts' outputs back to the ranks their tokens came from, with the split sizes reversed.
#
# Backward, dispatch and combine run again with their split sizes swapped (a custom `autograd.Function`). The
# router is replicated, so its gradients are averaged like data parallelism's; an expert's gradient already sums
# what every rank's tokens contributed, because the tokens came to it (`average_gradients` does both). The bytes
# each call passes follow from the routing alone (`predicted_traffic`): rank `r` sends its kept rows, receives
# the rows of all ranks for its experts, and returns as many as it received; backward the two directions swap.
#
# The one-process `MoE(..., groups=n)` routes each of `n` equal groups of tokens on its own, as `n` ranks do, so
# it is the exact reference, with drops as well. The worker below compares the two layers in float64, then trains
# a small ViT (2 blocks, `dim` 32, 7 x 7-pixel patches) whose MLPs are MoE layers with 4 experts, 2 per rank, on
# Fashion-MNIST: once with the balancing loss (weight 0.05), once without.
# <!-- ja -->
# エキスパート 0 は最初の 2トークンを受け付け、残りの 3つをドロップします。エキスパート 1 は 3つめをドロップします。合わせて 4つです。補助損失はおよそ `4 x (5/8 x 5/8 + 3/8 x 3/8) = 2.125`（ゲートはほぼ 1）で、均等な負荷の 1 からは遠く離れています。
#
# ### ランクごとに異なるエキスパート
#
# **エキスパート並列**では、ランク `r`（`n` 個中）はエキスパート `r E / n` から `(r + 1) E / n` と、ルーターのコピーを持ちます。データ並列と同じく、各ランクは自分のトークンを処理します。トークンの行き先のエキスパートはどのランクにもありうるので、層ごとに全ランクが全ランクとトークンを交換します。これが**オールツーオール**（all-to-all）です。`ExpertParallelMoE` は順伝播ごとに 3回、どれも `dist.all_to_all_single` で行います。
#
# 1. まず**個数**: 各ランクは他のランクに、そのランクの各エキスパートへ何行送るかを知らせます（整数 `E` 個）。次のメッセージの大きさは前もってわからず、各ランクは受け取る分の領域を用意しなければならないからです。
# 2. 次に**配送**（dispatch）: 受け付けたトークンの行を、エキスパート順（つまりランク順）に並べて送ります。分割の大きさは 1 で知らせたものです。
# 3. 最後に**回収**（combine）: エキスパートの出力を、トークンの出どころのランクへ送り返します。分割の大きさは逆になります。
#
# 逆伝播では、配送と回収が分割の大きさを入れ替えてもう一度行われます（独自の `autograd.Function`）。ルーターは複製されているので、勾配はデータ並列と同じく平均します。エキスパートの勾配は、トークンの方が送られてきたので、すでに全ランクのトークンの寄与の和になっています（`average_gradients` が両方を行います）。各呼び出しが渡すバイト数はルーティングだけから決まります（`predicted_traffic`）。ランク `r` は自分が受け付けた行を送り、自分のエキスパート宛ての全ランクの行を受け取り、受け取った数だけ送り返します。逆伝播では 2つの向きが入れ替わります。
#
# 1個のプロセスで動く `MoE(..., groups=n)` は、トークンを `n` 個の同じ大きさのグループに分けてグループごとにルーティングします。`n` 個のランクがすることと同じなので、ドロップがあっても正確な基準になります。次のワーカーは、まず 2つの層を float64 で比べます。次に、MLP を 4個のエキスパート（ランクごとに 2個）の MoE 層にした小さな ViT（ブロック 2つ、`dim` 32、7 x 7 ピクセルのパッチ）を Fashion-MNIST で訓練します。補助損失あり（重み 0.05）となしの 2回です。

# %%
# %%worker ep_workers
import torch
import torch.distributed as dist
from torch.nn import functional as F

from mparlib import experts
from mparlib.vit import ViTConfig

CONFIG = ViTConfig(dim=32, depth=2, heads=2, hidden=64, patch=7)  # 16 tokens per image
MOE = dict(experts=4, k=1, capacity_factor=1.25)
LR = 3e-3


def layer_check(capacity_factor, seed=0, tokens=32, dim=16, hidden=32):
    """ExpertParallelMoE against MoE(groups=n) in float64 (top-2 of 4 experts); bytes counted and predicted."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    full = experts.MoE(dim, hidden, experts=4, k=2, capacity_factor=capacity_factor, groups=world).double()
    x, w = (torch.randn(world, tokens, dim, dtype=torch.float64) for _ in range(2))
    x_full = x.clone().requires_grad_()
    y_full = full(x_full)
    (y_full * w).sum().backward()
    part = experts.ExpertParallelMoE(full)
    x_mine = x[rank].clone().requires_grad_()
    y = part(x_mine)
    (y * w[rank]).sum().backward()
    dist.all_reduce(part.router.weight.grad)  # replicated: the sum over every rank's tokens
    ref = dict(full.named_parameters())
    diffs = {"output": (y - y_full[rank]).abs().max().item(),
             "input grad": (x_mine.grad - x_full.grad[rank]).abs().max().item(),
             "router grad": (part.router.weight.grad - ref["router.weight"].grad).abs().max().item()}
    for i, expert in enumerate(part.experts):
        for n, p in expert.named_parameters():
            name = f"experts.{part.first + i}.{n}"
            diffs[f"{name} grad"] = (p.grad - ref[name].grad).abs().max().item()
    return {"diffs": diffs, "dropped": full.last["dropped"], "per_group": full.last["per_group"].tolist(),
            "counted": {t["what"]: t["bytes"] for t in part.traffic},
            "predicted": experts.predicted_traffic(full.last["per_group"], dim, 8, rank)}


def evaluate(model, test):
    """Test accuracy and the tokens routed to each expert (per layer), over every rank's share of the test set."""
    rank, world = dist.get_rank(), dist.get_world_size()
    correct, routed = torch.zeros(2), torch.zeros(CONFIG.depth, MOE["experts"])
    with torch.no_grad():
        for X, y in test:
            b = len(y) // world
            X, y = X[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
            correct += torch.tensor([(model(X).argmax(1) == y).sum().item(), len(y)])
            routed += torch.stack([block.mlp.last["routed"].float() for block in model.blocks])
    dist.all_reduce(correct)
    dist.all_reduce(routed)
    return (correct[0] / correct[1]).item(), routed.long().tolist()


def train(batches, test, aux_weight, seed=0):
    """Adam on the expert-parallel MoE ViT, rank r on its share of each batch; losses, accuracy, load, bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = experts.expert_parallel(experts.moe_vit(CONFIG, groups=world, **MOE))
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, traffic = [], None
    for X, y in batches:
        b = len(y) // world
        X, y = X[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
        loss = F.cross_entropy(model(X), y) + aux_weight * experts.aux_loss(model)
        opt.zero_grad()
        loss.backward()
        experts.average_gradients(model)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if traffic is None:  # the first step: bytes counted, and predicted from every rank's routing
            kept = []
            for block in model.blocks:
                rows = [torch.zeros_like(block.mlp.last["per_group"]) for _ in range(world)]
                dist.all_gather(rows, block.mlp.last["per_group"])  # (1, E) from every rank -> (world, E)
                kept.append(torch.cat(rows))
            traffic = {"counted": [sum(t["bytes"] for t in block.mlp.traffic) for block in model.blocks],
                       "predicted": [sum(experts.predicted_traffic(t, CONFIG.dim, 4, rank).values()) for t in kept],
                       "leaving": [sum(t["leaving"] for t in block.mlp.traffic) for block in model.blocks]}
    accuracy, routed = evaluate(model, test)
    return {"losses": losses, "accuracy": accuracy, "routed": routed, "traffic": traffic}


def moe_checks(batches, test):
    """The layer comparison (without and with drops) and the two trainings, in one launch."""
    return {"layer": {"no drops": layer_check(4.0), "drops": layer_check(0.75)},
            "balanced": train(batches, test, 0.05), "unbalanced": train(batches, test, 0.0)}

# %% [markdown]
# <!-- en -->
# The data: 60 batches of 64 training images (32 per rank) and 512 test images, the same for both runs. One
# launch on 2 processes does everything:
# <!-- ja -->
# データは、64枚の訓練画像のバッチ 60個（ランクごとに 32枚）とテスト画像 512枚で、2回の訓練で共通です。2個のプロセスで 1回起動し、すべてを行います。

# %%
from ep_workers import CONFIG, LR, MOE, moe_checks

train_iter, test_iter = load_fashion_mnist(64, subset=(64 * 60, 512), resident=True)
batches = [(x.clone(), y.clone()) for x, y in train_iter]
test = [(x.clone(), y.clone()) for x, y in test_iter]
moe_report = launch(moe_checks, 2, args=(batches, test), timeout=600)
CASES = {"no drops": tr("no drops", "ドロップなし"), "drops": tr("drops", "ドロップあり")}
print(table([[CASES[case], r["dropped"], str(r["counted"]), str(r["predicted"])]
             for case, r in moe_report["layer"].items()],
            ["", ("dropped", "ドロップ"), ("rank 0's bytes per call", "ランク 0 の呼び出しごとのバイト数"),
             ("predicted from the routing", "ルーティングからの予想")]))

# %% tags=["nbval-ignore-output"]
print(table([[CASES[case], f"{max(r['diffs'].values()):.1e}"] for case, r in moe_report["layer"].items()],
            ["", ("largest difference to the one-process layer", "1個のプロセスの層との最大の差")]))

# %%
for case, r in moe_report["layer"].items():
    assert all(d < 1e-12 for d in r["diffs"].values()), (case, r["diffs"])
    assert r["counted"] == r["predicted"], case
assert moe_report["layer"]["no drops"]["dropped"] == 0 and moe_report["layer"]["drops"]["dropped"] > 0
print(tr("expert parallel = one process on 2 processes, without and with dropped tokens: output, input gradient, "
         "router and expert gradients (float64, tolerance 1e-12); bytes passed to every all-to-all = prediction",
         "2個のプロセスのエキスパート並列は 1個のプロセスと一致（ドロップなしとあり）: 出力、入力の勾配、ルーターと"
         "エキスパートの勾配（float64、許容誤差 1e-12）。各オールツーオールに渡したバイト数 = 予想"))

# %% [markdown]
# <!-- en -->
# The dispatch of rank 0 passes its kept rows, 16 features of 8 bytes each, the combine passes back what its
# experts received, and the counts are 4 integers of 8 bytes. Part of each message stays on the rank (rows for its
# own experts): `all_to_all_single` copies that part locally. Now the training. First, parity: the first three
# steps' losses against one process on the same batches (`MoE(groups=2)`, the same seed, Adam):
# <!-- ja -->
# ランク 0 の配送は、受け付けた行（特徴 16個、各 8バイト）を渡し、回収は自分のエキスパートが受け取った分を送り返します。個数は 8バイトの整数 4個です。各メッセージの一部は同じランクにとどまります（自分のエキスパート宛ての行）。`all_to_all_single` はその部分をランクの中でコピーします。次は訓練です。まず一致を確かめます。最初の 3ステップの損失を、同じバッチで 1個のプロセスが訓練した場合（`MoE(groups=2)`、同じシード、Adam）と比べます。

# %%
torch.manual_seed(0)
one = experts.moe_vit(CONFIG, groups=2, **MOE)
opt = torch.optim.Adam(one.parameters(), lr=LR)
ref_losses = []
for x, y in batches[:3]:
    loss = F.cross_entropy(one(x), y) + 0.05 * experts.aux_loss(one)
    opt.zero_grad()
    loss.backward()
    opt.step()
    ref_losses.append(loss.item())
balanced, unbalanced = moe_report["balanced"], moe_report["unbalanced"]
torch.testing.assert_close(torch.tensor(balanced["losses"][:3]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
print(tr("first 3 losses, 2 processes = one process (float32, tolerance 1e-4)",
         "最初の 3つの損失: 2個のプロセス = 1個のプロセス（float32、許容誤差 1e-4）"))

# %% tags=["nbval-ignore-output"]
print(tr("one process:  ", "1個のプロセス: "), [f"{v:.6f}" for v in ref_losses])
print(tr("2 processes:  ", "2個のプロセス: "), [f"{v:.6f}" for v in balanced["losses"][:3]])
RUNS = {"balanced": tr("with balancing loss", "補助損失あり"), "unbalanced": tr("without", "補助損失なし")}
print(table([[RUNS[name], f"{r['accuracy']:.1%}", f"{r['losses'][-1]:.3f}"]
             for name, r in (("balanced", balanced), ("unbalanced", unbalanced))],
            ["", ("test accuracy", "テスト精度"), ("last loss", "最後の損失")]))
print(tr(f"whole chapter so far: {time.perf_counter() - CHAPTER_START:.0f} s",
         f"ここまでの章全体: {time.perf_counter() - CHAPTER_START:.0f}秒"))

# %%
assert balanced["accuracy"] > 0.5 and unbalanced["accuracy"] > 0.5, "10 classes: chance is 10%"
assert balanced["losses"][-1] < balanced["losses"][0] - 0.5
fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
axes[0].plot(balanced["losses"], label=RUNS["balanced"])
axes[0].plot(unbalanced["losses"], label=RUNS["unbalanced"])
axes[0].set(xlabel=tr("step", "ステップ"), ylabel=tr("training loss", "訓練損失"))
axes[0].legend()
for ax, (name, r) in zip(axes[1:], ((RUNS["balanced"], balanced), (RUNS["unbalanced"], unbalanced)), strict=True):
    width = 0.8 / CONFIG.depth
    for layer, counts in enumerate(r["routed"]):
        ax.bar([e + layer * width for e in range(MOE["experts"])], counts, width,
               label=tr(f"block {layer}", f"ブロック {layer}"))
    ax.axhline(sum(r["routed"][0]) / MOE["experts"], color="gray", lw=1, ls="--")
    ax.set(title=name, xlabel=tr("expert", "エキスパート"), ylabel=tr("test tokens routed", "送られたテストのトークン"),
           xticks=[e + width / 2 for e in range(MOE["experts"])], xticklabels=range(MOE["experts"]))
    ax.legend(fontsize=8)
    ax.set_ylim(0, 1.15 * max(max(c) for run in (balanced, unbalanced) for c in run["routed"]))
fig.tight_layout()
plt.show()

# %% [markdown]
# <!-- en -->
# Both runs learn (accuracy far above the 10% of guessing after 60 small steps; the first run's loss includes the
# small balancing term), and the first steps follow one process. The histograms count, over the 8192 test tokens,
# where each token's first choice went; the dashed line is an even load. Without the balancing loss the router
# already favours some experts after 60 steps, and those would drop more tokens as the imbalance grows; with it,
# the load stays closer to even. The next cell puts a number on it: the largest expert's share, against the
# `1/E = 25%` of an even load.
# <!-- ja -->
# どちらの訓練も学習しています（60回の小さなステップの後、精度は当て推量の 10% を大きく上回ります。補助損失ありの訓練損失には、補助損失の小さな項も含まれます）。最初のステップは 1個のプロセスと一致します。ヒストグラムは、テストの 8192トークンについて、各トークンの第 1希望がどのエキスパートだったかを数えたものです。破線は均等な負荷です。補助損失がないと、60ステップの時点ですでにルーターは一部のエキスパートをひいきしており、偏りが大きくなるほどそのエキスパートがドロップするトークンも増えます。補助損失があると、負荷は均等に近いままです。次のセルはそれを数値にします。最も多いエキスパートの割合を、均等な負荷の `1/E = 25%` と比べます。

# %% tags=["nbval-ignore-output"]
shares = {name: [max(c) / sum(c) for c in r["routed"]] for name, r in (("balanced", balanced),
                                                                      ("unbalanced", unbalanced))}
print(table([[RUNS[name]] + [f"{s:.0%}" for s in row] for name, row in shares.items()],
            [""] + [(f"block {b}: largest expert's share", f"ブロック {b}: 最大のエキスパートの割合")
                    for b in range(max(len(row) for row in shares.values()))]))

# %%
assert max(shares["balanced"]) < max(shares["unbalanced"]), shares

# %% [markdown]
# <!-- en -->
# ### Bytes per step
#
# What did a training step move? Per MoE layer and rank, forward and backward together: `4 x kept rows x dim x 4`
# bytes when the rank receives as many rows as it sends (dispatch and combine, each twice), plus `E x 8` bytes of
# counts. The first step's bytes on rank 0, counted in the calls and predicted from the routing of both ranks:
# <!-- ja -->
# ### ステップごとのバイト数
#
# 訓練の 1ステップは何を運んだでしょうか。MoE 層とランクごとに、順伝播と逆伝播を合わせて、送る行と受け取る行が同じ数なら `4 x 受け付けた行 x dim x 4` バイト（配送と回収が 2回ずつ）と、個数の `E x 8` バイトです。最初のステップのランク 0 のバイト数を、呼び出しで数えた値と、両方のランクのルーティングから予想した値で示します。

# %%
t = balanced["traffic"]
for layer, (counted, predicted) in enumerate(zip(t["counted"], t["predicted"], strict=True)):
    print(tr(f"block {layer}: counted {counted} bytes, predicted {predicted}",
             f"ブロック {layer}: 数えた値 {counted}バイト、予想 {predicted}"))
assert t["counted"] == t["predicted"]

# %% tags=["nbval-ignore-output"]
for layer, (counted, leaving) in enumerate(zip(t["counted"], t["leaving"], strict=True)):
    print(tr(f"block {layer}: {leaving / counted:.0%} of it left the rank (the rest was for its own experts)",
             f"ブロック {layer}: そのうち {leaving / counted:.0%} がランクの外へ出た（残りは自分のエキスパート宛て）"))

# %% [markdown]
# <!-- en -->
# The rows for the rank's own experts never leave it; with `n` ranks and an even load, a share `(n - 1) / n`
# leaves (a half on 2 ranks), so the all-to-all's cost grows towards the full message as the experts spread over
# more ranks. Unlike tensor parallelism's all-reduces, its size depends on the routing, which is why the counts
# travel first.
# <!-- ja -->
# 自分のエキスパート宛ての行はランクの外へ出ません。ランクが `n` 個で負荷が均等なら、`(n - 1) / n` の割合（ランク 2個なら半分）がランクの外へ出ます。エキスパートを多くのランクに広げるほど、オールツーオールの費用はメッセージ全体に近づきます。テンソル並列のオールリデュースと違って、その大きさはルーティングで決まります。個数を先に送るのはそのためです。

# %% [markdown]
# <!-- en -->
# ## Putting the dimensions together
#
# Chapters 6 to 11 have now split training along seven dimensions. Each one splits something different, and each
# pays for it with its own kind of message. The figure marks, for every dimension, what a rank holds only a part of
# (filled) and what it holds whole (empty).
# <!-- ja -->
# ## 並列化の次元のまとめ
#
# 6章から 11章までで、訓練を 7つの次元で分けてきました。次元ごとに分けるものが違い、それぞれ違う種類の通信でその代価を払います。次の図は、次元ごとに、ランクが一部分だけを持つもの（塗りつぶし）と、丸ごと持つもの（白抜き）を示します。

# %%
DIMENSIONS = ["dp", "fsdp", "tp", "sp", "cp", "ep", "pp"]
STATE = [tr("parameters", "パラメータ"), tr("gradients", "勾配"), tr("optimizer state", "オプティマイザの状態"),
         tr("activations", "活性化"), tr("tokens (batch x sequence)", "トークン（バッチ x 系列）")]
SPLITS = {  # which of STATE a rank holds only a part of, for each dimension
    "dp": {4},  # each rank its own samples; everything else replicated
    "fsdp": {0, 1, 2, 4},  # ZeRO-3 / FSDP: all training state sharded, and each rank its own samples
    "tp": {0, 1, 2, 3},  # the weights of every layer, and the activations inside the split region
    "sp": {0, 1, 2, 3},  # tp, plus the activations outside the matmuls (norms, dropout) split along the sequence
    "cp": {3, 4},  # each rank a slice of every sequence; weights replicated
    "ep": {0, 1, 2, 4},  # the experts' weights (and their state); tokens dispatched to the rank of their expert
    "pp": {0, 1, 2, 3},  # whole layers: a stage holds its own layers, their state and their activations
}
fig, ax = plt.subplots(figsize=(7.5, 3.2))
for i, dim_name in enumerate(DIMENSIONS):
    for j in range(len(STATE)):
        split = j in SPLITS[dim_name]
        ax.scatter(j, i, s=260, marker="s", edgecolors="tab:blue", facecolors="tab:blue" if split else "white")
ax.set_xticks(range(len(STATE)), STATE, rotation=15, ha="right")
ax.set_yticks(range(len(DIMENSIONS)), DIMENSIONS)
ax.invert_yaxis()
ax.set_xlim(-0.6, len(STATE) - 0.4)
ax.set_title(tr("filled: each rank holds only its part", "塗りつぶし: 各ランクは自分の部分だけを持つ"))
fig.tight_layout()
plt.show()
assert all(SPLITS[d] <= set(range(len(STATE))) for d in DIMENSIONS)

# %% [markdown]
# <!-- en -->
# What each dimension sends, and when it pays off, with this course's measurements (the chapter that made them) and
# published figures:
#
# | dimension | what it sends | when it pays off | measured in this course | published figures |
# |---|---|---|---|---|
# | dp (chapters 6, 8) | one all-reduce of all gradients per step, overlapped with the backward pass | the model fits on one device | chapter 8: when 2 devices are slower than 1, from the all-reduce's alpha and beta | d2l: 160 MB of gradients in a ring over 8 V100s in about 6 ms |
# | fsdp / ZeRO (chapter 9) | all-gathers of parameters, reduce-scatters of gradients | the training state does not fit, a few layers do | chapter 9: bytes per rank for each ZeRO stage | ZeRO paper: full sharding moves 1.5 x DDP's bytes |
# | tp (chapter 10) | all-reduces of activations inside every block, on the critical path | layers too big or too slow for one device, fast links | chapter 10: all-reduces per block, counted | Megatron-LM: 2 all-reduces forward and 2 backward per layer, within one 8-GPU server |
# | sp (this chapter) | the same bytes as tp, as all-gathers and reduce-scatters | always with tp: norms and dropout no longer hold the whole sequence | this chapter: activation bytes per rank against tp alone | Korthikanti et al. (2022): activations per layer `sbh(10 + 24/t + 5as/(ht))` with tp, `sbh(34 + 5as/h)/t` with tp + sp |
# | cp (this chapter) | key and value blocks around a ring, overlapped with attention | sequences too long for one device's activations | this chapter: attention activation bytes per rank against sequence length, and the causal imbalance | Llama 3 405B at 128K tokens: TP 8, CP 16, PP 16 |
# | ep (this chapter) | two all-to-alls of tokens per MoE layer, forward and backward | many experts, each too big to copy everywhere | this chapter: all-to-all bytes predicted and counted | DeepSeek-V3: 64-way EP over 8 nodes, with 16-way PP and ZeRO-1 DP; Switch Transformer: balancing loss weight 0.01 |
# | pp (chapter 10) | one activation per micro-batch and stage boundary, point to point | deep models, slow links between machines | chapter 10: the bubble against its formula | GPipe: bubble `(p - 1) / (m + p - 1)` |
#
# The dimensions multiply: a layout is a mesh with one axis for each dimension in use, and its product is the number
# of devices. Chapter 10's rule of thumb still orders the choice: replicate while the model fits, shard when its
# state does not, split layers over fast links, and add cp when the sequence, ep when the experts, outgrow a device.
# <!-- ja -->
# 各次元が何を送り、いつ得をするかを、このコースでの測定（測った章）と公表されている数値とともにまとめます。
#
# | 次元 | 送るもの | 得をするとき | このコースでの測定 | 公表されている数値 |
# |---|---|---|---|---|
# | dp（6章、8章） | ステップごとに全勾配のオールリデュース 1回。逆伝播と重ねて行う | モデルが 1つのデバイスに収まるとき | 8章: オールリデュースの α と β から、2つのデバイスが 1つより遅くなる条件 | d2l: V100 8枚のリングで 160 MB の勾配を約 6 ms で同期 |
# | fsdp / ZeRO（9章） | パラメータのオールギャザーと勾配のリデュース・スキャッター | 訓練の状態は収まらないが、数層分なら収まるとき | 9章: ZeRO の段階ごとのランクあたりのバイト数 | ZeRO の論文: 完全なシャーディングで DDP の 1.5倍のバイト数 |
# | tp（10章） | ブロックごとに活性化のオールリデュース。計算の途中に入る | 層が 1つのデバイスには大きすぎるか遅すぎ、リンクが速いとき | 10章: ブロックごとのオールリデュースの回数 | Megatron-LM: 層 1つにつき順伝播で 2回、逆伝播で 2回。1台の 8 GPU サーバーの中で使う |
# | sp（この章） | tp と同じバイト数を、オールギャザーとリデュース・スキャッターで送る | いつも tp と組み合わせる。正規化とドロップアウトが系列全体を持たなくなる | この章: tp だけの場合と比べたランクあたりの活性化のバイト数 | Korthikanti ら（2022）: 層 1つの活性化は tp で `sbh(10 + 24/t + 5as/(ht))`、tp + sp で `sbh(34 + 5as/h)/t` |
# | cp（この章） | キーとバリューのブロックをリングで回す。アテンションの計算と重ねて行う | 系列が長すぎて、1つのデバイスに活性化が収まらないとき | この章: 系列長に対するランクあたりのアテンションの活性化のバイト数と、因果的な場合の負荷の偏り | Llama 3 405B の 128K トークン: TP 8、CP 16、PP 16 |
# | ep（この章） | MoE の層ごとに、トークンのオールツーオール 2回（順伝播と逆伝播のそれぞれ） | エキスパートが多く、それぞれを全デバイスに複製するには大きすぎるとき | この章: 予測して数えたオールツーオールのバイト数 | DeepSeek-V3: 8ノードにまたがる 64-way の EP と、16-way の PP、ZeRO-1 の DP。Switch Transformer: 負荷分散の損失の重み 0.01 |
# | pp（10章） | マイクロバッチとステージの境界ごとに活性化 1つを 1対1通信で送る | モデルが深く、マシンの間のリンクが遅いとき | 10章: 式と比べたバブル | GPipe: バブル `(p - 1) / (m + p - 1)` |
#
# 次元は掛け合わされます。配置は、使う次元ごとに 1つの軸を持つメッシュで、その積がデバイスの数です。選ぶ順序は 10章の目安のままです。モデルが収まるうちは複製し、状態が収まらなくなったらシャーディングし、速いリンクの上で層を分けます。系列が 1つのデバイスに収まらなくなったら cp を、エキスパートが収まらなくなったら ep を加えます。

# %% [markdown]
# <!-- en -->
# ## Summary
#
# - Sequence parallelism cuts the LayerNorms, residuals and dropout of a tensor-parallel block along the tokens.
#   `f` and `g` become an all-gather (backward: reduce-scatter) entering and a reduce-scatter (backward: all-gather)
#   leaving each region: the same bytes as the all-reduces, less activation memory, and no all-reduce in the block.
#   Replicated parameters that see a slice of the tokens need their gradients summed.
# - `parallelize_module` with `SequenceParallel`, `PrepareModuleInput` and `RowwiseParallel(output_layouts=Shard(1))`
#   does the same, message for message; `SavedBytes` measured the activations to the byte.
# - Context parallelism splits the sequence on every layer, attention included. Ring attention passes the key/value
#   blocks around a ring of ranks in `N - 1` moves, posted before each block's compute so that they can overlap,
#   and folds the partial results with the log-sum-exp rule (`merge`), which is exact.
# - Its backward pass is a second ring pass: the key/value gradients travel with their blocks and arrive home after
#   `N` moves. Outputs and gradients equal one process's attention on 2 and 4 ranks, non-causal and causal, and the
#   non-causal output equals PyTorch's `context_parallel`.
# - Per rank, the tensors saved for backward shrink by `N` and the largest score block by `N^2` (measured with
#   `saved_tensors_hooks`).
# - Under a causal mask the contiguous split gives the last rank `N` times the first one's work; the balanced split
#   (chunks `r` and `2N - 1 - r`) equalizes it.
# - A ViT trained with 196 tokens split over 2 ranks follows one process step for step and learns.
# - A mixture of experts routes each token to `k` of `E` MLPs; capacity fixes the shapes and drops the overflow;
#   the Switch balancing loss `E x sum f_i P_i` pushes the router towards an even load.
# - Expert parallelism places the experts on different ranks and moves tokens with three all-to-alls per layer
#   (counts, dispatch, combine) and two more backward; the bytes follow from the routing, and a one-process layer
#   that routes the same groups computes exactly the same.
# <!-- ja -->
# ## まとめ
#
# - シーケンス並列は、テンソル並列のブロックの LayerNorm、残差、ドロップアウトをトークンの向きに切ります。`f` と `g` は、各領域に入る場所のオールギャザー（逆伝播はリデュース・スキャッター）と、出る場所のリデュース・スキャッター（逆伝播はオールギャザー）になります。通信するバイト数はオールリデュースと同じで、活性化のメモリが減り、ブロックの中にオールリデュースはありません。トークンの一部しか見ない複製パラメータは、勾配を足し合わせる必要があります。
# - `SequenceParallel`、`PrepareModuleInput`、`RowwiseParallel(output_layouts=Shard(1))` を使った `parallelize_module` は、通信 1回単位まで同じことをします。`SavedBytes` は活性化をバイト単位で予想どおりに測りました。
# - コンテキスト並列は、アテンションも含めてどの層でも系列を分けます。リングアテンションは、キーとバリューのブロックをランクのリングに沿って `N - 1` 回移動させます。移動はブロックの計算の前に発行するので、計算と重ねられます。部分的な結果は log-sum-exp の規則（`merge`）で合わせ、この合わせ方は誤差なく成り立ちます。
# - 逆伝播はリングのもう 1周です。キーとバリューの勾配はブロックと一緒に回り、`N` 回の移動で持ち主に戻ります。ランク 2個と 4個で、非因果的な場合も因果的な場合も、出力と勾配は 1個のプロセスのアテンションと一致し、非因果的な出力は PyTorch の `context_parallel` とも一致します。
# - ランクあたりでは、逆伝播のために保存されるテンソルが `N` 分の 1 に、最大のスコアのブロックが `N^2` 分の 1 になります（`saved_tensors_hooks` で測りました）。
# - 因果マスクのもとでは、連続した分割だと最後のランクが最初のランクの `N` 倍の仕事をします。負荷を均した分割（チャンク `r` と `2N - 1 - r`）はこれを均等にします。
# - 196トークンを 2個のランクに分けて訓練した ViT は、1個のプロセスと 1ステップずつ一致し、学習します。
# - MoE は各トークンを `E` 個の MLP のうち `k` 個に送ります。容量が形状を固定してあふれた分をドロップし、Switch の補助損失 `E x sum f_i P_i` がルーターを均等な負荷へ向かわせます。
# - エキスパート並列はエキスパートを別々のランクに置き、層ごとに 3回のオールツーオール（個数、配送、回収）と、逆伝播でさらに 2回を使ってトークンを運びます。バイト数はルーティングから決まり、同じグループをルーティングする 1個のプロセスの層は、まったく同じものを計算します。

# %% [markdown]
# <!-- en -->
# ## Exercises
#
# Each exercise has a **starter** cell whose function body is `raise NotImplementedError`: replace that line with your
# code, run the cell, then run the check cell below it. The check says *not attempted*, *wrong* (the first difference
# and one hint for the likely mistake), *error* (your exception, or your code ending its process), *right*, *cannot
# run here* or *the check itself failed* (never a verdict on your answer); it never prints the answer. Your function
# runs in a fresh worker process and is stopped after 30 s. `hint("11.1")` prints the next hint level each time you
# call it and says when none is left; `hint("11.1", 2)` prints a given level.
# <!-- ja -->
# ## 練習問題
#
# 各練習問題には、本体が `raise NotImplementedError` だけの関数を含む**スターター**のセルがあります。その行を自分のコードに置き換えてセルを実行し、すぐ下のチェックのセルを実行してください。チェックの結果は「未着手」、「不正解」（最初の違いと、ありがちな間違いに合わせたヒント 1つ）、「エラー」（発生した例外、またはコードがプロセスを終了させたこと）、「正解」、「この環境では実行できません」、「チェック自体の不具合」（あなたの答えの判定ではありません）のどれかで、答えそのものは表示しません。関数は新しいワーカープロセスで実行し、30秒で止めます。`hint("11.1")` は呼ぶたびに次の段階のヒントを表示し、もう残っていなければそう伝えます。`hint("11.1", 2)` は指定した段階のヒントを表示します。

# %%
from mparlib.exercises import check, hint

# %% [markdown]
# <!-- en -->
# ### Exercise 11.1: Merging two partial attentions
#
# Write `merge_partial(out_a, lse_a, out_b, lse_b)` without calling the chapter's `merge`: given the attention of
# the same queries over two disjoint sets of keys (`out` of shape `(B, H, T, d)` and its log-sum-exp `lse` of shape
# `(B, H, T)`, as `block_attention` returns them), return `(out, lse)` over both sets. The check cuts the keys of a
# few random inputs in two and compares your merge with `F.scaled_dot_product_attention` over all the keys.
# <!-- ja -->
# ### 練習問題 11.1: 2つの部分的なアテンションの合わせ方
#
# 章の `merge` を呼ばずに `merge_partial(out_a, lse_a, out_b, lse_b)` を書いてください。同じクエリの、互いに重ならない 2組のキーに対するアテンション（`block_attention` が返すのと同じ、形状 `(B, H, T, d)` の `out` と、形状 `(B, H, T)` のその log-sum-exp `lse`）から、両方の組に対する `(out, lse)` を返します。チェックはいくつかのランダムな入力のキーを 2つに切り、あなたの関数の結果を、すべてのキーに対する `F.scaled_dot_product_attention` と比べます。

# %%
# Exercise 11.1: starter
def merge_partial(out_a, lse_a, out_b, lse_b):
    """Attention over both sets of keys, from the attentions over each set and their log-sum-exps."""
    raise NotImplementedError("11.1")


# %%
check("11.1", merge_partial)

# %% [markdown]
# <!-- en -->
# ### Exercise 11.2: The balanced causal split
#
# Write `balanced_positions(length, world, rank)`: the list of token positions that rank `rank` of `world` holds
# under the chapter's balanced split for causal attention, in order, without calling `shard_sequence` or
# `chunks_of`. The check asks every rank of a few cases and tests that every token is held exactly once, that all
# ranks compute the same number of score elements under the causal mask, and that the layout is the chapter's.
# <!-- ja -->
# ### 練習問題 11.2: 負荷を均した因果的な分割
#
# 因果的アテンションのための章の負荷を均した分割で、`world` 個のうちランク `rank` が持つトークンの位置のリストを、順に返す `balanced_positions(length, world, rank)` を書いてください。`shard_sequence` と `chunks_of` は呼ばないでください。チェックはいくつかの場合のすべてのランクに問い合わせ、どのトークンもちょうど 1回ずつ持たれること、因果マスクのもとでどのランクも同じ数のスコアの要素を計算すること、配置が章と同じことを確かめます。

# %%
# Exercise 11.2: starter
def balanced_positions(length, world, rank):
    """The token positions of `rank` under the balanced causal split."""
    raise NotImplementedError("11.2")


# %%
check("11.2", balanced_positions)

# %% [markdown]
# <!-- en -->
# ### Exercise 11.3: The split sizes of the dispatch
#
# `ExpertParallelMoE` sends each rank the rows routed to the experts it holds, with `all_to_all_single`, whose
# split sizes say how many rows go to each rank. Write `send_splits(expert_of_row, num_experts, world)`: given the
# expert of each of this rank's kept rows (a sorted 1-D `torch.long` tensor) return the list of `world` ints, rows for
# each rank, with the chapter's placement of the experts. The check compares at random routings, some of which leave
# ranks without rows.
# <!-- ja -->
# ### 練習問題 11.3: 配送の分割の大きさ
#
# `ExpertParallelMoE` は、各ランクが持つエキスパートへルーティングされた行を `all_to_all_single` でそのランクへ送ります。その分割の大きさは、各ランクへ何行送るかを表します。このランクの残った行それぞれのエキスパート（並べ替え済みの 1次元の `torch.long` のテンソル）から、章のエキスパートの配置でランクごとの行数を表す `world` 個の int のリストを返す `send_splits(expert_of_row, num_experts, world)` を書いてください。チェックはランダムなルーティングで比べます。その中には、行のないランクが出る場合もあります。

# %%
# Exercise 11.3: starter
def send_splits(expert_of_row, num_experts, world):
    """Rows of this rank for each rank, by the rank that holds their expert."""
    raise NotImplementedError("11.3")


# %%
check("11.3", send_splits)
