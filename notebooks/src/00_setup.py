# %% [markdown]
# <!-- en -->
# # 0. Setting up: devices, data and live plots
#
# This course teaches **data parallelism** in PyTorch: one model, many devices, each device working on its own
# slice of every mini-batch. Every chapter runs on a laptop without a GPU, on one GPU and on many, and proves
# its claims with code you can execute.
#
# | Chapter | What you learn |
# |---|---|
# | 00 Setup | the devices PyTorch sees, the course profile, Fashion-MNIST, live training plots |
# | 01 DataParallel basics | wrapping a module in `nn.DataParallel` and what one forward pass does |
# | 02 Attributes of a wrapped module | why custom methods disappear after wrapping, and checkpoints |
# | 03 `data_parallel` from primitives | `replicate`, `scatter`, `parallel_apply`, `gather` |
# | 04 Hybrid CPU/GPU models | an embedding on the CPU, the rest on the GPU; model parallelism |
# | 05 Multi-GPU ResNet-18 | training a ResNet-18 on Fashion-MNIST on one and on all devices |
# | 06 DistributedDataParallel | one process per device, `torchrun`, checkpoints that survive a crash |
# | 07 Performance | where the time goes, and how to use the hardware you already have |
# | 08 Collective communication | send/recv, an all-reduce built from them, bandwidth, DDP's gradient buckets, hangs |
# | 09 Sharding | where the memory goes, ZeRO from primitives, FSDP2, activation memory, sharded checkpoints |
# | 10 Model parallelism | tensor parallelism (one layer split across devices), pipelines across processes, 2D parallelism |
# | 11 Long sequences and many experts | sequence parallelism, ring attention (context parallelism), mixture of experts over all-to-all (expert parallelism), all the dimensions side by side |
# | 12 Planning a run | interleaved and zero-bubble pipeline schedules, a planner that predicts memory and step time of a layout, checked on 8 processes and used on paper for published runs, how to choose |
#
# Chapters 01-07 are about data parallelism. The last five look underneath and beyond it: the collective
# operations it is built on (08), sharding the model's state over the devices (09), splitting the model itself
# (10), splitting long sequences and many experts (11), and choosing how to combine all of them for a run (12).
#
# Code that several chapters share lives in the small package `mparlib`; a chapter defines what it teaches.
# <!-- ja -->
# # 0. 準備: デバイス、データ、学習曲線のライブ表示
#
# このコースでは PyTorch の**データ並列**を学びます。1つのモデルを複数のデバイスに置き、各デバイスがミニバッチの一部ずつを受け持つ方法です。どの章も GPU のないノート PC、GPU 1枚のマシン、複数の GPU を積んだマシンのいずれでも動き、本文の主張は実行できるコードで確かめます。
#
# | 章 | 内容 |
# |---|---|
# | 00 準備 | PyTorch から見えるデバイス、コースのプロファイル、Fashion-MNIST、学習曲線のライブ表示 |
# | 01 DataParallel の基本 | モジュールを `nn.DataParallel` でラップする方法と、1回の順伝播で起きること |
# | 02 ラップしたモジュールの属性 | ラップすると独自メソッドが見えなくなる理由と、チェックポイントの扱い |
# | 03 プリミティブから作る `data_parallel` | `replicate`、`scatter`、`parallel_apply`、`gather` |
# | 04 CPU と GPU にまたがるモデル | 埋め込みは CPU に、残りは GPU に置く構成とモデル並列 |
# | 05 複数 GPU での ResNet-18 | Fashion-MNIST で ResNet-18 を 1つのデバイスとすべてのデバイスで訓練する |
# | 06 DistributedDataParallel | デバイスごとに 1個のプロセス、`torchrun`、落ちても失われないチェックポイント |
# | 07 性能 | 時間がどこで使われているかを調べ、手元のハードウェアを使い切る |
# | 08 集合通信 | send/recv、それで組み立てるオールリデュース、帯域幅、DDP の勾配バケット、ハング |
# | 09 シャーディング | メモリの内訳、プリミティブから作る ZeRO、FSDP2、活性化のメモリ、シャーディングしたチェックポイント |
# | 10 モデル並列 | テンソル並列（1つの層を複数のデバイスに分ける）、プロセスをまたぐパイプライン、2次元並列 |
# | 11 長い系列と多数のエキスパート | シーケンス並列、リングアテンション（コンテキスト並列）、オールツーオールで動く MoE（エキスパート並列）、すべての次元の比較 |
# | 12 訓練のプラン | インターリーブとゼロバブルのパイプラインのスケジュール、レイアウトのメモリと 1ステップの時間を予測するプランナー、8個のプロセスでの検証と公表された訓練の机上検討、レイアウトの選び方 |
#
# 1〜7章はデータ並列を扱います。最後の 5つの章では、その下と先に進みます。データ並列を支える集合通信（8章）、モデルの状態をデバイスに分けて持つシャーディング（9章）、モデルそのものの分割（10章）、長い系列と多数のエキスパートの分割（11章）、そしてそれらを組み合わせて 1つの訓練の分け方を選ぶ方法（12章）です。
#
# 複数の章で使うコードは小さなパッケージ `mparlib` にまとめています。各章で教える内容そのものは、その章のノートブックの中で定義します。

