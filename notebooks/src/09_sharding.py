# %% [markdown]
# <!-- en -->
# # 9. Sharding: when the model no longer fits
#
# Data parallelism, as chapters 6 and 8 built it, keeps a **full copy** of everything on every device: the
# parameters, their gradients and the optimizer's state. Training with Adam in float32 costs 16 bytes per
# parameter, so a 7-billion-parameter model needs 112 GB on each device before a single activation is stored,
# more than any one GPU holds. Adding devices does not help: each one holds the same 112 GB.
#
# **Sharding** cuts these copies into N pieces, one per rank, and fetches a missing piece by communication just
# before it is needed. This is ZeRO (the Zero Redundancy Optimizer of DeepSpeed) and PyTorch's FSDP (Fully
# Sharded Data Parallel). The model is the chapter's small Vision Transformer on Fashion-MNIST, whose transformer
# blocks are the units that FSDP shards; everything runs on CPU processes with `gloo`, and with `nccl` on GPUs.
# In this chapter you will
#
# - count where the memory of training goes, byte by byte, for published model sizes and for our own model,
# - build ZeRO from the collectives of chapter 8 (reduce-scatter the gradients, update one shard, all-gather the
#   parameters), prove it computes exactly what DDP computes, and measure it beside PyTorch's ZeRO-1, then build a
#   real ZeRO-2, whose gradients are reduce-scattered bucket by bucket during the backward pass,
# - shard the model with FSDP2's `fully_shard` on 1, 2 and 4 processes and measure what each rank holds, what it
#   sends, and what mixed precision changes; and check that it trains exactly like one process, also with gradient
#   accumulation, with explicit forward prefetch and as HSDP on a 2 x 2 mesh,
# - measure the peak memory per rank, the most a rank holds at any moment of a step, of DDP, ZeRO-1, ZeRO-2 and FSDP2
#   on 1, 2 and 4 ranks,
# - trade computation for activation memory with activation checkpointing,
# - save a sharded checkpoint from 2 ranks and load it into 4 ranks and into one process, and kill a save
#   half-way to see that nothing is lost,
# - decide which of DDP, ZeRO-1/2/3 and FSDP to use, from the numbers measured here.
# <!-- ja -->
# # 9. シャーディング: デバイス 1つに収まらなくなったモデル
#
# 6章と 8章で作ったデータ並列は、すべてのデバイスに、パラメータ、その勾配、オプティマイザの状態の**完全なコピー**を持たせます。float32 で Adam を使って訓練すると、パラメータ 1つあたり 16バイトかかります。70億パラメータのモデルなら、活性化を 1つも保存しないうちから、各デバイスに 112 GB が必要です。これだけのメモリを持つ GPU は 1枚もありません。デバイスを増やしても解決しません。どのデバイスも同じ 112 GB を抱えるからです。
#
# **シャーディング**は、このコピーを N 個に切り分けてランクごとに 1片ずつ持たせ、足りない部分は必要になる直前に通信で取り寄せます。これが ZeRO（DeepSpeed の Zero Redundancy Optimizer）と PyTorch の FSDP（Fully Sharded Data Parallel）です。モデルはこの章用の小さな Vision Transformer で、Fashion-MNIST を学習します。その Transformer ブロックが、FSDP がシャーディングする単位になります。すべて `gloo` を使う CPU のプロセスで動き、GPU では `nccl` で動きます。この章では次のことを学びます。
#
# - 訓練のメモリがどこに使われるのかを、公表されているモデルの大きさとこの章のモデルについて、バイト単位で数えます。
# - 8章の集合通信から ZeRO を作ります。勾配をリデュース・スキャッター（reduce-scatter）し、シャード 1つだけを更新し、パラメータをオールギャザー（all-gather）します。DDP とまったく同じ計算になることを証明し、PyTorch の ZeRO-1 と並べて測ります。さらに、逆伝播の途中でバケットごとに勾配をリデュース・スキャッターする本来の ZeRO-2 を作ります。
# - FSDP2 の `fully_shard` でモデルを 1個、2個、4個のプロセスにシャーディングし、各ランクが持つもの、送るもの、混合精度で何が変わるかを測ります。さらに、1個のプロセスとまったく同じように訓練が進むことを、勾配累積、順伝播の明示的な先読み、2 × 2 のメッシュでの HSDP の場合も含めて確かめます。
# - DDP、ZeRO-1、ZeRO-2、FSDP2 について、ランク 1個、2個、4個での 1ランクあたりのピークメモリ（ステップの途中でランクがいちばん多く持つ瞬間の量）を測ります。
# - 活性化の再計算（activation checkpointing）で、計算と引き換えに活性化のメモリを減らします。
# - シャーディングしたチェックポイントを 2個のランクから保存し、4個のランクと 1個のプロセスに読み込みます。保存を途中で強制終了しても、何も失われないことも確かめます。
# - ここで測った数値をもとに、DDP、ZeRO-1/2/3、FSDP のどれを使うべきかを判断します。

# %% tags=["nbval-ignore-output"]
import tempfile
from pathlib import Path

import torch
from IPython.display import Image, display
from matplotlib.figure import Figure
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

import mparlib
from mparlib import sharding
from mparlib.data import to_float
from mparlib.ddp_train import load_split_tensors
from mparlib.errors import CheckpointError, WorkerFailed
from mparlib.runfolder import LOCK_NAME
from mparlib.sharded_checkpoint import CHECKSUMS, latest_checkpoint, load_sharded
from mparlib.timing import measure_each
from mparlib.lang import join, table, tr
from mparlib.launch import launch
from mparlib.rendezvous import describe
from mparlib.plot import course_style, figure_png
from mparlib.vit import vit

# %load_ext mparlib.launch

print(mparlib.report())
print(mparlib.profile_line())
PROFILE = mparlib.profile()
print(describe(2))
print(describe(4))


KINDS = {"all_reduce": tr("all-reduce", "オールリデュース"), "reduce_scatter": tr("reduce-scatter", "リデュース・スキャッター"),
         "all_gather": tr("all-gather", "オールギャザー"), "broadcast": tr("broadcast", "ブロードキャスト")}
PART = sharding.PART_NAMES  # params, grads, optimizer, other: each edition's label
TOTAL = ("total", "合計")

# %% [markdown]
# <!-- en -->
# The table describes your machine, and the last two lines say where this chapter's ranks run: one process per
# GPU with `nccl` where there are enough GPUs, CPU processes with `gloo` otherwise. Every checked output below
# counts bytes of tensors, which are the same on a laptop, on one GPU and on many. Both profiles run the same
# measurements; the `full` profile trains the model longer in section 3. Starting processes costs a few seconds
# each time, so each launch below does several measurements at once.
# <!-- ja -->
# 上の表はお使いのマシンの情報です。最後の 2行は、この章のランクがどこで動くかを示しています。GPU が足りていれば GPU 1枚につき 1個のプロセスを `nccl` で、そうでなければ CPU のプロセスを `gloo` で動かします。このあとの検査対象の出力はどれもテンソルのバイト数を数えたもので、ノート PC でも GPU 1枚でも複数の GPU でも同じになります。どちらのプロファイルでも同じ測定をしますが、`full` プロファイルでは 3節でモデルをより長く訓練します。プロセスの起動には毎回数秒かかるので、以下では 1回の起動でいくつもの測定をまとめて行います。

# %% [markdown]
# <!-- en -->
# ## Where the memory goes
#
# Training holds three things per parameter, whatever the model:
#
# - the **parameter** itself, used by the forward and backward passes,
# - its **gradient**, written by the backward pass and read by the optimizer,
# - the **optimizer state**: nothing for plain SGD, one momentum buffer for SGD with momentum, two moving averages
#   for Adam (`exp_avg` and `exp_avg_sq`, the first and second moment of the gradient).
#
# In **mixed precision** the forward and backward passes use 16-bit numbers (bfloat16: 2 bytes) while the
# optimizer updates an fp32 **master copy** of the weights (4 bytes) with fp32 state, because updates much smaller
# than a weight vanish when added in 16 bits. ZeRO counts the master copy as part of the optimizer state, and so
# does `mparlib.sharding.bytes_per_parameter`. **Activations** (the outputs that the backward pass needs) come on
# top and depend on the batch, not on the number of parameters; section 4 is about them.
# <!-- ja -->
# ## メモリの内訳
#
# 訓練では、モデルが何であれ、パラメータ 1つにつき 3つのものを持ちます。
#
# - **パラメータ**そのもの。順伝播と逆伝播で使います。
# - その**勾配**。逆伝播が書き込み、オプティマイザが読みます。
# - **オプティマイザの状態**。ふつうの SGD なら何もなし、モーメンタム付きの SGD ならモーメンタムのバッファが 1つ、Adam なら 2つの移動平均（勾配の 1次と 2次のモーメント `exp_avg` と `exp_avg_sq`）です。
#
# **混合精度**では、順伝播と逆伝播は 16ビットの数（bfloat16、2バイト）で計算し、オプティマイザは重みの fp32 の**マスターコピー**（4バイト）を fp32 の状態で更新します。重みよりはるかに小さい更新量は、16ビットで足すと消えてしまうからです。ZeRO はマスターコピーをオプティマイザの状態に数え、`mparlib.sharding.bytes_per_parameter` もそれにならいます。**活性化**（逆伝播が必要とする各層の出力）はこれとは別にかかり、パラメータの数ではなくバッチの大きさで決まります。4節で扱います。

# %%
print(tr("bytes per parameter:", "パラメータ 1つあたりのバイト数:"))
rows = []
for precision, optimizer in [("fp32", "sgd"), ("fp32", "momentum"), ("fp32", "adam"), ("bf16", "adam"),
                             ("mixed", "adam"), ("mixed_fp32_grads", "adam")]:
    b = sharding.bytes_per_parameter(precision, optimizer)
    rows.append([repr(precision), repr(optimizer), b["params"], b["grads"], b["optimizer"], sum(b.values())])
print(table(rows, [("precision", "精度"), ("optimizer", "オプティマイザ"), PART["params"], PART["grads"],
                   PART["optimizer"], TOTAL]))

# %% [markdown]
# <!-- en -->
# fp32 and mixed precision with Adam both come to 16 bytes: mixed precision saves compute and activation memory,
# not memory per parameter. Keeping an fp32 copy of the gradients for accumulation (`mixed_fp32_grads`) brings it
# to 20. Hugging Face's *Ultra-Scale Playbook* tabulates exactly these figures for published model sizes; the next
# cell computes them and checks them against the Playbook's, then shows what the ZeRO stages leave on each of 8
# ranks for the 7B model.
# <!-- ja -->
# Adam を使う場合、fp32 でも混合精度でも 16バイトになります。混合精度で節約できるのは計算と活性化のメモリで、パラメータ 1つあたりのメモリではありません。勾配累積のために勾配の fp32 のコピーも持つと（`mixed_fp32_grads`）20バイトになります。Hugging Face の『Ultra-Scale Playbook』は、公表されているモデルの大きさについてまさにこの数値を表にしています。次のセルでその値を計算して Playbook の数値と照らし合わせ、さらに 7B のモデルを 8個のランクで訓練するとき、ZeRO の各ステージで 1個のランクに何が残るかを示します。

# %%
playbook = {"1B": (16, 20), "7B": (112, 140), "70B": (1120, 1400)}  # GB, Ultra-Scale Playbook (1 GB = 1e9 bytes)
rows = []
for name, published in playbook.items():
    n = sharding.PUBLISHED_SIZES[name]
    ours = tuple(sum(sharding.zero_bytes_per_rank(n, 1, 0, p).values()) / 1e9 for p in ("mixed", "mixed_fp32_grads"))
    rows.append([name, f"{ours[0]:,.0f} GB", f"{ours[1]:,.0f} GB"])
    assert ours == published, (name, ours, published)
print(table(rows, [("model", "モデル"), ("mixed + Adam", "混合精度 + Adam"), ("+ fp32 grads", "+ fp32 の勾配")]))

print()
print(tr("7B, mixed precision with Adam, 8 ranks: GB held by each rank",
         "7B、混合精度と Adam、ランク 8個: 各ランクが持つ GB"))
rows = []
for stage, label in enumerate(["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3 / FSDP"]):
    b = sharding.zero_bytes_per_rank(sharding.PUBLISHED_SIZES["7B"], 8, stage, "mixed")
    rows.append([label] + [f"{v / 1e9:.1f}" for v in (b["params"], b["grads"], b["optimizer"], sum(b.values()))])
print(table(rows, ["", PART["params"], PART["grads"], PART["optimizer"], TOTAL]))

# %% [markdown]
# <!-- en -->
# ZeRO-1 shards only the optimizer state and already cuts the 112 GB to 38.5 GB per rank; ZeRO-3 shards everything and
# leaves 1/8, 14 GB. The Playbook also has an interactive figure of the same stages for an 8B model on 8 ranks, but
# its numbers do not follow the Playbook's own text: it shows 60 GB of optimizer state (7.5 GB with ZeRO-1) and 15 GB
# each of gradients and parameters (1.875 GB with ZeRO-2 and ZeRO-3 respectively), while 12 bytes of optimizer state
# per parameter make about 96 GB for 8 billion parameters; 60 GB is 8e9 x 8 bytes, counted in GiB. This chapter
# follows the text, 16 bytes per parameter, which the cell above checks.
#
# Now our own model. `vit("smoke", patch=7)` from `mparlib.vit` builds a `ViT` from a `ViTConfig`: the 28x28 image
# is cut into 16 patches of 7x7 pixels, each becomes a token of width 64, and 4 `Block`s mix the tokens (each a
# pre-norm transformer block: attention, then an MLP, each with a residual connection). The arithmetic predicts 16
# bytes per parameter for fp32 and Adam. To check it, the next cell
# builds the model, takes one Adam step and counts the bytes of the tensors that exist afterwards:
# `sharding.held_bytes` adds up the storage behind the parameters, the gradients and every tensor in the
# optimizer's state.
# <!-- ja -->
# ZeRO-1 はオプティマイザの状態だけをシャーディングしますが、それだけで 1ランクあたり 112 GB が 38.5 GB に減ります。ZeRO-3 はすべてをシャーディングし、1/8 の 14 GB だけが残ります。Playbook には、8B のモデルを 8個のランクで訓練するときの同じステージを示すインタラクティブな図もありますが、その数値は Playbook 自身の本文と合いません。図ではオプティマイザの状態が 60 GB（ZeRO-1 で 7.5 GB）、勾配とパラメータがそれぞれ 15 GB（ZeRO-2 と ZeRO-3 でそれぞれ 1.875 GB）ですが、パラメータ 1つあたり 12バイトのオプティマイザの状態なら、80億パラメータで約 96 GB になるはずです。60 GB は 8e9 × 8バイトを GiB で数えた値です。この章は本文の計算（パラメータ 1つあたり 16バイト）に従い、それを上のセルで確かめています。
#
# 次はこの章のモデルです。`mparlib.vit` の `vit("smoke", patch=7)` は、`ViTConfig` から `ViT` を作ります。28x28 の画像を 7x7 ピクセルのパッチ 16個に切り分け、各パッチを幅 64 のトークンにし、4つの `Block` がトークンを混ぜ合わせます（各ブロックは pre-norm の Transformer ブロックで、アテンションと MLP のそれぞれに残差接続を付けたものです）。先ほどの計算によれば、fp32 と Adam ならパラメータ 1つあたり 16バイトになるはずです。これを確かめるため、次のセルでモデルを作って Adam で 1ステップ進め、そのあとに存在するテンソルのバイト数を数えます。`sharding.held_bytes` は、パラメータ、勾配、オプティマイザの状態にあるすべてのテンソルについて、その裏にあるストレージのバイト数を合計します。

# %%
images, labels = load_split_tensors("train", 320)
X_all, y_all = to_float(images), labels  # (320, 1, 28, 28), (320,)
batches = [(X_all[i:i + 32], y_all[i:i + 32]) for i in range(0, 320, 32)]  # 10 batches of 32 images

torch.manual_seed(0)
model = vit("smoke", patch=7)  # 7x7 patches: 16 tokens of width 64, 4 transformer blocks
n_params = sum(p.numel() for p in model.parameters())
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
nn.functional.cross_entropy(model(batches[0][0]), batches[0][1]).backward()
optimizer.step()
single = sharding.held_bytes(model, optimizer)
predicted = sharding.zero_bytes_per_rank(n_params, 1, 0, "fp32", "adam")
print(tr(f"{n_params:,} parameters in {len(list(model.parameters()))} tensors",
         f"パラメータ {n_params:,}個、テンソル {len(list(model.parameters()))}個"))
