# %% [markdown]
# <!-- en -->
# # 8. Collective communication
#
# Chapter 6 let DDP average the gradients "by all-reduce" and moved on. This chapter opens that box. The processes
# of a distributed training talk in a small vocabulary of **collectives**, operations that every process of a group
# calls together, built on **point-to-point** messages between two processes. Everything here runs on CPU processes
# with `gloo`, and with `nccl` on GPUs. In this chapter you will
#
# - run each word of the vocabulary (`send`/`recv`, `broadcast`, `reduce`, `all_reduce`, `reduce_scatter`,
#   `all_gather`, `all_to_all`) on 4 processes and see what moves where,
# - build the ring all-reduce from sends and receives alone and check it against `dist.all_reduce`,
# - measure what an all-reduce costs on your machine and fit the latency-bandwidth model to it,
# - open DDP: its gradient buckets overlapping the backward pass, a communication hook that halves the bytes,
#   and gradient accumulation with `no_sync()`,
# - predict from these numbers when two devices are slower than one, and check the prediction,
# - make a training hang on purpose, twice, and read the diagnosis that names the cause.
# <!-- ja -->
# # 8. 集合通信
#
# 6章では、DDP が勾配を「オールリデュース（all-reduce）で」平均すると述べただけで先へ進みました。この章では、その中身を詳しく見ていきます。分散訓練のプロセスどうしは、**集合通信**（collective communication）と呼ばれる少数の決まった操作でやり取りします。集合通信はグループのすべてのプロセスがそろって呼び出す操作で、2個のプロセスの間で送る **1対1通信**（point-to-point）のメッセージの上に作られています。この章の内容はすべて `gloo` を使う CPU のプロセスで動き、GPU では `nccl` で動きます。この章では次のことを学びます。
#
# - 通信の基本操作（`send`/`recv`、`broadcast`、`reduce`、`all_reduce`、`reduce_scatter`、`all_gather`、`all_to_all`）を 4個のプロセスで 1つずつ実行し、何がどこへ動くのかを確かめます。
# - 送信と受信だけでリング・オールリデュースを作り、`dist.all_reduce` と一致することを確かめます。
# - 手元のマシンでオールリデュースにかかる時間を測り、レイテンシ・帯域幅モデル（α-β モデル）を当てはめます。
# - DDP の中を見ます。逆伝播と重なって進む勾配のバケット、送るバイト数を半分にする通信フック、`no_sync()` を使った勾配累積です。
# - ここで測った数値から、2つのデバイスが 1つより遅くなるのはどんなときかを予測し、その予測を確かめます。
# - 2通りの方法でわざと訓練をハングさせ、原因を名指しする診断メッセージを読みます。

# %% tags=["nbval-ignore-output"]
import inspect
import math
import os
import re
import tempfile
import textwrap
import time
from pathlib import Path

import torch
from IPython.display import Image, display
from matplotlib.figure import Figure

import mparlib
from mparlib import collectives, diagrams
from mparlib.errors import WorkerFailed
from mparlib.lang import join, table, tr
from mparlib.launch import launch
from mparlib.rendezvous import choose_backend, describe
from mparlib.plot import figure_png, use_course_style

# %load_ext mparlib.launch

use_course_style()  # a font with Japanese glyphs for this notebook's figures
print(mparlib.report())
print(mparlib.profile_line())
PROFILE = mparlib.profile()
ON_GPUS = choose_backend("auto", 2) == "nccl"  # large sizes only where the ranks have GPUs of their own
print(describe(4))
print(describe(2))

# %% [markdown]
# <!-- en -->
# The last two lines say where this chapter's processes run: on a machine with a GPU for each process they use
# `nccl`, one process per GPU; otherwise they are CPU processes that talk through `gloo`. The checked outputs of the
# chapter are the same either way.
#
# ## The vocabulary
#
# A **point-to-point** message has one sender and one receiver: rank 0 calls `dist.send(x, dst=1)` and rank 1
# calls `dist.recv(buf, src=0)`, with a tensor of the same shape and dtype, which the message fills. `isend` and
# `irecv` start the same message without waiting and return a handle whose `wait()` finishes it.
#
# A **collective** is called by every rank of the group, in the same order, with tensors of matching shapes. The
# six that training uses:
#
# | collective | what every rank has afterwards | used by |
# |---|---|---|
# | `broadcast(x, src)` | a copy of rank `src`'s `x` | DDP at start-up: rank 0's parameters to everyone |
# | `reduce(x, dst)` | rank `dst` only: the elementwise sum of all ranks' `x` | metrics summed on one rank |
# | `all_reduce(x)` | the sum of all ranks' `x`, on every rank | DDP's gradient averaging |
# | `reduce_scatter_tensor(out, x)` | rank `r`: chunk `r` of the sum | FSDP / ZeRO: each rank keeps its shard of the gradients |
# | `all_gather_into_tensor(out, x)` | every rank's `x`, concatenated in rank order | FSDP: the full parameters from the shards |
# | `all_to_all_single(out, x)` | chunk `r` of every rank's `x`, in rank order | mixture-of-experts routing, changing how a tensor is split |
#
# Each has a list form too (`reduce_scatter`, `all_gather`, `all_to_all` take lists of tensors); gloo in this
# version of PyTorch runs all of them on CPU tensors. The figure shows, for 4 ranks, whose data ends up where: each
# rank starts with 4 chunks of its own (`r.j` is chunk `j` of rank `r`). It is drawn from
# `collectives.collective_patterns(4)`, which `tests/test_collectives.py` checks against the real collectives.
#
# The table gives the names that this chapter's code calls. torch 2.13 renamed two of them: `reduce_scatter_tensor`
# became `reduce_scatter_single` and `all_gather_into_tensor` became `all_gather_single`, and the old names now warn
# that they are deprecated (a `FutureWarning`). torch 2.11 and older releases know only the old names, so the tour
# below calls those, which every release has; the warning goes to the ranks' logs, which `echo=False` keeps out of the
# notebook. Chapter 9's worker calls the new name where it exists and the old one otherwise.
# <!-- ja -->
# 最後の 2行は、この章のプロセスがどこで動くかを示しています。プロセスごとに GPU があるマシンでは `nccl` を使い、GPU 1枚につき 1個のプロセスを動かします。そうでなければ、プロセスは CPU 上で動き、`gloo` を通じて通信します。どちらの場合も、この章の検査対象の出力は同じです。
#
# ## 通信の基本操作
#
# **1対1通信**のメッセージでは、送り手と受け手がそれぞれ 1つだけです。ランク 0 が `dist.send(x, dst=1)` を呼び、ランク 1 が `dist.recv(buf, src=0)` を呼びます。`buf` は形状と dtype が同じテンソルで、メッセージの中身がそこに書き込まれます。`isend` と `irecv` は同じメッセージを待たずに開始し、ハンドルを返します。ハンドルの `wait()` を呼ぶとメッセージが完了します。
#
# **集合通信**は、グループのすべてのランクが、同じ順序で、形状のそろったテンソルを渡して呼び出します。訓練で使うのは次の 6つです。
#
# | 集合通信 | 終わったあと各ランクが持っているもの | 使われる場面 |
# |---|---|---|
# | `broadcast(x, src)` | ランク `src` の `x` のコピー | DDP の開始時。ランク 0 のパラメータを全員に配る |
# | `reduce(x, dst)` | ランク `dst` だけ: 全ランクの `x` の要素ごとの和 | 評価指標を 1つのランクで合計する |
# | `all_reduce(x)` | 全ランクの `x` の和（すべてのランクで） | DDP の勾配の平均 |
# | `reduce_scatter_tensor(out, x)` | ランク `r`: 和のチャンク `r` | FSDP / ZeRO。各ランクが勾配の自分のシャードだけを持つ |
# | `all_gather_into_tensor(out, x)` | 全ランクの `x` をランクの順に連結したもの | FSDP。シャードから完全なパラメータを組み立てる |
# | `all_to_all_single(out, x)` | 全ランクの `x` のチャンク `r` をランクの順に並べたもの | MoE（Mixture of Experts）のルーティング、テンソルの分け方の変更 |
#
# それぞれにリストを受け取る形もあります（`reduce_scatter`、`all_gather`、`all_to_all` はテンソルのリストを受け取ります）。このバージョンの PyTorch の gloo は、CPU のテンソルでそのすべてを実行できます。下の図は、4個のランクで、誰のデータがどこへ行くかを示しています。各ランクは最初に自分のチャンクを 4つ持っています（`r.j` はランク `r` のチャンク `j` です）。図は `collectives.collective_patterns(4)` から描いたもので、`tests/test_collectives.py` はこれを実際の集合通信と照らし合わせています。
#
# 表の名前は、この章のコードが呼び出している名前です。torch 2.13 でこのうち 2つの名前が変わり、`reduce_scatter_tensor` は `reduce_scatter_single` に、`all_gather_into_tensor` は `all_gather_single` になりました。古い名前を使うと、非推奨であることを知らせる警告（`FutureWarning`）が出ます。torch 2.11 以前のリリースには古い名前しかないので、下の `tour` はどのリリースにもある古い名前を使います。警告はランクのログに出ますが、`echo=False` なのでノートブックには表示されません。9章のワーカーは、新しい名前があればそれを使い、なければ古い名前を使います。

# %%
display(Image(figure_png(diagrams.collectives_figure(4))))

# %% [markdown]
# <!-- en -->
# `reduce_scatter` and `all_gather` are each other's mirror image, and together they make an `all_reduce`: after
# `reduce_scatter_tensor` rank `r` holds the full sum of chunk `r`, and `all_gather_into_tensor` of those sums puts
# every chunk, in rank order, on every rank. The ring all-reduce below is built the same way, from two functions
# with the same layouts: after `ring_reduce_scatter`, rank `r` holds the sum of chunk `r`, as after
# `dist.reduce_scatter_tensor`, and `ring_all_gather` then hands every finished chunk to every rank, as
# `dist.all_gather_into_tensor` does. So "all-reduce = reduce-scatter + all-gather" holds literally: `ring_all_reduce`
# is one call of each.
#
# Now the real thing. The worker below runs every word of the vocabulary on 4 processes. Rank `r` starts from
# the tensor `[10r, 10r + 1, 10r + 2, 10r + 3]`, so the tens digit of a number tells whose it was. Every rank
# records its tensor before and after each call, and `all_gather_object` (a collective for any picklable Python
# object) brings the records to rank 0, which returns them to the notebook. The same run also checks the ring
# all-reduce of the next section, so that the 4 processes start only once.
# <!-- ja -->
# `reduce_scatter` と `all_gather` は互いに鏡像の関係にあり、2つを続けると `all_reduce` になります。`reduce_scatter_tensor` のあと、ランク `r` はチャンク `r` の全体の和を持ちます。その和を `all_gather_into_tensor` で集めると、すべてのランクがすべてのチャンクをランクの順に持ちます。あとで作るリング・オールリデュースも同じように、チャンクの配置が同じ 2つの関数からできています。`ring_reduce_scatter` のあと、ランク `r` は `dist.reduce_scatter_tensor` のあとと同じくチャンク `r` の和を持ち、続く `ring_all_gather` が、`dist.all_gather_into_tensor` と同じように、完成したチャンクをすべてのランクに配ります。つまり「オールリデュース = リデュース・スキャッター（reduce-scatter）+ オールギャザー（all-gather）」という関係が文字どおり成り立ち、`ring_all_reduce` はそれぞれを 1回ずつ呼ぶだけです。
#
# では実際に動かします。次のワーカーは、これらの基本操作をすべて 4個のプロセスで実行します。ランク `r` はテンソル `[10r, 10r + 1, 10r + 2, 10r + 3]` から始めるので、数の十の位を見れば誰のデータだったかがわかります。各ランクは呼び出しの前後で自分のテンソルを記録し、`all_gather_object`（pickle できる任意の Python オブジェクトを集める集合通信）で記録をランク 0 に集め、ランク 0 がそれをノートブックに返します。同じ実行で次の節のリング・オールリデュースも確かめて、4個のプロセスの起動を 1回で済ませます。

# %%
# %%worker tour_workers
import torch
import torch.distributed as dist

from mparlib.collectives import ring_all_reduce, ring_reduce_scatter
from mparlib.errors import ConfigError
from mparlib.rendezvous import device


def tour():
    """Every rank: each point-to-point message and collective on small int64 tensors, before and after."""
    rank, k, dev = dist.get_rank(), dist.get_world_size(), device()
    mine = torch.tensor([10 * rank + j for j in range(k)], device=dev)  # (k,)
    seen = {}

    # point to point: rank 0 sends to rank 1, which receives into a buffer of the same shape and dtype
    buf = torch.zeros_like(mine)
    if rank == 0:
        dist.send(mine, dst=1)
    elif rank == 1:
        dist.recv(buf, src=0)
    seen["send/recv"] = buf.tolist()

    # every rank passes its tensor to the right neighbour and receives from the left one, without waiting
    buf = torch.zeros_like(mine)
    pending = [dist.isend(mine, dst=(rank + 1) % k), dist.irecv(buf, src=(rank - 1) % k)]
    for work in pending:
        work.wait()
    seen["isend/irecv"] = buf.tolist()

    for name in ("broadcast", "reduce", "all_reduce"):
        t = mine.clone()
        {"broadcast": lambda: dist.broadcast(t, src=0), "reduce": lambda: dist.reduce(t, dst=0),
         "all_reduce": lambda: dist.all_reduce(t)}[name]()
        seen[name] = t.tolist() if name != "reduce" or rank == 0 else None  # reduce: defined on dst only
    out = torch.zeros(1, dtype=mine.dtype, device=dev)
    dist.reduce_scatter_tensor(out, mine)  # rank r gets chunk r of the sum
    seen["reduce_scatter"] = out.tolist()
    out = torch.zeros(2 * k, dtype=mine.dtype, device=dev)
    dist.all_gather_into_tensor(out, mine[:2].contiguous())  # each rank contributes its first 2 numbers
    seen["all_gather"] = out.tolist()
    out = torch.zeros_like(mine)
    dist.all_to_all_single(out, mine)  # element j of rank r goes to rank j, at position r
    seen["all_to_all"] = out.tolist()

    records = [None] * k
    dist.all_gather_object(records, {"before": mine.tolist(), **seen})
    return {"tour": records, "ring": ring_checks()}


