"""Checks of chapter 12's exercises: the interleaved bubble, a layout's training state per rank, micro-batches in flight.

The bubble is checked at random points against ``mparlib.schedules.bubble_formula``; the state per rank against
``mparlib.sharding.zero_bytes_per_rank`` applied to a rank's share of the model; the micro-batches in flight against
a count over the order in which ``ScheduleGPipe`` and ``Schedule1F1B`` run a stage's passes. Explained in 12_planning.
"""
import random

from ..lang import tr
from ..schedules import bubble_formula
from ..sharding import zero_bytes_per_rank
from .ch07 import near
from .ch10 import order_1f1b
from .core import call_each, exercise, right, wrong


def first_wrong(answer, cases, reference, hypotheses, describe, rel=1e-9):
    """Call ``answer`` on every case: the text of the first disagreement with ``reference`` (or None) and the key of a
    hypothesis that every answer matched (or None). For check authors: see the package docstring."""
    first, fits = None, dict.fromkeys(hypotheses, True)
    for case, got in zip(cases, call_each(answer, cases)):
        for key, formula in hypotheses.items():
            fits[key] = fits[key] and near(got, formula(*case), rel)
        if first is None and not near(got, reference(*case), rel):
            first = describe(case, got)
    return first, next((key for key, ok in fits.items() if ok), None)


# ---- 12.1: the interleaved bubble ------------------------------------------------------------------------------
@exercise("12.1", title=("The interleaved bubble", "インターリーブのバブル"), hints=[
    ("Look at the section 'Schedules beyond 1F1B', and at chapter 10's bubble: what changes when each rank holds v "
     "smaller stages instead of one?",
     "「1F1B の先のスケジュール」の節と、10章のバブルを見てください。各ランクが 1つのステージの代わりに v 個の小さな"
     "ステージを持つと、何が変わるでしょうか。"),
    ("The pipeline fills and drains through p - 1 stages as before, but each of them is now 1/v of a rank's work, so "
     "the idle time is (p - 1) / v micro-batches' worth; the busy time is still m of them.",
     "パイプラインが満ちるまでと空になるまでに通るステージは前と同じ p - 1 個ですが、その 1つ 1つはランクの仕事の"
     "1/v になりました。そのため遊ぶ時間はマイクロバッチ (p - 1) / v 個分で、働く時間は変わらず m 個分です。"),
    ("As in chapter 10 the pipeline fills and drains through p - 1 stages, but each of them is now 1/v of a "
     "rank's work; compute the idle and the busy time in those units and take the idle share.",
     "10章と同じく、パイプラインが満ちるまでと空になるまでに p - 1 個のステージを通りますが、その 1つ "
     "1つはランクの仕事の 1/v になりました。その単位で遊ぶ時間と働く時間を求め、遊ぶ時間の割合を取ります。"),
], mistakes={
    "ratio": ("Your value divides the idle time by the busy time, (p - 1) / (v m): the formula asks for the idle share of "
              "the whole step.",
              "遊ぶ時間を働く時間で割っています（(p - 1) / (v m)）。求めるのはステップ全体に対する遊ぶ時間の割合です。"),
    "v_ignored": ("Your value does not change with v: it is 1F1B's bubble. Interleaving makes each stage, and with it "
                  "the fill and the drain, v times shorter.",
                  "値が v によって変わりません。それは 1F1B のバブルです。インターリーブでは各ステージが、そして満ちる"
                  "時間と空になる時間も、v 分の 1 になります。"),
    "share_divided": ("You divided 1F1B's idle share by v. The idle time shrinks v times, but the step shrinks too: "
                      "recompute the share from the idle and the busy time.",
                      "1F1B の遊ぶ割合を v で割っています。遊ぶ時間は v 分の 1 になりますが、ステップも短くなります。"
                      "遊ぶ時間と働く時間から割合を計算し直してください。"),
})
def check_12_1(answer, points=40, seed=0):
    """Compare with ``bubble_formula(p, m, schedule="interleaved1f1b", stages_per_rank=v)`` at random points.
    Explained in 12_planning."""
    rng = random.Random(seed)
    cases = [(rng.randint(2, 32), rng.randint(1, 128), rng.randint(2, 6)) for _ in range(points)]
    reference = lambda p, m, v: bubble_formula(p, m, schedule="interleaved1f1b", stages_per_rank=v)  # noqa: E731
    hypotheses = {"ratio": lambda p, m, v: (p - 1) / (v * m), "v_ignored": lambda p, m, v: (p - 1) / (m + p - 1),
                  "share_divided": lambda p, m, v: (p - 1) / (m + p - 1) / v}
    first, key = first_wrong(answer, cases, reference, hypotheses, lambda c, got: tr(
        f"p = {c[0]}, m = {c[1]}, v = {c[2]}: your bubble is {got!r}.",
        f"p = {c[0]}、m = {c[1]}、v = {c[2]}: あなたのバブルは {got!r} です。"))
    if first is None:
        return right(tr(f"The interleaved bubble agrees at {points} random points.",
                        f"ランダムな {points}点でインターリーブのバブルが一致しました。"))
    return wrong(first, key)


