# %% [markdown]
# <!-- en -->
# # 12. Planning a run: schedules, a layout planner, and the choice for your cluster
#
# Chapters 8 to 11 gave a dozen ways to divide training: data parallelism with and without sharding, tensor,
# sequence, context, expert and pipeline parallelism. Each was built from messages, proved equal to one process and
# measured. The question every reader ends with is the one this chapter answers: **which layout should I use, for
# my model, on my cluster?** It does so in four steps:
#
# 1. **Schedules beyond 1F1B.** Chapter 10 found the pipeline's bubble; interleaving (several smaller stages per
#    rank) and zero-bubble schedules (the backward split into an input-gradient and a weight-gradient pass) shrink
#    it. They are run, checked against one process and measured beside their formulas.
# 2. **A layout planner.** A small module, `mparlib.planner`, predicts the memory per rank and the step time of a
#    layout from the shape of a model, a global batch and a few numbers of a cluster, with the chapters' own
#    formulas, each cited to the chapter that measured it.
# 3. **Checked on 8 processes.** The course's transformer is trained in several layouts on 8 processes of this
#    machine, each checked against one process, and the planner's predictions, made from inputs measured in the
#    same run, are set beside what was measured.
# 4. **On paper, at scale.** The same planner, fed published hardware figures, reasons about 8B and 70B models on
#    64 to 8,192 GPUs and about a mixture of experts, beside the layouts Llama 3 was trained with.
#
# It ends with a procedure for choosing a layout on a cluster of your own, and with the end of the course.
# <!-- ja -->
# # 12. 訓練のプラン: スケジュール、レイアウトのプランナー、手元のクラスタでの選び方
#
# 8〜11章では、訓練を分ける方法を十あまり扱いました。シャーディングのあるデータ並列とないデータ並列、テンソル並列、シーケンス並列、コンテキスト並列、エキスパート並列、パイプライン並列です。どれもメッセージから組み立て、1個のプロセスと等しいことを証明し、測りました。ここまで読むと、最後に 1つの問いが残ります。**自分のモデルを自分のクラスタで訓練するには、どのレイアウトを使えばよいのでしょうか。** この章は、この問いに 4つの段階で答えます。
#
# 1. **1F1B の先のスケジュール。** 10章ではパイプラインのバブルを測りました。インターリーブ（1つのランクに小さなステージを複数置く方法）とゼロバブルのスケジュール（逆伝播を入力の勾配のパスと重みの勾配のパスに分ける方法）は、バブルを小さくします。これらを実行し、1個のプロセスと比べて確かめ、式と並べて測ります。
# 2. **レイアウトのプランナー。** 小さなモジュール `mparlib.planner` は、モデルの形状、全体のバッチサイズ、クラスタのいくつかの数値から、レイアウトのランクあたりのメモリと 1ステップの時間を予測します。使う式はどれもこれまでの章のもので、それを測った章を示します。
# 3. **8個のプロセスでの検証。** このコースの Transformer を、このマシンの 8個のプロセスでいくつかのレイアウトで訓練し、それぞれを 1個のプロセスと比べて確かめます。そして、同じ実行の中で測った入力から作ったプランナーの予測を、測った値と並べます。
# 4. **大規模な構成の机上検討。** 同じプランナーに公表されているハードウェアの数値を与え、8B と 70B のモデルを 64〜8,192枚の GPU で訓練する場合と、MoE のモデルの場合を検討し、Llama 3 の訓練に使われたレイアウトと並べます。
#
# 最後に、自分のクラスタでレイアウトを選ぶための手順を示して、このコースを締めくくります。

# %% tags=["nbval-ignore-output"]
import time

import matplotlib.pyplot as plt
import torch
from torch.nn import functional as F

import mparlib
import mparlib.plot
from mparlib import diagrams, layouts, planner, schedules
from mparlib.errors import ConfigError
from mparlib.lang import join, table, tr
from mparlib.launch import launch
from mparlib.rendezvous import describe, interface_of, listening_store
from mparlib.sharding import PART_NAMES as PART  # params, grads, optimizer, other: each edition's label

# %load_ext mparlib.launch

# The course needs torch 2.11 or newer (pyproject.toml; this chapter runs ScheduleDualPipeV and replays torch's own
# order of passes, both newer than that). An older torch would fail deep inside a worker, so say so now.
floor = mparlib.devices.check_torch(tr("Chapter 12", "12章"))
mparlib.plot.use_course_style()  # a font with Japanese glyphs for this notebook's figures
print(mparlib.report())
print(mparlib.profile_line())
PROFILE = mparlib.profile()
CHAPTER_START = time.perf_counter()

# %% [markdown]
# <!-- en -->
# The cells below start groups of 2, 4 and 8 processes. Where the machine has fewer GPUs than processes, they run
# on the CPU with `gloo`; the next cell says which applies here. Checked outputs are the same either way; timings
# are printed in cells whose output depends on the machine.
# <!-- ja -->
# この後のセルでは、2個、4個、8個のプロセスのグループを起動します。マシンの GPU がプロセスの数より少なければ、プロセスは CPU 上で `gloo` を使って動きます。ここでどちらになるかは次のセルが表示します。検査される出力はどちらの場合も同じです。時間の計測値は、マシンによって変わる出力のセルに表示します。

# %% tags=["nbval-ignore-output"]
for n in (2, 4, 8):
    print(describe(n))

# %% [markdown]
# <!-- en -->
# ## Schedules beyond 1F1B
#
# Chapter 10 measured GPipe and 1F1B and found that 1F1B saves memory, not time: both leave each rank idle for
# `(p - 1) / (m + p - 1)` of a step, the time it takes the first micro-batch to reach the last stage and its
# gradient to come back. Two ideas shrink that idle time without more micro-batches.
#
# - **Interleaving** (interleaved 1F1B; Narayanan et al., 2021, "Efficient Large-Scale Language Model Training on
#   GPU Clusters Using Megatron-LM"). Cut the model into `v p` stages instead of `p`, and give each rank `v` of
#   them in a loop: rank `r` holds stages `r, r + p, r + 2p, ...`. A stage is now `v` times smaller, so filling
#   and draining the pipeline costs `(p - 1)` passes of a stage `v` times smaller: idle `(p - 1) / v` against
#   busy `m`, a share of `(p - 1) / (v m + p - 1)`. The price: a micro-batch crosses the ranks `v` times, so there
#   are `v` times as many messages, and more micro-batches are in flight at once.
# - **Zero bubble** (Qi et al., 2024, "Zero Bubble Pipeline Parallelism"). The backward of a stage is two
#   computations: the gradient with respect to its input (call it I here; the paper calls it B), which the previous stage waits for,
#   and the gradient with respect to its weights (W), which nobody waits for. Running W later, wherever a rank would
#   otherwise wait, fills the bubble. The paper's ZB-V schedule gives each rank two stages in a **V**: rank `r`
#   holds stages `r` and `2p - 1 - r`, so a micro-batch goes down the ranks and back up, and rank 0 holds the first
#   stage and the last one (it computes the loss). With F, I and W of a stage taking the same time, each rank
#   idles only `p - 1` passes once `m >= 2p - 1`, however large `m` is: the share `(p - 1) / (6 m + p - 1)` falls
#   towards zero. (The paper calls the schedule "zero bubble" because the next step can start on each rank as soon
#   as it is done; measured from the first start to the last end of one step, as here, those `p - 1` passes
#   remain.) DualPipeV (from DeepSeek's DualPipe, 2024) uses the same V placement and pairs a forward with a backward.
#
# `schedules.stage_indices` gives the stages a rank holds; `schedules.check_micro_batches` says, before torch
# does, what a schedule needs (1F1B at least `p` micro-batches, DualPipeV at least `2p`, the interleaved schedules a
# whole number of rounds of `p`). Under the V placement the middle rank holds two neighbouring stages (rank `p - 1`
# holds stages `p - 1` and `p`). Before its first step, the schedule of torch 2.11 opens the link to every
# neighbouring stage with a small message, this rank's own included, and gloo cannot send from a rank to itself;
# `schedules.without_self_messages` leaves those messages out (torch 2.14 skips them itself).
# <!-- ja -->
# ## 1F1B の先のスケジュール
#
# 10章では GPipe と 1F1B を測り、1F1B が節約するのはメモリで、時間ではないことを確かめました。どちらでも、各ランクはステップのうち `(p - 1) / (m + p - 1)` の割合だけ遊んでいます。最初のマイクロバッチが最後のステージに届き、その勾配が戻ってくるまでの時間です。マイクロバッチを増やさずにこの遊びを減らす考え方が 2つあります。
#
# - **インターリーブ**（インターリーブ 1F1B。Narayanan ら、2021年、"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"）。モデルを `p` 個ではなく `v p` 個のステージに切り、各ランクにループ状に `v` 個ずつ持たせます。ランク `r` はステージ `r, r + p, r + 2p, ...` を持ちます。ステージは `v` 分の 1 の大きさになるので、パイプラインを満たして空にする費用は、`v` 分の 1 の大きさのステージの `(p - 1)` 回分です。遊びは `(p - 1) / v`、仕事は `m` で、割合は `(p - 1) / (v m + p - 1)` になります。その代わり、マイクロバッチはランクの間を `v` 周するのでメッセージは `v` 倍になり、同時に抱えるマイクロバッチも増えます。
# - **ゼロバブル**（Qi ら、2024年、"Zero Bubble Pipeline Parallelism"）。ステージの逆伝播は 2つの計算からなります。入力についての勾配（ここでは I と呼びます。論文では B）は前のステージが待っています。重みについての勾配（W）は誰も待っていません。W を後回しにして、ランクが待つはずだった時間に実行すれば、バブルが埋まります。論文の ZB-V スケジュールは、各ランクに 2つのステージを **V** の形に持たせます。ランク `r` はステージ `r` と `2p - 1 - r` を持ちます。マイクロバッチはランクを下っていき、また上ってきます。ランク 0 は最初のステージと最後のステージを持ち、損失を計算します。ステージの F、I、W がどれも同じ時間なら、`m >= 2p - 1` のとき各ランクが遊ぶのは、`m` がいくら大きくても `p - 1` 回分だけです。割合 `(p - 1) / (6 m + p - 1)` は 0 に近づいていきます（論文が「ゼロバブル」と呼ぶのは、各ランクが自分の仕事を終えたらすぐ次のステップを始められるからです。ここでのように 1ステップを最初の開始から最後の終了まで測ると、この `p - 1` 回分が残ります）。DualPipeV（DeepSeek の DualPipe、2024年から）も同じ V 字の配置を使い、順伝播と逆伝播を組にして進めます。
#
# ランクが持つステージは `schedules.stage_indices` が返します。スケジュールに何が必要かは、torch より先に `schedules.check_micro_batches` が教えてくれます（1F1B は `p` 個以上のマイクロバッチ、DualPipeV は `2p` 個以上、インターリーブのスケジュールは `p` 個ずつの回がちょうど割り切れる数）。V 字の配置では、真ん中のランクが隣り合う 2つのステージを持ちます（ランク `p - 1` がステージ `p - 1` と `p` を持ちます）。torch 2.11 のスケジュールは最初のステップの前に、隣のステージそれぞれへ小さなメッセージを送ってリンクを開きます。このとき自分のランクの中の隣にも送りますが、gloo はランクから自分自身へは送れません。`schedules.without_self_messages` はそのメッセージを除きます（torch 2.14 は自分で飛ばします）。

# %%
NAMES = {"1f1b": "1F1B", "interleaved1f1b": tr("interleaved 1F1B", "インターリーブ 1F1B"), "zbv": "ZBV",
         "dualpipev": "DualPipeV"}
print(tr("stages held by each rank, p = 4", "各ランクが持つステージ（p = 4）"))
print(table([[NAMES[name]] + [str(schedules.stage_indices(name, r, 4)) for r in range(4)] for name in NAMES],
            [("schedule", "スケジュール")] + [(f"rank {r}", f"ランク {r}") for r in range(4)]))
try:
    schedules.check_micro_batches("interleaved1f1b", 4, 9)
except ConfigError as error:  # what a learner sees instead of torch's error deep inside the schedule
    print(error)

