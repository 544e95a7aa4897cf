# Section for notebooks/src/12_planning.py: "Schedules beyond 1F1B".
# Imports it needs in chapter 12's first cell:
#   import matplotlib.pyplot as plt
#   from mparlib import diagrams, schedules
#   from mparlib.devices import pad
#   from mparlib.errors import ConfigError
#   from mparlib.lang import tr
#   from mparlib.launch import launch

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
# whole number of rounds of `p`).
# <!-- ja -->
# ## 1F1B の先のスケジュール
#
# 10章では GPipe と 1F1B を測り、1F1B が節約するのはメモリで、時間ではないことを確かめました。どちらでも、各ランクはステップのうち `(p - 1) / (m + p - 1)` の割合だけ遊んでいます。最初のマイクロバッチが最後のステージに届き、その勾配が戻ってくるまでの時間です。マイクロバッチを増やさずにこの遊びを減らす考え方が 2つあります。
#
# - **インターリーブ**（インターリーブ 1F1B。Narayanan ら、2021年、"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"）。モデルを `p` 個ではなく `v p` 個のステージに切り、各ランクにループ状に `v` 個ずつ持たせます。ランク `r` はステージ `r, r + p, r + 2p, ...` を持ちます。ステージは `v` 分の 1 の大きさになるので、パイプラインを満たして空にする費用は、`v` 分の 1 の大きさのステージの `(p - 1)` 回分です。遊びは `(p - 1) / v`、仕事は `m` で、割合は `(p - 1) / (v m + p - 1)` になります。その代わり、マイクロバッチはランクの間を `v` 周するのでメッセージは `v` 倍になり、同時に抱えるマイクロバッチも増えます。
# - **ゼロバブル**（Qi ら、2024年、"Zero Bubble Pipeline Parallelism"）。ステージの逆伝播は 2つの計算からなります。入力についての勾配（ここでは I と呼びます。論文では B）は前のステージが待っています。重みについての勾配（W）は誰も待っていません。W を後回しにして、ランクが待つはずだった時間に実行すれば、バブルが埋まります。論文の ZB-V スケジュールは、各ランクに 2つのステージを **V** の形に持たせます。ランク `r` はステージ `r` と `2p - 1 - r` を持ちます。マイクロバッチはランクを下っていき、また上ってきます。ランク 0 は最初のステージと最後のステージを持ち、損失を計算します。ステージの F、I、W がどれも同じ時間なら、`m >= 2p - 1` のとき各ランクが遊ぶのは、`m` がいくら大きくても `p - 1` 回分だけです。割合 `(p - 1) / (6 m + p - 1)` は 0 に近づいていきます（論文が「ゼロバブル」と呼ぶのは、各ランクが自分の仕事を終えたらすぐ次のステップを始められるからです。ここでのように 1ステップを最初の開始から最後の終了まで測ると、この `p - 1` 回分が残ります）。DualPipeV（DeepSeek の DualPipe、2024年から）も同じ V の配置を使い、順伝播と逆伝播を組にして進めます。
#
# ランクが持つステージは `schedules.stage_indices` が返します。スケジュールに何が必要かは、torch より先に `schedules.check_micro_batches` が教えてくれます（1F1B は `p` 個以上のマイクロバッチ、DualPipeV は `2p` 個以上、インターリーブのスケジュールは `p` 個ずつの回がちょうど割り切れる数）。

# %%
NAMES = {"1f1b": "1F1B", "interleaved1f1b": tr("interleaved 1F1B", "インターリーブ 1F1B"), "zbv": "ZBV",
         "dualpipev": "DualPipeV"}
print(tr("stages held by each rank, p = 4", "各ランクが持つステージ（p = 4）"))
print(pad(tr("schedule", "スケジュール"), 20) + "".join(pad(tr(f"rank {r}", f"ランク {r}"), 10) for r in range(4)))
for name in NAMES:
    print(pad(NAMES[name], 20) + "".join(pad(str(schedules.stage_indices(name, r, 4)), 10) for r in range(4)))
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
print(pad(tr("schedule", "スケジュール"), 18) + pad("p", 3, ">") + pad("m", 4, ">")
      + pad(tr("gradients vs 1 process", "勾配の差（1プロセス比）"), 26, ">"))
for p, result in beyond.items():
    for name, by_m in result.items():
        for m, entry in by_m.items():
            print(pad(NAMES[name], 18) + pad(p, 3, ">") + pad(m, 4, ">") + pad(f"{entry['parity']:.1e}", 26, ">"))

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
header = (pad(tr("schedule", "スケジュール"), 18) + pad("p", 3, ">") + pad("m", 4, ">")
          + pad(tr("measured", "測定"), 10, ">") + pad(tr("min-max", "最小-最大"), 14, ">")
          + pad(tr("formula", "式"), 9, ">") + pad(tr("idle/busy", "遊び/仕事"), 11, ">")
          + pad(tr("simulated", "模擬"), 10, ">"))
print(header)
for p, result in beyond.items():
    for name, by_m in result.items():
        for m, e in by_m.items():
            formula = "-" if e["formula"] is None else f"{e['formula']:.3f}"
            ratio = f"{e['formula'] / (1 - e['formula']):.3f}" if name == "interleaved1f1b" else ""
            print(pad(NAMES[name], 18) + pad(p, 3, ">") + pad(m, 4, ">") + pad(f"{e['measured']:.3f}", 10, ">")
                  + pad(f"{min(e['steps']):.3f}-{max(e['steps']):.3f}", 14, ">") + pad(formula, 9, ">")
                  + pad(ratio, 11, ">") + pad(f"{e['simulated']:.3f}", 10, ">"))

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
print(pad(tr("schedule", "スケジュール"), 18) + pad("p", 3, ">") + pad("m", 4, ">")
      + pad(tr("per rank, until I", "ランクごと（I まで）"), 22, ">") + pad(tr("until W", "W まで"), 16, ">")
      + pad("KiB", 8, ">") + pad(tr("vs 1F1B", "1F1B 比"), 9, ">"))
