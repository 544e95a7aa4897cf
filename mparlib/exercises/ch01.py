"""Checks of chapter 01's exercises: chunk sizes, the linear scaling rule, one step with data_parallel.

Explained in 01_dataparallel.
"""
import math
import random

import torch
from torch import nn

from ..lang import tr
from ..parallel import data_parallel
from .core import call, compare_cases, exercise, in_worker, ratio, right, wrong


def _chunks(batch, k):
    size = math.ceil(batch / k)
    return [size] * (batch // size) + ([batch % size] if batch % size else [])


def _balanced(batch, k):
    return [batch // k + (1 if i < batch % k else 0) for i in range(min(k, batch))]


def _cases_01_1():
    rng = random.Random(101)
    fixed = [(10, 4), (6, 4), (10, 3), (3, 4), (256, 3), (8, 4), (7, 7), (1, 3), (5, 4), (63, 4)]
    return fixed + [(rng.randint(1, 300), rng.randint(1, 9)) for _ in range(30)]


@exercise("01.1", title=("Chunk sizes", "チャンクの大きさ"), hints=[
    ("Look at the section 'What one forward pass does' and the figure of three cases: which rule does scatter "
     "follow?",
     "「1回の順伝播で起きること」の節と、3つの場合の図を見てください。分配はどの規則に従っていますか。"),
    ("Every chunk has the same size, ceil(batch / k), except the last one, which gets what is left. A device "
     "whose chunk would be empty gets none, so there can be fewer than k chunks.",
     "どのチャンクも ceil(batch / k) 行で、最後のチャンクだけが残りを受け取ります。空になるはずのデバイスはチャンクを"
     "受け取らないので、チャンクが k個より少ないこともあります。"),
    ("First the size of a full chunk, from `batch` and `k` (rounded up). Then ask how many full chunks fit "
     "into `batch`, and whether anything is left over for one more.",
     "まず、`batch` と `k` から満杯のチャンクの大きさを求めます（切り上げ）。次に、満杯のチャンクが "
     "`batch` にいくつ収まるか、そして最後にもう 1つのチャンクに回す余りがあるかを考えます。"),
], mistakes={
    "balanced": ("You spread the rows as evenly as possible (sizes differing by at most one). torch.chunk does "
                 "not: all chunks but the last have ceil(batch / k) rows.",
                 "行をできるだけ均等に（差が 1行以内になるように）分けています。torch.chunk はそうしません。最後以外の"
                 "チャンクはすべて ceil(batch / k) 行です。"),
    "idle_devices": ("Your list has an entry for every device, including empty ones. A device without rows gets no "
                     "chunk at all: list only the chunks that exist.",
                     "行のないデバイスの分も含めて、すべてのデバイスの値を並べています。行のないデバイスにはチャンクが"
                     "ないので、存在するチャンクだけを並べてください。"),
    "floor": ("You rounded the chunk size down and gave the rest to the last device. torch.chunk rounds up.",
              "チャンクの大きさを切り捨て、残りを最後のデバイスに回しています。torch.chunk は切り上げます。"),
})
def check_01_1(answer):
    """The check of exercise 01.1, "Chunk sizes". Explained in 01_dataparallel."""
    floor = lambda c, got, exp: c[1] > 1 and got == [c[0] // c[1]] * (c[1] - 1) + [c[0] - (c[1] - 1) * (c[0] // c[1])]
    return compare_cases(answer, _cases_01_1(), _chunks, detectors=[
        ("idle_devices", lambda c, got, exp: len(got) > len(exp) and list(got[:len(exp)]) == exp
         and not any(got[len(exp):])),
        ("balanced", lambda c, got, exp: list(got) == _balanced(*c)),
        ("floor", floor),
    ], same=lambda got, exp: isinstance(got, (list, tuple)) and list(got) == exp)


def _lr(step, base_lr, k, warmup_steps):
    if step >= warmup_steps:
        return base_lr * k
    return base_lr * (1 + (k - 1) * step / warmup_steps)


def _cases_01_2():
    rng = random.Random(102)
    fixed = [(0, 0.1, 4, 100), (50, 0.1, 4, 100), (100, 0.1, 4, 100), (1000, 0.1, 4, 100), (3, 0.05, 8, 10),
             (10, 0.2, 1, 10), (7, 0.1, 2, 0)]
    return fixed + [(rng.randint(0, 600), round(rng.uniform(0.001, 0.5), 4), rng.randint(2, 16), rng.randint(1, 400))
                    for _ in range(30)]


@exercise("01.2", title=("Linear scaling with warm-up", "ウォームアップ付きの線形スケーリング則"), hints=[
    ("Read 'Batch size and learning rate': what happens to the learning rate when the global batch grows k-fold, "
     "and how does a warm-up start?",
     "「バッチサイズと学習率」を読んでください。全体のバッチが k倍になると学習率はどうなり、ウォームアップは"
     "どこから始まりますか。"),
    ("At step 0 the rate is the single-device rate base_lr; it grows linearly to k * base_lr at step warmup_steps "
     "and stays there.",
     "ステップ 0 では 1台のときの学習率 base_lr で、ステップ warmup_steps で k * base_lr になるまで直線的に増え、"
     "その後は一定です。"),
    ("Split on `step < warmup_steps`. After the warm-up the rate is constant; during it, it lies on the "
     "straight line from base_lr at step 0 to its final value at step warmup_steps: write that line with the "
     "fraction `step / warmup_steps`.",
     "`step < warmup_steps`"
     " で場合分けします。ウォームアップの後は一定です。その間は、ステップ 0 の base_lr からステップ "
     "warmup_steps の最終値までを結ぶ直線の上にあります。その直線を割合 "
     "`step / warmup_steps` を使って書いてください。"),
], mistakes={
    "no_warmup": ("During the warm-up your rate is already the full k * base_lr: it must start at base_lr and grow.",
                  "ウォームアップ中なのに学習率がすでに k * base_lr です。base_lr から始めて増やしてください。"),
    "unscaled": ("Your rate stays at base_lr: the linear scaling rule multiplies it by k (after the warm-up).",
                 "学習率が base_lr のままです。線形スケーリング則では（ウォームアップの後に）k倍します。"),
    "from_zero": ("Your warm-up starts at 0. Here it starts at the single-device rate base_lr (Goyal et al.).",
                  "ウォームアップが 0 から始まっています。ここでは 1台のときの学習率 base_lr から始めます"
                  "（Goyal ら）。"),
})
def check_01_2(answer):
    """The check of exercise 01.2, "Linear scaling with warm-up". Explained in 01_dataparallel."""
    def from_zero(c, got, exp):
        step, base, k, w = c
        return step < w and math.isclose(got, base * k * step / w, rel_tol=1e-6, abs_tol=1e-12)

    return compare_cases(answer, _cases_01_2(), _lr, detectors=[
        ("no_warmup", lambda c, got, exp: c[0] < c[3] and c[2] > 1 and math.isclose(got, c[1] * c[2])),
        ("unscaled", lambda c, got, exp: c[0] > 0 and c[2] > 1 and math.isclose(got, c[1])),
        ("from_zero", from_zero),
    ])


class Probe(nn.Module):
    """Pass the input on and write down how many rows arrived (the replicas share the list)."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def forward(self, x):
        self.log.append(x.shape[0])
        return x


def _step_models():
    torch.manual_seed(1)
    log = []
    net = nn.Sequential(Probe(log), nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1)).double()
    X, Y = torch.randn(63, 10, dtype=torch.float64), torch.randn(63, 1, dtype=torch.float64)
    return net, log, X, Y


def _reference_step(net, X, Y, lr):
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    nn.functional.mse_loss(net(X), Y).backward()
    optimizer.step()


def _their_step(answer, devices, lr):
    """Where the learner's code runs: their step on the check's model; its parameters after, and the rows seen."""
    theirs, log, X, Y = _step_models()
    call(answer, theirs, X, Y, list(devices), lr)
    return [p.detach().clone() for p in theirs.parameters()], list(log)


@exercise("01.3", title=("One step on simulated devices", "模擬デバイスでの 1ステップ"), hints=[
    ("Look at the one-step comparison in 'Batch size and learning rate'.",
     "「バッチサイズと学習率」の 1ステップの比較を見てください。"),
    ("Run the forward pass through data_parallel(model, X, devices), compute one loss on the gathered output, "
     "then backward and one SGD step with the given lr.",
     "順伝播を data_parallel(model, X, devices) で行い、集約した出力で損失を 1つ計算してから、逆伝播と、与えられた"
     "lr での SGD の 1ステップを行います。"),
    ("Four things, in order: an SGD optimizer over the model's parameters with `lr`; the forward pass through "
     "`data_parallel` on all the `devices`; one MSE loss of the gathered output against `Y`; the three calls "
     "that clear, compute and apply the gradients.",
     "順に 4つです。`lr` を使うモデルのパラメータの SGD オプティマイザ、すべての `devices`"
     " での `data_parallel` による順伝播、集約した出力と `Y` の MSE 損失 1"
     "つ、そして勾配を消し、計算し、適用する 3つの呼び出しです。"),
], mistakes={
    "not_split": ("The parameters are right, but the batch was never split: the model saw all rows in one call. Use "
                  "data_parallel with the devices you are given.",
                  "パラメータは正しいのですが、バッチが分けられていません。モデルはすべての行を 1回の呼び出しで受け取り"
                  "ました。与えられたデバイスで data_parallel を使ってください。"),
    "chunk_losses": ("The update is about k times too large: you added one mean loss per chunk. Compute one loss on "
                     "the gathered output instead.",
                     "更新量がおよそ k倍になっています。チャンクごとの平均損失を足し合わせています。集約した出力で損失を"
                     "1つ計算してください。"),
    "no_step": ("The parameters did not change: did you call optimizer.step() (and backward before it)?",
                "パラメータが変わっていません。optimizer.step()（とその前の backward）を呼びましたか。"),
    "lr_scaled": ("The update is scaled by the number of devices. For an unchanged global batch keep the learning "
                  "rate.",
                  "更新量がデバイスの数に応じて拡大・縮小されています。全体のバッチが同じなら学習率はそのままです。"),
})
def check_01_3(answer, devices=("cpu",) * 4, lr=0.1):
    """The check of exercise 01.3, "One step on simulated devices". Explained in 01_dataparallel."""
    net, _, X, Y = _step_models()
    before = [p.detach().clone() for p in net.parameters()]
    _reference_step(net, X, Y, lr)
    params, log = in_worker(_their_step, answer, devices, lr)
    if [tuple(p.shape) for p in params] != [tuple(b.shape) for b in before]:
        return wrong(tr("Your step changed the model's parameters themselves (their number or shapes): update their "
                        "values only.",
                        "あなたのステップがモデルのパラメータそのもの（数や形状）を変えました。値だけを更新してください。"))
    names = [n for n, _ in net.named_parameters()]
    expected = torch.cat([(p.detach() - b).flatten() for p, b in zip(net.parameters(), before)])
    got = torch.cat([(p - b).flatten() for p, b in zip(params, before)])
    gap = (got - expected).abs().max().item()
    if gap < 1e-10:
        if max(log, default=0) >= X.shape[0]:
            return wrong(tr(f"The model received these row counts: {log}.", f"モデルが受け取った行数: {log}。"),
                         "not_split")
        return right(tr(f"Same parameters as one step on one device (largest difference {gap:.1e}), with the "
                        f"batch split into {log}.",
                        f"1つのデバイスでの 1ステップと同じパラメータです（最大の差 {gap:.1e}）。バッチは {log} に"
                        "分けられました。"))
    scale = ratio(got.norm().item(), expected.norm().item()) or 0.0
    name = names[0]
    proportional = any(torch.allclose(got, f * expected, rtol=1e-6, atol=1e-12) for f in (len(devices),
                                                                                         1 / len(devices)))
    key = "no_step" if scale < 1e-6 else "lr_scaled" if proportional else \
        "chunk_losses" if 0.6 * len(devices) < scale < 1.4 * len(devices) else None
    return wrong(tr(f"After your step the parameters differ from one step on one device (largest difference "
                    f"{gap:.3g}; your update of {name!r} and the others is {scale:.3g} times the size it should "
                    "have).",
                    f"あなたのステップの後のパラメータは、1つのデバイスでの 1ステップと違います（最大の差 {gap:.3g}。"
                    f"{name!r} などの更新量は、あるべき大きさの {scale:.3g} 倍です）。"), key)
