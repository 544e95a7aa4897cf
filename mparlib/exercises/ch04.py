"""Checks of chapter 04's exercises: the pipeline bubble, a model split over two devices, a table's memory.

Explained in 04_hybrid_cpu_gpu.
"""
import random

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..lang import tr
from .core import call, compare_cases, exercise, first_mismatch, in_worker, mismatch_text, ratio, right, wrong


def _bubble(stages, micro_batches):
    return (stages - 1) / (micro_batches + stages - 1)


def _cases_04_1():
    rng = random.Random(401)
    fixed = [(4, 1), (4, 4), (2, 8), (4, 12), (8, 32), (1, 5), (3, 2)]
    return fixed + [(rng.randint(1, 16), rng.randint(1, 64)) for _ in range(30)]


@exercise("04.1", title=("The bubble", "バブル"), hints=[
    ("Count the ticks of `pipeline_schedule(S, m)` and the ticks in which a given stage has work.",
     "`pipeline_schedule(S, m)` のティックの数と、あるステージに仕事があるティックの数を数えてください。"),
    ("There are m + S - 1 ticks in all; each stage works in m of them and idles in the others. The bubble is the "
     "idle share, a number between 0 and 1.",
     "ティックは全部で m + S - 1 個あります。各ステージはそのうち m 個で働き、残りは待っています。バブルはその待ちの"
     "割合で、0 から 1 の間の数です。"),
    ("Count in ticks: how many ticks the whole step takes (the last micro-batch still has to pass every "
     "stage), and in how many of them one stage is busy. The bubble is the share of the others.",
     "ティック単位で数えます。ステップ全体が何ティックかかるか（最後のマイクロバッチもすべてのステージを通ります）、そのうち "
     "1つのステージが働いているのは何ティックか。バブルは残りのティックの割合です。"),
], mistakes={
    "over_m": ("You divided the idle ticks by the busy ones (m). The bubble is a share of all ticks.",
               "待ちのティックを働くティックの数（m）で割っています。バブルは全ティックに占める割合です。"),
    "percent": ("Your value is 100 times too large: return a fraction, not a percentage.",
                "値が 100倍です。百分率ではなく割合を返してください。"),
    "swapped": ("You swapped the roles of stages and micro-batches.",
                "ステージとマイクロバッチの役割が入れ替わっています。"),
})
def check_04_1(answer):
    """The check of exercise 04.1, "The bubble". Explained in 04_hybrid_cpu_gpu."""
    return compare_cases(answer, _cases_04_1(), _bubble, detectors=[
        ("percent", lambda c, got, exp: exp > 0 and abs(ratio(got, exp) - 100) < 1e-6),
        ("over_m", lambda c, got, exp: abs(got - (c[0] - 1) / c[1]) < 1e-9),
        ("swapped", lambda c, got, exp: abs(got - _bubble(c[1], c[0])) < 1e-9),
    ])


class _Moves(TorchFunctionMode):
    """Count the tensors moved with ``.to(device)`` while a forward pass runs."""

    def __init__(self, device):
        super().__init__()
        self.device, self.count = torch.device(device), 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to or func is torch.Tensor.cuda:
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if isinstance(target, (str, torch.device, int)) and torch.device(target) == self.device:
                self.count += 1
        return func(*args, **kwargs)


def _net_04_2():
    torch.manual_seed(6)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def _devices_04_2():
    return ["cuda:0", "cuda:1"] if torch.cuda.device_count() >= 2 else ["cpu", "cpu"]


def _their_split_04_2(answer, split_at):
    """Where the learner's code runs: their model built from the check's network, what it holds and where, its output
    on the check's batch (counting moves to the second device) and the gradients after a backward through it."""
    net, devices = _net_04_2(), _devices_04_2()
    model = call(answer, net, devices, split_at)
    first, second = getattr(model, "first", None), getattr(model, "second", None)
    seen = {"type": type(model).__name__, "stages": isinstance(first, nn.Module) and isinstance(second, nn.Module)}
    if not seen["stages"]:
        return seen
    seen["first_params"] = len(list(first.parameters()))
    seen["first_len"] = len(first) if isinstance(first, nn.Sequential) else None
    seen["placed"] = [all(p.device == torch.device(d) for p in stage.parameters())
                      for stage, d in ((first, devices[0]), (second, devices[1]))]
    torch.manual_seed(7)
    x = torch.randn(6, 8, dtype=torch.float64)
    moves = _Moves(devices[1])
    with moves:
        out = call(model, x)
    seen["moves"], seen["grads"] = moves.count, None
    seen["out"] = out.detach().cpu() if isinstance(out, torch.Tensor) else out
    if isinstance(out, torch.Tensor) and out.grad_fn is not None:
        call(lambda: out.to(devices[0]).pow(2).mean().backward())
        seen["grads"] = [(name, None if p.grad is None else p.grad.detach().cpu())
                         for name, p in model.named_parameters()]
    return seen