print(table([[PART[part], f"{predicted[part]:,.0f}", single[part]] for part in ("params", "grads", "optimizer")],
            ["", ("predicted", "予測"), ("counted", "実測")]))

# %%
steps = len(optimizer.state)  # Adam keeps a step count (one float32 scalar) for each parameter tensor
assert single["params"] == predicted["params"] and single["grads"] == predicted["grads"]
assert single["optimizer"] == predicted["optimizer"] + 4 * steps

# %% [markdown]
# <!-- en -->
# The count matches the arithmetic to the byte, except for 4 bytes per parameter tensor: Adam keeps its step
# count as a one-element float32 tensor for each of the 71 tensors. This model is tiny (0.56 MB of parameters);
# the point is that the same three parts, in the same proportions 1 : 1 : 2, are what sharding will cut.
# <!-- ja -->
# 実測は計算とバイト単位で一致します。違いはパラメータのテンソル 1つにつき 4バイトだけで、Adam が 71個のテンソルそれぞれについて、ステップ数を要素 1つの float32 テンソルとして持っているためです。このモデルはごく小さい（パラメータは 0.56 MB）のですが、大切なのは、シャーディングが切り分けるのがこの 3つの部分で、その比が 1 : 1 : 2 だということです。

# %% [markdown]
# <!-- en -->
# ## ZeRO from primitives
#
# Chapter 8 showed that an all-reduce is two collectives in a row: a **reduce-scatter**, after which rank r holds
# the sum of chunk r only, then an **all-gather**, which hands every chunk to every rank. DDP all-reduces the
# gradients and then every rank runs the same optimizer step on all of them: N ranks do the same work N times and
# each keeps the whole optimizer state.
#
# ZeRO moves the optimizer step **between** the two halves. View all parameters as one flat vector, padded so
# that it splits into N slices of S elements, and let rank r own slice r:
#
# 1. reduce-scatter the gradients: rank r receives the sum over all ranks of slice r, and divides by N;
# 2. rank r runs the optimizer on slice r only, so it keeps the optimizer state of slice r only;
# 3. all-gather the updated slices: every rank has all the new parameters again.
#
# The bytes sent are the same as DDP's all-reduce (it was a reduce-scatter and an all-gather anyway), and each rank
# now keeps 1/N of the optimizer state (ZeRO stage 1) and, once the step is over, 1/N of the gradients. That is not
# yet ZeRO stage 2, whose point is the gradients' memory: `sharded_step` below first copies every `p.grad` into a
# full-size flat buffer, so while it does, a rank holds the full gradient twice: twice the gradient bytes counted for
# DDP below (about what DDP itself holds with its communication buckets, unless `gradient_as_bucket_view=True`). It
# shards the optimizer step, not the gradients' memory: it is ZeRO-1, written from primitives.
#
# A real **ZeRO-2** reduce-scatters the gradients during the backward pass, bucket by bucket, so that the full
# gradient never exists at once on a rank. `mparlib.sharding.Zero2Optimizer` does it in about 80 lines. It groups
# the parameters into buckets (in reverse order, since the backward pass produces the last layers' gradients
# first), moves each bucket's parameters into a flat buffer, and registers a hook on every parameter with
# `register_post_accumulate_grad_hook`. Autograd calls the hook as soon as that parameter's gradient is complete;
# the hook adds it into one persistent gradient buffer, the size of one bucket, and frees it (`p.grad = None`).
# When a bucket's last gradient has arrived, the buffer is reduce-scattered, rank r keeps the mean of its slice,
# and the next bucket reuses the buffer. After the backward pass a rank holds 1/N of the gradients and one bucket;
# `step()` updates its slices and all-gathers every bucket into the parameters. For an optimizer that works
# element by element (SGD, Adam, AdamW), updating slices is the same arithmetic as updating everything, so both
# must give **exactly** DDP's parameters. (One that looks at whole tensors, like clipping by the global gradient
# norm, needs one more all-reduce of a single number.)
#
# The worker cell below writes it with `torch.distributed` directly: `reduce_scatter_single` and `all_gather_single`
# are the tensor forms of chapter 8's `reduce_scatter` and `all_gather`, under the names that PyTorch 2.13 gave
# `reduce_scatter_tensor` and `all_gather_into_tensor` (it warns that the old names are deprecated; the worker falls
# back to them on older releases, and chapter 8's tour calls the old names, which every release has). gloo supports
# both on CPU tensors. `flatten` moves the model's parameters into one flat buffer, each parameter becoming a view of
# its stretch, so that the all-gather writes straight into the parameters, and rank r's slice is a view too: the
# optimizer updates the buffer in place. `compare` trains the same model five ways on the same batches: DDP, this
# sharded step, the same algorithm as packaged in `mparlib.sharding.ShardedOptimizer`, PyTorch's
# `ZeroRedundancyOptimizer`, and the real ZeRO-2, `Zero2Optimizer`, with buckets of 64 KiB (the model's 0.56 MB of
# gradients make 13 of them). `mparlib.sharding.tensor_collectives()` makes the same choice of names as the
# worker's first lines, for the library's own code.
# <!-- ja -->
# ## プリミティブから作る ZeRO
#
# 8章で見たように、オールリデュース（all-reduce）は 2つの集合通信を続けたものです。まず**リデュース・スキャッター**で、ランク r はチャンク r の和だけを受け取ります。次に**オールギャザー**で、すべてのチャンクをすべてのランクに配ります。DDP は勾配をオールリデュースしたあと、すべてのランクがすべての勾配について同じオプティマイザのステップを実行します。N 個のランクが同じ仕事を N 回繰り返し、どのランクもオプティマイザの状態をすべて持つことになります。
#
# ZeRO は、オプティマイザのステップをこの 2つの**間に**移します。すべてのパラメータを 1本のフラットなベクトルとみなし、S 要素ずつの N 個のスライスに分けられるようにパディングして、ランク r がスライス r を受け持ちます。
#
# 1. 勾配をリデュース・スキャッターします。ランク r は全ランクのスライス r の和を受け取り、N で割ります。
# 2. ランク r はスライス r だけについてオプティマイザを実行します。そのため、オプティマイザの状態もスライス r の分だけを持ちます。
# 3. 更新したスライスをオールギャザーします。すべてのランクが、再びすべての新しいパラメータを持ちます。
#
# 送るバイト数は DDP のオールリデュースと同じです（もともとリデュース・スキャッターとオールギャザーだったからです）。そして各ランクが持ち続けるのは、オプティマイザの状態の 1/N（ZeRO のステージ 1）と、ステップが終わったあとの勾配の 1/N です。ただし、これはまだ ZeRO のステージ 2 ではありません。ステージ 2 の目的は勾配のメモリですが、下の `sharded_step` はまずすべての `p.grad` をモデル全体の大きさのフラットなバッファにコピーするので、その間ランクは完全な勾配を 2組持ちます。下で DDP について数える勾配のバイト数の 2倍です（DDP 自身も、`gradient_as_bucket_view=True` にしなければ通信用のバケットにもう 1組持つので、それとほぼ同じです）。シャーディングしているのはオプティマイザのステップで、勾配のメモリではありません。これはプリミティブで書いた ZeRO-1 です。
#
# 本来の **ZeRO-2** は、逆伝播の途中でバケットごとに勾配をリデュース・スキャッターするので、完全な勾配が一度にランク上にそろうことはありません。`mparlib.sharding.Zero2Optimizer` は、これを 80行ほどで実装しています。パラメータをバケットに分け（逆伝播は最後の層の勾配から先に作るので、逆の順序で分けます）、各バケットのパラメータをフラットなバッファに移し、すべてのパラメータに `register_post_accumulate_grad_hook` でフックを登録します。autograd は、そのパラメータの勾配ができあがるとすぐにフックを呼びます。フックは勾配を、バケット 1つ分の大きさの永続的な勾配バッファに足し込み、元の勾配を解放します（`p.grad = None`）。バケットの最後の勾配が届いたらバッファをリデュース・スキャッターし、ランク r は自分のスライスの平均を残し、次のバケットが同じバッファを使います。逆伝播のあと、ランクが持つのは勾配の 1/N とバケット 1つ分です。`step()` は自分のスライスを更新し、すべてのバケットをパラメータにオールギャザーします。要素ごとに計算するオプティマイザ（SGD、Adam、AdamW）なら、スライスごとに更新しても全体を更新しても計算は同じなので、どちらのパラメータも DDP と**完全に**一致するはずです（勾配全体のノルムでクリッピングするように、テンソル全体を見る処理には、数値 1つのオールリデュースがもう 1回必要です）。
#
# 下のワーカーのセルでは、これを `torch.distributed` で直接書きます。`reduce_scatter_single` と `all_gather_single` は、8章の `reduce_scatter` と `all_gather` のテンソル版で、PyTorch 2.13 で `reduce_scatter_tensor` と `all_gather_into_tensor` に付けられた新しい名前です（古い名前には非推奨の警告が出ます。それより前のリリースでは、ワーカーは古い名前を使います。8章の `tour` は、どのリリースにもある古い名前を使っています）。gloo は CPU のテンソルでどちらにも対応しています。`flatten` はモデルのパラメータを 1本のフラットなバッファに移し、各パラメータをバッファの自分の区間のビューにします。こうするとオールギャザーの結果がそのままパラメータに書き込まれます。ランク r のスライスもビューなので、オプティマイザはバッファをその場で更新します。`compare` は同じモデルを同じバッチで 5通りの方法で訓練します。DDP、このシャーディングしたステップ、同じアルゴリズムを `mparlib.sharding.ShardedOptimizer` にまとめたもの、PyTorch の `ZeroRedundancyOptimizer`、そして本来の ZeRO-2 である `Zero2Optimizer`（バケットは 64 KiB。このモデルの 0.56 MB の勾配は 13個のバケットになります）です。ライブラリの中では、`mparlib.sharding.tensor_collectives()` がワーカーの最初の数行と同じ名前の選び方をします。

# %%
# %%worker zero_workers
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from mparlib import sharding
from mparlib.rendezvous import device
from mparlib.timing import measure, slowest_rank
from mparlib.vit import vit

# torch 2.13 renamed the tensor forms of reduce_scatter and all_gather; earlier releases know only the old names
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def make_model(seed=0):
    """The chapter's model: the smoke ViT with 7x7 patches (16 tokens of width 64, 4 blocks), from a seed."""
    torch.manual_seed(seed)
    return vit("smoke", patch=7)


def share(t):
    """This rank's rows of a global batch, on its device: rank r of W takes rows r*b .. (r+1)*b - 1."""
    b = len(t) // dist.get_world_size()
    return t[dist.get_rank() * b:(dist.get_rank() + 1) * b].to(device())


def flatten(params):
    """Move the parameters into one flat buffer of W * S elements (the tail is padding); return the buffer."""
    world = dist.get_world_size()
    P = sum(p.numel() for p in params)
    S = -(-P // world)  # ceil(P / W): every rank owns a slice of S elements
    flat = torch.zeros(world * S, dtype=params[0].dtype, device=params[0].device)  # (W * S,)
    offset = 0
    for p in params:
        piece = flat[offset:offset + p.numel()]
        piece.copy_(p.detach().reshape(-1))
        p.data = piece.view_as(p)  # the parameter now lives inside the buffer
        offset += p.numel()
    return flat


def sharded_step(params, flat, shard, optimizer):
    """One ZeRO step: reduce-scatter the gradients, update this rank's slice, all-gather the parameters."""
    world = dist.get_world_size()
    grads = torch.zeros_like(flat)  # (W * S,): this rank's gradients, laid out like the buffer
    torch.cat([p.grad.reshape(-1) for p in params], out=grads[:sum(p.numel() for p in params)])
    for p in params:
        p.grad = None  # from here on the rank keeps only the gradient of its own slice
    shard.grad = torch.empty_like(shard)  # (S,)
    reduce_scatter_single(shard.grad, grads)  # rank r receives slice r, summed over the ranks
    shard.grad /= world  # the mean over the ranks, as DDP computes it
    optimizer.step()  # updates this rank's slice of the buffer in place; its state exists for S elements only
    all_gather_single(flat, shard.detach().clone())  # every rank's slice, in rank order, into the buffer


def _run(model, batches, step, zero_grad):
    """Train on every batch; the collectives of the last step."""
    for X, y in batches:
        zero_grad()
        with sharding.CollectiveLog() as log:
            nn.functional.cross_entropy(model(share(X)), share(y)).backward()
            step()
    return log.summary()


def step_timing(model, batch, step, zero_grad):
    """More steps on one batch, timed as chapter 8 times a collective: the slowest rank's seconds per step."""
    X, y = share(batch[0]), share(batch[1])

    def train_step():
        nn.functional.cross_entropy(model(X), y).backward()
        step()

    def before():  # untimed: drop the gradients, then start together
        zero_grad()
        dist.barrier()

    # the training steps just run were the warm-up; then >= 5 steps and >= 50 ms
    return measure(train_step, warmup=0, before=before, across=slowest_rank, device=device()).summary()


def compare(batches, lr):
    """The same training five ways: DDP + Adam, the sharded step above, ShardedOptimizer, ZeRO-1, ZeRO-2."""
    torch.backends.cudnn.allow_tf32 = False  # float32 convolutions on GPUs, as on the CPU
    dev, out = device(), {}

    def record(name, model, held, log, timed):
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, held)  # rank 0 returns what every rank holds
        out[name] = {"params": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                     "held": everyone, "collectives": log}
        out[name]["seconds"] = step_timing(*timed)  # after the copy: the timed steps train the model further

    # DDP: every rank holds everything; the gradients are all-reduced (in buckets) during the backward pass
    model = make_model().to(dev)
    ddp, opt = DDP(model), torch.optim.Adam(model.parameters(), lr=lr)
    log = _run(ddp, batches, opt.step, opt.zero_grad)
    record("DDP", model, sharding.held_bytes(model, opt), log, (ddp, batches[-1], opt.step, opt.zero_grad))

    # The sharded step above, with Adam on this rank's slice only
    model = make_model().to(dev)
    params = list(model.parameters())
    flat = flatten(params)
    S = len(flat) // dist.get_world_size()
    shard = nn.Parameter(flat[dist.get_rank() * S:(dist.get_rank() + 1) * S])  # (S,): a view of the buffer
    opt = torch.optim.Adam([shard], lr=lr)

    def step():
        sharded_step(params, flat, shard, opt)

    log = _run(model, batches, step, lambda: None)
    held = {"params": sharding.tensor_bytes(params), "grads": sharding.tensor_bytes([shard.grad]),
            "optimizer": sharding.tensor_bytes(opt.state[shard].values())}
    record("sharded_step", model, held, log, (model, batches[-1], step, lambda: None))

    # The same algorithm, packaged as mparlib.sharding.ShardedOptimizer
    model = make_model().to(dev)
    opt = sharding.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=lr)
    log = _run(model, batches, opt.step, opt.zero_grad)
    record("ShardedOptimizer", model, sharding.held_bytes(model, opt), log,
           (model, batches[-1], opt.step, opt.zero_grad))

    # ZeRO-1 as PyTorch ships it: DDP all-reduces the gradients, each rank updates the parameters it owns and
    # broadcasts them to the others
    model = make_model().to(dev)
    ddp = DDP(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=lr)
    log = _run(ddp, batches, opt.step, opt.zero_grad)
    record("ZeroRedundancyOptimizer", model, sharding.held_bytes(model, opt), log,
           (ddp, batches[-1], opt.step, opt.zero_grad))

    # ZeRO-2: the gradients are reduce-scattered bucket by bucket during the backward pass, then freed
    model = make_model().to(dev)
    opt = sharding.Zero2Optimizer(model.parameters(), torch.optim.Adam, bucket_bytes=2**16, lr=lr)
    log = _run(model, batches, opt.step, opt.zero_grad)
    record("Zero2Optimizer", model, sharding.held_bytes(model, opt), log,
           (model, batches[-1], opt.step, opt.zero_grad))
    out["Zero2Optimizer"]["buckets"] = len(opt.buckets)
    return out

# %% [markdown]
# <!-- en -->
# Two processes, five Adam steps on batches of 32 Fashion-MNIST images (16 per rank): a check of the mechanics,
# too short to learn much. The same five steps on the whole batches in this one process are the reference.
# <!-- ja -->
# 2個のプロセスで、Fashion-MNIST の画像 32枚のバッチ（ランクごとに 16枚）を使って Adam で 5ステップ進めます。仕組みを確かめるための実行で、学習が進むほどの長さはありません。同じ 5ステップをこのプロセスでバッチ全体を使って計算したものを基準にします。

# %% tags=["nbval-ignore-output"]
from zero_workers import compare, make_model

