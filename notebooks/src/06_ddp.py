# %% [markdown]
# <!-- en -->
# # 6. DistributedDataParallel
#
# Chapters 1 to 5 used `nn.DataParallel`: one Python process drives all GPUs, with one thread per GPU. PyTorch's
# documentation recommends `torch.nn.parallel.DistributedDataParallel` (DDP) instead, even on a single machine.
# DDP runs **one process per device**; the processes train their own copies of the model on their own part of the
# data and agree on the gradients by communicating. It is also the tool that takes the same program from one
# machine to many.
#
# DDP does not need a GPU: with the `gloo` backend the processes run on the CPU, so everything in this chapter
# runs on a laptop. In this chapter you will
#
# - see what changes from `DataParallel`: processes instead of threads, gradients averaged by all-reduce during
#   the backward pass, a sampler that gives each process its own data, and the global batch size,
# - check that two processes working on two halves of a batch compute exactly what one process computes on the
#   whole batch,
# - train the chapter-5 ResNet-18 with 2 processes, kill one of them on purpose, and resume from the checkpoint,
# - compare `DataParallel` and DDP on your machine, and learn the commands for two machines.
# <!-- ja -->
# # 6. DistributedDataParallel
#
# 1章から 5章では `nn.DataParallel` を使いました。1個の Python プロセスが GPU ごとに 1つのスレッドを立てて、すべての GPU を動かす方式です。PyTorch のドキュメントは、マシンが 1台だけの場合でも、代わりに `torch.nn.parallel.DistributedDataParallel`（DDP）を使うよう勧めています。DDP は**デバイスごとに 1個のプロセス**を動かします。各プロセスは自分のモデルのコピーを自分の担当データで訓練し、通信によって勾配をそろえます。同じプログラムを 1台のマシンから複数台のマシンへ広げるときにも、この DDP を使います。
#
# DDP に GPU は必須ではありません。バックエンドに `gloo` を使えばプロセスは CPU 上で動くので、この章の内容はすべてノート PC で実行できます。この章では次のことを学びます。
#
# - `DataParallel` から何が変わるのかを確かめます。スレッドではなくプロセスを使うこと、勾配が逆伝播の最中にオールリデュース（all-reduce）で平均されること、サンプラーが各プロセスに専用のデータを配ること、そして全体のバッチサイズです。
# - 2個のプロセスがミニバッチを半分ずつ計算した結果が、1個のプロセスでミニバッチ全体を計算した結果と一致することを確かめます。
# - 5章の ResNet-18 を 2個のプロセスで訓練し、途中でわざとプロセスを落としてから、チェックポイントから再開します。
# - 手元のマシンで `DataParallel` と DDP を比べ、2台のマシンで訓練するためのコマンドを学びます。

# %% tags=["nbval-ignore-output"]
import dataclasses
import math
import tempfile
from pathlib import Path

import torch
from IPython.display import Image, Markdown, display
from torch.utils.data import DistributedSampler

import mparlib
from mparlib import ddp_train, diagrams, throughput
from mparlib.data import to_float
from mparlib.errors import WorkerFailed
from mparlib.lang import tr
from mparlib.launch import launch
from mparlib.rendezvous import choose_backend, describe, process_group
from mparlib.plot import figure_png

# %load_ext mparlib.launch

print(mparlib.report())
print(mparlib.profile_line())
PROFILE = mparlib.profile()

# %% [markdown]
# <!-- en -->
# The table describes your machine, so it differs from the one stored here. The `smoke` profile trains chapter
# 5's narrow ResNet-18 on 9,000 images with 2 CPU processes, so that the chapter finishes in about a minute; the
# `full` profile runs the real chapter-5 experiment on all GPUs.
# <!-- ja -->
# 上の表はお使いのマシンの情報なので、ここに保存されている出力とは異なります。`smoke` プロファイルでは、5章の細い ResNet-18 を 2個の CPU プロセスで 9,000枚の画像について訓練し、この章が 1分ほどで終わるようにしています。`full` プロファイルでは、5章の実験を本来の規模ですべての GPU を使って実行します。

# %% [markdown]
# <!-- en -->
# ## What changes from DataParallel
#
# | | `nn.DataParallel` (chapters 1-5) | `DistributedDataParallel` |
# |---|---|---|
# | workers | 1 process, 1 thread per GPU, all sharing one Python interpreter and its GIL | 1 process per device, each with its own interpreter |
# | copies of the model | copied from GPU 0 to the other GPUs at **every** forward pass | each process builds its own; DDP broadcasts rank 0's parameters **once**, when it wraps the model |
# | input data | one batch loaded by the process, split (scatter) from GPU 0 | each process loads only its own share, chosen by a `DistributedSampler` |
# | outputs and loss | collected (gather) on GPU 0, loss computed there | each process computes the loss of its own share |
# | gradients | summed on GPU 0 | averaged over all processes by all-reduce, bucket by bucket, **during** the backward pass |
# | optimizer step | once, on GPU 0 | in every process, on the same averaged gradients, so the copies stay identical |
# | where it runs | the GPUs of one machine | CPUs (`gloo`) or GPUs (`nccl`), on one machine or many |
#
# The figure shows the two layouts and, below them, the overlap that makes DDP fast: the backward pass produces
# gradients from the last layer to the first, DDP groups them into **buckets**, and the all-reduce of a bucket
# starts as soon as all its gradients exist, while the backward pass keeps computing the earlier layers.
# <!-- ja -->
# ## DataParallel から変わること
#
# | | `nn.DataParallel`（1章から 5章） | `DistributedDataParallel` |
# |---|---|---|
# | 計算の担い手 | 1個のプロセスと GPU ごとのスレッド。すべてのスレッドが 1つの Python インタプリタと GIL を共有 | デバイスごとに 1個のプロセス。それぞれが専用のインタプリタを持つ |
# | モデルのコピー | 順伝播のたびに GPU 0 から他の GPU へ複製する | 各プロセスが自分で作る。DDP はモデルをラップするときに 1回だけ、ランク 0 のパラメータをブロードキャストする |
# | 入力データ | 1個のプロセスがミニバッチを読み込み、GPU 0 から分配（scatter）する | 各プロセスが `DistributedSampler` の決めた自分の担当分だけを読み込む |
# | 出力と損失 | GPU 0 に集約（gather）し、そこで損失を計算する | 各プロセスが自分の担当分の損失を計算する |
# | 勾配 | GPU 0 で合計する | 逆伝播の**最中に**、バケットごとのオールリデュースで全プロセスの平均をとる |
# | パラメータの更新 | GPU 0 で 1回 | 各プロセスが同じ平均勾配で更新するので、コピーは常に一致する |
# | 動く場所 | 1台のマシンの GPU | CPU（`gloo`）または GPU（`nccl`）。マシンは 1台でも複数台でもよい |
#
# 下の図は 2つの構成と、DDP を速くしている重なりを示しています。逆伝播は最後の層から最初の層へ向かって勾配を作ります。DDP は勾配を**バケット**にまとめ、バケット内の勾配がそろった時点でそのオールリデュースを始めます。その間も逆伝播は手前の層の計算を続けます。

# %%
display(Image(figure_png(diagrams.ddp_overview())))