def ring_checks():
    """ring_all_reduce vs dist.all_reduce on the same inputs: sizes that k divides and does not, three dtypes."""
    rank, k, dev = dist.get_rank(), dist.get_world_size(), device()
    g = torch.Generator().manual_seed(rank)  # different numbers on every rank
    rows = []
    for n in (0, 1, 3, 10, 1001):
        for dtype in (torch.int64, torch.float32, torch.float64):
            if dtype == torch.float64:  # random reals: the sums may round differently
                x = torch.randn(n, generator=g, dtype=dtype).to(dev)
            else:  # integers (also as float32): every sum is exact
                x = torch.randint(-1000, 1000, (n,), generator=g).to(dtype).to(dev)
            ours, ref, size = x.clone(), x.clone(), x.abs()
            ring_all_reduce(ours)
            dist.all_reduce(ref)
            dist.all_reduce(size)  # sum of |x| over the ranks: how large a rounding error can be
            difference = (ours - ref).abs().max().item() if n else 0.0
            rounding = 2 * (k - 1) * torch.finfo(torch.float64).eps * size.max().item() if n else 0.0
            rows.append((n, str(dtype).replace("torch.", ""), torch.equal(ours, ref), difference <= rounding))
    example = torch.tensor([100 * rank + i for i in range(10)], device=dev)  # 10 elements, 4 ranks: uneven chunks
    before = example.tolist()
    ring_all_reduce(example)
    mine = torch.tensor([10 * rank + j for j in range(k)], device=dev)  # the tour's tensor
    shard = ring_reduce_scatter(mine.clone())  # the ring's first phase alone: chunk r of the sum
    reference = torch.zeros(1, dtype=mine.dtype, device=dev)
    dist.reduce_scatter_tensor(reference, mine)
    try:  # rank 1 passes 5 elements, the others 4: refused on every rank, before any chunk moves
        ring_all_reduce(torch.ones(5 if rank == 1 else 4, device=dev))
        refused = None
    except ConfigError as e:
        refused = str(e)
    examples = [None] * k
    dist.all_gather_object(examples, (before, example.tolist(), shard.tolist(), reference.tolist(), refused))
    everyone = [None] * k
    dist.all_gather_object(everyone, rows)
    return {"rows": everyone, "example": examples}

# %%
from tour_workers import tour

results = launch(tour, 4, echo=False, timeout=120)
records = results["tour"]


def show(name, key):
    """One line per rank: what it held before, and after ``name``."""
    print(name)
    for r, rec in enumerate(records):
        after = rec[key] if rec[key] is not None else tr("(not defined)", "（未定義）")
        print(f"  {tr('rank', 'ランク')} {r}:  {str(rec['before']):<18} -> {after}")


show("dist.send(x, dst=1) / dist.recv(buf, src=0)", "send/recv")
show(tr("isend to the right, irecv from the left", "右へ isend、左から irecv"), "isend/irecv")
show("dist.broadcast(x, src=0)", "broadcast")
show("dist.reduce(x, dst=0)", "reduce")
show("dist.all_reduce(x)", "all_reduce")
show("dist.reduce_scatter_tensor(out, x)", "reduce_scatter")
show("dist.all_gather_into_tensor(out, x[:2])", "all_gather")
show("dist.all_to_all_single(out, x)", "all_to_all")

# %% [markdown]
# <!-- en -->
# Read the lines against the figure. `broadcast` gives everyone rank 0's numbers. `all_reduce` gives everyone the
# column sums (`0 + 10 + 20 + 30 = 60`, ...); `reduce_scatter` gives rank `r` just the `r`-th of those sums, and
# `all_gather` concatenates every rank's contribution. `all_to_all` transposes: rank `r` receives element `r`
# of every rank. `reduce` defines the result on rank 0 only; what it leaves in the other ranks' tensors is up to
# the backend, so the worker did not record them. The next cell checks
# each line against what the definitions say.
# <!-- ja -->
# 図と見比べながら読んでください。`broadcast` では全員がランク 0 の数を受け取ります。`all_reduce` では全員が列ごとの和（`0 + 10 + 20 + 30 = 60` など）を受け取り、`reduce_scatter` ではランク `r` がその和の `r` 番目だけを受け取ります。`all_gather` は各ランクが出した分をすべて連結します。`all_to_all` は転置にあたり、ランク `r` は全ランクの `r` 番目の要素を受け取ります。`reduce` で結果が決まるのはランク 0 だけです。他のランクのテンソルに何が残るかはバックエンド次第なので、ワーカーは記録していません。次のセルでは、各行が定義どおりであることを確かめます。

# %%
k = len(records)
before = [rec["before"] for rec in records]
sums = [sum(column) for column in zip(*before)]
assert records[1]["send/recv"] == before[0]
assert all(records[r]["isend/irecv"] == before[(r - 1) % k] for r in range(k))
assert all(rec["broadcast"] == before[0] for rec in records)
assert records[0]["reduce"] == sums
assert all(rec["all_reduce"] == sums for rec in records)
assert all(rec["reduce_scatter"] == [sums[r]] for r, rec in enumerate(records))
assert all(rec["all_gather"] == [v for b in before for v in b[:2]] for rec in records)
assert all(rec["all_to_all"] == [before[q][r] for q in range(k)] for r, rec in enumerate(records))
print(tr("every collective did what its definition says", "すべての集合通信が定義どおりに動きました"))

# %% [markdown]
# <!-- en -->
# ## A ring all-reduce from sends and receives
#
# How does a library sum a large tensor over `k` ranks? The naive way, everyone sends everything to rank 0,
# which adds and broadcasts the result, makes rank 0's link carry `2(k-1)` whole tensors while every other link
# idles. The **ring all-reduce** keeps every link busy with a small part. The ranks form a ring (rank `r` sends to
# `r + 1` and receives from `r - 1`, modulo `k`), and each tensor is cut into `k` chunks:
#
# 1. **Reduce-scatter**, `k - 1` steps. In step `s` (`s = 0, 1, ..., k - 2`), rank `r` sends chunk `r - s - 1` to
#    its right neighbour and adds the chunk `r - s - 2` that arrives from its left (all modulo `k`). A chunk travels
#    round the ring collecting one more rank's contribution per step, and the schedule starts each chunk `c` on rank
#    `c + 1` so that its last stop is rank `c`: after `k - 1` steps rank `r` holds the full sum of chunk `r`, the
#    layout of `dist.reduce_scatter_tensor` (`collectives.ring_reduce_scatter`).
# 2. **All-gather**, `k - 1` steps. Rank `r` first sends its finished chunk `r`; each finished chunk travels round
#    the ring once more, now replacing instead of adding, until every rank has all `k` sums
#    (`collectives.ring_all_gather`, the layout of `dist.all_gather_into_tensor`).
#
# `2(k - 1)` steps, each sending `n / k` elements per rank: every rank sends `2(k - 1) / k` times the tensor in
# total, close to twice the tensor whatever the number of ranks, and all links work at once. `mparlib.collectives`
# writes the chunk arithmetic once, in `ring_schedule(n, k)` (a list of `RingStep`s: for each step, the chunk
# that every rank sends and the one it receives), and the function and the figures both follow it. With
# 10 elements on 4 ranks the chunks have 3, 3, 2 and 2 elements:
# <!-- ja -->
# ## 送信と受信で作るリング・オールリデュース
#
# ライブラリは、大きなテンソルの和を `k` 個のランクでどうやって求めるのでしょうか。素朴な方法は、全員がすべてをランク 0 に送り、ランク 0 が足してから結果をブロードキャストする方法です。この方法では、ランク 0 のリンクがテンソル `2(k-1)` 個分を運び、他のリンクは遊んだままです。**リング・オールリデュース**は、すべてのリンクに少しずつ仕事をさせます。ランクは輪（リング）を作り（ランク `r` は `r + 1` に送り、`r - 1` から受け取ります。番号は `k` を法として数えます）、各テンソルを `k` 個のチャンクに切ります。
#
# 1. **リデュース・スキャッター**、`k - 1` ステップ。ステップ `s`（`s = 0, 1, ..., k - 2`）で、ランク `r` はチャンク `r - s - 1` を右隣に送り、左隣から届いたチャンク `r - s - 2` を自分のものに足します（番号はどれも `k` を法として数えます）。チャンクは輪を回りながら、ステップごとに 1個のランクの分を集めていきます。スケジュールは各チャンク `c` をランク `c + 1` から出発させるので、最後に着くのはランク `c` です。`k - 1` ステップ後、ランク `r` はチャンク `r` の全体の和を持っています。これは `dist.reduce_scatter_tensor` と同じ配置です（`collectives.ring_reduce_scatter`）。
# 2. **オールギャザー**、`k - 1` ステップ。ランク `r` はまず完成したチャンク `r` を送ります。完成したチャンクがもう一度輪を回ります。今度は足すのではなく置き換え、全ランクが `k` 個の和をすべて持つまで続けます（`collectives.ring_all_gather`。`dist.all_gather_into_tensor` と同じ配置です）。
#
# ステップは `2(k - 1)` 回で、各ステップで各ランクが送るのは `n / k` 要素です。各ランクが送る量は合計でテンソルの `2(k - 1) / k` 倍、つまりランクがいくつあってもテンソルのおよそ 2倍で、しかもすべてのリンクが同時に働きます。`mparlib.collectives` はチャンクの計算を `ring_schedule(n, k)` の 1か所にだけ書き（戻り値は `RingStep` のリストで、ステップごとに、各ランクが送るチャンクと受け取るチャンクを表します）、関数も図もそれに従います。10要素を 4個のランクで分けると、チャンクの大きさは 3、3、2、2 になります。

# %%
print(tr("chunks (start, stop):", "チャンク（start, stop）:"), collectives.chunk_bounds(10, 4))
print(table([[f"{i}.", step.label(), join(f"{r}->{(r + 1) % 4}: {tr('chunk', 'チャンク')} {c}"
                                               for r, c in enumerate(step.send))]
             for i, step in enumerate(collectives.ring_schedule(10, 4), 1)], align="<<<", gap=1))

# %% [markdown]
# <!-- en -->
# The figure follows the ring on 4 ranks. Each rank is a row of 4 chunks; the digits in a chunk are the ranks whose
# numbers it has summed, and the red box is the chunk that arrived in that step (`collectives.ring_contents(4)` follows
# the schedule without sending anything, and the figure draws what it finds). After the third step every rank owns one
# complete chunk (`0123`), rank `r` chunk `r`, on the diagonal, and the all-gather hands them round.
# <!-- ja -->
# 次の図は 4個のランクのリングを追ったものです。1行が 1つのランクで、4つのチャンクが並びます。チャンクの中の数字はそこに足し込まれたランクを表し、赤枠はそのステップで届いたチャンクです（`collectives.ring_contents(4)` が何も送らずにスケジュールをたどり、図はその結果を描いています）。3ステップ目が終わると、各ランクは完成したチャンク（`0123`）を 1つずつ持ちます。ランク `r` が持つのはチャンク `r` で、図では対角線に並びます。オールギャザーがそれを配って回ります。

# %%
display(Image(figure_png(diagrams.ring_figure(4))))

# %% [markdown]
# <!-- en -->
# Here is the function. `ring_all_reduce` checks its input and then runs the two phases, each with `run_ring_steps`,
# which holds the loop (both are printed below). In each step a rank must send and receive at the same time: if every rank first called a
# blocking `send`, each would wait for a neighbour that is itself still sending, and with large messages nobody
# would ever receive. `dist.batch_isend_irecv` posts both messages of a step together (with nccl, as one group), and
# the rank waits for both before it adds. The received chunk lands in a separate buffer, `incoming`: in the
# reduce-scatter phase it must be added to the rank's own copy of that chunk, not written over it. A caller that
# all-reduces again and again keeps that buffer from one call to the next: it passes the same dict as `buffers=` each
# time (`bandwidth_worker` below does), and the buffer stays in it; without one, the buffer lives for the call only.
# Memory that was never written costs the operating system a page fault per page on its first write, so a receive
# into a fresh buffer is expected to be slower than one into a used buffer, which is why communication libraries keep
# their buffers too. Finally, a chunk larger than `piece_bytes` (by default `PIECE_BYTES`, 4 MiB) travels as several
# messages posted in the same step. No cell of this chapter times these two choices: they
# were made by timing the function on a 2-core CPU while it was written. The ring's times next to `dist.all_reduce`
# are measured in the next section, and `benchmarks/collectives.py` saves them in
# `benchmarks/results/collectives-*.json`.
#
# Two guards protect the ring from the mistakes of its callers. First, a ring call starts with one small all-gather
# in which the ranks compare their element counts and dtypes (`check=True`, the default). Without it, a rank whose
# tensor is longer would wait for a message that never comes, and an integer tensor on one rank would be summed
# with the bytes of a float tensor on another; with it, every rank fails at once with a message that names the ranks
# that differ (the tour below tries it). Second, ring calls on one group must run one after the other: two at once,
# from two threads, would pair up each other's messages. While `run_ring_steps` runs, it marks the caller's
# `buffers` dict as in use (`collectives.IN_USE`), so that a second call sharing the dict fails instead of mixing
# data; a thread that needs a ring of its own needs its own group and its own dict.
# <!-- ja -->
# 関数の中身は次のとおりです。`ring_all_reduce` は入力を確かめてから 2つの段階を実行します。どちらの段階も、ループを持つ `run_ring_steps` が実行します（下に両方を表示します）。各ステップで、ランクは送信と受信を同時に行う必要があります。もし全ランクがまずブロッキングの `send` を呼ぶと、各ランクは、自分もまだ送信中の隣を待つことになり、メッセージが大きいと誰も受け取れなくなります。`dist.batch_isend_irecv` は 1ステップの 2つのメッセージをまとめて開始し（nccl では 1つのグループとして）、ランクは両方が終わるのを待ってから足し算をします。受け取ったチャンクは別のバッファ `incoming` に入れます。リデュース・スキャッターの段階では、受け取ったチャンクを自分の同じチャンクに足す必要があり、上書きしてはいけないからです。何度もオールリデュースする呼び出し側は、このバッファを呼び出しをまたいで使い回せます。毎回同じ dict を `buffers=` に渡すと（下の `bandwidth_worker` がそうしています）、バッファはその中に残ります。渡さなければ、バッファはその呼び出しの間だけ存在します。一度も書き込まれていないメモリには、最初の書き込みのときにページごとにページフォールトが起きるので、新しく確保したバッファへの受信は、使用済みのバッファへの受信より遅くなると考えられます。通信ライブラリがバッファを使い回すのも同じ理由です。最後に、`piece_bytes`（既定では `PIECE_BYTES`、4 MiB）より大きなチャンクは、同じステップの中でまとめて開始する複数のメッセージに分けて送ります。この 2つの工夫の効果を測るセルは、この章にはありません。どちらも、関数を書いたときに CPU 2コアのマシンで時間を測って決めたものです。リングと `dist.all_reduce` の時間は次の節で測ります。`benchmarks/collectives.py` はそれを `benchmarks/results/collectives-*.json` に保存しています。
#
# リングには、呼び出し側の誤りから身を守る仕組みが 2つあります。1つ目として、リングの呼び出しはまず小さなオールギャザーを 1回行い、ランクどうしで要素数と dtype を照らし合わせます（既定の `check=True`）。これがないと、テンソルが長いランクは届くことのないメッセージを待ち続け、あるランクの整数のテンソルが別のランクの浮動小数点数のテンソルのバイト列と足し合わされてしまいます。照らし合わせれば、すべてのランクがすぐに失敗し、違っているランクをメッセージで名指しします（下の `tour` で試します）。2つ目として、1つのグループでのリングの呼び出しは 1つずつ順に行う必要があります。2つのスレッドから同時に呼び出すと、互いのメッセージが入れ違うからです。`run_ring_steps` は実行中、呼び出し側の `buffers` の dict に使用中の印（`collectives.IN_USE`）を付けるので、同じ dict を使う 2つ目の呼び出しは、データを混ぜずにエラーになります。自分専用のリングが必要なスレッドには、専用のグループと専用の dict が必要です。

