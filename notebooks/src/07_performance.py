# %% [markdown]
# <!-- en -->
# # 7. Performance: training near the hardware's limit
#
# Chapter 05 trained ResNet-18 on Fashion-MNIST the way d2l does: a `DataLoader` that turns every image into a PIL
# image and back into a tensor, fp32 arithmetic, one small kernel after another. d2l's own build reports 12.3 s per
# epoch on one GPU, about 4,900 images/s. A modern GPU could do far more: this chapter measures how much more, finds
# where the time goes, and removes the obstacles one at a time, measuring each step.
#
# The tools are in `mparlib.fastpath`: `mparlib.loop.train(..., fast=True)` runs the same epoch loop with faster
# parts, and `fastpath.FastPath(...)` switches each of them on or off. The loop runs whatever `StepPlan` it is given
# (what a step calls, its optimizer, loss, batch layout and numeric precision): chapter 05's `classic_plan`, or the
# one that `fastpath.plan` builds from these options:
#
# | option | what it changes |
# |---|---|
# | `resident` | the whole data set lives on the device as `uint8`; batches are gathered and normalised there |
# | `channels_last` | model and batches in NHWC memory layout, the layout of the fast convolution kernels |
# | `precision` | bf16 autocast where the device computes bf16 natively (`bf16_native`; on a CPU, `cpu_has_bf16`), fp32 elsewhere |
# | `fused` | one fused SGD kernel for all parameters instead of one update per tensor (`make_fast_optimizer`) |
# | `momentum`, `warmup`, `label_smoothing` | a schedule that keeps accuracy when batches grow (`warmup_cosine`) |
# | `compile`, `cuda_graphs` | `torch.compile`, and replaying each step as a CUDA graph (GPUs); `warm_up` compiles before the first timed step and leaves the model as it was |
#
# The sizes follow the course profile: the smoke profile (no GPU) runs a few steps of each measurement, so the
# numbers are real but noisy, and its last section trains chapter 05's narrow ResNet-18 (`width=8`) on 4,000
# images to compare the accuracy of the two loops; the full profile (a GPU) runs the real experiment with d2l's
# network, including training to 91% test accuracy.
# <!-- ja -->
# # 7. 性能: ハードウェアの限界近くでの訓練
#
# 5章では、ResNet-18 を d2l と同じ方法で Fashion-MNIST に訓練しました。`DataLoader` が画像を 1枚ずつ PIL 画像にしてからテンソルに戻し、計算は fp32 で、小さなカーネルを 1つずつ順に実行する方法です。d2l 自身のビルドでは GPU 1枚で 1エポック 12.3秒、毎秒およそ 4,900枚という結果が報告されています。最近の GPU はこれよりはるかに多くの計算ができます。この章では、どれだけ多くできるのかを測り、時間がどこで使われているかを調べ、障害を 1つずつ取り除きながら、その効果をそのつど計測します。
#
# 道具は `mparlib.fastpath` にあります。`mparlib.loop.train(..., fast=True)` は同じエポックのループを、より速い部品で実行します。`fastpath.FastPath(...)` で部品を 1つずつ有効・無効にできます。ループは渡された `StepPlan`（1ステップで呼ぶもの、オプティマイザ、損失、バッチのメモリ配置、数値の精度）のとおりに実行します。5章の `classic_plan` か、次のオプションから `fastpath.plan` が組み立てたものです。
#
# | オプション | 変わること |
# |---|---|
# | `resident` | データセット全体を `uint8` のままデバイスに置き、バッチの切り出しと正規化もデバイス上で行う |
# | `channels_last` | モデルとバッチを NHWC のメモリ配置にする（高速な畳み込みカーネルが使う配置） |
# | `precision` | デバイスが bf16 をネイティブに計算できるときは bf16 の autocast（`bf16_native`。CPU では `cpu_has_bf16`）、それ以外では fp32 |
# | `fused` | パラメータごとに更新する代わりに、全パラメータを 1つの融合（fused）SGD カーネルで更新する（`make_fast_optimizer`） |
# | `momentum`、`warmup`、`label_smoothing` | バッチを大きくしても精度を保つための学習率スケジュールなど（`warmup_cosine`） |
# | `compile`、`cuda_graphs` | `torch.compile` と、各ステップを CUDA グラフとして再生する仕組み（GPU）。`warm_up` が最初の計測の前にコンパイルを済ませ、モデルは元の状態に戻す |
#
# 規模はコースのプロファイルに従います。`smoke` プロファイル（GPU なし）では各計測を数ステップだけ実行するので、数値は本物ですがばらつきが大きくなります。最後の節では、5章の細い ResNet-18（`width=8`）を 4,000枚の画像で訓練し、2つのループの精度を比べます。`full` プロファイル（GPU あり）では、d2l のネットワークでテスト精度 91% までの訓練を含む本来の実験を行います。

# %% tags=["nbval-ignore-output"]
import contextlib
import math
import os
import statistics
import time
import unicodedata

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.flop_counter import FlopCounterMode
from torchvision import transforms

import mparlib
import mparlib.plot

mparlib.plot.use_course_style()  # a font with Japanese glyphs for this notebook's figures
from mparlib import data, fastpath, sources
from mparlib import loop as T
from mparlib.step import autocast_context, make_optimizer, move_batch
from mparlib.lang import tr
from mparlib.models import init_weights, resnet18
from mparlib.timing import matmul_tflops, synchronize

print(mparlib.report())
print(mparlib.profile_line())
device = mparlib.try_gpu()
SIZES = {
    # batch: the d2l batch for the step-by-step table; big_batch: the larger batch; steps: batches per timed run
    "smoke": dict(batch=8, big_batch=16, steps=1, repeats=3, profile_steps=2, conv_repeats=3),
    "full": dict(batch=256, big_batch=1024, steps=40, repeats=3, profile_steps=10, conv_repeats=10),
}
S = SIZES[mparlib.profile()]
print(tr(f"device: {device}, bf16 native: {fastpath.bf16_native(device)}, sizes: {S}",
         f"デバイス: {device}、bf16 のネイティブ対応: {fastpath.bf16_native(device)}、規模: {S}"))


def cell(text, width, right=False):
    """``text`` padded to ``width`` columns for a printed table (East Asian wide characters take two)."""
    text = str(text)
    pad = " " * max(0, width - sum(1 + (unicodedata.east_asian_width(c) in "WF") for c in text))
    return pad + text if right else text + pad