# %% [markdown]
# <!-- en -->
# ## The machine this notebook runs on
#
# `mparlib.report()` prints one table: software versions, the GPUs PyTorch sees, and the course profile. The
# output depends on your machine, so it will differ from the one stored here.
# <!-- ja -->
# ## このノートブックを実行しているマシン
#
# `mparlib.report()` はソフトウェアのバージョン、PyTorch から見える GPU、コースのプロファイルを 1つの表にまとめて表示します。出力はマシンごとに異なるので、ここに保存されている出力と違っていても問題ありません。

# %% tags=["nbval-ignore-output"]
import torch

import mparlib
from mparlib.data import load_fashion_mnist, text_labels
from mparlib.lang import tr
from mparlib.plot import Animator

mparlib.plot.use_course_style()  # a font with Japanese glyphs for this notebook's figures
print(mparlib.report())
print(mparlib.profile_line())

# %% [markdown]
# <!-- en -->
# ## No GPU? Where the real experiments run
#
# Every chapter runs on the machine you have. Without a GPU, the `smoke` profile (next section) keeps the
# experiments small, and **simulated devices**, the CPU listed several times, show how data parallelism splits the
# work. What a CPU cannot show is the real thing: training at full size, and the speed-up of several GPUs. For that,
# hosted notebooks lend you GPUs free of charge, within a usage quota:
#
# - **Google Colab** gives a notebook one GPU, for example an NVIDIA T4: in the menu, Runtime > Change runtime type
#   > T4 GPU. One GPU runs every experiment at full size; the parts of chapters 01-06 that need two GPUs still run
#   on simulated devices or as CPU processes.
# - **Kaggle** gives one notebook two GPUs, "GPU T4 x2" (in the notebook's Settings > Accelerator). That is
#   enough for chapters 01-06 on real hardware: `nn.DataParallel` really splits each batch over two GPUs, and DDP
#   runs two processes with the nccl backend. Kaggle asks you to verify a phone number before it turns on GPUs and
#   internet access, and the notebook needs internet access to install the course.
#
# When the course is published from a repository (its address set as `repository` in `book.toml`), every notebook
# and every page of the book starts with what a hosted notebook needs: a line of links, "Open in Colab" and "Open in
# Kaggle", which open that very notebook there, and a code cell that installs the course (about a minute) and does
# nothing where the course is already installed, as it did here. After that, the notebook runs as it does on your
# own machine, and since PyTorch now sees a GPU, the profile is `full`.
# <!-- ja -->
# ## GPU がない場合: 本物の実験を動かせる場所
#
# どの章も手元のマシンで動きます。GPU がなければ、`smoke` プロファイル（次の節）が実験を小さく保ち、**模擬デバイス**（CPU を何回か並べたリスト）がデータ並列による仕事の分け方を見せます。CPU では見せられないのは本物の実験、つまり本来の規模の訓練と、複数の GPU による高速化です。これには、GPU を無料で（利用時間の上限の範囲で）貸してくれるクラウドのノートブックを使えます。
#
# - **Google Colab** では、1つのノートブックで GPU 1枚（たとえば NVIDIA T4）を使えます。メニューの「ランタイム」>「ランタイムのタイプを変更」で「T4 GPU」を選びます。GPU 1枚でどの実験も本来の規模で動きますが、1〜6章のうち GPU 2枚を必要とする部分は、模擬デバイスか CPU のプロセスで動きます。
# - **Kaggle** では、1つのノートブックで GPU 2枚（「GPU T4 x2」）を使えます。ノートブックの「Settings」>「Accelerator」で選びます。これで 1〜6章を本物のハードウェアで実行できます。`nn.DataParallel` は各バッチを本当に 2枚の GPU に分け、DDP は nccl バックエンドで 2個のプロセスを動かします。Kaggle では、GPU とインターネット接続を有効にする前に電話番号の確認を求められます。コースのインストールにはインターネット接続が必要です。
#
# コースをリポジトリから公開している場合（`book.toml` の `repository` にアドレスを設定した場合）、どのノートブックにも、本のどのページにも、クラウドのノートブックに必要なものが先頭に付きます。1つは「Colab で開く」「Kaggle で開く」のリンクで、そのノートブックをそのままクラウドで開きます。もう 1つはコースをインストールするコードセルです（1分ほどかかります）。コースがインストール済みの環境では、ここでそうだったように何もしません。インストールが済めば、ノートブックは手元のマシンと同じように動きます。PyTorch から GPU が見えるので、プロファイルは `full` になります。