# %%
print(inspect.getsource(collectives.ring_all_reduce))
print(inspect.getsource(collectives.run_ring_steps))

# %% [markdown]
# <!-- en -->
# The tour above also ran `ring_all_reduce` and `dist.all_reduce` on the same inputs, on each of the 4 ranks: 0, 1
# and 3 elements (fewer than the ranks: some chunks are empty), 10 (uneven chunks) and 1001, in int64, in float32
# holding integers, and in float64 holding random reals. Integer sums are exact in any order, so these must agree
# bit for bit. Sums of random reals may differ in the last bits, since the ring adds in another order than the
# backend; the check allows `2(k - 1)` units of rounding of the largest sum of magnitudes. It also ran the ring's
# first phase alone on the tour's tensors, next to `dist.reduce_scatter_tensor`, and a ring call in which rank 1
# passes one element more than the others.
# <!-- ja -->
# 上の `tour` の実行では、4個のランクそれぞれで、同じ入力に対して `ring_all_reduce` と `dist.all_reduce` も実行していました。要素数は 0、1、3（ランクの数より少ないので空のチャンクができます）、10（チャンクの大きさがそろいません）、1001 で、dtype は int64、整数を入れた float32、ランダムな実数を入れた float64 です。整数の和はどんな順序で足しても正確なので、ビット単位で一致するはずです。ランダムな実数の和は、リングがバックエンドと違う順序で足すため、最後の数ビットが異なることがあります。そこで、絶対値の和の最大値に対する丸め誤差の `2(k - 1)` 単位分までの差を許します。さらに、リングの前半だけを `tour` のテンソルで `dist.reduce_scatter_tensor` と並べて実行し、ランク 1 だけが他より 1要素多く渡すリングの呼び出しも試しました。

# %%
rows = [row for rank_rows in results["ring"]["rows"] for row in rank_rows]
exact = [equal for n, dtype, equal, within in rows if dtype != "float64"]
close = [within for n, dtype, equal, within in rows if dtype == "float64"]
print(tr(f"integer sums equal to dist.all_reduce: {sum(exact)} of {len(exact)}",
         f"dist.all_reduce と一致した整数の和: {len(exact)}個中 {sum(exact)}個"))
print(tr(f"random float64 sums within rounding: {sum(close)} of {len(close)}",
         f"丸め誤差の範囲に収まったランダムな float64 の和: {len(close)}個中 {sum(close)}個"))
for r, (before, after, *_) in enumerate(results["ring"]["example"]):
    print(f"{tr('rank', 'ランク')} {r}: {before} -> {after}")
print(tr("ring_reduce_scatter of the tour's tensors, and dist.reduce_scatter_tensor:",
         "tour のテンソルの ring_reduce_scatter と dist.reduce_scatter_tensor:"))
for r, (*_, shard, reference, refused) in enumerate(results["ring"]["example"]):
    print(f"  {tr('rank', 'ランク')} {r}: {shard} {reference}")
print(tr("rank 1 passes 5 elements, the others 4; rank 0 is told:",
         "ランク 1 が 5要素、他が 4要素を渡したとき、ランク 0 に出るエラー:"))
print(textwrap.fill(results["ring"]["example"][0][-1], 110, initial_indent="  ", subsequent_indent="  "))
assert all(exact) and all(close) and len(rows) == 4 * 15
assert all(shard == reference == [sum(10 * q + r for q in range(4))]
           for r, (*_, shard, reference, _) in enumerate(results["ring"]["example"]))
assert all(refused is not None and "ring_all_reduce" in refused and "1" in refused
           for *_, refused in results["ring"]["example"])

# %% [markdown]
# <!-- en -->
# `tests/test_collectives.py` runs the same comparison on 1 to 4 processes with more sizes, shapes (including a
# tensor that is not contiguous) and a subgroup of the ranks, checks `ring_reduce_scatter` and `ring_all_gather`
# against `dist.reduce_scatter_tensor` and `dist.all_gather_into_tensor` (integers exactly, reals to rounding), the
# refusals of ranks that disagree, and each collective against the figure above; on a machine with two GPUs or more
# it runs the ring with nccl.
# <!-- ja -->
# `tests/test_collectives.py` では、同じ比較を 1個から 4個のプロセスで、さらに多くの要素数、形状（メモリ上で連続していないテンソルも含みます）、ランクの一部だけのグループについて行います。さらに、`ring_reduce_scatter` と `ring_all_gather` を `dist.reduce_scatter_tensor` と `dist.all_gather_into_tensor` と比べ（整数は正確に、実数は丸め誤差の範囲で）、ランクどうしが食い違うときに呼び出しが拒まれること、各集合通信が上の図のとおりに動くことも確かめています。GPU が 2枚以上あるマシンでは、リングを nccl で実行します。

# %% [markdown]
# <!-- en -->
# ## What communication costs
#
# A message of `n` bytes costs roughly a fixed **latency** `α` (seconds to start a message at all, whatever its
# size) plus `n` times the seconds per byte `β` (one over the **bandwidth**):
#
# $$t(n) = \alpha + n \beta .$$
#
# For the ring on `k` ranks, each of the `2(k-1)` steps pays the latency of one link and moves `n / k` bytes over
# it, so `t = 2(k-1) α_link + 2(k-1)/k · n β_link`. Two bandwidths follow from a measured time, in the convention of
# `nccl-tests`: the **algorithm bandwidth** `n / t`, what the user sees, and the **bus bandwidth** `n / t · 2(k-1)/k`,
# which for large messages approaches the speed of one link, `1 / β_link`, whatever the number of ranks: it
# compares machines and world sizes fairly.
#
# ### One way to time
#
# A single call of a collective says little: the first is slowed by connections and allocations, and on a machine
# that runs other work any call can wait milliseconds for a core. The course times every short operation the same
# way, with `mparlib.timing.measure(fn)`: `warmup` untimed calls, then timed calls, the device synchronised around
# each, until they add up to at least `min_seconds` (50 ms) **and** number at least `min_repeats` (5). A 64 KiB
# all-reduce is thus timed dozens of times and a 256 MiB one 5 times. It returns a `Timing`: the median, which one
# slow call cannot move, the spread (`min`, `max`, the quartiles), and the 1-minute load average
# (`mparlib.timing.load_average()`) before and after, with `busy` set when it exceeds 0.3 per core, so that a number
# measured beside other work says so. For a collective, `collectives.time_collective` adds what a distributed
# timing needs: the ranks meet at a barrier before each call, a call's time is that of the slowest rank, and all
# ranks stop after the same call.
#
# The next cell measures `dist.all_reduce` and `ring_all_reduce` on 2 processes for messages from 64 KiB to
# 256 MiB (`mparlib.collectives.bandwidth_worker`, which times each point with `time_collective`), then fits `α`
# and `β` to the all-reduce medians by least squares on relative errors, so that a 64 KiB message weighs as much as
# 256 MiB, and prints each size's error. `benchmarks/collectives.py` does the same on 2 and 4 ranks and saves the
# numbers. The numbers are your machine's; the stored ones come from the machine that built this notebook.
# <!-- ja -->
# ## 通信にかかる時間
#
# `n` バイトのメッセージにかかる時間は、おおよそ、大きさによらずメッセージを始めるだけでかかる一定の**レイテンシ** `α` と、`n` にバイトあたりの秒数 `β`（**帯域幅**の逆数）を掛けたものの和です。
#
# $$t(n) = \alpha + n \beta$$
#
# `k` 個のランクのリングでは、`2(k-1)` 回のステップのそれぞれでリンク 1本分のレイテンシを払い、そのリンクで `n / k` バイトを運ぶので、`t = 2(k-1) α_link + 2(k-1)/k · n β_link` となります。測った時間からは、`nccl-tests` の慣習に従って 2つの帯域幅を求めます。利用者から見える**アルゴリズム帯域幅** `n / t` と、**バス帯域幅** `n / t · 2(k-1)/k` です。バス帯域幅は、メッセージが大きければランクの数によらずリンク 1本の速さ `1 / β_link` に近づくので、マシンどうしやワールドサイズどうしを公平に比べられます。
#
# ### 時間の測り方
#
# 集合通信を 1回呼び出しただけでは、ほとんど何もわかりません。最初の呼び出しは接続やメモリ確保のぶん遅くなりますし、他の仕事も動いているマシンでは、どの呼び出しもコアを待って数ミリ秒遅れることがあります。このコースでは、短い処理の時間をすべて同じ方法、`mparlib.timing.measure(fn)` で測ります。まず計測しない呼び出しを `warmup` 回行い、そのあと、呼び出しごとにデバイスを同期しながら計測を繰り返します。計測した時間の合計が `min_seconds`（50 ms）以上に**なり、かつ**回数が `min_repeats`（5回）以上になるまで続けます。そのため 64 KiB のオールリデュースは数十回、256 MiB のものは 5回測ることになります。戻り値は `Timing` で、遅い呼び出しが 1回あっても動かない中央値、ばらつき（`min`、`max`、四分位数）、計測の前後の 1分間のロードアベレージ（`mparlib.timing.load_average()`）を持ちます。ロードアベレージがコアあたり 0.3 を超えると `busy` が真になり、他の仕事と並んで測った数値であることがわかります。集合通信では、`collectives.time_collective` が分散環境での計測に必要な処理を加えます。各呼び出しの前にランクがバリアで待ち合わせ、いちばん遅いランクの時間をその呼び出しの時間とし、すべてのランクが同じ回数で計測を終えます。
#
# 次のセルでは、2個のプロセスで `dist.all_reduce` と `ring_all_reduce` を、64 KiB から 256 MiB までのメッセージについて測ります（`mparlib.collectives.bandwidth_worker`。各点を `time_collective` で計測します）。そのあと、オールリデュースの中央値に `α` と `β` を相対誤差の最小二乗法で当てはめ、大きさごとの誤差を表示します。相対誤差を使うので、64 KiB のメッセージも 256 MiB のメッセージも同じ重みで扱われます。`benchmarks/collectives.py` は同じことを 2個と 4個のランクで行い、結果を保存します。表示される数値はお使いのマシンのものです。保存されている数値は、このノートブックを作成したマシンのものです。

# %% tags=["nbval-ignore-output"]
KiB, MiB = 1024, 1024 ** 2
sizes = [64 * KiB * 4 ** i for i in range(7)]  # 64 KiB .. 256 MiB, as benchmarks/collectives.py
bandwidth = launch(collectives.bandwidth_worker, 2, args=(sizes,), kwargs=dict(min_seconds=0.05, min_repeats=5),
                   echo=False, timeout=300)
measured = {m: [row for row in bandwidth if row["method"] == m] for m in ("all_reduce", "ring")}
fit = collectives.fit_alpha_beta([r["bytes"] for r in measured["all_reduce"]],
                                 [r["seconds"] for r in measured["all_reduce"]])
head = [("bytes", "バイト数"), "all_reduce ms", ("min-max ms", "最小-最大 ms"), ("calls", "回数"),
        ("ring ms", "リング ms"), ("busbw GB/s", "バス帯域 GB/s"), ("model ms", "モデル ms"), ("model error", "モデルの誤差")]
print(table([[a["bytes"], f"{a['seconds'] * 1e3:.3f}", f"{a['min'] * 1e3:.2f}-{a['max'] * 1e3:.2f}", a["repeats"],
              f"{r['seconds'] * 1e3:.3f}", f"{a['busbw'] / 1e9:.3f}",
              f"{collectives.predict_seconds(fit, a['bytes']) * 1e3:.3f}", f"{error:+.0%}"]
             for a, r, error in zip(measured["all_reduce"], measured["ring"], fit["relative_errors"])],
            head, align=">" * len(head)))
worst = max(abs(e) for e in fit["relative_errors"])
print(tr(f"alpha-beta fit: alpha = {fit['alpha'] * 1e6:.1f} us, bandwidth 1/beta = {fit['bandwidth'] / 1e9:.2f} GB/s "
         f"({bandwidth[0]['backend']}, 2 processes); worst error {worst:.0%} (goal: 25%)",
         f"α-β モデルの当てはめ: α = {fit['alpha'] * 1e6:.1f} μs、帯域幅 1/β = {fit['bandwidth'] / 1e9:.2f} GB/s"
         f"（{bandwidth[0]['backend']}、プロセス 2個）。誤差の最大 {worst:.0%}（目標は 25%）"))