# %% [markdown]
# <!-- en -->
# ## What one image costs
#
# Before timing anything, count the work. `torch.utils.flop_counter.FlopCounterMode` records the floating-point
# operations of every operator that runs inside it (a multiply-add counts as two). The count depends only on the
# model and the image size, not on the machine, so it prints the same everywhere.
# <!-- ja -->
# ## 画像 1枚あたりの計算量
#
# 時間を測る前に、仕事の量を数えます。`torch.utils.flop_counter.FlopCounterMode` は、その中で実行された演算子の浮動小数点演算の回数を記録します（積和 1回を 2回と数えます）。この回数はモデルと画像の大きさだけで決まり、マシンには依存しないので、どこで実行しても同じ値が表示されます。

# %%
torch.manual_seed(0)
net = resnet18(10)
X, y = torch.rand(2, 1, 28, 28), torch.tensor([0, 1])
with FlopCounterMode(display=False) as forward_count:
    net(X)
with FlopCounterMode(display=False) as step_count:
    nn.functional.cross_entropy(net(X), y).backward()
forward_flops = forward_count.get_total_flops() / len(X)  # per image
step_flops = step_count.get_total_flops() / len(X)
for what, flops in ((tr("forward:", "順伝播:"), forward_flops),
                    (tr("training step (forward + backward):", "訓練ステップ（順伝播 + 逆伝播）:"), step_flops)):
    print(cell(what, 36), tr(f"{flops / 1e9:.3f} GFLOP/image", f"画像 1枚あたり {flops / 1e9:.3f} GFLOP"))
by_stage = forward_count.get_flop_counts()
for name in ["Sequential.0"] + [f"Sequential.resnet_block{i}" for i in range(1, 5)] + ["Sequential.fc"]:
    share = sum(by_stage[name].values()) / len(X) / forward_flops
    label = tr("0 (stem)", "0（ステム）") if name == "Sequential.0" else name.removeprefix("Sequential.")
    print(f"  {cell(label, 15)} {100 * share:5.1f}%")

# %%
assert 2.9 < step_flops / forward_flops < 3.1  # backward costs about twice the forward

# %% [markdown]
# <!-- en -->
# A trained image costs about three times its forward pass: the backward pass computes gradients with respect to
# both the activations and the weights. The modified ResNet-18 keeps the full 28x28 resolution in its first stage,
# so the early, thin layers cost as much as the deep, wide ones.
#
# ## Where the time goes
#
# Now the chapter-05 loop itself: the torchvision-style data set and `DataLoader` (worker processes, pinned memory on
# a GPU), fp32, plain SGD. The profiler (`torch.profiler`) records every operator; `record_function` names the
# phases of a step. To charge each phase with its own GPU work, this diagnostic run synchronises after each phase
# (the training loop itself does not). The table shows per step: wall time, operators called and, on a GPU, kernel
# launches.
# <!-- ja -->
# 訓練する画像 1枚のコストは、順伝播の約 3倍です。逆伝播では、活性化と重みの両方に対する勾配を計算するからです。この修正版 ResNet-18 は最初のステージで 28x28 の解像度をそのまま保つので、前半の細い層が、後半の太い層と同じくらいの計算量になります。
#
# ## 時間の内訳
#
# 次に 5章のループそのものを調べます。torchvision 形式のデータセットと `DataLoader`（ワーカープロセスを使い、GPU ではピン留めメモリ（pinned memory）を使う）、fp32、素の SGD です。プロファイラ（`torch.profiler`）はすべての演算子を記録し、`record_function` でステップの各段階に名前を付けます。各段階に自分の GPU の仕事を正しく割り当てるため、この診断用の実行では段階ごとに同期します（訓練ループ自体は同期しません）。表には 1ステップあたりの実時間、呼ばれた演算子の数、GPU ではカーネル起動の回数を示します。

# %%
images, labels = sources.read_split(sources.locate(), "train")  # (60000, 28, 28) uint8, (60000,) int64
test_images, test_labels = sources.read_split(sources.locate(), "test")


def d2l_loaders(batch_size, n, n_test=16):
    """Chapter 05's input: PIL images through ToTensor in DataLoader workers (kept alive between epochs here)."""
    workers = min(4, os.cpu_count() or 1)
    train_set = data.FashionMNIST(images[:n], labels[:n], transforms.ToTensor())
    test_set = data.FashionMNIST(test_images[:n_test], test_labels[:n_test], transforms.ToTensor())
    train_iter = torch.utils.data.DataLoader(train_set, batch_size, shuffle=True, num_workers=workers,
                                             generator=torch.Generator().manual_seed(0),
                                             pin_memory=device.type == "cuda", persistent_workers=workers > 0)
    return train_iter, torch.utils.data.DataLoader(test_set, batch_size)


def resident_loaders(batch_size, n, n_test=16):
    """The fast path's input: uint8 images on the device, each batch gathered and scaled to [0, 1] there."""
    g = torch.Generator().manual_seed(0)
    return (data.ResidentLoader(images[:n], labels[:n], batch_size, shuffle=True, device=device, generator=g),
            data.ResidentLoader(test_images[:n_test], test_labels[:n_test], batch_size, shuffle=False, device=device))

# %% tags=["nbval-ignore-output"]
PHASES = [tr("data loading", "データの読み込み"), tr("host-to-device copy", "ホストからデバイスへの転送"),
          tr("forward", "順伝播"), tr("backward", "逆伝播"), tr("optimizer step", "オプティマイザのステップ")]
torch.manual_seed(0)
net = resnet18(10).to(device)
init_weights(net)
optimizer, loss_fn = make_optimizer(net, 0.1), nn.CrossEntropyLoss()
batches = iter(d2l_loaders(S["batch"], S["batch"] * (S["profile_steps"] + 1))[0])


def baseline_step(phase):
    """One step of the chapter-05 loop, each phase inside ``phase(name)`` and finished before the next."""
    with phase(PHASES[0]):
        X, y = next(batches)
    with phase(PHASES[1]):
        X, y = move_batch(X, y, device)
        synchronize(device)
    with phase(PHASES[2]):
        loss = loss_fn(net(X), y)
        synchronize(device)
    with phase(PHASES[3]):
        optimizer.zero_grad()
        loss.backward()
        synchronize(device)
    with phase(PHASES[4]):
        optimizer.step()
        synchronize(device)