# %% [markdown]
# <!-- en -->
# Three words name the processes. The **world size** is the number of processes; each has a **rank** from 0 to
# world size - 1; on a machine with several processes, the **local rank** numbers them on that machine and picks
# the GPU (`cuda:<local rank>`). Together the processes form a **process group**, and the **backend** carries
# their messages: `nccl` between GPUs, `gloo` between CPU processes. `mparlib.rendezvous.choose_backend("auto", n)` takes `nccl`
# when there is a GPU for each of the `n` processes and `gloo` otherwise.
#
# Before they can talk, the processes must find each other: the **rendezvous**. Each process reads its rank and
# the world size from the environment variables `RANK` and `WORLD_SIZE`, and meets the others at
# `MASTER_ADDR:MASTER_PORT`, where rank 0 listens. The program `torchrun` sets these variables for every process
# it starts. A process started without them does not know who it is, and `mparlib.rendezvous.process_group()` says so:
# <!-- ja -->
# プロセスを区別するための用語が 3つあります。**ワールドサイズ**はプロセスの総数です。各プロセスは 0 からワールドサイズ - 1 までの**ランク**を持ちます。1台のマシンで複数のプロセスを動かすときは、そのマシンの中での番号である**ローカルランク**で使う GPU（`cuda:<ローカルランク>`）を決めます。プロセス全体で**プロセスグループ**を作り、プロセス間のメッセージは**バックエンド**が運びます。GPU 間なら `nccl`、CPU のプロセス間なら `gloo` です。`mparlib.rendezvous.choose_backend("auto", n)` は `n` 個のプロセスそれぞれに GPU があれば `nccl` を、なければ `gloo` を選びます。
#
# 通信を始める前に、プロセスどうしが互いを見つける必要があります。これを**ランデブー**と呼びます。各プロセスは環境変数 `RANK` と `WORLD_SIZE` から自分のランクとワールドサイズを読み、ランク 0 が待ち受ける `MASTER_ADDR:MASTER_PORT` で他のプロセスと落ち合います。`torchrun` は起動するすべてのプロセスにこれらの変数を設定します。変数なしで起動したプロセスは自分が誰なのかわからないので、`mparlib.rendezvous.process_group()` はそのことをエラーで伝えます。

# %%
print(choose_backend("auto", 2) == ("nccl" if mparlib.num_gpus() >= 2 else "gloo"))

# %% tags=["raises-exception"]
with process_group():
    pass

# %% [markdown]
# <!-- en -->
# ## The sampler: each process its own share, a new order every epoch
#
# With DataParallel one process loads each mini-batch. With DDP each process loads its own share, and a
# `DistributedSampler` decides which one: all processes draw the **same** random order of the data set (from the
# same seed), and rank `r` of `W` keeps positions `r, r + W, r + 2W, ...` of it. The shares never overlap, so
# one epoch still visits every example once.
#
# The order is drawn from `seed + epoch`. Call `sampler.set_epoch(epoch)` at the start of every epoch; without
# it, every epoch repeats the order of the first. Here 10 examples are shared by 2 processes:
# <!-- ja -->
# ## サンプラー: 各プロセスに専用の担当分、エポックごとに新しい順序
#
# DataParallel では 1個のプロセスがミニバッチを読み込みました。DDP では各プロセスが自分の担当分を読み込み、どれを担当するかは `DistributedSampler` が決めます。すべてのプロセスは同じシードからデータセットの**同じ**ランダムな順序を作り、`W` 個中のランク `r` はその順序の `r, r + W, r + 2W, ...` 番目を受け持ちます。担当分は重ならないので、1エポックで各データをちょうど 1回ずつ使います。
#
# 順序は `seed + epoch` から作られます。各エポックの始めに `sampler.set_epoch(epoch)` を呼んでください。呼ばないと、どのエポックも最初のエポックと同じ順序になります。次の例では 10個のデータを 2個のプロセスで分け合います。

# %%
data = list(range(10))
samplers = [DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=0) for r in range(2)]
for epoch in range(2):
    for s in samplers:
        s.set_epoch(epoch)
    shares = {tr(f"rank {r}", f"ランク {r}"): list(s) for r, s in enumerate(samplers)}
    print(tr(f"epoch {epoch}:", f"エポック {epoch}:"), shares)

forgetful = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0)
print(tr("without set_epoch, rank 0:", "set_epoch なし、ランク 0:"), [list(forgetful) for epoch in range(2)])

# %% [markdown]
# <!-- en -->
# When the data set does not divide evenly, the sampler pads it by repeating the first examples, so that every
# process runs the same number of steps (a process that stopped early would leave the others waiting in the
# all-reduce). With 10 examples and 3 processes each gets 4, and two examples are used twice:
# <!-- ja -->
# データセットがプロセス数で割り切れないとき、サンプラーは先頭のデータを繰り返して数を補います。どのプロセスも同じ回数だけステップを進めるためです（先に終わったプロセスがあると、残りのプロセスはオールリデュースで待ち続けてしまいます）。10個のデータを 3個のプロセスで分けると、各プロセスが 4個ずつ受け持ち、2個のデータが 2回使われます。

# %%
shares = [list(DistributedSampler(data, num_replicas=3, rank=r, shuffle=False)) for r in range(3)]
print(shares)

# %% [markdown]
# <!-- en -->
# Each process takes `batch_size // world_size` examples per step, so the **global batch size**, the number of
# examples that one optimizer step averages over, is the per-process batch times the world size. `mparlib.ddp`
# takes the global batch size as its setting and splits it, so that a run with 2 processes and a global batch
# of 256 computes the same steps as one process with a batch of 256 (checked below). If you instead keep the
# per-process batch fixed and add processes, the global batch grows, and the learning rate usually grows with it
# (the linear scaling rule, as chapter 5 did with batch 512 and learning rate 0.2 on 2 GPUs).
# <!-- ja -->
# 各プロセスは 1ステップで `batch_size // world_size` 個のデータを使います。したがって**全体のバッチサイズ**（1回のパラメータ更新で平均をとるデータの数）は、デバイスあたりのバッチサイズとワールドサイズの積です。`mparlib.ddp` は全体のバッチサイズを設定として受け取ってプロセスに割り振ります。そのため、2個のプロセスで全体のバッチサイズ 256 の訓練は、1個のプロセスでバッチサイズ 256 の訓練と同じステップを計算します（このあと確かめます）。逆に、デバイスあたりのバッチサイズを固定したままプロセスを増やすと全体のバッチサイズが大きくなり、ふつうは学習率もそれに合わせて大きくします（線形スケーリング則。5章では GPU 2枚でバッチサイズ 512、学習率 0.2 にしました）。

