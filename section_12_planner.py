# Chapter 12, the planner sections: "A layout planner", "On paper, at scale", "How to choose".
# Runs on its own after chapter 12's import cell, which provides:
#   import torch; from mparlib import planner; from mparlib.devices import pad; from mparlib.lang import tr
# and needs two more imports (in their own cell below): from dataclasses import replace; from mparlib.vit import SIZES, Block, vit

# %% [markdown]
# <!-- en -->
# ## A layout planner
#
# Every chapter so far ended with a formula next to a measurement: bytes per parameter and what ZeRO leaves per
# rank (chapter 9), the alpha-beta time of a collective and its ring traffic (chapter 8), the pipeline's bubble
# (chapter 10), the collectives of tensor, sequence, context and expert parallelism (chapters 10 and 11).
# `mparlib.planner` puts them together. It runs no model: from a few sizes it predicts what one rank holds and how
# long one step takes, for any layout, in a fraction of a second. Its inputs are four things:
#
# - `planner.ModelShape`: the sizes of a transformer (layers, width, heads and key/value heads, MLP width, tokens
#   per sample, vocabulary or patch inputs, experts and `top_k`). `ModelShape.from_vit(config)` describes the
#   course's ViT, `ModelShape.published(name)` four published models.
# - `planner.Cluster`: devices per node, memory and FLOP/s per device, and chapter 8's `alpha` (seconds per
#   collective) and `beta` (seconds per byte a rank sends) for the link inside a node and the link between nodes.
# - `planner.Layout`: the degrees `dp` (with the ZeRO stage `zero`, 3 being FSDP), `tp` (and `sp`), `cp`, `ep`,
#   `pp` with its `schedule`, `micro_batches` and `stages_per_rank`, and `recompute`. `Layout.check` refuses a
#   layout the model or the batch cannot take, and says what to change.
# - the global batch, in samples.
#
# The formulas, each from the chapter that measured it:
#
# | what | formula | from |
# |---|---|---|
# | parameters, gradients, optimizer state | `bytes_per_parameter` x this rank's weights (`local_parameters`: blocks' matrices / tp, experts / (ep tp), stages / pp), sharded over `dp x cp x ep` ranks by `zero_bytes_per_rank` | chapters 9, 10, 11 |
# | activations per block and token | `activation_bytes_per_layer`: the tensors the block saves, listed below | chapters 9-11 |
# | activations in flight | `in_flight`: GPipe `m`, 1F1B and ZBV `min(m, p)`, interleaved `min(m v, p v + p - 1) / v` stages | chapter 10 |
# | compute | `flops_per_sample x batch / (ranks x FLOP/s)`; forward + backward = 3 x forward; recomputation 4/3 of it | chapter 7 |
# | a collective | `collective_seconds`: `calls x alpha + bytes sent x beta`, bytes sent = `2 (n-1)/n` of the message for an all-reduce, `(n-1)/n` for reduce-scatter and all-gather, on the link that `link` picks | chapter 8 |
# | tensor (+ sequence) parallelism | 2 all-reduces forward, 2 backward per block (with `sp`: as many all-gather and reduce-scatter pairs, the same bytes) | chapters 10, 11 |
# | context parallelism | ring attention: K and V pass `cp - 1` times forward; backward once more, and their gradients `cp` times | chapter 11 |
# | expert parallelism | two all-to-alls forward and two backward per MoE layer, `(ep - 1) / ep` of the routed rows leave the rank | chapter 11 |
# | data parallelism | one all-reduce of the gradients per step (ZeRO-1/2: reduce-scatter + all-gather; ZeRO-3: an all-gather forward and backward per micro-batch and a reduce-scatter) | chapters 6, 9 |
# | pipeline | one activation forward and one gradient backward per micro-batch and stage; the bubble is `bubble_formula`'s share `b` of the step: `busy x b / (1 - b)` | chapter 10 |
#
# Ranks are numbered with the tensor-parallel ranks next to each other, then context, expert and data parallel
# ranks, and the pipeline stages outermost; a group whose ranks do not fit in one node uses the slower link.
# Nothing is assumed to overlap, except a share `overlap` of the data-parallel collectives (DDP's buckets of
# chapter 6 and FSDP's prefetching hide part of them behind the backward pass). Its default, 0, hides nothing; set
# it from a measurement of your own.
#
# First the sizes. The planner's parameter count of the small ViT is that of the real model:
# <!-- ja -->
# ## レイアウトのプランナー
#
# これまでの章は、どれも式と測定値を並べて終わりました。パラメータあたりのバイト数と ZeRO がランクに残す量（9章）、集合通信のアルファ・ベータモデルの時間とリングの通信量（8章）、パイプラインのバブル（10章）、テンソル並列、シーケンス並列、コンテキスト並列、エキスパート並列の集合通信（10章と 11章）です。`mparlib.planner` はこれらをまとめます。モデルは実行しません。いくつかのサイズから、1つのランクが持つメモリと 1ステップの時間を、どのレイアウトについても 1秒もかからずに予測します。入力は次の 4つです。
#
# - `planner.ModelShape`: Transformer のサイズです（層の数、幅、ヘッドとキー・バリューのヘッドの数、MLP の幅、1サンプルあたりのトークン数、語彙またはパッチの入力、エキスパートの数と `top_k`）。`ModelShape.from_vit(config)` はこのコースの ViT を、`ModelShape.published(name)` は公表されている 4つのモデルを表します。
# - `planner.Cluster`: ノードあたりのデバイスの数、デバイスごとのメモリと FLOP/s、そしてノード内のリンクとノード間のリンクについての 8章の `alpha`（集合通信 1回あたりの秒数）と `beta`（ランクが送る 1バイトあたりの秒数）です。
# - `planner.Layout`: 並列の次数です。`dp`（ZeRO のステージ `zero` と組み合わせます。3 は FSDP です）、`tp`（と `sp`）、`cp`、`ep`、`pp` と、その `schedule`、`micro_batches`、`stages_per_rank`、そして `recompute` です。`Layout.check` は、モデルやバッチが受け付けないレイアウトを拒み、何を変えればよいかを示します。
# - グローバルバッチ（サンプル数）。
#
# 使う式と、それを測った章です。
#
# | 対象 | 式 | 出典 |
# |---|---|---|
# | パラメータ、勾配、オプティマイザの状態 | `bytes_per_parameter` x このランクの重み（`local_parameters`: ブロックの行列は tp で、エキスパートは ep tp で、ステージは pp で割ります）を、`zero_bytes_per_rank` で `dp x cp x ep` 個のランクにシャーディング | 9章、10章、11章 |
# | ブロックとトークンあたりの活性化 | `activation_bytes_per_layer`: ブロックが保存するテンソル（下に列挙します） | 9〜11章 |
# | 処理中のマイクロバッチの活性化 | `in_flight`: GPipe は `m`、1F1B と ZBV は `min(m, p)`、インターリーブは `min(m v, p v + p - 1) / v` ステージ分 | 10章 |
# | 計算 | `flops_per_sample x バッチ / (ランク数 x FLOP/s)`。順伝播 + 逆伝播 = 順伝播の 3倍、再計算ではその 4/3 | 7章 |
# | 集合通信 1種類 | `collective_seconds`: `回数 x alpha + 送るバイト数 x beta`。送るバイト数はオールリデュースでメッセージの `2 (n-1)/n`、リデュース・スキャッターとオールギャザーで `(n-1)/n`。リンクは `link` が選びます | 8章 |
# | テンソル並列（+ シーケンス並列） | ブロックごとに順伝播で 2回、逆伝播で 2回のオールリデュース（`sp` では同じ数のオールギャザーとリデュース・スキャッターの対で、バイト数は同じ） | 10章、11章 |
# | コンテキスト並列 | リングアテンション: K と V は順伝播で `cp - 1` 回、逆伝播でもう一度回り、その勾配が `cp` 回回ります | 11章 |
# | エキスパート並列 | MoE の層ごとに順伝播で 2回、逆伝播で 2回のオールツーオール。振り分けた行の `(ep - 1) / ep` がランクの外へ出ます | 11章 |
# | データ並列 | 1ステップに 1回の勾配のオールリデュース（ZeRO-1/2 はリデュース・スキャッター + オールギャザー、ZeRO-3 はマイクロバッチごとに順伝播と逆伝播で 1回ずつのオールギャザーと、1回のリデュース・スキャッター） | 6章、9章 |
# | パイプライン | マイクロバッチとステージごとに、順伝播で活性化を 1回、逆伝播で勾配を 1回送ります。バブルはステップのうち `bubble_formula` の割合 `b` で、`busy x b / (1 - b)` です | 10章 |
#
# ランクの番号は、テンソル並列のランクを隣り合わせに置き、その外にコンテキスト並列、エキスパート並列、データ並列のランク、いちばん外にパイプラインのステージを置く順に振ります。1つのノードに収まらないグループは遅いほうのリンクを使います。重なる通信は仮定しません。例外はデータ並列の集合通信のうち `overlap` の割合だけです（6章の DDP のバケットや FSDP のプリフェッチは、その一部を逆伝播の陰に隠します）。既定値の 0 では何も隠れません。自分で測った値を設定してください。
#
# まずサイズです。プランナーが数える small の ViT のパラメータ数は、実際のモデルと同じです。

