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

print(mparlib.report())
print(mparlib.profile_line())

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
print("images:", tuple(X.shape), X.dtype, f"values in [{X.min():.0f}, {X.max():.0f}]")
print("labels:", tuple(y.shape), y.dtype)

# %% [markdown]
# <!-- en -->
# Each batch holds images of shape (batch, channels, height, width) and integer labels. The test iterator
# keeps the file order, so the first batch is always the same 18 images. Their class names come from
# `text_labels`, in the language of this notebook:
# <!-- ja -->
# 各バッチは形状が（バッチ、チャンネル、高さ、幅）の画像と整数のラベルからなります。テスト用イテレータはファイルの順序を保つので、最初のバッチはいつも同じ 18枚です。クラス名は `text_labels` で取得でき、このノートブックの言語で表示されます。

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
# <!-- ja -->
# ## 学習曲線のライブ表示
#
# 訓練ループはエポックごとに進み具合を報告します。`mparlib.plot.Animator` はその値が届くたびにグラフを描きます。JupyterLab では画像を**1枚**だけ表示し、更新のたびにその場で差し替えるため、同じセルで出力したテキストも消えません。スクリプトや `torchrun` の下では PNG ファイルを書き出し、更新ごとに 1行を表示します。
#
# 簡単な例として、ソフトマックス回帰（線形層 1つ）を訓練データの一部で数エポック訓練し、エポックごとに訓練損失とテスト精度を描きます。

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
         f"{num_epochs} エポックが終わりました。上の図はエポックごとにその場で更新されました。"))

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
         f"{device} での 1024x1024 の行列積: {len(timer.times)} 回の平均 {timer.avg() * 1e3:.2f} ms"))

# %%
assert len(timer.times) == 3 and all(t > 0 for t in timer.times)

# %% [markdown]
# <!-- en -->
# ## Summary
#
# - `mparlib.try_all_gpus()` always returns at least one device; d2l 1.0.3's version returns `[]` without a GPU.
# - The course profile (`smoke` or `full`, from `MPARLIB_PROFILE`) sizes every experiment to your machine.
# - `load_fashion_mnist` finds the data offline, checks it, and returns training and test iterators.
# - `Animator` updates one figure in place in JupyterLab and writes a PNG elsewhere.
# - Time GPU work only after synchronising.
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
#
# ## 練習問題
#
# 1. `load_fashion_mnist(batch_size=256)` を呼び、`len(train_iter)` で訓練用イテレータのバッチ数を数えてください。60,000枚とバッチサイズからその数を説明してください（端数の最後のバッチも含まれます）。
# 2. 例の学習率を `0.1` から `0.01` に変えて実行してください。5エポック後の曲線はどう変わるでしょうか。
# 3. `MPARLIB_PROFILE=full` を設定して Jupyter を起動し、`mparlib.profile()` の戻り値を確かめてください。