for p, result in beyond.items():
    for m in (8,):
        base = None
        for name, by_m in result.items():
            e = by_m[m]
            until_i = [c["I"] for c in e["in_flight"]]
            held = max(until_i) * e["saved_bytes"]
            base = held if name == "1f1b" else base
            print(pad(NAMES[name], 18) + pad(p, 3, ">") + pad(m, 4, ">") + pad(str(until_i), 22, ">")
                  + pad(str([c["W"] for c in e["in_flight"]]), 16, ">") + pad(f"{held / 2**10:.0f}", 8, ">")
                  + pad(f"{held / base:.2f}", 9, ">"))

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
# パスごとの決まった費用が、それぞれの式に何をするかを見ます。10章では、大きさによらずマイクロバッチごとにかかる費用が見つかりました。それはどこにあるのでしょうか。`k` 層のパスにかかる時間を `c + k a` とします。同じ種類のパスを、1F1B のステージと半分の大きさのステージ（p = 2 では 4層と 2層、p = 4 では 2層と 1層）で比べると、`c = 2 t(半分) - t(全体)` です。ここでは最短のパスを使います（共有のマシンでは、パスが遅くなることはあっても速くなることはないからです）。もう 1つの候補はパスとパスの間の時間です。「パスあたりの隙間」は、実行で測ったパスの時間の中央値で `simulate_schedule` が再現したステップより実際のステップがどれだけ長かったかを、1つのランクが実行するパスの数で割ったものです。

# %% tags=["nbval-ignore-output"]
for p, result in beyond.items():
    m = 8
    full, half = result["1f1b"][m]["fastest"], result["interleaved1f1b"][m]["fastest"]
    for kind in "FB":
        c, per_layer = 2 * half[kind] - full[kind], (full[kind] - half[kind]) / (8 // p - 8 // (2 * p))
        print(f"p={p}, m={m}, {kind}: " + tr(f"fixed {1e3 * c:.2f} ms, per layer {1e3 * per_layer:.2f} ms",
                                             f"決まった費用 {1e3 * c:.2f} ms、1層あたり {1e3 * per_layer:.2f} ms"))
    for name, by_m in result.items():
        print(f"p={p}, m={m}, {pad(NAMES[name], 18)}" + tr("gap per pass", "パスあたりの隙間")
              + f" {1e3 * by_m[m]['gap_per_pass']:.2f} ms, "
              + tr(f"{sum(map(len, by_m[m]['notes'])) // p} passes per rank",
                   f"ランクあたり {sum(map(len, by_m[m]['notes'])) // p}回のパス"))

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
# the gap per pass is longer than most passes. The "simulated" column,
# computation only, stays near the formula; the measured bubble is well above both. In `benchmarks/pipeline.py`'s
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
# どの式も仕事だけを数えています。パスごとに決まった費用がかかるなら、1F1B のランクはそれを 1ステップに `2 m` 回払います（マイクロバッチごとに F と B）。インターリーブ 1F1B は `2 v m` 回で、マイクロバッチがランクを `v` 周するので、メッセージも `v` 倍になります。ZBV は `6 m` 回（2つのステージそれぞれで F、I、W）で、1F1B の 3倍の頻度です。インターリーブもゼロバブルも、バブルを小さくする代わりに、仕事を小さく数多く切ります。1つ 1つの費用が仕事に比べて小さくなければ、遊びの時間で節約した分をまた使ってしまいます。このコースの実行では、その費用はパスの中ではなく、パスとパスの間にありました。パスの決まった部分 `c` は共有のマシンの揺らぎに埋もれてしまい、パスあたりの隙間はたいていのパスより長くなります。計算だけを数えた「模擬」の列は式の近くにあり、測ったバブルはどちらよりもずっと大きくなります。`benchmarks/pipeline.py` を CPU 2コアで実行して保存した結果（`benchmarks/results/pipeline-vm-20261202-053552.json`。幅 512 の層を 8つ、マイクロバッチあたり 32行、float64）では、`m` = 8 のときの測ったバブルは、2ランクで 1F1B 0.443、インターリーブ 1F1B 0.551、ZBV 0.529、DualPipeV 0.450（式では 0.111、0.059、0.020）、4ランクで 0.668、0.809、0.754、0.701（式では 0.273、0.158、0.059）でした。パスの数がいちばん少ない 1F1B のバブルがいちばん小さく、式の大小の順とは逆です。決まった部分 `c` は -1.7〜+0.1 ms で、1層あたり 0.6〜1.9 ms の仕事と比べると 0 と区別できません。一方、パスあたりの隙間は 6〜20 ms でした。このときマシンは混んでいて（CPU 2コアに対して 1分間のロードアベレージが 21〜24。ファイルに記録してあります）、隙間の多くはランクがコアの空くのを待つ時間です。空いたマシンで隙間がどれだけになるかは、この実行からはわかりません。パスがメッセージよりはるかに長い GPU クラスタで勝つスケジュールも、ここでは勝ちません。式どおりの姿を見るには、各パスを隙間に比べて長くします。層を広くし、マイクロバッチの行を増やします。