# %%
from dataclasses import replace

from mparlib.vit import SIZES, Block, vit

# %%
small = planner.ModelShape.from_vit(SIZES["small"])
counted = sum(p.numel() for p in vit("small").parameters())
print(tr("parameters: planner", "パラメータ数: プランナー"), f"{small.parameters():,}", "|",
      tr("the real ViT", "実際の ViT"), f"{counted:,}")
print(tr("FLOPs per sample (forward + backward):", "1サンプルあたりの FLOP 数（順伝播 + 逆伝播）:"),
      f"{small.flops_per_sample():,}")

# %%
assert small.parameters() == counted

# %% [markdown]
# <!-- en -->
# `flops_per_sample` counts every matrix product as `2 m n k`: per token and block the four projections, the
# scores `Q K^T` and their product with `V` (`4 s d` for `s` tokens of width `d`) and the MLP; then the patch
# embedding and the head; the backward pass does two products for each one of the forward pass, 3 x in all. The
# tests compare it with PyTorch's `FlopCounterMode` exactly (with the math attention kernel, whose products the
# counter sees); the one difference is the images' gradient, which the convention counts and nobody computes.
#
# Activations are where a formula is easiest to get wrong, so `activation_bytes_per_layer` lists what an
# `mparlib.vit.Block` really keeps for its backward pass, per token, with `e` bytes per value, width `d`, MLP
# width `f` and `a` heads:
#
# - each LayerNorm's input and output (`4 d` values) and each one's mean and inverse deviation (float32),
# - the queries, keys and values (`3 d`), and the attention's output (`d`), which is also the output projection's
#   input: the CPU's attention kernel writes its output in the token-major layout of its inputs, so the reshape
#   that puts the heads side by side is a view, not a copy,
# - the fused ("flash") attention kernel keeps one log-sum-exp per head and token (`a` values) instead of the
#   `a s` softmax weights that the math kernel keeps; PyTorch runs the fused kernel on the CPU (its backward
#   function is `ScaledDotProductFlashAttentionForCpuBackward0`),
# - the MLP's hidden activation before and after GELU (`2 f`).
#
# The cell counts every storage autograd saves while a block runs forward (a saved-tensor hook; weights left out)
# and sets it beside the formula:
# <!-- ja -->
# `flops_per_sample` は行列の積をどれも `2 m n k` と数えます。トークンとブロックごとに、4つの射影、スコア `Q K^T` とその `V` との積（幅 `d` のトークンが `s` 個なら `4 s d`）、そして MLP です。これにパッチの埋め込みと出力層を加えます。逆伝播は順伝播の積 1つごとに積を 2つ計算するので、全体で 3倍です。テストでは、PyTorch の `FlopCounterMode` と完全に一致することを確かめています（積がカウンタに見える math のアテンションのカーネルを使います）。違いは画像の勾配だけです。この慣習では数えますが、実際には誰も計算しません。
#
# 式をいちばん間違えやすいのは活性化です。そこで `activation_bytes_per_layer` は、`mparlib.vit.Block` が逆伝播のために実際に保存するものをトークンごとに列挙します。値 1つあたり `e` バイト、幅 `d`、MLP の幅 `f`、ヘッド数 `a` とします。
#
# - 2つの LayerNorm の入力と出力（`4 d` 個の値）と、それぞれの平均と標準偏差の逆数（float32）
# - クエリ、キー、バリュー（`3 d`）と、アテンションの出力（`d`）。アテンションの出力は出力の射影の入力でもあります。CPU のアテンションのカーネルは入力と同じトークン優先の配置で出力を書くので、ヘッドを横に並べ直す reshape はコピーではなくビューになります。
# - 融合した（flash）アテンションのカーネルは、math のカーネルが保存する `a s` 個の softmax の重みの代わりに、ヘッドとトークンごとに log-sum-exp を 1つ（`a` 個の値）保存します。PyTorch は CPU でこの融合したカーネルを使います（逆伝播の関数は `ScaledDotProductFlashAttentionForCpuBackward0` です）。
# - MLP の中間の活性化の GELU の前と後（`2 f`）
#
# 次のセルは、ブロックの順伝播の間に autograd が保存するストレージをすべて数え（保存済みテンソルのフックを使い、重みは除きます）、式と並べます。