first, last = bandwidth[0], bandwidth[-1]
busy = any(row["busy"] for row in bandwidth)
print(tr(f"load average (1 min): {first['load_before']:.2f} at the start, {last['load_after']:.2f} at the end, "
         f"on {first['cores']} cores: " + ("busy (above 0.3 per core)" if busy else "not busy"),
         f"ロードアベレージ（1分）: 開始時 {first['load_before']:.2f}、終了時 {last['load_after']:.2f}、"
         f"コア {first['cores']}個: " + ("混んでいます（コアあたり 0.3 超）" if busy else "空いています")))

fig = Figure(figsize=(9, 3.6))
ax = fig.add_subplot()
for m, style, label in (("all_reduce", "o-", "dist.all_reduce"), ("ring", "s--", "ring_all_reduce")):
    busbw = [r["busbw"] / 1e9 for r in measured[m]]
    spread = [[b - b * r["seconds"] / r["q3"] for b, r in zip(busbw, measured[m])],  # slower quartile: lower bandwidth
              [b * r["seconds"] / r["q1"] - b for b, r in zip(busbw, measured[m])]]
    ax.errorbar([r["bytes"] for r in measured[m]], busbw, yerr=spread, fmt=style, capsize=3, label=label)
model = [collectives.bus_bandwidth(n / collectives.predict_seconds(fit, n), 2) / 1e9 for n in sizes]
ax.plot(sizes, model, "k:", label=tr("alpha-beta model of dist.all_reduce", "dist.all_reduce の α-β モデル"))
ax.set_xscale("log", base=2)
ax.set_xlabel(tr("message size (bytes)", "メッセージの大きさ（バイト）"))
ax.set_ylabel(tr("bus bandwidth (GB/s)", "バス帯域幅（GB/s）"))
ax.set_title(tr("All-reduce on 2 processes (bars: the middle half of the calls)",
                "プロセス 2個のオールリデュース（縦線: 呼び出しの中央の半分）"))
ax.grid(True, alpha=0.3)
ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the axes, never over a point
fig.tight_layout()
display(Image(figure_png(fig)))

# %%
assert [r["bytes"] for r in measured["all_reduce"]] == sizes == [r["bytes"] for r in measured["ring"]]
assert all(r["seconds"] > 0 and math.isfinite(r["seconds"]) for r in bandwidth)
assert all(r["repeats"] >= 5 and sum(r["all_seconds"]) >= 0.05 for r in bandwidth)  # the timing rule held
assert all(r["min"] <= r["q1"] <= r["seconds"] <= r["q3"] <= r["max"] for r in bandwidth)
assert 0 <= fit["alpha"] < 1 and 0 < fit["beta"] and math.isfinite(fit["bandwidth"])

# %% [markdown]
# <!-- en -->
# Read the curve from left to right. Small messages are all latency: doubling the size hardly changes the time,
# so the bandwidth grows in proportion to the size. Large messages are all bandwidth: the curve flattens at what
# the transport can carry, and that plateau, `1 / β`, is the number that matters for gradients of many megabytes.
# Where the fit misses a measured point, the model is too simple for that size (libraries switch algorithms
# between sizes, caches and buffers change at some sizes) or the machine was busy during that call; the table
# shows how far off each size is, and the min-max column how much the calls of one size varied. (The table's
# columns are padded with `mparlib.devices.pad`, which counts display columns with `display_width`: a Japanese
# character takes two, and `f"{text:<10}"`, which counts characters, would misalign the Japanese edition.)
#
# The ring from `send`/`recv` should be slower than the backend's own all-reduce for small messages: each of its
# `2(k-1)` steps starts separate messages from Python, so it pays the latency several times over. On a busy machine a
# single small size can come out the other way round, because one call that waits for a core takes milliseconds
# longer; trust a small size only when a rerun agrees. For large messages the gap narrows, because then both are
# limited by the same bytes over the same links.
# `benchmarks/collectives.py` states two goals and records whether they were met: the ring within 2x of gloo's
# all-reduce from 16 MiB on 2 ranks, and the model within 25% of every measured size from 64 KiB to 256 MiB.
#
# The stored run (`benchmarks/results/collectives-vm-20261202-011842.json`, 2 and 4 gloo processes on this course's
# 2-core machine) was made on a busy machine: a load average of 13.2 at the start and 17.4 at the end, 8.7 per core,
# far above the 0.3 below which a run counts as quiet. It met the first goal (the ring took 0.42, 0.84 and 0.88
# times the all-reduce's median at 16, 64 and 256 MiB) and missed the second. On 2 ranks the fit (`α` = 159 µs,
# `1 / β` = 1.15 GB/s) is off by -31%, +10%, +53%, -80%, -88%, -32% and -65% from 64 KiB to 256 MiB, worst 88% at
# 16 MiB, where the median of 5 calls (121 ms) was slower than that of the four times larger 64 MiB message
# (86 ms): on that machine the medians of the large sizes measure the competition for the cores more than the link.
# On 4 ranks (4 processes on 2 cores) the worst error was 43%. A fit of each size's fastest call, the least
# disturbed one, misses too (82% on 2 ranks, 45% on 4). Part of the miss is the model itself: the 1 MiB all-reduce
# ran at 1.5 GB/s of bus bandwidth, faster than any larger size, and one latency plus one bandwidth cannot describe
# both a message that stays in the processor's caches and one that does not. Whether the goal holds where nothing
# else runs is for a run on an idle machine to say; the JSON's `load` records which kind of run it was.
#
# For scale: between the 8 GPUs of one H200 server, an all-reduce reaches a bus bandwidth of about 482 GB/s (Stas
# Bekman, *Machine Learning Engineering*). That figure does not come from a ring. On such a node NCCL reduces inside
# the NVLink switches (NVLS, NVLink SHARP): the switch adds up what the GPUs send and returns the sum, so the ring's
# factor `2(k-1)/k` does not describe the traffic, as the book points out. The bus bandwidth, computed with that
# factor by the nccl-tests convention, is then a figure for comparing how fast machines finish an all-reduce, not the
# speed of a link. Set beside the plateau above, it shows how far apart the two machines are; the `α`-`β` model of one
# message still applies there, with other values.
# <!-- ja -->
# グラフを左から右へ読んでください。小さなメッセージはほとんどレイテンシだけです。大きさを 2倍にしても時間はほとんど変わらないので、帯域幅は大きさに比例して伸びます。大きなメッセージはほとんど帯域幅だけで決まります。曲線は通信路が運べる量のところで頭打ちになり、その高さ `1 / β` が、何メガバイトもある勾配にとって重要な数値です。当てはめたモデルが測定点から外れるのは、その大きさではモデルが単純すぎる（ライブラリはメッセージの大きさによってアルゴリズムを切り替えますし、キャッシュやバッファの効き方もある大きさで変わります）か、その呼び出しの間にマシンが忙しかったかのどちらかです。どれだけ外れたかは表で大きさごとに確かめられ、同じ大きさの呼び出しがどれだけばらついたかは「最小-最大」の列でわかります（表の列は `mparlib.devices.pad` でそろえています。`pad` は `display_width` で表示上の幅を数えます。日本語の文字は 2文字分の幅をとるので、文字数を数える `f"{text:<10}"` では日本語版の列がずれてしまいます）。
#
# `send`/`recv` で作ったリングは、小さなメッセージではバックエンド自身のオールリデュースより遅くなるはずです。`2(k-1)` 回のステップのそれぞれで Python から別々のメッセージを開始するので、レイテンシを何回も払うからです。ただし忙しいマシンでは、コアを待った呼び出しが 1回あるだけで数ミリ秒長くなるので、小さな大きさでは逆の結果が出ることもあります。小さな大きさの結果は、実行し直しても同じになったときだけ信用してください。大きなメッセージでは差が縮まります。どちらも、同じリンクで同じバイト数を運ぶ速さで制約されるからです。`benchmarks/collectives.py` には 2つの目標があり、達成したかどうかを記録します。ランク 2個で 16 MiB 以上のとき、リングが gloo のオールリデュースの 2倍以内の時間で終わること、そして 64 KiB から 256 MiB までの測ったすべての大きさで、モデルが測定値の 25% 以内に収まることです。
#
# 保存されている実行（`benchmarks/results/collectives-vm-20261202-011842.json`。このコースの 2コアのマシンで、gloo のプロセス 2個と 4個）は、混んだマシンで測ったものです。ロードアベレージは開始時 13.2、終了時 17.4、コアあたり 8.7 で、空いているとみなせる 0.3 をはるかに超えていました。1つ目の目標は達成しました（16、64、256 MiB で、リングの時間はオールリデュースの中央値の 0.42倍、0.84倍、0.88倍）。2つ目の目標は達成できませんでした。ランク 2個での当てはめ（`α` = 159 μs、`1 / β` = 1.15 GB/s）の誤差は、64 KiB から 256 MiB まで順に -31%、+10%、+53%、-80%、-88%、-32%、-65% で、最大は 16 MiB の 88% です。この大きさでは 5回の呼び出しの中央値（121 ms）が、4倍大きい 64 MiB のメッセージの中央値（86 ms）より遅くなりました。このマシンでは、大きなメッセージの中央値はリンクの速さよりもコアの奪い合いを測っていたことになります。ランク 4個（2コアにプロセス 4個）での誤差の最大は 43% でした。大きさごとにいちばん速い呼び出し、つまりいちばん邪魔されなかった呼び出しに当てはめても、やはり外れます（ランク 2個で 82%、4個で 45%）。外れた原因の一部はモデルそのものにあります。1 MiB のオールリデュースはバス帯域幅 1.5 GB/s で、それより大きいどの大きさよりも速く進みました。プロセッサのキャッシュに収まるメッセージと収まらないメッセージの両方を、1つのレイテンシと 1つの帯域幅で表すことはできません。ほかに何も動いていないマシンで目標が成り立つかどうかは、空いたマシンでの実行で確かめることになります。どちらの種類の実行だったかは JSON の `load` に記録されます。
#
# 規模の目安として、H200 を 8枚積んだサーバー 1台の中では、オールリデュースのバス帯域幅はおよそ 482 GB/s に達します（Stas Bekman『Machine Learning Engineering』）。ただし、これはリングの値ではありません。このようなノードでは、NCCL は NVLink スイッチの中で足し算をします（NVLS、NVLink SHARP）。GPU が送ったデータをスイッチが足し合わせて和を返すので、リングの係数 `2(k-1)/k` は実際の通信量を表しません。このことは同書も指摘しています。nccl-tests の慣習どおりにこの係数を掛けて求めたバス帯域幅は、マシンがオールリデュースをどれだけ速く終えるかを比べるための数値で、リンク 1本の速さではありません。上のグラフの頭打ちの高さと並べれば、2つのマシンの差がわかります。メッセージ 1つの `α`-`β` モデルは、値は違っても、そのまま当てはまります。

# %% [markdown]
# <!-- en -->
# ## Inside DDP
#
# DDP calls an all-reduce on the gradients, but not on each gradient separately (hundreds of small messages, each
# paying `α`) and not on all of them at once after the backward pass (one big message that waits for the slowest
# gradient and overlaps nothing). It packs the gradients into **buckets** of about `bucket_cap_mb` megabytes (25 by
# default), in the order in which the backward pass produces them, from the last layer to the first; when
# `bucket_cap_mb` is not given, the first bucket is capped at `dist._DEFAULT_FIRST_BUCKET_BYTES` (1 MiB), so that
# communication starts early. When every gradient of a bucket is ready, DDP starts that bucket's all-reduce
# asynchronously, and the backward pass carries
# on with the earlier layers meanwhile. What DDP does with a bucket is replaceable: a **communication hook**,
# registered with `model.register_comm_hook(state, hook)`, receives each bucket (`bucket.buffer()` is one flat
# tensor of its gradients) and returns a future of the averaged gradients.
#
# The worker below looks inside with three experiments on a stack of seven `Linear` layers (1.58 million
# parameters, 6.3 MB of float32 gradients), on 2 CPU processes with gloo, where the host's clock sees when the
# communication really happens (on GPUs the same questions need CUDA events or `torch.profiler`):
#
# 1. a hook that does what DDP does by default, averaging with `all_reduce`, but writes down when each bucket's
#    all-reduce starts and ends, next to `register_post_accumulate_grad_hook` on every parameter, which writes down
#    when its gradient is complete; once with `bucket_cap_mb=1` and once with `bucket_cap_mb=25` (the default cap,
#    passed explicitly);
# 2. a hook that sends the gradients in bfloat16, compared with PyTorch's own `bf16_compress_hook`;
# 3. gradient accumulation over 4 micro-batches with and without `no_sync()`.
# <!-- ja -->
# ## DDP の内部
#
# DDP は勾配をオールリデュースしますが、勾配を 1つずつ送るわけではありません（小さなメッセージが何百個にもなり、それぞれが `α` を払います）。逆伝播がすべて終わってから一度に送るわけでもありません（いちばん遅い勾配を待つ 1つの大きなメッセージになり、何とも重なりません）。DDP は勾配を、逆伝播が作る順、つまり最後の層から最初の層への順に、およそ `bucket_cap_mb` メガバイト（既定値は 25）の**バケット**に詰めます。`bucket_cap_mb` を渡さなければ、通信を早く始めるために、最初のバケットだけは `dist._DEFAULT_FIRST_BUCKET_BYTES`（1 MiB）までに抑えます。バケットの勾配がすべてそろうと、DDP はそのバケットのオールリデュースを非同期に始め、その間も逆伝播は手前の層の計算を続けます。DDP がバケットをどう扱うかは差し替えられます。`model.register_comm_hook(state, hook)` で登録した**通信フック**は、バケットを 1つずつ受け取り（`bucket.buffer()` はそのバケットの勾配を並べた 1本のテンソルです）、平均した勾配の future を返します。
#
# 次のワーカーは、7層の `Linear` を積んだネットワーク（パラメータ 158万個、float32 の勾配で 6.3 MB）を使い、3つの実験で内部をのぞきます。gloo を使う 2個の CPU プロセスで実行します。CPU なら、通信が実際に行われる時刻をホストの時計で測れるからです（GPU で同じことを調べるには CUDA のイベントか `torch.profiler` が必要です）。
#
# 1. DDP の既定の動作と同じく `all_reduce` で平均をとる一方で、各バケットのオールリデュースが始まった時刻と終わった時刻を記録するフックを使います。あわせて、すべてのパラメータに `register_post_accumulate_grad_hook` を付け、勾配が完成した時刻を記録します。`bucket_cap_mb=1` のときと、既定値と同じ 25 を明示的に渡した `bucket_cap_mb=25` のときの 2回行います。
# 2. 勾配を bfloat16 で送るフックを作り、PyTorch 自身の `bf16_compress_hook` と比べます。
# 3. 4つのマイクロバッチにわたる勾配累積を、`no_sync()` を使う場合と使わない場合で比べます。