# %% [markdown]
# <!-- en -->
# ## A DDP training script
#
# Every process runs the same program. Stripped to its bones, one process of a DDP training looks like this:
#
# ```python
# dist.init_process_group("gloo")                  # or "nccl"; reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
# rank, world = dist.get_rank(), dist.get_world_size()
# sampler = DistributedSampler(train_set, seed=0)  # this rank's share of a shuffle common to all ranks
# loader = DataLoader(train_set, batch_size=global_batch // world, sampler=sampler)
# model = DDP(net)                                 # on GPUs: DDP(net.to(local_rank), device_ids=[local_rank])
# for epoch in range(num_epochs):
#     sampler.set_epoch(epoch)
#     for X, y in loader:
#         optimizer.zero_grad()
#         loss_fn(model(X), y).backward()          # gradients are averaged over the ranks during backward
#         optimizer.step()                         # identical on every rank
#     if rank == 0:
#         ...                                      # print, plot, save a checkpoint: one process does it
# dist.destroy_process_group()
# ```
#
# `mparlib.ddp_train.train_worker` is this loop plus the metrics, the evaluation and the checkpoints; its source is
# short enough to read. It runs the chapter-5 experiment in three ways:
#
# - `torchrun --nproc_per_node=2 -m mparlib.ddp --epochs 10` in a terminal: torchrun starts the processes and
#   sets the variables (`--nproc_per_node` = number of GPUs with `nccl`),
# - `python -m mparlib.ddp --nproc 2 --epochs 10`: the module starts the processes itself,
# - `launch(ddp_train.train_worker, 2, args=(config,))` from Python, which is what this notebook does.
#
# `python -m mparlib.ddp --help` lists the options (batch size, learning rate, `--sync-bn`, `--resume`, ...).
#
# Around that loop the library takes care of what a long run needs, each piece small enough to read:
#
# | where | what it does |
# |---|---|
# | `mparlib.ddp_train.check_run` | refuses settings that cannot work (a global batch that does not split evenly, a rank without data, `lr=nan`) before any process starts |
# | `mparlib.rendezvous.rendezvous_env`, `check_port`, `free_port`, `check_gpus` | read torchrun's variables, check that the rendezvous port is free, and that nccl has a GPU per process |
# | `mparlib.runfolder.lock_folder` (a `with` block) | one run per `--out` folder: a second run is refused with the name of the first |
# | `mparlib.runfolder.save_run`, `checkpoint_path`, `sampler_state` | rank 0's atomic checkpoint after every epoch, with what resuming needs |
# | `mparlib.runfolder.read_checkpoint`, `shared_checkpoint` | for `--resume`: rank 0 reads and checks the file, then sends it to every rank |
#
# The training loop also watches the loss: at the first NaN or infinite loss the run stops with
# `TrainingDiverged`, naming the epoch and step, and the last good checkpoint stays.
# <!-- ja -->
# ## DDP の訓練スクリプト
#
# すべてのプロセスが同じプログラムを実行します。骨組みだけにすると、DDP の訓練を行う 1個のプロセスは次のようになります。
#
# ```python
# dist.init_process_group("gloo")                  # または "nccl"。RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT を読む
# rank, world = dist.get_rank(), dist.get_world_size()
# sampler = DistributedSampler(train_set, seed=0)  # 全ランク共通のシャッフルのうち、このランクの担当分
# loader = DataLoader(train_set, batch_size=global_batch // world, sampler=sampler)
# model = DDP(net)                                 # GPU では DDP(net.to(local_rank), device_ids=[local_rank])
# for epoch in range(num_epochs):
#     sampler.set_epoch(epoch)
#     for X, y in loader:
#         optimizer.zero_grad()
#         loss_fn(model(X), y).backward()          # 逆伝播の最中に勾配がランク間で平均される
#         optimizer.step()                         # どのランクでも同じ更新になる
#     if rank == 0:
#         ...                                      # 表示、グラフ、チェックポイントの保存は 1個のプロセスだけが行う
# dist.destroy_process_group()
# ```
#
# `mparlib.ddp_train.train_worker` は、このループに評価指標の集計、テスト精度の評価、チェックポイントを加えたものです。ソースは短いので読んでみてください。5章の実験は次の 3通りの方法で実行できます。
#
# - ターミナルで `torchrun --nproc_per_node=2 -m mparlib.ddp --epochs 10`: torchrun がプロセスを起動し、環境変数を設定します（`nccl` では `--nproc_per_node` を GPU の枚数にします）。
# - `python -m mparlib.ddp --nproc 2 --epochs 10`: モジュール自身がプロセスを起動します。
# - Python から `launch(ddp_train.train_worker, 2, args=(config,))`: このノートブックではこの方法を使います。
#
# オプション（バッチサイズ、学習率、`--sync-bn`、`--resume` など）の一覧は `python -m mparlib.ddp --help` で表示できます。
#
# このループの周りで、長い訓練に必要なことはライブラリが受け持ちます。どれも読める大きさです。
#
# | 場所 | 役割 |
# |---|---|
# | `mparlib.ddp_train.check_run` | 動かない設定（プロセス数で割り切れない全体のバッチサイズ、データのないランク、`lr=nan` など）を、プロセスを起動する前に拒否する |
# | `mparlib.rendezvous.rendezvous_env`、`check_port`、`free_port`、`check_gpus` | torchrun の環境変数を読み、ランデブーのポートが空いていること、nccl ならプロセスごとに GPU があることを確かめる |
# | `mparlib.runfolder.lock_folder`（`with` で使います） | 1つの `--out` フォルダには 1つの訓練だけ。2つ目の訓練は 1つ目の名前を添えて拒否する |
# | `mparlib.runfolder.save_run`、`checkpoint_path`、`sampler_state` | エポックごとにランク 0 がアトミックに書くチェックポイントと、再開に必要な情報 |
# | `mparlib.runfolder.read_checkpoint`、`shared_checkpoint` | `--resume` のとき、ランク 0 がファイルを読んで確かめ、全ランクに送る |
#
# 訓練ループは損失も見張っています。損失が初めて NaN か無限大になった時点で、エポックとステップを示す `TrainingDiverged` で訓練を止め、最後の正常なチェックポイントを残します。

