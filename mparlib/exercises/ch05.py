"""Checks of chapter 05's exercises: an initialisation that reaches every layer, steps per epoch, and this
machine's training throughput, measured by the check too. Explained in 05_multi_gpu_resnet.
"""
import math
import random
import statistics
import time

import torch
from torch import nn

from ..lang import tr
from ..step import train_step
from .core import as_number, call, compare_cases, exercise, in_worker, right, wrong


class _Block(nn.Module):
    """Layers of the kinds real models have, including subclasses of Linear that an exact type check misses."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3)
        self.norm = nn.BatchNorm2d(16)
        self.attention = nn.MultiheadAttention(32, 4)  # its out_proj is a subclass of nn.Linear
        self.head = nn.Linear(32, 10)
        self.embedding = nn.Embedding(50, 32)


def _layers(net):
    return [m for m in net.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]


def _their_init_05_1(answer):
    """Where the learner's code runs: the check's block after ``apply`` with their function, as its state dict."""
    torch.manual_seed(8)
    net = _Block()
    call(net.apply, answer)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@exercise("05.1", title=("An initialisation that reaches every layer", "すべての層に届く初期化"), hints=[
    ("Read '1. Lazy layers and a weight initialisation that skips them': which test selects the layers?",
     "「1. 遅延層と、それを素通りする重みの初期化」を読んでください。層を選んでいるのはどの判定ですか。"),
    ("`type(m) in [...]` misses subclasses (and lazy layers); `isinstance` accepts them. Change only the weights "
     "of convolutions and linear layers, with a standard deviation (not a variance) of 0.01.",
     "`type(m) in [...]` はサブクラス（と遅延層）を見落とし、`isinstance` なら受け入れます。畳み込み層と線形層の重み"
     "だけを、分散ではなく標準偏差 0.01 で変えてください。"),
    ("Test the module's type against the two layer classes the exercise names (isinstance with a tuple), and "
     "for those alone draw the weight anew, in place, from nn.init's normal distribution with the stated "
     "standard deviation.",
     "モジュールの型を、問題が挙げる 2つの層のクラスと比べ（タプルを渡した isinstance"
     "）、それらについてだけ、重みを nn.init の正規分布から、指定の標準偏差でその場で引き直します。"),
], mistakes={
    "exact_type": ("A layer kept its old weights: an exact type check misses subclasses of nn.Linear, such as the "
                   "output projection of nn.MultiheadAttention.",
                   "古い重みのままの層があります。型の完全一致の判定は、nn.MultiheadAttention の出力の射影のような "
                   "nn.Linear のサブクラスを見落とします。"),
    "std": ("The weights have the wrong spread: nn.init.normal_ takes the standard deviation, 0.01.",
            "重みのばらつきが違います。nn.init.normal_ が受け取るのは標準偏差の 0.01 です。"),
    "too_much": ("Layers other than convolutions and linear layers changed (batch normalization, embeddings), or "
                 "the biases did.",
                 "畳み込み層と線形層以外の層（バッチ正規化、埋め込み）か、バイアスが変わっています。"),
})
def check_05_1(answer):
    """The check of exercise 05.1, "An initialisation that reaches every layer". Explained in 05_multi_gpu_resnet."""
    torch.manual_seed(8)
    net = _Block()
    before = {k: v.detach().clone() for k, v in net.state_dict().items()}
    layers = {id(m) for m in _layers(net)}
    after = in_worker(_their_init_05_1, answer)
    if list(after) != list(before):
        return wrong(tr("Your function changed which tensors the model holds: initialise their values only.",
                        "関数がモデルの持つテンソルそのものを変えました。値だけを初期化してください。"))
    weights = {f"{name}.weight" for name, m in net.named_modules() if id(m) in layers}
    for key, old in before.items():
        changed = not torch.equal(old, after[key])
        if key in weights and not changed:
            return wrong(tr(f"{key!r} was not initialised.", f"{key!r} が初期化されていません。"), "exact_type")
        if key not in weights and changed and not key.endswith("in_proj_weight"):
            return wrong(tr(f"{key!r} changed, and it should not have.", f"{key!r} が変わりましたが、変えてはいけません。"),
                         "too_much")
    for key in sorted(weights):
        std = after[key].std().item()
        if not 0.007 < std < 0.013:
            return wrong(tr(f"The standard deviation of {key!r} is {std:.3g}.",
                            f"{key!r} の標準偏差は {std:.3g} です。"), "std")
    return right(tr(f"All {len(weights)} convolution and linear weights initialised, nothing else touched.",
                    f"畳み込み層と線形層の重み {len(weights)}個をすべて初期化し、ほかには触れていません。"))


def _steps(n_images, batch_per_device, k, drop_last):
    batch = batch_per_device * k
    return n_images // batch if drop_last else math.ceil(n_images / batch)


def _cases_05_2():
    rng = random.Random(502)
    fixed = [(60000, 256, 1, False), (60000, 256, 4, False), (60000, 256, 4, True), (12000, 16, 2, False),
             (1000, 3, 3, True), (10, 32, 2, False)]
    return fixed + [(rng.randint(1, 100000), rng.choice([8, 16, 32, 64, 128, 256]), rng.randint(1, 8),
                     rng.random() < 0.5) for _ in range(30)]


@exercise("05.2", title=("Steps per epoch", "1エポックのステップ数"), hints=[
    ("Look at 'Training on all devices': which batch size does the second run use, and what does an epoch do with "
     "the images left over at its end?",
     "「すべてのデバイスでの訓練」を見てください。2回目の実行はどのバッチサイズを使い、エポックの最後に余った画像を"
     "どう扱いますか。"),
    ("The global batch is batch_per_device * k. Without drop_last the last, smaller batch is a step too; with "
     "drop_last it is skipped.",
     "全体のバッチは batch_per_device * k です。drop_last がなければ最後の小さなバッチも 1ステップになり、drop_last "
     "があれば飛ばされます。"),
    ("Steps are batches. The global batch is the per-device batch times k; with drop_last the incomplete last "
     "batch is dropped (round down), without it, it is kept (round up).",
     "ステップの数はバッチの数です。全体のバッチはデバイスあたりのバッチの k倍です。drop_last"
     " では最後の半端なバッチを捨て（切り捨て）、そうでなければ残します（切り上げ）。"),
], mistakes={
    "per_device": ("You divided by one device's batch: every step consumes batch_per_device images on each of the "
                   "k devices.",
                   "1台分のバッチで割っています。各ステップは、k台のデバイスそれぞれで batch_per_device 枚の画像を"
                   "使います。"),
    "floor": ("You dropped the last, smaller batch although drop_last is False.",
              "drop_last が False なのに、最後の小さなバッチを落としています。"),
    "drop_last": ("With drop_last=True the last, smaller batch is not a step.",
                  "drop_last=True のとき、最後の小さなバッチは 1ステップになりません。"),
})
def check_05_2(answer):
    """The check of exercise 05.2, "Steps per epoch". Explained in 05_multi_gpu_resnet."""
    return compare_cases(answer, _cases_05_2(), _steps, detectors=[
        ("per_device", lambda c, got, exp: c[2] > 1 and got == _steps(c[0], c[1], 1, c[3])),
        ("floor", lambda c, got, exp: not c[3] and got == c[0] // (c[1] * c[2])),
        ("drop_last", lambda c, got, exp: c[3] and got == math.ceil(c[0] / (c[1] * c[2]))),
    ])


BATCH = 256  # images per step of 05.3's workload


def _workload():
    torch.manual_seed(9)
    net = nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
    X, y = torch.randn(BATCH, 1, 28, 28), torch.randint(10, (BATCH,))
    return net, X, y


def _their_throughput(answer):
    """Where the learner's code runs: their measurement of the check's workload, on one thread as the check's."""
    torch.set_num_threads(1)
    return call(answer, *_workload())