# %%
# %%worker ddp_inside
import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def stack(width=512, layers=6, seed=0):
    """Linear(width, width) + ReLU, `layers` times, then Linear(width, 10): (N, width) -> (N, 10)."""
    torch.manual_seed(seed)  # the same initial weights on every rank
    blocks = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


def batch(n, width=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randint(0, 10, (n,), generator=g)


def bucket_timeline(bucket_cap_mb, steps=2):
    """When each gradient is complete and when each bucket's all-reduce runs, in ms from the start of backward."""
    model, world, events = DDP(stack(), bucket_cap_mb=bucket_cap_mb), dist.get_world_size(), []

    def recording_all_reduce(state, bucket):  # DDP's default (sum, then divide by the world size), timed
        start = time.perf_counter()
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()

        def done(f):  # runs when the all-reduce has finished
            events.append(("bucket", bucket.index(), bucket.buffer().numel(), start, time.perf_counter()))
            return f.value()[0].div_(world)

        return fut.then(done)

    model.register_comm_hook(None, recording_all_reduce)
    names = {p: name for name, p in model.module.named_parameters()}
    for p in model.module.parameters():
        p.register_post_accumulate_grad_hook(lambda p: events.append(("grad", names[p], time.perf_counter())))
    x, y = batch(64, seed=dist.get_rank())
    for _ in range(steps):  # DDP re-forms its buckets after the first step, in the order the gradients came
        events.clear()
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        start = time.perf_counter()
        loss.backward()  # returns when every bucket's all-reduce has finished
        end = time.perf_counter()
    ms = lambda t: (t - start) * 1e3
    return {"grads": [(e[1], ms(e[2])) for e in events if e[0] == "grad"],
            "buckets": sorted((e[1], e[2], ms(e[3]), ms(e[4])) for e in events if e[0] == "bucket"),
            "backward_ms": ms(end)}


def counting_all_reduce(state, bucket):
    """DDP's default, float32 average, counting the bytes handed to all_reduce."""
    state["bytes"] = state.get("bytes", 0) + bucket.buffer().numel() * bucket.buffer().element_size()
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(dist.get_world_size()))


def bf16_all_reduce(state, bucket):
    """Send half the bytes: average the bucket in bfloat16 (7 bits of mantissa), then copy it back to float32."""
    compressed = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size())
    state["bytes"] = state.get("bytes", 0) + compressed.numel() * compressed.element_size()
    fut = dist.all_reduce(compressed, async_op=True).get_future()
    return fut.then(lambda f: bucket.buffer().copy_(f.value()[0]))


def gradients(hook=None, state=None):
    """The averaged gradients of one backward pass of DDP, as one flat tensor, with an optional comm hook."""
    model = DDP(stack())
    if hook is not None:
        model.register_comm_hook(state, hook)
    x, y = batch(32, seed=dist.get_rank())
    nn.functional.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def compression():
    fp32, bf16 = {}, {}
    default, counted = gradients(), gradients(counting_all_reduce, fp32)
    ours, pytorchs = gradients(bf16_all_reduce, bf16), gradients(default_hooks.bf16_compress_hook, None)
    error = (ours - default).abs()
    return {"bytes_fp32": fp32["bytes"], "bytes_bf16": bf16["bytes"],
            "counting_is_default": torch.equal(counted, default), "ours_is_pytorchs": torch.equal(ours, pytorchs),
            "max_error": (error.max() / default.abs().max()).item(),
            "median_relative_error": (error / default.abs().clamp_min(1e-30)).median().item()}


def accumulation(micro_batches=4, micro=16, steps=6):
    """One SGD step from micro_batches backward passes, three ways; the step's result and the time per step."""
    x, y = batch(micro_batches * micro, seed=dist.get_rank())  # this rank's share of the large batch
    initial = [p.detach().clone() for p in stack().parameters()]
    results = {}
    for way in ("one large batch", "no_sync", "all-reduce every micro-batch"):
        model = DDP(stack())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        times = []
        for step in range(steps + 1):  # step 0 warms up; its update is the one compared
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad()
            if way == "one large batch":
                nn.functional.cross_entropy(model(x), y).backward()
            else:
                for i in range(micro_batches):
                    part = slice(i * micro, (i + 1) * micro)
                    quiet = way == "no_sync" and i < micro_batches - 1  # the last backward all-reduces
                    with model.no_sync() if quiet else contextlib.nullcontext():
                        (nn.functional.cross_entropy(model(x[part]), y[part]) / micro_batches).backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
            if step == 0:
                results[way] = {"params": [p.detach().clone() for p in model.parameters()]}
        results[way]["ms"] = min(times[1:]) * 1e3
    reference = results["one large batch"]["params"]
    largest = lambda a, b: max((p - q).abs().max().item() for p, q in zip(a, b))
    return {way: {"ms": r["ms"], "difference": largest(r["params"], reference),
                  "moved": largest(r["params"], initial)} for way, r in results.items()}


def inside_ddp():
    return {"timeline": {cap: bucket_timeline(cap) for cap in (1, 25)}, "compression": compression(),
            "accumulation": accumulation()}

# %%
from ddp_inside import inside_ddp

inside = launch(inside_ddp, 2, backend="gloo", echo=False, timeout=120)

# %% [markdown]
# <!-- en -->
# ### Buckets overlap the backward pass
#
# The figure shows the second backward pass of each run (DDP re-forms its buckets after the first, in the order the
# gradients arrived). Dots are gradients becoming complete, last layer first; bars are the buckets' all-reduces, one
# lane per bucket, numbered at their right end (DDP's bucket index).
# <!-- ja -->
# ### 逆伝播と重なるバケット
#
# 図は、それぞれの実行の 2回目の逆伝播です（DDP は 1回目のあとで、勾配が届いた順にバケットを組み直します）。点は勾配が完成した時刻（最後の層から順に）、横棒は各バケットのオールリデュースで、バケットごとに段を分け、右端に番号（DDP のバケットの番号）を付けています。

# %% tags=["nbval-ignore-output"]
fig = Figure(figsize=(8, 3.8))
axes = fig.subplots(2, 1, sharex=True)
for ax, (cap, run) in zip(axes, inside["timeline"].items()):
    ax.plot([t for _, t in run["grads"]], [1] * len(run["grads"]), "o", ms=4, color="#2e86c1")
    lane = 0.9 / len(run["buckets"])  # one lane per bucket: all-reduces that overlap in time stay apart
    for j, (index, numel, start, end) in enumerate(run["buckets"]):
        y = 0.45 - (j + 0.5) * lane
        ax.barh(y, end - start, left=start, height=0.85 * lane, color="#e59866", edgecolor="white")
        ax.text(end, y, f" {index}", ha="left", va="center", fontsize=7)  # after the bar's end, in its own lane
    ax.axvline(run["backward_ms"], color="0.4", ls=":")
    ax.set_yticks([0, 1], [tr("all-reduce", "オールリデュース"), tr("gradient ready", "勾配の完成")])
    ax.set_ylim(-0.6, 1.5)
    ax.set_title(tr(f"bucket_cap_mb={cap}: {len(run['buckets'])} bucket(s)",
                    f"bucket_cap_mb={cap}: バケット {len(run['buckets'])}個"), fontsize=9)
axes[-1].set_xlabel(tr("ms from the start of backward (dotted: backward() returns)",
                       "逆伝播の開始からの時間 ms（点線: backward() が戻った時刻）"))
fig.tight_layout()
display(Image(figure_png(fig)))
for cap, run in inside["timeline"].items():
    last_grad = max(t for _, t in run["grads"])
    first = run["buckets"][0]
    print(tr(f"bucket_cap_mb={cap}: {len(run['buckets'])} bucket(s); the first all-reduce starts at "
             f"{first[2]:.1f} ms, the last gradient is ready at {last_grad:.1f} ms, backward returns at "
             f"{run['backward_ms']:.1f} ms",
             f"bucket_cap_mb={cap}: バケット {len(run['buckets'])}個。最初のオールリデュースの開始 {first[2]:.1f} ms、"
             f"最後の勾配の完成 {last_grad:.1f} ms、backward() が戻る {run['backward_ms']:.1f} ms"))

# %%
small, default = inside["timeline"][1], inside["timeline"][25]
numel = sum(n for _, n, _, _ in default["buckets"])
assert numel == sum(n for _, n, _, _ in small["buckets"]) == 6 * (512 * 512 + 512) + 512 * 10 + 10
assert len(small["buckets"]) > 1 and len(default["buckets"]) == 1
assert small["buckets"][0][2] < max(t for _, t in small["grads"])  # communication began during backward
assert default["buckets"][0][2] >= max(t for _, t in default["grads"])  # one bucket waits for every gradient

# %% [markdown]
# <!-- en -->
# With 1 MB buckets the first all-reduce starts while most of the backward pass is still to come, and the buckets
# follow one another as the layers finish. With `bucket_cap_mb=25`, passed explicitly as the worker does, this whole
# model fits in one bucket, which can start only when the last gradient (that of the first layer) is complete: nothing
# overlaps. DDP's real default behaves otherwise. Without the argument, the first bucket is capped at 1 MiB
# (`dist._DEFAULT_FIRST_BUCKET_BYTES`) and only the others at 25 MB, so the last layers' gradients leave early in a
# small bucket of their own and their all-reduce overlaps the rest of the backward pass; for this stack that makes
# 2 buckets (question 5 of *More questions*). Passing `bucket_cap_mb`, even the value 25, turns the small first bucket off. Smaller
# buckets are not always better, since each pays the latency `α`; for a large model on fast links, the default is a
# good compromise, and `bucket_cap_mb` is the knob to try when a profile shows communication waiting at the end of
# backward.
#
# ### A communication hook: half the bytes
#
# `bf16_all_reduce` above casts each bucket to bfloat16 (the 8 exponent bits of float32, 7 bits of mantissa instead
# of 23), averages that, and copies the result back into the float32 bucket. It is PyTorch's
# `default_hooks.bf16_compress_hook` written out (its documentation asks for a recent nccl, but it runs with gloo
# too), and the gradients of the two agree bit for bit:
# <!-- ja -->
# 1 MB のバケットでは、逆伝播の大部分がまだ残っているうちに最初のオールリデュースが始まり、層の計算が終わるのに合わせてバケットが次々に続きます。ワーカーのように `bucket_cap_mb=25` を明示的に渡すと、このモデル全体が 1つのバケットに収まります。このバケットは最後の勾配（最初の層の勾配）が完成するまで始められないので、何も重なりません。DDP の実際の既定の動作はこれとは違います。引数を渡さなければ、最初のバケットは 1 MiB（`dist._DEFAULT_FIRST_BUCKET_BYTES`）まで、残りのバケットだけが 25 MB までになります。そのため最後のほうの層の勾配は小さな専用のバケットで先に送られ、そのオールリデュースは逆伝播の残りと重なります。このネットワークでは、バケットは 2つになります（「その他の問い」の 5）。`bucket_cap_mb` を渡すと、値が 25 でも、この小さな最初のバケットはなくなります。バケットは小さければよいわけではありません。バケットごとにレイテンシ `α` を払うからです。大きなモデルを速いリンクで訓練するなら既定値はよい妥協点です。プロファイラの結果で、逆伝播の終わりに通信を待っている時間が目立つときに試すのが `bucket_cap_mb` です。
#
# ### 通信フック: 送るバイト数の半減
#
# 上の `bf16_all_reduce` は、各バケットを bfloat16（float32 と同じ 8ビットの指数部と、23ビットではなく 7ビットの仮数部）に変換してから平均をとり、結果を float32 のバケットにコピーして戻します。これは PyTorch の `default_hooks.bf16_compress_hook` を書き下したもので（そのドキュメントは新しい nccl を求めていますが、gloo でも動きます）、両者の勾配はビット単位で一致します。

# %%
c = inside["compression"]
print(tr(f"bytes sent per backward pass: float32 {c['bytes_fp32']:,}, bfloat16 {c['bytes_bf16']:,}",
         f"逆伝播 1回あたりに送るバイト数: float32 {c['bytes_fp32']:,}、bfloat16 {c['bytes_bf16']:,}"))
print(tr("our hook gives the same gradients as PyTorch's bf16_compress_hook:",
         "このフックの勾配は PyTorch の bf16_compress_hook と一致:"), c["ours_is_pytorchs"])
assert c["bytes_bf16"] * 2 == c["bytes_fp32"] == 4 * numel
assert c["ours_is_pytorchs"] and c["counting_is_default"]

# %% tags=["nbval-ignore-output"]
print(tr(f"difference to the float32 average: largest {c['max_error']:.1e} of the largest gradient, "
         f"median {c['median_relative_error']:.1e} of each gradient",
         f"float32 の平均との差: 最大で勾配の最大値の {c['max_error']:.1e}、各勾配に対する相対誤差の中央値 "
         f"{c['median_relative_error']:.1e}"))

# %%
assert 0 < c["median_relative_error"] < 2 ** -7 and 0 < c["max_error"] < 2 ** -6

