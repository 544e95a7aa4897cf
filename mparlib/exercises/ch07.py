"""Checks of chapter 07's exercises: the cost of a linear layer, the roofline, FLOPs counted per training image.

The FLOP counts are checked against PyTorch's own count (``FlopCounterMode``) on layers and models the check
draws at random; the roofline against a formula at random points. Explained in 07_performance.
"""
import math
import random

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..lang import tr
from .core import call, call_each, exercise, right, wrong


def counted_flops(fn):
    """FLOPs that ``FlopCounterMode`` counts while ``fn()`` runs. For check authors: see the package docstring."""
    with FlopCounterMode(display=False) as count:
        fn()
    return count.get_total_flops()


def near(a, b, rel=1e-9):
    """True if the numbers ``a`` and ``b`` agree to ``rel``. For check authors: see the package docstring."""
    return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def pair(got):
    """``got`` as two numbers ``(flops, bytes)``, or ``None``. For check authors: see the package docstring."""
    try:
        flops, moved = got
        return float(flops), float(moved)
    except (TypeError, ValueError):
        return None


def linear_cases(seed=0, n=8):
    """Random linear layers and input shapes (1 to 3 leading dimensions, with and without bias). For check authors: see
    the package docstring."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        lead = tuple(rng.randint(2, 9) for _ in range(1 + i % 3))
        layer = nn.Linear(rng.randint(3, 40), rng.randint(3, 40), bias=i % 4 != 3)
        cases.append((layer, (*lead, layer.in_features), rng.choice([2, 4])))
    return cases


@exercise("07.1", title=("The cost of a linear layer", "線形層のコスト"), hints=[
    ("Look at `conv_cost` in the section 'The roofline of this model on your device': FLOPs from the shapes, bytes "
     "from what is read and written once.",
     "「このモデルのルーフライン」の節の `conv_cost` を見てください。FLOP は形状から、バイト数は 1回ずつ読み書きする"
     "ものから求めます。"),
    ("A linear layer multiplies every row of the input (all leading dimensions together are rows) by the weight: "
     "one multiply-add per input feature, output feature and row, and a multiply-add counts as two FLOPs. The "
     "bytes: the input, the weight, the bias if there is one, and the output.",
     "線形層は入力の各行（先頭の次元をすべてまとめたものが行です）に重みを掛けます。行、入力特徴、出力特徴の組ごとに"
     "積和が 1回で、積和は 2 FLOP と数えます。バイト数は入力、重み、（あれば）バイアス、出力の分です。"),
    ("FLOPs: a multiply and an add for each of the in_features x out_features products, for every row (all "
     "leading dimensions together). Bytes: count the values read and written (input, weight, bias if there is "
     "one, output), then multiply by the bytes per value.",
     "FLOP: 行ごと（先頭の次元をすべてまとめた行）に、in_features x out_features"
     " 個の積それぞれについて乗算と加算が 1"
     "回ずつです。バイト数: 読み書きする値（入力、重み、あればバイアス、出力）を数え、値 1"
     "つのバイト数を掛けます。"),
], mistakes={
    "missing_factor_two": ("Your FLOPs are half of PyTorch's count: a multiply-add is two floating-point operations.",
                           "FLOP が PyTorch の数え方の半分です。積和は 2回の浮動小数点演算です。"),
    "leading_dims": ("Your FLOPs fit a 2-D input but not one with more leading dimensions: every leading dimension "
                     "multiplies the rows (math.prod(in_shape[:-1])).",
                     "2次元の入力では合いますが、先頭の次元が多い入力では合いません。先頭の次元はすべて行数に掛かり"
                     "ます（math.prod(in_shape[:-1])）。"),
    "bytes_per_value": ("Your bytes count values, not bytes: multiply by bytes_per_value.",
                        "バイト数ではなく値の個数を数えています。bytes_per_value を掛けてください。"),
    "bytes_parts": ("Your bytes miss a part (or count one twice): the input, the weight, the bias (when the layer "
                    "has one) and the output, each once.",
                    "バイト数に足りない部分（または 2回数えた部分）があります。入力、重み、（ある場合は）バイアス、出力を"
                    "1回ずつ数えます。"),
})
def check_07_1(answer):
    """Compare FLOPs with FlopCounterMode and bytes with the minimum traffic, on random layers. Explained in
    07_performance."""
    for layer, shape, nbytes in linear_cases():
        got = pair(call(answer, layer, shape, nbytes))
        if got is None:
            return wrong(tr("Return two numbers: (flops, bytes).", "2つの数 (flops, bytes) を返してください。"), "shape")
        x = torch.zeros(shape)
        flops = counted_flops(lambda: layer(x))
        rows = math.prod(shape[:-1])
        values = rows * layer.in_features + layer.weight.numel() + rows * layer.out_features
        values += layer.bias.numel() if layer.bias is not None else 0
        where = tr(f"For {layer} on an input of shape {shape}", f"入力の形状 {shape} の {layer} で")
        if not near(got[0], flops):
            key = "missing_factor_two" if near(got[0], flops / 2) else None
            if key is None and near(got[0], flops / rows * shape[0]):
                key = "leading_dims"
            return wrong(tr(f"{where} your FLOPs are {got[0]:g}.", f"{where}、あなたの FLOP は {got[0]:g} です。"), key)
        if not near(got[1], values * nbytes):
            key = "bytes_per_value" if near(got[1], values) else "bytes_parts"
            return wrong(tr(f"{where} ({nbytes} bytes per value) your bytes are {got[1]:g}.",
                            f"{where}（値 1つあたり {nbytes}バイト）、あなたのバイト数は {got[1]:g} です。"), key)
    return right(tr("FLOPs equal PyTorch's count and the bytes the minimum traffic, on 8 random layers and shapes.",
                    "ランダムな 8通りの層と形状で、FLOP は PyTorch の数え方と、バイト数は最小の転送量と一致しました。"))


# ---- 07.2: the roofline ----------------------------------------------------------------------------------------
def roofline(peak_tflops, bandwidth_gbs, intensity):
    """The attainable TFLOP/s under the roofline (the check's reference). For check authors: see the package
    docstring."""
    return min(peak_tflops, bandwidth_gbs * intensity / 1e3)


@exercise("07.2", title=("The roofline", "ルーフライン"), hints=[
    ("Look at the first paragraph of 'The roofline of this model on your device'.",
     "「このモデルのルーフライン」の節の最初の段落を見てください。"),
    ("Two limits: the device's peak, and what memory can feed, bandwidth x intensity. A kernel gets the smaller "
     "one. Mind the units: GB/s x FLOP/byte is GFLOP/s, and the answer is in TFLOP/s.",
     "上限は 2つあります。デバイスのピークと、メモリが供給できる 帯域幅 x 演算強度 です。カーネルが得られるのは"
     "小さいほうです。単位に注意してください。GB/s x FLOP/バイト は GFLOP/s で、答えは TFLOP/s です。"),
    ("There are two ceilings: the peak itself, and what memory can feed (bandwidth times intensity, converted "
     "from GFLOP/s to TFLOP/s). A kernel gets the lower of the two.",
     "上限は 2つです。ピークそのものと、メモリが供給できる量（帯域幅 × 演算強度。GFLOP/s から "
     "TFLOP/s に換算します）です。カーネルが得られるのは低いほうです。"),
], mistakes={
    "max_not_min": ("Your value exceeds one of the two limits: a kernel gets the smaller of the two, not the larger.",
                    "あなたの値は 2つの上限の一方を超えています。カーネルが得られるのは大きいほうではなく小さいほうです。"),
    "units": ("Your value is 1000 times too large where memory limits: GB/s x FLOP/byte gives GFLOP/s; divide by "
              "1000 for TFLOP/s.",
              "メモリが制約になる所で、値が 1000倍大きくなっています。GB/s x FLOP/バイト は GFLOP/s なので、TFLOP/s "
              "にするには 1000 で割ります。"),
    "memory_roof": ("Your value ignores memory: at low intensity the bandwidth limits, not the peak.",
                    "メモリを無視しています。演算強度が低いところでは、ピークではなく帯域幅が制約になります。"),
    "compute_roof": ("Your value ignores the peak: at high intensity the arithmetic limits.",
                     "ピークを無視しています。演算強度が高いところでは演算が制約になります。"),
})
def check_07_2(answer, points=40, seed=0):
    """Compare with the roofline at random points on both sides of the ridge; a mistake is named when it explains
    every point. Explained in 07_performance."""
    rng = random.Random(seed)
    hypotheses = {"units": lambda p, m: min(p, m * 1e3), "max_not_min": max,
                  "memory_roof": lambda p, m: p, "compute_roof": lambda p, m: m}
    first, fits = None, dict.fromkeys(hypotheses, True)
    cases = []
    for i in range(points):
        peak, bw = 10 ** rng.uniform(-2, 3), 10 ** rng.uniform(1, 4)
        ridge = peak * 1e3 / bw
        cases.append((peak, bw, ridge * 10 ** rng.uniform(-2, 2) if i > 1 else ridge * (0.01 if i == 0 else 100)))
    for (peak, bw, intensity), got in zip(cases, call_each(answer, cases)):
        memory = bw * intensity / 1e3
        for key, formula in hypotheses.items():
            fits[key] = fits[key] and near(got, formula(peak, memory), 1e-6)
        if first is None and not near(got, roofline(peak, bw, intensity), 1e-6):
            first = tr(f"peak {peak:.4g} TFLOP/s, {bw:.4g} GB/s, {intensity:.4g} FLOP/byte: your value is {got!r}.",
                       f"ピーク {peak:.4g} TFLOP/s、{bw:.4g} GB/s、{intensity:.4g} FLOP/バイト: あなたの値は {got!r} "
                       "です。")
    if first is None:
        return right(tr(f"The roofline agrees at {points} random points, memory-bound and compute-bound.",
                        f"メモリ律速と演算律速の両方を含むランダムな {points}点で、ルーフラインが一致しました。"))
    return wrong(first, next((key for key, ok in fits.items() if ok), None))


# ---- 07.3: FLOPs of a training step per image ------------------------------------------------------------------
def small_cnn(seed):
    """A small convolutional network for 1x12x12 images (the check's model). For check authors: see the package
    docstring."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, stride=2), nn.ReLU(),
                         nn.Flatten(), nn.Linear(6 * 5 * 5, 10))


@exercise("07.3", title=("FLOPs of a training step per image", "画像 1枚あたりの訓練ステップの FLOP"), hints=[
    ("Look at the section 'What one image costs'.", "「画像 1枚あたりの計算量」の節を見てください。"),
    ("Count inside one FlopCounterMode block everything a training step computes: the forward pass, the loss "
     "and the backward pass; then share the count among the images of the batch.",
     "1つの FlopCounterMode のブロックの中で、訓練ステップが計算するものすべて（順伝播、損失、逆伝播）を数え、"
     "その数をミニバッチの画像の枚数で割ります。"),
    ("Count the whole training step, forward, loss and backward, inside one FlopCounterMode block, then divide "
     "the total it reports by the number of images.",
     "訓練の 1ステップ全体（順伝播、損失、逆伝播）を 1つの FlopCounterMode"
     " のブロックの中で数え、報告された合計を画像の枚数で割ります。"),
], mistakes={
    "forward_only": ("Your count is about a third of a training step: the backward pass (about twice the forward) "
                     "must run inside the counter too.",
                     "訓練ステップの約 3分の 1 しか数えていません。逆伝播（順伝播の約 2倍）もカウンタの中で実行して"
                     "ください。"),
    "per_image": ("Your count is that of the whole batch: divide by the number of images.",
                  "ミニバッチ全体の数になっています。画像の枚数で割ってください。"),
})
def check_07_3(answer, batch=3, seed=0):
    """Compare with the check's own FlopCounterMode count of a step on a small CNN. Explained in 07_performance."""
    g = torch.Generator().manual_seed(seed)
    images, labels = torch.rand(batch, 1, 12, 12, generator=g), torch.randint(0, 10, (batch,), generator=g)
    model = small_cnn(seed)
    step = counted_flops(lambda: nn.functional.cross_entropy(model(images), labels).backward()) / batch
    forward = counted_flops(lambda: model(images)) / batch
    got = call(answer, small_cnn(seed), images, labels)
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        return wrong(tr(f"Your function returned {got!r}; return a number.", f"戻り値が {got!r} です。数を返してください。"),
                     "shape")
    if near(got, step, 1e-6):
        return right(tr(f"{got:g} FLOPs per image, as PyTorch counts them for a step of this model.",
                        f"画像 1枚あたり {got:g} FLOP で、このモデルの 1ステップを PyTorch が数えた値と一致しました。"))
    key = None
    if near(got, forward, 1e-6) or near(got, forward * batch, 1e-6):
        key = "forward_only"
    elif near(got, step * batch, 1e-6):
        key = "per_image"
    return wrong(tr(f"For a batch of {batch} images of a small CNN your function returned {got:g}.",
                    f"小さな CNN と {batch}枚のミニバッチで、関数の戻り値は {got:g} でした。"), key)