@exercise("04.2", title=("A model split over two devices", "2つのデバイスに分けたモデル"), hints=[
    ("Look at `HybridModel` in 'A working version' and at the stages of 'Beyond the example: model parallelism'.",
     "「動くように直した版」の `HybridModel` と、「例の先へ: モデル並列」のステージを見てください。"),
    ("Register two submodules, `first` (layers before split_at) and `second` (the rest), each moved to its device; "
     "forward moves the activation to the second device between them.",
     "サブモジュールを 2つ登録します。`first`（split_at より前の層）と `second`（残り）で、それぞれを自分のデバイスに"
     "移します。forward では、その間で活性化を 2つ目のデバイスへ移します。"),
    ("Register the two stages as submodules, each a slice of `net` moved to its device. In forward, move the "
     "input to the first device, and the first stage's output to the second device before the second stage "
     "runs.",
     "2つのステージをサブモジュールとして登録します。それぞれ `net`"
     " のスライスを自分のデバイスに移したものです。forward では入力を 1つ目のデバイスに移し、1"
     "つ目のステージの出力を、2つ目のステージの前に 2つ目のデバイスへ移します。"),
], mistakes={
    "no_transfer": ("The outputs are right here, but forward never moves the activation to the second device: on "
                    "two real GPUs the second stage would receive a tensor on the wrong device.",
                    "ここでは出力は正しいのですが、forward が活性化を 2つ目のデバイスへ移していません。本物の GPU 2枚では、"
                    "2つ目のステージが違うデバイスのテンソルを受け取ってしまいます。"),
    "split_point": ("The stages do not split the network at split_at: `first` must hold exactly the layers before "
                    "that index.",
                    "ステージが split_at でネットワークを分けていません。`first` には、その位置より前の層だけを"
                    "入れてください。"),
    "placement": ("A parameter is not on its stage's device.", "ステージのデバイスにないパラメータがあります。"),
    "no_stages": ("The module needs two submodules named `first` and `second`.",
                  "モジュールには `first` と `second` という名前のサブモジュールが 2つ必要です。"),
})
def check_04_2(answer, split_at=2):
    """The check of exercise 04.2, "A model split over two devices". Explained in 04_hybrid_cpu_gpu."""
    reference, devices = _net_04_2(), _devices_04_2()
    seen = in_worker(_their_split_04_2, answer, split_at)
    if not seen["stages"]:
        return wrong(tr(f"Your function returned a {seen['type']} without both stages.",
                        f"関数が返した {seen['type']} には 2つのステージがそろっていません。"), "no_stages")
    if seen["first_params"] != len(list(reference[:split_at].parameters())) or \
            seen["first_len"] not in (None, split_at):
        return wrong(tr(f"`first` holds {seen['first_params']} parameter tensors.",
                        f"`first` のパラメータのテンソルは {seen['first_params']}個です。"), "split_point")
    for placed, device in zip(seen["placed"], devices):
        if not placed:
            return wrong(tr(f"A parameter is not on {device}.", f"{device} にないパラメータがあります。"), "placement")
    torch.manual_seed(7)
    x = torch.randn(6, 8, dtype=torch.float64)
    mm = first_mismatch(seen["out"], reference(x))
    if mm is not None:
        return wrong(mismatch_text(tr("Your model's output", "あなたのモデルの出力"), mm))
    if seen["grads"] is None:
        return wrong(tr("Your model's output is right but carries no gradient: keep it connected to the stages "
                        "(no .detach(), no torch.no_grad()).",
                        "モデルの出力の値は正しいのですが、勾配がありません。ステージにつながったままにしてください"
                        "（.detach() や torch.no_grad() は使いません）。"))
    reference(x).pow(2).mean().backward()
    for (name, grad), q in zip(seen["grads"], reference.parameters()):
        mm = first_mismatch(grad, q.grad, rtol=1e-9, atol=1e-12) if grad is not None else ("type", "None")
        if mm is not None:
            return wrong(mismatch_text(tr(f"The gradient of {name}", f"{name} の勾配"), mm))
    if seen["moves"] == 0:
        return wrong(tr("No tensor was moved to the second device during forward.",
                        "forward の間に 2つ目のデバイスへ移されたテンソルがありません。"), "no_transfer")
    return right(tr(f"Same outputs and gradients as the whole network, split at layer {split_at} over {devices}.",
                    f"{devices} にまたがり層 {split_at} で分けたモデルが、分ける前のネットワークと同じ出力と勾配を返し"
                    "ました。"))