# %%
def saved_bytes(module, x):
    """Bytes of every storage autograd keeps for the backward pass of ``module(x)``, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(kept.values())


rows = []
for size in ("smoke", "small"):
    c = SIZES[size]
    shape, batch = planner.ModelShape.from_vit(c), 8
    x = torch.randn(batch, shape.seq, c.dim, requires_grad=True)
    measured = saved_bytes(Block(c.dim, c.heads, c.hidden), x)
    rows.append((size, planner.activation_bytes_per_layer(shape, 4), batch * shape.seq, measured))
print(pad(tr("size", "サイズ"), 8), pad(tr("bytes per token", "トークンあたりのバイト数"), 26, ">"),
      pad(tr("x tokens", "x トークン数"), 12, ">"), pad(tr("measured", "測定値"), 12, ">"))
for size, per_token, tokens, measured in rows:
    print(pad(size, 8), pad(f"{per_token:,.0f}", 26, ">"), pad(f"{tokens:,}", 12, ">"), pad(f"{measured:,}", 12, ">"))

# %%
assert all(per_token * tokens == measured for _, per_token, tokens, measured in rows)

# %% [markdown]
# <!-- en -->
# The count is exact. The same list, with the knobs of a large model (16-bit values, dropout masks of one byte,
# the math kernel's softmax weights kept, a `4 d` MLP, the norms' statistics left out), gives the formula of
# Korthikanti et al. (*Reducing Activation Recomputation in Large Transformer Models*, 2022), `d (34 + 5 a s / d)`
# bytes per token and layer, and with tensor and sequence parallelism that, divided by `t`. The tests check both.
# With sequence parallelism the course's block of chapter 11 keeps the gathered LayerNorm outputs whole, where
# Megatron keeps them split and gathers them again for the backward pass: `regather=True` counts the latter.
#
# Now memory per rank, `memory_per_rank`, which returns a `planner.Memory`: the small ViT in float32 with Adam, a
# global batch of 64, on 8 ranks in seven layouts:
# <!-- ja -->
# 数は完全に一致します。同じ列挙に大きなモデルの設定（16ビットの値、1バイトのドロップアウトのマスク、math のカーネルが保存する softmax の重み、`4 d` の MLP、正規化の統計量は数えない）を与えると、Korthikanti ら（『Reducing Activation Recomputation in Large Transformer Models』、2022年）の式、トークンと層あたり `d (34 + 5 a s / d)` バイトになります。テンソル並列とシーケンス並列を使うと、それを `t` で割った値です。テストはこの両方を確かめます。なお、シーケンス並列では、11章のこのコースのブロックは集めた LayerNorm の出力を丸ごと保存します。Megatron は分けたまま保存し、逆伝播でもう一度集めます。後者を数えるには `regather=True` を指定します。
#
# 次はランクあたりのメモリで、`memory_per_rank` が `planner.Memory` を返します。small の ViT を float32 と Adam で、グローバルバッチ 64 で、8個のランクの 7つのレイアウトで訓練する場合です。

# %%
course_layouts = [planner.Layout(dp=8), planner.Layout(dp=8, zero=1), planner.Layout(dp=8, zero=3),
                  planner.Layout(dp=4, zero=3, tp=2), planner.Layout(dp=2, tp=2, pp=2, micro_batches=2),
                  planner.Layout(dp=4, tp=2, sp=True), planner.Layout(tp=8)]
memories = [planner.memory_per_rank(small, layout, 64, "fp32", "adam") for layout in course_layouts]
heads = [tr("layout", "レイアウト"), tr("params", "パラメータ"), tr("grads", "勾配"), tr("optimizer", "オプティマイザ"),
         tr("activations", "活性化"), tr("total", "合計")]
print(pad(heads[0], 26), *(pad(h, 14, ">") for h in heads[1:]), " MiB")
for layout, m in zip(course_layouts, memories):
    parts = (m.parameters, m.gradients, m.optimizer, m.activations, m.total)
    print(pad(layout.label(), 26), *(pad(f"{b / 2**20:.2f}", 14, ">") for b in parts))

# %%
ddp, zero1, zero3 = memories[:3]
assert zero3.total < zero1.total < ddp.total and ddp.activations == zero3.activations
assert zero1.optimizer == ddp.optimizer / 8 and zero3.parameters == ddp.parameters / 8
assert memories[-1].parameters < ddp.parameters / 4  # tp 8 splits the blocks' matrices, not the norms and biases

# %% [markdown]
# <!-- en -->
# ZeRO shrinks the state and leaves the activations alone; tensor parallelism shrinks both the weights and the
# activations inside the block, but every tensor-parallel rank works on the whole batch of its replica, so `tp 8`
# holds the whole batch's activations on every rank. The section after this one measures layouts like these on 8
# processes.
#
# `step_time` returns a `planner.StepTime`, the seconds of each part. On a published cluster,
# `Cluster.h100()`: servers of 8 H100 SXM 80 GB (data sheet: 989 TFLOP/s dense BF16, NVLink 4 at 900 GB/s per GPU,
# both directions together, so 450 GB/s each way), 400 Gb/s InfiniBand per GPU between servers (50 GB/s), and
# compute charged at 400 TFLOP/s per GPU, the rate Llama 3 405B trained at (*The Llama 3 Herd of Models*, 2024:
# 38 to 43% of the peak). The published figures give no latencies, so `alpha` is 0. Llama 3 8B on 64 GPUs, with
# tensor parallelism over each server, for Llama 3's batch of 2,048 sequences of 8,192 tokens:
# <!-- ja -->
# ZeRO は状態を小さくしますが、活性化は変えません。テンソル並列は重みとブロック内の活性化の両方を小さくしますが、テンソル並列のどのランクもそのレプリカのバッチ全体を処理するので、`tp 8` ではどのランクもバッチ全体の活性化を持ちます。この後の節では、このようなレイアウトを 8個のプロセスで測ります。
#
# `step_time` は `planner.StepTime` を返します。各部分の秒数です。公表されているクラスタ `Cluster.h100()` で試します。8枚の H100 SXM 80 GB を載せたサーバーで（データシートの値: 密な BF16 で 989 TFLOP/s、NVLink 4 は GPU あたり 900 GB/s で、これは両方向の合計なので片方向 450 GB/s）、サーバー間は GPU ごとに 400 Gb/s の InfiniBand（50 GB/s）です。計算は GPU あたり 400 TFLOP/s として数えます。これは Llama 3 405B の訓練で得られた値です（『The Llama 3 Herd of Models』、2024年: ピークの 38〜43%）。公表値にレイテンシはないので `alpha` は 0 です。Llama 3 8B を 64枚の GPU で、各サーバーの中でテンソル並列を使い、Llama 3 のバッチ（8,192トークンの系列 2,048本）で訓練する場合です。

# %%
h100 = planner.Cluster.h100()
llama8 = planner.ModelShape.published("llama3-8b")
example = planner.Layout(dp=8, tp=8, sp=True, zero=1, micro_batches=256)
t = planner.step_time(llama8, example, 2048, h100, "mixed")
m = planner.memory_per_rank(llama8, example, 2048, "mixed", regather=True)
print(f"{llama8.name}, 64 x H100, {example.label()}, 2048 x 8192 {tr('tokens', 'トークン')}")
names = {"compute": tr("compute", "計算"), "tp": tr("tensor parallel", "テンソル並列"),
         "cp": tr("context parallel", "コンテキスト並列"), "ep": tr("expert parallel", "エキスパート並列"),
         "pp": tr("pipeline sends", "パイプラインの送受信"), "bubble": tr("bubble", "バブル"),
         "dp_exposed": tr("data parallel (not hidden)", "データ並列（隠れない分）")}
for field, label in names.items():
    print(pad(label, 28), pad(f"{getattr(t, field):.3f} s", 12, ">"))
print(pad(tr("step", "1ステップ"), 28), pad(f"{t.total:.3f} s", 12, ">"))
print(pad(tr("memory per rank", "ランクあたりのメモリ"), 28), pad(f"{m.total / 1e9:.1f} GB", 12, ">"))

# %%
assert t.total == t.compute + t.tp + t.cp + t.ep + t.pp + t.bubble + t.dp_exposed
assert t.bubble == 0 and t.cp == t.ep == t.pp == 0 and t.dp == t.dp_exposed  # no pipeline, nothing overlapped
assert 0.15 < t.tp / t.total < 0.25  # the sentence below

# %% [markdown]
# <!-- en -->
# Tensor parallelism's all-reduces take about a fifth of this step: each of the 32 blocks all-reduces four
# `(8192, 4096)` activations for each of the 256 sequences of a replica. That layout fits easily, but it is not the
# best one; `plan` finds out which is.
# <!-- ja -->
# このステップの約 5分の 1 はテンソル並列のオールリデュースです。32個のブロックのそれぞれが、レプリカの 256本の系列ごとに `(8192, 4096)` の活性化を 4回オールリデュースします。このレイアウトは余裕をもって収まりますが、最善ではありません。どれが最善かは `plan` が調べます。

# %% [markdown]
# <!-- en -->
# ## On paper, at scale
#
# `planner.layouts` lists every valid layout of a number of GPUs over small grids of degrees (`dp` is what the
# others leave); `planner.plan` predicts each one and returns `planner.Plan` rows, those that fit in the device's
# memory first, each group ordered by predicted step time. The grid here: `tp` 1 to 8, `pp` 1 to 16, ZeRO-1 or
# ZeRO-3, 1F1B or interleaved 1F1B with two stages per rank, full recomputation or none, one sequence per
# micro-batch; 16-bit compute with fp32 Adam state (16 bytes per parameter, chapter 9), Megatron's sequence
# parallelism (`regather=True`), and Llama 3's batch of 16M tokens for every model. The table shows the three
# fastest layouts that fit, their memory per rank, step time, the bubble's share of the step, and the model FLOP/s
# per GPU they imply (the model's FLOPs, recomputation not counted, per second and GPU).
# <!-- ja -->
# ## 大規模な構成の机上検討
#
# `planner.layouts` は、与えた GPU の数について、次数の小さなグリッドの上で有効なレイアウトをすべて挙げます（`dp` は他の次数の残りです）。`planner.plan` はそれぞれを予測し、`planner.Plan` の行を返します。デバイスのメモリに収まるものが先で、それぞれの中では予測したステップの時間の順です。ここでのグリッドは、`tp` が 1〜8、`pp` が 1〜16、ZeRO-1 か ZeRO-3、1F1B かランクあたり 2ステージのインターリーブ 1F1B、活性化の再計算は全部するかしないか、マイクロバッチは系列 1本です。計算は 16ビット、Adam の状態は fp32（パラメータあたり 16バイト、9章）、シーケンス並列は Megatron の方式（`regather=True`）、バッチはどのモデルも Llama 3 の 16M トークンです。表には、収まるレイアウトのうち速い 3つについて、ランクあたりのメモリ、ステップの時間、ステップに占めるバブルの割合、そこから導かれる GPU あたりのモデルの FLOP/s（再計算を除いたモデルの FLOP 数を、秒と GPU で割った値）を示します。

# %%
GRID = dict(tp=(1, 2, 4, 8), pp=(1, 2, 4, 8, 16), zero=(1, 3), schedules=("1f1b", "interleaved1f1b"),
            recompute=(False, True))
BATCH = 2048  # Llama 3's 16M tokens per step: 2,048 sequences of 8,192


def ranked(model, world, batch=BATCH, cluster=h100, **grid):
    """The planner's ranking of every layout of ``world`` GPUs for ``model`` (16-bit compute, fp32 Adam state)."""
    return planner.plan(model, cluster, world, batch, precision="mixed", regather=True, **{**GRID, **grid})