# %% [markdown]
# <!-- en -->
# ## The course profile
#
# Training a ResNet-18 on all of Fashion-MNIST takes minutes on a GPU and hours on a laptop CPU. Each chapter
# therefore sizes its experiments from one setting, the **course profile**:
#
# - `smoke`: small subsets and one epoch, so that a chapter finishes in about a minute on a CPU. The default on
#   a machine without a GPU.
# - `full`: the real experiment. The default when PyTorch sees a GPU.
#
# To choose, set the environment variable before starting Jupyter, for example `MPARLIB_PROFILE=full make lab`.
# <!-- ja -->
# ## コースのプロファイル
#
# Fashion-MNIST 全体で ResNet-18 を訓練すると、GPU なら数分、ノート PC の CPU では数時間かかります。そこで各章は、**コースのプロファイル**という 1つの設定から実験の規模を決めます。
#
# - `smoke`: 小さな部分集合で 1エポックだけ動かし、CPU でも 1章が 1分ほどで終わります。GPU のないマシンでの既定値です。
# - `full`: 本来の規模の実験です。PyTorch が GPU を認識している場合の既定値です。
#
# プロファイルを選ぶには、Jupyter を起動する前に環境変数を設定します（例: `MPARLIB_PROFILE=full make lab`）。

# %%
PROFILE = mparlib.profile()
assert PROFILE in ("smoke", "full")

# %% [markdown]
# <!-- en -->
# ## Devices
#
# A device is where tensors live and where kernels run: `cpu`, `cuda:0`, `cuda:1`, ... Three helpers answer
# the questions every chapter asks:
#
# - `mparlib.num_gpus()`: how many GPUs PyTorch can use.
# - `mparlib.try_gpu(i)`: GPU `i` if it exists, otherwise the CPU.
# - `mparlib.try_all_gpus()`: all GPUs, or `[cpu]` when there are none.
#
# The last one differs from d2l 1.0.3's function of the same name, which returns an empty list on a machine
# without a GPU, so that `devices[0]` fails. The course's version always returns at least one device.
# <!-- ja -->
# ## デバイス
#
# デバイスとは、テンソルが置かれ、カーネルが実行される場所のことです（`cpu`、`cuda:0`、`cuda:1` など）。どの章でも必要になる問いには、次の 3つの関数が答えます。
#
# - `mparlib.num_gpus()`: PyTorch が使える GPU の枚数を返します。
# - `mparlib.try_gpu(i)`: GPU `i` があればそれを、なければ CPU を返します。
# - `mparlib.try_all_gpus()`: すべての GPU を返します。GPU がなければ `[cpu]` を返します。
#
# 最後の関数は、d2l 1.0.3 にある同名の関数とは振る舞いが異なります。d2l 版は GPU のないマシンで空のリストを返すため、`devices[0]` がエラーになります。このコースの関数は必ず 1つ以上のデバイスを返します。

