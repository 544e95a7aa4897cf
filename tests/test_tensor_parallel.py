"""Tensor parallelism from primitives (mparlib.tensor_parallel) and pipelines across processes (mparlib.schedules).

Every claim is checked against the unsplit computation on the same inputs: a split MLP or attention block against
the full block in one process (outputs, the input's gradient, every parameter's gradient gathered from the ranks,
float64, tolerance 1e-12), and a pipeline of 2 or 4 ranks against the same stages run one after another in one
process (losses and parameters after SGD steps, float64). The workers are in this module, which the spawned ranks
import; each test starts its processes once (gloo on the CPU, one thread per process).
"""
import copy

import pytest
import torch
import torch.distributed as dist
from matplotlib.figure import Figure
from torch import nn
from torch.nn import functional as F

from mparlib import schedules as pp
from mparlib import tensor_parallel as tp
from mparlib.diagrams import draw_timeline
from mparlib.errors import ConfigError, LaunchError
from mparlib.hybrid import pipeline_schedule
from mparlib.launch import launch
from mparlib.vit import MLP, Attention

TIGHT = dict(rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------- workers

def _all_reduces(mode):
    return sum(k for op, k in mode.get_comm_counts().items() if "all_reduce" in str(op) or "allreduce" in str(op))


def _blocks(seed=0):
    """Full blocks of several shapes, the same on every rank; biases on and off."""
    torch.manual_seed(seed)
    no_bias = MLP(16, 24)
    no_bias.fc1, no_bias.fc2 = nn.Linear(16, 24, bias=False), nn.Linear(24, 16, bias=False)
    return {"mlp": MLP(16, 32), "mlp-no-bias": no_bias, "mlp-2d-input": MLP(8, 16),
            "attention": Attention(16, 4), "attention-8-heads": Attention(32, 8)}


def split_block_diffs(seed=0):
    """Worker: every block split and unsplit; the largest difference of each compared quantity, counts, errors."""
    from torch.distributed.tensor.debug import CommDebugMode

    torch.manual_seed(seed + 1)  # the inputs: the same on every rank
    report = {}
    for name, full in _blocks(seed).items():
        full = full.double()
        dim = full.fc1.in_features if hasattr(full, "fc1") else full.q.in_features
        shape = (6, dim) if name == "mlp-2d-input" else (3, 5, dim)
        x, w = torch.randn(*shape, dtype=torch.float64), torch.randn(*shape, dtype=torch.float64)
        x_full = x.clone().requires_grad_()
        y_full = full(x_full)
        (y_full * w).sum().backward()
        part = tp.split_attention(full) if name.startswith("attention") else tp.split_mlp(full)
        x_part = x.clone().requires_grad_()
        with CommDebugMode() as mode:
            y = part(x_part)
            forward = _all_reduces(mode)
            (y * w).sum().backward()
            backward = _all_reduces(mode) - forward
        grads, params = tp.gather_full(part, grads=True), tp.gather_full(part)
        report[name] = {
            "output": (y - y_full).abs().max().item(),
            "input grad": (x_part.grad - x_full.grad).abs().max().item(),
            "grads": {n: (grads[n] - p.grad).abs().max().item() for n, p in full.named_parameters()},
            "params": {n: torch.equal(params[n], p.detach()) for n, p in full.named_parameters()},
            "names": sorted(grads) == sorted(n for n, _ in full.named_parameters()),
            "counted": {"forward": forward, "backward": backward},
            "expected": tp.expected_all_reduces(part),
            "local": sum(p.numel() for p in part.parameters()),
            "heads": getattr(part, "heads", None),
            "full_untouched": all(p.grad is not None for p in full.parameters()),
        }
    errors = {}
    try:
        tp.split_mlp(MLP(16, 30))  # 30 hidden features do not divide by 4 (nor by 2? they do: checked by the test)
    except ConfigError as e:
        errors["uneven"] = str(e)
    try:
        tp.split_attention(Attention(12, 6))  # 6 heads on 4 ranks
    except ConfigError as e:
        errors["heads"] = str(e)
    try:
        tp.gather_full(tp.split_mlp(MLP(16, 32)), grads=True)  # no backward pass yet
    except ConfigError as e:
        errors["no grad"] = str(e)
    report["errors"] = errors
    return report


def _stages(seed, num_stages, width, layers):
    """The stages of a pipeline, each built from its own seed: what every rank and the reference build alike."""
    stages = []
    for s in range(num_stages):
        torch.manual_seed(seed + s)
        stages.append(pp.uniform_stage(width, layers).double())
    return stages


def pipeline_training(schedule, micro_batches, steps=3, width=16, layers=2, batch=24, lr=0.1, seed=0):
    """Worker: SGD steps of a pipeline of uniform stages; the losses, every rank's parameters, the order of work."""
    from torch.distributed.pipelining import PipelineStage

    rank, world = dist.get_rank(), dist.get_world_size()
    module = _stages(seed, world, width, layers)[rank]
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    timer = pp.StageTimes(stage)
    runner = pp.schedule_class(schedule)(stage, n_microbatches=micro_batches, loss_fn=F.mse_loss)
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 100)
    losses = []
    for _ in range(steps):
        x = torch.randn(batch, width, generator=gen, dtype=torch.float64)
        y = torch.randn(batch, width, generator=gen, dtype=torch.float64)
        timer.clear()
        micro = []
        optimizer.zero_grad()
        if stage.is_first:
            runner.step(x)
        elif stage.is_last:
            runner.step(target=y, losses=micro)
        else:
            runner.step()
        optimizer.step()
        if stage.is_last:
            losses.append(torch.stack(micro).mean().item())
    box = [losses]
    dist.broadcast_object_list(box, src=world - 1)
    every = [None] * world
    dist.all_gather_object(every, ({n: p.detach().clone() for n, p in module.named_parameters()},
                                   [(k, i) for k, i, _, _ in timer.records], timer.records))
    return {"losses": box[0], "params": [e[0] for e in every], "orders": [e[1] for e in every],
            "records": [e[2] for e in every]}