def tflops(model, row, world, batch=BATCH):
    """Model FLOP/s per GPU of a plan row, in TFLOP/s (recomputation not counted as useful work)."""
    return model.flops_per_sample() * batch / (row.time.total * world) / 1e12


def show(model, world, rows, top=3):
    """The fastest ``top`` layouts that fit, one line each."""
    fits = [r for r in rows if r.fits]
    print(f"{model.name}, {world:,} x H100: " + tr(f"{len(fits)} of {len(rows)} layouts fit in 80 GB",
                                                   f"{len(rows)}個のレイアウトのうち {len(fits)}個が 80 GB に収まる"))
    print("  ", pad(tr("layout", "レイアウト"), 36), pad("GB", 7, ">"), pad(tr("step s", "ステップ s"), 11, ">"),
          pad(tr("bubble", "バブル"), 8, ">"), pad("TFLOP/s", 9, ">"))
    for r in fits[:top]:
        print("  ", pad(r.layout.label(), 36), pad(f"{r.memory.total / 1e9:.1f}", 7, ">"),
              pad(f"{r.time.total:.2f}", 11, ">"), pad(f"{r.time.bubble / r.time.total:.0%}", 8, ">"),
              pad(f"{tflops(model, r, world):.0f}", 9, ">"))


dense = {}
for name in ("llama3-8b", "llama3-70b"):
    model = planner.ModelShape.published(name)
    for world in (64, 512, 8192):
        dense[name, world] = ranked(model, world)
        show(model, world, dense[name, world])