# %%
assert [schedules.stage_indices("interleaved1f1b", r, 4) for r in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
assert [schedules.stage_indices("zbv", r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]

# %% [markdown]
# <!-- en -->
# Before measuring, the same schedules with every pass taking the same time and messages taking none:
# `schedules.simulate_schedule` replays the order in which torch runs each rank's passes (the tests check that it is the
# order the ranks really ran). Each rank is one row; bars of a rank's second stage carry a prime, input-gradient
# passes are hatched `\\` and weight-gradient passes are grey. In ZBV the grey W passes fill what would be gaps.
# <!-- ja -->
# 測る前に、同じスケジュールを、どのパスも同じ時間で、通信には時間がかからないものとして見ておきます。`schedules.simulate_schedule` は、torch が各ランクのパスを実行する順序をそのまま再現します（この順序が実際にランクの動いた順序と同じであることは、テストで確かめています）。1つのランクが 1段で、ランクの 2つ目のステージの棒にはプライム（'）が付きます。入力の勾配のパスには `\\` の斜線を引き、重みの勾配のパスは灰色です。ZBV では、灰色の W のパスが、本来なら隙間になるところを埋めています。

# %%
fig, axes = plt.subplots(3, 1, figsize=(10, 5.6))
for ax, name in zip(axes, ("1f1b", "interleaved1f1b", "zbv")):
    v = 1 if name == "1f1b" else 2
    notes = schedules.simulate_schedule(name, 2, 4, (1 / v, 1 / v, 1 / v))  # the same model: v stages per rank
    share = schedules.bubble_fraction(notes)
    diagrams.draw_timeline(ax, notes, tr(f"{NAMES[name]}, p=2, m=4, simulated: bubble {share:.1%}",
                                         f"{NAMES[name]}、p=2、m=4、模擬: バブル {share:.1%}"),
                           unit=1, xlabel=tr("time (passes of a whole rank's layers)", "時間（1ランク分の層のパス）"))
fig.tight_layout()
plt.show()

# %%
for name in ("1f1b", "interleaved1f1b", "zbv"):
    v = 1 if name == "1f1b" else 2
    simulated = schedules.bubble_fraction(schedules.simulate_schedule(name, 2, 4))
    assert abs(simulated - schedules.bubble_formula(2, 4, schedule=name, stages_per_rank=v)) < 1e-12

# %% [markdown]
# <!-- en -->
# Now on real ranks. `schedules.measure_schedules` is a worker: every rank builds the same model of 8 layers
# (`Linear(256, 256)` and tanh), cut into `p` stages for 1F1B and into `2p` half-size stages for the others, so that
# each schedule trains the same model on the same batch. For each schedule and `m` it runs one untimed step
# and then timed ones, with `schedules.StageTimes` on every stage noting its F, B, I and W passes (merged per rank by `schedules.rank_notes`), and compares
# every parameter's gradient after the first step with one process on the whole batch (float64). It also counts,
# per rank, the most micro-batches whose forward has run and whose backward has not (`schedules.in_flight`), and
# the bytes autograd keeps for one micro-batch of one stage (`schedules.saved_bytes`). 2 ranks run `m` = 4 and 8;
# 4 ranks run `m` = 8 (DualPipeV needs `m >= 2p`).
# <!-- ja -->
# では実際のランクで動かします。`schedules.measure_schedules` はワーカーです。どのランクも同じ 8層のモデル（`Linear(256, 256)` と tanh）を作り、1F1B では `p` 個のステージに、ほかのスケジュールでは半分の大きさの `2p` 個のステージに切ります。こうすると、どのスケジュールも同じバッチで同じモデルを訓練します。スケジュールと `m` ごとに、時間を測らないステップを 1回、続いて測るステップを実行します。各ステージには `schedules.StageTimes` を付け、F、B、I、W のパスを記録します（ランクごとにまとめるのは `schedules.rank_notes` です）。最初のステップの後のすべてのパラメータの勾配を、バッチ全体を 1個のプロセスで処理した結果（float64）と比べます。さらに、順伝播は済んだが逆伝播はまだのマイクロバッチが同時にいくつあったかの最大値をランクごとに数え（`schedules.in_flight`）、1つのステージで 1つのマイクロバッチのために autograd が取っておくバイト数を測ります（`schedules.saved_bytes`）。2ランクでは `m` = 4 と 8、4ランクでは `m` = 8 を実行します（DualPipeV には `m >= 2p` が必要です）。

# %% tags=["nbval-ignore-output"]
SCHEDULE_RUN = dict(schedules=tuple(NAMES), width=256, layers=8, micro_batch_size=32, warmup=1)
beyond = {2: launch(schedules.measure_schedules, 2, kwargs=dict(SCHEDULE_RUN, micro_batches=(4, 8), steps=2),
                    timeout=300),
          4: launch(schedules.measure_schedules, 4, kwargs=dict(SCHEDULE_RUN, micro_batches=(8,), steps=2),
                    timeout=300)}
print(table([[NAMES[name], p, m, f"{entry['parity']:.1e}"] for p, result in beyond.items()
             for name, by_m in result.items() for m, entry in by_m.items()],
            [("schedule", "スケジュール"), "p", "m", ("gradients vs 1 process", "勾配の差（1プロセス比）")]))

# %%
for p, result in beyond.items():
    assert sorted(result) == sorted(NAMES)
    for name, by_m in result.items():
        for m, entry in by_m.items():
            assert entry["parity"] <= 1e-12, (name, p, m)  # float64: the same gradients as one process
            simulated = schedules.simulate_schedule(name, p, m)
            assert [[n[:2] + n[4:] for n in rank] for rank in entry["notes"]] == \
                   [[n[:2] + n[4:] for n in rank] for rank in simulated]  # the order torch ran is the simulated one
            for rank in entry["notes"]:
                for stage in {n[4] for n in rank}:
                    kinds = [n[0] for n in rank if n[4] == stage]
                    assert kinds.count("F") == m and kinds.count("B") + kinds.count("I") == m
                    assert kinds.count("B") + kinds.count("W") == m
            assert 0 < entry["measured"] < 1

# %% [markdown]
# <!-- en -->
# The bubble of each run: the median of the timed steps (with the smallest and largest), the formula, and
# `simulate_schedule` given this run's own median pass times (computation only, messages free). For
# interleaved 1F1B the column idle/busy is the formula's idle time divided by its busy time, the `(p - 1) / (v m)`
# of the Megatron-LM paper.
# <!-- ja -->
# 各実行のバブルです。測ったステップの中央値（最小値と最大値も）、式の値、そしてこの実行で測ったパスの時間の中央値を `simulate_schedule` に与えた値（計算だけを数え、通信は時間 0）を並べます。インターリーブ 1F1B の「遊び/仕事」の列は、式の遊びの時間を仕事の時間で割った値で、Megatron-LM の論文の `(p - 1) / (v m)` です。

# %% tags=["nbval-ignore-output"]
rows = []
for p, result in beyond.items():
    for name, by_m in result.items():
        for m, e in by_m.items():
            formula = "-" if e["formula"] is None else f"{e['formula']:.3f}"
            ratio = f"{e['formula'] / (1 - e['formula']):.3f}" if name == "interleaved1f1b" else "-"
            rows.append([NAMES[name], p, m, f"{e['measured']:.3f}", f"{min(e['steps']):.3f}-{max(e['steps']):.3f}",
                         formula, ratio, f"{e['simulated']:.3f}"])
print(table(rows, [("schedule", "スケジュール"), "p", "m", ("measured", "測定値"), ("min-max", "最小-最大"),
                   ("formula", "式"), ("idle/busy", "遊び/仕事"), ("simulated", "模擬")], align="<>>>>>>>"))

# %%
for p, result in beyond.items():
    for m in result["interleaved1f1b"]:
        inter = schedules.bubble_formula(p, m, schedule="interleaved1f1b", stages_per_rank=2)
        assert abs(inter / (1 - inter) - (p - 1) / (2 * m)) < 1e-12
        assert schedules.bubble_formula(p, m, schedule="zbv") < inter < schedules.bubble_formula(p, m)

# %% [markdown]
# <!-- en -->
# The timelines of the 2-rank runs with `m` = 4, as measured (times in milliseconds from the step's first start).
# <!-- ja -->
# 2ランク、`m` = 4 の実行の、測ったままのタイムラインです（時間は、ステップの最初の開始からのミリ秒）。

# %% tags=["nbval-ignore-output"]
fig, axes = plt.subplots(len(NAMES), 1, figsize=(10, 1.7 * len(NAMES) + 0.6))
for ax, name in zip(axes, NAMES):
    e = beyond[2][name][4]
    diagrams.draw_timeline(ax, e["notes"], tr(f"{NAMES[name]} on 2 processes, m=4: bubble {e['measured']:.0%}",
                                              f"{NAMES[name]}、プロセス 2個、m=4: バブル {e['measured']:.0%}"))
fig.tight_layout()
plt.show()

# %% [markdown]
# <!-- en -->
# Activations in flight. A 1F1B rank holds at most `p - r` micro-batches at once (rank `r`), `p` on the first
# rank. Counted in stages it is hard to compare: the two-stage schedules' stages are half as large. The table
# therefore also gives bytes: the most micro-batches held at once times what autograd keeps for one micro-batch of one of
# the rank's stages, on the rank that holds the most. "until I" counts a micro-batch until its input gradient,
# "until W" until its weight gradient, which still needs each layer's input.
# <!-- ja -->
# 同時に抱える活性化です。1F1B のランク `r` が一度に抱えるマイクロバッチは最大 `p - r` 個で、最初のランクでは `p` 個です。ステージの数で数えると比べにくくなります。2つのステージを持つスケジュールでは、ステージが半分の大きさだからです。そこで表にはバイト数も載せます。同時に抱えるマイクロバッチの最大数に、そのランクのステージ 1つでマイクロバッチ 1つのために autograd が取っておく量を掛けたもので、いちばん多く抱えるランクの値です。「I まで」は入力の勾配まで、「W まで」は重みの勾配まで数えます。重みの勾配にも各層の入力が必要だからです。

# %%
rows = []
for p, result in beyond.items():
    for m in (8,):
        base = None
        for name, by_m in result.items():
            e = by_m[m]
            until_i = [c["I"] for c in e["in_flight"]]
            held = max(until_i) * e["saved_bytes"]
            base = held if name == "1f1b" else base
            rows.append([NAMES[name], p, m, str(until_i), str([c["W"] for c in e["in_flight"]]), f"{held / 2**10:.0f}",
                         f"{held / base:.2f}"])
print(table(rows, [("schedule", "スケジュール"), "p", "m", ("per rank, until I", "ランクごと（I まで）"),
                   ("until W", "W まで"), "KiB", ("vs 1F1B", "1F1B 比")], align="<>>>>>>"))

# %%
for p, result in beyond.items():
    flights = {name: [c["I"] for c in result[name][8]["in_flight"]] for name in result}
    assert flights["1f1b"] == [p - r for r in range(p)]
    assert max(flights["interleaved1f1b"]) > 2 * p  # more than 1F1B's p, in stages half as large
    assert all(c["W"] >= c["I"] for name in result for c in result[name][8]["in_flight"])

# %% [markdown]
# <!-- en -->
# What the fixed cost per pass does to each formula. Chapter 10 found a cost that comes with every micro-batch
# whatever its size. Where is it? A pass of `k` layers takes `c + k a`; comparing the same kind of pass on 1F1B's
# stages and on the half-size ones (4 and 2 layers for p = 2, 2 and 1 for p = 4) gives
# `c = 2 t(half) - t(whole)`, from the shortest passes (on a shared machine a pass can be slowed, never sped up).
# The time between passes is the other place: `gap per pass` is how much longer the step took than its replay by
# `simulate_schedule` with the run's own median pass times, divided by the number of passes a rank runs.
# <!-- ja -->
# パスごとの固定のコストが、それぞれの式にどう効くかを見ます。10章では、大きさによらずマイクロバッチごとにかかる費用が見つかりました。それはどこにあるのでしょうか。`k` 層のパスにかかる時間を `c + k a` とします。同じ種類のパスを、1F1B のステージと半分の大きさのステージ（p = 2 では 4層と 2層、p = 4 では 2層と 1層）で比べると、`c = 2 t(半分) - t(全体)` です。ここでは最短のパスを使います（共有のマシンでは、パスが遅くなることはあっても速くなることはないからです）。もう 1つの候補はパスとパスの間の時間です。「パスあたりの隙間」は、実行で測ったパスの時間の中央値で `simulate_schedule` が再現したステップより実際のステップがどれだけ長かったかを、1つのランクが実行するパスの数で割ったものです。

# %% tags=["nbval-ignore-output"]
costs, gaps = [], []
for p, result in beyond.items():
    m = 8
    full, half = result["1f1b"][m]["fastest"], result["interleaved1f1b"][m]["fastest"]
    for kind in "FB":
        c, per_layer = 2 * half[kind] - full[kind], (full[kind] - half[kind]) / (8 // p - 8 // (2 * p))
        costs.append([p, m, kind, f"{1e3 * c:.2f}", f"{1e3 * per_layer:.2f}"])
    for name, by_m in result.items():
        gaps.append([p, m, NAMES[name], f"{1e3 * by_m[m]['gap_per_pass']:.2f}", sum(map(len, by_m[m]['notes'])) // p])
print(table(costs, ["p", "m", ("pass", "パス"), ("fixed ms", "固定のコスト ms"), ("ms per layer", "1層あたり ms")]))
print()
print(table(gaps, ["p", "m", ("schedule", "スケジュール"), ("gap per pass, ms", "パスあたりの隙間 ms"),
                   ("passes per rank", "ランクあたりのパス数")]))

# %%
for p, result in beyond.items():
    passes = {name: sum(map(len, result[name][8]["notes"])) // p for name in result}
    assert passes["1f1b"] == 2 * 8 and passes["interleaved1f1b"] == 4 * 8 and passes["zbv"] == 6 * 8

# %% [markdown]
# <!-- en -->
# Each formula counts only the work. Under a fixed cost per pass, a 1F1B rank pays it `2 m` times per step (an F and
# a B per micro-batch); interleaved 1F1B `2 v m` times, and its micro-batches cross the ranks `v` times, so there are
# `v` times as many messages too; ZBV `6 m` times (F, I and W on each of two stages), three times as often as 1F1B.
# Interleaving and zero bubble both trade a smaller bubble for more, smaller pieces of work; when the cost of a piece
# is not small beside its work, what they save in idle time they spend again. In this course's runs the cost sits
# between the passes, not in them: the fixed part `c` of a pass is lost in the noise of a shared machine, while
# the gap per pass is as long as a pass or longer (the table above: a layer's forward takes a fraction of a
# millisecond). The "simulated" column, computation only, stays near the formula; the measured bubble is well above
# both. In `benchmarks/pipeline.py`'s
# saved run on 2 cores (`benchmarks/results/pipeline-vm-20261202-053552.json`: 8 layers of width 512, 32 rows per
# micro-batch, float64), the measured bubbles at `m` = 8 were, on 2 ranks, 1F1B 0.443, interleaved 1F1B 0.551, ZBV
# 0.529 and DualPipeV 0.450 (formulas 0.111, 0.059 and 0.020), and on 4 ranks 0.668, 0.809, 0.754 and 0.701
# (formulas 0.273, 0.158 and 0.059): 1F1B, the schedule with the fewest passes, had the smallest bubble, the
# reverse of the formulas' order. The fixed part `c` came out between -1.7 and +0.1 ms, which cannot be told
# from zero beside 0.6 to 1.9 ms of work per layer, while the gap per pass was 6 to 20 ms. The machine was busy
# (a 1-minute load average of 21 to 24 on 2 cores, recorded in the file), so much of that gap is ranks waiting for
# a core; how large the gap is on a quiet machine, this run cannot say. The schedules that win on a GPU cluster, where a pass lasts far longer than a message, do not win
# here. To see the formulas, make each pass long beside the gap: wider layers, more rows per micro-batch.
# <!-- ja -->
# どの式も仕事だけを数えています。パスごとに固定のコストがかかるなら、1F1B のランクはそれを 1ステップに `2 m` 回払います（マイクロバッチごとに F と B）。インターリーブ 1F1B は `2 v m` 回で、マイクロバッチがランクを `v` 周するので、メッセージも `v` 倍になります。ZBV は `6 m` 回（2つのステージそれぞれで F、I、W）で、1F1B の 3倍の頻度です。インターリーブもゼロバブルも、バブルを小さくする代わりに、仕事を小さく数多く切ります。1つ 1つの費用が仕事に比べて小さくなければ、遊びの時間で節約した分をまた使ってしまいます。このコースの実行では、その費用はパスの中ではなく、パスとパスの間にありました。パスの決まった部分 `c` は共有のマシンの揺らぎに埋もれてしまう一方で、パスあたりの隙間はパスと同じくらいか、それより長くなります（上の表。1層の順伝播は 1ミリ秒に満たない時間です）。計算だけを数えた「模擬」の列は式の近くにあり、測ったバブルはどちらよりもずっと大きくなります。`benchmarks/pipeline.py` を CPU 2コアで実行して保存した結果（`benchmarks/results/pipeline-vm-20261202-053552.json`。幅 512 の層を 8つ、マイクロバッチあたり 32行、float64）では、`m` = 8 のときの測ったバブルは、2ランクで 1F1B 0.443、インターリーブ 1F1B 0.551、ZBV 0.529、DualPipeV 0.450（式では 0.111、0.059、0.020）、4ランクで 0.668、0.809、0.754、0.701（式では 0.273、0.158、0.059）でした。パスの数がいちばん少ない 1F1B のバブルがいちばん小さく、式の大小の順とは逆です。決まった部分 `c` は -1.7〜+0.1 ms で、1層あたり 0.6〜1.9 ms の仕事と比べると 0 と区別できません。一方、パスあたりの隙間は 6〜20 ms でした。このときマシンは混んでいて（CPU 2コアに対して 1分間のロードアベレージが 21〜24。ファイルに記録してあります）、隙間の多くはランクがコアの空くのを待つ時間です。空いたマシンで隙間がどれだけになるかは、この実行からはわかりません。パスがメッセージよりはるかに長い GPU クラスタで勝つスケジュールも、ここでは勝ちません。式どおりの姿を見るには、各パスを隙間に比べて長くします。層を広くし、マイクロバッチの行を増やします。

# %% [markdown]
# <!-- en -->
# ## A layout planner
#
# Every chapter so far ended with a formula next to a measurement: bytes per parameter and what ZeRO leaves per
# rank (chapter 9), the alpha-beta time of a collective and its ring traffic (chapter 8), the pipeline's bubble
# (chapter 10), the collectives of tensor, sequence, context and expert parallelism (chapters 10 and 11).
# `mparlib.planner` puts them together. It runs no model: from a few sizes it predicts what one rank holds and how
# long one step takes, for any layout, in a fraction of a second. Its inputs are four things:
#
# - `planner.ModelShape`: the sizes of a transformer (layers, width, heads and key/value heads, MLP width, tokens
#   per sample, vocabulary or patch inputs, experts and `top_k`). `ModelShape.from_vit(config)` describes the
#   course's ViT, `ModelShape.published(name)` four published models.
# - `planner.Cluster`: devices per node, memory and FLOP/s per device, and chapter 8's `alpha` (seconds per
#   collective) and `beta` (seconds per byte a rank sends) for the link inside a node and the link between nodes.
# - `planner.Layout`: the degrees `dp` (with the ZeRO stage `zero`, 3 being FSDP), `tp` (and `sp`), `cp`, `ep`,
#   `pp` with its `schedule`, `micro_batches` and `stages_per_rank`, and `recompute`. `Layout.check` refuses a
#   layout the model or the batch cannot take, and says what to change.
# - the global batch, in samples.
#
# The formulas, each from the chapter that measured it:
#
# | what | formula | from |
# |---|---|---|
# | parameters, gradients, optimizer state | `bytes_per_parameter` x this rank's weights (`local_parameters`: blocks' matrices / tp, experts / (ep tp), stages / pp), sharded over `dp x cp x ep` ranks by `zero_bytes_per_rank` | chapters 9, 10, 11 |
# | activations per block and token | `activation_bytes_per_layer`: the tensors the block saves, listed below | chapters 9-11 |
# | activations in flight | `in_flight`: GPipe `m`, 1F1B and ZBV `min(m, p)`, interleaved `min(m v, p v + p - 1) / v` stages | chapter 10 |
# | what the data-parallel step adds | ZeRO-3: two blocks' weights and one block's gradients whole (chapter 9), and inside a pipeline the stage's weights and gradients whole; `zero` 0 and 1: a flat copy of the gradients after the backward pass, when the activations are freed (the peak is the larger of the two) | chapters 9, 10 |
# | compute | `flops_per_sample x batch / (ranks x FLOP/s)`; forward + backward = 3 x forward; recomputation 4/3 of it | chapter 7 |
# | a collective | `collective_seconds`: `calls x alpha + bytes sent x beta`, bytes sent = `2 (n-1)/n` of the message for an all-reduce, `(n-1)/n` for reduce-scatter and all-gather, all of it for a send, on the link that `link` picks | chapter 8 |
# | tensor (+ sequence) parallelism | from `planner.TP_PLAN`, the plan the layouts run: per block one all-reduce forward for each row-wise layer (out, fc2) and one backward for each column-wise layer (q, k, v, fc1); with `sp`, an all-gather and a reduce-scatter for each input the column-wise layers share and for each row-wise layer, forward and backward | chapters 10, 11 |
# | context parallelism | ring attention: K and V pass `cp - 1` times forward; backward once more, and their gradients `cp` times | chapter 11 |
# | expert parallelism | two all-to-alls forward and two backward per MoE layer, `(ep - 1) / ep` of the routed rows leave the rank | chapter 11 |
# | data parallelism | `zero=0`: one all-reduce of all the gradients as one flat vector per step; ZeRO-1: one reduce-scatter and one all-gather; ZeRO-2: a reduce-scatter per micro-batch; ZeRO-3 (FSDP): per block an all-gather for each forward and each backward and a reduce-scatter per micro-batch, or, inside a pipeline, `m + 1` all-gathers and one reduce-scatter per step | chapters 6, 9 |
# | pipeline | one activation forward and one gradient backward per micro-batch and stage; the bubble is `bubble_formula`'s share `b` of the step: `busy x b / (1 - b)` | chapter 10 |
#
# Ranks are numbered with the tensor-parallel ranks next to each other, then context, expert and data parallel
# ranks, and the pipeline stages outermost; a group whose ranks do not fit in one node uses the slower link.
# Nothing is assumed to overlap, except a share `overlap` of the data-parallel collectives (DDP's buckets of
# chapter 6 and FSDP's prefetching hide part of them behind the backward pass). Its default, 0, hides nothing; set
# it from a measurement of your own.
#
# First the sizes. The planner's parameter count of the small ViT is that of the real model:
# <!-- ja -->
# ## レイアウトのプランナー
#
# これまでの章は、どれも式と測定値を並べて終わりました。パラメータあたりのバイト数と ZeRO がランクに残す量（9章）、集合通信の α-β モデルの時間とリングの通信量（8章）、パイプラインのバブル（10章）、テンソル並列、シーケンス並列、コンテキスト並列、エキスパート並列の集合通信（10章と 11章）です。`mparlib.planner` はこれらをまとめます。モデルは実行しません。いくつかのサイズから、1つのランクが持つメモリと 1ステップの時間を、どのレイアウトについても 1秒もかからずに予測します。入力は次の 4つです。
#
# - `planner.ModelShape`: Transformer のサイズです（層の数、幅、ヘッドとキー・バリューのヘッドの数、MLP の幅、1サンプルあたりのトークン数、語彙またはパッチの入力、エキスパートの数と `top_k`）。`ModelShape.from_vit(config)` はこのコースの ViT を、`ModelShape.published(name)` は公表されている 4つのモデルを表します。
# - `planner.Cluster`: ノードあたりのデバイスの数、デバイスごとのメモリと FLOP/s、そしてノード内のリンクとノード間のリンクについての 8章の `alpha`（集合通信 1回あたりの秒数）と `beta`（ランクが送る 1バイトあたりの秒数）です。
# - `planner.Layout`: 並列の次数です。`dp`（ZeRO のステージ `zero` と組み合わせます。3 は FSDP です）、`tp`（と `sp`）、`cp`、`ep`、`pp` と、その `schedule`、`micro_batches`、`stages_per_rank`、そして `recompute` です。`Layout.check` は、モデルやバッチが受け付けないレイアウトを拒み、何を変えればよいかを示します。
# - 全体のバッチサイズ（サンプル数）。
#
# 使う式と、それを測った章です。
#
# | 対象 | 式 | 出典 |
# |---|---|---|
# | パラメータ、勾配、オプティマイザの状態 | `bytes_per_parameter` x このランクの重み（`local_parameters`: ブロックの行列は tp で、エキスパートは ep tp で、ステージは pp で割ります）を、`zero_bytes_per_rank` で `dp x cp x ep` 個のランクにシャーディング | 9章、10章、11章 |
# | ブロックとトークンあたりの活性化 | `activation_bytes_per_layer`: ブロックが保存するテンソル（下に列挙します） | 9〜11章 |
# | 処理中のマイクロバッチの活性化 | `in_flight`: GPipe は `m`、1F1B と ZBV は `min(m, p)`、インターリーブは `min(m v, p v + p - 1) / v` ステージ分 | 10章 |
# | データ並列のステップが加えるもの | ZeRO-3: ブロック 2つ分の重みとブロック 1つ分の勾配を丸ごと（9章）。パイプラインの中ではステージの重みと勾配を丸ごと。`zero` が 0 と 1: 逆伝播のあと、活性化が解放されたときの勾配のフラットなコピー（ピークは 2つの大きいほう） | 9章、10章 |
# | 計算 | `flops_per_sample x バッチ / (ランク数 x FLOP/s)`。順伝播 + 逆伝播 = 順伝播の 3倍、再計算ではその 4/3 | 7章 |
# | 集合通信 1種類 | `collective_seconds`: `回数 x alpha + 送るバイト数 x beta`。送るバイト数はオールリデュースでメッセージの `2 (n-1)/n`、リデュース・スキャッターとオールギャザーで `(n-1)/n`、送信ではすべてです。リンクは `link` が選びます | 8章 |
# | テンソル並列（+ シーケンス並列） | レイアウトが実行するプラン `planner.TP_PLAN` から数えます。ブロックごとに、行並列の層（out、fc2）1つにつき順伝播で 1回、列並列の層（q、k、v、fc1）1つにつき逆伝播で 1回のオールリデュースです。`sp` では、列並列の層が共有する入力ごとと行並列の層ごとに、順伝播と逆伝播でオールギャザーとリデュース・スキャッターを 1回ずつ行います | 10章、11章 |
# | コンテキスト並列 | リングアテンション: K と V は順伝播で `cp - 1` 回、逆伝播でもう一度回り、その勾配が `cp` 回回ります | 11章 |
# | エキスパート並列 | MoE の層ごとに順伝播で 2回、逆伝播で 2回のオールツーオール。振り分けた行の `(ep - 1) / ep` がランクの外へ出ます | 11章 |
# | データ並列 | `zero=0`: 1ステップに 1回、すべての勾配を 1本のフラットなベクトルにしてオールリデュース。ZeRO-1: リデュース・スキャッターとオールギャザーを 1回ずつ。ZeRO-2: マイクロバッチごとにリデュース・スキャッター。ZeRO-3（FSDP）: ブロックごとに順伝播と逆伝播のたびにオールギャザー、マイクロバッチごとにリデュース・スキャッター。パイプラインの中では 1ステップに `m + 1` 回のオールギャザーと 1回のリデュース・スキャッター | 6章、9章 |
# | パイプライン | マイクロバッチとステージごとに、順伝播で活性化を 1回、逆伝播で勾配を 1回送ります。バブルはステップのうち `bubble_formula` の割合 `b` で、`busy x b / (1 - b)` です | 10章 |
#
# ランクの番号は、テンソル並列のランクを隣り合わせに置き、その外にコンテキスト並列、エキスパート並列、データ並列のランク、いちばん外にパイプラインのステージを置く順に振ります。1つのノードに収まらないグループは遅いほうのリンクを使います。重なる通信は仮定しません。例外はデータ並列の集合通信のうち `overlap` の割合だけです（6章の DDP のバケットや FSDP の先読みは、その一部を逆伝播の陰に隠します）。既定値の 0 では何も隠れません。自分で測った値を設定してください。
#
# まずサイズです。プランナーが数える small の ViT のパラメータ数は、実際のモデルと同じです。

# %%
from dataclasses import replace

from mparlib.vit import SIZES, Block, vit

# %%
small = planner.ModelShape.from_vit(SIZES["small"])
counted = sum(p.numel() for p in vit("small").parameters())
print(tr("parameters: planner", "パラメータ数: プランナー"), f"{small.parameters():,}", "|",
      tr("the real ViT", "実際の ViT"), f"{counted:,}")
print(tr("FLOPs per sample (forward + backward):", "1サンプルあたりの FLOP 数（順伝播 + 逆伝播）:"),
      f"{small.flops_per_sample():,}")

# %%
assert small.parameters() == counted

# %% [markdown]
# <!-- en -->
# `flops_per_sample` counts every matrix product as `2 m n k`: per token and block the four projections, the
# scores `Q K^T` and their product with `V` (`4 s d` for `s` tokens of width `d`) and the MLP; then the patch
# embedding and the head; the backward pass does two products for each one of the forward pass, 3 x in all. The
# tests compare it with PyTorch's `FlopCounterMode` exactly (with the math attention kernel, whose products the
# counter sees); the one difference is the images' gradient, which the convention counts and nobody computes.
#
# Activations are where a formula is easiest to get wrong, so `activation_bytes_per_layer` lists what an
# `mparlib.vit.Block` really keeps for its backward pass, per token, with `e` bytes per value, width `d`, MLP
# width `f` and `a` heads:
#
# - each LayerNorm's input and output (`4 d` values) and each one's mean and inverse deviation (float32),
# - the queries, keys and values (`3 d`), and the attention's output (`d`), which is also the output projection's
#   input: the CPU's attention kernel writes its output in the token-major layout of its inputs, so the reshape
#   that puts the heads side by side is a view, not a copy,
# - the fused ("flash") attention kernel keeps one log-sum-exp per head and token (`a` values) instead of the
#   `a s` softmax weights that the math kernel keeps; PyTorch runs the fused kernel on the CPU (its backward
#   function is `ScaledDotProductFlashAttentionForCpuBackward0`),
# - the MLP's hidden activation before and after GELU (`2 f`).
#
# The cell counts every storage autograd saves while a block runs forward (a saved-tensor hook; weights left out)
# and sets it beside the formula:
# <!-- ja -->
# `flops_per_sample` は行列の積をどれも `2 m n k` と数えます。トークンとブロックごとに、4つの射影、スコア `Q K^T` とその `V` との積（幅 `d` のトークンが `s` 個なら `4 s d`）、そして MLP です。これにパッチの埋め込みと出力層を加えます。逆伝播は順伝播の積 1つごとに積を 2つ計算するので、全体で 3倍です。テストでは、PyTorch の `FlopCounterMode` と完全に一致することを確かめています（積がカウンタに見える math のアテンションのカーネルを使います）。違いは画像の勾配だけです。この慣習では数えますが、実際には誰も計算しません。
#
# 式をいちばん間違えやすいのは活性化です。そこで `activation_bytes_per_layer` は、`mparlib.vit.Block` が逆伝播のために実際に保存するものをトークンごとに列挙します。値 1つあたり `e` バイト、幅 `d`、MLP の幅 `f`、ヘッド数 `a` とします。
#
# - 2つの LayerNorm の入力と出力（`4 d` 個の値）と、それぞれの平均と標準偏差の逆数（float32）
# - クエリ、キー、バリュー（`3 d`）と、アテンションの出力（`d`）。アテンションの出力は出力の射影の入力でもあります。CPU のアテンションのカーネルは入力と同じトークン優先の配置で出力を書くので、ヘッドを横に並べ直す reshape はコピーではなくビューになります。
# - 融合した（flash）アテンションのカーネルは、math のカーネルが保存する `a s` 個の softmax の重みの代わりに、ヘッドとトークンごとに log-sum-exp を 1つ（`a` 個の値）保存します。PyTorch は CPU でこの融合カーネルを使います（逆伝播の関数は `ScaledDotProductFlashAttentionForCpuBackward0` です）。
# - MLP の中間の活性化の GELU の前と後（`2 f`）
#
# 次のセルは、ブロックの順伝播の間に autograd が保存するストレージをすべて数え（保存済みテンソルのフックを使い、重みは除きます）、式と並べます。

# %%
def saved_bytes(module, x):
    """Bytes of every storage autograd keeps for the backward pass of ``module(x)``, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(kept.values())


rows = []
for size in ("smoke", "small"):
    c = SIZES[size]
    shape, batch = planner.ModelShape.from_vit(c), 8
    x = torch.randn(batch, shape.seq, c.dim, requires_grad=True)
    measured = saved_bytes(Block(c.dim, c.heads, c.hidden), x)
    rows.append((size, planner.activation_bytes_per_layer(shape, 4), batch * shape.seq, measured))
print(table([[size, f"{per_token:,.0f}", tokens, measured] for size, per_token, tokens, measured in rows],
            [("size", "サイズ"), ("bytes per token", "トークンあたりのバイト数"), ("x tokens", "x トークン数"),
             ("measured", "測定値")]))

# %%
assert all(per_token * tokens == measured for _, per_token, tokens, measured in rows)

# %% [markdown]
# <!-- en -->
# The count is exact. The same list, with the knobs of a large model (16-bit values, dropout masks of one byte,
# the math kernel's softmax weights kept, a `4 d` MLP, the norms' statistics left out), gives the formula of
# Korthikanti et al. (*Reducing Activation Recomputation in Large Transformer Models*, 2022), `d (34 + 5 a s / d)`
# bytes per token and layer, and with tensor and sequence parallelism that, divided by `t`. The tests check both.
# With sequence parallelism the course's block of chapter 11 keeps the gathered LayerNorm outputs whole, where
# Megatron keeps them split and gathers them again for the backward pass: `regather=True` counts the latter.
#
# Now memory per rank, `memory_per_rank`, which returns a `planner.Memory`: the small ViT in float32 with Adam, a
# global batch of 64, on 8 ranks in seven layouts:
# <!-- ja -->
# 数は完全に一致します。同じ列挙に大きなモデルの設定（16ビットの値、1バイトのドロップアウトのマスク、math のカーネルが保存する softmax の重み、`4 d` の MLP、正規化の統計量は数えない）を与えると、Korthikanti ら（『Reducing Activation Recomputation in Large Transformer Models』、2022年）の式、トークンと層あたり `d (34 + 5 a s / d)` バイトになります。テンソル並列とシーケンス並列を使うと、それを `t` で割った値です。テストはこの両方を確かめます。なお、シーケンス並列では、11章のこのコースのブロックは集めた LayerNorm の出力を丸ごと保存します。Megatron は分けたまま保存し、逆伝播でもう一度集めます。後者を数えるには `regather=True` を指定します。
#
# 次はランクあたりのメモリで、`memory_per_rank` が `planner.Memory` を返します。small の ViT を float32 と Adam で、全体のバッチサイズ 64 で、8個のランクの 7つのレイアウトで訓練する場合です。

# %%
course_layouts = [planner.Layout(dp=8), planner.Layout(dp=8, zero=1), planner.Layout(dp=8, zero=3),
                  planner.Layout(dp=4, zero=3, tp=2), planner.Layout(dp=2, tp=2, pp=2, micro_batches=2),
                  planner.Layout(dp=4, tp=2, sp=True), planner.Layout(tp=8)]
memories = [planner.memory_per_rank(small, layout, 64, "fp32", "adam") for layout in course_layouts]
print(tr("MiB per rank:", "ランクあたりの MiB:"))
print(table([[layout.label()] + [f"{b / 2**20:.2f}" for b in (m.parameters, m.gradients, m.optimizer, m.activations,
                                                               m.total)]
             for layout, m in zip(course_layouts, memories)],
            [("layout", "レイアウト"), PART["params"], PART["grads"], PART["optimizer"], ("activations", "活性化"),
             ("total", "合計")]))

# %%
ddp, zero1, zero3 = memories[:3]
assert zero3.total < zero1.total < ddp.total and ddp.activations == zero3.activations
assert zero1.optimizer == ddp.optimizer / 8 and zero3.parameters == ddp.parameters / 8
assert memories[-1].parameters < ddp.parameters / 4  # tp 8 splits the blocks' matrices, not the norms and biases

# %% [markdown]
# <!-- en -->
# ZeRO shrinks the state and leaves the activations alone; tensor parallelism shrinks both the weights and the
# activations inside the block, but every tensor-parallel rank works on the whole batch of its replica, so `tp 8`
# holds the whole batch's activations on every rank. The section after this one measures layouts like these on 8
# processes.
#
# `step_time` returns a `planner.StepTime`, the seconds of each part. On a published cluster,
# `Cluster.h100()`: servers of 8 H100 SXM 80 GB (data sheet: 989 TFLOP/s dense BF16, NVLink 4 at 900 GB/s per GPU,
# both directions together, so 450 GB/s each way), 400 Gb/s InfiniBand per GPU between servers (50 GB/s), and
# compute charged at 400 TFLOP/s per GPU, the rate Llama 3 405B trained at (*The Llama 3 Herd of Models*, 2024:
# 38 to 43% of the peak). The published figures give no latencies, so `alpha` is 0. Llama 3 8B on 64 GPUs, with
# tensor parallelism over each server, for Llama 3's batch of 2,048 sequences of 8,192 tokens:
# <!-- ja -->
# ZeRO は状態を小さくしますが、活性化は変えません。テンソル並列は重みとブロック内の活性化の両方を小さくしますが、テンソル並列のどのランクもそのレプリカのバッチ全体を処理するので、`tp 8` ではどのランクもバッチ全体の活性化を持ちます。この後の節では、このようなレイアウトを 8個のプロセスで測ります。
#
# `step_time` は `planner.StepTime` を返します。各部分の秒数です。公表されているクラスタ `Cluster.h100()` で試します。8枚の H100 SXM 80 GB を載せたサーバーで（データシートの値: 密な BF16 で 989 TFLOP/s、NVLink 4 は GPU あたり 900 GB/s で、これは両方向の合計なので片方向 450 GB/s）、サーバー間は GPU ごとに 400 Gb/s の InfiniBand（50 GB/s）です。計算は GPU あたり 400 TFLOP/s として数えます。これは Llama 3 405B の訓練で得られた値です（『The Llama 3 Herd of Models』、2024年: ピークの 38〜43%）。公表値にレイテンシはないので `alpha` は 0 です。Llama 3 8B を 64枚の GPU で、各サーバーの中でテンソル並列を使い、Llama 3 のバッチ（8,192トークンの系列 2,048本）で訓練する場合です。

# %%
h100 = planner.Cluster.h100()
llama8 = planner.ModelShape.published("llama3-8b")
example = planner.Layout(dp=8, tp=8, sp=True, zero=1, micro_batches=256)
t = planner.step_time(llama8, example, 2048, h100, "mixed")
m = planner.memory_per_rank(llama8, example, 2048, "mixed", regather=True)
print(join([llama8.name, "64 x H100", example.label(), f"2048 x 8192 {tr('tokens', 'トークン')}"]))
names = {"compute": tr("compute", "計算"), "tp": tr("tensor parallel", "テンソル並列"),
         "cp": tr("context parallel", "コンテキスト並列"), "ep": tr("expert parallel", "エキスパート並列"),
         "pp": tr("pipeline sends", "パイプラインの送受信"), "bubble": tr("bubble", "バブル"),
         "dp_exposed": tr("data parallel (not hidden)", "データ並列（隠れない分）")}
print(table([[label, f"{getattr(t, field):.3f} s"] for field, label in names.items()]
            + [[("step", "1ステップ"), f"{t.total:.3f} s"], [("memory per rank", "ランクあたりのメモリ"), f"{m.total / 1e9:.1f} GB"]]))

# %%
assert t.total == t.compute + t.tp + t.cp + t.ep + t.pp + t.bubble + t.dp_exposed
assert t.bubble == 0 and t.cp == t.ep == t.pp == 0 and t.dp == t.dp_exposed  # no pipeline, nothing overlapped
assert 0.15 < t.tp / t.total < 0.25  # the sentence below

# %% [markdown]
# <!-- en -->
# Tensor parallelism's collectives take about a fifth of this step: with sequence parallelism each of the 32 blocks
# runs four all-gathers and four reduce-scatters of a `(8192, 4096)` activation for each of the 256 sequences of a
# replica. That layout fits easily, but it is not the best one; `plan` finds out which is.
# <!-- ja -->
# このステップの約 5分の 1 はテンソル並列の集合通信です。シーケンス並列では、32個のブロックのそれぞれが、レプリカの 256本の系列ごとに `(8192, 4096)` の活性化のオールギャザーを 4回、リデュース・スキャッターを 4回行います。このレイアウトは余裕をもって収まりますが、最善ではありません。どれが最善かは `plan` が調べます。

# %% [markdown]
# <!-- en -->
# ### Collectives counted from the plan
#
# The collectives in the table are not constants written beside the code. `planner.TP_PLAN` says how each linear
# layer of a block is split; `layouts.block_plan` turns it into DTensor's `ColwiseParallel` and `RowwiseParallel`
# for the layouts that run in the next section, and `planner.collectives` counts from the same table. A row-wise
# layer all-reduces its output in the forward pass and a column-wise layer its input's gradient in the backward
# pass: DTensor converts each layer's input on its own, so q, k and v cost three all-reduces where one fused `qkv`
# matrix would cost one. The data-parallel collectives come from `planner.rank_tensors`, the parameters a rank
# holds, unit by unit as FSDP wraps them (each tensor's first dimension padded to a multiple of the group, as FSDP2
# pads it), and from what the layouts' code does: one flat all-reduce for `zero=0`, FSDP2's all-gathers and
# reduce-scatters for `zero=3`. Inside `torch.distributed.pipelining` FSDP2 keeps a stage's units whole after each
# backward pass and reduce-scatters once, after the last, so a block is all-gathered `m + 1` times a step (for each
# forward pass that follows a forward pass, and for the first backward pass), whatever the order of the schedule.
#
# `collectives` returns a list of `planner.Collective`: what it serves, its kind, calls per step, bytes (the whole
# tensor of each call, as chapter 9's `CollectiveLog` counts it) and the group's size. `step_time` prices each one
# with the alpha-beta model (`Collective.seconds`); `by_kind` totals them in the form of `CollectiveLog.summary()`,
# so that a run can be compared with the prediction key by key. fsdp 2 x tp 2 x pp 2 of the small ViT, a global
# batch of 32 in two micro-batches, on its two pipeline ranks:
# <!-- ja -->
# ### プランから数える集合通信
#
# 表の集合通信は、コードの横に書いた定数ではありません。`planner.TP_PLAN` は、ブロックの各線形層をどう分けるかを表します。`layouts.block_plan` はこれを DTensor の `ColwiseParallel` と `RowwiseParallel` に変えて、次の節で実行するレイアウトに使います。`planner.collectives` も同じ表から数えます。行並列の層は順伝播で出力をオールリデュースし、列並列の層は逆伝播で入力の勾配をオールリデュースします。DTensor は層ごとに入力を変換するので、q、k、v は 3回のオールリデュースになります。1つにまとめた `qkv` の行列なら 1回で済むところです。データ並列の集合通信は、ランクが持つパラメータを FSDP がまとめるユニットごとに並べた `planner.rank_tensors`（各テンソルの最初の次元は、FSDP2 と同じくグループの大きさの倍数にパディングします）と、レイアウトのコードの動きから数えます。`zero=0` ではフラットなオールリデュース 1回、`zero=3` では FSDP2 のオールギャザーとリデュース・スキャッターです。`torch.distributed.pipelining` の中では、FSDP2 は逆伝播のあともステージのユニットを丸ごと持ち続け、最後の逆伝播のあとで 1回だけリデュース・スキャッターします。そのため、1つのブロックは 1ステップに `m + 1` 回オールギャザーされます（順伝播に続く順伝播ごとに 1回と、最初の逆伝播で 1回）。スケジュールの順序にはよりません。
#
# `collectives` は `planner.Collective` のリストを返します。それぞれ、何のための通信か、種類、1ステップの回数、バイト数（9章の `CollectiveLog` と同じく、各呼び出しのテンソル全体）、グループの大きさを持ちます。`step_time` は各項目に α-β モデルで時間をつけ（`Collective.seconds`）、`by_kind` は `CollectiveLog.summary()` と同じ形に合計します。こうすると、実行した結果と予測をキーごとに比べられます。small の ViT の fsdp 2 x tp 2 x pp 2 で、全体のバッチ 32 を 2つのマイクロバッチに分けた場合の、2つのパイプラインのランクです。

# %%
pipelined = planner.Layout(dp=2, zero=3, tp=2, pp=2, micro_batches=2)
print(tr("split by tensor parallelism:", "テンソル並列で分ける層:"),
      join(f"{layer} {style}" for layer, style in planner.tp_layers(small).items()))
for stage in range(pipelined.pp):
    print(tr(f"pipeline rank {stage}:", f"パイプラインのランク {stage}:"))
    print(table([[c.part, planner.KINDS[c.kind], c.calls, f"{c.bytes / 2**10:,.0f}", c.ranks]
                 for c in planner.collectives(small, pipelined, 32, "fp32", stage)],
                [("for", "用途"), ("collective", "集合通信"), ("calls", "回数"), "KiB", ("group", "グループ")],
                indent=2))

# %%
blocks = pipelined.stage_layers(small)
first = planner.collectives(small, pipelined, 32, "fp32", 0)
calls = {(c.part, c.kind): c.calls for c in first}
assert calls["tp", "all_reduce"] == (2 + 4) * blocks * pipelined.micro_batches  # out, fc2 forward; q, k, v, fc1 back
assert calls["dp", "all_gather"] == blocks * (pipelined.micro_batches + 1) + 1  # and the root (embedding) once
assert calls["dp", "reduce_scatter"] == blocks + 1 and calls["pp", "send"] == pipelined.micro_batches

# %% [markdown]
# <!-- en -->
# ## Checked on 8 processes
#
# A planner is only as good as its agreement with a real run. Here the course's ViT (chapters 9 to 11) trains on
# 8 gloo processes in five layouts, one after the other in the same launch, and every layout is checked four
# ways: its losses against one process (the same initial weights, the same global batches), every collective of
# every rank against the planner's count, its peak memory per rank, and its step time. The same launch then measures the
# planner's inputs on these very ranks, and the planner
# predicts each layout from them. The ranks form a mesh `(pp, dp, cp, tp)`, tensor parallelism innermost, as the
# planner assumes.
#
# | layout | what is split | pieces (chapter) |
# |---|---|---|
# | dp 8 | the batch; each rank keeps all weights and averages the gradients in one all-reduce | chapter 6 |
# | fsdp 8 | the batch, and every weight, gradient and optimizer state into eighths | `fully_shard`, chapter 9 |
# | fsdp 4 x tp 2 | each block's matrices in two (heads, MLP columns), then shards of that over 4 | `parallelize_module` + `fully_shard`, chapter 10 |
# | fsdp 2 x tp 2 x pp 2 | the blocks into 2 stages, each stage as in the row above over 2 x 2 ranks | + `PipelineStage`, 1F1B, chapter 10 |
# | dp 2 x cp 2 x pp 2 | 2 stages; inside a stage the 16 tokens of an image over 2 ranks (ring attention), and the batch over 2 | `ring_attention`, chapter 11 |
#
# `mparlib.layouts` holds the parts: `check_layout` and `check_split` (refuse what cannot run, with the planner's
# own checks against the model and the batch, and say what to change), `build`
# (splits a model that is the same on every rank; a rank's part is a `LayoutStage`, whose context-parallel ranks
# add up their tokens for the mean with `SumOverGroup`), `Trainer` (one step on this rank's share of the batch: the
# pipeline schedule if there is one, `average_gradients` for `zero=0`, the optimizer's step),
# `StepMemory` (chapter 9's way of counting memory, cheap enough for thousands of operators: every storage alive
# after each operator, with a second identical step to split the peak into its parts) and `measure_inputs`. One
# more identical step runs inside chapter 9's `CollectiveLog`, which records every collective the rank runs.
# <!-- ja -->
# ## 8個のプロセスでの確認
#
# プランナーの価値は、実際の実行とどれだけ合うかで決まります。ここでは、このコースの ViT（9〜11章）を gloo の 8個のプロセスで、5つのレイアウトで訓練します。レイアウトは同じ起動の中で順に実行し、それぞれを 4つの面から確かめます。1個のプロセスとの損失の比較（同じ初期の重み、同じ全体のバッチ）、すべてのランクのすべての集合通信とプランナーの数との比較、ランクあたりのピークメモリ、ステップ時間です。そのあと同じ起動の中で、まさにこれらのランクの上でプランナーの入力を測り、プランナーはそこから各レイアウトを予測します。ランクは `(pp, dp, cp, tp)` のメッシュに並べ、プランナーの前提どおりテンソル並列をいちばん内側に置きます。
#
# | レイアウト | 分けるもの | 部品（章） |
# |---|---|---|
# | dp 8 | バッチ。各ランクはすべての重みを持ち、勾配を 1回のオールリデュースで平均します | 6章 |
# | fsdp 8 | バッチと、すべての重み、勾配、オプティマイザの状態を 8分の 1ずつ | `fully_shard`、9章 |
# | fsdp 4 x tp 2 | 各ブロックの行列を 2つに分け（ヘッド、MLP の列）、それをさらに 4つにシャーディング | `parallelize_module` + `fully_shard`、10章 |
# | fsdp 2 x tp 2 x pp 2 | ブロックを 2つのステージに分け、各ステージを 2 x 2 のランクで上の行と同じように分けます | + `PipelineStage`、1F1B、10章 |
# | dp 2 x cp 2 x pp 2 | 2つのステージ。ステージの中では画像 1枚の 16トークンを 2つのランクで分け（リングアテンション）、バッチを 2つに分けます | `ring_attention`、11章 |
#
# 部品は `mparlib.layouts` にあります。`check_layout` と `check_split`（実行できないレイアウトを、モデルとバッチに対するプランナー自身の確認も使って拒み、何を変えればよいかを示します）、`build`（どのランクでも同じモデルを分けます。ランクが受け持つ部分は `LayoutStage` で、コンテキスト並列のランクは平均を取るためのトークンの和を `SumOverGroup` で足し合わせます）、`Trainer`（このランクが受け持つバッチでの 1ステップ。パイプラインがあればそのスケジュール、`zero=0` なら `average_gradients` による勾配のオールリデュース、そしてオプティマイザのステップ）、`StepMemory`（9章のメモリの数え方を、数千の演算子でも軽く済むようにしたもの。各演算子のあとに生きているストレージをすべて数え、同じステップをもう 1回実行してピークを内訳に分けます）、`measure_inputs` です。さらにもう 1回、同じステップを 9章の `CollectiveLog` の中で実行し、ランクが行う集合通信をすべて記録します。

# %%
# %%worker layout_checks
import time

import torch
import torch.distributed as dist

from mparlib import layouts
from mparlib.sharding import CollectiveLog
from mparlib.timing import measure


def check_layout_on_ranks(config, layout, batches, timed, lr=0.05):
    """One layout: SGD steps for the parity check, then Adam's peak memory, collectives and step time."""
    layout = layouts.check_layout(layout, dist.get_world_size())
    layouts.check_split(config, layout, len(batches[0][1]))  # the planner's checks, before anything is built
    mesh = layouts.make_mesh(layout)  # (pp, dp, cp, tp)
    torch.manual_seed(0)  # the one-process reference's weights, on every rank
    module, stage = layouts.build(layouts.vit_of(config), layout, mesh)
    trainer = layouts.Trainer(module, stage, layout, mesh)
    sgd = torch.optim.SGD(module.parameters(), lr=lr)
    losses = layouts.global_losses([trainer.step(x, y, sgd) for x, y in batches])
    adam = torch.optim.Adam(module.parameters(), lr=1e-3, foreach=False)
    x, y = batches[0]
    trainer.step(x, y, adam)  # Adam creates its state
    first = layouts.StepMemory(module, adam)
    with first:
        trainer.step(x, y, adam)
    second = layouts.StepMemory(module, adam, parts_at=first.peak_op)
    with second:  # the same step again, split at the moment of the peak
        trainer.step(x, y, adam)
    log = CollectiveLog()
    with log:  # and once more: every collective this rank runs
        trainer.step(x, y, adam)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"peak": first.peak, "parts": second.parts, "stage": mesh["pp"].get_local_rank(),
                                   "collectives": log.summary()})
    top = max(every, key=lambda r: r["peak"])
    step = measure(lambda: trainer.step(x, y, adam), warmup=0, min_seconds=0, min_repeats=timed,
                   max_repeats=timed, before=dist.barrier, across=layouts.slowest)
    return {"layout": layout, "name": layouts.name_of(layout), "losses": losses, "step": step.summary(),
            "memory": {"peak": top["peak"], "parts": top["parts"], "per_rank": [r["peak"] for r in every]},
            "collectives": [{"stage": r["stage"], **r["collectives"]} for r in every]}


def check_layouts(config, layout_list, batches, timed=3, inputs=None):
    """Every layout in turn on the same 8 ranks, then the planner's inputs measured on them."""
    out = []
    for layout in layout_list:
        start = time.perf_counter()
        out.append(check_layout_on_ranks(config, layout, batches, timed))
        dist.barrier()
        out[-1]["wall"] = time.perf_counter() - start
    return {"layouts": out, "inputs": layouts.measure_inputs(**(inputs or {}))}

# %% [markdown]
# <!-- en -->
# The same procedure, as one function, is `layouts.run_layout`, and its loop `layouts.layouts_worker`: the tests and
# `benchmarks/planner.py` run those.
#
# The model is the smoke ViT with patches of 7 x 7 pixels, so that an image has 16 tokens and two
# context-parallel ranks take 8 each (the `full` profile makes it wider: `dim` 128, MLP 512). The reference trains
# it in this process on the same three global batches of 32 random images with plain SGD; SGD, not Adam, for the
# parity check, because Adam divides each gradient by its own size and would hide a gradient that is wrong by a
# constant factor.
# <!-- ja -->
# 同じ手順を 1つの関数にしたものが `layouts.run_layout`、そのループが `layouts.layouts_worker` です。テストと `benchmarks/planner.py` はこちらを実行します。
#
# モデルは smoke の ViT で、パッチを 7 x 7 ピクセルにします。すると画像 1枚が 16トークンになり、コンテキスト並列の 2つのランクが 8トークンずつ受け持てます（`full` プロファイルでは幅を広げ、`dim` を 128、MLP を 512 にします）。基準は、このプロセスで同じモデルを、ランダムな画像 32枚からなる全体のバッチ 3つで、ふつうの SGD で訓練したものです。損失の比較に Adam ではなく SGD を使うのは、Adam が各勾配をその大きさで割るので、定数倍だけずれた勾配を見逃してしまうからです。

# %%
LAYOUT_VIT = {"patch": 7} if PROFILE == "smoke" else {"patch": 7, "dim": 128, "hidden": 512}
LAYOUT_LIST = [{"dp": 8}, {"dp": 8, "zero": 3}, {"dp": 4, "zero": 3, "tp": 2},
               {"dp": 2, "zero": 3, "tp": 2, "pp": 2, "micro_batches": 2},
               {"dp": 2, "cp": 2, "pp": 2, "micro_batches": 2}]
GLOBAL_BATCH, LAYOUT_LR = 32, 0.05
generator = torch.Generator().manual_seed(1)
layout_batches = [(torch.randn(GLOBAL_BATCH, 1, 28, 28, generator=generator),  # (B, 1, 28, 28)
                   torch.randint(0, 10, (GLOBAL_BATCH,), generator=generator)) for _ in range(3)]


def reference_losses(batches, lr=LAYOUT_LR):
    """One process, the whole batch, SGD: the losses every layout must reproduce."""
    torch.manual_seed(0)
    model = layouts.vit_of(LAYOUT_VIT)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model


layout_reference, reference_model = reference_losses(layout_batches)
print(tr("parameters of the model:", "モデルのパラメータ数:"), sum(p.numel() for p in reference_model.parameters()))

# %% tags=["nbval-ignore-output"]
from layout_checks import check_layouts

start = time.perf_counter()
layout_report = launch(check_layouts, 8, args=(LAYOUT_VIT, LAYOUT_LIST, layout_batches),
                       kwargs={"timed": 3 if PROFILE == "smoke" else 10}, timeout=300)
layout_wall = time.perf_counter() - start
print(tr(f"one launch of 8 processes: {layout_wall:.0f} s in all; per layout (after the start):",
         f"8個のプロセスの起動 1回: 全体で {layout_wall:.0f}秒。レイアウトごと（起動のあと）:"),
      join(f"{r['name']} {r['wall']:.1f} s" for r in layout_report["layouts"]))
print(table([[r["name"], str([f"{v:.6f}" for v in r["losses"]]),
              f"{max(abs(a - b) for a, b in zip(r['losses'], layout_reference)):.1e}"] for r in layout_report["layouts"]]
            + [[("one process", "1個のプロセス"), str([f"{v:.6f}" for v in layout_reference]), "-"]],
            [("layout", "レイアウト"), ("losses", "損失"), ("largest difference", "最大の差")]))

# %%
for r in layout_report["layouts"]:
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(layout_reference), rtol=1e-5, atol=1e-5)
assert [r["name"] for r in layout_report["layouts"]] == [layouts.name_of(layout) for layout in LAYOUT_LIST]
print(tr("all 5 layouts on 8 processes = one process: the losses of 3 steps (float32, tolerance 1e-5)",
         "8個のプロセスでの 5つのレイアウトはすべて 1個のプロセスと一致: 3ステップの損失（float32、許容誤差 1e-5）"))

# %% [markdown]
# <!-- en -->
# ### Every collective, counted
#
# `CollectiveLog` saw every collective of one step on each of the 8 ranks. `layouts.collective_mismatches` sets
# each rank's count beside `layouts.predicted_collectives` (`planner.collectives` of the same layout for that
# rank's pipeline stage, totalled by `by_kind`), kind by kind: the calls must be equal and the bytes within 1%. The
# table shows the calls the ranks of each stage counted (all ranks of a stage
# counted the same). These numbers do not depend on the machine: the same code runs the same collectives anywhere.
# <!-- ja -->
# ### すべての集合通信を数える
#
# `CollectiveLog` は、8個のランクのそれぞれで、1ステップのすべての集合通信を見ました。`layouts.collective_mismatches` は、各ランクの数を `layouts.predicted_collectives`（同じレイアウトのそのランクのパイプラインのステージについての `planner.collectives` を、`by_kind` で合計したもの）と種類ごとに並べます。回数は等しく、バイト数の差は 1% 以内でなければなりません。表は各ステージのランクが数えた回数です（同じステージのランクはすべて同じ数でした）。これらの数はマシンによりません。同じコードは、どこでも同じ集合通信を行います。

# %%
counted_kinds = [k for k in planner.KINDS if any(k in c for r in layout_report["layouts"] for c in r["collectives"])]
count_rows = []
for r in layout_report["layouts"]:
    for stage in range(r["layout"]["pp"]):
        mine = [c for c in r["collectives"] if c["stage"] == stage]
        assert all(c == mine[0] for c in mine)  # every rank of a stage ran the same collectives
        count_rows.append([r["name"], stage] + [mine[0].get(k, {"calls": 0})["calls"] for k in counted_kinds])
print(table(count_rows, [("layout", "レイアウト"), ("stage", "ステージ")] + [planner.KINDS[k] for k in counted_kinds]))
mismatches = [m for r in layout_report["layouts"] for m in layouts.collective_mismatches(LAYOUT_VIT, r, GLOBAL_BATCH)]
print(tr(f"kinds on a rank where the count differs from the planner's (calls, or bytes by more than 1%): "
         f"{len(mismatches)} of {sum(len(c) - 1 for r in layout_report['layouts'] for c in r['collectives'])}",
         f"プランナーの数と違う（回数、または 1% を超えるバイト数）ランクごとの種類: "
         f"{sum(len(c) - 1 for r in layout_report['layouts'] for c in r['collectives'])}個のうち {len(mismatches)}個"))

# %%
assert mismatches == [], mismatches

# %% [markdown]
# <!-- en -->
# ### The planner's inputs, measured on the same ranks
#
# The planner needs a link (alpha, beta) and the FLOP/s of one device. Both were measured at the end of the same
# launch, the way the layouts use the machine: all-reduces on groups of 2, 4 and 8 neighbouring ranks, **every
# group busy at the same time** (in fsdp 4 x tp 2 the four tp pairs all-reduce at once), and a matrix product of the
# model's size (`(512, 128) x (128, 512)`) **on all 8 ranks at once**, so that each rank gets its share of the 2
# cores. One machine has no link between nodes: the planner's two links get the same numbers. The fit is chapter
# 8's `fit_alpha_beta`, once per group size on the message bytes, and once over all groups on the bytes each rank
# sends in a ring (`2 (g - 1) / g` of the message), the form `planner.Cluster` takes. The layouts make other calls
# too, so the same launch times all-gathers, reduce-scatters and sends to a neighbour (with a receive from the
# other one) in the same groups, each fitted on its own (on the bytes each rank sends: `(g - 1) / g` of the whole
# tensor of an all-gather or a reduce-scatter, all of a send); `measured_cluster` hands these to the planner as
# `Cluster.kind_costs`, and `Collective.seconds` prices each kind of call with its own alpha and beta.
# <!-- ja -->
# ### 同じランクで測ったプランナーの入力
#
# プランナーには、リンク（alpha、beta）と 1つのデバイスの FLOP/s が必要です。どちらも同じ起動の最後に、レイアウトがマシンを使うのと同じやり方で測りました。隣り合う 2個、4個、8個のランクのグループでのオールリデュースを、**すべてのグループで同時に**行います（fsdp 4 x tp 2 では、tp の 4つの組が同時にオールリデュースします）。また、モデルと同じ大きさの行列積（`(512, 128) x (128, 512)`）を **8個のランクすべてで同時に**計算します。こうすると、各ランクは 2つのコアのうち自分の取り分だけを使います。1台のマシンにはノード間のリンクがないので、プランナーの 2つのリンクには同じ値を与えます。当てはめには 8章の `fit_alpha_beta` を使います。グループの大きさごとにメッセージのバイト数で 1回、さらにすべてのグループをまとめて、リングで各ランクが送るバイト数（メッセージの `2 (g - 1) / g`）で 1回です。後者が `planner.Cluster` の受け取る形です。レイアウトは他の呼び出しも行うので、同じ起動の中で、同じグループでのオールギャザー、リデュース・スキャッター、隣のランクへの送信（もう一方の隣からの受信と組にします）も測り、それぞれを別々に当てはめます（各ランクが送るバイト数で当てはめます。オールギャザーとリデュース・スキャッターではテンソル全体の `(g - 1) / g`、送信ではすべてです）。`measured_cluster` はこれらを `Cluster.kind_costs` としてプランナーに渡し、`Collective.seconds` は呼び出しの種類ごとに、その種類の alpha と beta で時間をつけます。

# %% tags=["nbval-ignore-output"]
inputs = layout_report["inputs"]
for g, fit in inputs["fits"].items():
    times = [f"{r['bytes'] // 1024} KiB {r['median'] * 1e3:.1f} ms" for r in inputs["calls"]
             if r["kind"] == "all_reduce" and r["group"] == g]
    bandwidth = (f"{fit['bandwidth'] / 1e9:.2f} GB/s" if fit["beta"] > 0  # beta 0: the sizes resolve no bandwidth
                 else tr("not resolved (beta = 0)", "求まらず（beta = 0）"))
    print(tr(f"all-reduce in groups of {g} ({inputs['world'] // g} at once): ",
             f"{g}個のグループでのオールリデュース（{inputs['world'] // g}つを同時に）: ") + join(times)
          + tr(f"; alpha {fit['alpha'] * 1e3:.2f} ms, bandwidth {bandwidth}",
               f"。alpha {fit['alpha'] * 1e3:.2f} ms、帯域幅 {bandwidth}"))
link = inputs["link"]
print(tr(f"link for the planner (bytes sent): alpha {link['alpha'] * 1e3:.2f} ms, {link['bandwidth'] / 1e9:.2f} GB/s, "
         f"worst fit error {max(abs(e) for e in link['relative_errors']):.0%}",
         f"プランナーのリンク（送るバイト数）: alpha {link['alpha'] * 1e3:.2f} ms、{link['bandwidth'] / 1e9:.2f} GB/s、"
         f"当てはめの最大誤差 {max(abs(e) for e in link['relative_errors']):.0%}"))
print(table([[planner.KINDS[kind], f"{fit['alpha'] * 1e3:.2f}", f"{fit['bandwidth'] / 1e9:.2f}" if fit["beta"] > 0 else "-",
              f"{max(abs(e) for e in fit['relative_errors']):.0%}"] for kind, fit in inputs["kinds"].items()],
            [("each kind on its own", "種類ごと"), "alpha ms", "GB/s", ("worst fit error", "当てはめの最大誤差")]))
print(tr(f"one rank's FLOP/s while all 8 compute: {inputs['flops_per_s'] / 1e9:.1f} GFLOP/s",
         f"8個すべてが計算しているときの 1ランクの FLOP/s: {inputs['flops_per_s'] / 1e9:.1f} GFLOP/s"))

# %% [markdown]
# <!-- en -->
# ### Predicted against measured
#
# `layouts.compare` makes a `planner.Cluster` of these inputs (`measured_cluster`), asks `predict` for each layout
# (`planner.memory_per_rank` and `planner.step_time`), ranks both with `spearman`, and sets
# the prediction beside the measurement: the largest peak of any rank, and the median step (the slowest rank's
# time, between barriers). The planner's formulas are used as they are: a goal that is missed is reported, never
# fixed by tuning the formulas to this machine.
# <!-- ja -->
# ### 予測と測定の比較
#
# `layouts.compare` は、これらの入力から `planner.Cluster` を作り（`measured_cluster`）、各レイアウトについて `predict` に予測させ（`planner.memory_per_rank` と `planner.step_time`）、両方の順位を `spearman` で比べて、予測を測定値の横に並べます。測定値は、どのランクよりも大きいピークと、ステップ時間の中央値（バリアの間で測った、いちばん遅いランクの時間）です。プランナーの式はそのまま使います。達成できなかった目標はそのまま報告し、式をこのマシンに合わせて調整することはしません。

# %% tags=["nbval-ignore-output"]
compared = layouts.compare(LAYOUT_VIT, layout_report, GLOBAL_BATCH)
MiB = 2 ** 20
print(table([[r["layout"], f"{r['predicted_bytes_per_rank'] / MiB:.2f}", f"{r['measured_bytes_per_rank'] / MiB:.2f}",
              f"{r['memory_error']:+.0%}", f"{r['predicted_ms']:.1f}", f"{r['measured_ms']:.1f}"]
             for r in compared["rows"]],
            [("layout", "レイアウト"), ("memory MiB: predicted", "メモリ MiB: 予測"), ("measured", "測定値"),
             ("error", "誤差"), ("step ms: predicted", "ステップ ms: 予測"), ("measured", "測定値")]))
print()
print(tr("MiB at the peak, measured and predicted:", "ピークでの MiB（測定値と予測）:"))
print(table([[r["layout"]] + [f"{r['measured_parts'][k] / MiB:.2f}" for k in PART]
             + [f"{r['predicted_parts'][k] / MiB:.2f}" for k in ("activations", "gathered", "flat_copy")]
             for r in compared["rows"]],
            [("layout", "レイアウト")] + [PART[k] for k in PART]
            + [("predicted activations", "予測した活性化"), ("gathered blocks", "まとめて持つブロック"),
               ("flat copy", "フラットなコピー")]))

fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
names = [r["layout"] for r in compared["rows"]]
at = torch.arange(len(names)).tolist()
for ax, key, scale, label in ((axes[0], "bytes_per_rank", MiB, tr("peak memory per rank (MiB)", "ランクあたりのピークメモリ（MiB）")),
                              (axes[1], "ms", 1, tr("step time (ms)", "ステップ時間（ms）"))):
    ax.bar([i - 0.2 for i in at], [r[f"predicted_{key}"] / scale for r in compared["rows"]], 0.4,
           label=tr("planner", "プランナー"))
    ax.bar([i + 0.2 for i in at], [r[f"measured_{key}"] / scale for r in compared["rows"]], 0.4,
           label=tr("measured, 8 processes", "測定、プロセス 8個"))
    ax.set_xticks(at, names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel(label)
axes[0].legend()
fig.tight_layout()
plt.show()

# %% tags=["nbval-ignore-output"]
goals = compared["goals"]
memory_goal, order_goal = goals["memory_within"], goals["time_order"]
print(tr(f"goal 1, memory per rank within {memory_goal['target']:.0%} on every layout: "
         f"{'met' if memory_goal['met'] else 'not met'} (largest error {memory_goal['worst']:.0%})",
         f"目標 1、すべてのレイアウトでランクあたりのメモリの誤差が {memory_goal['target']:.0%} 以内: "
         f"{'達成' if memory_goal['met'] else '未達成'}（最大の誤差 {memory_goal['worst']:.0%}）"))
print(tr(f"goal 2, the layouts in the measured order of step time, Spearman at least {order_goal['target']}: "
         f"{order_goal['spearman']:.2f} ({'met' if order_goal['met'] else 'not met'})",
         f"目標 2、ステップ時間の順位が測定と同じ、スピアマンの順位相関 {order_goal['target']} 以上: "
         f"{order_goal['spearman']:.2f}（{'達成' if order_goal['met'] else '未達成'}）"))
print(tr("measured order:", "測定の順:"), " < ".join(r["layout"] for r in sorted(compared["rows"], key=lambda r: r["measured_ms"])))
print(tr("planner's order:", "プランナーの順:"), " < ".join(r["layout"] for r in sorted(compared["rows"], key=lambda r: r["predicted_ms"])))

# %% [markdown]
# <!-- en -->
# Memory counts do not depend on the machine: the same operators create the same tensors everywhere. Two parts
# are exact enough to check on any machine. Without sharding (dp 8) a rank holds every parameter (4 bytes each in
# float32) and Adam's two moments (8 bytes) plus one 4-byte step counter per parameter tensor, which the planner
# leaves out; dp 2 x cp 2 x pp 2 holds exactly its first stage's share, as the planner counts it.
# <!-- ja -->
# メモリの値はマシンによって変わりません。同じ演算子は、どこでも同じテンソルを作るからです。そのうち 2つの部分は、どのマシンでも確かめられるほど正確です。シャーディングしないとき（dp 8）、ランクはすべてのパラメータ（float32 で 1つ 4バイト）と Adam の 2つのモーメント（8バイト）を持ち、さらにパラメータのテンソルごとに 4バイトのステップ数を持ちます。プランナーはこのステップ数を数えません。dp 2 x cp 2 x pp 2 は、プランナーが数えるとおり、ちょうど最初のステージの分を持ちます。

# %%
rows = {r["layout"]: r for r in compared["rows"]}
names = [n for n, _ in reference_model.named_parameters()]
first_stage = [n for n in names if n.split(".")[0] in ("embed", "pos")
               or n.startswith(tuple(f"blocks.{i}." for i in range(len(reference_model.blocks) // 2)))]
for name, tensors in (("dp 8", len(names)), ("dp 2 x cp 2 x pp 2", len(first_stage))):
    measured, predicted = rows[name]["measured_parts"], rows[name]["predicted_parts"]
    assert measured["params"] == predicted["params"], (name, measured, predicted)
    assert measured["optimizer"] == predicted["optimizer"] + 4 * tensors, (name, measured, predicted)
print(tr("parameters and optimizer state per rank: measured = planner (+ Adam's step counters) for dp 8 and "
         "dp 2 x cp 2 x pp 2",
         "ランクあたりのパラメータとオプティマイザの状態: dp 8 と dp 2 x cp 2 x pp 2 で測定値 = プランナー"
         "（+ Adam のステップ数）"))

# %% [markdown]
# <!-- en -->
# ### What the numbers show
#
# The tables above are this notebook's own run (the `smoke` ViT). `benchmarks/planner.py` runs the same check on a
# wider ViT (`dim` 128, MLP 512, 16 tokens, global batch 32) three times and compares the medians; its run on the
# 2 cores this course was written on, `benchmarks/results/planner-vm-20261208-010808.json`, is the one quoted here.
# The machine was busy, as every run of 8 processes on 2 cores is: the load average per core reached 2.2, 2.8 and
# 3.4 at the ends of the three runs, and one rank's matrix product ran at 19.4, 14.2 and 12.6 GFLOP/s. Every
# layout matched one process to 1e-5 in float32 in every run.
#
# - **Collectives: exact.** In all three runs every rank of every layout ran the collectives `planner.collectives`
#   counts, call for call, with the bytes within 1%: no mismatch.
# - **Memory: goal (10%) met on three layouts of five.** dp 8: predicted 15.32 MiB, measured 15.41 (-1%); the
#   peak falls after the backward pass, when the activations are freed and `average_gradients` holds its flat
#   copy of the gradients, which the planner counts (the rest is Adam's step counters and small tensors).
#   dp 2 x cp 2 x pp 2: 8.19 against 7.96 (+3%); fsdp 2 x tp 2 x pp 2: 5.28 against 5.78 (-9%), counting the
#   stage's weights and gradients whole, as FSDP2 keeps them inside the pipeline. Without a pipeline FSDP is
#   under-predicted: fsdp 4 x tp 2 by 12% (5.21 against 5.91) and fsdp 8 by 26% (5.81 against 7.85, the median
#   of 7.94, 7.31 and 7.85 MiB). `StepMemory` also records the storages live at each rank's peak
#   (`sizes_at_peak`); in a later run of the benchmark (`planner-vm-20261208-014542.json`) every rank of fsdp 8
#   held two or three flat buffers the size of a whole block (0.76 MiB), and 1.5 to 3.4 MiB in storages the size
#   of the blocks' weight gradients (0.25 MiB for fc1 and fc2, 64 KiB for q, k, v and out): two to four and a half
#   blocks' worth, where the planner counts one. The mix differs from rank to rank and run to run (the ranks'
#   peaks spanned 6.4 to 7.9 MiB): on gloo a buffer is freed when the asynchronous collective that uses it lets go
#   of it, so the largest of 8 peaks lies above a count of what the code keeps by design. What holds the extra
#   gradients is not yet found.
# - **Step time: the order met its goal in this run (Spearman 0.9, goal 0.8), the seconds did not.** Measured:
#   dp 8 102 ms < dp 2 x cp 2 x pp 2 159 < fsdp 8 342 < fsdp 2 x tp 2 x pp 2 392 < fsdp 4 x tp 2 457. Predicted:
#   dp 8 40 < dp 2 x cp 2 x pp 2 170 < fsdp 8 173 < fsdp 4 x tp 2 204 < fsdp 2 x tp 2 x pp 2 225. The order holds
#   because each kind of call is priced by its own fit: a send cost 2.0 ms a call here against an all-reduce's
#   3.5 ms, and an all-gather or reduce-scatter moved a byte at 0.08 to 0.09 GB/s against an all-reduce's 0.40
#   on gloo. Priced instead with the all-reduce's alpha and beta for every call, an earlier run
#   (`planner-vm-20261208-004344.json`) ranked dp 2 x cp 2 x pp 2 last and reached 0.3. Three later runs of the
#   same code (`...013738.json`, `...014047.json`, `...014542.json`) reached 0.8 each, the goal and no more. The
#   order is fragile: dp 2 x cp 2 x pp 2 and fsdp 8 are predicted 2% apart, and every fit on this machine missed
#   some of its own points by 51 to 79%. The seconds are off by more: the measured steps are 0.9 (dp 2 x cp 2 x pp 2) to 2.6
#   (dp 8) times the prediction, time on 2 shared cores that no count of calls and bytes contains.
#
# A planner that counts from the code it plans for gets the calls and the bytes right by construction, and the
# memory right where the code decides what is held. Time has to be measured kind by kind: how long a send, an
# all-reduce or an all-gather takes on the machine at hand. On a GPU cluster the same check is the first thing to
# run: feed the planner inputs measured with every group busy at once, and compare before trusting its ranking.
# <!-- ja -->
# ### 数値からわかること
#
# 上の表は、このノートブック自身の実行（`smoke` の ViT）です。`benchmarks/planner.py` は同じ確認を、より幅の広い ViT（`dim` 128、MLP 512、16トークン、全体のバッチサイズ 32）で 3回行い、中央値を比べます。ここで引用するのは、このコースを書いた 2コアのマシンでのその実行、`benchmarks/results/planner-vm-20261208-010808.json` です。2コアで 8個のプロセスを動かす実行はどれもそうですが、マシンは busy でした。コアあたりのロードアベレージは 3回の実行の終わりに 2.2、2.8、3.4 に達し、1ランクの行列積の速さは 19.4、14.2、12.6 GFLOP/s でした。どの実行でも、どのレイアウトも float32 で 1e-5 以内で 1個のプロセスと一致しました。
#
# - **集合通信: 正確。** 3回の実行のすべてで、どのレイアウトのどのランクも `planner.collectives` が数えたとおりの集合通信を行いました。回数は一つ残らず等しく、バイト数は 1% 以内で、食い違いはありません。
# - **メモリ: 目標（10%）を達成したのは 5つのレイアウトのうち 3つ。** dp 8 は予測 15.32 MiB に対して測定 15.41 MiB（-1%）でした。ピークは逆伝播のあと、活性化が解放され、`average_gradients` が勾配のフラットなコピーを持つときに来ます。プランナーはこのコピーを数えます（残りは Adam のステップ数と小さなテンソルです）。dp 2 x cp 2 x pp 2 は 8.19 MiB に対して 7.96 MiB（+3%）、fsdp 2 x tp 2 x pp 2 は 5.28 MiB に対して 5.78 MiB（-9%）です。後者では、FSDP2 がパイプラインの中で持つとおり、ステージの重みと勾配を丸ごと数えています。パイプラインのない FSDP は少なく予測します。fsdp 4 x tp 2 で 12%（5.21 MiB に対して 5.91 MiB）、fsdp 8 で 26%（5.81 MiB に対して 7.85 MiB。7.94、7.31、7.85 MiB の中央値）です。`StepMemory` は、各ランクのピークで生きているストレージも記録します（`sizes_at_peak`）。ベンチマークのその後の実行（`planner-vm-20261208-014542.json`）では、fsdp 8 のどのランクも、ブロック 1つ分の大きさのフラットなバッファ（0.76 MiB）を 2つか 3つ持ち、さらにブロックの重みの勾配と同じ大きさのストレージ（fc1 と fc2 は 0.25 MiB、q、k、v、out は 64 KiB）に 1.5〜3.4 MiB を持っていました。プランナーが 1つと数えるところに、ブロック 2〜4.5個分です。その内訳はランクごとにも実行ごとにも違います（ランクのピークは 6.4〜7.9 MiB に広がりました）。gloo では、バッファはそれを使う非同期の集合通信が手放した時点で解放されます。そのため、8個のピークのうちいちばん大きなものは、コードが設計上持つものを数えた値を上回ります。余分な勾配を何が持っているのかは、まだ突き止めていません。
# - **ステップ時間: この実行では順位は目標を達成しました（スピアマンの順位相関 0.9、目標は 0.8）。秒数は合いません。** 測定: dp 8 102 ms < dp 2 x cp 2 x pp 2 159 < fsdp 8 342 < fsdp 2 x tp 2 x pp 2 392 < fsdp 4 x tp 2 457。予測: dp 8 40 < dp 2 x cp 2 x pp 2 170 < fsdp 8 173 < fsdp 4 x tp 2 204 < fsdp 2 x tp 2 x pp 2 225。順位が合うのは、呼び出しの種類ごとに、それぞれの当てはめで時間をつけるからです。ここでは送信は 1回 2.0 ms で、オールリデュースの 3.5 ms より安く、オールギャザーとリデュース・スキャッターは 1バイトを 0.08〜0.09 GB/s で運び、gloo ではオールリデュースの 0.40 GB/s よりずっと遅くなりました。どの呼び出しにもオールリデュースの alpha と beta を使った以前の実行（`planner-vm-20261208-004344.json`）では、dp 2 x cp 2 x pp 2 を最後に置き、順位相関は 0.3 でした。同じコードによるその後の 3回の実行（`...013738.json`、`...014047.json`、`...014542.json`）は、どれも 0.8 で、目標ちょうどでした。この順位は壊れやすいものです。dp 2 x cp 2 x pp 2 と fsdp 8 の予測は 2% しか違わず、このマシンでの当てはめはどれも、自分の点のいくつかを 51〜79% 外しています。秒数の食い違いはもっと大きく、測ったステップは予測の 0.9倍（dp 2 x cp 2 x pp 2）から 2.6倍（dp 8）です。共有された 2つのコアの上での時間で、呼び出しとバイト数をいくら数えても含まれないものです。
#
# プランを立てる対象のコードから数えるプランナーは、集合通信の回数とバイト数を作りからして正しく出し、メモリもコードが何を持つかを決めているところでは正しく出します。時間は、種類ごとに測る必要があります。手元のマシンで、送信、オールリデュース、オールギャザーがそれぞれどれだけかかるかです。GPU のクラスタでも、最初に行うべきなのはこれと同じ確認です。すべてのグループが同時に動いている状態で測った入力をプランナーに与え、その順位を信じる前に比べてください。

# %% [markdown]
# <!-- en -->
# ## On paper, at scale
#
# `planner.layouts` lists every valid layout of a number of GPUs over small grids of degrees (`dp` is what the
# others leave); `planner.plan` predicts each one and returns `planner.Plan` rows, those that fit in the device's
# memory first, each group ordered by predicted step time. The grid here: `tp` 1 to 8, `pp` 1 to 16, ZeRO-1 or
# ZeRO-3, 1F1B or interleaved 1F1B with two stages per rank, full recomputation or none, one sequence per
# micro-batch; 16-bit compute with fp32 Adam state (16 bytes per parameter, chapter 9), Megatron's sequence
# parallelism (`regather=True`), and Llama 3's batch of 16M tokens for every model. The table shows the three
# fastest layouts that fit, their memory per rank, step time, the bubble's share of the step, and the model FLOP/s
# per GPU they imply (the model's FLOPs, recomputation not counted, per second and GPU).
# <!-- ja -->
# ## 大規模な構成の机上検討
#
# `planner.layouts` は、与えた GPU の数について、次数の小さなグリッドの上で有効なレイアウトをすべて挙げます（`dp` は他の次数の残りです）。`planner.plan` はそれぞれを予測し、`planner.Plan` の行を返します。デバイスのメモリに収まるものが先で、それぞれの中では予測したステップの時間の順です。ここでのグリッドは、`tp` が 1〜8、`pp` が 1〜16、ZeRO-1 か ZeRO-3、1F1B かランクあたり 2ステージのインターリーブ 1F1B、活性化の再計算は全部するかしないか、マイクロバッチは系列 1本です。計算は 16ビット、Adam の状態は fp32（パラメータあたり 16バイト、9章）、シーケンス並列は Megatron の方式（`regather=True`）、バッチはどのモデルも Llama 3 の 16M トークンです。表には、収まるレイアウトのうち速い 3つについて、ランクあたりのメモリ、ステップの時間、ステップに占めるバブルの割合、そこから導かれる GPU あたりのモデルの FLOP/s（再計算を除いたモデルの FLOP 数を、秒と GPU で割った値）を示します。

# %%
GRID = dict(tp=(1, 2, 4, 8), pp=(1, 2, 4, 8, 16), zero=(1, 3), schedules=("1f1b", "interleaved1f1b"),
            recompute=(False, True))
BATCH = 2048  # Llama 3's 16M tokens per step: 2,048 sequences of 8,192


def ranked(model, world, batch=BATCH, cluster=h100, **grid):
    """The planner's ranking of every layout of ``world`` GPUs for ``model`` (16-bit compute, fp32 Adam state)."""
    return planner.plan(model, cluster, world, batch, precision="mixed", regather=True, **{**GRID, **grid})


def tflops(model, row, world, batch=BATCH):
    """Model FLOP/s per GPU of a plan row, in TFLOP/s (recomputation not counted as useful work)."""
    return model.flops_per_sample() * batch / (row.time.total * world) / 1e12


def show(model, world, rows, top=3):
    """The fastest ``top`` layouts that fit, one line each."""
    fits = [r for r in rows if r.fits]
    print(tr(f"{model.name} on {world:,} x H100: {len(fits)} of {len(rows)} layouts fit in 80 GB",
             f"{world:,}枚の H100 での {model.name}: {len(rows)}個のレイアウトのうち {len(fits)}個が 80 GB に収まる"))
    print(table([[r.layout.label(), f"{r.memory.total / 1e9:.1f}", f"{r.time.total:.2f}",
                  f"{r.time.bubble / r.time.total:.0%}", f"{tflops(model, r, world):.0f}"] for r in fits[:top]],
                [("layout", "レイアウト"), "GB", ("step s", "ステップ s"), ("bubble", "バブル"), "TFLOP/s"], indent=3))


dense = {}
for name in ("llama3-8b", "llama3-70b"):
    model = planner.ModelShape.published(name)
    for world in (64, 512, 8192):
        dense[name, world] = ranked(model, world)
        show(model, world, dense[name, world])

# %%
firsts = {key: next(r for r in rows if r.fits) for key, rows in dense.items()}
assert all(r.fits == (r.memory.total <= 80e9) for rows in dense.values() for r in rows)
assert all(first.layout.tp <= h100.devices_per_node for first in firsts.values())  # tp stays inside a server
plain = next(r for r in dense["llama3-8b", 64] if r.layout == planner.Layout(dp=64, zero=1, micro_batches=32))
assert not plain.fits and firsts["llama3-8b", 64].layout.pp == 2  # plain ZeRO-1 misses 80 GB; pp 2 fits
staged = next(r for r in dense["llama3-8b", 64] if r.layout == planner.Layout(dp=32, zero=1, pp=2, micro_batches=64))
assert abs(staged.memory.parameters / plain.memory.parameters - 0.5) < 1e-3  # two stages halve the weights ...
assert 0.85 < staged.memory.activations / plain.memory.activations < 0.9  # ... not the activations: 44 of 50 GB
assert [firsts["llama3-70b", w].layout.tp for w in (64, 512, 8192)] == [4, 4, 8]
assert firsts["llama3-70b", 8192].layout.pp == 1 and firsts["llama3-70b", 64].layout.pp > 1

# %% [markdown]
# <!-- en -->
# What the planner's choices say:
#
# - **Memory first.** Llama 3 8B on 64 GPUs with plain ZeRO-1 data parallelism needs 84 GB per rank: 32 GB of
#   16-bit weights and gradients, 1.5 GB of optimizer shard and 50 GB of activations (one sequence through 32
#   blocks, and the output scores of a 128,256-word vocabulary). Two pipeline stages halve the weights and
#   gradients per rank, but not the activations: under 1F1B the first stage holds 2 micro-batches of 16 blocks,
#   as many as one sequence through all 32, and sheds only the output scores, which sit on the last stage (44 GB
#   against 50; interleaved with two stages per rank it holds more, 55 GB). That fits, at a bubble of 1.5% (0.8%
#   interleaved) with 64 micro-batches, less than recomputing (a third more compute) or ZeRO-3 (the weights
#   gathered for each micro-batch) would cost.
# - **The least tensor parallelism that fits.** Tensor parallelism's traffic per rank grows with `t`
#   (`2 (t-1)/t` of each activation, and each rank runs `t` times more blocks' worth of tokens than with a pipeline
#   of the same size), so 70B on 64 and 512 GPUs uses `tp 4` with a pipeline rather than `tp 8`.
# - **The batch limits data parallelism.** On 8,192 GPUs a batch of 2,048 sequences leaves one sequence per replica
#   with `tp 4` alone and two with `tp 4` and two stages: too few micro-batches for a pipeline to fill (with `m = 2`
#   the bubble `(p-1)/(v m + p - 1)` is a fifth of the step even interleaved), so the planner moves to `tp 8`
#   without a pipeline, and the model FLOP/s per GPU fall (about 270 to 280 against 350 to 390 on fewer GPUs): the
#   same batch on more GPUs leaves each with less work to hide its communication behind.
# - **Tensor parallelism stays inside a server**: `tp 8` over NVLink, never across the 50 GB/s links.
#
# A mixture of experts changes the balance. Mixtral 8x7B (32 layers, width 4096, 32 heads with 8 key/value heads,
# 8 experts of width 14336 of which each token uses 2, vocabulary 32,000; *Mixtral of Experts*, 2024) has 46.7B
# parameters, most of them in the experts, but each token only computes with 2 of the 8. Expert parallelism
# (`ep`) splits the experts among ranks that still take different samples:
# <!-- ja -->
# プランナーの選択からわかること:
#
# - **まずメモリ。** Llama 3 8B を 64枚の GPU で ZeRO-1 のデータ並列だけで訓練すると、ランクあたり 84 GB 必要です。16ビットの重みと勾配で 32 GB、オプティマイザの状態のシャードで 1.5 GB、活性化で 50 GB です（1本の系列が 32個のブロックを通る分と、128,256語の語彙の出力スコア）。パイプラインを 2ステージにすると、ランクあたりの重みと勾配は半分になりますが、活性化は半分になりません。1F1B では最初のステージが 16個のブロックのマイクロバッチを 2つ持ち、これは 1本の系列が 32個のブロックすべてを通る分と同じです。減るのは、最後のステージに置かれる出力スコアだけです（50 GB に対して 44 GB。ランクあたり 2ステージのインターリーブではもっと多く、55 GB です）。これで収まり、マイクロバッチが 64個あればバブルは 1.5%（インターリーブでは 0.8%）です。再計算（計算が 3分の 1 増えます）や ZeRO-3（マイクロバッチごとに重みを集めます）より安く済みます。
# - **収まる範囲でいちばん小さいテンソル並列。** テンソル並列のランクあたりの通信量は `t` とともに増えます（活性化ごとにその `2 (t-1)/t`。さらに、同じ大きさのパイプラインと比べて、各ランクは `t` 倍のブロック分のトークンを処理します）。そのため 70B を 64枚と 512枚の GPU で訓練するときは、`tp 8` ではなく `tp 4` とパイプラインを組み合わせます。
# - **データ並列はバッチで制限されます。** 8,192枚の GPU では、系列 2,048本のバッチは、`tp 4` だけならレプリカあたり 1本、`tp 4` と 2ステージでも 2本にしかなりません。パイプラインを埋めるにはマイクロバッチが足りません（`m = 2` では、インターリーブしてもバブル `(p-1)/(v m + p - 1)` がステップの 5分の 1 になります）。そこでプランナーはパイプラインなしの `tp 8` を選び、GPU あたりのモデルの FLOP/s は下がります（GPU が少ない場合の 350〜390 に対して約 270〜280）。同じバッチを多くの GPU で分けると、GPU ごとの仕事が減り、通信を隠す余地が小さくなるからです。
# - **テンソル並列はサーバーの中に置きます。** `tp 8` は NVLink の上で使い、50 GB/s のリンクをまたぐことはありません。
#
# MoE はこのバランスを変えます。Mixtral 8x7B（32層、幅 4096、32個のヘッドと 8個のキー・バリューのヘッド、幅 14336 のエキスパートが 8個で各トークンはそのうち 2個を使う、語彙 32,000。『Mixtral of Experts』、2024年）のパラメータは 46.7B で、その大半がエキスパートにありますが、各トークンが計算に使うのは 8個のうち 2個だけです。エキスパート並列（`ep`）は、別々のサンプルを受け持つランクの間でエキスパートを分けます。

# %%
mixtral = planner.ModelShape.published("mixtral-8x7b")
moe = {world: ranked(mixtral, world, ep=(1, 2, 4, 8)) for world in (64, 512)}
for world, rows in moe.items():
    show(mixtral, world, rows, top=4)

# %%
for world, rows in moe.items():
    first = next(r for r in rows if r.fits)
    assert first.layout.ep > 1 and first.layout.tp * first.layout.ep <= h100.devices_per_node  # one server
    assert 0 < first.time.ep < first.time.compute / 20

# %% [markdown]
# <!-- en -->
# The first choice on both sizes puts 4 experts' worth of ranks and `tp 2` inside one server: expert parallelism
# divides the largest part of the weights by 4 without the bubble of a pipeline or tensor parallelism's
# all-reduces, and its all-to-alls carry each token's 2 rows of width 4096 only, less than a twentieth of the compute
# time on NVLink. The assumption that flatters it: the planner spreads tokens evenly over the experts (chapter 11
# measured how uneven a router can be, and a full expert drops tokens or waits).
#
# Now the runs this can be checked against. Llama 3 405B (126 layers, width 16384, 128 heads with 8 key/value
# heads, MLP 53248, vocabulary 128,256) was trained with a global batch of 16M tokens in sequences of 8,192 on
# servers of 8 H100s connected by NVLink inside and 400 Gb/s between them, with these layouts and per-GPU rates
# (*The Llama 3 Herd of Models*, 2024): on 8,192 GPUs TP 8, CP 1, PP 16 at 430 TFLOP/s; on 16,384 GPUs TP 8, CP 1,
# PP 16 at 400; for long context (131,072 tokens) TP 8, CP 16, PP 16 at 380. The paper also describes FSDP's
# sharding of the optimizer state and the gradients (the weights are not resharded after the forward pass),
# context parallelism that all-gathers K and V rather than passing them round a ring, and an interleaved schedule
# of its own. The planner's version of these layouts adds its own choices where the paper differs or says nothing,
# and the cell prints them apart: sequence parallelism, interleaved 1F1B with two stages per rank, ZeRO-1, full
# recomputation, ring attention (the same bytes as an all-gather in more calls). For each, the planner's rank of that
# layout among those that fit, its memory, the model FLOP/s it predicts, and the planner's own first choice. Two
# clusters: `Cluster.h100()`, compute at the 400 TFLOP/s Llama 3 reached, and the same with the data sheet's
# 989 TFLOP/s.
# <!-- ja -->
# どちらの規模でも、第 1候補はエキスパート並列 4 と `tp 2` を 1台のサーバーの中に置きます。エキスパート並列は、重みのいちばん大きな部分を、パイプラインのバブルもテンソル並列のオールリデュースもなしに 4で割ります。オールツーオールで運ぶのは各トークンの幅 4096 の行 2本だけで、NVLink の上では計算時間の 20分の 1 に届きません。これを有利に見せている仮定もあります。プランナーはトークンがエキスパートに均等に分かれると仮定しています（11章では、ルーターの割り振りがどれほど偏りうるかを測りました。いっぱいになったエキスパートはトークンを落とすか、待たせます）。
#
# 次は、確かめる相手になる実際の訓練です。Llama 3 405B（126層、幅 16384、128個のヘッドと 8個のキー・バリューのヘッド、MLP 53248、語彙 128,256）は、全体のバッチサイズ 16M トークン、系列の長さ 8,192 で、中を NVLink で、サーバー間を 400 Gb/s でつないだ 8枚の H100 のサーバーで訓練されました。レイアウトと GPU あたりの速さは次のとおりです（『The Llama 3 Herd of Models』、2024年）。8,192枚の GPU で TP 8、CP 1、PP 16、430 TFLOP/s。16,384枚の GPU で TP 8、CP 1、PP 16、400 TFLOP/s。長いコンテキスト（131,072トークン）では TP 8、CP 16、PP 16、380 TFLOP/s。論文はさらに、オプティマイザの状態と勾配の FSDP によるシャーディング（重みは順伝播のあと再シャーディングしません）、K と V をリングで回すのではなくオールギャザーするコンテキスト並列、そして独自のインターリーブのスケジュールを述べています。プランナーが組み立てるこれらのレイアウトには、論文と違うところや論文が何も言っていないところで、プランナー自身の選択が入ります。セルはそれを分けて表示します。シーケンス並列、ランクあたり 2ステージのインターリーブ 1F1B、ZeRO-1、すべての再計算、リングアテンション（オールギャザーと同じバイト数を、より多くの呼び出しで送ります）です。それぞれについて、収まるレイアウトの中でのそのレイアウトの順位、メモリ、予測したモデルの FLOP/s、プランナー自身の第 1候補を示します。クラスタは 2つです。Llama 3 が得た 400 TFLOP/s で計算を数える `Cluster.h100()` と、データシートの 989 TFLOP/s で数えるものです。

# %%
peak = planner.Cluster.h100(flops_per_s=989e12)
PUBLISHED = [(8192, 8192, BATCH, 1, 430), (16384, 8192, BATCH, 1, 400), (16384, 131072, 128, 16, 380)]
llama405, rows405 = {}, []
for world, seq, batch, cp, rate in PUBLISHED:
    model = planner.ModelShape.published("llama3-405b", seq=seq)
    dp = world // (8 * cp * 16)
    theirs = planner.Layout(dp=dp, tp=8, sp=True, cp=cp, pp=16, schedule="interleaved1f1b", stages_per_rank=2,
                            micro_batches=batch // dp, zero=1, recompute=True)
    for cluster in (h100, peak):
        rows = ranked(model, world, batch, cluster=cluster, cp=(cp,))
        fits = [r for r in rows if r.fits]
        mine = next(r for r in rows if r.layout == theirs)
        bare = next(r for r in rows if r.layout == replace(theirs, recompute=False))
        llama405[world, seq, cluster.flops_per_s] = (mine, bare, fits, tflops(model, mine, world, batch))
        rows405.append([world, f"{seq // 1024}K", rate, f"{cluster.flops_per_s / 1e12:.0f}T",
                        f"{fits.index(mine) + 1}/{len(fits)}", f"{mine.memory.total / 1e9:.1f}",
                        f"{tflops(model, mine, world, batch):.0f}", fits[0].layout.label(),
                        f"{tflops(model, fits[0], world, batch):.0f}"])
print(table(rows405, [("GPUs", "GPU の数"), ("tokens", "トークン"), ("published", "公表値"), "FLOP/s", ("rank", "順位"), "GB",
                      "TFLOP/s", ("planner's first", "プランナーの第 1候補"), "TFLOP/s"], align=">>>>>>><>"))
print(tr("published: TP 8, PP 16, CP 1 (16 for 131,072 tokens), the rest data parallel",
         "公表されたもの: TP 8、PP 16、CP 1（131,072トークンでは 16）、残りはデータ並列"))
print(tr("as the planner builds them (sp, i1F1B x2, ZeRO-1 and rc are its own assumptions):",
         "プランナーが組み立てたもの（sp、i1F1B x2、ZeRO-1、rc はプランナー自身の仮定）:"))
for label in sorted({r[0].layout.label() for r in llama405.values()}):
    print("  " + label)

# %%
for (world, seq, rate), (mine, bare, fits, predicted) in llama405.items():
    assert mine.fits and not bare.fits  # the planner needs recomputation to fit these layouts in 80 GB
    assert fits.index(mine) < 4 and mine.layout.recompute
    if rate == 400e12:
        assert predicted < 400  # compute alone is charged at 400: every other part only adds time
at_peak = {(w, s): v[3] for (w, s, r), v in llama405.items() if r == 989e12}
assert at_peak[8192, 8192] > at_peak[16384, 8192]  # 430 > 400, as published
assert at_peak[16384, 131072] > at_peak[16384, 8192]  # published 380 < 400: the planner disagrees
long = planner.ModelShape.published("llama3-405b", seq=131072)
assert ranked(long, 16384, 128, cp=(1,)) == []  # without context parallelism: nothing valid
d, s = long.dim, long.seq
scores = 4 * s * d / (4 * s * d + 2 * (2 * d * d + 2 * d * long.kv_dim) + 2 * 3 * d * long.hidden)
assert round(scores, 2) == 0.57

# %%
theirs = llama405[8192, 8192, peak.flops_per_s][0].layout  # the 8,192-GPU layout, 8K tokens
RECOMPUTE_NAMES = {False: ("none", "なし"), "selective": ("selective", "選択的"), True: ("full", "すべて")}
KEPT = {"scores": ("softmax weights (math kernel)", "softmax の重み（math カーネル）"),
        "flash": ("log-sum-exp (fused kernel)", "log-sum-exp（融合カーネル）")}
recompute_rows, recompute_gb = [], {}
for attention in ("scores", "flash"):
    shape = replace(planner.ModelShape.published("llama3-405b"), attention=attention)
    for how, label in RECOMPUTE_NAMES.items():
        layout = replace(theirs, recompute=how)
        memory = planner.memory_per_rank(shape, layout, BATCH, "mixed", regather=True).total
        seconds = planner.step_time(shape, layout, BATCH, peak, "mixed").total
        recompute_gb[attention, how] = memory / 1e9
        recompute_rows.append([KEPT[attention], label, f"{memory / 1e9:,.0f}",
                               f"{shape.flops_per_sample() * BATCH / (seconds * 8192) / 1e12:.0f}"])
bare_label = replace(theirs, recompute=False).label()
print(tr(f"Llama 3 405B, {bare_label}, on 8,192 H100s at 989 TFLOP/s:",
         f"Llama 3 405B、{bare_label}、8,192枚の H100、989 TFLOP/s:"))
print(table(recompute_rows, [("attention keeps", "アテンションが保存するもの"), ("recomputation", "再計算"), "GB",
                             "TFLOP/s"], indent=2))

# %%
assert recompute_gb["flash", "selective"] == recompute_gb["flash", False] > 80  # nothing to drop: still too large
assert recompute_gb["scores", "selective"] == recompute_gb["flash", False]  # dropping the scores = a fused kernel
assert recompute_gb["flash", True] < 80 and 500 < recompute_gb["scores", False] < 600  # the sentence below

# %% [markdown]
# <!-- en -->
# Where the planner agrees with the published runs:
#
# - Each published layout is among the planner's first four of 13 to 20 that fit, and with compute at the data
#   sheet's rate the two 8K-token layouts are its first choice: tensor parallelism over the 8 GPUs of a server,
#   a 16-stage pipeline, the rest data parallel. Above them it ranks layouts with fewer stages and more data
#   parallelism, by one or two percent for the 8K runs, well inside what a model of this kind can tell apart (for
#   long context at 400 TFLOP/s, by 8%: see the bubble below).
# - More GPUs for the same batch lower the rate per GPU: 8,192 GPUs reach more FLOP/s per GPU than 16,384, as
#   published (430 and 400). With 16 sequences per replica instead of 32, the bubble's share grows.
# - Long context needs context parallelism: a step of 128 sequences of 131,072 tokens cannot even occupy 16,384
#   GPUs without splitting sequences (`tp 8` and `pp 16` leave 128 replicas of one sequence each, and a pipeline
#   needs at least as many micro-batches as stages); without `cp` the grid has no valid layout.
#
# Where it does not:
#
# - **Recomputation.** Under the planner's count none of the three published layouts fits in 80 GB without
#   recomputing activations (135 and 96 GB per rank), and with full recomputation they fit with room to spare
#   (about 21 GB). Selective recomputation (`recompute="selective"`; Korthikanti et al. drop the attention's
#   `s x s` softmax and dropout tensors and recompute them in the backward pass) does not close the gap, as the
#   table above shows: the published models use a fused attention kernel, which keeps no `s x s` tensors in the
#   first place (its backward pass recomputes the scores, the same idea built into the kernel), so for them
#   selective recomputation changes nothing; with the math kernel's scores kept, it is what brings the memory back
#   from 539 GB per rank to the fused kernel's 135. What lies between none and full recomputation is something
#   the planner does not model (recomputing only some of the blocks, for one); full recomputation costs a third
#   more compute, which makes the predicted rates low.
# - **The bubble.** With 16 sequences per replica (16,384 GPUs) `bubble_formula` charges the interleaved 16-stage
#   pipeline `15 / (2 x 16 + 15)`, a third of the step; Llama 3 still reached 400 and 380 TFLOP/s there, so its
#   schedule lost less than the formula for equal stages says.
# - **The rate itself.** With compute charged at 400 TFLOP/s the predicted model FLOP/s are far below the
#   published 430, 400 and 380, necessarily: Llama 3's 400 is already the end-to-end rate, bubble and
#   communication included, and the planner adds its own on top. With the data sheet's 989 TFLOP/s the
#   predictions land near the published rates, above them for 8,192 GPUs and long context and slightly below
#   for 16,384, though real kernels run well below the peak: the planner charges the pipeline a fuller bubble and
#   more recomputation than the published runs paid (their schedule and memory savings are their own).
# - **Long context is predicted faster than the 8K run on the same GPUs, and it was slower.** At 131,072 tokens
#   the scores `Q K^T` and `A V` are 57% of the FLOPs the planner counts in a block, and it counts every one of them at full
#   speed; a causal model computes only half the `s x s` scores, ring attention's blocks are unbalanced unless the
#   sequence is split cleverly (chapter 11), and attention kernels run further from the peak than large matrix
#   products. None of this is in the formulas.
#
# The planner, then, is a tool for the first decision (what fits, which dimension to use, where each group goes),
# not a stopwatch: its seconds are only as good as the FLOP/s and the links it is given, and those must be measured.
# <!-- ja -->
# プランナーが公表された訓練と一致する点:
#
# - 公表されたレイアウトはどれも、収まる 13〜20個のレイアウトの中でプランナーの上位 4つに入ります。データシートの速さで計算を数えると、8K トークンの 2つのレイアウトはプランナーの第 1候補です。サーバーの 8枚の GPU でテンソル並列、16ステージのパイプライン、残りはデータ並列という組み合わせです。これより上に並ぶのはステージを減らしてデータ並列を増やしたレイアウトで、8K の訓練では差は 1〜2% です。この種のモデルが区別できる範囲をはるかに下回ります（400 TFLOP/s で数えた長いコンテキストでは 8% です。下のバブルの項を見てください）。
# - 同じバッチを多くの GPU で分けると、GPU あたりの速さは下がります。公表値（430 と 400）と同じく、8,192枚のほうが 16,384枚より GPU あたりの FLOP/s が高くなります。レプリカあたりの系列が 32本から 16本に減り、バブルの割合が大きくなるからです。
# - 長いコンテキストにはコンテキスト並列が必要です。131,072トークンの系列 128本のステップでは、系列を分けなければ 16,384枚の GPU に仕事を行き渡らせることさえできません（`tp 8` と `pp 16` で、系列 1本ずつのレプリカが 128個になり、パイプラインにはステージの数以上のマイクロバッチが必要です）。`cp` なしでは、グリッドに有効なレイアウトが 1つもありません。
#
# 一致しない点:
#
# - **再計算。** プランナーの数え方では、公表された 3つのレイアウトはどれも、活性化を再計算しなければ 80 GB に収まりません（ランクあたり 135 GB と 96 GB）。すべて再計算すると、余裕をもって収まります（約 21 GB）。選択的な再計算（`recompute="selective"`。Korthikanti らは、アテンションの `s x s` の softmax とドロップアウトのテンソルを保存せず、逆伝播で計算し直します）では、上の表のとおり、この差は埋まりません。公表されたモデルはアテンションの融合カーネルを使っていて、そもそも `s x s` のテンソルを保存しないからです（そのカーネルの逆伝播はスコアを計算し直します。同じ考え方がカーネルに組み込まれています）。そのため、これらのモデルでは選択的な再計算で何も変わりません。math カーネルのようにスコアを保存する場合には、選択的な再計算こそが、ランクあたりのメモリを 539 GB から融合カーネルの 135 GB まで戻します。再計算なしとすべての再計算の間にあるものは、プランナーが表していない方法です（たとえば一部のブロックだけを再計算する方法）。すべての再計算は計算を 3分の 1 増やすので、予測する速さは低めになります。
# - **バブル。** レプリカあたり系列 16本（16,384枚の GPU）では、`bubble_formula` はインターリーブした 16ステージのパイプラインに `15 / (2 x 16 + 15)`、つまりステップの 3分の 1 を課します。それでも Llama 3 はそこで 400 と 380 TFLOP/s を出したので、そのスケジュールの損失は、等しいステージを仮定した式が示すより小さかったことになります。
# - **速さそのもの。** 計算を 400 TFLOP/s で数えると、予測したモデルの FLOP/s は公表値の 430、400、380 を大きく下回ります。これは当然です。Llama 3 の 400 はバブルも通信も含めた最終的な速さで、プランナーはその上に自分の分を加えるからです。データシートの 989 TFLOP/s で数えると、予測は公表値の近くに来ます。8,192枚と長いコンテキストでは公表値より上、16,384枚ではわずかに下です。実際のカーネルはピークよりかなり遅いのに、そうなります。プランナーは、公表された訓練が払ったよりも大きなバブルと多くの再計算をパイプラインに課しているからです（スケジュールとメモリの節約の工夫は、それぞれの訓練独自のものです）。
# - **長いコンテキストは、同じ GPU での 8K の訓練より速いと予測されますが、実際は遅くなりました。** 131,072トークンでは、スコア `Q K^T` と `A V` がプランナーの数えるブロックの FLOP 数の 57% を占め、プランナーはそのすべてを全速で数えます。因果的なモデルが計算する `s x s` のスコアは半分だけで、リングアテンションのブロックは系列をうまく分けないと偏り（11章）、アテンションのカーネルは大きな行列の積よりピークから遠いところで動きます。どれも式には入っていません。
#
# つまりプランナーは、最初の判断（何が収まるか、どの次元を使うか、各グループをどこに置くか）のための道具で、ストップウォッチではありません。秒数の確かさは、与えた FLOP/s とリンクの値の確かさで決まり、それらは測らなければなりません。

# %% [markdown]
# <!-- en -->
# ## How to choose
#
# A procedure for a model and a cluster of your own, in the order the chapters built it:
#
# 1. **Measure the cluster.** The FLOP/s one device reaches on your model's matrix sizes while all devices
#    compute (chapter 7 measured a device's peak with a large matrix product), and `alpha` and `beta` of an all-reduce inside a node and across nodes with
#    chapter 8's `bandwidth_worker` and `fit_alpha_beta`, at the group sizes you mean to use;
#    `Cluster.from_fit(fit, ranks, ...)` turns a fit into the planner's link. Check the memory a device really
#    gives you (chapter 9's `PeakMemory` on one step) and leave room for what the planner does not count.
# 2. **Fit memory first.** Bytes per parameter x parameters (chapter 9) tells whether data parallelism alone can
#    hold the state; ZeRO-1 or 2 removes most of the optimizer's share for little traffic, ZeRO-3 (FSDP) the rest
#    for an all-gather per micro-batch. Then the activations: `activation_bytes_per_layer` x tokens x blocks x the
#    schedule's micro-batches in flight.
# 3. **Tensor parallelism inside a node, no more of it than needed.** It splits weights and activations together,
#    but its traffic per rank grows with `t` and sits on the critical path; keep its group on the fastest link,
#    with sequence parallelism (chapter 11) for the activations between its regions.
# 4. **A pipeline across nodes** when the model is still too large: its messages are small, point to point, and
#    cross the slow links well; give it at least 4 to 8 times more micro-batches than stages, or interleave
#    (chapter 10), or both, to keep the bubble small.
# 5. **Context parallelism for long sequences** when one sequence's activations do not fit even with tensor and
#    sequence parallelism; **expert parallelism for mixtures of experts**, inside a node when the all-to-alls are
#    large.
# 6. **Data parallelism for the rest**, up to what the global batch allows: more replicas mean fewer micro-batches
#    each, and at some point the bubble or the communication eats the gain.
# 7. **Rank with the planner, then measure the first few.** Run `plan` with your measured cluster, take the first
#    layouts that fit with some margin, and time a few steps of each; where measurement and prediction disagree,
#    find which part (compute, a collective, the bubble) is off, as this chapter's measurements on 8 processes do.
# <!-- ja -->
# ## レイアウトの選び方
#
# 自分のモデルと自分のクラスタのための手順です。章を進めてきた順に並べます。
#
# 1. **手元のクラスタを測ります。** すべてのデバイスが同時に計算しているときに、1つのデバイスが自分のモデルの行列のサイズで出せる FLOP/s（7章では大きな行列の積でデバイスのピークを測りました）と、ノード内とノード間のオールリデュースの `alpha` と `beta`（8章の `bandwidth_worker` と `fit_alpha_beta`、使うつもりのグループのサイズで）を測ります。`Cluster.from_fit(fit, ranks, ...)` は、当てはめた結果をプランナーのリンクに変えます。デバイスで実際に使えるメモリも確かめ（9章の `PeakMemory` で 1ステップ分）、プランナーが数えないものの分の余裕を残します。
# 2. **まずメモリに収めます。** パラメータあたりのバイト数 x パラメータ数（9章）で、データ並列だけで状態を持てるかがわかります。ZeRO-1 や 2 は少ない通信でオプティマイザの分の大半をなくし、ZeRO-3（FSDP）はマイクロバッチごとのオールギャザーと引き換えに残りもなくします。次に活性化です。`activation_bytes_per_layer` x トークン数 x ブロック数 x スケジュールで処理中のマイクロバッチの数です。
# 3. **テンソル並列はノードの中で、必要な分だけ使います。** 重みと活性化をまとめて分けますが、ランクあたりの通信量は `t` とともに増え、しかもクリティカルパスの上にあります。グループはいちばん速いリンクの上に置き、領域の間の活性化にはシーケンス並列（11章）を使います。
# 4. **それでもモデルが大きすぎれば、ノードをまたいでパイプラインを使います。** メッセージは小さい 1対1通信で、遅いリンクをまたいでも困りません。バブルを小さく保つため、マイクロバッチの数をステージの数の 4〜8倍以上にするか、インターリーブする（10章）か、その両方にします。
# 5. **長い系列にはコンテキスト並列を使います。** テンソル並列とシーケンス並列を使っても 1本の系列の活性化が収まらないときです。**MoE にはエキスパート並列を使います。** オールツーオールが大きければノードの中に置きます。
# 6. **残りはデータ並列にします。** 全体のバッチサイズが許す範囲までです。レプリカを増やすとレプリカごとのマイクロバッチは減り、どこかでバブルや通信が利得を食いつぶします。
# 7. **プランナーで順位をつけ、上位のいくつかを測ります。** 測ったクラスタで `plan` を実行し、余裕をもって収まる上位のレイアウトを選んで、それぞれ数ステップの時間を測ります。測定と予測が食い違ったら、どの部分（計算、ある集合通信、バブル）がずれているのかを突き止めます。この章の 8個のプロセスでの測定がそうしているようにです。

# %% [markdown]
# <!-- en -->
# ### Before the first run over several machines: where the rendezvous listens
#
# On one machine every process of this course meets at `127.0.0.1`. On several, rank 0's machine serves the
# rendezvous (a `TCPStore`, a small key-value server) on an address the other machines reach. `TCPStore` on its own
# listens on every interface of the machine, so any computer that reaches it could read and write the keys the
# ranks meet by. The course's launcher and `process_group` (for processes started by hand with `RANK`,
# `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`) serve it on `MASTER_ADDR` alone, with
# `rendezvous.listening_store`, and point gloo's own connections at the same interface (`interface_of`,
# `GLOO_SOCKET_IFNAME`). Under `torchrun`, its agent serves the store: give it `--rdzv-endpoint` on the interface
# you mean, and keep the cluster's network closed to the outside.
# <!-- ja -->
# ### 複数のマシンでの最初の実行の前に: ランデブーが待ち受ける場所
#
# 1台のマシンでは、このコースのプロセスはどれも `127.0.0.1` で落ち合います。複数のマシンでは、ランク 0 のマシンが、他のマシンから届くアドレスでランデブー（小さなキーと値のサーバーである `TCPStore`）を開きます。`TCPStore` はそのままではマシンのすべてのインターフェースで待ち受けるので、そこに届くどのコンピューターでも、ランクが落ち合うためのキーを読み書きできてしまいます。このコースのランチャーと `process_group`（`RANK`、`WORLD_SIZE`、`MASTER_ADDR`、`MASTER_PORT` を手で設定して起動したプロセスの場合）は、`rendezvous.listening_store` でサーバーを `MASTER_ADDR` だけで開き、gloo 自身の接続も同じインターフェースに向けます（`interface_of`、`GLOO_SOCKET_IFNAME`）。`torchrun` ではそのエージェントがサーバーを開くので、`--rdzv-endpoint` に意図したインターフェースのアドレスを指定し、クラスタのネットワークを外部から閉じておいてください。

# %% tags=["nbval-ignore-output"]
import psutil

store = listening_store("127.0.0.1", 0, 1)  # port 0: the system chooses a free one
where = sorted({c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port})
print(tr(f"The store listens on {', '.join(where)} only (interface {interface_of('127.0.0.1')}).",
         f"サーバーが待ち受けるのは {', '.join(where)} だけです（インターフェース {interface_of('127.0.0.1')}）。"))
del store

# %%
assert where == ["127.0.0.1"], where

# %% [markdown]
# <!-- en -->
# ### The end of the course
#
# This is where the course ends. It started with `nn.DataParallel` on one machine and a question about why two GPUs
# can be slower than one; it ends with the tools to answer that question for any layout: build each method from its
# messages, check it against one process, measure what it costs, and predict before you spend a cluster's hours.
# <!-- ja -->
# ### コースの終わりに
#
# ここでこのコースは終わりです。1台のマシンでの `nn.DataParallel` と、「なぜ GPU 2枚のほうが 1枚より遅いことがあるのか」という問いから始まりました。そして、その問いにどのレイアウトについても答えるための道具で終わります。それぞれの方法をメッセージから組み立て、1個のプロセスと比べて確かめ、何がかかるかを測り、クラスタの時間を使う前に予測することです。

# %% [markdown]
# <!-- en -->
# ## Summary
#
# - **Interleaving** gives each of `p` ranks `v` stages `v` times smaller: the fill and the drain shrink to
#   `(p - 1) / v` passes, a bubble of `(p - 1) / (v m + p - 1)`. **Zero bubble** splits a stage's backward into the
#   input gradient I, which the previous stage waits for, and the weight gradient W, which nobody waits for, and
#   runs W where a rank would idle; with the V placement (rank `r` holds stages `r` and `2p - 1 - r`) and equal
#   passes, `(p - 1) / (6 m + p - 1)`. Interleaved 1F1B, ZBV and DualPipeV give the gradients of one process on 2 and
#   4 processes (float64), and `simulate_schedule` replays torch's own order of passes.
# - They pay in memory and in pieces: at `m = 8` the most activations a rank holds are 1.5x (interleaved, 2 ranks) to
#   1.83x (4 ranks) those of 1F1B, ZBV 1.2x and 1.33x, DualPipeV 1.5x; and a rank runs 4 passes per micro-batch
#   (interleaved, v = 2) or 6 (ZBV) instead of 1F1B's 2. On CPU processes the time between passes is as long as
#   the passes or longer, so the measured bubbles stay far above every formula; in every run recorded here
#   interleaved 1F1B's bubble came out larger than 1F1B's, the reverse of the formulas' order, and ZBV's within 0.09
#   of 1F1B's, above it or below.
# - `mparlib.planner` predicts a layout's memory per rank and step time from a model's shape, a global batch and a
#   cluster, with the chapters' formulas: chapter 9's bytes per parameter and ZeRO stages (plus the blocks FSDP
#   gathers), activations counted as the course's block saves them (exact for its ViT; Korthikanti et al.'s
#   `34 + 5 a s / h` under their assumptions), chapter 8's alpha-beta model with ring traffic, chapter 10's bubble
#   and chapter 11's collectives.
# - On 8 processes of this machine five layouts (dp 8; fsdp 8; fsdp 4 x tp 2; fsdp 2 x tp 2 x pp 2;
#   dp 2 x cp 2 x pp 2) train exactly like one process, and every rank runs exactly the collectives
#   `planner.collectives` counts from the plan the layouts execute (`TP_PLAN`, FSDP's units, the pipeline's sends):
#   the same calls of each kind, the same bytes to 1%. Memory per rank is within 10% where the code decides what
#   is held (dp 8 -1%, dp 2 x cp 2 x pp 2 +3%, fsdp 2 x tp 2 x pp 2 -9%) and too low for FSDP without a pipeline
#   (-12%, -26%), whose largest peak depends on when gloo frees gradients. With each kind of call priced by its own
#   measured alpha and beta, the planner ordered the five step times with Spearman 0.8 to 0.9 in four runs (goal
#   0.8), a fragile order (two layouts 2% apart); the seconds themselves were 0.9 to 2.6 times off.
# - On paper, with published H100 figures, the planner ranks Llama 3 405B's published layouts among its first four
#   of those that fit; they fit only with activations recomputed; it gets the 8,192- and 16,384-GPU rates in the
#   right order and the 128K-token run wrong, because it counts attention's `s x s` products at full speed.
# - To choose a layout for a cluster of your own: measure its FLOP/s and links with every group busy, fit memory
#   first, keep tensor parallelism inside a node, add a pipeline across nodes with enough micro-batches, context and
#   expert parallelism where sequences or experts need them, data parallelism for the rest, then rank with the
#   planner and time the first few.
# <!-- ja -->
# ## まとめ
#
# - **インターリーブ**では、`p` 個のランクのそれぞれが、`v` 分の 1 の大きさのステージを `v` 個持ちます。満ちるまでと空になるまでが `(p - 1) / v` パスに縮み、バブルは `(p - 1) / (v m + p - 1)` です。**ゼロバブル**は、ステージの逆伝播を、前のステージが待っている入力の勾配 I と、誰も待っていない重みの勾配 W に分け、ランクが遊ぶはずの場所で W を実行します。V 字の配置（ランク `r` がステージ `r` と `2p - 1 - r` を持つ）でパスの時間が等しければ `(p - 1) / (6 m + p - 1)` です。インターリーブ 1F1B、ZBV、DualPipeV は、2個と 4個のプロセスで 1個のプロセスと同じ勾配を出し（float64）、`simulate_schedule` は torch 自身のパスの順序を再現します。
# - その代わりに、メモリと仕事の細かさで払います。`m = 8` でランクが同時に持つ活性化の最大は、1F1B に対してインターリーブで 1.5倍（2ランク）〜1.83倍（4ランク）、ZBV で 1.2倍と 1.33倍、DualPipeV で 1.5倍です。また、ランクはマイクロバッチごとに、1F1B の 2回に対して、インターリーブ（v = 2）では 4回、ZBV では 6回のパスを実行します。CPU 上のプロセスではパスとパスの間の時間がパスと同じくらいか、それより長いので、測ったバブルはどの式よりもずっと大きくなります。ここに記録したどの実行でも、インターリーブ 1F1B のバブルは 1F1B より大きく、式の大小の順とは逆でした。ZBV のバブルは 1F1B との差が上下とも 0.09 以内でした。
# - `mparlib.planner` は、モデルの形状、全体のバッチサイズ、クラスタから、レイアウトのランクあたりのメモリと 1ステップの時間を予測します。使うのはこれまでの章の式です。9章のパラメータあたりのバイト数と ZeRO のステージ（FSDP がまとめて持つブロックも加えます）、このコースのブロックが保存するとおりに数えた活性化（コースの ViT では正確で、Korthikanti らの仮定のもとでは `34 + 5 a s / h` になります）、8章のリング通信量付きの α-β モデル、10章のバブル、11章の集合通信です。
# - このマシンの 8個のプロセスで、5つのレイアウト（dp 8、fsdp 8、fsdp 4 x tp 2、fsdp 2 x tp 2 x pp 2、dp 2 x cp 2 x pp 2）は 1個のプロセスとまったく同じように訓練されます。どのランクも、レイアウトが実行するプラン（`TP_PLAN`、FSDP のユニット、パイプラインの送信）から `planner.collectives` が数えたとおりの集合通信を行います。種類ごとの回数は同じで、バイト数は 1% 以内で一致します。ランクあたりのメモリは、何を持つかをコードが決めているところでは 10% 以内です（dp 8 は -1%、dp 2 x cp 2 x pp 2 は +3%、fsdp 2 x tp 2 x pp 2 は -9%）。パイプラインのない FSDP では少なく予測します（-12%、-26%）。そのいちばん大きなピークは、gloo が勾配を解放する時点で決まります。呼び出しの種類ごとに測った alpha と beta で時間をつけると、プランナーは 5つのステップ時間を、4回の実行でスピアマンの順位相関 0.8〜0.9（目標は 0.8）で並べました。ただし壊れやすい順位です（2つのレイアウトの差は 2%）。秒数そのものは 0.9〜2.6倍ずれました。
# - 公表された H100 の数値を使った机上検討では、プランナーは Llama 3 405B の公表されたレイアウトを、収まるものの上位 4つの中に並べます。それらが収まるのは活性化を再計算する場合だけです。8,192枚と 16,384枚の GPU での速さの順は正しく、128K トークンの訓練は外します。アテンションの `s x s` の積を全速で数えるからです。
# - 自分のクラスタでレイアウトを選ぶには、すべてのグループが同時に動いている状態で FLOP/s とリンクを測り、まずメモリに収め、テンソル並列はノードの中に置き、ノードをまたぐところには十分なマイクロバッチを持つパイプラインを、系列やエキスパートが必要とするところにはコンテキスト並列とエキスパート並列を加え、残りをデータ並列にしてから、プランナーで順位をつけ、上位のいくつかを測ります。

# %% [markdown]
# <!-- en -->
# ## Exercises
#
# Each exercise has a **starter** cell whose function body is `raise NotImplementedError`: replace that line with your
# code, run the cell, then run the check cell below it. The check says *not attempted*, *wrong* (the first difference
# and one hint for the likely mistake), *error* (your exception, or your code ending its process), *right*, *cannot
# run here* or *the check itself failed* (never a verdict on your answer); it never prints the answer. Your function
# runs in a fresh worker process and is stopped after 30 s. `hint("12.1")` prints the next hint level each time you
# call it and says when none is left; `hint("12.1", 2)` prints a given level.
# <!-- ja -->
# ## 練習問題
#
# 各練習問題には、本体が `raise NotImplementedError` だけの関数を含む**スターター**のセルがあります。その行を自分のコードに置き換えてセルを実行し、すぐ下のチェックのセルを実行してください。チェックの結果は「未着手」、「不正解」（最初の違いと、ありがちな間違いに合わせたヒント 1つ）、「エラー」（発生した例外、またはコードがプロセスを終了させたこと）、「正解」、「この環境では実行できません」、「チェック自体の不具合」（あなたの答えの判定ではありません）のどれかで、答えそのものは表示しません。関数は新しいワーカープロセスで実行し、30秒で止めます。`hint("12.1")` は呼ぶたびに次の段階のヒントを表示し、もう残っていなければそう伝えます。`hint("12.1", 2)` は指定した段階のヒントを表示します。

# %%
from mparlib.exercises import check, hint

# %% [markdown]
# <!-- en -->
# ### Exercise 12.1: The interleaved bubble
#
# Write `interleaved_bubble(num_stages, micro_batches, stages_per_rank)` without calling
# `schedules.bubble_formula`: the share of a step that a rank of interleaved 1F1B spends idle, with `num_stages`
# pipeline ranks `p`, each holding `stages_per_rank` (`v`) equal stages, and `micro_batches` micro-batches `m`.
# The check compares at random points.
# <!-- ja -->
# ### 練習問題 12.1: インターリーブのバブル
#
# `schedules.bubble_formula` を呼ばずに `interleaved_bubble(num_stages, micro_batches, stages_per_rank)` を書いてください。パイプラインのランクが `num_stages` 個（`p`）で、それぞれが等しいステージを `stages_per_rank` 個（`v`）持ち、マイクロバッチが `micro_batches` 個（`m`）のとき、インターリーブの 1F1B で 1つのランクがステップのうち何もしていない割合を返します。チェックはランダムな点で比べます。

# %%
# Exercise 12.1: starter
def interleaved_bubble(num_stages, micro_batches, stages_per_rank):
    """The idle share of a step of interleaved 1F1B with v equal stages per rank."""
    raise NotImplementedError("12.1")

# %%
check("12.1", interleaved_bubble)

# %% [markdown]
# <!-- en -->
# ### Exercise 12.2: A layout's training state per rank
#
# Write `state_bytes_per_rank(n_params, dp, tp, pp, stage)`: the bytes of parameters, gradients and Adam state
# (float32 throughout, 16 bytes per parameter as in chapter 9) that one rank holds when a model of `n_params`
# parameters is split by tensor parallelism over `tp` ranks and by pipeline parallelism over `pp` ranks, and each
# part is trained by `dp` data-parallel ranks under ZeRO stage `stage` (0 to 3). Assume every split is even. The
# check compares at random layouts, including 7 billion parameters.
# <!-- ja -->
# ### 練習問題 12.2: レイアウトのランクあたりの訓練状態
#
# `state_bytes_per_rank(n_params, dp, tp, pp, stage)` を書いてください。パラメータが `n_params` 個のモデルを、テンソル並列で `tp` 個のランクに、パイプライン並列で `pp` 個のランクに分け、それぞれの部分を `dp` 個のデータ並列のランクが ZeRO のステージ `stage`（0〜3）で訓練するとき、1つのランクが持つパラメータ、勾配、Adam の状態のバイト数（すべて float32 で、9章と同じくパラメータ 1個あたり 16バイト）を返します。分割はどれも均等とします。チェックは、70億個のパラメータを含むランダムなレイアウトで比べます。

# %%
# Exercise 12.2: starter
def state_bytes_per_rank(n_params, dp, tp, pp, stage):
    """Bytes of fp32 parameters, gradients and Adam state on one rank of a dp x tp x pp layout under ZeRO `stage`."""
    raise NotImplementedError("12.2")

# %%
check("12.2", state_bytes_per_rank)

# %% [markdown]
# <!-- en -->
# ### Exercise 12.3: Micro-batches in flight
#
# Write `in_flight(schedule, stage, num_stages, micro_batches)` for `schedule` `"gpipe"` or `"1f1b"`: the largest
# number of micro-batches whose forward pass has run on stage `stage` (of `num_stages`) and whose backward pass
# has not yet, that is, how many micro-batches' activations the stage holds at once. The check counts over the
# order in which `ScheduleGPipe` and `Schedule1F1B` run every stage of pipelines of 1 to 6 stages.
# <!-- ja -->
# ### 練習問題 12.3: 処理中のマイクロバッチ
#
# `schedule` が `"gpipe"` または `"1f1b"` のときの `in_flight(schedule, stage, num_stages, micro_batches)` を書いてください。`num_stages` 個のステージのうちのステージ `stage` で、順伝播は済んだがまだ逆伝播をしていないマイクロバッチの数の最大値、つまりそのステージが同時に何個のマイクロバッチの活性化を持つかを返します。チェックは、1〜6 ステージのパイプラインのすべてのステージで、`ScheduleGPipe` と `Schedule1F1B` がパスを実行する順序をたどって数えます。

# %%
# Exercise 12.3: starter
def in_flight(schedule, stage, num_stages, micro_batches):
    """The most micro-batches that stage `stage` holds between their forward and their backward."""
    raise NotImplementedError("12.3")

# %%
check("12.3", in_flight)
