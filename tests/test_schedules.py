"""Pipeline schedules beyond 1F1B (mparlib.schedules): placement, bubble helpers, and real runs on 2 and 4 gloo ranks.

The runs compare every parameter's gradient with one process on the same batch (float64), and the order in which
each rank really ran its passes with the order that simulate_schedule replays, so that the simulated bubbles and
in-flight counts of chapter 12 describe what torch does.
"""
import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from matplotlib.figure import Figure

from mparlib import schedules as pp
from mparlib.diagrams import draw_timeline
from mparlib.errors import ConfigError, WorkerFailed
from mparlib.launch import launch

NEW = ("1f1b", "interleaved1f1b", "interleavedzb", "zbv", "dualpipev")


@pytest.fixture(scope="module", params=[2, 4])
def runs(request):
    """One launch per world size: every schedule, m = 2p (DualPipeV's least), tiny stages, one timed step."""
    p = request.param
    result = launch(pp.measure_schedules, p, kwargs=dict(schedules=NEW, micro_batches=(2 * p,), width=16, layers=8,
                                                         micro_batch_size=2, steps=1, warmup=0),
                    echo=False, timeout=240)
    return p, result


@pytest.mark.slow
def test_every_schedule_gives_one_process_gradients(runs):
    p, result = runs
    assert sorted(result) == sorted(NEW)
    for name, by_m in result.items():
        entry = by_m[2 * p]
        assert entry["parity"] <= 1e-12, (name, p, entry["parity"])


@pytest.mark.slow
def test_each_rank_ran_the_order_that_is_simulated(runs):
    p, result = runs
    for name, by_m in result.items():
        notes = by_m[2 * p]["notes"]
        simulated = pp.simulate_schedule(name, p, 2 * p)
        assert [[(k, i, s) for k, i, _, _, s in rank] for rank in notes] == \
               [[(k, i, s) for k, i, _, _, s in rank] for rank in simulated], (name, p)
        assert by_m[2 * p]["in_flight"] == [{"I": pp.in_flight(n, "I"), "W": pp.in_flight(n, "W")} for n in simulated]


@pytest.mark.slow
def test_every_stage_runs_each_pass_once_per_micro_batch(runs):
    p, result = runs
    m = 2 * p
    for name, by_m in result.items():
        notes = by_m[m]["notes"]
        held = sorted(s for rank in notes for s in {n[4] for n in rank})
        v = 1 if name == "1f1b" else 2
        assert held == list(range(v * p))
        for r, rank in enumerate(notes):
            assert {n[4] for n in rank} == set(pp.stage_indices(name, r, p))
            for stage in set(n[4] for n in rank):
                count = {k: sum(1 for n in rank if n[4] == stage and n[0] == k) for k in "FBIW"}
                assert count["F"] == m and count["B"] + count["I"] == m and count["B"] + count["W"] == m, (name, count)
        split = any(n[0] in "IW" for rank in notes for n in rank)
        assert split == (name in ("interleavedzb", "zbv", "dualpipev")), name