# %% [markdown]
# <!-- en -->
# Half the bytes, and gradients that differ from the exact average by a fraction of a percent, the rounding of
# bfloat16's 8 significant bits. Whether that matters for training is a question for the training curve (question 3 of *More questions*);
# where the links are slow and the gradients large, it often does not, and the step gets faster. Other hooks in
# `torch.distributed.algorithms.ddp_comm_hooks` go further (PowerSGD sends low-rank approximations).
#
# ### Gradient accumulation and `no_sync()`
#
# To train with a batch larger than fits in memory, a process can run several **micro-batches** forward and
# backward, let their gradients add up in `.grad` (each loss divided by the number of micro-batches), and take one
# optimizer step. With DDP, every backward pass would all-reduce its gradients, though only the sum at the end is
# needed. Inside `with model.no_sync():` DDP skips the all-reduce and only accumulates; the first backward pass
# after the block all-reduces the accumulated sum. The worker compared three ways to take one step over the same
# data: one large batch per rank, 4 micro-batches with `no_sync()` for the first 3, and 4 micro-batches that each
# all-reduce.
# <!-- ja -->
# 送るバイト数は半分になり、勾配と正確な平均との差は 1% に満たない程度です。これは有効数字 8ビットの bfloat16 の丸め誤差にあたります。これが訓練に影響するかどうかは訓練曲線で確かめるべきことです（「その他の問い」の 3）。リンクが遅く勾配が大きい場合には影響しないことが多く、ステップは速くなります。`torch.distributed.algorithms.ddp_comm_hooks` には、さらに踏み込んだフックもあります（PowerSGD は低ランク近似を送ります）。
#
# ### 勾配累積と `no_sync()`
#
# メモリに収まらないほど大きなバッチで訓練したいときは、プロセスが複数の**マイクロバッチ**について順伝播と逆伝播を行い、勾配を `.grad` に足し合わせてから（各損失はマイクロバッチの数で割っておきます）、パラメータを 1回だけ更新します。DDP では、逆伝播のたびに勾配がオールリデュースされますが、必要なのは最後の合計だけです。`with model.no_sync():` の中では、DDP はオールリデュースを省いて勾配を足し合わせるだけにします。ブロックを出たあとの最初の逆伝播で、足し合わせた合計がオールリデュースされます。ワーカーでは、同じデータで 1ステップ進める 3つの方法を比べました。ランクごとに 1つの大きなバッチを使う方法、4つのマイクロバッチのうち最初の 3つで `no_sync()` を使う方法、4つのマイクロバッチのそれぞれでオールリデュースする方法です。

# %% tags=["nbval-ignore-output"]
acc = inside["accumulation"]
names = {"one large batch": tr("one large batch", "1つの大きなバッチ"), "no_sync": "no_sync",
         "all-reduce every micro-batch": tr("all-reduce every micro-batch", "マイクロバッチごとにオールリデュース")}
print(table([[names[way], f"{r['difference']:.1e}", f"{r['ms']:.1f}"] for way, r in acc.items()],
            [("way", "方法"), ("difference to one batch", "1バッチとの差"), ("ms per step", "ステップあたり ms")]))

# %%
assert all(r["difference"] < 1e-6 for r in acc.values())  # float32 rounding: the same update
assert all(r["moved"] > 1e-3 for r in acc.values())  # and the step really changed the parameters
assert all(r["ms"] > 0 and math.isfinite(r["ms"]) for r in acc.values())

# %% [markdown]
# <!-- en -->
# All three give the same update, up to float32 rounding. The times show the price of the all-reduces that
# `no_sync()` avoids: 4 instead of 1 per optimizer step. How much that saves depends on how the gradients' all-reduce
# compares with a micro-batch's computation on your machine, and a busy machine blurs small differences, so run the
# cell twice before concluding. On slow links with large models, the ratio of the two times approaches the number
# of micro-batches.
# <!-- ja -->
# 3つの方法はどれも、float32 の丸め誤差の範囲で同じ更新を行います。時間の差に表れているのは、`no_sync()` が省くオールリデュースのコストです。`no_sync()` を使わないと、パラメータの更新 1回あたりのオールリデュースが 1回ではなく 4回になります。どれだけ節約できるかは、お使いのマシンで勾配のオールリデュースがマイクロバッチ 1つの計算と比べてどれだけかかるかによります。また、マシンが忙しいと小さな差はぼやけるので、結論を出す前にセルを 2回実行してください。リンクが遅くモデルが大きいほど、2つの時間の比はマイクロバッチの数に近づきます。

# %% [markdown]
# <!-- en -->
# ## Why two devices can be slower than one
#
# With `k` devices and a fixed global batch `B`, one step of data-parallel training costs roughly the computation
# of `B / k` examples plus one all-reduce of all the gradients:
#
# $$t_k \approx \frac{t_1(B)}{k} + \text{comm}(\text{bytes}, k), \qquad \text{comm}(n, k) = \alpha + n \beta .$$
#
# The first term shrinks with more devices; the second does not, because the bytes are those of the **model**, not
# of the batch: ResNet-18's 11,175,818 parameters make 44.7 MB of float32 gradients whether a device computes 8
# images or 800. Two devices are slower than one as soon as the all-reduce costs more than the share of the
# computation that the second device takes over: small per-device batches, large models and slow links.
#
# The worker below measures this for the ResNet-18 step of chapter 6. Rank 0 first times the step on its own, as one
# device with the whole global batch (and, for later, with half of it), while the other rank waits at a barrier (a
# rank that waits in gloo sleeps until the barrier's message arrives, so it should take almost no CPU time); then both
# ranks time DDP steps on half the batch each. The fitted `α` and `β` from the bandwidth measurement turn the gradient
# bytes into a predicted communication time.
# <!-- ja -->
# ## 2つのデバイスが 1つより遅くなるわけ
#
# デバイスが `k` 個で全体のバッチサイズ `B` が一定のとき、データ並列の訓練の 1ステップには、おおよそ `B / k` 個のデータの計算と、すべての勾配のオールリデュース 1回分の時間がかかります。
#
# $$t_k \approx \frac{t_1(B)}{k} + \text{comm}(\text{bytes}, k), \qquad \text{comm}(n, k) = \alpha + n \beta$$
#
# 第 1項はデバイスを増やすほど小さくなりますが、第 2項は小さくなりません。バイト数はバッチではなく**モデル**で決まるからです。ResNet-18 のパラメータ 11,175,818個は、デバイスが計算する画像が 8枚でも 800枚でも、float32 の勾配で 44.7 MB になります。オールリデュースにかかる時間が、2つ目のデバイスが引き受ける分の計算時間を上回ると、2つのデバイスは 1つより遅くなります。デバイスあたりのバッチが小さいとき、モデルが大きいとき、リンクが遅いときです。
#
# 次のワーカーは、6章の ResNet-18 のステップについてこれを測ります。まずランク 0 が 1つのデバイスとして、全体のバッチで（あとで使うために、その半分でも）ステップの時間を単独で測ります。その間、もう一方のランクはバリアで待ちます（gloo で待っているランクはバリアのメッセージが届くまで眠っているので、CPU の時間はほとんど使わないはずです）。次に、両方のランクがバッチを半分ずつ受け持って DDP のステップの時間を測ります。帯域幅の測定で当てはめた `α` と `β` を使えば、勾配のバイト数から通信時間を予測できます。

# %%
# %%worker scaling_workers
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mparlib.ddp_train import make_model
from mparlib.rendezvous import device
from mparlib.timing import measure