baseline_step(lambda name: contextlib.nullcontext())  # warm-up: workers start, kernels are chosen
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
# The profiler's C++ library (Kineto) logs each start and stop, and without a GPU a failed GPU query, straight to
# the process's stderr; level 6 keeps it quiet. It reads the setting when the first profile of the process starts.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
with profile(activities=activities) as prof:
    for _ in range(S["profile_steps"]):
        baseline_step(record_function)

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
events = prof.events()
phase_rows = []
for name in PHASES:
    spans = [(e.time_range.start, e.time_range.end) for e in events if e.name == name]
    inside = [e for e in events if any(a <= e.time_range.start < b for a, b in spans)]  # any thread
    phase_rows.append(dict(phase=name, ms=sum(b - a for a, b in spans) / 1e3 / len(spans),
                           operators=sum(e.name.startswith("aten::") for e in inside) / len(spans),
                           launches=sum(e.name in LAUNCHES for e in inside) / len(spans)))
step_ms = sum(r["ms"] for r in phase_rows)
print(cell(tr("phase", "段階"), 28), cell(tr("ms/step", "ms/ステップ"), 11, True), cell(tr("share", "割合"), 7, True),
      cell(tr("operators", "演算子"), 10, True), cell(tr("kernel launches", "カーネル起動"), 16, True))
for r in phase_rows:
    print(f"{cell(r['phase'], 28)} {r['ms']:11.1f} {100 * r['ms'] / step_ms:6.1f}% {r['operators']:10.0f} "
          f"{r['launches']:16.0f}")
print(f"{cell(tr('one step', '1ステップ'), 28)} {step_ms:11.1f}   {S['batch'] / step_ms * 1e3:.0f} "
      + tr("images/s", "画像/秒"))

# %%
assert [r["phase"] for r in phase_rows] == PHASES and all(r["ms"] > 0 for r in phase_rows)
assert phase_rows[2]["operators"] > 0 and phase_rows[3]["operators"] > 0  # forward, backward
if device.type == "cpu":
    assert all(r["launches"] == 0 for r in phase_rows)  # a CPU runs operators, it launches no kernels
else:
    assert phase_rows[2]["launches"] > 0 and phase_rows[3]["launches"] > 0

# %% [markdown]
# <!-- en -->
# How to read the table depends on the device:
#
# - On a **CPU** forward and backward take almost all of the time: the processor that runs the model is the one
#   that also prepares the batches, and its arithmetic is slow enough to hide everything else. Only faster
#   arithmetic helps there (bf16 on CPUs that have bf16 units).
# - On a **GPU** the picture turns around. Each step calls about a thousand operators (the table counts them), each
#   one kernel launch or more, and many of these kernels are so small that the GPU finishes them before the CPU has
#   launched the next one. The data pipeline converts one image at a time in Python, and every batch crosses PCIe.
#   None of these costs shrinks when the GPU gets faster.
#
# ## One optimisation at a time
#
# `measure` trains the same number of images with each configuration through `mparlib.loop.train`, one epoch per
# run, after one untimed warm-up run (worker start, kernel selection and, with `compile`, compilation). The train
# loop's clock synchronises the device, and evaluation is not timed. The rows are cumulative: each adds one option
# to the row above. `momentum`, `warmup` and `label_smoothing` change what is learned, not the speed, so they stay at
# their defaults in every fast row. Timings vary from run to run, more so on a machine that other programs share and
# with the few steps of the smoke profile: compare rows of the same run, and repeat a surprising one.
# <!-- ja -->
# 表の読み方はデバイスによって変わります。
#
# - **CPU** では、順伝播と逆伝播がほぼすべての時間を占めます。モデルを計算するプロセッサがバッチの準備もしており、その演算が遅いので、ほかのコストは隠れてしまいます。効果があるのは演算そのものを速くすることだけです（bf16 の演算器を持つ CPU での bf16 など）。
# - **GPU** では状況が逆になります。1ステップで約 1,000個の演算子が呼ばれ（表で数えています）、それぞれが 1回以上のカーネル起動になります。その多くはとても小さいカーネルなので、CPU が次のカーネルを起動し終える前に GPU が計算を終えてしまいます。データパイプラインは Python で画像を 1枚ずつ変換し、バッチは毎回 PCIe を通ります。どのコストも、GPU が速くなっても小さくなりません。
#
# ## 最適化を 1つずつ
#
# `measure` は、各構成で同じ枚数の画像を `mparlib.loop.train` で訓練します。1回の実行は 1エポックで、その前に時間を測らないウォームアップ実行を 1回行います（ワーカーの起動、カーネルの選択、`compile` のときはコンパイル）。訓練ループの時計はデバイスと同期しており、評価の時間は含みません。各行は累積で、上の行にオプションを 1つ加えたものです。`momentum`、`warmup`、`label_smoothing` は学習の中身を変えますが速度は変えないので、高速パスのどの行でも既定値のままにしています。計測時間は実行のたびに変わります。ほかのプログラムと共有しているマシンや、ステップ数の少ない `smoke` プロファイルでは特にそうです。同じ実行の中の行どうしを比べ、意外な結果が出た行は計測し直してください。

# %%
def measure(fast, batch_size, n_images, repeats):
    """Median images/s of ``repeats`` one-epoch train() runs over ``n_images`` images, after a warm-up run."""
    torch.manual_seed(0)
    net = resnet18(10)
    loaders = (d2l_loaders if fast is None else resident_loaders)(batch_size, n_images)
    rates = []
    for run in range(repeats + 1):
        hist = T.train(net, [device], batch_size=batch_size, lr=0.01, num_epochs=1, data=loaders, animator=False,
                       init=run == 0, progress=False, verbose=False, fast=fast)
        if run > 0:
            rates.append(hist.images_per_s[0])
    return dict(images_per_s=statistics.median(rates), images=round(hist.images_per_s[0] * hist.seconds[0]),
                precision=hist.fast["precision"] if hist.fast else "fp32")


B, BIG = S["batch"], S["big_batch"]
N = S["steps"] * BIG  # the same images for every row; whole batches at both sizes
step1 = dict(resident=True, channels_last=False, precision="fp32", fused=False, compile=False, cuda_graphs=False)
step2 = {**step1, "channels_last": True}
step3 = {**step2, "precision": "auto"}
step4 = {**step3, "fused": True}
step6 = {**step4, "compile": True}
step7 = {**step6, "cuda_graphs": True}
PLAN = [
    (tr("chapter-05 loop: DataLoader, fp32", "5章のループ: DataLoader、fp32"), None, B),
    (tr("+ data resident on the device", "+ データをデバイスに常駐"), step1, B),
    (tr("+ channels_last", "+ channels_last"), step2, B),
    (tr("+ bf16 autocast where native", "+ ネイティブなら bf16 autocast"), step3, B),
    (tr("+ fused SGD", "+ 融合 SGD"), step4, B),
    (tr(f"+ batch {BIG}", f"+ バッチ {BIG}"), step4, BIG),
    (tr("+ torch.compile", "+ torch.compile"), step6, BIG),
    (tr("+ CUDA graphs", "+ CUDA グラフ"), step7, BIG),
]

