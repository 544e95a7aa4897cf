"""Layouts of the course ViT on 8 gloo ranks: the same losses as one process, and memory counted exactly.

The 8-rank test launches once and runs every layout in turn (process start is the expensive part on 2 cores); the
reference is one process training the same model from the same seed on the same global batches.
"""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mparlib import layouts, planner, sharding
from mparlib.errors import ConfigError
from mparlib.launch import launch

CONFIG = {"patch": 7}  # the smoke ViT with 16 tokens per image, so that 2 context-parallel ranks split them
LAYOUTS = [{"dp": 8}, {"dp": 8, "zero": 3}, {"dp": 4, "zero": 3, "tp": 2},
           {"dp": 2, "zero": 3, "tp": 2, "pp": 2, "micro_batches": 2}, {"dp": 2, "cp": 2, "pp": 2, "micro_batches": 2}]
LR = 0.05


def data(batch=32, steps=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(steps)]


def one_process(batches):
    torch.manual_seed(0)
    model = layouts.vit_of(CONFIG)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


@pytest.mark.slow
def test_every_layout_on_8_ranks_trains_like_one_process_and_runs_the_planners_collectives():
    batches = data()
    model, reference = one_process(batches)
    report = launch(layouts.layouts_worker, 8, args=(CONFIG, LAYOUTS, batches), kwargs={"timed": 1}, echo=False,
                    timeout=240)
    assert [r["name"] for r in report["layouts"]] == [layouts.name_of(layout) for layout in LAYOUTS]
    assert reference[0] != reference[1] != reference[2]  # the steps changed the model: parity below means something
    for r in report["layouts"]:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{r['name']}: {m}")
        memory = r["memory"]
        assert memory["peak"] == max(memory["per_rank"]) and sum(memory["parts"].values()) <= memory["peak"] * 1.1
    for r in report["layouts"]:  # every rank's collectives, counted in a step, are the planner's: calls and bytes
        assert layouts.collective_mismatches(CONFIG, r, 32) == [], r["name"]
        assert {c["stage"] for c in r["collectives"]} == set(range(r["layout"]["pp"]))
    kinds = [set().union(*(c.keys() for c in r["collectives"])) - {"stage"} for r in report["layouts"]]
    # the check sees every kind the layouts use: one all-reduce (dp), FSDP's gathers and reduce-scatters, DTensor's
    # functional all-reduces (tp), the pipeline's and the ring's sends and receives
    assert kinds == [{"all_reduce"}, {"all_gather", "reduce_scatter"}, {"all_gather", "reduce_scatter", "all_reduce"},
                     {"all_gather", "reduce_scatter", "all_reduce", "send", "recv"}, {"all_reduce", "send", "recv"}]
    n = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    dp = report["layouts"][0]["memory"]["parts"]  # dp 8 keeps the whole training state on every rank
    assert dp["params"] == 4 * n and dp["optimizer"] == 8 * n + 4 * tensors  # Adam: 2 moments + a float32 step
    fsdp = report["layouts"][1]["memory"]["parts"]  # FSDP keeps Adam's state of its shards alone: dim-0 chunks,
    shards = [sum(c[r].numel() if r < len(c) else 0 for c in (torch.chunk(p, 8) for p in model.parameters()))
              for r in range(8)]  # a little larger on the first ranks; the largest peak may be on any rank
    assert fsdp["optimizer"] in {4 * tensors + 8 * s for s in shards} and max(shards) < 1.1 * n / 8
    for r in (report["layouts"][0], report["layouts"][4]):  # no tensor parallelism: the same operators each step.
        # The one difference allowed: the flat vector of the gradients' all-reduce (4 n bytes at most) is freed by
        # whichever thread lets go of it last, this rank's or gloo's worker thread (StepMemory's docstring), so a
        # rank's peak may include it in one step and not in the next. Most ranks must match to the byte.
        pairs = list(zip(r["memory"]["per_rank"], r["memory"]["repeated"]))
        assert all(abs(a - b) <= 4 * n for a, b in pairs) and sum(a == b for a, b in pairs) >= 6, (r["name"], pairs)


def test_step_memory_finds_the_same_peak_as_chapter_9s_peak_memory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    optimizer = torch.optim.Adam(model.parameters(), foreach=False)
    x = torch.randn(32, 64)

    def step():
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    step()  # Adam creates its state
    reference = sharding.PeakMemory(model, optimizer)
    with reference:
        step()
    first = layouts.StepMemory(model, optimizer)
    with first:
        step()
    second = layouts.StepMemory(model, optimizer, parts_at=first.peak_op)
    with second:
        step()
    assert first.peak == second.peak == reference.peak_all
    assert sum(size * n for size, n in first.sizes_at_peak.items()) == first.peak  # what the peak is made of
    assert first.sizes_at_peak.get(4 * 256 * 64, 0) >= 2  # among it: fc1's weight and its gradient (256 x 64)
    assert sum(second.parts.values()) == first.peak
    assert second.parts["params"] == 4 * sum(p.numel() for p in model.parameters())