# %% tags=["nbval-ignore-output"]
devices = mparlib.try_all_gpus()
print("try_all_gpus():", devices)
print("try_gpu(0):    ", mparlib.try_gpu(0))

# %%
assert len(devices) >= 1
assert len(devices) == max(1, mparlib.num_gpus())
assert all(d.type == ("cuda" if mparlib.num_gpus() else "cpu") for d in devices)

# %% [markdown]
# <!-- en -->
# ## Fashion-MNIST
#
# The chapters train on Fashion-MNIST: 60,000 training and 10,000 test images of clothing, 28x28 pixels in
# grey scale, in 10 classes. `load_fashion_mnist` looks for the files offline first (the folder in
# `$MPARLIB_DATA`, the user cache, and `/usr/share/datasets/fashion-mnist` from the Debian package
# `dataset-fashion-mnist`), checks them, and downloads them only when they are nowhere to be found. It returns
# two iterators over mini-batches, one for training and one for testing.
# <!-- ja -->
# ## Fashion-MNIST
#
# 各章では Fashion-MNIST で訓練します。衣料品を写した 28x28 ピクセルのグレースケール画像で、訓練用 60,000枚とテスト用 10,000枚が 10クラスに分かれています。`load_fashion_mnist` はまずオフラインでファイルを探し（`$MPARLIB_DATA` のフォルダ、ユーザーのキャッシュ、Debian パッケージ `dataset-fashion-mnist` が置く `/usr/share/datasets/fashion-mnist`）、中身を検査します。どこにも見つからないときだけダウンロードします。戻り値は訓練用とテスト用の 2つのミニバッチのイテレータです。

# %%
train_iter, test_iter = load_fashion_mnist(batch_size=18)
X, y = next(iter(test_iter))
print(tr("images:", "画像:"), tuple(X.shape), X.dtype,
      tr(f"values in [{X.min():.0f}, {X.max():.0f}]", f"値の範囲 [{X.min():.0f}, {X.max():.0f}]"))
print(tr("labels:", "ラベル:"), tuple(y.shape), y.dtype)

# %% [markdown]
# <!-- en -->
# Each batch holds images of shape (batch, channels, height, width) and integer labels. The test iterator
# keeps the file order, so the first batch is always the same 18 images. Their class names come from
# `text_labels`, in the language of this notebook:
# <!-- ja -->
# 各バッチは形状が（バッチ、チャネル、高さ、幅）の画像と整数のラベルからなります。テスト用イテレータはファイルの順序を保つので、最初のバッチはいつも同じ 18枚です。クラス名は `text_labels` で取得でき、このノートブックの言語で表示されます。

# %%
import matplotlib.pyplot as plt

fig, axes = plt.subplots(2, 9, figsize=(11, 3.2))
for ax, image, name in zip(axes.flat, X, text_labels(y)):
    ax.imshow(image[0], cmap="gray_r")
    ax.set_title(name, fontsize=9)
    ax.axis("off")
fig.suptitle(tr("The first 18 test images", "テストデータの最初の 18枚"))
plt.show()
print(text_labels(y[:6]))