# %%
firsts = {key: next(r for r in rows if r.fits) for key, rows in dense.items()}
assert all(r.fits == (r.memory.total <= 80e9) for rows in dense.values() for r in rows)
assert all(first.layout.tp <= h100.devices_per_node for first in firsts.values())  # tp stays inside a server
plain = next(r for r in dense["llama3-8b", 64] if r.layout == planner.Layout(dp=64, zero=1, micro_batches=32))
assert not plain.fits and firsts["llama3-8b", 64].layout.pp == 2  # plain ZeRO-1 misses 80 GB; pp 2 fits
assert [firsts["llama3-70b", w].layout.tp for w in (64, 512, 8192)] == [4, 4, 8]
assert firsts["llama3-70b", 8192].layout.pp == 1 and firsts["llama3-70b", 64].layout.pp > 1

# %% [markdown]
# <!-- en -->
# What the planner's choices say:
#
# - **Memory first.** Llama 3 8B on 64 GPUs with plain ZeRO-1 data parallelism needs a little more than 80 GB
#   per rank (the 16 bytes per parameter replicated but for the optimizer share, plus the activations of 32 blocks
#   and the output scores of a 128,256-word vocabulary); two pipeline stages halve both the weights and the
#   activations per rank and cost a bubble of one or two percent with 64 micro-batches, less than recomputing
#   (a third more compute) or ZeRO-3 (the weights gathered for each micro-batch).
# - **The least tensor parallelism that fits.** Tensor parallelism's traffic per rank grows with `t`
#   (`2 (t-1)/t` of each activation, and each rank runs `t` times more blocks' worth of tokens than with a pipeline
#   of the same size), so 70B on 64 and 512 GPUs uses `tp 4` with a pipeline rather than `tp 8`.
# - **The batch limits data parallelism.** On 8,192 GPUs a batch of 2,048 sequences leaves one sequence per replica
#   with `tp 4` alone and two with `tp 4` and two stages: too few micro-batches for a pipeline to fill (with `m = 2`
#   the bubble `(p-1)/(v m + p - 1)` is a fifth of the step even interleaved), so the planner moves to `tp 8`
#   without a pipeline, and the model FLOP/s per GPU fall (about 270 to 280 against 350 to 390 on fewer GPUs): the
#   same batch on more GPUs leaves each with less work to hide its communication behind.
# - **Tensor parallelism stays inside a server**: `tp 8` over NVLink, never across the 50 GB/s links.
#
# A mixture of experts changes the balance. Mixtral 8x7B (32 layers, width 4096, 32 heads with 8 key/value heads,
# 8 experts of width 14336 of which each token uses 2, vocabulary 32,000; *Mixtral of Experts*, 2024) has 46.7B
# parameters, most of them in the experts, but each token only computes with 2 of the 8. Expert parallelism
# (`ep`) splits the experts among ranks that still take different samples:
# <!-- ja -->
# プランナーの選択からわかること:
#
# - **まずメモリ。** Llama 3 8B を 64枚の GPU で ZeRO-1 のデータ並列だけで訓練すると、ランクあたり 80 GB を少し超えます（パラメータあたり 16バイトのうちオプティマイザの分以外は複製され、そこに 32個のブロックの活性化と、128,256語の語彙の出力スコアが加わります）。パイプラインを 2ステージにすると、ランクあたりの重みと活性化がどちらも半分になり、マイクロバッチが 64個あればバブルは 1〜2% です。これは再計算（計算が 3分の 1 増えます）や ZeRO-3（マイクロバッチごとに重みを集めます）より安く済みます。
# - **収まる範囲でいちばん小さいテンソル並列。** テンソル並列のランクあたりの通信量は `t` とともに増えます（活性化ごとにその `2 (t-1)/t`。さらに、同じ大きさのパイプラインと比べて、各ランクは `t` 倍のブロック分のトークンを処理します）。そのため 70B を 64枚と 512枚の GPU で訓練するときは、`tp 8` ではなく `tp 4` とパイプラインを組み合わせます。
# - **データ並列はバッチで制限されます。** 8,192枚の GPU では、系列 2,048本のバッチは、`tp 4` だけならレプリカあたり 1本、`tp 4` と 2ステージでも 2本にしかなりません。パイプラインを埋めるにはマイクロバッチが足りません（`m = 2` では、インターリーブしてもバブル `(p-1)/(v m + p - 1)` がステップの 5分の 1 になります）。そこでプランナーはパイプラインなしの `tp 8` を選び、GPU あたりのモデルの FLOP/s は下がります（GPU が少ない場合の 350〜390 に対して約 270〜280）。同じバッチを多くの GPU で分けると、GPU ごとの仕事が減り、通信を隠す余地が小さくなるからです。
# - **テンソル並列はサーバーの中に置きます。** `tp 8` は NVLink の上で使い、50 GB/s のリンクをまたぐことはありません。
#
# MoE はこのバランスを変えます。Mixtral 8x7B（32層、幅 4096、32個のヘッドと 8個のキー・バリューのヘッド、幅 14336 のエキスパートが 8個で各トークンはそのうち 2個を使う、語彙 32,000。『Mixtral of Experts』、2024年）のパラメータは 46.7B で、その大半がエキスパートにありますが、各トークンが計算に使うのは 8個のうち 2個だけです。エキスパート並列（`ep`）は、別々のサンプルを受け持つランクの間でエキスパートを分けます。

# %%
mixtral = planner.ModelShape.published("mixtral-8x7b")
moe = {world: ranked(mixtral, world, ep=(1, 2, 4, 8)) for world in (64, 512)}
for world, rows in moe.items():
    show(mixtral, world, rows, top=4)