def test_bubble_fraction_merges_the_stages_of_a_rank():
    # rank 0 holds stages 0 and 2, rank 1 holds stage 1; the step lasts from 0 to 10 (rank 1's last end).
    rank0 = [[("F", 0, 0.0, 2.0), ("B", 0, 7.0, 9.0)], [("F", 0, 4.0, 5.0), ("B", 0, 5.0, 6.0)]]  # busy 2+2+1+1 = 6
    rank1 = [("F", 0, 2.0, 4.0), ("B", 0, 6.0, 7.0), ("W", 0, 9.0, 10.0)]  # busy 2+1+1 = 4
    assert pp.bubble_fraction([rank0, rank1]) == pytest.approx(1 - (6 + 4) / (2 * 10))
    merged = sorted([(*n, s) for s, stage in zip((0, 2), rank0) for n in stage], key=lambda n: n[2])
    assert pp.bubble_fraction([merged, rank1]) == pytest.approx(0.5)
    overlapping = [("F", 0, 0.0, 6.0), ("F", 1, 4.0, 10.0)]  # one rank cannot be busier than the step
    assert pp.bubble_fraction([overlapping]) == pytest.approx(0.0)


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (3, 6), (4, 4), (4, 8), (4, 12)])
def test_interleaved_formula_is_the_simulated_schedule(p, m):
    notes = pp.simulate_schedule("interleaved1f1b", p, m)
    assert pp.bubble_fraction(notes) == pytest.approx(pp.bubble_formula(p, m, schedule="interleaved1f1b",
                                                                        stages_per_rank=2))
    assert pp.bubble_fraction(pp.simulate_schedule("1f1b", p, m)) == pytest.approx(pp.bubble_formula(p, m))


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_zbv_formula_is_the_simulated_schedule_under_equal_passes(p):
    for m in range(1, 2 * p + 3):
        notes = pp.simulate_schedule("zbv", p, m)
        assert pp.bubble_fraction(notes) == pytest.approx(pp.bubble_formula(p, m, schedule="zbv", stages_per_rank=2))
    busy = [sum(e - s for _, _, s, e, _ in rank) for rank in pp.simulate_schedule("zbv", p, 2 * p)]
    assert busy == [6 * 2 * p] * p  # two stages x three passes x m


def test_unequal_passes_leave_a_bubble_that_the_equal_formula_misses():
    equal = pp.bubble_fraction(pp.simulate_schedule("zbv", 4, 8, (1.0, 1.0, 1.0)))
    slow_input_grad = pp.bubble_fraction(pp.simulate_schedule("zbv", 4, 8, (1.0, 2.0, 1.0)))
    assert equal == pytest.approx(pp.bubble_formula(4, 8, schedule="zbv", stages_per_rank=2))
    assert slow_input_grad > equal


