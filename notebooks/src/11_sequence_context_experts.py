# %% tags=["nbval-ignore-output"]
import inspect
import time
import unicodedata

import matplotlib.pyplot as plt
import torch
from torch.nn import functional as F

import mparlib
import mparlib.plot
from mparlib import experts, sequence_parallel
from mparlib.data import load_fashion_mnist
from mparlib.lang import tr
from mparlib.launch import launch

# %load_ext mparlib.launch

mparlib.plot.use_course_style()  # a font with Japanese glyphs for this notebook's figures
print(mparlib.report())
print(mparlib.profile_line())
PROFILE = mparlib.profile()
CHAPTER_START = time.perf_counter()


def col(text, width, right=False):
    """``text`` padded to ``width`` columns of a printed table (an East Asian wide character takes two)."""
    text = str(text)
    pad = " " * max(0, width - sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text))
    return pad + text if right else text + pad

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
# テンソル並列（10章）は、アテンションをヘッドで、MLP を中間の特徴で分けます。しかしその間では、どのランクも活性化 `(B, T, dim)` 全体を持っています。2つの LayerNorm と 2つの残差の足し算（モデルにあればドロップアウトも）はどのランクでも同じように実行され、各ランクがその入力を逆伝播のために保存します。シーケンスが長いと、この複製された部分が活性化のメモリの大半を占めます。**シーケンス並列**（Korthikanti ら、『Reducing Activation Recomputation in Large Transformer Models』、2022年）は、この部分をシーケンスの向きに切ります。ランク `r`（`n` 個中）は、テンソル並列の領域の外ではトークン `r*T/n` から `(r+1)*T/n` だけを持ちます。LayerNorm とドロップアウトはトークンを 1つずつ独立に扱うので、他のランクから何も受け取る必要がありません。
#
# それに合わせて、10章の鏡像の対 `f` / `g` も変わります。オールリデュース（all-reduce）はリデュース・スキャッター（reduce-scatter）の後にオールギャザー（all-gather）を続けたものです（8章）。シーケンス並列は、この 2つの半分を複製された部分の両側に置くだけです。
#
# - **領域に入る場所**（もとの `f`）: ブロックはすべてのトークンを必要とするので、順伝播では**シーケンスの向きにオールギャザー**します。逆伝播では、各ランクがすべてのトークンについて部分的な勾配を持ち、必要なのは自分のトークンの和だけなので、**リデュース・スキャッター**です。
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
# single reduce-scatter: chapter 10's first exercise, for free.
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
# `CommDebugMode` は何回と数えるはずでしょうか。ブロックごとに、順伝播でオールギャザー 2回（アテンションの前と MLP の前）とリデュース・スキャッター 2回（それぞれの後）、逆伝播でも鏡像の形で同じ回数、オールリデュースはなしです（`expected_collectives`）。MLP だけを見ると、順伝播と逆伝播を合わせてオールギャザー 2回とリデュース・スキャッター 2回で、10章ではここがオールリデュース 2回でした。ブロック全体では、10章は順伝播で 2回、逆伝播で 4回のオールリデュースでした。`q`、`k`、`v` がそれぞれ自分の `f` を持っていたからです。ここでは 3つの射影が集めた 1つのテンソルを読むので、その勾配はランクの中で足し合わされてから 1回のリデュース・スキャッターに渡ります。10章の練習問題 1 が、何もしなくても実現しています。
#
# PyTorch は同じプランを `parallelize_module` で表します（`block_plan` が `Block` 用に書きます）。正規化には `SequenceParallel()`（入力と出力はシーケンスの次元の `Shard(1)`）、アテンションと MLP の前には `Shard(1)` を `Replicate()` にする `PrepareModuleInput`（オールギャザー）、中には `ColwiseParallel`、出口には `RowwiseParallel(output_layouts=Shard(1))`（リデュース・スキャッター）を置きます。次のワーカーは両方の版を分割前のブロックと float64 で比べます。出力、入力の勾配、すべてのパラメータの勾配です。入力は、画像 8枚を 7 x 7 ピクセルのパッチに切ったトークンです（`T = 16` は 2 でも 4 でも割り切れます。4 x 4 のパッチの 49トークンでは割り切れません）。

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
for n, report in sp_reports.items():
    for version in ("mine", "pytorch"):
        c = report[version]["counts"]
        print(f"n={n} " + col(tr("from primitives", "プリミティブ版") if version == "mine" else "parallelize_module", 19),
              tr("forward", "順伝播"), c["forward"], "|", tr("backward", "逆伝播"), c["backward"])
    print(" " * 6 + tr("replicated gradients all-reduced after the backward pass",
                       "逆伝播の後にオールリデュースした複製パラメータの勾配") + f": {report['mine']['synced']}")