# %% [markdown]
# <!-- en -->
# ## Starting processes from a notebook
#
# `launch(fn, nproc, args=(...), kwargs={...})` from `mparlib.launch` starts `nproc` new Python processes,
# gives each the variables torchrun would set, joins them into a process group, calls `fn(*args, **kwargs)` in
# each, and returns what rank 0's `fn` returned. It also shows rank 0's printed lines and its live plot in the
# cell. Its own options (`backend`, `port`, `echo`, ...) are keyword-only, so they never take an argument meant for
# the worker. The launcher hosts the rendezvous server itself, as torchrun does, and its processes end with it:
# interrupting the cell, restarting the kernel or killing the launcher stops every rank.
#
# The worker `fn` must be importable. A new process starts without the kernel's variables: it receives the
# function as "module name + function name" (that is how `pickle` sends a function) and imports it. A function
# defined in a cell belongs to the kernel's `__main__` module, which the new process does not have. With
# `torch.multiprocessing.spawn` the new process fails with `AttributeError: Can't get attribute 'worker' on
# <module '__main__' (built-in)>`, and the notebook sees only `ProcessExitedException: process 0 terminated with
# exit code 1`. (Starting processes by `fork`, which copies the kernel, avoids the import but is unsafe once the
# kernel has used CUDA or started threads, so PyTorch spawns: every process is a new interpreter that imports
# PyTorch again. `launch` takes the third way Python offers, a **fork server**: its first run starts one new
# interpreter that imports PyTorch and nothing of the kernel, and every rank of every later run is forked from that
# clean process, so it starts with PyTorch already loaded. On the 2-core machine the course is tested on, a launch
# of 2 ranks that do almost nothing took 1.2 s with spawn and 0.07 s from the fork server
# (`benchmarks/launch_start.py`).) `launch` checks this before starting anything:
# <!-- ja -->
# ## ノートブックからのプロセスの起動
#
# `mparlib.launch` の `launch(fn, nproc, args=(...), kwargs={...})` は、新しい Python プロセスを `nproc` 個起動し、torchrun が設定するのと同じ環境変数を渡してプロセスグループを作り、各プロセスで `fn(*args, **kwargs)` を呼び出して、ランク 0 の `fn` の戻り値を返します。ランク 0 が表示する行とライブ表示のグラフも、セルの中に表示します。`launch` 自身のオプション（`backend`、`port`、`echo` など）はキーワード専用なので、ワーカーに渡すつもりの引数を横取りすることはありません。ランデブーのサーバーは torchrun と同じく起動する側が受け持ち、起動したプロセスは `launch` と運命をともにします。セルを中断しても、カーネルを再起動しても、起動したプログラムを強制終了しても、すべてのランクが止まります。
#
# ワーカー関数 `fn` はインポートできなければなりません。新しいプロセスはカーネルの変数を持たずに始まります。関数は「モジュール名 + 関数名」として届き（`pickle` は関数をこの形で送ります）、新しいプロセスがそれをインポートします。セルで定義した関数はカーネルの `__main__` モジュールに属しますが、新しいプロセスにはそのモジュールがありません。`torch.multiprocessing.spawn` を使うと、新しいプロセスは `AttributeError: Can't get attribute 'worker' on <module '__main__' (built-in)>` で失敗し、ノートブックには `ProcessExitedException: process 0 terminated with exit code 1` しか届きません（カーネルを丸ごと複製する `fork` で起動すればインポートは不要ですが、カーネルが CUDA を使ったりスレッドを起動したりしたあとでは安全ではないため、PyTorch は spawn で起動します。spawn ではプロセスごとに新しいインタプリタが PyTorch をインポートし直します。`launch` は Python が用意している 3つ目の方法、**フォークサーバー**（fork server）を使います。最初の実行で、PyTorch だけをインポートし、カーネルのものは何も持たないインタプリタを 1つ起動し、以後の実行のランクはすべてこのまっさらなプロセスから fork するので、ランクは PyTorch を読み込んだ状態で始まります。このコースをテストしている CPU コア 2個のマシンでは、ほとんど何もしないランク 2個の起動が、spawn では 1.2秒、フォークサーバーからでは 0.07秒でした（`benchmarks/launch_start.py`）。）`launch` はプロセスを起動する前にこれを確かめます。

# %% tags=["raises-exception"]
def worker():
    return "hello"


launch(worker, 2)

# %% [markdown]
# <!-- en -->
# The fix is what the message says. A cell that starts with `%%worker NAME` (the magic comes with
# `%load_ext mparlib.launch`, run in the first code cell) becomes the module `NAME`: the kernel writes it into a
# temporary folder of its own, which the new processes can import from, and imports it. Nothing is written into
# the course's folders, and running the cell again replaces the module (`mparlib.workers.write_worker` does the
# writing into `mparlib.workers.worker_folder()`; `register_magic` is what `%load_ext` calls). This chapter's own
# workers follow: one
# that says who it is, and one DDP step on a share of a batch, used in the next section.
# <!-- ja -->
# 直し方はメッセージのとおりです。`%%worker NAME` で始まるセルは、モジュール `NAME` になります（このマジックは最初のコードセルで実行した `%load_ext mparlib.launch` で使えるようになります）。カーネルはセルの中身を自分専用の一時フォルダに書き出してインポートし、新しいプロセスもそのフォルダからインポートできます。コースのフォルダには何も書き込みません。セルを実行し直すと、モジュールも置き換わります（書き出すのは `mparlib.workers.write_worker` で、書き出し先は `mparlib.workers.worker_folder()` です。`%load_ext` が呼ぶのは `register_magic` です）。次のセルがこの章のワーカーです。自分が誰かを答えるワーカーと、ミニバッチの担当分で DDP の 1ステップを進めるワーカー（次の節で使います）です。

# %%
# %%worker ddp_workers
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mparlib.ddp_train import make_model
from mparlib.lang import tr


def hello():
    rank, world, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    return tr(f"rank {rank} of {world}, backend {backend}", f"ランク {rank}（全 {world}個中）、バックエンド {backend}")


def one_step(x, y, lr, seed=0):
    """One DDP step in which rank r trains on rows r*b .. (r+1)*b - 1 of the batch; returns the new parameters."""
    rank, world = dist.get_rank(), dist.get_world_size()
    b = len(y) // world  # this rank's share of the global batch
    torch.manual_seed(seed)
    net = make_model("mlp")  # the same seed on every rank gives the same initial weights
    model = DDP(net)  # broadcasts rank 0's parameters once, then averages gradients in backward
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss = nn.functional.cross_entropy(model(x[rank * b:(rank + 1) * b]), y[rank * b:(rank + 1) * b])
    loss.backward()  # the all-reduce happens here, bucket by bucket
    optimizer.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}

# %%
from ddp_workers import hello, one_step

print(launch(hello, 2))

# %% [markdown]
# <!-- en -->
# ## Two halves equal one whole
#
# Each process computes the mean loss over its `b = B / W` examples, and DDP averages the gradients of the `W`
# processes. The average of the `W` per-process means is the mean over all `B` examples:
#
# $$\frac{1}{W}\sum_{r=1}^{W} \frac{1}{b}\sum_{i \in \text{share}_r} \nabla \ell_i = \frac{1}{B}\sum_{i=1}^{B} \nabla \ell_i .$$
#
# So after one step, DDP with 2 processes on the two halves of a batch must hold the same parameters as one
# process that took one step on the whole batch. The check below uses a small network without batch
# normalization: batch normalization computes its statistics over the examples a process sees, so with DDP its
# output depends on the split (on GPUs, `--sync-bn` replaces it with `SyncBatchNorm`, which computes them over
# the global batch). The worker `one_step` above builds the model from the same seed and takes one SGD step on
# rank `r`'s half.
# <!-- ja -->
# ## 半分ずつの計算と全体の計算の一致
#
# 各プロセスは自分の担当する `b = B / W` 個のデータで損失の平均をとり、DDP は `W` 個のプロセスの勾配を平均します。プロセスごとの平均を `W` 個平均すると、`B` 個すべてのデータの平均になります。
#
# $$\frac{1}{W}\sum_{r=1}^{W} \frac{1}{b}\sum_{i \in \text{担当}_r} \nabla \ell_i = \frac{1}{B}\sum_{i=1}^{B} \nabla \ell_i$$
#
# したがって、2個のプロセスでミニバッチを半分ずつ使って 1ステップ進めた DDP のパラメータは、1個のプロセスでミニバッチ全体を使って 1ステップ進めたパラメータと一致するはずです。この確認には、バッチ正規化を含まない小さなネットワークを使います。バッチ正規化は、そのプロセスが見るデータだけで統計量を計算するため、DDP では出力がデータの分け方に依存するからです（GPU では `--sync-bn` を指定すると `SyncBatchNorm` に置き換わり、全体のバッチで統計量を計算します）。上のワーカー `one_step` は同じシードからモデルを作り、ランク `r` の担当する半分で SGD を 1ステップ進めます。