# %% tags=["nbval-ignore-output"]
results = []
for label, options, batch_size in PLAN:
    skip = None
    if options and options["cuda_graphs"] and device.type != "cuda":
        skip = tr("needs a CUDA GPU", "CUDA の GPU が必要")
    elif options and options["compile"] and mparlib.profile() == "smoke":
        skip = tr("smoke profile: compiling takes minutes on a CPU", "smoke: CPU ではコンパイルに数分かかる")
    row = dict(step=label, batch=batch_size, skipped=skip)
    if skip is None:
        row.update(measure(fastpath.FastPath(**options) if options else None, batch_size, N, S["repeats"]))
    results.append(row)
base = results[0]["images_per_s"]
print(cell(tr("step", "ステップ"), 36), cell(tr("batch", "バッチ"), 6, True), cell(tr("format", "数値形式"), 9, True),
      cell(tr("images/s", "画像/秒"), 10, True), cell(tr("vs. ch. 05", "5章比"), 9, True))
for r in results:
    if r["skipped"]:
        print(f"{cell(r['step'], 36)} {r['batch']:>6}   {tr('skipped', '省略')}: {r['skipped']}")
    else:
        print(f"{cell(r['step'], 36)} {r['batch']:>6} {r['precision']:>9} {r['images_per_s']:>10.1f} "
              f"{r['images_per_s'] / base:>8.2f}x")

# %%
measured = [r for r in results if not r["skipped"]]
assert all(r["images"] == N for r in measured)  # every row trained the same images
assert all(r["images_per_s"] > 0 and math.isfinite(r["images_per_s"]) for r in measured)
assert all(r["precision"] == ("bf16" if fastpath.bf16_native(device) else "fp32") for r in measured[3:])
if device.type == "cuda":
    assert max(r["images_per_s"] for r in measured) > 2 * base

# %% [markdown]
# <!-- en -->
# What each step removes, and where it pays:
#
# - **Resident data.** Fashion-MNIST is 47 MB as `uint8`: it fits on any GPU. Gathering a batch with one indexing
#   operation and scaling it to [0, 1] there replaces per-image PIL decoding in worker processes and the PCIe copy
#   of every batch. On a GPU this is usually the largest single step; on a CPU it only frees the cores that the
#   workers used.
# - **`channels_last`.** Tensor-core convolution kernels read NHWC; in NCHW layout cuDNN first transposes. CPUs gain
#   little.
# - **bf16 autocast.** Matrix products and convolutions run in bf16 (half the bytes, and on GPUs tensor cores);
#   weights, the optimizer and the loss sums stay fp32. Unlike fp16, bf16 keeps fp32's exponent range, so no loss
#   scaling is needed. `precision="auto"` uses it only where the device has bf16 units; elsewhere it would be slower.
# - **Fused SGD.** One kernel updates all 76 parameter tensors at once instead of several kernels per tensor.
# - **Larger batch.** Fewer steps per epoch, so fewer launches and larger kernels that fill the GPU. To keep the
#   accuracy, the fast path uses SGD with Nesterov momentum, a learning rate that rises linearly over the first 20% of
#   the steps and then falls along a cosine, and label smoothing 0.1.
# - **`torch.compile`** fuses chains of small operators (batch norm, ReLU, additions) into a few generated kernels;
#   **CUDA graphs** record the whole forward and backward once and replay them with a single launch per step.
#
# None of these steps waits for the device inside the step. The loss and the number of correct predictions are
# summed on the device and read once per epoch: a `float(loss)` after each batch, as in d2l's loop, would make the
# CPU wait for the GPU every step, and the GPU then idles while the CPU launches the next kernels.
#
# ## The roofline of this model on your device
#
# A kernel is limited either by arithmetic (the peak FLOP/s of the device) or by memory traffic. A kernel's
# **arithmetic intensity** is the number of FLOPs it does per byte it moves to or from memory; memory can then feed
# it at most bandwidth (bytes/s) x intensity (FLOP/byte) FLOP/s. The **roofline** draws both limits as one bound:
# attainable FLOP/s = min(peak, bandwidth x intensity). Both are measured here: the peak with a large matrix product,
# the bandwidth with a large copy.
# <!-- ja -->
# 各ステップが何を取り除き、どこで効くのかをまとめます。
#
# - **データの常駐。** Fashion-MNIST は `uint8` で 47 MB なので、どの GPU にも載ります。1回のインデックス演算でバッチを切り出し、その場で [0, 1] に正規化すれば、ワーカープロセスでの画像 1枚ごとの PIL 変換と、バッチごとの PCIe 転送がなくなります。GPU ではたいていこれが最も大きな 1歩です。CPU では、ワーカーが使っていたコアが空くだけです。
# - **`channels_last`。** Tensor コアの畳み込みカーネルは NHWC で読み込みます。NCHW の配置だと、cuDNN は先に転置を行います。CPU での効果は小さいです。
# - **bf16 の autocast。** 行列積と畳み込みを bf16 で計算します（バイト数が半分になり、GPU では Tensor コアを使います）。重み、オプティマイザ、損失の合計は fp32 のままです。fp16 と違って bf16 は fp32 と同じ指数の範囲を持つので、損失のスケーリングは要りません。`precision="auto"` は、デバイスに bf16 の演算器があるときだけ bf16 を使います。ないデバイスではかえって遅くなるからです。
# - **融合 SGD。** テンソルごとに複数のカーネルを起動する代わりに、1つのカーネルで 76個のパラメータテンソルをまとめて更新します。
# - **大きなバッチ。** 1エポックあたりのステップ数が減るので、カーネル起動が減り、GPU を埋める大きなカーネルになります。精度を保つため、高速パスでは Nesterov モーメンタム付きの SGD、最初の 20% のステップで線形に上がってからコサインに沿って下がる学習率、0.1 のラベル平滑化（label smoothing）を使います。
# - **`torch.compile`** は、小さな演算子の連なり（バッチ正規化、ReLU、加算）を少数の生成カーネルに融合します。**CUDA グラフ** は順伝播と逆伝播の全体を 1度記録し、1ステップを 1回の起動で再生します。
#
# どのステップも、ステップの途中でデバイスを待ちません。損失と正解数はデバイス上で合計し、エポックごとに 1回だけ読み出します。d2l のループのようにバッチごとに `float(loss)` を呼ぶと、CPU は毎ステップ GPU を待つことになり、その間 CPU が次のカーネルを起動できないので、今度は GPU が遊んでしまいます。
#
# ## このモデルのルーフライン
#
# カーネルの速さを制限するのは、演算（デバイスのピーク FLOP/s）かメモリの転送量のどちらかです。カーネルがメモリとの間で 1バイトを転送するあいだに行う FLOP 数を、そのカーネルの**演算強度**（FLOP/バイト）と呼びます。メモリが供給できる計算は、多くても帯域幅（バイト/秒）× 演算強度の FLOP/s です。**ルーフライン**は、この 2つの限界を 1本の上限として描きます。到達可能な FLOP/s は、ピークと「帯域幅 × 演算強度」の小さいほうです。ここでは両方を計測します。ピークは大きな行列積で、帯域幅は大きなコピーで測ります。