def test_layouts_that_cannot_run_are_refused_with_what_to_change():
    with pytest.raises(ConfigError, match="product pp x dp x cp x tp is 8"):
        layouts.check_layout({"dp": 4, "tp": 4}, 8)
    with pytest.raises(ConfigError, match="zero=0"):
        layouts.check_layout({"dp": 4, "zero": 3, "cp": 2}, 8)
    with pytest.raises(ConfigError, match="zero=3"):
        layouts.check_layout({"dp": 4, "tp": 2}, 8)
    with pytest.raises(ConfigError, match="micro_batches"):
        layouts.check_layout({"dp": 4, "pp": 2, "micro_batches": 1}, 8)
    with pytest.raises(ConfigError, match="micro_batches=1 or pp > 1"):
        layouts.check_layout({"dp": 8, "micro_batches": 2}, 8)
    with pytest.raises(ConfigError, match=r"4 blocks do not split into pp=3 stages .* \(1, 2, 4\)"):
        layouts.check_split(CONFIG, layouts.check_layout({"dp": 2, "pp": 3, "micro_batches": 3}), 6)
    with pytest.raises(ConfigError, match="heads=4 does not divide by tp=8"):  # the planner's own refusal
        layouts.check_split(CONFIG, layouts.check_layout({"tp": 8, "zero": 3}), 8)
    with pytest.raises(ConfigError, match="global_batch=30 does not divide"):
        layouts.check_split(CONFIG, layouts.check_layout({"dp": 4, "zero": 3}), 30)
    layouts.check_split(CONFIG, layouts.check_layout({"dp": 2, "zero": 3, "tp": 2, "pp": 2, "micro_batches": 2}), 32)
    with pytest.raises(ConfigError, match="fields"):
        layouts.check_layout({"dp": 8, "fsdp": 8}, 8)
    assert layouts.name_of({"dp": 2, "zero": 3, "tp": 2, "pp": 2}) == "fsdp 2 x tp 2 x pp 2"


def test_spearman_counts_rank_disagreements():
    assert layouts.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1
    assert layouts.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == -1
    assert layouts.spearman([1, 2, 3], [1, 3, 2]) == 0.5  # 1 - 6 x 2 / (3 x 8)


def test_the_prediction_uses_the_planner_on_the_same_layout():
    cluster = planner.Cluster(8, 1e10, 1e10, 1e-4, 1e-9, 1e-4, 1e-9)
    got = layouts.predict(CONFIG, {"dp": 4, "zero": 3, "tp": 2}, 32, cluster)
    model = planner.ModelShape.from_vit(layouts.vit_of(CONFIG).config)
    layout = planner.Layout(dp=4, zero=3, tp=2)
    assert got["memory"]["total"] == planner.memory_per_rank(model, layout, 32).total
    assert got["time"]["total"] == planner.step_time(model, layout, 32, cluster).total


@pytest.mark.slow
def test_the_planners_inputs_fit_each_kind_of_call_and_price_it():
    inputs = launch(layouts.measure_inputs, 2, kwargs={"sizes": (4096, 65536), "groups": (2,), "matmul": (64, 32, 64),
                                                      "repeats": 2}, echo=False, timeout=120)
    assert set(inputs["kinds"]) == {"all_reduce", "all_gather", "reduce_scatter", "send"}
    assert len(inputs["calls"]) == 4 * 2 and inputs["link"] == inputs["kinds"]["all_reduce"]
    assert [r["sent_bytes"] for r in inputs["calls"] if r["kind"] == "send"] == [4096, 65536]  # all of a send
    assert [r["sent_bytes"] for r in inputs["calls"] if r["kind"] == "all_gather"] == [2048, 32768]  # (g - 1) / g
    cluster = layouts.measured_cluster(inputs, memory_bytes=1e9)
    fit = inputs["kinds"]["send"]
    send = planner.Collective("pp", "send", 3, 3 * 4096.0, 2, 2)
    assert send.seconds(cluster) == pytest.approx(3 * fit["alpha"] + 3 * 4096 * fit["beta"])
    assert {k for k, _, _ in cluster.kind_costs} == set(inputs["kinds"]) and inputs["flops_per_s"] > 0