STATE_COPIES = {"sgd": 2, "momentum": 3, "adam": 4}  # weights + gradient + the optimiser's tensors per weight


def _table_bytes(rows, dim, optimizer):
    return rows * dim * 4 * STATE_COPIES[optimizer]


def _cases_04_3():
    rng = random.Random(403)
    fixed = [(10_000_000, 256, "adam"), (10_000_000, 256, "sgd"), (1000, 10, "momentum"), (50_000_000, 128, "adam")]
    return fixed + [(rng.randint(1, 10**8), rng.choice([8, 16, 64, 128, 300]), rng.choice(list(STATE_COPIES)))
                    for _ in range(20)]


@exercise("04.3", title=("A table's memory", "テーブルのメモリ"), hints=[
    ("Look at the arithmetic cell of 'When does keeping a huge embedding table on the CPU pay?'.",
     "「巨大な埋め込みテーブルを CPU に置いて得をする条件」の計算のセルを見てください。"),
    ("Count float32 copies of the table: the weights, a dense gradient, and what the optimiser keeps per weight "
     "(plain SGD nothing, momentum one buffer, Adam two moments). Each number is 4 bytes.",
     "テーブルの float32 のコピーを数えます。重み、密な勾配、それに最適化手法が重みごとに持つもの（ふつうの SGD は"
     "なし、モーメンタムはバッファ 1つ、Adam は 2つのモーメント）です。数値 1つは 4バイトです。"),
    ("Bytes per value, times values per copy, times the number of float32 copies the optimiser needs (count "
     "them for each optimiser: the weights, a dense gradient, and its own state). Return an int.",
     "値 1つのバイト数 × 1コピーの値の数 × オプティマイザが必要とする float32"
     " のコピーの数です（重み、密な勾配、オプティマイザ自身の状態を、オプティマイザごとに数えます）。int"
     " で返します。"),
], mistakes={
    "no_gradient": ("You left out the gradient: backward stores one value per weight, as large as the table.",
                    "勾配を数えていません。逆伝播は重み 1つにつき 1つの値を保存し、その大きさはテーブルと同じです。"),
    "optimizer_state": ("The optimiser's own state is miscounted: momentum keeps one tensor per weight, Adam two.",
                        "最適化手法自身の状態の数え方が違います。モーメンタムは重みごとにテンソルを 1つ、Adam は 2つ"
                        "持ちます。"),
    "units": ("Your value is off by a unit factor (bits, KiB, MiB or GiB): return bytes.",
              "値が単位の分だけずれています（ビット、KiB、MiB、GiB）。バイトで返してください。"),
})
def check_04_3(answer):
    """The check of exercise 04.3, "A table's memory". Explained in 04_hybrid_cpu_gpu."""
    def no_gradient(c, got, exp):  # plain SGD tells: weights alone, one copy
        return call(answer, 1000, 10, "sgd") == 1000 * 10 * 4

    def optimizer_state(c, got, exp):
        copies = ratio(got, c[0] * c[1] * 4)
        return copies is not None and copies != STATE_COPIES[c[2]] and abs(copies - round(copies)) < 1e-9 and \
            1 <= copies <= 5

    return compare_cases(answer, _cases_04_3(), _table_bytes, detectors=[
        ("units", lambda c, got, exp: any(abs(ratio(got, exp) - f) < 1e-6 * f for f in (8, 2**-10, 2**-20, 2**-30))),
        ("no_gradient", no_gradient),
        ("optimizer_state", optimizer_state),
    ])