# %% tags=["nbval-ignore-output"]
def copy_gbytes_per_s(nbytes, repeats=10):
    """Best GB/s of copying ``nbytes`` (each byte read once and written once)."""
    x = torch.ones(nbytes // 4, device=device)
    y = torch.empty_like(x)
    best = math.inf
    for _ in range(repeats + 1):
        synchronize(device)
        t = time.perf_counter()
        y.copy_(x)
        synchronize(device)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best / 1e9


gpu = device.type == "cuda"
peaks = {"fp32": matmul_tflops(device, torch.float32, 8192 if gpu else 2048)}
if fastpath.bf16_native(device):
    peaks["bf16"] = matmul_tflops(device, torch.bfloat16, 8192 if gpu else 2048)
bandwidth = copy_gbytes_per_s(2**30 if gpu else 2**26)
for name, peak in peaks.items():
    print(f"{tr(f'{name} matmul peak', f'{name} の行列積のピーク')}: {peak:8.3f} TFLOP/s   "
          f"{tr('ridge point', '屈曲点')}: {peak * 1e3 / bandwidth:6.1f} " + tr("FLOP/byte", "FLOP/バイト"))
print(f"{tr('memory bandwidth (copy)', 'メモリ帯域幅（コピー）')}: {bandwidth:8.1f} GB/s")

# %% [markdown]
# <!-- en -->
# A kernel whose intensity is below the **ridge point** (peak / bandwidth) cannot reach the peak, however well it is
# written. (Both limits are measured, so they are lower bounds of the true ones: a kernel may land slightly above
# them.) Each convolution's intensity follows from its shapes: FLOPs = 2 x batch x output pixels x output channels
# x input channels x kernel area; the bytes are at least the input, the weights and the output, each read or
# written once. Hooks on the `nn.Conv2d` layers collect the shapes from a forward pass on the `meta` device, which
# computes shapes and nothing else. The table is for d2l's batch of 256; bf16 halves the bytes and doubles the
# intensity.
# <!-- ja -->
# 演算強度が**屈曲点**（ピーク ÷ 帯域幅）より低いカーネルは、どれほどうまく書いてもピークに届きません（どちらの限界も実測値なので、本当の限界の下限です。カーネルがわずかに上回ることもあります）。畳み込みの演算強度は形状から決まります。FLOP 数 = 2 × バッチ × 出力画素数 × 出力チャネル数 × 入力チャネル数 × カーネルの面積、バイト数は少なくとも入力・重み・出力をそれぞれ 1回ずつ読み書きする量です。形状は、`nn.Conv2d` 層に付けたフックで、`meta` デバイス上の順伝播から集めます。`meta` デバイスは形状だけを計算し、中身は計算しません。表は d2l のバッチサイズ 256 の場合です。bf16 ではバイト数が半分になるので、演算強度は 2倍になります。

# %%
def conv_shapes(batch):
    """(name, conv, input shape, output shape) of every convolution of ResNet-18, from a shape-only forward."""
    with torch.device("meta"):
        model = resnet18(10)
        seen = []
        hooks = [m.register_forward_hook(lambda m, inp, out, name=name: seen.append((name, m, inp[0].shape, out.shape)))
                 for name, m in model.named_modules() if isinstance(m, nn.Conv2d)]
        model(torch.empty(batch, 1, 28, 28))
    for h in hooks:
        h.remove()
    return seen


def conv_cost(conv, in_shape, out_shape, bytes_per_value):
    """FLOPs and minimum bytes moved of one convolution's forward pass."""
    n, c_out, h, w = out_shape
    flops = 2 * n * c_out * h * w * conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1]
    values = math.prod(in_shape) + conv.weight.numel() + math.prod(out_shape)
    return flops, values * bytes_per_value


def distinct_convs(batch):
    """The convolutions grouped by shape: {key: [first name, count, conv, in shape, out shape]}."""
    groups = {}
    for name, conv, i, o in conv_shapes(batch):
        key = (tuple(i), tuple(o), conv.kernel_size, conv.stride)
        groups.setdefault(key, [name, 0, conv, tuple(i), tuple(o)])[1] += 1
    return groups


ai = {b: [conv_cost(c, i, o, 4)[0] / conv_cost(c, i, o, 4)[1] for _, _, c, i, o in distinct_convs(b).values()]
      for b in (1, 256)}  # fp32 FLOP/byte of each distinct convolution
print(tr("fp32 FLOP/byte of each distinct convolution (forward); GFLOP at batch 256",
         "形状の異なる各畳み込みの fp32 の FLOP/バイト（順伝播）と、バッチ 256 での GFLOP"))
print(cell(tr("first layer of the shape", "その形状の最初の層"), 28), cell(tr("count", "個数"), 5, True),
      cell(tr("output", "出力"), 11, True), cell("GFLOP", 7, True), cell(tr("batch 1", "バッチ 1"), 9, True),
      cell(tr("batch 256", "バッチ 256"), 10, True))
for (name, count, conv, i, o), a1, a256 in zip(distinct_convs(256).values(), ai[1], ai[256]):
    name = tr("0 (stem)", "0（ステム）") if name == "0" else name
    print(f"{cell(name, 28)} {count:>5} {'x'.join(map(str, o[1:])):>11} {conv_cost(conv, i, o, 4)[0] / 1e9:7.2f} "
          f"{a1:9.1f} {a256:10.1f}")

# %%
assert len(ai[1]) == len(ai[256]) == 11
assert all(a256 > a1 for a1, a256 in zip(ai[1], ai[256]))  # a batch shares each weight's bytes among its images