print(describe(2))
zero = launch(compare, 2, args=(batches[:5], 1e-3), timeout=300)

reference = make_model()
optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)
for X, y in batches[:5]:
    optimizer.zero_grad()
    nn.functional.cross_entropy(reference(X), y).backward()
    optimizer.step()
reference = reference.state_dict()
start = make_model().state_dict()


def gaps(a, b, skip=()):
    """The largest |a - b| over all tensors of two state dicts, and the name of the tensor where it occurs."""
    worst = max((k for k in a if k not in skip), key=lambda k: (a[k] - b[k]).abs().max().item())
    return (a[worst] - b[worst]).abs().max().item(), worst


print(tr("largest parameter difference after 5 steps:", "5ステップ後のパラメータの差の最大値:"))
for name, r in zero.items():
    vs_ddp, _ = gaps(r["params"], zero["DDP"]["params"])
    vs_one, where = gaps(r["params"], reference)
    print(f"  {name:<24} {tr('vs DDP', 'DDP と')} {vs_ddp:.1e}   {tr('vs one process', '1個のプロセスと')} "
          f"{vs_one:.1e} ({where})")
moved, _ = gaps(reference, start)
print(tr("largest change made by the 5 steps:", "5ステップによる変化の最大値:"), f"{moved:.1e}")

# %%
assert moved > 1e-3  # the steps really moved the parameters: a match is not trivial
for name, r in zero.items():
    assert gaps(r["params"], zero["DDP"]["params"])[0] <= 1e-6, name
    keys = [k for k in reference if k.endswith("attn.k.bias")]
    assert gaps(r["params"], reference, skip=keys)[0] <= 1e-5, name
    assert gaps(r["params"], reference)[0] <= 5 * 1e-3  # five steps of Adam move any parameter by at most ~5 lr

# %% [markdown]
# <!-- en -->
# All five give the same parameters as DDP, to the last bit on a CPU (the assertion allows 1e-6: the ranks
# compute the same gradients, and the only freedom left is the order in which N gradients are summed, which
# costs at most a few units of float32's last digit, about 1e-7 relative, per step).
#
# Against one process the picture has a twist worth knowing. Every parameter agrees within 1e-5 (float32 rounding:
# two ranks compute the loss of 16 images each instead of 32 at once) except the **key biases**
# `blocks.*.attn.k.bias`, which differ by up to about 1e-4. A key bias adds the same number to all of a query's
# attention scores, and softmax ignores such a shift, so its true gradient is exactly zero. What reaches the
# optimizer is rounding noise of about 1e-9, and Adam divides each gradient by its own running size
# (`sqrt(exp_avg_sq) + eps`, with `eps = 1e-8`): noise of that size becomes an update of about a tenth of the
# learning rate, in a direction that depends on the rounding. Such parameters never change the loss, which is why
# the FSDP check below compares losses; `tests/test_sharding.py` compares parameters in float64, where the noise
# is far below `eps` and every parameter agrees within 1e-10.
# <!-- ja -->
# 5通りとも DDP と同じパラメータになり、CPU では最後のビットまで一致します（`assert` は 1e-6 まで許します。ランクは同じ勾配を計算するので、残る違いは N 個の勾配を足す順序だけで、その影響は 1ステップあたり float32 の最後の桁の数単位、相対誤差にして約 1e-7 以下です）。
#
# 1個のプロセスと比べたときの結果には、知っておきたい点があります。ほとんどのパラメータは 1e-5 以内で一致します（float32 の丸め誤差です。2個のランクは 32枚をまとめてではなく 16枚ずつ損失を計算します）。例外は**キーのバイアス** `blocks.*.attn.k.bias` で、最大で 1e-4 ほど違います。キーのバイアスは、あるクエリのアテンションスコアすべてに同じ数を足しますが、softmax はそのようなずれを無視するので、本当の勾配はちょうど 0 です。オプティマイザに届くのは 1e-9 ほどの丸め誤差だけですが、Adam は各勾配をそれ自身の移動平均の大きさ（`sqrt(exp_avg_sq) + eps`、`eps = 1e-8`）で割ります。そのため、この大きさの誤差が学習率の 10分の 1 ほどの更新になり、その向きは丸め方しだいで決まります。このようなパラメータは損失をまったく変えません。このあとの FSDP の確認で損失を比べるのはそのためです。`tests/test_sharding.py` では float64 でパラメータを比べます。float64 では誤差が `eps` よりはるかに小さく、すべてのパラメータが 1e-10 以内で一致します。

# %% [markdown]
# <!-- en -->
# What did sharding save? Each rank's bytes after the last step, counted from its tensors (the same on both ranks
# here, except for ZeRO-1's uneven split):
# <!-- ja -->
# シャーディングで何が減ったのでしょうか。最後のステップのあとに各ランクが持つバイト数を、テンソルから数えます（ZeRO-1 の分け方が均等でない点を除き、ここでは 2個のランクで同じです）。

# %%
print(table([[name, rank, held["params"], held["grads"], held["optimizer"], sum(held.values())]
             for name, r in zero.items() for rank, held in enumerate(r["held"])],
            [("method", "方式"), ("rank", "ランク"), PART["params"], PART["grads"], PART["optimizer"], TOTAL]))
ddp_total = sum(zero["DDP"]["held"][0].values())
ours = max(sum(h.values()) for h in zero["sharded_step"]["held"])
print(tr(f"the sharded step holds {ours / ddp_total:.0%} of DDP's bytes per rank",
         f"シャーディングしたステップが 1ランクで持つのは DDP の {ours / ddp_total:.0%} です"))

# %%
for name in ("sharded_step", "ShardedOptimizer"):
    for held in zero[name]["held"]:
        assert held["grads"] == single["grads"] // 2 and held["optimizer"] <= single["optimizer"] // 2 + 4
assert zero["sharded_step"]["held"] == zero["ShardedOptimizer"]["held"]
assert sum(h["optimizer"] for h in zero["ZeroRedundancyOptimizer"]["held"]) == single["optimizer"]
buckets = zero["Zero2Optimizer"]["buckets"]
for held in zero["Zero2Optimizer"]["held"]:  # half the gradients (+ padding) and one bucket's buffer of <= 64 KiB
    assert single["grads"] // 2 < held["grads"] <= single["grads"] // 2 + 2**16 + 8 * buckets
    assert held["optimizer"] <= single["optimizer"] // 2 + 4 * buckets + 8 * buckets

# %% [markdown]
# <!-- en -->
# After the step, the sharded step holds half the gradients and half of Adam's state: 62% of DDP's bytes on 2 ranks,
# and 1/4 + 3/4 x 1/N of them on N ranks (the parameters stay whole). These are the bytes held after the step; during
# the step it held the full gradients twice, as said above, which the peaks of section 3 show. `Zero2Optimizer`
# holds after the step the same half of the gradients and of Adam's state, plus its one gradient buffer (64 KiB,
# kept for the next backward pass), and during the step never more gradients than that plus the one parameter
# gradient autograd has just produced. PyTorch's `ZeroRedundancyOptimizer` is ZeRO-1: it
# shards the optimizer state, but by whole parameter tensors, assigned greedily to balance the ranks (hence the
# uneven split), and it keeps DDP's full gradients. The collectives of one step, recorded by
# `sharding.CollectiveLog` (it watches the `c10d` operators that every `torch.distributed` collective reaches
# PyTorch's dispatcher through), and the step times. These are measured after the five steps, which serve as the
# warm-up, as chapter 8 times a collective: `mparlib.timing.measure` runs more steps on the last batch, a barrier
# before each, until there are at least 5 and 50 ms of them, and `slowest_rank` makes each step's time the slowest
# rank's (every rank then stops after the same step):
# <!-- ja -->
# ステップのあと、シャーディングしたステップが持つ勾配と Adam の状態は半分です。ランク 2個なら DDP の 62% で、ランク N 個なら 1/4 + 3/4 × 1/N です（パラメータは丸ごと残ります）。これはステップのあとに持っている量です。ステップの途中では、上で述べたとおり完全な勾配を 2組持っていました。3節で測るピークにそれが表れます。`Zero2Optimizer` がステップのあとに持つのも、同じく勾配と Adam の状態の半分と、勾配バッファ 1つ（64 KiB。次の逆伝播のために残します）です。ステップの途中でも、勾配はこれに autograd が作ったばかりのパラメータ 1つ分の勾配を加えた量を超えません。PyTorch の `ZeroRedundancyOptimizer` は ZeRO-1 です。オプティマイザの状態をシャーディングしますが、パラメータのテンソル単位で、ランクの負担がそろうように貪欲に割り当てます（分け方が均等でないのはそのためです）。勾配は DDP と同じく全体を持ちます。1ステップの集合通信を `sharding.CollectiveLog` で記録したもの（`torch.distributed` の集合通信はどれも、PyTorch のディスパッチャを `c10d` の演算子として通ります。`CollectiveLog` はこれを見張ります）と、ステップの時間を示します。時間は 5ステップのあとに、8章で集合通信を測ったのと同じ方法で測ります。5ステップがウォームアップの役目を果たします。`mparlib.timing.measure` が最後のバッチでさらにステップを進め、各ステップの前にバリアで待ち合わせ、5ステップ以上、合計 50 ms 以上になるまで続けます。`slowest_rank` は各ステップの時間をいちばん遅いランクの時間にします（そのため、すべてのランクが同じステップで計測を終えます）。

# %% tags=["nbval-ignore-output"]
rows = []
for name, r in zero.items():
    calls = join(f"{KINDS[kind]} {c['calls']}x {c['bytes']:,}" for kind, c in r["collectives"].items())
    t = r["seconds"]
    rows.append([name, calls, f"{1000 * t['median']:.1f}", f"{1000 * t['min']:.1f}-{1000 * t['max']:.1f}"])
print(table(rows, [("method", "方式"), ("collectives of one step (calls x, bytes)", "1ステップの集合通信（回数、バイト数）"),
                   ("ms per step", "ステップあたり ms"), ("min-max ms", "最小-最大 ms")], align="<<>>"))
busy = any(r["seconds"]["busy"] for r in zero.values())
print(tr(f"each time: the median of {min(r['seconds']['repeats'] for r in zero.values())} or more steps, the slowest "
         "rank's; the machine was " + ("busy (load above 0.3 per core)" if busy else "not busy"),
         f"時間はどれも、いちばん遅いランクの {min(r['seconds']['repeats'] for r in zero.values())}ステップ以上の中央値です。"
         "マシンは" + ("混んでいました（コアあたりのロードアベレージ 0.3 超）" if busy else "空いていました")))

# %%
for name in ("sharded_step", "ShardedOptimizer"):
    assert zero[name]["collectives"] == {"reduce_scatter": {"calls": 1, "bytes": single["params"]},
                                         "all_gather": {"calls": 1, "bytes": single["params"]}}
for kind in ("reduce_scatter", "all_gather"):  # ZeRO-2: one of each per bucket, the model's bytes (+ padding) in all
    c = zero["Zero2Optimizer"]["collectives"][kind]
    assert c["calls"] == buckets and single["params"] <= c["bytes"] <= single["params"] + 8 * buckets

# %% [markdown]
# <!-- en -->
# DDP sends its gradients in one all-reduce (the model fits in one bucket); the sharded step sends the same bytes
# as one reduce-scatter and one all-gather, and ZeRO-2 as 13 of each, the reduce-scatters during the backward pass,
# one as each bucket completes, where they can overlap the rest of the backward computation. ZeRO-1 adds one broadcast per parameter tensor (71 of them) after
# DDP's all-reduce: the same bytes again, in many small messages. On a CPU the times are dominated by the small
# model's compute and by the noise of other programs; with a model of billions of parameters on GPUs, what
# matters is that sharding the optimizer costs no extra bytes on the wire.
# <!-- ja -->
# DDP は勾配を 1回のオールリデュースで送ります（このモデルは 1つのバケットに収まります）。シャーディングしたステップは、同じバイト数を 1回のリデュース・スキャッターと 1回のオールギャザーで送ります。ZeRO-2 はそれぞれ 13回に分けて送ります。リデュース・スキャッターは逆伝播の途中で、バケットが 1つそろうたびに行うので、残りの逆伝播の計算と重ねられます。ZeRO-1 は DDP のオールリデュースのあとに、パラメータのテンソルごとに 1回（71回）ブロードキャストします。バイト数は同じだけ増え、しかも多数の小さなメッセージになります。CPU での時間は、小さなモデルの計算と他のプログラムによるばらつきで決まってしまいます。数十億パラメータのモデルを GPU で訓練するときに大切なのは、オプティマイザをシャーディングしても通信のバイト数が増えないことです。

# %% [markdown]
# <!-- en -->
# ## FSDP2: shard the parameters too
#
# The sharded step still keeps all parameters on every rank. **ZeRO-3** shards them as well: each rank stores 1/N
# of every parameter, and a layer's full parameters exist only around the time that layer computes. PyTorch's
# implementation is FSDP; its current form, **FSDP2**, is the function `torch.distributed.fsdp.fully_shard`:
#
# ```python
# for block in model.blocks:
#     fully_shard(block)          # each transformer block becomes one unit: its parameters are gathered together
# fully_shard(model)              # the root: the parameters left over (embedding, positions, final norm, head)
# optimizer = torch.optim.Adam(model.parameters())   # created after sharding: it sees the shards
# ```
#
# After `fully_shard`, every parameter is a `DTensor`, a tensor that knows how it is split over the ranks
# (`Shard(0)`: cut along dimension 0), and `.to_local()` is the piece this rank stores. Around each unit FSDP
# adds hooks: before its forward, all-gather its parameters; after the forward, free them again
# (`reshard_after_forward=True`); before its backward, all-gather them once more; after the backward,
# reduce-scatter its gradients, so that each rank keeps the gradient of its own shard. The optimizer then updates
# shards, with state for shards. Sharding block by block is what keeps the memory low: the full parameters of only a
# few blocks exist at once. Not of one block, though: in the backward pass FSDP2 prefetches, starting the all-gather
# of the next block while the current one computes, so two blocks' full parameters exist at the same time. In the
# forward pass it issues each all-gather only when the block is reached, and the overlap comes from the CPU running
# ahead of the GPU's kernels; section 3 asks for an explicit forward prefetch and shows the order that results.
#
# The worker below shards the chapter's model this way (the root's `reshard_after_forward` keeps its default,
# which does not free the root's parameters after the forward, since the backward needs them at once), and one
# launch measures several things: the parameters as DTensors, ten Adam steps with the bytes each rank holds and
# the collectives of a step, the same with `reshard_after_forward=False`, with bfloat16 mixed precision, and with
# activation checkpointing (section 4). The 2-rank launch then trains the model on Fashion-MNIST and saves a
# sharded checkpoint; the 4-rank launch loads it (section 5).
# <!-- ja -->
# ## FSDP2: パラメータも含めたシャーディング
#
# シャーディングしたステップでも、パラメータはすべてのランクが丸ごと持っていました。**ZeRO-3** はパラメータもシャーディングします。各ランクはどのパラメータも 1/N だけを保存し、ある層の完全なパラメータが存在するのは、その層が計算する前後の短い間だけです。PyTorch での実装が FSDP で、その現在の形である **FSDP2** は関数 `torch.distributed.fsdp.fully_shard` です。
#
# ```python
# for block in model.blocks:
#     fully_shard(block)          # Transformer ブロックごとに 1つのユニット。パラメータはまとめて集められる
# fully_shard(model)              # ルート: 残りのパラメータ（埋め込み、位置、最後の正規化、出力層）
# optimizer = torch.optim.Adam(model.parameters())   # シャーディングのあとに作る。オプティマイザにはシャードが見える
# ```
#
# `fully_shard` のあと、パラメータはどれも `DTensor` になります。ランクにどう分割されているかを知っているテンソルで（`Shard(0)` は 0次元目で切ることを表します）、`.to_local()` がこのランクの保存している部分です。FSDP は各ユニットの周りにフックを付けます。順伝播の前にパラメータをオールギャザーし、順伝播のあとで再び解放します（`reshard_after_forward=True`）。逆伝播の前にもう一度オールギャザーし、逆伝播のあとで勾配をリデュース・スキャッターして、各ランクは自分のシャードの勾配だけを持ちます。オプティマイザはシャードを更新し、状態もシャードの分だけを持ちます。ブロックごとにシャーディングすることが、メモリを少なく保つ鍵です。一度に完全なパラメータが存在するのは、いくつかのブロックの分だけです。ただし、1ブロック分だけではありません。逆伝播では FSDP2 は先読み（prefetch）をして、今のブロックの計算中に次のブロックのオールギャザーを始めるので、2ブロック分の完全なパラメータが同時に存在します。順伝播では、各オールギャザーはそのブロックの番が来たときに初めて発行され、重なりは CPU が GPU のカーネルより先に進むことから生まれます。3節では順伝播の明示的な先読みを指定し、その結果の順序を示します。
#
# 下のワーカーは、この章のモデルをこの方法でシャーディングします（ルートの `reshard_after_forward` は既定値のままにします。逆伝播がすぐにルートのパラメータを必要とするので、既定値では順伝播のあとも解放しません）。1回の起動でいくつもの測定をします。DTensor になったパラメータ、Adam で 10ステップ進めたときに各ランクが持つバイト数と 1ステップの集合通信、`reshard_after_forward=False` での同じ測定、bfloat16 の混合精度、そして活性化の再計算（4節）です。さらに 2ランクの起動ではモデルを Fashion-MNIST で訓練して、シャーディングしたチェックポイントを保存します。4ランクの起動はそれを読み込みます（5節）。