# %% [markdown]
# <!-- en -->
# ## Live training curves
#
# Training loops report progress once per epoch. `mparlib.plot.Animator` draws those numbers as they arrive.
# In JupyterLab it shows **one** image and replaces it in place at each update, so text printed in the same
# cell stays visible; in a script, or under `torchrun`, it writes a PNG file instead and prints one line per
# update.
#
# A short demonstration: a softmax regression (one linear layer) trained for a few epochs on a small part of
# the training set, with the training loss and the test accuracy drawn after every epoch.
#
# The course draws its figures with a font that has Japanese glyphs: `mparlib.plot.use_course_style()`, called
# in this notebook's first cell, sets it (importing mparlib changes nothing in matplotlib), and
# `with mparlib.plot.course_style():` applies the same style to the figures made inside the block only.
# `mparlib.plot.figure_png(fig)` renders a figure to PNG bytes with no date in them. The training loops' progress
# bars come from `mparlib.progress.progress_bar`: shown in a terminal and in Jupyter (where
# `mparlib.progress.in_kernel()` is true), left out when `mparlib.progress.quiet()` is true (under pytest, and with
# `MPARLIB_QUIET=1`, which builds the stored notebooks).
# <!-- ja -->
# ## 学習曲線のライブ表示
#
# 訓練ループはエポックごとに進み具合を報告します。`mparlib.plot.Animator` はその値が届くたびにグラフを描きます。JupyterLab では画像を **1枚**だけ表示し、更新のたびにその場で差し替えるため、同じセルで出力したテキストも消えません。スクリプトや `torchrun` の下では PNG ファイルを書き出し、更新ごとに 1行を表示します。
#
# 簡単な例として、ソフトマックス回帰（線形層 1つ）を訓練データの一部で数エポック訓練し、エポックごとに訓練損失とテスト精度を描きます。
#
# コースの図は日本語を表示できるフォントで描きます。このノートブックの最初のセルで呼んだ `mparlib.plot.use_course_style()` がその設定で、mparlib をインポートしただけでは matplotlib の設定は何も変わりません。`with mparlib.plot.course_style():` と書けば、その中で作る図だけに同じ設定を使えます。`mparlib.plot.figure_png(fig)` は図を日時の入らない PNG のバイト列にします。訓練ループの進捗バーは `mparlib.progress.progress_bar` が出します。ターミナルでも、Jupyter の中（`mparlib.progress.in_kernel()` が真のとき）でも表示されますが、`mparlib.progress.quiet()` が真のとき（pytest の下と、保存するノートブックを作るときに設定する `MPARLIB_QUIET=1` のとき）は表示しません。

# %%
torch.manual_seed(0)
n_train, n_test = (6000, 1000) if PROFILE == "smoke" else (60000, 10000)
train_iter, test_iter = load_fashion_mnist(batch_size=256, subset=(n_train, n_test))
net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 10))
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
loss_fn = torch.nn.CrossEntropyLoss()
num_epochs = 5
animator = Animator(xlabel=tr("epoch", "エポック"), xlim=[1, num_epochs],
                    legend=[tr("train loss", "訓練損失"), tr("test accuracy", "テスト精度")])