# %% [markdown]
# <!-- en -->
# With one image, the deep layers read a large weight tensor to compute only 16 or 49 output pixels: their
# intensity is low and they are memory-bound. A batch reuses each weight for every image, which lifts every layer's
# intensity. Now each distinct
# convolution is timed alone on this device (forward, in the fast path's precision and layout) at the larger batch
# size, and placed on the measured roofline together with the fastest complete training step from the table above.
# <!-- ja -->
# 画像 1枚のときは、深い層は大きな重みテンソルを読み込んでも、出力の画素は 16個か 49個しか計算しません。演算強度が低く、メモリ律速になります。バッチにすると各重みを画像の数だけ再利用するので、どの層の演算強度も上がります。次に、形状の異なる畳み込みをこのデバイス上で 1つずつ単独で計測し（順伝播、高速パスの精度とメモリ配置で、大きい方のバッチサイズ）、上の表で最も速かった訓練ステップ全体と一緒に、計測したルーフラインの上に置きます。

# %% tags=["nbval-ignore-output"]
fast_dtype = torch.bfloat16 if fastpath.bf16_native(device) else torch.float32
bytes_per_value = 2 if fast_dtype == torch.bfloat16 else 4
points = []
for name, count, conv, i, o in distinct_convs(BIG).values():
    layer = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding).to(device)
    layer = layer.to(memory_format=torch.channels_last)
    x = torch.rand(i, device=device).contiguous(memory_format=torch.channels_last)
    flops, moved = conv_cost(conv, i, o, bytes_per_value)
    best = math.inf
    with torch.no_grad(), autocast_context(device, fast_dtype):
        for _ in range(S["conv_repeats"] + 1):
            synchronize(device)
            t = time.perf_counter()
            layer(x)
            synchronize(device)
            best = min(best, time.perf_counter() - t)
    points.append((name, flops / moved, flops / best / 1e12))
fastest = max(measured, key=lambda r: r["images_per_s"])  # from the step-by-step table
step_tflops = step_flops * fastest["images_per_s"] / 1e12
star_bytes = 2 if fastest["precision"] == "bf16" else 4
costs = [(count, *conv_cost(c, i, o, star_bytes)) for _, count, c, i, o in distinct_convs(fastest["batch"]).values()]
step_intensity = sum(n * f for n, f, _ in costs) / sum(n * b for n, _, b in costs)  # all convolutions together

fig, ax = plt.subplots(figsize=(9, 4.2))
intensity = np.logspace(-1, 4, 200)
for (name, peak), style in zip(peaks.items(), ["-", "--"]):
    ax.plot(intensity, np.minimum(peak, bandwidth * intensity / 1e3), "k" + style,
            label=tr(f"{name} roof (measured)", f"{name} の上限（実測）"))
ax.scatter([p[1] for p in points], [p[2] for p in points], color="tab:blue",
           label=tr(f"convolutions alone, forward, batch {BIG}", f"畳み込み単独、順伝播、バッチ {BIG}"))
ax.scatter([step_intensity], [step_tflops], marker="*", s=200, color="tab:red",
           label=tr(f"whole training step: {fastest['step']}", f"訓練ステップ全体: {fastest['step']}"))
ax.set(xscale="log", yscale="log", xlabel=tr("arithmetic intensity (FLOP/byte)", "演算強度（FLOP/バイト）"),
       ylabel=tr("throughput (TFLOP/s)", "スループット（TFLOP/s）"),
       title=tr(f"Roofline of ResNet-18 on {device}", f"{device} 上の ResNet-18 のルーフライン"))
ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
ax.grid(True, which="both", alpha=0.3)
fig.tight_layout()
plt.show()
share = 100 * step_tflops / peaks[fastest["precision"]]
print(tr(f"fastest training step: {step_tflops:.4f} TFLOP/s = {share:.1f}% of the {fastest['precision']} peak",
         f"最速の訓練ステップ: {step_tflops:.4f} TFLOP/s（{fastest['precision']} ピークの {share:.1f}%）"))

# %%
assert all(p[1] > 0 and p[2] > 0 for p in points) and step_tflops > 0
assert len(points) == len(distinct_convs(BIG))

# %% [markdown]
# <!-- en -->
# The distance between a point and the roof above it is what remains to be gained. For the whole step (the star)
# it includes everything beyond the forward convolutions: the backward pass (whose convolutions have other shapes),
# batch norm and ReLU (memory-bound), the optimizer update and, in the slower configurations, waiting for data and
# for kernel launches. On a large GPU the last
# stages (7x7 and 4x4 images) also have too little work per kernel to fill the chip at small batch sizes.
#
# ## The fast path in one call
#
# All of this is one argument of `train`. Is the speed bought with accuracy? The fast path also changes the
# optimisation (Nesterov momentum, warm-up and cosine schedule, label smoothing, weight decay), so the next cell
# trains the same network twice on the same data for the same number of epochs: once with chapter 05's loop
# (`DataLoader`, fp32, plain SGD), once with `fast=True`. In the full profile that is d2l's network on all
# 60,000 images for 10 epochs, the baseline with d2l's batch 256 and learning rate 0.1, the fast path with batch
# 512 and peak learning rate 0.2; the table reports the training seconds until the test accuracy first reaches
# 0.91 (evaluation and the untimed compilation are not counted). In the smoke profile both train chapter 05's
# narrow network (`width=8`) for 3 epochs on 4,000 images at batch 32 and are tested on 1,000.
# <!-- ja -->
# 各点とその上の上限線との距離が、まだ改善できる余地です。ステップ全体（星印）の場合、その距離には順伝播の畳み込み以外のすべてが含まれます。逆伝播（その畳み込みは形状が異なります）、メモリ律速のバッチ正規化と ReLU、オプティマイザの更新、そして遅い構成ではデータやカーネル起動の待ち時間です。大きな GPU では、最後のステージ（7x7 と 4x4 の画像）はカーネルあたりの仕事が少なく、小さなバッチではチップを埋めきれません。
#
# ## 1回の呼び出しで使う高速パス
#
# ここまでの内容は、すべて `train` の引数 1つにまとまっています。では、速さと引き換えに精度を失っていないでしょうか。高速パスは最適化の方法も変えます（Nesterov モーメンタム、ウォームアップとコサインのスケジュール、ラベル平滑化、重み減衰）。そこで次のセルでは、同じネットワークを同じデータで同じエポック数だけ 2回訓練します。1回目は 5章のループ（`DataLoader`、fp32、素の SGD）、2回目は `fast=True` です。`full` プロファイルでは d2l のネットワークを 60,000枚すべてで 10エポック訓練します。ベースラインは d2l と同じバッチサイズ 256、学習率 0.1、高速パスはバッチサイズ 512、学習率のピーク 0.2 です。表には、テスト精度が初めて 0.91 に達するまでの訓練時間（秒）も示します（評価と、時間を測らないコンパイルは含みません）。`smoke` プロファイルでは、どちらも 5章の細いネットワーク（`width=8`）を訓練画像 4,000枚、バッチサイズ 32 で 3エポック訓練し、テスト画像 1,000枚で評価します。