# %%
for world, rows in moe.items():
    first = next(r for r in rows if r.fits)
    assert first.layout.ep > 1 and first.layout.tp * first.layout.ep <= h100.devices_per_node  # one server
    assert 0 < first.time.ep < first.time.compute / 20

# %% [markdown]
# <!-- en -->
# The first choice on both sizes puts 4 experts' worth of ranks and `tp 2` inside one server: expert parallelism
# divides the largest part of the weights by 4 without the bubble of a pipeline or tensor parallelism's
# all-reduces, and its all-to-alls carry each token's 2 rows of width 4096 only, less than a twentieth of the compute
# time on NVLink. The assumption that flatters it: the planner spreads tokens evenly over the experts (chapter 11
# measured how uneven a router can be, and a full expert drops tokens or waits).
#
# Now the runs this can be checked against. Llama 3 405B (126 layers, width 16384, 128 heads with 8 key/value
# heads, MLP 53248, vocabulary 128,256) was trained with a global batch of 16M tokens in sequences of 8,192 on
# servers of 8 H100s connected by NVLink inside and 400 Gb/s between them, with these layouts and per-GPU rates
# (*The Llama 3 Herd of Models*, 2024): on 8,192 GPUs TP 8, CP 1, PP 16 at 430 TFLOP/s; on 16,384 GPUs TP 8, CP 1,
# PP 16 at 400; for long context (131,072 tokens) TP 8, CP 16, PP 16 at 380. For each, the planner's rank of that
# layout among those that fit, its memory, the model FLOP/s it predicts, and the planner's own first choice. Two
# clusters: `Cluster.h100()`, compute at the 400 TFLOP/s Llama 3 reached, and the same with the data sheet's
# 989 TFLOP/s.
# <!-- ja -->
# どちらの規模でも、第 1候補はエキスパート並列 4 と `tp 2` を 1台のサーバーの中に置きます。エキスパート並列は、重みのいちばん大きな部分を、パイプラインのバブルもテンソル並列のオールリデュースもなしに 4で割ります。オールツーオールで運ぶのは各トークンの幅 4096 の行 2本だけで、NVLink の上では計算時間の 20分の 1 に届きません。これを有利に見せている仮定もあります。プランナーはトークンがエキスパートに均等に分かれると仮定しています（11章では、ルーターの割り振りがどれほど偏りうるかを測りました。いっぱいになったエキスパートはトークンを落とすか、待たせます）。
#
# 次は、確かめる相手になる実際の訓練です。Llama 3 405B（126層、幅 16384、128個のヘッドと 8個のキー・バリューのヘッド、MLP 53248、語彙 128,256）は、グローバルバッチ 16M トークン、系列の長さ 8,192 で、中を NVLink で、サーバー間を 400 Gb/s でつないだ 8枚の H100 のサーバーで訓練されました。レイアウトと GPU あたりの速さは次のとおりです（『The Llama 3 Herd of Models』、2024年）。8,192枚の GPU で TP 8、CP 1、PP 16、430 TFLOP/s。16,384枚の GPU で TP 8、CP 1、PP 16、400 TFLOP/s。長いコンテキスト（131,072トークン）では TP 8、CP 16、PP 16、380 TFLOP/s。それぞれについて、収まるレイアウトの中でのそのレイアウトの順位、メモリ、予測したモデルの FLOP/s、プランナー自身の第 1候補を示します。クラスタは 2つです。Llama 3 が得た 400 TFLOP/s で計算を数える `Cluster.h100()` と、データシートの 989 TFLOP/s で数えるものです。

# %%
peak = planner.Cluster.h100(flops_per_s=989e12)
PUBLISHED = [(8192, 8192, BATCH, 1, 430), (16384, 8192, BATCH, 1, 400), (16384, 131072, 128, 16, 380)]
print(pad("GPUs", 7, ">"), pad(tr("tokens", "トークン"), 8, ">"), pad(tr("published", "公表値"), 10, ">"),
      pad("FLOP/s", 8, ">"), pad(tr("rank", "順位"), 8, ">"), pad("GB", 6, ">"), pad("TFLOP/s", 8, ">"), " ",
      pad(tr("planner's first", "プランナーの第 1候補"), 38), pad("TFLOP/s", 8, ">"))