# %%
# %%worker fsdp_workers
import os
import signal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from mparlib import sharding
from mparlib.data import to_float
from mparlib.ddp_train import load_split_tensors
from mparlib.lang import join, table, tr
from mparlib.rendezvous import device
from mparlib.sharded_checkpoint import load_sharded, save_sharded
from zero_workers import make_model, share


class Checkpointed(nn.Module):
    """A block whose activations are recomputed in the backward pass instead of kept (activation checkpointing)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def shard(model, reshard=True, mp_policy=None):
    """FSDP2: every block becomes a unit of its own, then the root takes the rest (embedding, norm, head)."""
    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **policy)
    fully_shard(model, mesh=mesh, **policy)
    return model


def mean_over_ranks(x):
    """The mean of a scalar over all ranks (each rank's loss covers its share of the batch)."""
    x = x.detach().float().clone()
    dist.all_reduce(x)
    return x.item() / dist.get_world_size()


def train_steps(model, batches, lr):
    """Adam on every batch (each rank its share): the losses, the bytes held after step 1, the collectives."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses, held = [], None
    for X, y in batches:
        with sharding.CollectiveLog() as log:
            loss = nn.functional.cross_entropy(model(share(X)), share(y))
            loss.backward()
        optimizer.step()
        if held is None:  # the bytes held after step 1: parameters, gradients and optimizer state
            held = sharding.held_bytes(model, optimizer)
            if device().type == "cuda":
                held["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device())
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss))
    return losses, held, log.summary()


def learn(model, lr, images, batch, epochs):
    """Train on Fashion-MNIST with AdamW and a one-cycle schedule, every rank its share of each batch."""
    X, y = load_split_tensors("train", images)
    X = to_float(X)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps = epochs * (images // batch)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps)
    order = torch.Generator().manual_seed(0)  # the same shuffle on every rank
    curve = []
    for epoch in range(epochs):
        rows = torch.randperm(images, generator=order)
        for i in range(images // batch):
            batch_rows = rows[i * batch:(i + 1) * batch]
            loss = nn.functional.cross_entropy(model(share(X[batch_rows])), share(y[batch_rows]))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
            curve.append(mean_over_ranks(loss))
            if dist.get_rank() == 0 and (len(curve) % 50 == 0 or len(curve) == steps):
                recent = sum(curve[-50:]) / len(curve[-50:])
                print(tr(f"step {len(curve)}/{steps}: loss {recent:.3f}",
                         f"ステップ {len(curve)}/{steps}: 損失 {recent:.3f}"), flush=True)
    return curve, optimizer


FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # the whole state, gathered on rank 0


def accumulate(batches, lr, micro=2):
    """FSDP2 with explicit forward prefetch, each batch in micro-batches: the losses, collectives, gather order."""
    model = shard(make_model().to(device()))
    blocks = list(model.blocks)
    for block, following in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([following])  # gather the next block when this one starts
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    out = {"order": forward_order(model, batches[0][0])}
    out["order_default"] = forward_order(shard(make_model().to(device())), batches[0][0])
    losses = []
    for X, y in batches:
        X, y, loss = share(X), share(y), 0.0
        with sharding.CollectiveLog() as log:
            for i, (Xm, ym) in enumerate(zip(X.chunk(micro), y.chunk(micro))):
                model.set_requires_gradient_sync(i == micro - 1)  # reduce-scatter on the last micro-batch only
                part = nn.functional.cross_entropy(model(Xm), ym) / micro
                part.backward()
                loss += part.detach()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss))
    return losses, log.summary(), out


def forward_order(model, X):
    """The all-gathers (AG) and block forwards (F0, F1, ...) of one forward pass, in the order they were issued."""
    with sharding.CollectiveLog() as log:
        hooks = [b.register_forward_pre_hook(lambda m, a, i=i: log.calls.append((f"F{i}", 0)))
                 for i, b in enumerate(model.blocks)]
        with torch.no_grad():
            model(share(X))
    for h in hooks:
        h.remove()
    return ["AG" if kind == "all_gather" else kind for kind, _ in log.calls]


def hsdp(batches, lr):
    """HSDP on 4 ranks: shard within each pair of ranks, replicate across the 2 pairs; losses and collectives."""
    mesh = init_device_mesh(device().type, (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make_model().to(device())
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    w = model.blocks[0].attn.q.weight
    placements = [str(p) for p in w.placements], list(w.to_local().shape)
    losses, _, collectives = train_steps(model, batches, lr)
    return losses, collectives, placements


def fsdp_run(batches, lr, learning=None, save_to=None, load_from=None):
    """FSDP2 on this world: shards, memory, collectives, mixed precision, checkpointing; then learn/save or load."""
    torch.backends.cudnn.allow_tf32 = False  # float32 convolutions on GPUs, as on the CPU
    dev, out = device(), {"world_size": dist.get_world_size(), "device": device().type}
    # the peak of the training state per rank, DDP, ZeRO-1, ZeRO-2 and FSDP2 (section 3's table)
    methods = sharding.PEAK_METHODS + ("sharded step",)
    out["peaks"] = sharding.peak_memory_worker(patch=7, bucket_bytes=2**16, methods=methods)["methods"]

    model = shard(make_model().to(dev))
    w = model.blocks[0].attn.q.weight
    out["example"] = {"type": type(w).__name__, "shape": list(w.shape), "placements": [str(p) for p in w.placements],
                      "local_shape": list(w.to_local().shape)}
    out["losses"], held, out["collectives"] = train_steps(model, batches, lr)
    out["held"] = [None] * dist.get_world_size()
    dist.all_gather_object(out["held"], held)

    # reshard_after_forward=False: the blocks stay gathered from the forward to the backward pass
    kept = shard(make_model().to(dev), reshard=False)
    _, _, out["collectives_kept"] = train_steps(kept, batches[:1], lr)

    # Mixed precision: compute in bfloat16, keep the sharded parameters and the gradient reduction in float32
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mixed = shard(make_model().to(dev), mp_policy=policy)
    out["bf16_output"] = str(mixed(share(batches[0][0])).dtype)
    out["losses_bf16"], _, out["collectives_bf16"] = train_steps(mixed, batches, lr)
    out["bf16_stored"] = str(next(mixed.parameters()).dtype)

    # Activation checkpointing on every block under FSDP: wrap the blocks, then shard the wrappers
    net = make_model().to(dev)
    net.blocks = nn.ModuleList(Checkpointed(b) for b in net.blocks)
    out["losses_checkpointed"], _, _ = train_steps(shard(net), batches[:3], lr)

    # Gradient accumulation (2 micro-batches per step) with explicit forward prefetch; HSDP on a 2 x 2 mesh
    out["losses_accumulated"], out["collectives_accumulated"], out["prefetch"] = accumulate(batches[:3], lr)
    if dist.get_world_size() == 4:
        out["losses_hsdp"], out["collectives_hsdp"], out["hsdp_placements"] = hsdp(batches[:3], lr)

    if learning is not None:  # train for real, then save a sharded checkpoint of model and optimizer
        learner = shard(make_model().to(dev))
        out["curve"], optimizer = learn(learner, **learning)
        model_state, optim_state = get_state_dict(learner, optimizer)
        folder = save_sharded({"model": model_state, "optim": optim_state}, save_to, step=len(out["curve"]))
        out["saved"] = folder.name
        out["full_model"], out["full_optim"] = get_state_dict(learner, optimizer, options=FULL)
    if load_from is not None:  # other weights, another world size: the checkpoint must replace them all
        other = shard(make_model(seed=1).to(dev))
        optimizer = torch.optim.AdamW(other.parameters(), lr=1e-3, weight_decay=0.05)
        model_state, optim_state = get_state_dict(other, optimizer)
        state = {"model": model_state, "optim": optim_state}
        out["loaded"] = load_sharded(state, load_from).name
        set_state_dict(other, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out["full_model"], out["full_optim"] = get_state_dict(other, optimizer, options=FULL)
    return out


def save_and_get_killed(root, victim=1):
    """Resume from the latest checkpoint and save again; rank ``victim`` is killed in the middle of the save."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    model = shard(make_model().to(device()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    step = int(load_sharded(state, root).name.split("-")[1])
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if dist.get_rank() == victim:  # sabotage: this rank dies right after writing its own file
        write_data = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            written = write_data(self, plan, planner)
            written.wait()
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = write_then_die
    model_state, optim_state = get_state_dict(model, optimizer)
    save_sharded({"model": model_state, "optim": optim_state}, root, step=step + 1)

# %% [markdown]
# <!-- en -->
# The training run uses 12,000 training images for two epochs (a global batch of 192, 96 per rank: 124 steps) in
# the `smoke` profile, the whole training set for two epochs in the `full` profile. Rank 0 prints its progress.
# <!-- ja -->
# 訓練には、`smoke` プロファイルでは訓練画像 12,000枚を 2エポック（全体のバッチサイズ 192、ランクごとに 96。124ステップ）、`full` プロファイルでは訓練データ全体を 2エポック使います。ランク 0 が進み具合を表示します。

# %% tags=["nbval-ignore-output"]
from fsdp_workers import Checkpointed, fsdp_run, save_and_get_killed

if PROFILE == "smoke":
    learning = dict(images=12000, batch=192, epochs=2, lr=1e-2)
else:
    learning = dict(images=60000, batch=256, epochs=2, lr=5e-3)
workdir = tempfile.TemporaryDirectory(prefix="mparlib-09-")
root = Path(workdir.name)  # the chapter's sharded checkpoints: a temporary folder, removed when the kernel stops
print(describe(2))
fsdp2 = launch(fsdp_run, 2, args=(batches, 1e-3), kwargs=dict(learning=learning, save_to=root), timeout=600)

# %% tags=["nbval-ignore-output"]
print(describe(4))
fsdp4 = launch(fsdp_run, 4, args=(batches, 1e-3), kwargs=dict(load_from=root), echo=False, timeout=600)

# %%
for r in (fsdp2, fsdp4):
    e = r["example"]
    print(tr(f"{r['world_size']} ranks: blocks.0.attn.q.weight is a {e['type']} of shape {tuple(e['shape'])}, "
             f"placements {e['placements']}; each rank stores {tuple(e['local_shape'])}",
             f"ランク {r['world_size']}個: blocks.0.attn.q.weight は形状 {tuple(e['shape'])} の "
             f"{e['type']}、配置 {e['placements']}。各ランクが保存するのは {tuple(e['local_shape'])}"))

# %% [markdown]
# <!-- en -->
# `S(0)` is `Shard(0)`: the 64 rows of the matrix are cut into 2 or 4 pieces. The table counts what each rank holds
# right after the first optimizer step, when parameters, gradients and Adam's state all exist (bytes held after the
# step, not a peak), the largest rank's count for each part. One process is the unsharded model of section 1, and the
# last columns compare the total with the ideal 1/N of it:
# <!-- ja -->
# `S(0)` は `Shard(0)` のことで、行列の 64行を 2つまたは 4つに切っています。次の表は、最初のオプティマイザのステップの直後（パラメータ、勾配、Adam の状態がすべてそろっている時点）に各ランクが持っているバイト数を、部分ごとに最も多いランクの値で示します。ステップのあとに持っている量で、ピークを測ったものではありません。プロセス 1個の行は 1節のシャーディングしていないモデルです。最後の列は、合計を理想の 1/N と比べています。

# %%
per_world = {1: single, 2: fsdp2["held"], 4: fsdp4["held"]}
parts = ("params", "grads", "optimizer")
rows = {1: single} | {n: {k: max(h[k] for h in held) for k in parts} for n, held in per_world.items() if n > 1}
total_one = sum(single.values())
print(table([[n, b["params"], b["grads"], b["optimizer"], sum(b[k] for k in parts), f"{total_one / n:,.0f}",
              f"{sum(b[k] for k in parts) / (total_one / n):.3f}"] for n, b in rows.items()],
            [("ranks", "ランク数"), PART["params"], PART["grads"], PART["optimizer"], TOTAL, ("ideal 1/N", "理想 1/N"),
             ("ratio", "比")]))

# %%
for n, b in rows.items():
    assert sum(b[k] for k in parts) <= 1.15 * total_one / n, n  # the chapter's goal: within 15% of 1/N
for n in (2, 4):
    assert sum(h["optimizer"] for h in per_world[n]) == single["optimizer"] + (n - 1) * 4 * steps  # split, not copied

# %%
with course_style():
    fig = Figure(figsize=(5.6, 3.3))
    ax = fig.add_subplot()
    worlds = list(rows)
    bottom = [0] * len(worlds)
    names = {"params": tr("parameters", "パラメータ"), "grads": tr("gradients", "勾配"),
             "optimizer": tr("Adam state", "Adam の状態")}
    for part, color in zip(parts, ("tab:blue", "tab:orange", "tab:green")):
        heights = [rows[n][part] / 1e6 for n in worlds]
        ax.bar([str(n) for n in worlds], heights, bottom=bottom, color=color, label=names[part], width=0.55)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.plot([str(n) for n in worlds], [total_one / n / 1e6 for n in worlds], "k--o",
            label=tr("ideal 1/N", "理想 1/N"))
    ax.set_xlabel(tr("ranks (FSDP2)", "ランク数（FSDP2）"))
    ax.set_ylabel(tr("MB held per rank", "1ランクが持つ MB"))
    ax.set_title(tr("Training state per rank", "1ランクあたりの訓練の状態"))
    ax.legend(fontsize=8)
    fig.tight_layout()
display(Image(figure_png(fig)))

# %% tags=["nbval-ignore-output"]
for r in (fsdp2, fsdp4):
    if r["device"] == "cuda":
        peaks = [h["cuda_max_allocated"] / 2**20 for h in r["held"]]
        print(tr(f"{r['world_size']} ranks on GPUs: allocator peak per rank (MiB):",
                 f"GPU 上のランク {r['world_size']}個: ランクごとのアロケータのピーク（MiB）:"),
              [f"{p:.1f}" for p in peaks])
    else:
        print(tr(f"{r['world_size']} ranks on the CPU: no allocator statistics (torch.cuda.max_memory_allocated "
                 "exists on GPUs only); the tensors were counted instead.",
                 f"CPU 上のランク {r['world_size']}個: アロケータの統計はありません"
                 "（torch.cuda.max_memory_allocated は GPU だけのものです）。代わりにテンソルを数えました。"))

# %% [markdown]
# <!-- en -->
# Each rank holds 1/N of the training state, within a few percent. The few percent are **padding**: FSDP2 cuts
# every parameter along its first dimension into N equal pieces, rounding up, and the position embedding
# `pos`, of shape `(1, 16, 64)`, has a first dimension of 1: one rank stores it whole and the others store padding
# of the same size. Adam's state follows the real shards, so the ranks' states add up to exactly the unsharded
# state (plus one step count per parameter tensor and rank). These counts are what is held after the step, not a peak:
# during the forward and backward passes a rank also holds gathered blocks and activations, so its peak is expected to
# be higher. Where the ranks have GPUs, the cell above printed the allocator's peak
# (`torch.cuda.max_memory_allocated`), which shows it; a CPU has no such statistic, so the next cells measure the
# peak another way, on any machine.
# <!-- ja -->
# 各ランクが持つのは、数パーセントの差を除けば訓練の状態の 1/N です。この数パーセントは**パディング**です。FSDP2 はどのパラメータも 0次元目に沿って N 等分し、端数は切り上げます。位置埋め込み `pos` の形状は `(1, 16, 64)` で 0次元目の大きさが 1 なので、1個のランクが丸ごと保存し、他のランクは同じ大きさのパディングを保存します。Adam の状態は実際のシャードに合わせて作られるので、全ランクの状態を足すと、シャーディングしない場合の状態とちょうど同じになります（これにパラメータのテンソル 1つとランク 1個ごとのステップ数が加わります）。これらはステップのあとに持っている量で、ピークではありません。順伝播と逆伝播の間は、集めたブロックや活性化も持つので、ピークはこれより大きくなるはずです。ランクが GPU 上にあれば、上のセルがアロケータのピーク（`torch.cuda.max_memory_allocated`）を表示しているので、それで確かめられます。CPU にはこの統計がないので、次のセルでは別の方法で、どのマシンでもピークを測ります。

# %% [markdown]
# <!-- en -->
# ### Peak memory per rank
#
# What limits a model is the **peak**: the most a rank holds at any one moment of a step, not what is left after it.
# `sharding.PeakMemory` measures it from the tensors themselves. It is a dispatch mode, like `CollectiveLog`: every
# operator of the step passes through it (forward, backward, the collectives, the optimizer), and after each one it
# counts the training state as `sharding.training_tensors` lists it (the parameters the model exposes now, which
# under FSDP2 include the gathered units; every `.grad`, plus the sharding code's own gradient buffers; the
# optimizer's state), each storage once, and keeps the largest total. The count is exact for every tensor that
# lives across at least one operator, and deterministic: the same operators run in the same order every time, so
# the numbers can be asserted. Activations are left out on purpose: they are the same for all four methods at the
# same batch per rank. `sharding.peak_memory_worker` builds the model for each method with
# `sharding.data_parallel_method`: DDP and ZeRO-1 with `gradient_as_bucket_view=True`, DDP's leanest setting, where
# the gradients are its communication buckets (by default DDP keeps them a second time), ZeRO-2 as
# `Zero2Optimizer` with 64 KiB buckets, FSDP2 as above, plus this chapter's sharded step. It runs one step to
# create Adam's state and measures the second. The 2- and 4-rank launches above ran it; one process gives N = 1:
# <!-- ja -->
# ### 1ランクあたりのピークメモリ
#
# モデルが収まるかどうかを決めるのは**ピーク**、つまりステップの途中でランクがいちばん多く持つ瞬間の量で、ステップのあとに残る量ではありません。`sharding.PeakMemory` は、これをテンソルそのものから測ります。`CollectiveLog` と同じくディスパッチモードで、ステップのすべての演算子（順伝播、逆伝播、集合通信、オプティマイザ）がここを通ります。演算子が 1つ終わるたびに、`sharding.training_tensors` が挙げる訓練の状態（モデルが今見せているパラメータ。FSDP2 では集めたユニットも含みます。すべての `.grad` と、シャーディングのコードが持つ勾配バッファ。オプティマイザの状態）を、ストレージごとに 1回ずつ数え、最大の合計を残します。演算子 1つ以上の間存在するテンソルについては正確で、しかも決定的です。毎回同じ演算子が同じ順序で実行されるので、数値を `assert` で確かめられます。活性化はわざと除いています。ランクあたりのバッチが同じなら、4つの方式で同じだからです。`sharding.peak_memory_worker` は、方式ごとに `sharding.data_parallel_method` でモデルを用意します。DDP と ZeRO-1 は `gradient_as_bucket_view=True` で動かします。勾配が通信用のバケットそのものになる、DDP で最もメモリの少ない設定です（既定では DDP は勾配をもう 1組持ちます）。ZeRO-2 はバケット 64 KiB の `Zero2Optimizer`、FSDP2 は上と同じ設定で、この章のシャーディングしたステップも加えます。1ステップ目で Adam の状態を作り、2ステップ目を測ります。上のランク 2個と 4個の起動でこれを実行しました。N = 1 は 1個のプロセスで測ります。

# %% tags=["nbval-ignore-output"]
one_rank = dict(patch=7, bucket_bytes=2**16, methods=sharding.PEAK_METHODS + ("sharded step",))
peaks = {1: launch(sharding.peak_memory_worker, 1, kwargs=one_rank, echo=False, timeout=300)["methods"],
         2: fsdp2["peaks"], 4: fsdp4["peaks"]}
METHODS = sharding.PEAK_METHODS
print(table([[(f"{n} rank(s)", f"ランク {n}個")] + [r[m]["peak_bytes_per_rank"] for m in METHODS]
             + [r["sharded step"]["peak_bytes_per_rank"]] for n, r in peaks.items()],
            [("peak bytes per rank", "1ランクのピークのバイト数"), *METHODS, ("sharded step", "この章のステップ")]))
print()
print(tr("at ZeRO-2's and FSDP2's peak on 4 ranks (rank 0):", "ランク 4個での ZeRO-2 と FSDP2 のピークの内訳（ランク 0）:"))
for m in ("ZeRO-2", "FSDP2"):
    at, after = peaks[4][m]["per_rank"][0]["parts"], peaks[4][m]["per_rank"][0]["after"]
    print(f"  {m}: " + join(f"{names[k]} {at[k]:,}" for k in parts)
          + tr(f"; after the step {sum(after.values()):,} in all", f"。ステップのあとは合計 {sum(after.values()):,}"))

# %%
P = single["params"]  # 555,560 bytes of float32 parameters; Adam's state is twice that
largest_grad = 4 * max(p.numel() for p in make_model().parameters())
for m in METHODS:
    assert 4 * P <= peaks[1][m]["peak_bytes_per_rank"] <= 1.1 * 4 * P, m  # one rank: 16 bytes per parameter
for n in (2, 4):
    peak = {m: peaks[n][m]["peak_bytes_per_rank"] for m in METHODS + ("sharded step",)}
    assert peak["FSDP2"] < peak["ZeRO-2"] < peak["ZeRO-1"] < peak["DDP"], (n, peak)
    assert peak["sharded step"] > peak["ZeRO-1"]  # its flat copy of the gradients
    for rank in peaks[n]["ZeRO-2"]["per_rank"]:  # 1/N of the gradients + one bucket + one fresh gradient
        assert rank["parts"]["grads"] <= P / n + 2**16 + largest_grad + 8 * n * 16
    fsdp_rank = peaks[n]["FSDP2"]["per_rank"][0]
    assert sum(fsdp_rank["after"].values()) < fsdp_rank["peak"]  # the peak is not what is left after the step

# %%
with course_style():
    fig = Figure(figsize=(6.0, 3.3))
    ax = fig.add_subplot()
    shown = METHODS + ("sharded step",)
    labels_m = {m: m for m in METHODS} | {"sharded step": tr("sharded step", "この章のステップ")}
    width = 0.8 / len(shown)
    for i, m in enumerate(shown):
        ax.bar([j + (i - (len(shown) - 1) / 2) * width for j in range(len(peaks))],
               [peaks[n][m]["peak_bytes_per_rank"] / 1e6 for n in peaks], width=width, label=labels_m[m])
    ax.set_xticks(range(len(peaks)), [str(n) for n in peaks])
    ax.set_xlabel(tr("ranks", "ランク数"))
    ax.set_ylabel(tr("peak MB per rank", "1ランクのピーク（MB）"))
    ax.set_title(tr("Peak of parameters + gradients + Adam state", "パラメータ、勾配、Adam の状態のピーク"))
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
display(Image(figure_png(fig)))

# %% [markdown]
# <!-- en -->
# On one rank every method holds 16 bytes per parameter at its peak, at the end of the step, when the gradients
# and Adam's state both exist. On 2 and 4 ranks the order is the one the ZeRO stages promise, now as peaks:
# ZeRO-1 saves Adam's state, ZeRO-2 also the gradients (its gradients never exceed 1/N plus one bucket and the one
# gradient autograd has just produced), FSDP2 also the parameters, although at its peak a rank holds the gathered
# blocks (the one that computes and the next, prefetched) and a unit's full gradients before they are
# reduce-scattered, so its peak is well above what it holds after the step. The chapter's sharded step has about
# DDP's peak: for a moment it holds every gradient twice.
# <!-- ja -->
# ランク 1個では、どの方式もピークでパラメータ 1つあたり 16バイトを持ちます。ピークはステップの終わり、勾配と Adam の状態がそろった瞬間です。ランク 2個と 4個では、ZeRO のステージが約束する順序が、ピークとしても成り立ちます。ZeRO-1 は Adam の状態を、ZeRO-2 は勾配も減らし（勾配は 1/N とバケット 1つ、autograd が作ったばかりの勾配 1つ分を超えません）、FSDP2 はパラメータも減らします。ただし FSDP2 のピークでは、集めたブロック（計算中のものと先読みした次のもの）と、リデュース・スキャッターする前のユニットの完全な勾配も持つので、ステップのあとに持つ量よりかなり大きくなります。この章のシャーディングしたステップのピークは DDP とほぼ同じです。一瞬、すべての勾配を 2組持つからです。

# %% [markdown]
# <!-- en -->
# ### ZeRO-3 or ZeRO-2: `reshard_after_forward`
#
# With `reshard_after_forward=True` (the default for blocks), a block's parameters are freed after its forward and
# gathered again for its backward: the least memory, at the price of a second all-gather. With `False`, they stay
# gathered from the forward to the backward: the behaviour of ZeRO-2, with full parameters during the step.
# `CollectiveLog` counts what one training step sends (the bytes of the whole tensors, gathered or reduced).
# PyTorch's own `CommDebugMode` (`torch.distributed.tensor.debug`) sees FSDP's collectives too and counts the same
# calls, but it does not record their sizes.
# <!-- ja -->
# ### ZeRO-3 と ZeRO-2 の切り替え: `reshard_after_forward`
#
# `reshard_after_forward=True`（ブロックの既定値）では、ブロックのパラメータは順伝播のあとで解放され、逆伝播のためにもう一度集められます。メモリは最も少なくなりますが、オールギャザーが 2回になります。`False` にすると、順伝播から逆伝播まで集めたまま保持します。これは ZeRO-2 の振る舞いで、ステップの間は完全なパラメータを持ちます。1回の訓練ステップで送るもの（集めたり足し合わせたりするテンソル全体のバイト数）を `CollectiveLog` で数えます。PyTorch 自身の `CommDebugMode`（`torch.distributed.tensor.debug`）も FSDP の集合通信を捉えて同じ回数を数えますが、その大きさは記録しません。

# %%
print(table([[r["world_size"], label, f"{log['all_gather']['calls']}x {log['all_gather']['bytes']:,}",
              f"{log['reduce_scatter']['calls']}x {log['reduce_scatter']['bytes']:,}"]
             for r in (fsdp2, fsdp4)
             for label, log in (("True (ZeRO-3)", r["collectives"]), ("False (ZeRO-2)", r["collectives_kept"]))],
            [("ranks", "ランク数"), "reshard_after_forward", "all_gather", "reduce_scatter"], align="><>>"))

# %%
for r in (fsdp2, fsdp4):
    units = len(make_model().blocks) + 1
    assert r["collectives"]["all_gather"]["calls"] == units + 4  # the 4 blocks are gathered again for backward
    assert r["collectives_kept"]["all_gather"]["calls"] == units
    assert r["collectives"]["reduce_scatter"] == r["collectives_kept"]["reduce_scatter"]
    assert r["collectives"]["reduce_scatter"]["calls"] == units
    assert single["params"] <= r["collectives_kept"]["all_gather"]["bytes"] <= 1.05 * single["params"]

# %% [markdown]
# <!-- en -->
# One unit per block plus the root: 5 all-gathers in the forward and 5 reduce-scatters in the backward, and with
# resharding 4 more all-gathers (the root is not resharded). The bytes are those of the whole model, padding
# included: with `False` the all-gathers move the model once per step and the reduce-scatters once, which is
# exactly DDP's all-reduce (a reduce-scatter and an all-gather); with `True` the parameters travel almost twice,
# **1.5 times DDP's traffic** in all, the figure the ZeRO paper gives for stage 3. In exchange, a rank holds the full
# parameters only of the block that computes and of the next one, prefetched, never of all blocks at once.
#
# ### Mixed precision
#
# `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)` keeps the sharded parameters in
# float32 (they are the master copy: the optimizer updates them), casts them to bfloat16 when they are gathered,
# computes in bfloat16, and reduce-scatters the gradients in float32. bfloat16 works on the CPU too, with gloo:
# <!-- ja -->
# ブロックごとに 1つとルートで、ユニットは 5つです。順伝播で 5回のオールギャザー、逆伝播で 5回のリデュース・スキャッターを行い、パラメータを解放する場合はさらに 4回オールギャザーします（ルートは解放しません）。バイト数はパディングを含めたモデル全体の大きさです。`False` では、オールギャザーでモデルを 1ステップに 1回分、リデュース・スキャッターで 1回分送ります。これは DDP のオールリデュース（リデュース・スキャッターとオールギャザー）とちょうど同じです。`True` ではパラメータがほぼ 2回送られるので、全体で **DDP の 1.5倍の通信量**になります。ZeRO の論文がステージ 3 について示している値です。その代わり、1個のランクが完全なパラメータを持つのは、計算中のブロックと先読みした次のブロックの分だけで、すべてのブロックの分を同時に持つことはありません。
#
# ### 混合精度
#
# `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)` は、シャーディングしたパラメータを float32 のまま保ち（これがマスターコピーで、オプティマイザが更新します）、集めるときに bfloat16 に変換して bfloat16 で計算し、勾配は float32 でリデュース・スキャッターします。bfloat16 は CPU と gloo でも動きます。

# %%
ag32, ag16 = fsdp2["collectives"]["all_gather"], fsdp2["collectives_bf16"]["all_gather"]
print(tr("output of the forward pass:", "順伝播の出力:"), fsdp2["bf16_output"])
print(tr("sharded parameters (the master copy):", "シャーディングしたパラメータ（マスターコピー）:"), fsdp2["bf16_stored"])
print(tr(f"bytes all-gathered per step: {ag32['bytes']:,} in float32, {ag16['bytes']:,} in bfloat16 "
         f"({ag16['bytes'] / ag32['bytes']:.2f}x)",
         f"1ステップでオールギャザーするバイト数: float32 で {ag32['bytes']:,}、bfloat16 で {ag16['bytes']:,}"
         f"（{ag16['bytes'] / ag32['bytes']:.2f}倍）"))
print(tr("bytes reduce-scattered per step, same in both:", "1ステップでリデュース・スキャッターするバイト数（両方で同じ）:"),
      fsdp2["collectives_bf16"]["reduce_scatter"] == fsdp2["collectives"]["reduce_scatter"])

# %% [markdown]
# <!-- en -->
# The all-gathers carry half the bytes, so the gathered blocks should take half the memory too (2 bytes per element
# instead of 4; no cell here measures that); the gradients are reduced in float32, as asked. On GPUs with
# bfloat16 support the matrix products usually run several times faster as well; on a CPU they may be slower,
# depending on the processor (this chapter times neither).
#
# ### The same training as one process
#
# FSDP changes where the numbers live, not what is computed: the losses of the ten fp32 steps on 2 and 4 ranks
# must equal those of one process training on the whole batches. The tolerance is 1e-4 on losses of about 2.
# float32 rounding, from summing the ranks' gradients in another order and from other splits of the matrix
# products, stays around 1e-6 over ten steps on a CPU; ranks on GPUs use other kernels and round differently,
# and 1e-4 covers both while staying far below what a real change does: bfloat16 moves the losses by a few
# hundredths, which the check must see, and does.
# <!-- ja -->
# オールギャザーで送るバイト数は半分になるので、集めたブロックのメモリも半分になるはずです（要素あたり 4バイトではなく 2バイト。このメモリを測るセルはありません）。勾配は指定どおり float32 で足し合わされます。bfloat16 に対応した GPU では行列積もふつう数倍速くなりますが、CPU ではプロセッサによっては遅くなることもあります（この章ではどちらの時間も測っていません）。
#
# ### 1個のプロセスと同じ訓練
#
# FSDP が変えるのは数値をどこに置くかで、何を計算するかではありません。fp32 の 10ステップについて、ランク 2個とランク 4個の損失は、1個のプロセスでバッチ全体を使って訓練したときの損失と等しいはずです。許容誤差は、2 程度の損失に対して 1e-4 とします。float32 の丸め誤差（ランクの勾配を足す順序や、行列積の分け方の違いから生じます）は、CPU では 10ステップで 1e-6 程度にとどまります。GPU 上のランクは別のカーネルを使うので丸め方が違いますが、1e-4 はその両方を含み、しかも本当に計算が変わったときの差よりずっと小さい値です。bfloat16 では損失が 0.01 の数倍ずれますが、この確認はそのずれを確実に検出します。

# %% tags=["nbval-ignore-output"]
one = make_model()
optimizer = torch.optim.Adam(one.parameters(), lr=1e-3)
one_losses = []
for X, y in batches:
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(one(X), y)
    loss.backward()
    optimizer.step()
    one_losses.append(loss.item())


def loss_gap(losses):
    return max(abs(a - b) for a, b in zip(losses, one_losses))


print(tr("losses of one process:", "1個のプロセスの損失:"), [round(v, 4) for v in one_losses])
rows = []
for label, losses in ((tr("FSDP, 2 ranks", "FSDP、ランク 2個"), fsdp2["losses"]),
                      (tr("FSDP, 4 ranks", "FSDP、ランク 4個"), fsdp4["losses"]),
                      (tr("FSDP, 2 ranks, bfloat16", "FSDP、ランク 2個、bfloat16"), fsdp2["losses_bf16"]),
                      (tr("FSDP, 2 ranks, activation checkpointing", "FSDP、ランク 2個、活性化の再計算"),
                       fsdp2["losses_checkpointed"])):
    rows.append([label, f"{loss_gap(losses):.1e}"])
print(table(rows, ["", ("largest difference", "差の最大値")]))

# %%
assert len(fsdp2["losses"]) == len(fsdp4["losses"]) == 10 and one_losses[-1] < one_losses[0]
assert loss_gap(fsdp2["losses"]) < 1e-4 and loss_gap(fsdp4["losses"]) < 1e-4
assert loss_gap(fsdp2["losses_bf16"]) > 1e-3  # a real change of arithmetic is far outside the tolerance
assert loss_gap(fsdp2["losses_checkpointed"]) < 1e-4

# %% [markdown]
# <!-- en -->
# ### Gradient accumulation, forward prefetch and HSDP
#
# Three more settings of FSDP2, each run by the launches above on the first three batches and held to the same
# standard, the losses of one process:
#
# - **Gradient accumulation**: each batch in 2 micro-batches, each loss divided by 2. With
#   `model.set_requires_gradient_sync(False)` on every micro-batch but the last, FSDP2 keeps the unsharded
#   gradients and reduce-scatters once per step instead of once per micro-batch (the all-gathers still happen for
#   every micro-batch: the parameters are resharded after each one).
# - **Explicit forward prefetch**: `block.set_modules_to_forward_prefetch([next_block])` makes each block issue the
#   all-gather of the next one when its own forward starts, so that the transfer overlaps its computation. The
#   worker records the order in which the all-gathers (AG) and the block forwards (F0 to F3) were issued.
# - **HSDP** (hybrid sharding) on 4 ranks: `fully_shard` with a 2-D `DeviceMesh` of shape (2, 2), named
#   `("replicate", "shard")`. Each parameter is sharded within a pair of ranks and replicated across the 2 pairs:
#   all-gathers and reduce-scatters stay inside a pair (in a cluster, inside a node, over the fast links), and the
#   pairs then all-reduce their gradient shards.
# <!-- ja -->
# ### 勾配累積、順伝播の先読み、HSDP
#
# FSDP2 の設定をさらに 3つ試します。どれも上の起動で最初の 3バッチについて実行したもので、同じ基準（1個のプロセスの損失）で確かめます。
#
# - **勾配累積**: 各バッチを 2つのマイクロバッチに分け、それぞれの損失を 2 で割ります。最後以外のマイクロバッチで `model.set_requires_gradient_sync(False)` にすると、FSDP2 はシャーディングしていない勾配を持ち続け、リデュース・スキャッターをマイクロバッチごとではなく 1ステップに 1回だけ行います（オールギャザーはマイクロバッチごとに行います。パラメータは毎回解放されるからです）。
# - **順伝播の明示的な先読み**: `block.set_modules_to_forward_prefetch([next_block])` とすると、各ブロックは自分の順伝播を始めるときに次のブロックのオールギャザーを発行するので、転送が自分の計算と重なります。ワーカーは、オールギャザー（AG）とブロックの順伝播（F0〜F3）が発行された順序を記録します。
# - **HSDP**（ハイブリッドシャーディング）、ランク 4個: 形状が (2, 2) で次元の名前が `("replicate", "shard")` の 2次元の `DeviceMesh` を渡して `fully_shard` を呼びます。各パラメータは 2個のランクの組の中でシャーディングされ、2つの組の間では複製されます。オールギャザーとリデュース・スキャッターは組の中で閉じ（クラスタなら、ノードの中の高速なリンクの上です）、そのあと組どうしが勾配のシャードをオールリデュースします。

# %% tags=["nbval-ignore-output"]
rows = []
for label, losses in ((tr("FSDP, 2 ranks, 2 micro-batches", "FSDP、ランク 2個、マイクロバッチ 2個"),
                       fsdp2["losses_accumulated"]),
                      (tr("FSDP, 4 ranks, 2 micro-batches", "FSDP、ランク 4個、マイクロバッチ 2個"),
                       fsdp4["losses_accumulated"]),
                      (tr("HSDP, 4 ranks on a 2 x 2 mesh", "HSDP、ランク 4個、2 × 2 のメッシュ"), fsdp4["losses_hsdp"])):
    rows.append([label, f"{loss_gap(losses):.1e}"])
print(table(rows, ["", ("largest difference", "差の最大値")]))
def call_counts(log):
    return join(f"{KINDS[k]} {c['calls']}x" for k, c in log.items())


print(tr("collectives of one accumulated step, 2 ranks:", "累積した 1ステップの集合通信（ランク 2個）:"),
      call_counts(fsdp2["collectives_accumulated"]))
print(tr("collectives of one HSDP step:", "HSDP の 1ステップの集合通信:"), call_counts(fsdp4["collectives_hsdp"]))
placements, local = fsdp4["hsdp_placements"]
print(tr(f"HSDP: blocks.0.attn.q.weight placements {placements}, each rank stores {tuple(local)}",
         f"HSDP: blocks.0.attn.q.weight の配置 {placements}。各ランクが保存するのは {tuple(local)}"))
print(tr("forward order, default:         ", "順伝播の順序（既定）:        "), " ".join(fsdp2["prefetch"]["order_default"]))
print(tr("forward order, explicit prefetch:", "順伝播の順序（明示的な先読み）:"), " ".join(fsdp2["prefetch"]["order"]))

# %%
for r in (fsdp2, fsdp4):
    assert loss_gap(r["losses_accumulated"]) < 1e-4
    assert r["collectives_accumulated"]["reduce_scatter"]["calls"] == units  # once per step, not per micro-batch
    assert r["collectives_accumulated"]["all_gather"]["calls"] == 2 * (units + 4)
    order, default = r["prefetch"]["order"], r["prefetch"]["order_default"]
    for i in range(3):  # with prefetch, block i + 1 is gathered before block i computes; without, only block i
        assert order[:order.index(f"F{i}")].count("AG") == i + 3
        assert default[:default.index(f"F{i}")].count("AG") == i + 2
assert loss_gap(fsdp4["losses_hsdp"]) < 1e-4
assert fsdp4["hsdp_placements"] == (["R", "S(0)"], [32, 64])  # replicated across pairs, 64 rows halved
assert {k: c["calls"] for k, c in fsdp4["collectives_hsdp"].items()} == {
    "all_gather": units + 4, "reduce_scatter": units, "all_reduce": units}

# %% [markdown]
# <!-- en -->
# All three train like one process. Accumulating costs no reduce-scatter until the last micro-batch (5, one per
# unit, for the whole step), at the price of holding the unit's full gradients between micro-batches. With explicit
# prefetch, every block's all-gather is issued one block earlier: block 1 is requested before block 0 computes.
# By default FSDP2 prefetches in the backward pass only; in the forward each all-gather waits for the block's own
# pre-forward hook. HSDP stores half of each parameter per rank, as 2-rank FSDP does, and adds one all-reduce per
# unit, across the pairs, in the backward pass: in a cluster the heavy all-gathers stay on the fast links within a
# node, and only the gradient shards cross between nodes.
# <!-- ja -->
# 3つとも 1個のプロセスと同じように訓練が進みます。累積では、最後のマイクロバッチまでリデュース・スキャッターをしません（1ステップ全体でユニットごとに 1回、5回です）。その代わり、マイクロバッチの間はユニットの完全な勾配を持ち続けます。明示的な先読みでは、各ブロックのオールギャザーが 1ブロック分早く発行されます。ブロック 0 が計算する前に、ブロック 1 が要求されています。既定では FSDP2 は逆伝播でだけ先読みし、順伝播では各オールギャザーはそのブロック自身の順伝播前のフックを待ちます。HSDP では、ランク 2個の FSDP と同じく各ランクがパラメータの半分を保存し、逆伝播で組の間のオールリデュースがユニットごとに 1回加わります。クラスタなら、重いオールギャザーはノードの中の高速なリンクにとどまり、ノードの間を行き来するのは勾配のシャードだけです。

# %% [markdown]
# <!-- en -->
# Ten steps on 2 and on 4 ranks agree with one process, and so do three steps with activation checkpointing
# (next section): recomputing a block gives the same numbers. The real training run of the 2-rank launch learned
# too; its curve follows, and section 5 measures the test accuracy of the model it saved.
# <!-- ja -->
# ランク 2個でも 4個でも、10ステップの損失は 1個のプロセスと一致します。活性化の再計算（次の節）を使った 3ステップも一致します。ブロックを再計算しても同じ数値になるからです。2ランクの起動で行った実際の訓練でも、モデルはきちんと学習しました。その曲線を次に示します。保存したモデルのテスト精度は 5節で測ります。

# %%
curve = fsdp2["curve"]
smooth = [sum(curve[max(0, i - 9):i + 1]) / len(curve[max(0, i - 9):i + 1]) for i in range(len(curve))]
with course_style():
    fig = Figure(figsize=(5.2, 3.0))
    ax = fig.add_subplot()
    ax.plot(range(1, len(curve) + 1), curve, color="tab:blue", alpha=0.3, lw=0.8)
    ax.plot(range(1, len(curve) + 1), smooth, color="tab:blue", label=tr("training loss (10-step mean)",
                                                                       "訓練損失（10ステップの平均）"))
    ax.set_xlabel(tr("step", "ステップ"))
    ax.set_ylabel(tr("training loss", "訓練損失"))
    ax.set_title(tr("FSDP2 on 2 ranks, Fashion-MNIST", "FSDP2、ランク 2個、Fashion-MNIST"))
    ax.legend(fontsize=8)
    fig.tight_layout()
display(Image(figure_png(fig)))
assert sum(curve[-20:]) / 20 < 0.6 * sum(curve[:20]) / 20

# %% [markdown]
# <!-- en -->
# ## Activation memory
#
# Sharding divides the training state, but the **activations** stay whole on every rank: the backward pass needs
# outputs of the forward pass (the input of each linear layer, the attention probabilities, ...), so autograd
# keeps them until it has used them. Their size grows with the batch and the sequence length, and for large
# models they often exceed the training state.
#
# **Activation checkpointing** keeps only each block's input and recomputes the block's forward pass during the
# backward pass: the activations of one block at a time instead of all blocks, for the price of one more forward
# pass per block (about a third more compute). `torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`
# does it; the `Checkpointed` wrapper of the worker cell applies it to a block, and with FSDP the blocks are
# wrapped first and then sharded, as the run above did.
#
# To see the saving, count what autograd keeps. `torch.autograd.graph.saved_tensors_hooks(pack, unpack)` calls
# `pack` on every tensor that is saved for the backward pass; the cell below adds up their storage (the
# parameters, which exist anyway, are left out) for one forward pass of 64 images, with and without
# checkpointing, in this process on the CPU (the bytes depend on the attention kernel, so they are measured in one
# place), and times a training step of each with `measure_each`, chapter 8's rules for two functions at once: a
# warm-up step of each, then steps of the two in turn, at least 5 of each and 50 ms in all, so that a change in
# the machine's load falls on both alike.
# <!-- ja -->
# ## 活性化のメモリ
#
# シャーディングで訓練の状態は分割できますが、**活性化**はどのランクにも丸ごと残ります。逆伝播は順伝播の出力（各線形層の入力、アテンションの確率など）を必要とするので、autograd はそれを使い終わるまで保持します。その大きさはバッチの大きさや系列長とともに増え、大きなモデルでは訓練の状態より大きくなることもよくあります。
#
# **活性化の再計算**（activation checkpointing）は、各ブロックの入力だけを残し、逆伝播の途中でそのブロックの順伝播をもう一度計算します。すべてのブロックの活性化ではなく一度に 1ブロック分で済む代わりに、ブロックごとに順伝播が 1回増えます（計算量はおよそ 3分の 1 増えます）。`torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)` がこれを行います。ワーカーのセルの `Checkpointed` はこれをブロックに適用するラッパーです。FSDP と組み合わせるときは、上の実行と同じように、先にブロックをラップしてからシャーディングします。
#
# 効果を見るため、autograd が保持するものを数えます。`torch.autograd.graph.saved_tensors_hooks(pack, unpack)` は、逆伝播のために保存されるすべてのテンソルについて `pack` を呼び出します。次のセルでは、画像 64枚の順伝播 1回について、その裏にあるストレージのバイト数を合計します（どのみち存在するパラメータは除きます）。再計算ありとなしの両方を、このプロセスの CPU で測ります（バイト数はアテンションのカーネルによって変わるので、1か所で測ります）。それぞれの訓練ステップの時間も `measure_each` で測ります。8章と同じ規則を 2つの関数に同時に適用するもので、それぞれウォームアップを 1ステップ行ったあと、2つを交互に、それぞれ 5ステップ以上、全体で 50 ms 以上になるまで測ります。こうすると、マシンの負荷が変わっても 2つに同じように影響します。

# %% tags=["nbval-ignore-output"]
def saved_activation_bytes(model, X, y):
    """Bytes of the tensors autograd keeps for the backward pass of one forward pass (parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = nn.functional.cross_entropy(model(X), y)
    loss.backward()
    return sum(kept.values())


def training_step(model, X, y):
    """One Adam step on (X, y), as a function of no arguments, for mparlib.timing."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step():
        nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


X64, y64 = X_all[:64], y_all[:64]
plain = make_model()
checkpointed = make_model()
checkpointed.blocks = nn.ModuleList(Checkpointed(b) for b in checkpointed.blocks)
models = {"plain": plain, "checkpointed": checkpointed}
activation = {name: saved_activation_bytes(m, X64, y64) for name, m in models.items()}
seconds = measure_each({name: training_step(m, X64, y64) for name, m in models.items()})  # in turn, round by round
block_input = 64 * 16 * 64 * 4  # one block's input: (B, T, dim) = (64, 16, 64) in float32
labels = {"plain": tr("without checkpointing", "再計算なし"), "checkpointed": tr("with checkpointing", "再計算あり")}
print(table([[label, activation[name], f"{1000 * seconds[name].median:.1f}",
              f"{1000 * min(seconds[name].times):.1f}-{1000 * max(seconds[name].times):.1f}"]
             for name, label in labels.items()],
            ["", ("saved for backward", "逆伝播のための保存"), ("ms per step", "ステップあたり ms"),
             ("min-max ms", "最小-最大 ms")]))
print(tr(f"{len(seconds['plain'].times)} steps each after a warm-up step; the machine was "
         + ("busy (load above 0.3 per core)" if seconds["plain"].busy else "not busy"),
         f"ウォームアップのステップのあと、それぞれ {len(seconds['plain'].times)}ステップ。マシンは"
         + ("混んでいました（コアあたりのロードアベレージ 0.3 超）" if seconds["plain"].busy else "空いていました")))
print(tr(f"saved with checkpointing: {activation['checkpointed'] / activation['plain']:.0%}; "
         f"the 4 block inputs alone are {4 * block_input:,} bytes",
         f"再計算ありで保存される量: {activation['checkpointed'] / activation['plain']:.0%}。4つのブロックの入力だけで "
         f"{4 * block_input:,}バイトです"))

# %%
assert activation["checkpointed"] < 0.25 * activation["plain"]
assert activation["checkpointed"] >= 4 * block_input  # each checkpointed block still keeps its input

# %% [markdown]
# <!-- en -->
# With checkpointing the saved activations shrink to about a fifth: what remains is mostly the four block inputs
# and the layers outside the blocks, while during the backward pass one block's activations exist again for a
# moment. The step takes longer by the recomputed forward passes (on a busy CPU the times are noisy). The
# same trade in other forms: checkpoint every second block, or only the attention, to balance memory and time.
# <!-- ja -->
# 再計算を使うと、保存される活性化はおよそ 5分の 1 になります。残るのは主に 4つのブロックの入力とブロックの外の層で、逆伝播の間は 1ブロック分の活性化が一時的にまた現れます。ステップは、順伝播を再計算する分だけ長くなります（混んだ CPU では時間がばらつきます）。メモリと計算時間のこの交換は、ほかのやり方でもできます。1つおきのブロックだけ、あるいはアテンションだけを再計算して、メモリと時間の釣り合いをとります。

# %% [markdown]
# <!-- en -->
# ## Sharded checkpoints
#
# With sharding no rank holds the whole model, so no rank can write it with `torch.save`, and gathering it on one
# rank could need more memory than that rank has. `torch.distributed.checkpoint` (DCP) lets **every rank write
# its own shards**, in parallel, into one folder: a file per rank and an index, `.metadata`, that says which piece
# of which tensor lies where. Loading **reshards**: each rank asks for the pieces of its own layout, whatever the
# layout at save time, and DCP reads them from whichever files hold them. A checkpoint saved by 2 ranks loads into
# 4 ranks, or into a single process without any process group.
#
# `torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)` gives the model's and the optimizer's
# state as DTensors with names that do not depend on the wrapping; `set_state_dict` puts them back.
#
# A save can also be cut off: a process killed by the out-of-memory killer, a node that goes down, a job that
# runs out of time. `mparlib.sharded_checkpoint.save_sharded` makes a save complete or absent:
#
# 1. every rank writes into a temporary folder `.step-NNNNNNNN.partial` (DCP's coordinator writes `.metadata` last,
#    once every rank's files are written);
# 2. when all ranks are done, rank 0 renames the folder to `step-NNNNNNNN`, one atomic step on the file system;
# 3. then it rewrites the small file `latest`, which names the last complete save (atomically too).
#
# Each save also lists the SHA-256 checksum of every file it wrote (`.mparlib-checksums.json`), which a load checks
# before it reads anything, and the root holds a lock file (`.mparlib.lock`) so that one run at a time writes into it.
#
# `load_sharded(state, root)` follows `latest`, and refuses any folder that is not a complete save. The 2-rank run
# above saved its trained model and AdamW state this way:
# <!-- ja -->
# ## シャーディングしたチェックポイント
#
# シャーディングすると、どのランクもモデル全体を持っていないので、`torch.save` で書き出せるランクがありません。1個のランクに集めようとすると、そのランクのメモリが足りなくなるかもしれません。`torch.distributed.checkpoint`（DCP）は、**各ランクが自分のシャードを**並行して 1つのフォルダに書き込めるようにします。ランクごとのファイルと、どのテンソルのどの部分がどこにあるかを記した索引 `.metadata` です。読み込むときは**再シャーディング**が起こります。各ランクは、保存したときの配置に関係なく、自分の配置に必要な部分を要求し、DCP はそれを持っているファイルから読み出します。2個のランクで保存したチェックポイントを 4個のランクに読み込むことも、プロセスグループのない 1個のプロセスに読み込むこともできます。
#
# `torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)` は、モデルとオプティマイザの状態を、ラップの仕方によらない名前の DTensor として返します。`set_state_dict` はそれを元に戻します。
#
# 保存が途中で断ち切られることもあります。メモリ不足でプロセスが強制終了される、ノードが落ちる、ジョブの制限時間が来る、などです。`mparlib.sharded_checkpoint.save_sharded` は、保存が完了しているか、まったく存在しないかのどちらかになるようにします。
#
# 1. 各ランクは一時フォルダ `.step-NNNNNNNN.partial` に書き込みます（DCP のコーディネータは、全ランクのファイルが書き終わってから最後に `.metadata` を書きます）。
# 2. 全ランクが終わったら、ランク 0 がフォルダの名前を `step-NNNNNNNN` に変えます。ファイルシステム上でアトミックな 1回の操作です。
# 3. そのあと、最後に完了した保存を指す小さなファイル `latest` を書き直します（これもアトミックに行います）。
#
# 保存のたびに、書いたすべてのファイルの SHA-256 チェックサムの一覧（`.mparlib-checksums.json`）も残します。読み込みは何かを読む前にこれを確かめます。また、ルートにはロックファイル（`.mparlib.lock`）があり、一度に 1つの実行だけが書き込めます。
#
# `load_sharded(state, root)` は `latest` をたどり、完了した保存でないフォルダは拒否します。上の 2ランクの実行は、訓練したモデルと AdamW の状態をこの方法で保存しました。

# %% tags=["nbval-ignore-output"]
def listing(folder):
    """The names in a checkpoint root, with the files of each save in it (the root's lock file left out)."""
    return {p.name: sorted(q.name for q in p.iterdir()) if p.is_dir() else p.read_text().strip()
            for p in sorted(folder.iterdir()) if p.name != LOCK_NAME}


saved = fsdp2["saved"]
print(listing(root))
print(tr(f"4 ranks loaded {fsdp4['loaded']}", f"ランク 4個が {fsdp4['loaded']} を読み込みました"))
model_gap = max((fsdp4["full_model"][k] - fsdp2["full_model"][k]).abs().max().item() for k in fsdp2["full_model"])
optim_equal = all(torch.equal(fsdp4["full_optim"]["state"][name][k], state[k])
                  for name, state in fsdp2["full_optim"]["state"].items() for k in state)
print(tr(f"largest parameter difference, 4 ranks vs the 2 that saved: {model_gap}; AdamW state equal: {optim_equal}",
         f"パラメータの差の最大値（ランク 4個と保存したランク 2個）: {model_gap}。AdamW の状態は一致: {optim_equal}"))

# %%
assert listing(root) == {"latest": saved, saved: sorted([".metadata", CHECKSUMS, "__0_0.distcp", "__1_0.distcp"])}
assert fsdp4["loaded"] == saved and model_gap == 0 and optim_equal
assert fsdp2["full_model"].keys() == make_model().state_dict().keys()  # plain names, as in an unwrapped model

# %% [markdown]
# <!-- en -->
# The 4 ranks got the 2 ranks' parameters and optimizer state bit for bit, each rank reading a quarter of every
# tensor from two files. Now one process, without a process group, as for evaluation on a laptop: a plain model's
# `state_dict()` asks for whole tensors, and DCP fills them in place. Then the test accuracy of the model trained
# in section 3:
# <!-- ja -->
# 4個のランクは、2個のランクのパラメータとオプティマイザの状態をビット単位で同じに受け取りました。各ランクは、どのテンソルについても 4分の 1 を 2つのファイルから読んでいます。次は、ノート PC で評価するときのように、プロセスグループのない 1個のプロセスに読み込みます。ふつうのモデルの `state_dict()` はテンソル全体を要求し、DCP はそれをその場で埋めます。そのあと、3節で訓練したモデルのテスト精度を測ります。

# %% tags=["nbval-ignore-output"]
evaluated = make_model(seed=2)
state = {"model": evaluated.state_dict()}
print(tr("loaded", "読み込み:"), load_sharded(state, root).name)
evaluated.load_state_dict(state["model"])
test_images, test_labels = load_split_tensors("test", 2000 if PROFILE == "smoke" else 10000)
evaluated.eval()
with torch.no_grad():
    accuracy = (evaluated(to_float(test_images)).argmax(dim=1) == test_labels).float().mean().item()
print(tr(f"test accuracy on {len(test_labels):,} test images: {accuracy:.3f}",
         f"テスト画像 {len(test_labels):,}枚でのテスト精度: {accuracy:.3f}"))

# %%
assert max((evaluated.state_dict()[k] - fsdp2["full_model"][k]).abs().max().item() for k in fsdp2["full_model"]) == 0
assert accuracy >= 0.75

# %% [markdown]
# <!-- en -->
# A sharded checkpoint can also become one ordinary file, for tools that expect `torch.save` files:
# `torch.distributed.checkpoint.format_utils.dcp_to_torch_save(folder, file)` reads every shard and writes the
# whole state, which `torch.load(..., weights_only=True)` reads back.
# <!-- ja -->
# シャーディングしたチェックポイントは、`torch.save` 形式のファイルを前提とするツールのために、ふつうのファイル 1つに変換することもできます。`torch.distributed.checkpoint.format_utils.dcp_to_torch_save(folder, file)` はすべてのシャードを読んで状態全体を書き出し、それを `torch.load(..., weights_only=True)` で読み戻せます。

# %%
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

dcp_to_torch_save(latest_checkpoint(root), Path(workdir.name) / "whole.pt")
whole = torch.load(Path(workdir.name) / "whole.pt", weights_only=True)
print(sorted(whole), tr(f"{len(whole['model'])} tensors in the model", f"モデルのテンソル {len(whole['model'])}個"))
assert all(torch.equal(whole["model"][k], v) for k, v in evaluated.state_dict().items())
(Path(workdir.name) / "whole.pt").unlink()

# %% [markdown]
# <!-- en -->
# Now the failure. The next launch resumes from the latest checkpoint on 2 ranks and starts the next save; rank 1
# is killed with `SIGKILL` right after it has written its own file, so the save never completes (the worker
# replaces DCP's `FileSystemWriter.write_data` on that rank to arrange it).
# <!-- ja -->
# 次は障害を起こします。次の起動では、2個のランクで最新のチェックポイントから再開し、次の保存を始めます。ランク 1 は自分のファイルを書き終えた直後に `SIGKILL` で強制終了されるので、保存は完了しません（ワーカーはそのランクで DCP の `FileSystemWriter.write_data` を置き換えて、これを仕組んでいます）。

# %% tags=["nbval-ignore-output"]
try:
    launch(save_and_get_killed, 2, args=(root,), echo=False, timeout=300)
except WorkerFailed as e:
    print(e.cause)  # which rank failed first, and how
    assert e.rank == 1

# %% tags=["nbval-ignore-output"]
print(listing(root))
print(tr("latest complete checkpoint:", "最後に完了したチェックポイント:"), latest_checkpoint(root).name)
state = {"model": make_model(seed=3).state_dict()}
print(tr("load_sharded(root) reads", "load_sharded(root) が読むもの:"), load_sharded(state, root).name)
partial = root / f".step-{int(saved.split('-')[1]) + 1:08d}.partial"
try:
    load_sharded(state, partial)
except CheckpointError as e:
    print(str(e).replace(str(root), "<root>"))

# %%
assert latest_checkpoint(root).name == saved
assert all(torch.equal(state["model"][k], v) for k, v in evaluated.state_dict().items())
assert partial.is_dir() and not (partial / ".metadata").exists()

# %% [markdown]
# <!-- en -->
# Rank 1's file is on disk, rank 0's too, but `.metadata` is missing and the folder still has its temporary name:
# the half-written save is visible for what it is, `latest` still names the previous checkpoint, that one loads,
# and loading the partial folder by name fails with an error that says why. The next save of the same step clears
# the leftover folder and starts afresh (`tests/test_sharding.py` checks this, and the resharding 2 -> 4 -> 1).
# <!-- ja -->
# ランク 1 のファイルもランク 0 のファイルもディスクにありますが、`.metadata` がなく、フォルダは一時的な名前のままです。書きかけの保存は書きかけだと一目でわかり、`latest` は前のチェックポイントを指したままで、それは問題なく読み込めます。途中までのフォルダを名前で指定して読み込もうとすると、理由を説明するエラーで失敗します。同じステップを次に保存するときは、残ったフォルダを片付けてから新しく始めます（`tests/test_sharding.py` でこのことと、2 → 4 → 1 の再シャーディングを確かめています）。

# %% [markdown]
# <!-- en -->
# ## Which to use when
#
# The measurements of this chapter, side by side: what each rank held on 2 ranks (bytes, the largest rank), and
# what one step sent, in bytes of whole tensors (on N ranks each rank sends and receives about (N - 1)/N of that
# with a ring).
# <!-- ja -->
# ## 方式の使い分け
#
# この章の測定結果を並べます。ランク 2個のときに各ランクが持ったバイト数（最も多いランクの値）と、1ステップで送ったものを、テンソル全体のバイト数で示します（ランク N 個のリングでは、各ランクはその約 (N - 1)/N を送受信します）。

# %%
def total_bytes(log):
    return sum(c["bytes"] for c in log.values())


AR, RS, AG, BC = (KINDS[k] for k in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"))
peak2 = {m: r["peak_bytes_per_rank"] for m, r in peaks[2].items()}
measured = [
    ("DDP", zero["DDP"]["held"], peak2["DDP"], 2 * single["params"], AR),
    ("ZeRO-1 (ZeroRedundancyOptimizer)", zero["ZeroRedundancyOptimizer"]["held"], peak2["ZeRO-1"],
     3 * single["params"], f"{AR} + {BC}"),
    (tr("ZeRO-1 (sharded step, this chapter)", "ZeRO-1（この章のステップ）"), zero["sharded_step"]["held"],
     peak2["sharded step"], total_bytes(zero["sharded_step"]["collectives"]), f"{RS} + {AG}"),
    ("ZeRO-2 (Zero2Optimizer)", zero["Zero2Optimizer"]["held"], peak2["ZeRO-2"],
     total_bytes(zero["Zero2Optimizer"]["collectives"]), f"{RS} + {AG}"),
    (tr("FSDP2, reshard_after_forward=False", "FSDP2（reshard_after_forward=False）"), fsdp2["held"], None, total_bytes(fsdp2["collectives_kept"]),
     f"{AG} + {RS}"),
    ("FSDP2 (ZeRO-3)", fsdp2["held"], peak2["FSDP2"], total_bytes(fsdp2["collectives"]), f"{AG} x 2 + {RS}"),
]
print(table([[name, max(sum(h[k] for k in parts) for h in held), peak or "-", sent, kinds]
             for name, held, peak, sent, kinds in measured],
            [("method", "方式"), ("held after step", "ステップ後の量"), ("peak", "ピーク"), ("sent per step", "1ステップの通信"),
             ("collectives", "集合通信")]))
print(tr("(DDP's and ZeRO-1's traffic: an all-reduce counted as a reduce-scatter plus an all-gather of the model, "
         "plus ZeRO-1's broadcasts)",
         "（DDP と ZeRO-1 の通信量: オールリデュースをモデルのリデュース・スキャッターとオールギャザーとして数え、"
         "ZeRO-1 ではブロードキャストを加えたもの）"))

# %% [markdown]
# <!-- en -->
# (FSDP2 holds the same at rest with `True` or `False`; with `False` it also holds all blocks' full parameters between
# the forward and the backward pass; its peak was not measured.) After the step the chapter's sharded step holds as
# little as ZeRO-2, but its peak, when it holds every gradient plus a full flat copy of them, is about DDP's: it
# shards the optimizer step, not the gradients' memory. `Zero2Optimizer` keeps both low, since its gradients are
# reduce-scattered bucket by bucket during the backward pass. Reading the table for a real model, scaled by the
# arithmetic of section 1:
#
# | | memory per rank | traffic per step | use it when |
# |---|---|---|---|
# | DDP | everything: 16 bytes per parameter with Adam | 1 all-reduce of the gradients (2 x model bytes) | the model, its gradients and optimizer state fit on one device with room for activations: the fastest and simplest |
# | ZeRO-1 | optimizer state / N | as DDP (PyTorch's version adds broadcasts) | the optimizer state is what does not fit (Adam: half of it); a drop-in optimizer |
# | ZeRO-2 | optimizer state and gradients / N | as DDP: reduce-scatter + all-gather | as ZeRO-1 with more room; no extra traffic, so take it whenever you shard the optimizer |
# | ZeRO-3 / FSDP2 | everything / N, plus in full the unit that computes and the next one, prefetched | 1.5 x DDP (parameters gathered twice) | the parameters themselves do not fit on one device; with many devices on fast links the extra traffic overlaps the compute |
# | FSDP2, `reshard_after_forward=False` | as ZeRO-3 at rest, full parameters during the step | as DDP | memory is tight only between steps, or the interconnect is slow |
#
# Whatever the choice, activation checkpointing cuts the activations, and mixed precision halves what is gathered
# and computed. For a model that fits, DDP is the answer; sharding is for the day it no longer fits. And the
# same code runs on 1, 2 or 4 ranks: a sharded checkpoint does not tie a model to the world size that saved it.
# `benchmarks/sharding.py` measures the memory per rank on 1, 2 and 4 processes for the larger ViT (`vit("small")`,
# 3.2 M parameters), with step times, and checks the goal of this chapter: at most 1.15 x 1/N (its worker,
# `mparlib.sharding.fsdp_memory_worker`, is the FSDP part of this chapter's worker in a few lines).
# <!-- ja -->
# （ステップの外で FSDP2 が持つ量は `True` でも `False` でも同じです。`False` では、順伝播から逆伝播までの間、すべてのブロックの完全なパラメータも持ちます。そのピークは測っていません）この章のシャーディングしたステップは、ステップのあとには ZeRO-2 と同じくらい少ない量しか持ちませんが、すべての勾配とそのフラットなコピーを持つ瞬間のピークは DDP とほぼ同じです。シャーディングしているのはオプティマイザのステップで、勾配のメモリではありません。`Zero2Optimizer` は逆伝播の途中でバケットごとに勾配をリデュース・スキャッターするので、どちらも少なく保ちます。実際のモデルについてこの表を読むには、1節の計算で大きさを換算します。
#
# | | 1ランクのメモリ | 1ステップの通信 | 使いどころ |
# |---|---|---|---|
# | DDP | すべて。Adam ならパラメータ 1つあたり 16バイト | 勾配のオールリデュース 1回（モデルの 2倍のバイト数） | モデル、勾配、オプティマイザの状態が 1つのデバイスに収まり、活性化の余裕もあるとき。最も速く、最も単純 |
# | ZeRO-1 | オプティマイザの状態 / N | DDP と同じ（PyTorch の実装ではブロードキャストが加わる） | 収まらないのがオプティマイザの状態のとき（Adam では全体の半分を占める）。オプティマイザを差し替えるだけで使える |
# | ZeRO-2 | オプティマイザの状態と勾配 / N | DDP と同じ。リデュース・スキャッターとオールギャザー | ZeRO-1 と同じ場面で、さらに余裕がほしいとき。通信は増えないので、オプティマイザをシャーディングするならこちら |
# | ZeRO-3 / FSDP2 | すべて / N と、計算中のユニットと先読みした次のユニットの完全なパラメータ | DDP の 1.5倍（パラメータを 2回集める） | パラメータそのものが 1つのデバイスに収まらないとき。高速なリンクでつながった多数のデバイスなら、増えた通信は計算と重なる |
# | FSDP2、`reshard_after_forward=False` | ステップの外では ZeRO-3 と同じ。ステップの最中は完全なパラメータ | DDP と同じ | メモリが厳しいのがステップの外（ステップとステップの合間）だけのとき、またはリンクが遅いとき |
#
# どれを選んでも、活性化の再計算で活性化を減らせますし、混合精度で集める量と計算を半分にできます。収まるモデルなら答えは DDP です。シャーディングは、モデルが収まらなくなった日のためのものです。そして同じコードがランク 1個、2個、4個で動きます。シャーディングしたチェックポイントは、保存したときのワールドサイズにモデルを縛りません。`benchmarks/sharding.py` は、より大きな ViT（`vit("small")`、パラメータ 320万個）について、プロセス 1個、2個、4個での 1ランクあたりのメモリとステップの時間を測り、この章の目標（1/N の 1.15倍以内）を確かめます（そのワーカー `mparlib.sharding.fsdp_memory_worker` は、この章のワーカーの FSDP の部分を数行にまとめたものです）。

# %% [markdown]
# <!-- en -->
# ## Summary
#
# - Training holds, per parameter, the parameter, its gradient and the optimizer state: 16 bytes with Adam in
#   fp32 or in mixed precision (with an fp32 master copy of the weights). DDP keeps all of it on every rank.
# - ZeRO shards them: stage 1 the optimizer state, stage 2 also the gradients, stage 3 also the parameters. The
#   chapter's sharded step is DDP's all-reduce cut in two, reduce-scatter, update one slice, all-gather: the same
#   bytes, the same parameters (proved here against DDP), 1/N of the optimizer state. It first copies the full
#   gradient into a flat buffer, so it is ZeRO-1: its peak is about DDP's. `Zero2Optimizer` is ZeRO-2: hooks
#   reduce-scatter the gradients bucket by bucket during the backward pass and free them, so a rank never holds
#   more than 1/N of them plus one bucket.
# - Peaks, not what is left after a step, decide what fits: counted after every operator (`PeakMemory`), they order
#   FSDP2 < ZeRO-2 < ZeRO-1 < DDP on 2 and 4 ranks.
# - FSDP2 is `fully_shard` per block and at the root: parameters become DTensors sharded on dimension 0, each rank
#   holds 1/N of parameters, gradients and optimizer state (within the padding), and each block is gathered just
#   before it computes. `reshard_after_forward` trades memory against a second all-gather; `MixedPrecisionPolicy`
#   halves the gathered bytes. It trains exactly like one process.
# - Activation checkpointing keeps each block's input and recomputes the rest in the backward pass.
# - DCP saves every rank's shards in parallel and reshards on load (2 ranks -> 4 ranks -> 1 process). Save into a
#   temporary folder, rename it, then point `latest` at it: a killed save is never taken for a complete one.
# <!-- ja -->
# ## まとめ
#
# - 訓練では、パラメータ 1つにつきパラメータ、勾配、オプティマイザの状態を持ちます。Adam なら fp32 でも混合精度（重みの fp32 のマスターコピー）でも 16バイトです。DDP はそのすべてを全ランクに持たせます。
# - ZeRO はこれをシャーディングします。ステージ 1 はオプティマイザの状態、ステージ 2 は勾配も、ステージ 3 はパラメータもシャーディングします。この章のシャーディングしたステップは、DDP のオールリデュースを 2つに分けたものです。リデュース・スキャッターし、1つのスライスを更新し、オールギャザーします。送るバイト数もパラメータも同じで（ここでは DDP と比べて証明しました）、オプティマイザの状態は 1/N です。ただし最初に完全な勾配をフラットなバッファにコピーするので、これは ZeRO-1 で、ピークは DDP とほぼ同じです。`Zero2Optimizer` は ZeRO-2 です。フックが逆伝播の途中でバケットごとに勾配をリデュース・スキャッターして解放するので、ランクが持つ勾配は 1/N とバケット 1つ分を超えません。
# - 何が収まるかを決めるのは、ステップのあとに残る量ではなくピークです。演算子ごとに数えると（`PeakMemory`）、ランク 2個と 4個で FSDP2 < ZeRO-2 < ZeRO-1 < DDP の順になります。
# - FSDP2 は、ブロックごととルートの `fully_shard` です。パラメータは 0次元目でシャーディングされた DTensor になり、各ランクはパラメータ、勾配、オプティマイザの状態を、パディングの分を除いて 1/N ずつ持ち、各ブロックは計算の直前に集められます。`reshard_after_forward` でメモリと 2回目のオールギャザーを交換でき、`MixedPrecisionPolicy` は集めるバイト数を半分にします。訓練は 1個のプロセスとまったく同じように進みます。
# - 活性化の再計算は各ブロックの入力だけを残し、残りは逆伝播の中で計算し直します。
# - DCP は全ランクのシャードを並行して保存し、読み込むときに再シャーディングします（ランク 2個 → ランク 4個 → 1個のプロセス）。一時フォルダに保存し、名前を変えてから `latest` でそれを指せば、強制終了された保存が完了したものと取り違えられることはありません。

# %% [markdown]
# <!-- en -->
# ## Exercises
#
# Each exercise has a **starter** cell whose function body is `raise NotImplementedError`: replace that line with your
# code, run the cell, then run the check cell below it. The starter of the ZeRO step is a `%%worker` cell: its check
# starts 2 and then 3 fresh processes that import your function. The check says *not attempted*, *wrong* (the first difference
# and one hint for the likely mistake), *error* (your exception, or your code ending its process), *right*, *cannot
# run here* or *the check itself failed* (never a verdict on your answer); it never prints the answer. A one-process
# exercise runs your function in a fresh worker process and stops it after 30 s; a distributed check stops a
# collective that waits for a partner that never comes after 20 s, naming the waiting rank, and the whole check after
# 240 s. `hint("09.1")` prints the next hint level each time you call it and says when none is left; `hint("09.1", 2)`
# prints a given level.
# <!-- ja -->
# ## 練習問題
#
# 各練習問題には、本体が `raise NotImplementedError` だけの関数を含む**スターター**のセルがあります。その行を自分のコードに置き換えてセルを実行し、すぐ下のチェックのセルを実行してください。ZeRO のステップのスターターは `%%worker` のセルです。そのチェックは新しいプロセスを 2個、次に 3個起動してそこで関数をインポートします。チェックの結果は「未着手」、「不正解」（最初の違いと、ありがちな間違いに合わせたヒント 1つ）、「エラー」（発生した例外、またはコードがプロセスを終了させたこと）、「正解」、「この環境では実行できません」、「チェック自体の不具合」（あなたの答えの判定ではありません）のどれかで、答えそのものは表示しません。1つのプロセスの練習問題では関数を新しいワーカープロセスで実行し、30秒で止めます。分散のチェックでは、来ない相手を待ち続ける集合通信を 20秒で止めて待っていたランクを示し、チェック全体を 240秒で止めます。`hint("09.1")` は呼ぶたびに次の段階のヒントを表示し、もう残っていなければそう伝えます。`hint("09.1", 2)` は指定した段階のヒントを表示します。

# %%
from mparlib.exercises import check, hint

# %% [markdown]
# <!-- en -->
# ### Exercise 09.1: Bytes per rank under ZeRO
#
# Write `bytes_per_rank(n_params, world, stage, per_parameter)`: the bytes one rank holds for `n_params`
# parameters trained on `world` ranks under ZeRO stage `stage` (0 to 3), where `per_parameter` gives the bytes per
# parameter of each part, as `mparlib.sharding.bytes_per_parameter` returns them, e.g.
# `{"params": 4, "grads": 4, "optimizer": 8}`. Work it out from the stages, without calling
# `zero_bytes_per_rank`. The check compares at random points, for every stage, precision and optimizer.
# <!-- ja -->
# ### 練習問題 09.1: ZeRO でのランクあたりのバイト数
#
# `n_params` 個のパラメータを `world` 個のランクで ZeRO のステージ `stage`（0 から 3）で訓練するとき、1つのランクが持つバイト数を返す `bytes_per_rank(n_params, world, stage, per_parameter)` を書いてください。`per_parameter` は、`mparlib.sharding.bytes_per_parameter` が返すのと同じ形の、各部分のパラメータあたりのバイト数です（例: `{"params": 4, "grads": 4, "optimizer": 8}`）。`zero_bytes_per_rank` を呼ばずに、ステージの定義から求めてください。チェックはすべてのステージ、精度、オプティマイザについて、ランダムな点で比べます。

# %%
# Exercise 09.1: starter
def bytes_per_rank(n_params, world, stage, per_parameter):
    """Bytes one rank holds under ZeRO `stage` for `n_params` parameters on `world` ranks."""
    raise NotImplementedError("09.1")


# %%
check("09.1", bytes_per_rank)

# %% [markdown]
# <!-- en -->
# ### Exercise 09.2: Shard a flat parameter
#
# Write `shard_flat(tensors, rank, world)`: rank `rank`'s shard when the `tensors` are flattened into one buffer
# and split over `world` ranks the way the chapter's sharded optimizer splits them, every rank with the same
# number of elements. The check uses totals that do not divide by the world size, down to a rank that holds only
# padding.
# <!-- ja -->
# ### 練習問題 09.2: フラットなパラメータのシャーディング
#
# `tensors` を 1本のバッファにフラットに並べ、章のシャーディングしたオプティマイザと同じ分け方で `world` 個のランクに分けるときの、ランク `rank` のシャードを返す `shard_flat(tensors, rank, world)` を書いてください。どのランクの要素数も同じです。チェックはワールドサイズで割り切れない合計を使い、パディングしか持たないランクがある場合も試します。

# %%
# Exercise 09.2: starter
import math

import torch


def shard_flat(tensors, rank, world):
    """Rank `rank`'s equal-sized shard of the flattened `tensors`, split over `world` ranks."""
    raise NotImplementedError("09.2")


# %%
check("09.2", shard_flat)

# %% [markdown]
# <!-- en -->
# ### Exercise 09.3: Back from the shards
#
# Write `unshard_flat(shards, shapes)`, the inverse: from the list of all ranks' shards (in rank order) and the
# shapes of the original tensors, return the tensors. The check feeds it the shards of exercise 09.2's cases.
# <!-- ja -->
# ### 練習問題 09.3: シャードからの復元
#
# その逆の `unshard_flat(shards, shapes)` を書いてください。全ランクのシャード（ランクの順）のリストと元のテンソルの形状から、元のテンソルを返します。チェックは練習問題 09.2 の場合のシャードを渡します。

# %%
# Exercise 09.3: starter
def unshard_flat(shards, shapes):
    """The tensors of `shapes` from all ranks' shards, in rank order."""
    raise NotImplementedError("09.3")


# %%
check("09.3", unshard_flat)

# %% [markdown]
# <!-- en -->
# ### Exercise 09.4: A ZeRO step
#
# Write `zero_sgd_step(params, lr)`, called on every rank after `backward()` on that rank's share of a batch, with
# the model's parameters and their local gradients: one plain SGD step, sharded as in the section "ZeRO from
# primitives". Afterwards every rank holds the parameters that one process would hold after an SGD step on the
# whole batch. The check runs 2 and then 3 ranks and a model of 40 parameters (not a multiple of 3) for 2 steps.
# <!-- ja -->
# ### 練習問題 09.4: ZeRO のステップ
#
# 各ランクがバッチのうち自分の担当分で `backward()` を実行したあとに、モデルのパラメータ（そのランクで計算した勾配を持つもの）を渡して呼ぶ `zero_sgd_step(params, lr)` を書いてください。「プリミティブから作る ZeRO」の節と同じようにシャーディングした、ふつうの SGD の 1ステップです。呼んだあと、どのランクも、1個のプロセスがバッチ全体で SGD を 1ステップ進めたときのパラメータを持っていなければなりません。チェックはランク 2個、次に 3個と、40個のパラメータ（3 の倍数ではありません）のモデルで 2ステップ実行します。

# %%
# %%worker ex09_zero
# Exercise 09.4: starter
import math

import torch
import torch.distributed as dist

reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def zero_sgd_step(params, lr):
    """One SGD step of `params` (local gradients): reduce-scatter, update this rank's slice, all-gather."""
    raise NotImplementedError("09.4")

# %%
from ex09_zero import zero_sgd_step

check("09.4", zero_sgd_step)

# %% [markdown]
# <!-- en -->
# ### More questions
#
# 1. In the ZeRO worker, replace `torch.optim.Adam` by `torch.optim.SGD` with `momentum=0.9` in every method.
#    Predict the optimizer bytes per rank with `sharding.bytes_per_parameter("fp32", "momentum")` first, then run
#    the launch again. Is the sharded step still equal to DDP?
# 2. Run `fsdp_run` on 3 ranks: `launch(fsdp_run, 3, args=(batches, 1e-3))`. How far above 1/3 is each rank's
#    share now, and which parameters cause the padding? (Look at the first dimension of every parameter.)
# 3. Checkpoint only every second block: build `checkpointed.blocks` as
#    `nn.ModuleList(Checkpointed(b) if i % 2 == 0 else b for i, b in enumerate(make_model().blocks))` and run the
#    measuring cell again. How many bytes does autograd keep now, and how long does a step take?
# 4. In `save_and_get_killed`, kill rank 0 instead (`args=(root, 0)`). Does `latest` still name a complete
#    checkpoint? Then save the evaluated model as that step from this process,
#    `save_sharded({"model": evaluated.state_dict()}, root, step=int(saved.split("-")[1]) + 1)`, and list
#    the folder again: what became of the partial folder?
# <!-- ja -->
# ### その他の問い
#
# 1. ZeRO のワーカーで、すべての方式の `torch.optim.Adam` を `momentum=0.9` の `torch.optim.SGD` に置き換えてください。まず `sharding.bytes_per_parameter("fp32", "momentum")` で 1ランクあたりのオプティマイザのバイト数を予測し、それから起動し直します。シャーディングしたステップは、今も DDP と一致するでしょうか。
# 2. `fsdp_run` を 3個のランクで実行してください（`launch(fsdp_run, 3, args=(batches, 1e-3))`）。各ランクの取り分は 1/3 をどれだけ上回るでしょうか。パディングの原因になっているのはどのパラメータでしょうか（各パラメータの 0次元目の大きさを見てください）。
# 3. 1つおきのブロックだけを再計算してください。`checkpointed.blocks` を `nn.ModuleList(Checkpointed(b) if i % 2 == 0 else b for i, b in enumerate(make_model().blocks))` として作り、測定のセルをもう一度実行します。autograd が保持するバイト数はいくつになり、1ステップにどれだけ時間がかかるでしょうか。
# 4. `save_and_get_killed` で、代わりにランク 0 を強制終了してください（`args=(root, 0)`）。`latest` は今も完了したチェックポイントを指しているでしょうか。そのあと、評価したモデルをこのプロセスからそのステップとして保存し（`save_sharded({"model": evaluated.state_dict()}, root, step=int(saved.split("-")[1]) + 1)`）、もう一度フォルダの中身を表示してください。途中までのフォルダはどうなったでしょうか。