# %% tags=["nbval-ignore-output"]
if mparlib.profile() == "full":  # d2l's network on all 60,000 images; the baseline is d2l's one-GPU run
    ACC = dict(width=64, num_epochs=10, subset=None, learned=0.88,
               baseline=dict(batch_size=256, lr=0.1), fast=dict(batch_size=512, lr=0.2))
else:  # chapter 05's narrow network on 4,000 images, the same batch for both loops
    ACC = dict(width=8, num_epochs=3, subset=(4000, 1000), learned=0.70,
               baseline=dict(batch_size=32, lr=0.05), fast=dict(batch_size=32, lr=0.05))
runs = {}
for loop in ("baseline", "fast"):
    data_args = dict(subset=ACC["subset"], shuffle_seed=0)
    if loop == "baseline":  # chapter 05's input: DataLoader workers, each batch copied to the device
        data_args.update(resident=False, device=device if device.type == "cuda" else None)
    torch.manual_seed(0)
    runs[loop] = T.train(resnet18(10, width=ACC["width"]), [device], num_epochs=ACC["num_epochs"], data=data_args,
                         fast=loop == "fast", **ACC[loop])
print({k: v for k, v in runs["fast"].fast.items() if k in ("precision", "channels_last", "compile", "cuda_graphs")})

# %% tags=["nbval-ignore-output"]
from IPython.display import Markdown

target = 0.91


def seconds_to(target, h):
    """Training seconds until the test accuracy first reaches ``target`` (None if it never does)."""
    total = 0.0
    for acc, s in zip(h.test_acc, h.seconds):
        total += s
        if acc >= target:
            return total
    return None


head = [tr("loop", "ループ"), tr("batch", "バッチ"), tr("format", "数値形式"),
        tr("test acc per epoch", "エポックごとのテスト精度"), tr("training s", "訓練時間（秒）"),
        tr("images/s", "画像/秒"), tr(f"training s to {target}", f"{target} までの訓練時間（秒）")]
rows = []
for loop, name in (("baseline", tr("chapter 05's loop", "5章のループ")), ("fast", tr("fast path", "高速パス"))):
    h = runs[loop]
    reached = seconds_to(target, h)
    rows.append([name, h.batch_size, h.fast["precision"] if h.fast else "fp32",
                 ", ".join(f"{a:.3f}" for a in h.test_acc), f"{sum(h.seconds):.1f}",
                 f"{sum(h.images_per_s) / h.epochs:.0f}", f"{reached:.1f}" if reached else tr("not reached", "未到達")])
Markdown("\n".join("| " + " | ".join(map(str, r)) + " |" for r in [head, ["---"] * len(head)] + rows))

# %%
fast, base = runs["fast"], runs["baseline"]
assert fast.fast["precision"] == ("bf16" if fastpath.bf16_native(device) else "fp32")
assert fast.fast["cuda_graphs"] == (device.type == "cuda") and base.fast is None  # base: the classic loop
for h in (base, fast):  # both learned: the loss fell far below log(10) = 2.30 and the accuracy passed a bar
    assert h.epochs == ACC["num_epochs"] and h.train_loss[-1] < 0.5 * math.log(10), h.train_loss
    assert h.test_acc[-1] >= ACC["learned"], h.test_acc
if mparlib.profile() == "full":
    assert fast.test_acc[-1] >= target and seconds_to(target, fast) is not None

# %% [markdown]
# <!-- en -->
# A comparison of accuracy means something only between runs that both learned: a baseline stuck near chance would
# make any fast path look accurate. Here both must pass the bar that the last cell checks before their accuracies
# are compared.
#
# The repository's benchmark, `benchmarks/train_throughput.py`, runs the same comparison as one script with more
# repetitions, counts FLOPs and measures the peak in the same process, compares the accuracy after the same number
# of epochs (and, like this cell, only when both loops learned), and writes its results with the hardware and
# software versions to `benchmarks/results/`.
#
# ## Summary
#
# - Count before timing: one trained image costs about three forward passes.
# - Profile before optimising: on a CPU the arithmetic dominates; on a GPU the data pipeline, host-to-device copies
#   and kernel launches do.
# - Each option of `FastPath` removes one cost: resident data, `channels_last`, bf16 where native, fused SGD, larger
#   batches with a schedule that keeps accuracy, `torch.compile` and CUDA graphs. Measure each on your own device.
# - The roofline tells how far a kernel can go: compare the measured points with the measured peak and bandwidth.
# <!-- ja -->
# 精度を比べて意味があるのは、どちらの実行も学習できている場合だけです。ベースラインが偶然の水準にとどまっていれば、どんな高速パスでも精度を保っているように見えてしまいます。ここでは、精度を比べる前に、どちらも最後のセルで確かめる基準を超えている必要があります。
#
# リポジトリのベンチマーク `benchmarks/train_throughput.py` は、同じ比較を 1つのスクリプトで、より多くの繰り返しで実行します。同じプロセスの中で FLOP 数を数えてピークを計測し、同じエポック数での精度を比べ（このセルと同じく、どちらのループも学習できた場合だけ）、結果をハードウェアとソフトウェアのバージョンとともに `benchmarks/results/` に書き出します。
#
# ## まとめ
#
# - 時間を測る前に数えます。訓練する画像 1枚のコストは、順伝播の約 3回分です。
# - 最適化の前にプロファイリングします。CPU では演算が支配的で、GPU ではデータパイプライン、ホストからデバイスへの転送、カーネル起動が支配的です。
# - `FastPath` の各オプションは、コストを 1つずつ取り除きます。データの常駐、`channels_last`、ネイティブな場合の bf16、融合 SGD、精度を保つスケジュール付きの大きなバッチ、`torch.compile`、CUDA グラフです。自分のデバイスでそれぞれを計測してください。
# - ルーフラインは、カーネルがどこまで速くなれるかを示します。計測した点を、計測したピークと帯域幅と比べます。