# %% tags=["nbval-ignore-output"]
images, labels = ddp_train.load_split_tensors("train", 16)
X, y = to_float(images), labels  # (16, 1, 28, 28), (16,)

torch.manual_seed(0)
net = ddp_train.make_model("mlp")  # Flatten, Linear(784, 64), ReLU, Linear(64, 10)
before = {k: v.clone() for k, v in net.state_dict().items()}
optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
torch.nn.functional.cross_entropy(net(X), y).backward()
optimizer.step()
one_process = net.state_dict()

two_processes = launch(one_step, 2, args=(X, y, 0.5), echo=False)
diff = max((two_processes[k] - one_process[k]).abs().max().item() for k in one_process)
moved = max((one_process[k] - before[k]).abs().max().item() for k in one_process)
print(tr("largest parameter difference, 2 processes vs 1:", "パラメータの差の最大値（2個のプロセスと 1個）:"),
      f"{diff:.1e}")
print(tr("largest change made by the step:", "このステップによる変化の最大値:"), f"{moved:.1e}")

# %%
assert diff < 1e-6, diff
assert moved > 1e-3  # the step really moved the parameters, so the match is not trivial

# %% [markdown]
# <!-- en -->
# The difference is at the level of float32 rounding: the sums are taken in another order, nothing else
# differs. `tests/test_ddp.py` checks the same thing for whole training runs.
# <!-- ja -->
# 差は float32 の丸め誤差の程度です。足し算の順序が違うだけで、それ以外に違いはありません。`tests/test_ddp.py` では、同じことを訓練全体について確かめています。

# %% [markdown]
# <!-- en -->
# ## The chapter-5 experiment with 2 processes, a crash, and a resume
#
# Now the ResNet-18 of chapter 5 on Fashion-MNIST, with DDP. The `full` profile runs chapter 5's experiment: one
# process per GPU (`nccl`), d2l's ResNet-18, the whole data set and 10 epochs, with batch size 256 and learning
# rate 0.1 per GPU and plain SGD. The `smoke` profile uses 2 CPU processes (`gloo`) and the narrow ResNet-18 of
# chapter 5's smoke profile (`width=8`), trained for 2 epochs on 9,000 images with a global batch of 32 and
# tested on 1,000. It adds momentum 0.9 to SGD (with the learning rate 0.01), which makes the steps of a short
# run count for more. DDP does not mind: it averages the gradients, and the optimizer, momentum included, runs
# unchanged in every process.
#
# After every epoch rank 0 writes a **checkpoint**: the model, the optimizer state, the number of finished
# epochs, the sampler's seed and epoch, and the history. It writes to a temporary file and renames it
# (`os.replace`), so a crash while writing leaves the previous checkpoint intact. To see why this matters, the
# first run kills rank 0 (with `SIGKILL`, as a power cut or the out-of-memory killer would) at the first step
# of the last epoch. The plot is drawn by rank 0 and updated in the cell after every epoch.
# <!-- ja -->
# ## 5章の実験を 2個のプロセスで: 障害と再開
#
# いよいよ 5章の ResNet-18 を Fashion-MNIST で、DDP を使って訓練します。`full` プロファイルは 5章の実験そのものです。GPU ごとに 1個のプロセス（`nccl`）で d2l の ResNet-18 をデータセット全体で 10エポック訓練し、バッチサイズは GPU あたり 256、学習率は GPU あたり 0.1、最適化は素の SGD です。`smoke` プロファイルでは 2個の CPU プロセス（`gloo`）で、5章の `smoke` プロファイルと同じ細い ResNet-18（`width=8`）を使い、訓練画像 9,000枚を全体のバッチサイズ 32 で 2エポック訓練し、テスト画像 1,000枚で評価します。短い訓練でも 1ステップごとの効果が大きくなるよう、SGD にモーメンタム 0.9 を加えています（学習率は 0.01）。DDP にとっては何も変わりません。DDP は勾配を平均するだけで、オプティマイザはモーメンタムも含めて各プロセスでそのまま動きます。
#
# ランク 0 はエポックが終わるたびに**チェックポイント**を書き出します。中身はモデル、オプティマイザの状態、終わったエポック数、サンプラーのシードとエポック、そして履歴です。いったん一時ファイルに書いてから名前を変える（`os.replace`）ので、書き込み中に落ちても直前のチェックポイントは壊れません。その効果を確かめるため、最初の実行では最後のエポックの 1ステップ目でランク 0 を強制終了します（停電やメモリ不足でプロセスが強制終了されたときと同じ `SIGKILL` を使います）。グラフはランク 0 が描き、エポックが終わるたびにセルの中で更新されます。

# %% tags=["nbval-ignore-output"]
nproc = 2 if PROFILE == "smoke" else (mparlib.num_gpus() or 2)  # smoke: two CPU processes
workdir = tempfile.TemporaryDirectory(prefix="mparlib-06-")
config = ddp_train.DDPConfig.for_profile(PROFILE, nproc, out=workdir.name)  # chapter 06's experiment, one definition
plot = Path(workdir.name) / "plot.png"  # rank 0's Animator writes it; launch(show=plot) displays it here
print(tr(f"{nproc} processes, backend {choose_backend('auto', nproc)}, ResNet-18 of width {config.width}, global "
         f"batch {config.batch_size} ({config.batch_size // nproc} per process), learning rate {config.lr:g}, "
         f"momentum {config.momentum:g}, {config.epochs} epochs",
         f"プロセス {nproc}個、バックエンド {choose_backend('auto', nproc)}、幅 {config.width} の ResNet-18、"
         f"全体のバッチサイズ {config.batch_size}（プロセスあたり {config.batch_size // nproc}）、学習率 {config.lr:g}、"
         f"モーメンタム {config.momentum:g}、{config.epochs}エポック"))
print(describe(nproc))

# %% tags=["nbval-ignore-output"]
crash = dataclasses.replace(config, crash_at=(config.epochs, 1))  # rank 0 dies at step 1 of the last epoch
try:
    launch(ddp_train.train_worker, nproc, args=(crash,), show=plot)
except WorkerFailed as e:
    print(e.cause)  # which rank failed first, and how
    print("    " + str(e).splitlines()[-1])  # the last line of its log, written just before it died

# %%
saved = torch.load(Path(workdir.name) / "checkpoint.pt", weights_only=True)
print(tr("epochs lost by the crash:", "障害で失われたエポック数:"), config.epochs - saved["epoch"])
assert saved["epoch"] == config.epochs - 1 and saved["sampler"]["epoch"] == config.epochs - 1

# %% [markdown]
# <!-- en -->
# Only the last epoch's progress is lost. Resuming (`--resume` on the command line) loads the checkpoint: rank 0
# reads it and broadcasts it, every process restores the model and the optimizer state, and the sampler continues
# with the next epoch's order. The resumed run reaches the same parameters as a run that was never interrupted
# (`tests/test_ddp.py` checks this).
# <!-- ja -->
# 失われたのは最後のエポックの進み具合だけです。再開（コマンドラインでは `--resume`）ではチェックポイントを読み込みます。ランク 0 がファイルを読んで他のプロセスへブロードキャストし、各プロセスがモデルとオプティマイザの状態を復元し、サンプラーは次のエポックの順序から続けます。再開した訓練は、一度も中断しなかった訓練と同じパラメータに到達します（`tests/test_ddp.py` で確かめています）。