def step_time(model, x, y, across=None):
    """Median seconds of an SGD step on (x, y), by mparlib.timing.measure: a warm-up step, then >= 5 steps, >= 50 ms."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    return measure(step, device=x.device if x.is_cuda else None, across=across).median


def slowest(values):
    """The elementwise maximum over the ranks: each DDP step lasts as long as its slowest rank."""
    t = torch.tensor(values, dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def one_vs_many(global_batch):
    rank, k, dev = dist.get_rank(), dist.get_world_size(), device()
    g = torch.Generator().manual_seed(0)  # random images: the time of a step does not depend on the pixels
    x = torch.rand(global_batch, 1, 28, 28, generator=g).to(dev)  # (B, 1, 28, 28)
    y = torch.randint(0, 10, (global_batch,), generator=g).to(dev)  # (B,)
    share = global_batch // k
    alone = alone_share = 0.0
    if rank == 0:  # one device on its own; the other ranks wait at the barrier below
        torch.manual_seed(0)
        net = make_model("resnet18").to(dev)
        alone = step_time(net, x, y)
        alone_share = step_time(net, x[:share], y[:share])
    dist.barrier()
    torch.manual_seed(0)
    model = DDP(make_model("resnet18").to(dev), device_ids=[dev.index] if dev.type == "cuda" else None)
    part = slice(rank * share, (rank + 1) * share)
    together = step_time(model, x[part], y[part], across=slowest)  # every rank stops after the same step
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"alone": alone, "alone_share": alone_share, "together": together, "grad_bytes": grad_bytes,
            "world_size": k, "per_rank_batch": share, "backend": dist.get_backend(),
            "threads": torch.get_num_threads()}

# %% tags=["nbval-ignore-output"]
from scaling_workers import one_vs_many

global_batch = 512 if ON_GPUS else 8
run = launch(one_vs_many, 2, args=(global_batch,), echo=False, timeout=300)
comm = collectives.predict_seconds(fit, run["grad_bytes"])
naive = run["alone"] / 2 + comm
refined = run["alone_share"] + comm
ms = lambda s: f"{s * 1e3:.1f} ms"
speedup = lambda x: tr(f"speed-up {x:.2f}x", f"速度 {x:.2f}倍")
print(tr(f"ResNet-18, global batch {global_batch}, {run['backend']}, {run['threads']} thread(s) per process",
         f"ResNet-18、全体のバッチサイズ {global_batch}、{run['backend']}、プロセスあたり {run['threads']}スレッド"))
print(table([
    [("measured, 1 device, whole batch:", "実測、デバイス 1つ、バッチ全体:"), ms(run["alone"])],
    [("measured, 2 devices (DDP), half each:", "実測、デバイス 2つ（DDP）、半分ずつ:"), ms(run["together"]),
     speedup(run["alone"] / run["together"])],
    [("predicted all-reduce of the gradients:", "予測、勾配のオールリデュース:"), ms(comm)],
    [("model 1: t1(B) / 2 + all-reduce:", "モデル 1: t1(B) / 2 + オールリデュース:"), ms(naive),
     speedup(run["alone"] / naive)],
    [("model 2: t1(B / 2) measured + all-reduce:", "モデル 2: t1(B / 2) の実測 + オールリデュース:"), ms(refined),
     speedup(run["alone"] / refined)]], align="<><"))
per_image = (run["alone"] - run["alone_share"]) / (global_batch - run["per_rank_batch"])  # seconds per example
if per_image > 0:
    # model 2: t1(B/2) + comm > t1(B) = t1(B/2) + per_image * B/2  <=>  B < 2 comm / per_image
    exact = 2 * comm / per_image
    break_even = max(2, 2 * math.ceil(exact / 2))  # a global batch that splits in two: the even number at or above
    if exact < 2:
        print(tr(f"by model 2, the break-even global batch is {exact:.2f}, below 2: 2 devices are faster than 1 at "
                 "every batch that splits in two",
                 f"モデル 2 によれば、損益分岐の全体のバッチサイズは {exact:.2f} で 2 より小さいので、2つに分けられる"
                 "どのバッチでも 2つのデバイスが 1つより速くなります"))
    else:
        print(tr(f"by model 2, 2 devices are slower than 1 below a global batch of {exact:.1f} (as an even batch: "
                 f"{break_even})",
                 f"モデル 2 によれば、全体のバッチサイズが {exact:.1f} 未満では 2つのデバイスが 1つより遅くなります"
                 f"（偶数のバッチサイズでは {break_even}）"))
else:
    print(tr("the step did not get faster with half the batch here, so model 2 gives no break-even batch",
             "ここではバッチを半分にしてもステップが速くならなかったので、モデル 2 から損益分岐のバッチサイズは求まりません"))

# %%
assert run["grad_bytes"] == 4 * 11_175_818 and run["world_size"] == 2
assert run["per_rank_batch"] * 2 == global_batch
assert all(v > 0 and math.isfinite(v) for v in (run["alone"], run["alone_share"], run["together"], comm))

# %% [markdown]
# <!-- en -->
# Compare the measured line with the two predictions; three effects decide how they differ, and the numbers show
# which one wins on this machine.
#
# - **Not all of a step divides by `k`.** Model 1 assumes that half the batch takes half the time. But part of a
#   step does not depend on the batch: the optimizer updates all 11 million parameters, hundreds of operations are
#   launched whatever their size, and small batches use a processor less efficiently. Every rank pays that part in
#   full. Model 2 measures the computation of half a batch instead of assuming it, and so it is usually the closer
#   one. If `t1(B / 2)` is much more than half of `t1(B)`, most of your step is this fixed part, and more devices
#   help little.
# - **Overlap hides communication.** DDP starts the buckets' all-reduces during the backward pass (previous
#   section), so a measurement *below* model 2 means that part of the communication ran at the same time as
#   computation.
# - **The devices share the machine.** CPU processes share the memory bandwidth and the caches, and gloo's threads
#   need CPU time of their own, taken from the computation; anything else running on the machine takes its share
#   too. GPUs share the PCIe or NVLink links and their host. A measurement *above* model 2 means time was lost to
#   something the model does not count; the bandwidth measurement, which sends one tensor at a time and
#   computes nothing, cannot see it.
#
# The last line turns model 2 around. With `t1(b) = c + p b` (a fixed part `c`, `p` seconds per example, measured
# as the difference of the two single-device steps), two devices lose when `t1(B / 2) + comm > t1(B)`, that is
# when `comm > p B / 2`: below the global batch `B = 2 comm / p`. A batch is split in two, so the cell also gives
# the even batch at or above it (`break_even`); when the formula gives less than 2, the second device wins at every
# batch it can share. Each step time is the median of at least 5 steps timed by `mparlib.timing.measure`, but a
# busy machine still moves `p`, so the number changes from run to run. Question 2 of *More questions* puts it to the test. On GPUs the same reasoning explains the
# usual advice: keep the per-device batch large, and the links fast, before adding devices.
# <!-- ja -->
# 実測の行と 2つの予測を比べてください。違いを決めるのは次の 3つの効果で、このマシンでどれが強く効いているかは数値からわかります。
#
# - **ステップのすべてが `k` で割れるわけではありません。** モデル 1 は、バッチが半分なら時間も半分だと仮定しています。しかし、ステップの一部はバッチに依存しません。オプティマイザはおよそ 1,100万個のパラメータをすべて更新し、演算は大きさにかかわらず何百個も起動され、小さなバッチではプロセッサを効率よく使えません。この部分は、どのランクも丸ごと払います。モデル 2 は、半分のバッチの計算時間を仮定せずに実測するので、ふつうはこちらのほうが実測に近くなります。`t1(B / 2)` が `t1(B)` の半分よりずっと長いなら、ステップの大部分はこの固定の部分で、デバイスを増やしてもあまり効果はありません。
# - **重なりが通信を隠します。** DDP は逆伝播の最中にバケットのオールリデュースを始めます（前の節）。実測がモデル 2 を**下回る**なら、通信の一部が計算と同時に進んだということです。
# - **デバイスはマシンを共有しています。** CPU のプロセスはメモリ帯域幅やキャッシュを共有し、gloo のスレッドも CPU の時間を必要とし、その分は計算から差し引かれます。マシンで他に動いているものも、それぞれの取り分を持っていきます。GPU は PCIe や NVLink のリンクとホストを共有します。実測がモデル 2 を**上回る**なら、モデルが数えていない何かに時間をとられたということです。テンソルを 1つずつ送るだけで計算をしない帯域幅の測定には、それは見えません。
#
# 最後の行は、モデル 2 を逆向きに使ったものです。`t1(b) = c + p b`（固定の部分 `c` と、データ 1個あたり `p` 秒。`p` はデバイス 1つでの 2つのステップの時間の差から求めます）とすると、2つのデバイスが負けるのは `t1(B / 2) + comm > t1(B)`、つまり `comm > p B / 2` のとき、全体のバッチサイズが `B = 2 comm / p` より小さいときです。バッチは 2つに分けるので、セルはそれ以上でいちばん近い偶数のバッチサイズ（`break_even`）も表示します。式の値が 2 より小さいときは、分けられるどのバッチでも 2つ目のデバイスが勝ちます。ステップの時間はどれも `mparlib.timing.measure` で 5ステップ以上測った中央値ですが、マシンが混んでいれば `p` はやはり動くので、この数値は実行のたびに変わります。「その他の問い」の 2 でこれを確かめます。GPU でも、同じ考え方からよく聞く助言が導かれます。デバイスを増やす前に、デバイスあたりのバッチを大きく保ち、リンクを速くすることです。

# %% [markdown]
# <!-- en -->
# ## A hang you can diagnose
#
# A collective finishes only when every rank of the group has called it. If one rank never does, the others wait, by
# default for 30 minutes with gloo and 10 with nccl (the process group's timeout), and then fail with a message that
# says only that they waited. If the ranks call collectives with different shapes, the messages do not fit together, and
# the run fails with a confusing error or, worse, mixes up data. Both come from one broken rule:
#
# > **Every rank calls the same collectives, in the same order, with the same shapes and dtypes.**
#
# A rule that breaks easily: a loop that runs a different number of times on different ranks (uneven data, an
# early `break`), a collective under `if rank == 0:`, a tensor whose size depends on the rank. Three tools turn the
# hang into a diagnosis:
#
# - a **timeout**, so that waiting ends: `init_process_group(..., timeout=timedelta(seconds=...))`, which
#   `launch(..., timeout=...)` passes on;
# - `dist.monitored_barrier(timeout=...)` (gloo), a barrier at which rank 0 waits for every other rank by name and
#   reports which ones did not arrive;
# - `TORCH_DISTRIBUTED_DEBUG=DETAIL` in the environment of every process: before each collective the ranks compare
#   what they are about to call (the operation, the shapes, the dtypes) and fail at once, naming the difference.
#
# First the uneven loop: rank 0 has 3 batches and rank 1 has 4 (as with a data set split without padding), each
# step all-reduces, and the epoch ends at a monitored barrier. Rank 1's fourth all-reduce has no partner. The cells
# run the ranks on the CPU with gloo on any machine (`monitored_barrier` is gloo's); the rule is the same with
# nccl, whose messages differ.
# <!-- ja -->
# ## 診断できるハング
#
# 集合通信は、グループのすべてのランクが呼び出したときに初めて終わります。呼び出さないランクが 1つでもあると、他のランクは待ち続けます。既定では gloo で 30分、nccl で 10分（プロセスグループのタイムアウト）待ってから、待ったことしか伝えないメッセージで失敗します。ランクがそれぞれ違う形状のテンソルで集合通信を呼び出すと、メッセージがかみ合わず、わかりにくいエラーで失敗するか、もっと悪い場合はデータが混ざってしまいます。どちらも、1つの規則が破られたことが原因です。
#
# > **すべてのランクが、同じ集合通信を、同じ順序で、同じ形状と dtype で呼び出すこと。**
#
# この規則は簡単に破られます。ランクによって回数の違うループ（データの偏り、途中の `break`）、`if rank == 0:` の中の集合通信、ランクによって大きさが変わるテンソルなどです。ハングを診断に変える道具が 3つあります。
#
# - **タイムアウト**: 待つことに終わりを設けます。`init_process_group(..., timeout=timedelta(seconds=...))` で指定し、`launch(..., timeout=...)` はこれを渡します。
# - `dist.monitored_barrier(timeout=...)`（gloo）: ランク 0 が他のすべてのランクを 1つずつ名前で待ち、来なかったランクを報告するバリアです。
# - すべてのプロセスの環境変数 `TORCH_DISTRIBUTED_DEBUG=DETAIL`: 集合通信の前に、これから呼び出すもの（操作、形状、dtype）をランクどうしで照らし合わせ、違いがあればそれを名指ししてすぐに失敗します。
#
# まずはランクによって回数の違うループです。ランク 0 にはバッチが 3つ、ランク 1 には 4つあり（データセットを補わずに分けたときのように）、各ステップでオールリデュースを行い、エポックの終わりに `monitored_barrier` で待ち合わせます。ランク 1 の 4回目のオールリデュースには相手がいません。どのマシンでも、これらのセルはランクを CPU 上の gloo で動かします（`monitored_barrier` は gloo の機能です）。規則は nccl でも同じで、メッセージが違うだけです。

# %%
# %%worker hang_workers
from datetime import timedelta

import torch
import torch.distributed as dist


def uneven_epoch(steps_of, wait_s):
    """Rank r runs steps_of[r] steps, each with an all-reduce, then meets the others at a monitored barrier."""
    rank = dist.get_rank()
    for step in range(steps_of[rank]):
        dist.all_reduce(torch.ones(4))  # stands for DDP's gradient all-reduce
    print(f"rank {rank}: {steps_of[rank]} steps done", flush=True)
    dist.monitored_barrier(timeout=timedelta(seconds=wait_s))  # rank 0 names the ranks that do not come


def mismatched_shapes():
    """Rank 0 all-reduces 4 numbers, rank 1 only 3 (say, a layer whose size was computed from the rank)."""
    dist.all_reduce(torch.ones(4 if dist.get_rank() == 0 else 3))

# %%
from hang_workers import mismatched_shapes, uneven_epoch


def diagnosis(log_dir, nproc):
    """The last error line in each rank's log, without C++ file names, ports and long tensor descriptions."""
    lines = []
    for r in range(nproc):
        log = (Path(log_dir) / f"rank{r}.log").read_text(encoding="utf-8", errors="replace").splitlines()
        errors = [line for line in log if re.match(r"^([\w.]*(Error|Exception)): ", line)]
        text = errors[-1] if errors else tr("(no error: stopped by the launcher)", "（エラーなし: 起動側が停止しました）")
        text = re.sub(r"\[/[^\]]*\]\s*", "", text)  # where in PyTorch's C++ sources the message was raised
        text = re.sub(r"\[?127\.0\.0\.1\]?:\d+", "127.0.0.1", text)
        text = re.sub(r", TensorDeviceTypes=TensorOptions\((?:[^()]|\([^()]*\))*\)", "", text)
        lines.append(f"{tr('rank', 'ランク')} {r}: {text}")
        print(textwrap.fill(lines[-1], 110, subsequent_indent="    "))
    return lines


def hang(worker, args=(), timeout=20):
    """Run a worker that is expected to fail; return the diagnosis lines and the seconds until it ended."""
    with tempfile.TemporaryDirectory(prefix="mparlib-08-") as logs:
        start = time.monotonic()
        try:
            launch(worker, 2, args=args, backend="gloo", timeout=timeout, log_dir=logs, echo=False)
            failed = False
        except WorkerFailed:
            failed = True
        seconds = time.monotonic() - start
        return failed, diagnosis(logs, 2), seconds

# %% tags=["nbval-ignore-output"]
failed, uneven, seconds = hang(uneven_epoch, args=([3, 4], 5))
print(tr(f"ended after {seconds:.0f} s", f"{seconds:.0f}秒後に終了"))

# %%
assert failed and seconds < 60
assert "Rank 1 failed to pass monitoredBarrier" in uneven[0]

# %% [markdown]
# <!-- en -->
# Rank 0 reached the barrier after 3 steps and waited 5 seconds for rank 1, then named it: rank 1 failed to pass
# the barrier, because it is still inside its fourth all-reduce. Rank 1 learns of the trouble only when rank 0
# gives up (its partner closes the connection). In a real training the barrier goes at the end of the epoch, or
# before evaluation, and the names it prints tell you where to look. The fix is the rule: the `DistributedSampler`
# of chapter 6 pads the data so that every rank runs the same number of steps (or `drop_last=True` drops the
# remainder), and DDP's `model.join()` context manager lets ranks with fewer batches shadow the others'
# all-reduces when uneven data cannot be avoided.
#
# Now the mismatched shapes, with `TORCH_DISTRIBUTED_DEBUG=DETAIL`. The variable must be in the environment of the
# processes when they join the group, so the cell sets it in the notebook's environment, which the new processes
# inherit, and restores it afterwards.
# <!-- ja -->
# ランク 0 は 3ステップのあとバリアに着き、ランク 1 を 5秒待ってから、その名前を挙げました。ランク 1 はバリアを通過できませんでした。まだ 4回目のオールリデュースの中にいるからです。ランク 1 が異常を知るのは、ランク 0 があきらめて接続を閉じたときです。実際の訓練では、このバリアをエポックの終わりや評価の前に置きます。表示された名前が、どこを調べればよいかを教えてくれます。直し方は規則のとおりです。6章の `DistributedSampler` はデータを補って、どのランクも同じ回数だけステップを進めるようにします（`drop_last=True` なら余りを捨てます）。データの偏りが避けられないときは、DDP の `model.join()` コンテキストマネージャを使うと、バッチの少ないランクが、他のランクのオールリデュースの相手を務めます。
#
# 次は形状の合わないテンソルです。今度は `TORCH_DISTRIBUTED_DEBUG=DETAIL` を使います。この変数は、プロセスがグループに参加する時点でそのプロセスの環境になければなりません。そこで、次のセルはノートブックの環境に設定し（新しいプロセスはそれを受け継ぎます）、終わったら元に戻します。

# %% tags=["nbval-ignore-output"]
previous = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
try:
    failed, mismatch, seconds = hang(mismatched_shapes)
finally:
    if previous is None:
        del os.environ["TORCH_DISTRIBUTED_DEBUG"]
    else:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = previous
print(tr(f"ended after {seconds:.0f} s", f"{seconds:.0f}秒後に終了"))

# %%
assert failed and seconds < 60
assert any("Detected mismatch between collectives" in line and "TensorShape=[4]" in line for line in mismatch)

# %% [markdown]
# <!-- en -->
# Each rank names both sides: which collective it runs with which shape (`TensorShape=[4]` against `[3]`), and what
# the other rank runs. `DETAIL` costs an extra exchange before every collective, so switch it on to find a bug,
# not for every training run. Without it, gloo has no way to know what the other side meant: the ranks receive
# messages of unexpected sizes, and what happens then depends on the backend and the sizes (question 4 of *More questions*).
#
# The checklist for a hanging run: set a timeout you can afford to wait; put a `monitored_barrier` where all ranks
# should meet; rerun with `TORCH_DISTRIBUTED_DEBUG=DETAIL`; and read every rank's log, not only rank 0's
# (`launch(..., log_dir=...)` keeps them).
# <!-- ja -->
# どちらのランクも両方の側を名指ししています。自分がどの集合通信をどの形状で実行しているか（`TensorShape=[4]` と `[3]`）と、相手のランクが何を実行しているかです。`DETAIL` は集合通信のたびに追加のやり取りをするので、バグを探すときにだけ有効にし、ふだんの訓練では使わないでください。これがないと、gloo には相手が何をするつもりだったのかを知る方法がありません。各ランクは思いがけない大きさのメッセージを受け取り、そのあとどうなるかはバックエンドと大きさによって変わります（「その他の問い」の 4）。
#
# 訓練がハングしたときの確認事項は次のとおりです。待ってもよい長さのタイムアウトを設定すること、すべてのランクがそろうべき場所に `monitored_barrier` を置くこと、`TORCH_DISTRIBUTED_DEBUG=DETAIL` を付けて実行し直すこと、そしてランク 0 だけでなくすべてのランクのログを読むことです（`launch(..., log_dir=...)` でログを残せます）。