# %% tags=["nbval-ignore-output"]
for n, report in sp_reports.items():
    for version in ("mine", "pytorch"):
        print(f"n={n} " + col(tr("from primitives", "プリミティブ版") if version == "mine" else "parallelize_module", 19)
              + tr("largest difference to the unsplit block", "分割前のブロックとの最大の差")
              + f": {max(report[version]['diffs'].values()):.1e}")

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
# - split by heads or hidden features under both forms: `q`, `k`, `v`, the attention output and its reshaped copy
#   (5 x `BTd`), the inputs of GELU and of `fc2` (2 x `BTh`), attention's log-sum-exp (`B x heads x T`);
# - whole on every rank under tensor parallelism: the inputs of the two norms and their outputs (4 x `BTd`) and the
#   norms' means and inverse deviations (4 x `BT`);
# - under sequence parallelism the norms' inputs and statistics shrink by `n`; their outputs, gathered, are what the
#   column-parallel layers save, and stay whole.
# <!-- ja -->
# ### 活性化のメモリ
#
# ランクは逆伝播のために何を保存しているでしょうか。`SavedBytes` は、有効な間に autograd が保存するテンソルを数えます（`torch.autograd.graph.saved_tensors_hooks` を使います）。同じ記憶領域は 1回だけ数え、重みは数えません。形状（float32、`B = 8`、`T = 16`、`dim = 64`、`hidden = 128`、ヘッド 4つ）から、すべてのバイトを予想できます。
#
# - どちらの方式でもヘッドまたは中間の特徴で分かれるもの: `q`、`k`、`v`、アテンションの出力とその形状を変えたコピー（5 x `BTd`）、GELU と `fc2` の入力（2 x `BTh`）、アテンションの log-sum-exp（`B x heads x T`）。
# - テンソル並列ではどのランクでも丸ごと持つもの: 2つの正規化の入力と出力（4 x `BTd`）、正規化の平均と標準偏差の逆数（4 x `BT`）。
# - シーケンス並列では、正規化の入力と統計量が `n` 分の 1 になります。正規化の出力は集めた後のものを列並列の層が保存するので、丸ごとのままです。

# %%
def predicted_saved(n, form, size=4):
    """Bytes a block saves for backward on one of n ranks (form: unsplit, tensor or sequence)."""
    btd, bth, bt, bht = B * T * DIM, B * T * HIDDEN, B * T, B * HEADS * T
    split = 5 * btd + 2 * bth + bht
    if form == "unsplit":
        return size * (split + 4 * btd + 4 * bt)
    if form == "tensor":
        return size * (split / n + 4 * btd + 4 * bt)
    return size * (split / n + 2 * btd + (2 * btd + 4 * bt) / n)


FORMS = {"unsplit": tr("unsplit", "分割なし"), "tensor": tr("tensor parallel", "テンソル並列"),
         "sequence": tr("sequence parallel", "シーケンス並列")}
print(f"{'n':>2} " + col(tr("form", "方式"), 18) + col(tr("measured", "測定値"), 13, right=True)
      + col(tr("predicted", "予想"), 13, right=True) + "  " + tr("of unsplit", "分割なしに対する割合"))
for n, report in sp_reports.items():
    saved = report["saved"]
    for form, label in FORMS.items():
        kib, predicted = saved[form] / 2**10, predicted_saved(n, form) / 2**10
        print(f"{n:>2} " + col(label, 18) + f"{kib:>9.1f} KiB {predicted:>8.1f} KiB  {saved[form] / saved['unsplit']:.0%}")
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
for case, r in moe_report["layer"].items():
    print(col(CASES[case], 13), tr("dropped", "ドロップ"), r["dropped"], "|",
          tr("rank 0's bytes per call", "ランク 0 の呼び出しごとのバイト数"), r["counted"])
    print(" " * 14 + tr("predicted from the routing", "ルーティングからの予想"), r["predicted"])

# %% tags=["nbval-ignore-output"]
for case, r in moe_report["layer"].items():
    print(col(CASES[case], 13) + tr("largest difference to the one-process layer", "1個のプロセスの層との最大の差")
          + f": {max(r['diffs'].values()):.1e}")

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
for name, r in (("balanced", balanced), ("unbalanced", unbalanced)):
    print(col(RUNS[name], 20) + tr("test accuracy", "テスト精度") + f" {r['accuracy']:.1%}" + tr(", ", "、")
          + tr("last loss", "最後の損失") + f" {r['losses'][-1]:.3f}")
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
for name, row in shares.items():
    print(col(RUNS[name], 20) + tr("largest expert's share per block", "ブロックごとの最大のエキスパートの割合") + ": "
          + ", ".join(f"{s:.0%}" for s in row))

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
# ## Summary
#
# - Sequence parallelism cuts the LayerNorms, residuals and dropout of a tensor-parallel block along the tokens.
#   `f` and `g` become an all-gather (backward: reduce-scatter) entering and a reduce-scatter (backward: all-gather)
#   leaving each region: the same bytes as the all-reduces, less activation memory, and no all-reduce in the block.
#   Replicated parameters that see a slice of the tokens need their gradients summed.
# - `parallelize_module` with `SequenceParallel`, `PrepareModuleInput` and `RowwiseParallel(output_layouts=Shard(1))`
#   does the same, message for message; `SavedBytes` measured the activations to the byte.
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
# - MoE は各トークンを `E` 個の MLP のうち `k` 個に送ります。容量が形状を固定してあふれた分をドロップし、Switch の補助損失 `E x sum f_i P_i` がルーターを均等な負荷へ向かわせます。
# - エキスパート並列はエキスパートを別々のランクに置き、層ごとに 3回のオールツーオール（個数、配送、回収）と、逆伝播でさらに 2回を使ってトークンを運びます。バイト数はルーティングから決まり、同じグループをルーティングする 1個のプロセスの層は、まったく同じものを計算します。