# %% tags=["nbval-ignore-output"]
result = launch(ddp_train.train_worker, nproc, args=(dataclasses.replace(config, resume=True),), show=plot)

# %%
history = result["history"]
assert [h["epoch"] for h in history] == list(range(1, config.epochs + 1))
assert result["world_size"] == nproc and result["per_rank_batch"] == config.batch_size // nproc
assert all(math.isfinite(h["train_loss"]) and 0 <= h["test_acc"] <= 1 for h in history)
# it learned: the loss fell far below log(10) = 2.30, that of a uniform guess, and the test accuracy passed a bar
assert history[-1]["train_loss"] < 0.5 * math.log(10), [h["train_loss"] for h in history]
assert history[-1]["test_acc"] >= (0.85 if PROFILE == "full" else 0.70), [h["test_acc"] for h in history]

# %% [markdown]
# <!-- en -->
# The checkpoint has the format of chapter 2: the parameters are saved from the model inside the DDP wrapper,
# without the `module.` prefix, next to the extra entries that resuming needs. So `load_checkpoint` puts the
# trained weights into a plain ResNet-18, for example to evaluate or fine-tune it on one device, without any
# process group:
# <!-- ja -->
# チェックポイントは 2章と同じ形式です。パラメータは DDP のラッパーの内側のモデルから `module.` の接頭辞なしで保存され、再開に必要な項目がその横に並びます。そのため、`load_checkpoint` を使えば、訓練した重みをふつうの ResNet-18 に読み込めます。プロセスグループなしで、1つのデバイスで評価したり追加で訓練したりできます。

# %%
from mparlib.checkpoint import load_checkpoint

plain = ddp_train.make_model("resnet18", config.width)
extra = load_checkpoint(plain, Path(workdir.name) / "checkpoint.pt")
print(sorted(extra))
assert extra["epoch"] == config.epochs and extra["sampler"]["epoch"] == config.epochs

# %% [markdown]
# <!-- en -->
# ## DataParallel and DDP on this machine
#
# Which one is faster here? The next cell times a few training steps of ResNet-18 both ways, with the same global
# batch. On a machine with GPUs, `DataParallel` spreads the batch over all GPUs from one process, and DDP runs one
# process per GPU. On a machine without GPUs `DataParallel` simply calls the model in one process, which uses all
# CPU cores through PyTorch's threads, while DDP runs 2 processes with one thread each. The numbers are yours;
# the stored ones came from the machine that built this notebook.
# <!-- ja -->
# ## このマシンでの DataParallel と DDP
#
# このマシンではどちらが速いでしょうか。次のセルでは、同じ全体のバッチサイズで ResNet-18 の訓練ステップを数回ずつ両方の方法で計測します。GPU のあるマシンでは、`DataParallel` は 1個のプロセスからミニバッチをすべての GPU に分配し、DDP は GPU ごとに 1個のプロセスを動かします。GPU のないマシンでは、`DataParallel` は 1個のプロセスでモデルをそのまま呼び出すだけで、PyTorch のスレッドを通じてすべての CPU コアを使います。一方 DDP は、スレッドを 1本ずつ持つ 2個のプロセスを動かします。表示される数値はお使いのマシンのものです。保存されている数値は、このノートブックを作成したマシンのものです。

# %% tags=["nbval-ignore-output"]
per_process, steps = (4, 2) if PROFILE == "smoke" else (256, 20)
dp = throughput.dataparallel("resnet18", batch_size=per_process * nproc, steps=steps)
dd = launch(throughput.ddp_worker, nproc, args=("resnet18",), kwargs=dict(per_rank_batch=per_process, steps=steps),
            echo=False)
rows = [("DataParallel", 1, ", ".join(dp["devices"]) + tr(f" ({dp['threads']} threads)", f"（スレッド {dp['threads']}本）"),
         dp["images_per_s"]),
        ("DistributedDataParallel", dd["world_size"],
         dd["backend"] + tr(f" ({dd['threads']} thread(s) each)", f"（各プロセスにスレッド {dd['threads']}本）"),
         dd["images_per_s"])]
head = [tr("method", "方式"), tr("processes", "プロセス数"), tr("devices", "デバイス"), tr("images/s", "画像/秒")]
Markdown("\n".join("| " + " | ".join(map(str, r)) + " |" for r in [head, ["---"] * 4] +
                   [(name, procs, where, f"{speed:.1f}") for name, procs, where, speed in rows]))

# %%
assert dd["world_size"] == nproc and dd["per_rank_batch"] * nproc == per_process * nproc
assert all(r[3] > 0 and math.isfinite(r[3]) for r in rows)

# %% [markdown]
# <!-- en -->
# On GPUs, DDP avoids what slows DataParallel down: one interpreter lock shared by all threads, copying the
# model to every GPU at every step, and collecting all outputs on GPU 0. On a CPU the comparison is different:
# both use the same cores, either as threads inside one operation of one process or as separate processes that
# also exchange gradients. Which one wins depends on the model, the batch size and on what else the machine is
# doing (threads that wait for each other suffer most when other programs take cores away), so run the cell
# twice before drawing conclusions. `benchmarks/ddp_throughput.py` measures the same comparison with more steps,
# adds one process with one thread as a baseline, and saves the numbers.
# <!-- ja -->
# GPU では、DDP は DataParallel を遅くしている要因を避けられます。すべてのスレッドが 1つのインタプリタロックを共有すること、ステップごとにモデルを全 GPU へ複製すること、すべての出力を GPU 0 に集約することです。CPU では事情が違います。どちらも同じ CPU コアを使い、1個のプロセスの 1つの演算の中でスレッドとして使うか、勾配もやり取りする別々のプロセスとして使うかの違いです。どちらが速いかは、モデル、バッチサイズ、そしてマシンで他に何が動いているかによって変わります（互いを待ち合わせるスレッドは、他のプログラムにコアを取られたときにいちばん大きな影響を受けます）。結論を出す前にセルを 2回実行してみてください。`benchmarks/ddp_throughput.py` は同じ比較をより多くのステップで計測し、基準として 1スレッドの 1個のプロセスも測って、結果を保存します。