# %% [markdown]
# <!-- en -->
# ## Summary
#
# - Point-to-point messages (`send`/`recv`, `isend`/`irecv`) connect two ranks; collectives (`broadcast`,
#   `reduce`, `all_reduce`, `reduce_scatter`, `all_gather`, `all_to_all`) are called by every rank of a group. An
#   all-reduce is a reduce-scatter followed by an all-gather, literally so for the ring: `ring_reduce_scatter`
#   leaves chunk `r` summed on rank `r`, the layout of `dist.reduce_scatter_tensor`, and `ring_all_gather` completes
#   the sum.
# - The ring all-reduce needs `2(k-1)` steps of `n / k` elements each; every rank sends about twice the tensor,
#   whatever the number of ranks. `mparlib.collectives.ring_all_reduce`, built from sends and receives alone, equals
#   `dist.all_reduce` exactly on integers and to rounding on reals.
# - A message costs `α + n β`; bus bandwidth (`n / t · 2(k-1)/k`) compares all-reduces across world sizes. Small
#   messages pay latency, large ones bandwidth. A time is the median of repeated calls (`mparlib.timing.measure`:
#   at least 50 ms and 5 calls), shown with its spread and the load average it was measured under; on a busy
#   machine the fit can miss by far more than its 25% goal, and the chapter's stored run did.
# - DDP all-reduces the gradients in buckets (`bucket_cap_mb`) that can start during the backward pass (by default the
#   first bucket is small, so that they do; one bucket for the whole model overlaps nothing); a communication hook
#   decides what is sent (bfloat16: half the bytes, gradients within bfloat16's rounding); `no_sync()`
#   accumulates micro-batches with one all-reduce per optimizer step and the same update.
# - A step on `k` devices costs about the computation of `B / k` examples plus an all-reduce of the model's
#   gradients; when the all-reduce costs more than the computation saved, more devices are slower.
# - Every rank must call the same collectives in the same order with the same shapes. Timeouts, `monitored_barrier`
#   and `TORCH_DISTRIBUTED_DEBUG=DETAIL` turn a hang into a message that names the rank and the difference.
# <!-- ja -->
# ## まとめ
#
# - 1対1通信（`send`/`recv`、`isend`/`irecv`）は 2つのランクをつなぎます。集合通信（`broadcast`、`reduce`、`all_reduce`、`reduce_scatter`、`all_gather`、`all_to_all`）はグループのすべてのランクが呼び出します。オールリデュースは、リデュース・スキャッターのあとにオールギャザーを続けたものです。リングではこれが文字どおり成り立ちます。`ring_reduce_scatter` はランク `r` にチャンク `r` の和を残し（`dist.reduce_scatter_tensor` と同じ配置）、`ring_all_gather` が和を完成させます。
# - リング・オールリデュースは、`n / k` 要素ずつのステップを `2(k-1)` 回行います。各ランクが送る量は、ランクの数によらずテンソルのおよそ 2倍です。送信と受信だけで作った `mparlib.collectives.ring_all_reduce` は、整数では `dist.all_reduce` と正確に一致し、実数では丸め誤差の範囲で一致します。
# - メッセージにかかる時間は `α + n β` です。バス帯域幅（`n / t · 2(k-1)/k`）を使えば、ワールドサイズの違うオールリデュースどうしを比べられます。小さなメッセージはレイテンシで、大きなメッセージは帯域幅で時間が決まります。時間は繰り返した呼び出しの中央値（`mparlib.timing.measure`。合計 50 ms 以上かつ 5回以上）で、ばらつきと、測ったときのロードアベレージを添えて示します。混んだマシンでは当てはめの誤差が目標の 25% を大きく超えることがあり、この章の保存された実行でもそうなりました。
# - DDP は勾配をバケット（`bucket_cap_mb`）ごとにオールリデュースし、それは逆伝播の最中に始められます（既定では最初のバケットが小さいので、実際に始まります。モデル全体が 1つのバケットに入ると何も重なりません）。通信フックで送るものを決められます（bfloat16 ならバイト数は半分で、勾配の違いは bfloat16 の丸め誤差の範囲です）。`no_sync()` を使うと、マイクロバッチの勾配を累積して、パラメータの更新 1回につきオールリデュース 1回で、同じ更新を行えます。
# - `k` 個のデバイスでの 1ステップには、おおよそ `B / k` 個のデータの計算と、モデルの勾配のオールリデュースの時間がかかります。オールリデュースが、節約できる計算時間より長くかかるなら、デバイスを増やすと遅くなります。
# - すべてのランクが、同じ集合通信を、同じ順序で、同じ形状で呼び出さなければなりません。タイムアウト、`monitored_barrier`、`TORCH_DISTRIBUTED_DEBUG=DETAIL` を使えば、ハングを、ランクと違いを名指しするメッセージに変えられます。

# %% [markdown]
# <!-- en -->
# ## Exercises
#
# Each exercise has a **starter** cell whose function body is `raise NotImplementedError`: replace that line with your
# code, run the cell, then run the check cell below it. The starters of the two distributed exercises are `%%worker`
# cells: their checks start 2 and then 3 fresh processes that import your function. The check says *not attempted*, *wrong* (the
# first difference and one hint for the likely mistake), *error* (your exception, or your code ending its process),
# *right*, *cannot run here* or *the check itself failed* (never a verdict on your answer); it never prints the
# answer. A one-process exercise runs your function in a fresh worker process and stops it after 30 s; a distributed
# check stops a collective that waits for a partner that never comes after 20 s, naming the waiting rank, and the
# whole check after 240 s. `hint("08.1")` prints the next hint level each time you call it and says when none is left;
# `hint("08.1", 2)` prints a given level.
# <!-- ja -->
# ## 練習問題
#
# 各練習問題には、本体が `raise NotImplementedError` だけの関数を含む**スターター**のセルがあります。その行を自分のコードに置き換えてセルを実行し、すぐ下のチェックのセルを実行してください。分散実行する 2問のスターターは `%%worker` のセルです。そのチェックは新しいプロセスを 2個、次に 3個起動してそこで関数をインポートします。チェックの結果は「未着手」、「不正解」（最初の違いと、ありがちな間違いに合わせたヒント 1つ）、「エラー」（発生した例外、またはコードがプロセスを終了させたこと）、「正解」、「この環境では実行できません」、「チェック自体の不具合」（あなたの答えの判定ではありません）のどれかで、答えそのものは表示しません。1つのプロセスの練習問題では関数を新しいワーカープロセスで実行し、30秒で止めます。分散のチェックでは、来ない相手を待ち続ける集合通信を 20秒で止めて待っていたランクを示し、チェック全体を 240秒で止めます。`hint("08.1")` は呼ぶたびに次の段階のヒントを表示し、もう残っていなければそう伝えます。`hint("08.1", 2)` は指定した段階のヒントを表示します。

# %%
from mparlib.exercises import check, hint

# %% [markdown]
# <!-- en -->
# ### Exercise 08.1: An all-gather from sends and receives
#
# Write `all_gather_by_sends(tensor, sizes)`, called on every rank with that rank's 1-D `tensor`: it returns the
# list of every rank's tensor in rank order, as `dist.all_gather` would, using only point-to-point messages.
# Rank `r`'s tensor has `sizes[r]` elements, and the sizes differ: the check uses 2 ranks with 4 and 1
# elements, then 3 ranks with 2, 5 and 3.
# <!-- ja -->
# ### 練習問題 08.1: 送信と受信で作るオールギャザー
#
# 各ランクが自分の 1次元の `tensor` を渡して呼ぶ `all_gather_by_sends(tensor, sizes)` を書いてください。`dist.all_gather` と同じく全ランクのテンソルをランクの順に並べたリストを返しますが、使うのは 1対1通信だけです。ランク `r` のテンソルの要素数は `sizes[r]` で、大きさはランクごとに違います。チェックでは 2個のランクがそれぞれ 4個、1個の要素を、続いて 3個のランクがそれぞれ 2個、5個、3個の要素を持ちます。

# %%
# %%worker ex08_gather
# Exercise 08.1: starter
import torch
import torch.distributed as dist


def all_gather_by_sends(tensor, sizes):
    """Every rank's tensor, in rank order, from sends and receives alone."""
    raise NotImplementedError("08.1")

# %%
from ex08_gather import all_gather_by_sends

check("08.1", all_gather_by_sends)

# %% [markdown]
# <!-- en -->
# ### Exercise 08.2: The ring's reduce-scatter
#
# Write `ring_reduce_scatter(tensor)`, the first phase of the ring all-reduce on its own: called on every rank with
# tensors of one shape, it returns on rank `r` chunk `r` of the flattened tensor (`chunk_bounds(n, k)[r]`),
# summed over all ranks, as `dist.reduce_scatter` leaves it. Only point-to-point messages, to the neighbours in
# the ring. The check runs 2 ranks with 7 elements, then 1, and 3 ranks with 10, then 2 (so a chunk is empty).
# <!-- ja -->
# ### 練習問題 08.2: リングのリデュース・スキャッター
#
# リング・オールリデュースの前半だけを取り出した `ring_reduce_scatter(tensor)` を書いてください。すべてのランクが同じ形状のテンソルを渡して呼び、ランク `r` には、フラットにしたテンソルのチャンク `r`（`chunk_bounds(n, k)[r]`）を全ランクで合計したものを返します。`dist.reduce_scatter` が残すものと同じです。使うのは、リングで隣り合うランクとの 1対1通信だけです。チェックは 2個のランクで要素 7個と 1個、3個のランクで要素 10個と 2個（どちらも最後はチャンクの 1つが空になります）で実行します。

# %%
# %%worker ex08_ring
# Exercise 08.2: starter
import torch
import torch.distributed as dist

from mparlib.collectives import chunk_bounds


def ring_reduce_scatter(tensor):
    """Chunk `rank` of the flattened tensor, summed over the ranks, around the ring."""
    raise NotImplementedError("08.2")

# %%
from ex08_ring import ring_reduce_scatter

check("08.2", ring_reduce_scatter)

# %% [markdown]
# <!-- en -->
# ### Exercise 08.3: The ring's time in the alpha-beta model
#
# Write `ring_all_reduce_seconds(nbytes, k, alpha, beta)`: the time the alpha-beta model predicts for a ring
# all-reduce of `nbytes` bytes on `k` ranks, with latency `alpha` seconds and `beta` seconds per byte per link.
# The check compares at random points.
# <!-- ja -->
# ### 練習問題 08.3: α-β モデルでのリングの時間
#
# レイテンシが `alpha` 秒、リンク 1本で 1バイトあたり `beta` 秒のとき、`k` 個のランクで `nbytes` バイトをリング・オールリデュースする時間を α-β モデルで予測して返す `ring_all_reduce_seconds(nbytes, k, alpha, beta)` を書いてください。チェックはランダムな点で比べます。

# %%
# Exercise 08.3: starter
def ring_all_reduce_seconds(nbytes, k, alpha, beta):
    """Predicted seconds of a ring all-reduce of `nbytes` bytes on `k` ranks."""
    raise NotImplementedError("08.3")


# %%
check("08.3", ring_all_reduce_seconds)

# %% [markdown]
# <!-- en -->
# ### Exercise 08.4: DDP's gradient buckets
#
# Write `bucket_assignment(grad_bytes, cap_bytes, first_cap_bytes=None)`: DDP's buckets for gradients of
# `grad_bytes[i]` bytes, listed in the order they become ready in the backward pass, as a list of buckets, each a
# list of indices into `grad_bytes`. `cap_bytes` is the cap of a bucket; `first_cap_bytes`, when given, that of the
# first bucket only. The check compares with the assignment DDP itself computes, on random sizes.
# <!-- ja -->
# ### 練習問題 08.4: DDP の勾配のバケット
#
# 逆伝播でできあがる順に並べた勾配の大きさ `grad_bytes[i]`（バイト）に対して、DDP が作るバケットを返す `bucket_assignment(grad_bytes, cap_bytes, first_cap_bytes=None)` を書いてください。戻り値はバケットのリストで、各バケットは `grad_bytes` のインデックスのリストです。`cap_bytes` はバケットの上限、`first_cap_bytes` は与えられたときの最初のバケットだけの上限です。チェックはランダムな大きさで、DDP 自身が計算する割り当てと比べます。

# %%
# Exercise 08.4: starter
def bucket_assignment(grad_bytes, cap_bytes, first_cap_bytes=None):
    """DDP's buckets (lists of indices) for gradients of `grad_bytes` bytes, in ready order."""
    raise NotImplementedError("08.4")


# %%
check("08.4", bucket_assignment)

# %% [markdown]
# <!-- en -->
# ### More questions
#
# 1. Run the tour on 3 processes, `launch(tour, 3)`, after predicting what `all_to_all_single` and
#    `reduce_scatter_tensor` will print (the last assert of the ring cell counts 4 ranks; leave it out).
# 2. Rerun `one_vs_many` with the break-even global batch that the scaling cell printed, and with half and twice
#    that batch (an even number). Are 2 processes slower than 1 where the model says they are?
# 3. Write a worker that trains `stack()` from the `ddp_inside` cell for 100 steps on a fixed random batch, once with
#    `model.register_comm_hook(None, default_hooks.bf16_compress_hook)` and once without, and return the losses.
#    Do the two curves differ?
# 4. Run `hang(mismatched_shapes)` without `TORCH_DISTRIBUTED_DEBUG`. How does the run end now, how long does it
#    take, and what do the two ranks' lines say? Then make `uneven_epoch` correct by making every rank run the
#    smallest number of steps: `n = torch.tensor([steps_of[rank]]); dist.all_reduce(n, op=dist.ReduceOp.MIN)`,
#    then loop over `range(n.item())`.
# 5. Count the buckets of DDP's real default: `from ddp_inside import bucket_timeline`, then
#    `launch(bucket_timeline, 2, args=(None,), backend="gloo")` (`bucket_cap_mb=None` is what DDP gets when nothing is
#    passed). How many buckets are there, and does the first all-reduce start before the last gradient is ready?
# <!-- ja -->
# ### その他の問い
#
# 1. `all_to_all_single` と `reduce_scatter_tensor` が何を表示するかを予想してから、`tour` を 3個のプロセスで実行してください（`launch(tour, 3)`。リングのセルの最後の assert は 4個のランクを前提にしているので、外してください）。
# 2. スケーリングのセルが表示した損益分岐の全体のバッチサイズと、その半分と 2倍（偶数にしてください）で、`one_vs_many` を実行し直してください。モデルが予測したところで、2個のプロセスは 1個より遅くなるでしょうか。
# 3. `ddp_inside` のセルの `stack()` を、固定したランダムなバッチで 100ステップ訓練して損失を返すワーカーを書いてください。`model.register_comm_hook(None, default_hooks.bf16_compress_hook)` を付けた場合と付けない場合で実行し、2つの曲線に違いがあるかを調べてください。
# 4. `TORCH_DISTRIBUTED_DEBUG` を設定せずに `hang(mismatched_shapes)` を実行してください。実行はどのように終わり、どれだけ時間がかかり、2つのランクの行には何と表示されるでしょうか。次に、すべてのランクがいちばん少ないステップ数だけ進むようにして、`uneven_epoch` を正しく直してください。`n = torch.tensor([steps_of[rank]]); dist.all_reduce(n, op=dist.ReduceOp.MIN)` のあとで、`range(n.item())` についてループします。
# 5. DDP の実際の既定の動作でバケットを数えてください。`from ddp_inside import bucket_timeline` のあとで `launch(bucket_timeline, 2, args=(None,), backend="gloo")` を実行します（`bucket_cap_mb=None` は、何も渡さないときの DDP の値です）。バケットはいくつになり、最初のオールリデュースは最後の勾配が完成する前に始まるでしょうか。