# ---- 12.2: a layout's training state per rank ------------------------------------------------------------------
def state_reference(n_params, dp, tp, pp, stage):
    """Bytes of parameters, gradients and Adam state (fp32) per rank. For check authors: see the package docstring."""
    return sum(zero_bytes_per_rank(n_params / (tp * pp), dp, stage).values())


@exercise("12.2", title=("A layout's training state per rank", "レイアウトのランクあたりの訓練状態"), hints=[
    ("Look at the section 'A layout planner', and at chapter 9's ZeRO stages.",
     "「レイアウトのプランナー」の節と、9章の ZeRO のステージを見てください。"),
    ("Tensor and pipeline parallelism split the model itself: a rank holds n / (tp pp) of the parameters, with their "
     "gradients and optimizer state. ZeRO then shards that share over the dp ranks that hold the same part.",
     "テンソル並列とパイプライン並列はモデルそのものを分けます。ランクが持つのはパラメータの n / (tp pp) と、その勾配と"
     "オプティマイザの状態です。ZeRO は、その分け前を同じ部分を持つ dp 個のランクでさらにシャーディングします。"),
    ("First a rank's share of the model, from the tensor- and pipeline-parallel degrees; then chapter 9's "
     "accounting on that share: bytes per parameter for each part, divided by dp for the parts that the ZeRO "
     "stage shards.",
     "まず、テンソル並列とパイプライン並列の度数から、ランクが受け持つモデルの割合を求めます。次に、その割合に 9"
     "章の数え方を当てはめます。部分ごとのパラメータあたりのバイト数を、ZeRO"
     " のステージがシャーディングする部分については dp で割ります。"),
], mistakes={
    "no_model_split": ("Your bytes do not shrink with tp and pp: tensor and pipeline parallelism give each rank only "
                       "its part of the model.",
                       "バイト数が tp と pp で減っていません。テンソル並列とパイプライン並列では、各ランクはモデルの自分の"
                       "部分だけを持ちます。"),
    "over_world": ("You sharded over every rank (dp tp pp). ZeRO shards only among the dp ranks that hold the same "
                   "part of the model.",
                   "すべてのランク（dp tp pp）でシャーディングしています。ZeRO がシャーディングするのは、モデルの同じ部分を"
                   "持つ dp 個のランクの間だけです。"),
    "stage_shifted": ("Your bytes belong to the next ZeRO stage up: stage 1 shards the optimizer state, 2 also the "
                      "gradients, 3 also the parameters.",
                      "1つ上の ZeRO のステージのバイト数になっています。ステージ 1 はオプティマイザの状態を、2 は勾配も、"
                      "3 はパラメータもシャーディングします。"),
})
def check_12_2(answer, points=40, seed=0):
    """Compare with ``zero_bytes_per_rank`` of a rank's share of the model at random layouts. Explained in 12_planning."""
    rng = random.Random(seed)
    cases = [(rng.choice((10**6, 7 * 10**9, 123_456_789)), rng.choice((1, 2, 4, 8, 64)), rng.choice((1, 2, 4, 8)),
              rng.choice((1, 2, 4, 16)), stage) for stage in (0, 1, 2, 3) for _ in range(points // 4)]
    hypotheses = {
        "no_model_split": lambda n, dp, tp, pp, s: state_reference(n, dp, 1, 1, s),
        "over_world": lambda n, dp, tp, pp, s: sum(zero_bytes_per_rank(n / (tp * pp), dp * tp * pp, s).values()),
        "stage_shifted": lambda n, dp, tp, pp, s: state_reference(n, dp, tp, pp, min(3, s + 1)),
    }
    first, key = first_wrong(answer, cases, state_reference, hypotheses, lambda c, got: tr(
        f"{c[0]:,} parameters, dp {c[1]}, tp {c[2]}, pp {c[3]}, ZeRO stage {c[4]}: your answer is {got!r} bytes.",
        f"パラメータ {c[0]:,}個、dp {c[1]}、tp {c[2]}、pp {c[3]}、ZeRO ステージ {c[4]}: あなたの答えは {got!r} バイトです。"))
    if first is None:
        return right(tr(f"The bytes per rank agree for {len(cases)} layouts.",
                        f"{len(cases)}通りのレイアウトでランクあたりのバイト数が一致しました。"))
    return wrong(first, key)


# ---- 12.3: micro-batches in flight -----------------------------------------------------------------------------
def in_flight_reference(schedule, stage, num_stages, micro_batches):
    """The most micro-batches a stage holds between their forward and their backward. For check authors: see the
    package docstring."""
    if schedule == "gpipe":
        order = [("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)]
    else:
        order = order_1f1b(stage, num_stages, micro_batches)
    alive = most = 0
    for kind, _ in order:
        alive += 1 if kind == "F" else -1
        most = max(most, alive)
    return most


@exercise("12.3", title=("Micro-batches in flight", "処理中のマイクロバッチ"), hints=[
    ("Look at the activation memory of the schedules in this chapter and at exercise 10.2's order of 1F1B.",
     "この章のスケジュールごとの活性化のメモリと、練習問題 10.2 の 1F1B の順序を見てください。"),
    ("A micro-batch's activations stay from its forward until its backward on that stage. Walk through the order of "
     "passes and count how many are alive at once; take the largest count.",
     "マイクロバッチの活性化は、そのステージでの順伝播から逆伝播まで残ります。パスの順序をたどり、同時にいくつ残って"
     "いるかを数え、その最大を取ります。"),
    ("Follow each schedule's order of passes on one stage and count, at the worst moment, how many forwards "
     "have run whose backward has not.",
     "1"
     "つのステージでの各スケジュールのパスの順序をたどり、逆伝播がまだ済んでいない順伝播が最も多くなる瞬間に、それがいくつあるかを数えます。"),
], mistakes={
    "stage_ignored": ("Every stage of your 1F1B holds the same number. The first stage warms up longest; the last holds "
                      "just one micro-batch at a time.",
                      "1F1B のどのステージも同じ数になっています。最初のステージのウォームアップが最も長く、最後のステージ"
                      "が持つのは一度に 1個だけです。"),
    "one_short": ("One too few: count the micro-batch whose backward is about to run, min(m, p - stage) in all.",
                  "1個足りません。これから逆伝播が始まるマイクロバッチも数えると、全部で min(m, p - stage) 個です。"),
    "gpipe_for_both": ("Your 1F1B holds every micro-batch, as GPipe does. 1F1B runs a backward as soon as it can, "
                       "which is what frees the activations.",
                       "1F1B でも GPipe と同じくすべてのマイクロバッチを持っています。1F1B はできるだけ早く逆伝播を行い、"
                       "それが活性化を解放します。"),
})
def check_12_3(answer):
    """Compare with a count over GPipe's and 1F1B's orders for every stage of pipelines of 1 to 6 stages.
    Explained in 12_planning."""
    cases = [(s, stage, p, m) for s in ("gpipe", "1f1b") for p in range(1, 7) for m in sorted({p, p + 2, 2 * p, 9})
             for stage in range(p)]
    hypotheses = {
        "stage_ignored": lambda s, st, p, m: m if s == "gpipe" else min(m, p),
        "one_short": lambda s, st, p, m: m if s == "gpipe" else min(m, p - st) - 1,
        "gpipe_for_both": lambda s, st, p, m: m,
    }
    first, key = first_wrong(answer, cases, in_flight_reference, hypotheses, lambda c, got: tr(
        f"{c[0]}, stage {c[1]} of {c[2]}, {c[3]} micro-batches: your count is {got!r}.",
        f"{c[0]}、{c[2]}ステージ中のステージ {c[1]}、マイクロバッチ {c[3]}個: あなたの数は {got!r} です。"), rel=0)
    if first is None:
        return right(tr(f"The counts agree for every stage in {len(cases)} cases.",
                        f"{len(cases)}通りで、どのステージの数も一致しました。"))
    return wrong(first, key)