# %% [markdown]
# <!-- en -->
# ## Beyond one machine
#
# With `torchrun`, two machines are two invocations of the same command, one on each host. Say host A has the
# address `10.0.0.1` and both hosts have 4 GPUs. Run on **each** host:
#
# ```bash
# torchrun --nnodes=2 --nproc_per_node=4 \
#     --rdzv-backend=c10d --rdzv-endpoint=10.0.0.1:29400 --rdzv-id=fmnist-run-1 \
#     -m mparlib.ddp --epochs 10 --batch-size 2048 --lr 0.8 --out runs/two-hosts
# ```
#
# (8 GPUs with 256 images each make the global batch of 2048, and the learning rate follows the linear scaling
# rule.) The `c10d` rendezvous runs on host A, the address in `--rdzv-endpoint`. The 8 processes get the global
# ranks 0 to 7 and the local ranks 0 to 3 on each host; which host holds ranks 0 to 3 is settled at the
# rendezvous. What must match between the hosts:
#
# - `--nnodes`, `--rdzv-backend`, `--rdzv-endpoint` and `--rdzv-id` (a name for this run, the same on both),
# - the program and its options: the same code, the same versions of PyTorch and `mparlib`, the same backend,
# - the data: every process reads Fashion-MNIST on its own host, so each host needs a copy,
# - the network: host B must reach host A's port 29400, and the processes open further connections to each
#   other; with several network interfaces, choose one with `NCCL_SOCKET_IFNAME` (nccl) or `GLOO_SOCKET_IFNAME`
#   (gloo).
#
# Only global rank 0 writes the checkpoint, and on resume only rank 0 reads it and broadcasts it to the others.
# Since either host may run rank 0 next time, keep `--out` on storage that both hosts see (a shared file system),
# or copy the checkpoint to both before resuming.
#
# You can rehearse all of this on one machine: two terminals, two "nodes" on `127.0.0.1` with one CPU process
# each. Start the same command in both terminals (the first one hosts the rendezvous; the second finds the port
# taken and joins as a client):
#
# ```bash
# torchrun --nnodes=2 --nproc_per_node=1 \
#     --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=rehearsal \
#     -m mparlib.ddp --model mlp --epochs 2 --subset 2048 --batch-size 64 --out runs/rehearsal
# ```
#
# Only one of the two terminals prints the progress (global rank 0). If port 29400 is taken, pick another, the
# same in both terminals.
# <!-- ja -->
# ## 複数台のマシンへ
#
# `torchrun` を使えば、2台のマシンでの訓練は、同じコマンドを各ホストで 1回ずつ実行するだけです。ホスト A のアドレスが `10.0.0.1` で、どちらのホストにも GPU が 4枚あるとします。**それぞれの**ホストで次を実行します。
#
# ```bash
# torchrun --nnodes=2 --nproc_per_node=4 \
#     --rdzv-backend=c10d --rdzv-endpoint=10.0.0.1:29400 --rdzv-id=fmnist-run-1 \
#     -m mparlib.ddp --epochs 10 --batch-size 2048 --lr 0.8 --out runs/two-hosts
# ```
#
# （GPU 8枚に 256枚ずつで全体のバッチサイズは 2048 になり、学習率は線形スケーリング則に従います。）`c10d` のランデブーは `--rdzv-endpoint` のアドレスのホスト A で動きます。8個のプロセスにはグローバルなランク 0 から 7 と、各ホストの中でのローカルランク 0 から 3 が割り当てられます。どちらのホストがランク 0 から 3 を受け持つかは、ランデブーの時点で決まります。ホスト間で一致させる必要があるのは次のものです。
#
# - `--nnodes`、`--rdzv-backend`、`--rdzv-endpoint`、`--rdzv-id`（この実行の名前。両方のホストで同じにします）
# - プログラムとそのオプション: 同じコード、同じバージョンの PyTorch と `mparlib`、同じバックエンド
# - データ: 各プロセスは自分のホストで Fashion-MNIST を読むので、どちらのホストにもデータが必要です。
# - ネットワーク: ホスト B からホスト A のポート 29400 に接続できる必要があり、プロセスどうしもさらに別の接続を開きます。ネットワークインタフェースが複数あるときは、`NCCL_SOCKET_IFNAME`（nccl）や `GLOO_SOCKET_IFNAME`（gloo）で使うものを指定します。
#
# チェックポイントを書くのはグローバルなランク 0 だけで、再開するときもランク 0 だけが読み込み、他のプロセスへブロードキャストします。次回はどちらのホストがランク 0 になるかわからないので、`--out` は両方のホストから見える場所（共有ファイルシステム）に置くか、再開する前にチェックポイントを両方のホストにコピーしてください。
#
# この手順は 1台のマシンで予行演習できます。ターミナルを 2つ開き、`127.0.0.1` 上の 2つの「ノード」として、CPU のプロセスを 1個ずつ動かします。両方のターミナルで同じコマンドを実行してください（先に起動した方がランデブーを受け持ち、後から起動した方はポートが使用中であることを確かめてクライアントとして参加します）。
#
# ```bash
# torchrun --nnodes=2 --nproc_per_node=1 \
#     --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=rehearsal \
#     -m mparlib.ddp --model mlp --epochs 2 --subset 2048 --batch-size 64 --out runs/rehearsal
# ```
#
# 進み具合を表示するのは、2つのターミナルのうち一方（グローバルなランク 0）だけです。ポート 29400 が使用中なら、両方のターミナルで同じ別の番号を選んでください。

# %%
workdir.cleanup()  # the checkpoint and plot of this chapter's runs lived in a temporary folder

# %% [markdown]
# <!-- en -->
# ## Summary
#
# - DDP runs one process per device. Each process loads its own share of the data (`DistributedSampler`, with
#   `set_epoch` every epoch), computes its own loss, and DDP averages the gradients by all-reduce in buckets
#   while the backward pass is still running.
# - With the global batch split over the processes, DDP computes the same steps as one process on the whole
#   batch (for models without batch normalization; `SyncBatchNorm` on GPUs).
# - `torchrun` starts the processes and sets `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`; from a
#   notebook, `mparlib.launch.launch` does it, with a worker from an importable module: a `%%worker` cell.
# - Rank 0 alone prints, plots and writes checkpoints, atomically; `--resume` continues where a run stopped.
# - The same program runs on several machines: `torchrun --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=...`.
# <!-- ja -->
# ## まとめ
#
# - DDP はデバイスごとに 1個のプロセスを動かします。各プロセスは自分の担当分のデータを読み込み（`DistributedSampler`。エポックごとに `set_epoch` を呼びます）、自分で損失を計算します。DDP は逆伝播が続いている間に、勾配をバケットごとのオールリデュースで平均します。
# - 全体のバッチサイズをプロセスに割り振れば、DDP は 1個のプロセスでミニバッチ全体を使ったときと同じステップを計算します（バッチ正規化を含まないモデルの場合。GPU では `SyncBatchNorm` を使います）。
# - `torchrun` はプロセスを起動し、`RANK`、`WORLD_SIZE`、`MASTER_ADDR`、`MASTER_PORT` を設定します。ノートブックからは `mparlib.launch.launch` が同じことを行います。ワーカー関数はインポートできるモジュール（`%%worker` のセル）に置きます。
# - 表示、グラフ、チェックポイントの書き込みはランク 0 だけが行い、チェックポイントはアトミックに書き込みます。`--resume` を指定すると、止まったところから訓練を続けます。
# - 同じプログラムが複数台のマシンで動きます: `torchrun --nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=...`