def _check_throughput():
    """The check's own measurement, in a fresh worker as the learner's is: same start, same one thread."""
    torch.set_num_threads(1)
    return measure_throughput(*_workload())


def measure_throughput(net, X, y, seconds=0.6):
    """The check's own measurement: images per second of SGD steps, after a warm-up, median of short windows.

    Explained in 05_multi_gpu_resnet.
    """
    optimizer, loss_fn = torch.optim.SGD(net.parameters(), lr=0.01), nn.CrossEntropyLoss()
    train_step(net, X, y, loss_fn, optimizer)  # warm-up
    rates, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(rates) < 5:
        start = time.perf_counter()
        train_step(net, X, y, loss_fn, optimizer)
        rates.append(len(y) / (time.perf_counter() - start))
    return statistics.median(rates)


TOLERANCE = 3.0  # a learner's measurement within a factor of 3 of the check's counts as right


@exercise("05.3", title=("This machine's throughput", "このマシンのスループット"), hints=[
    ("Look at what `train` reports per epoch (images per second) and at `train_step`.",
     "`train` がエポックごとに報告する値（1秒あたりの画像数）と `train_step` を見てください。"),
    ("Run one step first (warm-up), then time several steps with time.perf_counter and divide the images they "
     "processed by the seconds they took.",
     "まず 1ステップ実行し（ウォームアップ）、それから time.perf_counter で数ステップの時間を測り、処理した画像の"
     "数をかかった秒数で割ります。"),
    ("Build the optimiser, run one step to warm up, then time a fixed number of steps between two calls of "
     "time.perf_counter. Images per second are the images those steps saw over the seconds they took.",
     "オプティマイザを作り、ウォームアップに 1ステップ実行してから、決まった数のステップを "
     "time.perf_counter の 2"
     "回の呼び出しではさんで計ります。画像/秒は、それらのステップが見た画像の数を、かかった秒数で割ったものです。"),
], mistakes={
    "per_step": ("Your number is about one batch size away from the check's: it looks like steps per second (or "
                 "seconds per step). Count images.",
                 "値がチェックの値からバッチサイズ分ほどずれています。1秒あたりのステップ数（または 1ステップの秒数）の"
                 "ようです。画像の数を数えてください。"),
    "units": ("Your number is off by about a factor of 1000: measure in seconds, not milliseconds.",
              "値がおよそ 1000倍ずれています。ミリ秒ではなく秒で測ってください。"),
    "inverted": ("Your number looks like seconds per image: divide images by seconds, not the other way round.",
                 "値が画像 1枚あたりの秒数のようです。秒数を画像の数で割るのではなく、画像の数を秒数で割ってください。"),
})
def check_05_3(answer, tolerance=TOLERANCE):
    """Measure the check's throughput in a fresh worker, the learner's in another, the check's again: right within
    ``tolerance`` of the two. Explained in 05_multi_gpu_resnet."""
    before = in_worker(_check_throughput)
    got = as_number(in_worker(_their_throughput, answer))
    after = in_worker(_check_throughput)
    low, high = min(before, after) / tolerance, max(before, after) * tolerance
    if low <= got <= high:
        return right(tr(f"Your {got:,.0f} images/s is within a factor {tolerance:g} of the check's own measurements "
                        f"({before:,.0f} and {after:,.0f} images/s).",
                        f"あなたの {got:,.0f} 枚/秒は、チェック自身の測定（{before:,.0f} と {after:,.0f} 枚/秒）の "
                        f"{tolerance:g}倍の範囲に収まっています。"))
    side = tr("higher", "高い") if got > high else tr("lower", "低い")
    return wrong(tr(f"Your function reported {got:.4g} images/s, more than a factor {tolerance:g} {side} than what "
                    "the check measured on this machine just before and after.",
                    f"あなたの関数は {got:.4g} 枚/秒と報告しました。チェックが直前と直後にこのマシンで測った値より "
                    f"{tolerance:g}倍以上{side}値です。"), throughput_key(got, (before * after) ** 0.5, BATCH, tolerance))


def throughput_key(got, measured, batch, tolerance):
    """The likely mistake behind a wrong throughput: the slip whose factor (a batch, 1000, or an inversion) brings
    ``got`` nearest to ``measured``, if that is within ``tolerance``; the nearest, since the windows of 256 and
    1000 overlap for a factor of 3. For check authors: see the package docstring."""
    if got <= 0:
        return None
    slips = [("per_step", batch), ("per_step", 1 / batch), ("units", 1000), ("units", 1e-3),
             ("inverted", None)]
    distance = {}
    for key, factor in slips:
        fixed = 1 / got if factor is None else got * factor
        distance[key] = min(distance.get(key, math.inf), abs(math.log(fixed / measured)))
    key = min(distance, key=distance.get)
    return key if distance[key] < math.log(tolerance) else None