llama405 = {}
for world, seq, batch, cp, rate in PUBLISHED:
    model = planner.ModelShape.published("llama3-405b", seq=seq)
    dp = world // (8 * cp * 16)
    theirs = planner.Layout(dp=dp, tp=8, sp=True, cp=cp, pp=16, schedule="interleaved1f1b", stages_per_rank=2,
                            micro_batches=batch // dp, zero=1, recompute=True)
    for cluster in (h100, peak):
        rows = ranked(model, world, batch, cluster=cluster, cp=(cp,))
        fits = [r for r in rows if r.fits]
        mine = next(r for r in rows if r.layout == theirs)
        bare = next(r for r in rows if r.layout == replace(theirs, recompute=False))
        llama405[world, seq, cluster.flops_per_s] = (mine, bare, fits, tflops(model, mine, world, batch))
        print(pad(f"{world:,}", 7, ">"), pad(f"{seq // 1024}K", 8, ">"), pad(rate, 10, ">"),
              pad(f"{cluster.flops_per_s / 1e12:.0f}T", 8, ">"), pad(f"{fits.index(mine) + 1}/{len(fits)}", 8, ">"),
              pad(f"{mine.memory.total / 1e9:.1f}", 6, ">"), pad(f"{tflops(model, mine, world, batch):.0f}", 8, ">"),
              " ", pad(fits[0].layout.label(), 38), pad(f"{tflops(model, fits[0], world, batch):.0f}", 8, ">"))
print(tr("the published layouts: ", "公表されたレイアウト: ") + ", ".join(sorted({r[0].layout.label() for r in llama405.values()})))

# %%
for (world, seq, rate), (mine, bare, fits, predicted) in llama405.items():
    assert mine.fits and not bare.fits  # the planner needs recomputation to fit these layouts in 80 GB
    assert fits.index(mine) < 4 and mine.layout.recompute
    if rate == 400e12:
        assert predicted < 400  # compute alone is charged at 400: every other part only adds time
at_peak = {(w, s): v[3] for (w, s, r), v in llama405.items() if r == 989e12}
assert at_peak[8192, 8192] > at_peak[16384, 8192]  # 430 > 400, as published
assert at_peak[16384, 131072] > at_peak[16384, 8192]  # published 380 < 400: the planner disagrees
long = planner.ModelShape.published("llama3-405b", seq=131072)
assert ranked(long, 16384, 128, cp=(1,)) == []  # without context parallelism: nothing valid
d, s = long.dim, long.seq
scores = 4 * s * d / (4 * s * d + 2 * (2 * d * d + 2 * d * long.kv_dim) + 2 * 3 * d * long.hidden)
assert round(scores, 2) == 0.57

# %% [markdown]
# <!-- en -->
# Where the planner agrees with the published runs:
#
# - Each published layout is among the planner's first four of 15 to 28 that fit, and with compute at the data
#   sheet's rate the two 8K-token layouts are its first choice: tensor parallelism over the 8 GPUs of a server,
#   a 16-stage pipeline, the rest data parallel. Above them it ranks layouts with fewer stages and more data
#   parallelism, by one or two percent for the 8K runs, well inside what a model of this kind can tell apart (for
#   long context at 400 TFLOP/s, by 15%: see the bubble below).
# - More GPUs for the same batch lower the rate per GPU: 8,192 GPUs reach more FLOP/s per GPU than 16,384, as
#   published (430 and 400). With 16 sequences per replica instead of 32, the bubble's share grows.
# - Long context needs context parallelism: a step of 128 sequences of 131,072 tokens cannot even occupy 16,384
#   GPUs without splitting sequences (`tp 8` and `pp 16` leave 128 replicas of one sequence each, and a pipeline
#   needs at least as many micro-batches as stages); without `cp` the grid has no valid layout.
#
# Where it does not:
#
# - **Recomputation.** Under the planner's count none of the three published layouts fits in 80 GB without
#   recomputing activations (135 and 96 GB per rank), and with full recomputation they fit with room to spare
#   (about 20 GB). The truth lies between: production systems recompute only selected parts of a block (the
#   attention's softmax, in Korthikanti et al.) and keep the rest, which the planner's all-or-nothing switch
#   cannot express; full recomputation costs a third more compute, which makes the predicted rates low.
# - **The bubble.** With 16 sequences per replica (16,384 GPUs) `bubble_formula` charges the interleaved 16-stage
#   pipeline `15 / (2 x 16 + 15)`, a third of the step; Llama 3 still reached 400 and 380 TFLOP/s there, so its
#   schedule lost less than the formula for equal stages says.
# - **The rate itself.** With compute charged at 400 TFLOP/s the predicted model FLOP/s are far below the
#   published 430, 400 and 380, necessarily: Llama 3's 400 is already the end-to-end rate, bubble and
#   communication included, and the planner adds its own on top. With the data sheet's 989 TFLOP/s the
#   predictions land near the published rates, above them for 8,192 GPUs and long context and slightly below
#   for 16,384, though real kernels run well below the peak: the planner charges the pipeline a fuller bubble and
#   more recomputation than the published runs paid (their schedule and memory savings are their own).
# - **Long context is predicted faster than the 8K run on the same GPUs, and it was slower.** At 131,072 tokens
#   the scores `Q K^T` and `A V` are 57% of the FLOPs the planner counts in a block, and it counts every one of them at full
#   speed; a causal model computes only half the `s x s` scores, ring attention's blocks are unbalanced unless the
#   sequence is split cleverly (chapter 11), and attention kernels run further from the peak than large matrix
#   products. None of this is in the formulas.
#
# The planner, then, is a tool for the first decision (what fits, which dimension to use, where each group goes),
# not a stopwatch: its seconds are only as good as the FLOP/s and the links it is given, and those must be measured.
# <!-- ja -->
# プランナーが公表された訓練と一致する点:
#
# - 公表されたレイアウトはどれも、収まる 15〜28個のレイアウトの中でプランナーの上位 4つに入ります。データシートの速さで計算を数えると、8K トークンの 2つのレイアウトはプランナーの第 1候補です。サーバーの 8枚の GPU でテンソル並列、16ステージのパイプライン、残りはデータ並列という組み合わせです。これより上に並ぶのはステージを減らしてデータ並列を増やしたレイアウトで、8K の訓練では差は 1〜2% です。この種のモデルが区別できる範囲をはるかに下回ります（400 TFLOP/s で数えた長いコンテキストでは 15% です。下のバブルの項を見てください）。
# - 同じバッチを多くの GPU で分けると、GPU あたりの速さは下がります。公表値（430 と 400）と同じく、8,192枚のほうが 16,384枚より GPU あたりの FLOP/s が高くなります。レプリカあたりの系列が 32本から 16本に減り、バブルの割合が大きくなるからです。
# - 長いコンテキストにはコンテキスト並列が必要です。131,072トークンの系列 128本のステップでは、系列を分けなければ 16,384枚の GPU に仕事を行き渡らせることさえできません（`tp 8` と `pp 16` で、系列 1本ずつのレプリカが 128個になり、パイプラインにはステージの数以上のマイクロバッチが必要です）。`cp` なしでは、グリッドに有効なレイアウトが 1つもありません。
#
# 一致しない点:
#
# - **再計算。** プランナーの数え方では、公表された 3つのレイアウトはどれも、活性化を再計算しなければ 80 GB に収まりません（ランクあたり 135 GB と 96 GB）。すべて再計算すると、余裕をもって収まります（約 20 GB）。実際はその間にあります。実用のシステムはブロックの一部だけを再計算し（Korthikanti らではアテンションの softmax）、残りは保存しますが、プランナーの「全部かなしか」の切り替えではこれを表せません。全部の再計算は計算を 3分の 1 増やすので、予測する速さは低めになります。
# - **バブル。** レプリカあたり系列 16本（16,384枚の GPU）では、`bubble_formula` はインターリーブした 16ステージのパイプラインに `15 / (2 x 16 + 15)`、つまりステップの 3分の 1 を課します。それでも Llama 3 はそこで 400 と 380 TFLOP/s を出したので、そのスケジュールの損失は、等しいステージを仮定した式が示すより小さかったことになります。
# - **速さそのもの。** 計算を 400 TFLOP/s で数えると、予測したモデルの FLOP/s は公表値の 430、400、380 を大きく下回ります。これは当然です。Llama 3 の 400 はバブルも通信も含めた最終的な速さで、プランナーはその上に自分の分を加えるからです。データシートの 989 TFLOP/s で数えると、予測は公表値の近くに来ます。8,192枚と長いコンテキストでは公表値より上、16,384枚ではわずかに下です。実際のカーネルはピークよりかなり遅いのに、そうなります。プランナーは、公表された訓練が払ったよりも大きなバブルと多くの再計算をパイプラインに課しているからです（スケジュールとメモリの節約の工夫は、それぞれの訓練独自のものです）。
# - **長いコンテキストは、同じ GPU での 8K の訓練より速いと予測されますが、実際は遅くなりました。** 131,072トークンでは、スコア `Q K^T` と `A V` がプランナーの数えるブロックの FLOP 数の 57% を占め、プランナーはそのすべてを全速で数えます。因果的なモデルが計算する `s x s` のスコアは半分だけで、リングアテンションのブロックは系列をうまく分けないと偏り（11章）、アテンションのカーネルは大きな行列の積よりピークから遠いところで動きます。どれも式には入っていません。
#
# つまりプランナーは、最初の判断（何が収まるか、どの次元を使うか、各グループをどこに置くか）のための道具で、ストップウォッチではありません。秒数の確かさは、与えた FLOP/s とリンクの値の確かさで決まり、それらは測らなければなりません。

# %% [markdown]
# <!-- en -->
# ## How to choose
#
# A procedure for a model and a cluster of your own, in the order the chapters built it:
#
# 1. **Measure the cluster.** The FLOP/s one device reaches on your model's matrix sizes while all devices
#    compute (chapter 7 measured a device's peak with a large matrix product), and `alpha` and `beta` of an all-reduce inside a node and across nodes with
#    chapter 8's `bandwidth_worker` and `fit_alpha_beta`, at the group sizes you mean to use;
#    `Cluster.from_fit(fit, ranks, ...)` turns a fit into the planner's link. Check the memory a device really
#    gives you (chapter 9's `PeakMemory` on one step) and leave room for what the planner does not count.
# 2. **Fit memory first.** Bytes per parameter x parameters (chapter 9) tells whether data parallelism alone can
#    hold the state; ZeRO-1 or 2 removes most of the optimizer's share for little traffic, ZeRO-3 (FSDP) the rest
#    for an all-gather per micro-batch. Then the activations: `activation_bytes_per_layer` x tokens x blocks x the
#    schedule's micro-batches in flight.
# 3. **Tensor parallelism inside a node, no more of it than needed.** It splits weights and activations together,
#    but its traffic per rank grows with `t` and sits on the critical path; keep its group on the fastest link,
#    with sequence parallelism (chapter 11) for the activations between its regions.
# 4. **A pipeline across nodes** when the model is still too large: its messages are small, point to point, and
#    cross the slow links well; give it at least 4 to 8 times more micro-batches than stages, or interleave
#    (chapter 10), or both, to keep the bubble small.
# 5. **Context parallelism for long sequences** when one sequence's activations do not fit even with tensor and
#    sequence parallelism; **expert parallelism for mixtures of experts**, inside a node when the all-to-alls are
#    large.
# 6. **Data parallelism for the rest**, up to what the global batch allows: more replicas mean fewer micro-batches
#    each, and at some point the bubble or the communication eats the gain.
# 7. **Rank with the planner, then measure the first few.** Run `plan` with your measured cluster, take the first
#    layouts that fit with some margin, and time a few steps of each; where measurement and prediction disagree,
#    find which part (compute, a collective, the bubble) is off, as this chapter's measurements on 8 processes do.
#
# This is where the course ends. It started with `nn.DataParallel` on one machine and a question about why two GPUs
# can be slower than one; it ends with the tools to answer that question for any layout: build each method from its
# messages, check it against one process, measure what it costs, and predict before you spend a cluster's hours.
# <!-- ja -->
# ## レイアウトの選び方
#
# 自分のモデルと自分のクラスタのための手順です。章を進めてきた順に並べます。
#
# 1. **手元のクラスタを測ります。** すべてのデバイスが同時に計算しているときに、1つのデバイスが自分のモデルの行列のサイズで出せる FLOP/s（7章では大きな行列の積でデバイスのピークを測りました）と、ノード内とノード間のオールリデュースの `alpha` と `beta`（8章の `bandwidth_worker` と `fit_alpha_beta`、使うつもりのグループのサイズで）を測ります。`Cluster.from_fit(fit, ranks, ...)` は、当てはめた結果をプランナーのリンクに変えます。デバイスで実際に使えるメモリも確かめ（9章の `PeakMemory` で 1ステップ分）、プランナーが数えないものの分の余裕を残します。
# 2. **まずメモリに収めます。** パラメータあたりのバイト数 x パラメータ数（9章）で、データ並列だけで状態を持てるかがわかります。ZeRO-1 や 2 は少ない通信でオプティマイザの分の大半をなくし、ZeRO-3（FSDP）はマイクロバッチごとのオールギャザーと引き換えに残りもなくします。次に活性化です。`activation_bytes_per_layer` x トークン数 x ブロック数 x スケジュールで処理中のマイクロバッチの数です。
# 3. **テンソル並列はノードの中で、必要な分だけ使います。** 重みと活性化をまとめて分けますが、ランクあたりの通信量は `t` とともに増え、しかもクリティカルパスの上にあります。グループはいちばん速いリンクの上に置き、領域の間の活性化にはシーケンス並列（11章）を使います。
# 4. **それでもモデルが大きすぎれば、ノードをまたいでパイプラインを使います。** メッセージは小さい 1対1通信で、遅いリンクをまたいでも困りません。バブルを小さく保つため、マイクロバッチの数をステージの数の 4〜8倍以上にするか、インターリーブする（10章）か、その両方にします。
# 5. **長い系列にはコンテキスト並列を使います。** テンソル並列とシーケンス並列を使っても 1本の系列の活性化が収まらないときです。**MoE にはエキスパート並列を使います。** オールツーオールが大きければノードの中に置きます。
# 6. **残りはデータ並列にします。** グローバルバッチが許す範囲までです。レプリカを増やすとレプリカごとのマイクロバッチは減り、どこかでバブルや通信が利得を食いつぶします。
# 7. **プランナーで順位をつけ、上位のいくつかを測ります。** 測ったクラスタで `plan` を実行し、余裕をもって収まる上位のレイアウトを選んで、それぞれ数ステップの時間を測ります。測定と予測が食い違ったら、どの部分（計算、ある集合通信、バブル）がずれているのかを突き止めます。この章の 8個のプロセスでの測定がそうしているようにです。
#
# ここでこのコースは終わりです。1台のマシンでの `nn.DataParallel` と、「なぜ GPU 2枚のほうが 1枚より遅いことがあるのか」という問いから始まりました。そして、その問いにどのレイアウトについても答えるための道具で終わります。それぞれの方法をメッセージから組み立て、1個のプロセスと比べて確かめ、何がかかるかを測り、クラスタの時間を使う前に予測することです。
