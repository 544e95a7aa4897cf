"""Checks of chapter 10's exercises: a row-parallel linear layer, the 1F1B order of a stage, the bubble.

The row-parallel layer runs on 2 and then 4 fresh gloo processes against ``nn.Linear`` itself (computed here,
never in a rank); the 1F1B order is checked against the rules of ``torch.distributed.pipelining``'s
``Schedule1F1B`` (warm-up forwards ``min(m, p - s)``, then one backward and one forward in turn, then the remaining
backwards); the bubble at random points against ``mparlib.schedules.bubble_formula``. Explained in 10_model_parallel.
"""
import random

import torch
from torch import nn

from ..lang import tr
from ..schedules import bubble_formula
from .ch06 import close, fault, learner_function, run_children
from .ch07 import near
from .core import call, call_each, exercise, first_mismatch, mismatch_text, right, whole, wrong


# ---- 10.1: a row-parallel linear layer ---------------------------------------------------------------------------
def row_inputs(seed=0):
    """The layer (8 features in, 5 out) and the 2-D and 3-D inputs of 10.1, the same in every process (the caller's
    generator untouched). For check authors: see the package docstring."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        linear = nn.Linear(8, 5).double()
    g = torch.Generator().manual_seed(seed + 1)
    return linear, [torch.randn(3, 8, generator=g, dtype=torch.float64),
                    torch.randn(2, 3, 8, generator=g, dtype=torch.float64)]


def row_child(module, name, seed=0):
    """The learner's row-parallel layer on a 2-D and a 3-D input: its outputs. For check authors: see the package
    docstring."""
    fn = learner_function(module, name)
    try:
        linear, inputs = row_inputs(seed)
    except Exception:
        return fault()
    out = []
    for x in inputs:
        with torch.no_grad():
            got = fn(x.clone(), linear)
        out.append(got.detach().clone() if isinstance(got, torch.Tensor) else got)
    return {"got": out}


def row_key(got, x, linear, rank, world):
    """The likely mistake behind rank ``rank``'s wrong row-parallel output for ``x``. For check authors: see the
    package docstring."""
    step = x.shape[-1] // world
    cuts = slice(rank * step, (rank + 1) * step)
    with torch.no_grad():
        bias, product = linear.bias, x @ linear.weight.T
        partial = x[..., cuts] @ linear.weight[:, cuts].T
        if close(got, product + world * bias):
            return "bias_every_rank"
        if close(got, partial + bias) or close(got, partial):
            return "missing_all_reduce"
        if close(got, world * product + bias) or close(got, world * product + world * bias):
            return "whole_input"
    return None


@exercise("10.1", title=("A row-parallel linear layer", "行並列の線形層"), needs="processes", hints=[
    ("Look at the section 'Splitting one layer: columns and rows', the row-parallel case, and the cell after it.",
     "「1つの層の分け方: 列と行」の節の行並列の場合と、そのあとのセルを見てください。"),
    ("Rank r keeps the columns r*in/n to (r+1)*in/n of the weight and reads only the matching input features. Its "
     "product is a partial sum: adding all ranks' partial sums (an all-reduce) gives x @ W.T, and the bias is "
     "added once, after the sum.",
     "ランク r は重みの r*in/n から (r+1)*in/n 列目を持ち、対応する入力の特徴だけを読みます。その積は部分和で、"
     "全ランクの部分和を足す（オールリデュース）と x @ W.T になります。バイアスは合計のあとに 1回だけ足します。"),
    ("Each rank takes its slice of the input features and the matching columns of the weight and computes a "
     "partial product; the ranks sum their partial products, and the bias is added once, after the sum.",
     "各ランクは入力の特徴量のうち自分のスライスと、それに対応する重みの列を取り、部分積を計算します。ランクは部分積を合計し、バイアスは合計の後に "
     "1回だけ足します。"),
], mistakes={
    "bias_every_rank": ("The bias was added on every rank before the sum, so the output holds it world-size times: "
                        "add it once, after the all-reduce.",
                        "合計の前に各ランクでバイアスを足したため、出力にはバイアスがワールドサイズ回入っています。"
                        "オールリデュースのあとに 1回だけ足してください。"),
    "missing_all_reduce": ("The output is this rank's partial sum: add the partial sums of all ranks with "
                           "dist.all_reduce.",
                           "出力がこのランクの部分和のままです。dist.all_reduce で全ランクの部分和を足してください。"),
    "whole_input": ("Every rank computed the whole product, so the sum counts it world-size times: each rank takes "
                    "only its slice of the input features and of the weight's columns.",
                    "各ランクが積全体を計算したため、合計では積がワールドサイズ回数えられています。各ランクは入力の特徴と"
                    "重みの列の自分のスライスだけを使います。"),
})
def check_10_1(answer, sizes=(2, 4)):
    """Compare every rank's outputs with nn.Linear on a 2-D and a 3-D input, on 2 and then 4 ranks. Explained in
    10_model_parallel."""
    runs = run_children(answer, row_child, [(world, ()) for world in sizes])
    linear, inputs = row_inputs()
    with torch.no_grad():
        expected = [linear(x) for x in inputs]
    for world, values in zip(sizes, runs):
        for rank, v in enumerate(values):
            for x, want, got in zip(inputs, expected, whole(v["got"], len(inputs))):
                if close(got, want, 1e-9, 1e-9):
                    continue
                where = tr(f"With {world} ranks, rank {rank}'s output for an input of shape {tuple(x.shape)}",
                           f"ランク {world}個のとき、入力の形状が {tuple(x.shape)} のランク {rank} の出力")
                key = row_key(got, x, linear, rank, world) if isinstance(got, torch.Tensor) else "shape"
                return wrong(mismatch_text(where, first_mismatch(got, want, 1e-9, 1e-9)), key)
    return right(tr(f"On {' and '.join(map(str, sizes))} ranks the row-parallel layer equals nn.Linear, for 2-D and "
                    "3-D inputs.",
                    f"ランク {'個と '.join(map(str, sizes))}個のどちらでも、2次元と 3次元の入力で行並列の層が "
                    "nn.Linear と一致しました。"))


# ---- 10.2: the 1F1B order of a stage -------------------------------------------------------------------------------
def order_1f1b(stage, num_stages, micro_batches):
    """The reference order of ``Schedule1F1B`` on one stage. For check authors: see the package docstring."""
    warmup = min(micro_batches, num_stages - stage)
    order, forward = [("F", i) for i in range(warmup)], warmup
    for backward in range(micro_batches):
        order.append(("B", backward))
        if forward < micro_batches:
            order.append(("F", forward))
            forward += 1
    return order


def order_key(got, stage, p, m):
    """The likely mistake behind a wrong 1F1B order. For check authors: see the package docstring."""
    if got == [("F", i) for i in range(m)] + [("B", i) for i in range(m)]:
        return "gpipe"
    warmup = next((i for i, (kind, _) in enumerate(got) if kind == "B"), len(got))
    expected = min(m, p - stage)
    if warmup in (expected - 1, expected + 1):
        return "warmup_count"
    if warmup == min(m, p) and stage > 0:
        return "stage_ignored"
    return None


@exercise("10.2", title=("The 1F1B order of a stage", "ステージの 1F1B の順序"), hints=[
    ("Look at the section 'Pipelines across processes': what does `Schedule1F1B` do differently from "
     "`ScheduleGPipe`, and how many micro-batches does a rank hold at most?",
     "「プロセスをまたぐパイプライン」の節を見てください。`Schedule1F1B` は `ScheduleGPipe` と何が違い、1つのランクが"
     "同時に持つマイクロバッチは最大でいくつでしょうか。"),
    ("Three phases. Warm-up: forwards until the first gradient can come back; the last stage needs 1, each stage "
     "before it one more (never more than m). Then one backward, one forward, in turn, while forwards remain. "
     "Then the remaining backwards. Micro-batches go in order in both directions.",
     "3つの段階があります。ウォームアップでは、最初の勾配が戻ってこられるようになるまで順伝播をします。最後のステージは"
     "1回、その手前のステージは 1回ずつ多く必要です（ただし m を超えません）。次に、順伝播が残っている間は逆伝播と"
     "順伝播を 1回ずつ交互に行い、最後に残りの逆伝播を行います。マイクロバッチはどちらの向きでも番号順です。"),
    ("Write the warm-up count of level 2 as a formula in p and the stage index (0 for the first stage), capped "
     "at m. Then build the list in three loops: the warm-up forwards, the steady pairs (a backward, then a "
     "forward while any is left), the closing backwards.",
     "段階 2 のウォームアップの回数を、p とステージの番号（最初のステージが 0）の式で書き、m"
     " を上限にします。そのあとリストを 3つのループで作ります。ウォームアップの順伝播、定常の組（逆伝播を 1"
     "つ、残っていれば順伝播を 1つ）、最後の逆伝播です。"),
], mistakes={
    "gpipe": ("That is GPipe's order: all forwards, then all backwards. 1F1B starts the backward passes as soon as "
              "the first gradient arrives.",
              "それは GPipe の順序です（すべての順伝播のあとにすべての逆伝播）。1F1B は最初の勾配が届きしだい逆伝播を"
              "始めます。"),
    "warmup_count": ("The warm-up has one forward too many or too few: stage s runs min(m, p - s) forwards before "
                     "its first backward (the last stage just one).",
                     "ウォームアップの順伝播が 1回多いか少ないです。ステージ s は最初の逆伝播の前に min(m, p - s) 回の"
                     "順伝播を行います（最後のステージは 1回だけ）。"),
    "stage_ignored": ("Every stage warms up alike: the later a stage, the sooner its first gradient comes back "
                      "(min(m, p - s) forwards).",
                      "どのステージも同じようにウォームアップしています。後ろのステージほど最初の勾配が早く戻ってきます"
                      "（順伝播は min(m, p - s) 回）。"),
})
def check_10_2(answer):
    """Compare the order of every stage of several pipelines (p = 1 to 5, m = p to 9) with 1F1B's rules.
    Explained in 10_model_parallel."""
    cases = [(s, p, m) for p in (1, 2, 3, 4, 5) for m in sorted({p, p + 1, 2 * p, 9}) for s in range(p)]
    for stage, p, m in cases:
        got = call(answer, stage, p, m)
        try:
            got = [(str(kind), int(i)) for kind, i in got]
        except (TypeError, ValueError):
            return wrong(tr(f"Your function returned {got!r}; return a list of ('F', i) and ('B', i) pairs.",
                            f"戻り値が {got!r} です。('F', i) と ('B', i) の組のリストを返してください。"), "shape")
        if got == order_1f1b(stage, p, m):
            continue
        return wrong(tr(f"Stage {stage} of {p} with {m} micro-batches: your order is {got}.",
                        f"{p}ステージ中のステージ {stage}、マイクロバッチ {m}個: あなたの順序は {got} です。"),
                     order_key(got, stage, p, m))
    return right(tr(f"Every stage's order agrees with 1F1B's rules in {len(cases)} cases.",
                    f"{len(cases)}通りで、どのステージの順序も 1F1B の規則と一致しました。"))


# ---- 10.3: the bubble ------------------------------------------------------------------------------------------
@exercise("10.3", title=("The bubble", "バブル"), hints=[
    ("Look at the section 'The bubble, measured' and the summary.", "「バブルの測定」の節とまとめを見てください。"),
    ("Each of the p ranks is busy for m micro-batches' worth of work out of a step that lasts m + p - 1 of them; "
     "the bubble is the idle share of the step.",
     "p 個の各ランクは、マイクロバッチ m + p - 1 個分の長さのステップのうち、m 個分だけ働きます。バブルはステップのうち"
     "働いていない割合です。"),
    ("Count in ticks, as in chapter 4: how long a step of m micro-batches takes on p stages, and how much of "
     "it one stage is busy. The bubble is the rest, as a share.",
     "4章と同じくティックで数えます。p ステージで m 個のマイクロバッチの 1"
     "ステップが何ティックかかり、そのうち 1つのステージが働くのは何ティックか。バブルは残りの割合です。"),
], mistakes={
    "over_busy": ("Your value divides the idle time by the busy time (p - 1) / m: the bubble is a share of the "
                  "whole step, m + p - 1.",
                  "働いていない時間を働いている時間で割っています（(p - 1) / m）。バブルはステップ全体 m + p - 1 に"
                  "対する割合です。"),
    "p_not_p_minus_1": ("The first micro-batch needs p - 1 steps, not p, to reach the last stage.",
                        "最初のマイクロバッチが最後のステージに届くのに必要なのは p ステップではなく p - 1 ステップです。"),
})
def check_10_3(answer, points=40, seed=0):
    """Compare with the bubble formula at random points. Explained in 10_model_parallel."""
    rng = random.Random(seed)
    hypotheses = {"over_busy": lambda p, m: (p - 1) / m, "p_not_p_minus_1": lambda p, m: p / (m + p)}
    first, fits = None, dict.fromkeys(hypotheses, True)
    cases = [(rng.randint(2, 64), rng.randint(1, 256)) for _ in range(points)]
    for (p, m), got in zip(cases, call_each(answer, cases)):
        for key, formula in hypotheses.items():
            fits[key] = fits[key] and near(got, formula(p, m), 1e-9)
        if first is None and not near(got, bubble_formula(p, m), 1e-9):
            first = tr(f"{p} stages, {m} micro-batches: your bubble is {got!r}.",
                       f"{p}ステージ、マイクロバッチ {m}個: あなたのバブルは {got!r} です。")
    if first is None:
        return right(tr(f"The bubble agrees at {points} random points.", f"ランダムな {points}点でバブルが一致しました。"))
    return wrong(first, next((key for key, ok in fits.items() if ok), None))