# %% [markdown]
# <!-- en -->
# ## Exercises
#
# Each exercise has a **starter** cell whose function body is `raise NotImplementedError`: replace that line with your
# code, run the cell, then run the check cell below it. The starters of this chapter are `%%worker` cells, because the
# check starts fresh processes that import your function. The check says *not attempted*, *wrong* (the first
# difference and one hint for the likely mistake), *error* (your exception, or your code ending its process), *right*,
# *cannot run here* or *the check itself failed* (never a verdict on your answer); it never prints the answer. Each
# check runs your function on 2 and then 3 fresh processes, so a number of processes written into the code is found
# out, and shows what rank 0 prints. A collective that waits for a partner that never comes is stopped after 20 s,
# naming the waiting rank, and the whole check after 240 s. `hint("06.1")` prints the next hint level each time you call it
# and says when none is left; `hint("06.1", 2)` prints a given level.
# <!-- ja -->
# ## 練習問題
#
# 各練習問題には、本体が `raise NotImplementedError` だけの関数を含む**スターター**のセルがあります。その行を自分のコードに置き換えてセルを実行し、すぐ下のチェックのセルを実行してください。チェックは新しいプロセスを起動してそこで関数をインポートするので、この章のスターターは `%%worker` のセルです。チェックの結果は「未着手」、「不正解」（最初の違いと、ありがちな間違いに合わせたヒント 1つ）、「エラー」（発生した例外、またはコードがプロセスを終了させたこと）、「正解」、「この環境では実行できません」、「チェック自体の不具合」（あなたの答えの判定ではありません）のどれかで、答えそのものは表示しません。どのチェックも関数を新しいプロセス 2個で、次に 3個で実行するので、コードに固定で書いたプロセス数は見つかります。ランク 0 が出力したものは表示されます。来ない相手を待ち続ける集合通信は 20秒で止めて待っていたランクを示し、チェック全体は 240秒で止めます。`hint("06.1")` は呼ぶたびに次の段階のヒントを表示し、もう残っていなければそう伝えます。`hint("06.1", 2)` は指定した段階のヒントを表示します。

# %%
from mparlib.exercises import check, hint

# %% [markdown]
# <!-- en -->
# ### Exercise 06.1: The gradient average by hand
#
# Write `average_gradients(model)`, called in every process right after `loss.backward()` on that process's share
# of a batch: afterwards every parameter's `.grad` must hold what DDP would have put there. The check runs 2
# and then 3 processes, each with the same small network (one of whose parameters is frozen) and its own
# share of a batch, and compares every gradient with that of one process on the whole batch.
# <!-- ja -->
# ### 練習問題 06.1: 手で求める勾配の平均
#
# 各プロセスが自分の担当分で `loss.backward()` を実行した直後に呼ぶ `average_gradients(model)` を書いてください。呼んだあと、各パラメータの `.grad` には DDP が入れるのと同じものが入っていなければなりません。チェックはプロセスを 2個、次に 3個動かし、それぞれが同じ小さなネットワーク（パラメータの 1つは凍結してあります）とミニバッチの自分の担当分を使って、すべての勾配を 1個のプロセスがミニバッチ全体で計算した勾配と比べます。

# %%
# %%worker ex06_average
# Exercise 06.1: starter
import torch.distributed as dist


def average_gradients(model):
    """Make every gradient of `model` the average over all processes, in place."""
    raise NotImplementedError("06.1")

# %%
from ex06_average import average_gradients

check("06.1", average_gradients)

# %% [markdown]
# <!-- en -->
# ### Exercise 06.2: A new order every epoch
#
# Write `epoch_shares(dataset, num_epochs, seed=0)`: the indices that this process trains on in each of
# `num_epochs` epochs, as a list of lists, shuffled from `seed` with a new order every epoch, as the training
# script of this chapter draws them. The check runs it on 2 and then 3 processes with 10 examples (on 3, the sampler
# pads) and 3 epochs.
# <!-- ja -->
# ### 練習問題 06.2: エポックごとに新しい順序
#
# このプロセスが `num_epochs` 個の各エポックで訓練に使うインデックスを、リストのリストとして返す `epoch_shares(dataset, num_epochs, seed=0)` を書いてください。この章の訓練スクリプトと同じく、`seed` からシャッフルし、エポックごとに新しい順序にします。チェックはプロセス 2個と 3個で、10個のデータ（3個のときはサンプラーが数を補います）と 3エポックで実行します。

# %%
# %%worker ex06_sampler
# Exercise 06.2: starter
import torch.distributed as dist
from torch.utils.data import DistributedSampler


def epoch_shares(dataset, num_epochs, seed=0):
    """This process's indices for each epoch: a list of `num_epochs` lists."""
    raise NotImplementedError("06.2")

# %%
from ex06_sampler import epoch_shares

check("06.2", epoch_shares)

# %% [markdown]
# <!-- en -->
# ### Exercise 06.3: Rank 0's checkpoint
#
# Write `save_checkpoint(model, path)`, called by every process with its DDP-wrapped `model`: afterwards `path`
# holds the parameters in the format a plain model loads (chapter 2's), written the way this chapter's
# checkpoints are, and no process returns before the file is there. The check runs 2 and then 3 processes and makes
# rank 0's disk slow.
# <!-- ja -->
# ### 練習問題 06.3: ランク 0 のチェックポイント
#
# すべてのプロセスが DDP でラップした `model` を渡して呼ぶ `save_checkpoint(model, path)` を書いてください。呼んだあと、`path` にはふつうのモデルが読み込める形式（2章の形式）のパラメータが、この章のチェックポイントと同じ書き方で書かれていて、しかもファイルができる前に戻るプロセスがあってはいけません。チェックはプロセスを 2個、次に 3個動かし、ランク 0 のディスクを遅くします。

# %%
# %%worker ex06_checkpoint
# Exercise 06.3: starter
import os

import torch
import torch.distributed as dist


def save_checkpoint(model, path):
    """Write `model`'s parameters to `path` from one process; return in every process once the file exists."""
    raise NotImplementedError("06.3")

# %%
from ex06_checkpoint import save_checkpoint

check("06.3", save_checkpoint)

# %% [markdown]
# <!-- en -->
# ### More questions
#
# - Run the correctness check with 4 processes: `launch(one_step, 4, args=(X, y, 0.5))`. Is the difference to
#   `one_process` still below `1e-6`? Then try 3 processes: what does the message say, and why?
# - In a terminal, run `python -m mparlib.ddp --nproc 2 --model mlp --epochs 3 --subset 2048 --batch-size 64
#   --momentum 0.9 --out runs/a`. Run the same command with `--crash-at 3:5 --out runs/b`, and once more with
#   `--resume --out runs/b` (without `--crash-at`). Load both `checkpoint.pt` files with `torch.load` and compare
#   their `"model"` entries.
# - Rehearse the two-node run on `127.0.0.1` in two terminals, as shown above. What happens if you start only one
#   of them?
# <!-- ja -->
# ### その他の問い
#
# - 正しさの確認を 4個のプロセスで実行してください: `launch(one_step, 4, args=(X, y, 0.5))`。`one_process` との差は `1e-6` 未満のままでしょうか。次に 3個のプロセスで試してください。どんなメッセージが表示され、それはなぜでしょうか。
# - ターミナルで `python -m mparlib.ddp --nproc 2 --model mlp --epochs 3 --subset 2048 --batch-size 64 --momentum 0.9 --out runs/a` を実行してください。次に同じコマンドを `--crash-at 3:5 --out runs/b` を付けて実行し、さらに `--crash-at` を外して `--resume --out runs/b` を付けて実行してください。2つの `checkpoint.pt` を `torch.load` で読み込み、`"model"` の中身を比べてください。
# - 上で示した 2ノードの予行演習を、2つのターミナルを使って `127.0.0.1` 上で行ってください。一方だけを起動するとどうなるでしょうか。