history = []
for epoch in range(1, num_epochs + 1):
    total, count = 0.0, 0
    for X, y in train_iter:
        loss = loss_fn(net(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total, count = total + loss.item() * len(y), count + len(y)
    with torch.no_grad():
        correct = sum((net(X).argmax(1) == y).sum().item() for X, y in test_iter)
    history.append((total / count, correct / n_test))
    animator.add(epoch, history[-1])
print(tr(f"{num_epochs} epochs done; the figure above was updated in place after each one.",
         f"{num_epochs}エポックが終わりました。上の図はエポックごとにその場で更新されました。"))

# %%
losses, accuracies = zip(*history)
assert len(history) == num_epochs
assert losses[-1] < losses[0], "the training loss should fall"
assert accuracies[-1] > 0.7, "softmax regression reaches well above chance (0.1) on Fashion-MNIST"
assert animator.handle is not None or not animator.display

# %% [markdown]
# <!-- en -->
# ## Timing on a GPU
#
# GPU kernels run **asynchronously**: a call returns as soon as the work is queued. A stopwatch that reads the
# clock right after the call measures how long it took to queue the work, not to do it. `mparlib.Timer` waits
# for the GPU (`torch.cuda.synchronize()`) before each reading; on a CPU it simply reads the clock.
# <!-- ja -->
# ## GPU での時間計測
#
# GPU のカーネルは**非同期**に実行されます。関数の呼び出しは処理をキューに積んだ時点で戻ってくるため、呼び出し直後に時計を読むと、処理そのものではなくキューに積むまでの時間を測ることになります。`mparlib.Timer` は時計を読む前に GPU の処理が終わるのを待ちます（`torch.cuda.synchronize()`）。CPU ではそのまま時計を読みます。

# %% tags=["nbval-ignore-output"]
device = mparlib.try_gpu()
A = torch.randn(1024, 1024, device=device)
timer = mparlib.Timer()
for _ in range(3):
    with timer:
        B = A @ A
print(tr(f"1024x1024 matmul on {device}: {timer.avg() * 1e3:.2f} ms on average over {len(timer.times)} runs",
         f"{device} での 1024x1024 の行列積: {len(timer.times)}回の平均 {timer.avg() * 1e3:.2f} ms"))

# %%
assert len(timer.times) == 3 and all(t > 0 for t in timer.times)

# %% [markdown]
# <!-- en -->
# ## When something goes wrong
#
# Every error the course raises on purpose says what was wrong and how to fix it, in the notebook's language,
# and derives from `mparlib.errors.MparlibError`. Each area has its own class, which also derives from the
# built-in exception a Python programmer would expect, so `except ValueError` keeps working:
#
# | class | raised when | also a |
# |---|---|---|
# | `ConfigError` | a setting cannot work (`lr=nan`, `nproc=0`, a batch size of 0) | `ValueError` |
# | `DeviceError` | a device does not exist here, or cannot be used that way | `ValueError` |
# | `DataError`, `DataNotFoundError`, `CorruptDataError` | the data set is missing, incomplete or damaged | `FileNotFoundError`, `ValueError` |
# | `CheckpointError`, `CheckpointMismatchError` | a checkpoint cannot be written or read back, or does not fit the model | `ValueError` |
# | `LaunchError`, `WorkerFailed` | processes cannot start or meet, or one of them failed | `RuntimeError` |
# | `TrainingDiverged` | the loss became NaN or infinite (the message names the epoch and step) | `ArithmeticError` |
# | `OutputLocked` | another run is writing into the same output folder | `RuntimeError` |
#
# The command-line programs of the course (`python -m mparlib.train`, `python -m mparlib.ddp`) print these as one
# line starting with `error:`; any other exception is a bug and shows its full traceback.
# <!-- ja -->
# ## うまくいかないとき
#
# コースが意図して出すエラーは、何が悪かったのかと直し方を、ノートブックの言語で伝えます。どれも `mparlib.errors.MparlibError` を継承しています。分野ごとに専用のクラスがあり、Python のプログラマーが期待する組み込みの例外も継承しているので、`except ValueError` のようなコードもそのまま動きます。
#
# | クラス | 発生する場面 | 継承する組み込みの例外 |
# |---|---|---|
# | `ConfigError` | 動くはずのない設定（`lr=nan`、`nproc=0`、バッチサイズ 0 など） | `ValueError` |
# | `DeviceError` | このマシンにないデバイス、またはその使い方ができないデバイス | `ValueError` |
# | `DataError`、`DataNotFoundError`、`CorruptDataError` | データセットがない、そろっていない、壊れている | `FileNotFoundError`、`ValueError` |
# | `CheckpointError`、`CheckpointMismatchError` | チェックポイントを書けない、読み戻せない、モデルに合わない | `ValueError` |
# | `LaunchError`、`WorkerFailed` | プロセスを起動できない、落ち合えない、どれかが失敗した | `RuntimeError` |
# | `TrainingDiverged` | 損失が NaN か無限大になった（メッセージにエポックとステップが入ります） | `ArithmeticError` |
# | `OutputLocked` | 別の訓練が同じ出力フォルダに書き込んでいる | `RuntimeError` |
#
# コースのコマンドラインプログラム（`python -m mparlib.train`、`python -m mparlib.ddp`）は、これらを `error:` で始まる 1行で表示します。それ以外の例外はバグなので、トレースバックをすべて表示します。

# %%
from mparlib import errors

try:
    mparlib.check_device("cuda:99")
except errors.MparlibError as e:
    print(type(e).__name__, isinstance(e, errors.DeviceError), isinstance(e, ValueError))

# %% [markdown]
# <!-- en -->
# Arguments are checked before any work starts, and always by the same small module, `mparlib.checks`: `is_int`
# (an int that is not a bool), `positive_int`, `int_in`, `finite_float`, `seconds`, `flag` (`True` or `False`) and
# `one_of`. Each returns the value it accepted, or raises `ConfigError` naming the argument, the value it got and
# an example of a good one. Every function and command line of the course that takes such a setting calls them,
# so a mistake reads the same wherever it is made:
# <!-- ja -->
# 引数は、処理を始める前に、いつも同じ小さなモジュール `mparlib.checks` で検査します。`is_int`（bool ではない整数）、`positive_int`、`int_in`、`finite_float`、`seconds`、`flag`（`True` か `False`）、`one_of` の 7つです。どれも受け付けた値を返すか、引数の名前、渡された値、正しい値の例を示す `ConfigError` を送出します。コースの関数とコマンドラインは、こうした設定を受け取るときに必ずこれらを呼ぶので、どこで間違えても同じ形のメッセージになります。

# %%
from mparlib import checks

for bad in (0, 2.5, True):  # True is an int to Python, but never a batch size
    try:
        checks.positive_int(bad, "batch_size", 256)
    except errors.ConfigError as e:
        print(e)
print(checks.finite_float(0.1, "lr"), checks.flag(False, "verify"), checks.one_of("gloo", "backend", ("gloo", "nccl")))

# %% [markdown]
# <!-- en -->
# ## Summary
#
# - `mparlib.try_all_gpus()` always returns at least one device; d2l 1.0.3's version returns `[]` without a GPU.
# - The course profile (`smoke` or `full`, from `MPARLIB_PROFILE`) sizes every experiment to your machine.
# - `load_fashion_mnist` finds the data offline, checks it, and returns training and test iterators.
# - `Animator` updates one figure in place in JupyterLab and writes a PNG elsewhere.
# - Time GPU work only after synchronising.
# - Without a GPU every chapter still runs; for the real experiments, open the notebooks on Colab (one GPU) or
#   Kaggle (two GPUs).
#
# ## Exercises
#
# 1. Call `load_fashion_mnist(batch_size=256)` and count the batches of `train_iter` with `len(train_iter)`.
#    Explain the number from 60,000 images and the batch size (the last, partial batch is kept).
# 2. Run the demonstration with `lr=0.01` instead of `0.1`. How does the curve change after 5 epochs?
# 3. Start Jupyter with `MPARLIB_PROFILE=full` and check what `mparlib.profile()` returns.
# <!-- ja -->
# ## まとめ
#
# - `mparlib.try_all_gpus()` は必ず 1つ以上のデバイスを返します。d2l 1.0.3 の同名の関数は GPU がないと `[]` を返します。
# - コースのプロファイル（`smoke` または `full`、環境変数 `MPARLIB_PROFILE` で変更）が、各実験の規模をマシンに合わせます。
# - `load_fashion_mnist` はデータをオフラインで探して検査し、訓練用とテスト用のイテレータを返します。
# - `Animator` は JupyterLab では 1枚の図をその場で更新し、それ以外の環境では PNG を書き出します。
# - GPU の処理時間は、同期してから測ります。
# - GPU がなくてもどの章も動きます。本物の実験には、ノートブックを Colab（GPU 1枚）か Kaggle（GPU 2枚）で開きます。
#
# ## 練習問題
#
# 1. `load_fashion_mnist(batch_size=256)` を呼び、`len(train_iter)` で訓練用イテレータのバッチ数を数えてください。60,000枚とバッチサイズからその数を説明してください（端数の最後のバッチも含まれます）。
# 2. 例の学習率を `0.1` から `0.01` に変えて実行してください。5エポック後の曲線はどう変わるでしょうか。
# 3. `MPARLIB_PROFILE=full` を設定して Jupyter を起動し、`mparlib.profile()` の戻り値を確かめてください。