def test_stage_placement():
    assert [pp.stage_indices("1f1b", r, 4) for r in range(4)] == [(0,), (1,), (2,), (3,)]
    assert [pp.stage_indices("interleaved1f1b", r, 4) for r in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert pp.stage_indices("interleavedzb", 1, 2, stages_per_rank=3) == (1, 3, 5)
    assert [pp.stage_indices("zbv", r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert pp.stage_indices("dualpipev", 0, 2) == (0, 3)
    for name in ("interleaved1f1b", "zbv", "dualpipev"):
        for world in (2, 3, 4):
            every = sorted(s for r in range(world) for s in pp.stage_indices(name, r, world))
            assert every == list(range(2 * world))


def test_in_flight_counts_pairs_until_their_backward():
    notes = [("F", 0, 0, 1, 0), ("F", 1, 1, 2, 0), ("F", 0, 2, 3, 3), ("I", 0, 3, 4, 3), ("F", 2, 4, 5, 0),
             ("W", 0, 5, 6, 3), ("B", 0, 6, 7, 0)]
    assert pp.in_flight(notes, "I") == 3  # (0,0), (0,1), (3,0); then (3,0) goes at its I, (0,2) arrives
    assert pp.in_flight(notes, "W") == 4  # (3,0) is held until its W
    assert pp.in_flight([("F", 0, 0, 1), ("F", 1, 1, 2), ("B", 0, 2, 3), ("F", 2, 3, 4)]) == 2


def test_saved_bytes_are_each_layer_input_and_the_last_output():
    rows, width, layers = 3, 8, 2
    module = pp.uniform_stage(width, layers).double()
    # Linear keeps its input, tanh its output; each tanh output is the next Linear's input, stored once
    assert pp.saved_bytes(module, rows, width) == (layers + 1) * rows * width * 8
    assert pp.saved_bytes(module.float(), rows, width, torch.float32) == (layers + 1) * rows * width * 4


def test_bad_inputs_get_clear_errors():
    with pytest.raises(ConfigError, match="at least 4 micro-batches"):
        pp.check_micro_batches("1f1b", 4, 3)
    with pytest.raises(ConfigError, match="at least 8 micro-batches"):
        pp.check_micro_batches("dualpipev", 4, 6)
    with pytest.raises(ConfigError, match="rounds of 2"):
        pp.check_micro_batches("interleaved1f1b", 2, 5)
    assert pp.check_micro_batches("interleaved1f1b", 4, 6) == 6  # one round of 6
    with pytest.raises(ConfigError, match="cannot place 3"):
        pp.stage_indices("zbv", 0, 2, stages_per_rank=3)
    with pytest.raises(ConfigError, match="cannot place 1"):
        pp.stage_indices("interleaved1f1b", 0, 2, stages_per_rank=1)
    with pytest.raises(ConfigError, match="rank=2"):
        pp.stage_indices("zbv", 2, 2)
    with pytest.raises(ConfigError, match="schedule='zb1p'"):
        pp.schedule_class("zb1p")
    with pytest.raises(ConfigError, match="t_b"):
        pp.simulate_schedule("zbv", 2, 4, (1.0, -1.0, 1.0))
    with pytest.raises(ConfigError, match="layers=7"):
        pp.measure_schedules(layers=7)
    with pytest.raises(ConfigError, match="worker"):
        pp.measure_schedules(layers=8)


def test_the_torch_classes_are_the_ones_named():
    from torch.distributed import pipelining

    assert pp.schedule_class("zbv") is pipelining.ScheduleZBVZeroBubble
    assert pp.schedule_class("interleaved1f1b") is pipelining.ScheduleInterleaved1F1B
    assert pp.schedule_class("dualpipev") is pipelining.ScheduleDualPipeV


def test_timeline_draws_two_stages_per_rank_in_one_row():
    notes = pp.simulate_schedule("zbv", 2, 4)
    fig = Figure()
    ax = fig.add_subplot()
    draw_timeline(ax, notes, unit=1)
    assert len(ax.get_yticks()) == 2
    labels = [t.get_text() for t in ax.texts]
    assert labels.count("0'") == 3 * 2  # F, I and W of micro-batch 0 on the second stage of each rank
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(legend) == 4 and "forward" in legend[0]  # F, I, W and the prime


def test_a_schedule_this_torch_lacks_is_named_with_the_release(monkeypatch):
    from torch.distributed import pipelining

    monkeypatch.delattr(pipelining, "ScheduleDualPipeV")  # as on torch 2.7 and 2.8
    with pytest.raises(ConfigError, match=r"'dualpipev' \(ScheduleDualPipeV\) is not in torch .*2\.9"):
        pp.schedule_class("dualpipev")


def test_simulate_schedule_names_the_release_it_needs(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.distributed.pipelining._schedule_visualizer", None)  # as on torch 2.7
    with pytest.raises(ConfigError, match=r"came with 2\.8"):
        pp.simulate_schedule("zbv", 2, 4)


@pytest.mark.slow
@pytest.mark.parametrize("p", [2, 4])
def test_opening_the_links_of_the_v_placement_sends_nothing_to_the_same_rank(p):
    """torch 2.11 opens the links of every neighbouring stage, the middle rank's own pair included, and gloo cannot
    send from a rank to itself; without_self_messages leaves those messages out, so ZBV and DualPipeV run there too."""
    import schedule_workers

    every = launch(schedule_workers.open_links_of_the_v_placement, p, echo=False, timeout=120)
    to_self = [r["to_self"] for r in every]
    assert to_self[p - 1] == 4 and sum(to_self) == 4, to_self  # stages p-1 and p: two messages each way
    assert all(r["sent"] > 0 for r in every)
    with pytest.raises(WorkerFailed, match="Pair is not connected"):
        launch(schedule_workers.open_links_of_the_v_placement, p, kwargs={"filtered": False}, echo=False, timeout=120)