def both_schedules(micro_batches):
    """Worker: the two schedules in one launch, and a tiny bubble measurement."""
    result = {name: pipeline_training(name, micro_batches) for name in ("gpipe", "1f1b")}
    result["bubble"] = pp.measure_bubble(micro_batches=(1, micro_batches), width=32, layers=1, micro_batch_size=4,
                                         steps=1, warmup=1)
    return result


# ------------------------------------------------------------------------------------------- references

def one_process_training(num_stages, steps=3, width=16, layers=2, batch=24, lr=0.1, seed=0):
    """The pipeline's stages run one after another in this process, on the whole batch."""
    stages = _stages(seed, num_stages, width, layers)
    model = nn.Sequential(*stages)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 100)
    losses = []
    for _ in range(steps):
        x = torch.randn(batch, width, generator=gen, dtype=torch.float64)
        y = torch.randn(batch, width, generator=gen, dtype=torch.float64)
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [{n: p.detach() for n, p in s.named_parameters()} for s in stages]


def expected_order(schedule, r, p, m):
    """The order of work on rank r of p: GPipe all forwards then all backwards; 1F1B fill, alternate, drain."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(m, p - r)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("B", i), ("F", warm + i)]
    return order + [("B", i) for i in range(m - warm, m)]


# ---------------------------------------------------------------------------------------------- tests

@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_split_blocks_compute_what_the_unsplit_blocks_compute(nproc):
    report = launch(split_block_diffs, nproc, echo=False, timeout=120)
    errors = report.pop("errors")
    for name, r in report.items():
        assert r["output"] < 1e-12 and r["input grad"] < 1e-12, (name, r)
        assert r["names"] and all(d < 1e-12 for d in r["grads"].values()), (name, r["grads"])
        assert all(r["params"].values()), "gathering the shards gives the full parameters back exactly"
        assert r["full_untouched"]
        assert r["counted"] == r["expected"], name  # the operators predict the messages, and only those happen
    assert report["mlp"]["expected"] == {"forward": 1, "backward": 1}
    assert report["attention"]["expected"] == {"forward": 1, "backward": 3}
    assert report["attention"]["heads"] == 4 // nproc and report["attention-8-heads"]["heads"] == 8 // nproc
    # each rank holds 1/n of the split weights: fc1 (32 x 16 + 32) and fc2's weight (16 x 32); fc2's bias is whole
    assert report["mlp"]["local"] == (32 * 16 + 32 + 16 * 32) // nproc + 16
    assert "no gradient yet" in errors["no grad"]
    if nproc == 4:
        assert "30 does not divide by the 4 ranks" in errors["uneven"]
        assert "6 heads do not divide by 4 ranks" in errors["heads"]
    else:
        assert "uneven" not in errors and "heads" not in errors  # 30 and 6 divide by 2


def test_the_operators_refuse_to_work_outside_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(LaunchError, match="in none"):
        tp.ColumnParallelLinear(nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="fc1, fc2"):
        tp.split_mlp(nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="lacks q, k, v, out"):
        tp.split_attention(MLP(4, 8))


@pytest.mark.slow
@pytest.mark.parametrize("nproc, micro_batches", [(2, 4), (4, 4)])
def test_pipelines_train_exactly_like_one_process(nproc, micro_batches):
    ref_losses, ref_params = one_process_training(nproc)
    result = launch(both_schedules, nproc, args=(micro_batches,), echo=False, timeout=300)
    for schedule in ("gpipe", "1f1b"):
        r = result[schedule]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), **TIGHT)
        for got, want in zip(r["params"], ref_params, strict=True):
            assert sorted(got) == sorted(want)
            for n in want:
                torch.testing.assert_close(got[n], want[n], **TIGHT)
        for rank, order in enumerate(r["orders"]):
            assert order == expected_order(schedule, rank, nproc, micro_batches), (schedule, rank)
        for notes in r["records"]:
            assert all(start <= end for _, _, start, end in notes)
        assert 0 < pp.bubble_fraction(r["records"]) < 1
    bubble = result["bubble"]
    assert sorted(bubble["gpipe"]) == [1, micro_batches] and sorted(bubble["1f1b"]) == [micro_batches]
    for schedule, rows in bubble.items():
        for m, row in rows.items():
            assert row["formula"] == pytest.approx((nproc - 1) / (m + nproc - 1))
            assert 0 < row["measured"] < 1 and len(row["records"]) == nproc
            for rank, notes in enumerate(row["records"]):
                assert [(k, i) for k, i, _, _ in notes] == expected_order(schedule, rank, nproc, m)


@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (4, 8), (3, 5)])
def test_bubble_fraction_of_an_ideal_schedule_is_the_formula(p, m):
    """GPipe with forward 1 and backward 2 time units on every stage: the idle share is exactly (p-1)/(m+p-1)."""
    f, b = 1.0, 2.0
    notes = [[] for _ in range(p)]
    for t, s, i in pipeline_schedule(p, m):  # forward: stage s works on micro-batch i at tick t = s + i
        notes[s].append(("F", i, t * f, (t + 1) * f))
    end_f = (m + p - 1) * f
    for s in range(p):  # backward: the last stage first, micro-batch i at stage s starts at tick (p-1-s) + i
        for i in range(m):
            t = (p - 1 - s) + i
            notes[s].append(("B", i, end_f + t * b, end_f + (t + 1) * b))
    assert pp.bubble_fraction(notes) == pytest.approx(pp.bubble_formula(p, m))
    ax = Figure().add_subplot()
    draw_timeline(ax, notes, unit=1)
    assert len(ax.collections) == len(ax.texts) == 2 * p * m  # a numbered bar per forward and backward
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward", "backward"]


def test_bubble_helpers_refuse_bad_input():
    with pytest.raises(ConfigError, match="num_stages=0"):
        pp.bubble_formula(0, 4)
    with pytest.raises(ConfigError, match="every rank"):
        pp.bubble_fraction([[("F", 0, 0.0, 1.0)], []])
    with pytest.raises(ConfigError, match="schedule='zb'"):
        pp.schedule_class("zb")


def test_stage_times_wraps_only_the_calls_it_times():
    class FakeStage:
        def forward_one_chunk(self, i, *args, **kwargs):
            return ("out", i, args, kwargs)

        def backward_one_chunk(self, i, loss=None, full_backward=True, last_backward=False):
            return ("grad", i, loss, last_backward)

    stage = FakeStage()
    timer = pp.StageTimes(stage)
    assert stage.forward_one_chunk(0, "x", save_forward_output=False) == ("out", 0, ("x",), {"save_forward_output": False})
    assert stage.backward_one_chunk(0, loss=1.5, last_backward=True) == ("grad", 0, 1.5, True)
    assert [(k, i) for k, i, _, _ in timer.records] == [("F", 0), ("B", 0)]
    timer.clear()
    assert timer.records == []
    module = copy.deepcopy(pp.uniform_stage(8, 3))
    assert [type(m) for m in module] == [nn.Linear, nn.Tanh] * 3


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 4, 3)])
def test_interleaved_bubble_is_the_idle_time_of_v_times_smaller_stages(p, m, v):
    """Idle (p-1)/v of a micro-batch's work against m busy: the share is (p-1)/(vm+p-1), and idle/busy is (p-1)/(vm)."""
    share = pp.bubble_formula(p, m, schedule="interleaved1f1b", stages_per_rank=v)
    assert share == pytest.approx(((p - 1) / v) / ((p - 1) / v + m))
    assert share / (1 - share) == pytest.approx((p - 1) / (v * m))
    assert share < pp.bubble_formula(p, m, schedule="1f1b")
    assert pp.bubble_formula(p, m, schedule="interleaved1f1b") == pp.bubble_formula(p, m)  # v = 1 is plain 1F1B
    assert 0 < pp.bubble_formula(p, m, schedule="zbv") < pp.bubble_formula(p, m, schedule="1f1b")  # tests/test_schedules.py


def test_bubble_formula_refuses_a_placement_the_schedule_does_not_have():
    with pytest.raises(ConfigError, match="stages_per_rank=2"):
        pp.bubble_formula(4, 8, schedule="1f1b", stages_per_rank=2)
    with pytest.raises(ConfigError, match="stages_per_rank=3"):
        pp.bubble_formula(4, 8, schedule="zbv", stages_per_rank=3)
    with pytest.raises(ConfigError, match="schedule='dualpipe'"):
        pp.bubble_formula(4, 8, schedule="dualpipe")