# %% [markdown]
# <!-- en -->
# ## Exercises
#
# Each exercise has a **starter** cell whose function body is `raise NotImplementedError`: replace that line with your
# code, run the cell, then run the check cell below it. The check runs your function on cases of its own. The check
# says *not attempted*, *wrong* (the first difference and one hint for the likely mistake), *error* (your exception,
# or your code ending its process), *right*, *cannot run here* or *the check itself failed* (never a verdict on your
# answer); it never prints the answer. Your function runs in a fresh worker process and is stopped after 30 s.
# `hint("07.1")` prints the next hint level each time you call it and says when none is left; `hint("07.1", 2)` prints
# a given level.
# <!-- ja -->
# ## 練習問題
#
# 各練習問題には、本体が `raise NotImplementedError` だけの関数を含む**スターター**のセルがあります。その行を自分のコードに置き換えてセルを実行し、すぐ下のチェックのセルを実行してください。チェックは独自の場合で関数を実行します。チェックの結果は「未着手」、「不正解」（最初の違いと、ありがちな間違いに合わせたヒント 1つ）、「エラー」（発生した例外、またはコードがプロセスを終了させたこと）、「正解」、「この環境では実行できません」、「チェック自体の不具合」（あなたの答えの判定ではありません）のどれかで、答えそのものは表示しません。関数は新しいワーカープロセスで実行し、30秒で止めます。`hint("07.1")` は呼ぶたびに次の段階のヒントを表示し、もう残っていなければそう伝えます。`hint("07.1", 2)` は指定した段階のヒントを表示します。

# %%
from mparlib.exercises import check, hint

# %% [markdown]
# <!-- en -->
# ### Exercise 07.1: The cost of a linear layer
#
# Write `linear_cost(linear, in_shape, bytes_per_value)`, the counterpart of `conv_cost` for an `nn.Linear`: the
# FLOPs of its forward pass on an input of shape `in_shape` (any number of leading dimensions), and the minimum
# bytes it moves when each value is `bytes_per_value` bytes, as a pair `(flops, bytes)`. The check compares the
# FLOPs with `FlopCounterMode`'s count and the bytes with the traffic of reading and writing each tensor once, on
# layers and shapes it draws at random.
# <!-- ja -->
# ### 練習問題 07.1: 線形層のコスト
#
# `conv_cost` の `nn.Linear` 版として `linear_cost(linear, in_shape, bytes_per_value)` を書いてください。形状 `in_shape`（先頭の次元はいくつでもかまいません）の入力に対する順伝播の FLOP と、値 1つが `bytes_per_value` バイトのときに動かす最小のバイト数を、組 `(flops, bytes)` で返します。チェックはランダムに選んだ層と形状で、FLOP を `FlopCounterMode` の数え方と、バイト数を各テンソルを 1回ずつ読み書きする転送量と比べます。

# %%
# Exercise 07.1: starter
def linear_cost(linear, in_shape, bytes_per_value):
    """FLOPs and minimum bytes moved of `linear`'s forward pass on an input of shape `in_shape`."""
    raise NotImplementedError("07.1")


# %%
check("07.1", linear_cost)

# %% [markdown]
# <!-- en -->
# ### Exercise 07.2: The roofline
#
# Write `attainable_tflops(peak_tflops, bandwidth_gbs, intensity)`: the TFLOP/s that the roofline allows a kernel
# of arithmetic intensity `intensity` (FLOP/byte) on a device with a peak of `peak_tflops` TFLOP/s and a memory
# bandwidth of `bandwidth_gbs` GB/s. The check tries points on both sides of the ridge.
# <!-- ja -->
# ### 練習問題 07.2: ルーフライン
#
# ピーク `peak_tflops` TFLOP/s、メモリ帯域幅 `bandwidth_gbs` GB/s のデバイスで、演算強度 `intensity`（FLOP/バイト）のカーネルにルーフラインが許す TFLOP/s を返す `attainable_tflops(peak_tflops, bandwidth_gbs, intensity)` を書いてください。チェックは屈曲点の両側の点を試します。

# %%
# Exercise 07.2: starter
def attainable_tflops(peak_tflops, bandwidth_gbs, intensity):
    """The roofline's bound in TFLOP/s for a kernel of `intensity` FLOP/byte."""
    raise NotImplementedError("07.2")


# %%
check("07.2", attainable_tflops)

# %% [markdown]
# <!-- en -->
# ### Exercise 07.3: FLOPs of a training step per image
#
# Write `step_flops_per_image(model, images, labels)`: the floating-point operations of one training step of
# `model` (forward pass, cross-entropy loss, backward pass) per image of the batch, counted by PyTorch as in the
# first section. The check gives you a small convolutional network it made and compares with its own count.
# <!-- ja -->
# ### 練習問題 07.3: 画像 1枚あたりの訓練ステップの FLOP
#
# `model` の訓練ステップ 1回（順伝播、交差エントロピー損失、逆伝播）の浮動小数点演算の数を、ミニバッチの画像 1枚あたりで返す `step_flops_per_image(model, images, labels)` を書いてください。最初の節と同じく PyTorch に数えさせます。チェックは自分で作った小さな畳み込みネットワークを渡し、自分で数えた値と比べます。

# %%
# Exercise 07.3: starter
def step_flops_per_image(model, images, labels):
    """FLOPs of one training step of `model` on `(images, labels)`, per image."""
    raise NotImplementedError("07.3")


# %%
check("07.3", step_flops_per_image)

# %% [markdown]
# <!-- en -->
# ### More questions
#
# - Switch off one option of the full fast path, e.g. `measure(fastpath.FastPath(**{**step4, "channels_last":
#   False}), BIG, N, 1)`. Which option matters most on your device?
# - Compute the arithmetic intensity of every convolution at batch 16 and at batch 1024 with `distinct_convs` and
#   `conv_cost`. Which layers cross the ridge point of your device, and at which batch size?
# - Profile one step of the fast path as the baseline was profiled above (use `resident_loaders` and
#   `fastpath.move_batch_fast`). How many operators and, on a GPU, kernel launches remain per step?
# - Train with `fast=fastpath.FastPath(label_smoothing=0.0, warmup=None)` for the same epochs as the full run. How
#   does the test accuracy change?
# <!-- ja -->
# ### その他の問い
#
# - 高速パスのオプションを 1つだけ無効にしてみましょう。たとえば `measure(fastpath.FastPath(**{**step4, "channels_last": False}), BIG, N, 1)` です。自分のデバイスでは、どのオプションが最も効きますか。
# - `distinct_convs` と `conv_cost` を使って、バッチ 16 とバッチ 1024 での各畳み込みの演算強度を計算しましょう。自分のデバイスの屈曲点を越えるのはどの層で、どのバッチサイズからですか。
# - 上でベースラインをプロファイリングしたのと同じ方法で、高速パスの 1ステップをプロファイリングしましょう（`resident_loaders` と `fastpath.move_batch_fast` を使います）。1ステップに残る演算子の数と、GPU ではカーネル起動の回数はいくつですか。
# - `fast=fastpath.FastPath(label_smoothing=0.0, warmup=None)` で、`full` プロファイルの実行と同じエポック数だけ訓練しましょう。テスト精度はどう変わりますか。
