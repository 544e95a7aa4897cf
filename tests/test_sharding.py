"""mparlib.sharding and mparlib.sharded_checkpoint: the memory arithmetic, ZeRO-1 and ZeRO-2 from primitives against
DDP and one process, the peak memory per rank of DDP, ZeRO-1, ZeRO-2 and FSDP2, FSDP2 (with gradient accumulation,
explicit forward prefetch, and as HSDP on a 2 x 2 mesh) against one process, the choice of collective names by torch
release, and sharded checkpoints that reshard (2 ranks -> 4 ranks -> 1 process) and survive a killed save.

The ranks run on the CPU with gloo (the workers live in tests/sharding_workers.py). Every comparison is against a
reference computed by PyTorch itself: DistributedDataParallel with the same optimizer, or the same model trained in
this process on the whole batches. Tolerances: in float64 the only differences are the order in which the ranks'
gradients are summed, about 1e-16 relative per step, so 1e-10 leaves a margin of a million and still catches any
real mistake (a missing average, a wrong slice: differences of 1e-3 and more after a few steps). In float32 the
same rounding is about 1e-7 relative; 1e-5 absolute on parameters of size ~0.1 after a few steps of lr 1e-3 to 0.1.
"""
import math
import types

import pytest
import torch
from torch import nn

from mparlib import sharding
from mparlib.sharded_checkpoint import latest_checkpoint, load_sharded, save_sharded
from mparlib.errors import CheckpointError, ConfigError, WorkerFailed
from mparlib.launch import launch
from sharding_workers import (OPTIMIZERS, fsdp_accumulate_and_hsdp, fsdp_load, fsdp_train_and_save, model,
                              save_and_get_killed, zero2_vs_ddp, zero_vs_ddp)


def batches(n, size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 1, 28, 28, generator=g), torch.randint(0, 10, (size,), generator=g)) for _ in range(n)]


def one_process(data, optimizer, dtype, steps_from=None):
    """The reference: the same model trained in this process on the whole batches; its state and losses."""
    cls, options = OPTIMIZERS[optimizer]
    net = model(dtype)
    opt = cls(net.parameters(), **options)
    losses = []
    for X, y in data:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(X.to(dtype)), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return net.state_dict(), losses


def largest_gap(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# ------------------------------------------------------------------------------------------------ arithmetic

def test_bytes_per_parameter_reproduce_the_published_figures():
    # Hugging Face's Ultra-Scale Playbook: 16 bytes per parameter (weights, gradients, Adam, fp32 master weights),
    # 1B 16 GB, 7B 112 GB, 70B 1120 GB; 20 / 140 / 1400 GB with fp32 gradient accumulation.
    for precision in ("fp32", "mixed"):
        assert sum(sharding.bytes_per_parameter(precision, "adam").values()) == 16
    for name, gb, gb_fp32_grads in (("1B", 16, 20), ("7B", 112, 140), ("70B", 1120, 1400)):
        n = sharding.PUBLISHED_SIZES[name]
        assert sum(sharding.zero_bytes_per_rank(n, 1, 0, "mixed").values()) / 1e9 == gb
        assert sum(sharding.zero_bytes_per_rank(n, 1, 0, "mixed_fp32_grads").values()) / 1e9 == gb_fp32_grads


def test_each_zero_stage_shards_one_more_part():
    n, world = 1000, 8
    parts = [sharding.zero_bytes_per_rank(n, world, stage) for stage in range(4)]
    assert parts[0] == {"params": 4000, "grads": 4000, "optimizer": 8000}
    assert parts[1] == {"params": 4000, "grads": 4000, "optimizer": 1000}
    assert parts[2] == {"params": 4000, "grads": 500, "optimizer": 1000}
    assert parts[3] == {"params": 500, "grads": 500, "optimizer": 1000}
    for bad in (dict(stage=4), dict(stage=True), dict(world=0)):
        with pytest.raises(ConfigError):
            sharding.zero_bytes_per_rank(**(dict(n_params=n, world=world, stage=1) | bad))
    with pytest.raises(ConfigError, match="precision='fp8'"):
        sharding.bytes_per_parameter("fp8")


def test_held_bytes_counts_the_tensors_a_plain_model_and_adam_hold():
    net = model()
    opt = torch.optim.Adam(net.parameters())
    n = sum(p.numel() for p in net.parameters())
    assert sharding.held_bytes(net, opt) == {"params": 4 * n, "grads": 0, "optimizer": 0}
    nn.functional.cross_entropy(net(torch.randn(2, 1, 28, 28)), torch.tensor([0, 1])).backward()
    opt.step()
    steps = len(opt.state)  # Adam keeps one scalar "step" tensor per parameter besides its two moments
    assert sharding.held_bytes(net, opt) == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n + 4 * steps}
    base = torch.zeros(10)
    assert sharding.tensor_bytes([base, base[:5], base.view(2, 5)]) == 40  # views of one buffer count once


# ------------------------------------------------------------------------------------------------ ZeRO from primitives

@pytest.mark.slow
@pytest.mark.parametrize("world, optimizer, dtype, tol", [
    (2, "adam", torch.float64, 1e-10),
    (3, "momentum", torch.float32, 1e-5),  # 3 ranks: the flat parameter vector needs padding
])
def test_sharded_optimizer_equals_ddp_and_one_process(world, optimizer, dtype, tol):
    data = batches(4, 6 * world)
    got = launch(zero_vs_ddp, world, args=(data, optimizer, dtype), echo=False, timeout=120)
    reference, _ = one_process(data, optimizer, dtype)
    start = model(dtype).state_dict()
    assert largest_gap(reference, start) > 1e-3  # the steps moved the parameters: the match is not trivial
    assert largest_gap(got["zero"], got["ddp"]) < tol
    assert largest_gap(got["zero"], reference) < tol
    # Each rank holds all parameters in one buffer of N * S elements (S = ceil(P / N)), and for its slice of S
    # elements only the gradient and the optimizer's state.
    size = torch.finfo(dtype).bits // 8
    S, P = got["shard_size"], got["total"]
    assert S == math.ceil(P / world) and S * world - P < world
    states = {"adam": 2, "momentum": 1}[optimizer]
    for held in got["held"]:
        assert held["params"] == world * S * size and held["grads"] == S * size
        assert states * S * size <= held["optimizer"] <= states * S * size + 4  # + Adam's step count (float32)


@pytest.mark.slow
@pytest.mark.parametrize("world, optimizer, micro", [(2, "adam", 1), (4, "adam", 2), (4, "momentum", 1)])
def test_zero2_reduces_gradients_in_the_backward_pass_and_equals_ddp(world, optimizer, micro):
    dtype, bucket = torch.float64, 2**16  # 64 KiB buckets: the 1.1 MB of float64 gradients make many of them
    data = batches(3, 4 * world)
    got = launch(zero2_vs_ddp, world, args=(data, optimizer, dtype, bucket, micro), echo=False, timeout=300)
    reference, _ = one_process(data, optimizer, dtype)
    assert largest_gap(reference, model(dtype).state_dict()) > 1e-3  # the steps moved the parameters
    assert largest_gap(got["zero"], got["ddp"]) < 1e-10
    assert largest_gap(got["zero"], reference) < 1e-10
    # Every bucket was reduce-scattered during the backward pass (once per micro-batch), and no full gradient is
    # left on the parameters when the backward pass ends.
    assert len(got["buckets"]) >= 8 and got["reduced"] == micro * len(got["buckets"])
    assert got["survived"] == []
    # After the step a rank holds its 1/N slice of the gradients plus one bucket's buffer, never the full gradient.
    P = sum(p.numel() for p in model().parameters())
    largest = max(got["buckets"]) * world * 8
    for held in got["held"]:
        assert held["grads"] == sum(got["buckets"]) * 8 + largest
        assert held["grads"] <= 8 * P / world + largest + 8 * world * len(got["buckets"])  # + the padding
        assert held["params"] == sum(got["buckets"]) * world * 8


@pytest.mark.slow
def test_peak_memory_per_rank_orders_ddp_zero1_zero2_fsdp2():
    # The smoke ViT (0.56 MB of float32 parameters), 64 KiB buckets. Counted by PeakMemory after every operator of
    # the measured step: deterministic, so exact inequalities can be asserted. With P the parameter bytes:
    # DDP holds P + P + 2P at the end of the step, ZeRO-1 P + P + 2P/N, ZeRO-2 P + P/N + one bucket + 2P/N,
    # FSDP2 P/N + the gathered blocks + P/N + one unit's gradients + 2P/N.
    got = {n: launch(sharding.peak_memory_worker, n, kwargs=dict(patch=7, bucket_bytes=2**16), echo=False,
                     timeout=300) for n in (1, 2, 4)}
    P = 4 * sum(p.numel() for p in model().parameters())
    peak = {n: {m: r["methods"][m]["peak_bytes_per_rank"] for m in sharding.PEAK_METHODS} for n, r in got.items()}
    for method, value in peak[1].items():  # one rank: nothing is sharded, every method holds 16 bytes per parameter
        assert 4 * P <= value <= 4 * P * 1.1, method
    for n in (2, 4):
        p = peak[n]
        assert p["FSDP2"] < p["ZeRO-2"] < p["ZeRO-1"] < p["DDP"], (n, p)
        assert p["DDP"] >= 4 * P and p["ZeRO-1"] >= 2 * P + 2 * P / n
        # The goal: gradients at most 1/N, plus one bucket (64 KiB, or the largest parameter, 64 KiB too), plus the
        # one parameter's gradient autograd has just produced, plus the padding of the buckets' slices.
        largest = 4 * max(p.numel() for p in model().parameters())
        for rank in got[n]["methods"]["ZeRO-2"]["per_rank"]:
            assert rank["parts"]["grads"] <= P / n + max(2**16, largest) + largest + 4 * n * 64
    assert peak[4]["ZeRO-2"] < peak[2]["ZeRO-2"] and peak[4]["FSDP2"] < peak[2]["FSDP2"]
    # The peak is not what is left after the step: ZeRO-2's gradient buffer and FSDP2's gathered blocks are gone.
    for n in (2, 4):
        fsdp = got[n]["methods"]["FSDP2"]["per_rank"][0]
        assert sum(fsdp["after"].values()) < fsdp["peak"]


@pytest.mark.slow
def test_fsdp2_accumulation_prefetch_and_hsdp_equal_one_process():
    dtype = torch.float64
    data = batches(3, 16)
    got = launch(fsdp_accumulate_and_hsdp, 4, args=(data, dtype, 2), echo=False, timeout=300)
    reference, _ = one_process(data, "adam", dtype)
    assert largest_gap(reference, model(dtype).state_dict()) > 1e-3
    assert largest_gap(got["accumulate"], reference) < 1e-10
    assert largest_gap(got["hsdp"], reference) < 1e-10
    # Accumulation: both micro-batches gather the parameters, only the last one reduce-scatters (5 units).
    assert got["accumulate_collectives"]["reduce_scatter"]["calls"] == 5
    assert got["accumulate_collectives"]["all_gather"]["calls"] == 2 * (5 + 4)
    # HSDP on (replicate 2, shard 2): gathered and reduce-scattered within a pair, then all-reduced across pairs.
    assert got["placements"] == ["R", "S(0)"]  # Replicate() across the pairs, Shard(0) within
    c = got["hsdp_collectives"]
    assert c["all_gather"]["calls"] == 5 + 4 and c["reduce_scatter"]["calls"] == 5 and c["all_reduce"]["calls"] == 5
    # Explicit forward prefetch: block i + 1 is gathered before block i computes.
    def gathers_before(order, i):
        return order[:order.index(f"forward {i}")].count("all_gather")

    for i in range(3):
        assert gathers_before(got["order_prefetch"], i) == i + 3  # the root, blocks 0..i and block i + 1
        assert gathers_before(got["order_plain"], i) == i + 2  # the root and blocks 0..i


def test_tensor_collectives_take_the_new_names_and_fall_back_to_the_old():
    new_rs, new_ag, old_rs, old_ag = (lambda *a, **k: None for _ in range(4))  # four distinct functions
    both = types.SimpleNamespace(reduce_scatter_single=new_rs, all_gather_single=new_ag,
                                 reduce_scatter_tensor=old_rs, all_gather_into_tensor=old_ag)
    assert sharding.tensor_collectives(both) == (new_rs, new_ag)
    before_2_13 = types.SimpleNamespace(reduce_scatter_tensor=old_rs, all_gather_into_tensor=old_ag)
    assert sharding.tensor_collectives(before_2_13) == (old_rs, old_ag)
    with pytest.raises(ConfigError, match="torch 2.6 or newer"):
        sharding.tensor_collectives(types.SimpleNamespace(reduce_scatter_tensor=old_rs))
    import torch.distributed as dist
    expected = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    assert sharding.tensor_collectives()[0] is getattr(dist, expected)


# ------------------------------------------------------------------------------------------------ FSDP2 and checkpoints

@pytest.mark.slow
def test_fsdp_equals_one_process_and_its_checkpoint_reshards_from_2_to_4_ranks_and_to_1(tmp_path):
    dtype = torch.float64
    data = batches(10, 8)
    saved = launch(fsdp_train_and_save, 2, args=(data, tmp_path, dtype), echo=False, timeout=120)
    reference, losses = one_process(data, "adam", dtype)
    assert len(saved["losses"]) == 10 and largest_gap(reference, model(dtype).state_dict()) > 1e-3
    assert max(abs(a - b) for a, b in zip(saved["losses"], losses)) < 1e-10
    assert largest_gap(saved["model"], reference) < 1e-10

    # Each rank holds about half. FSDP2 pads every parameter's first dimension to a multiple of the world size, so
    # the parameters and gradients of every rank fill the same padded storage; Adam's state follows the unpadded
    # shards, and the ranks' states add up to exactly the whole state (+ one step count per parameter and rank).
    n, tensors = sum(p.numel() for p in model().parameters()), len(list(model().parameters()))
    for held in saved["held"]:
        assert 8 * n / 2 <= held["params"] <= 1.05 * 8 * n / 2
        assert 8 * n / 2 <= held["grads"] <= 1.05 * 8 * n / 2
        assert held["optimizer"] <= 1.05 * 16 * n / 2
    assert sum(h["optimizer"] for h in saved["held"]) == 16 * n + 2 * 4 * tensors  # the step counts are float32
    # One all-gather per FSDP unit in the forward, again for the 4 resharded blocks in the backward; one
    # reduce-scatter per unit.
    units = 4 + 1
    assert saved["collectives"]["all_gather"]["calls"] == units + 4
    assert saved["collectives"]["reduce_scatter"]["calls"] == units
    assert saved["collectives"]["reduce_scatter"]["bytes"] >= 8 * n  # every gradient element reduced once

    loaded = launch(fsdp_load, 4, args=(tmp_path, dtype), echo=False, timeout=120)
    assert loaded["folder"] == saved["folder"]
    assert largest_gap(loaded["model"], saved["model"]) == 0
    assert saved["optim"]["state"].keys() == loaded["optim"]["state"].keys()
    for name, state in saved["optim"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[k], loaded["optim"]["state"][name][k]), (name, k)

    single = model(dtype, seed=3)  # one process, no process group: DCP reads every shard it needs
    state = {"model": single.state_dict()}
    load_sharded(state, tmp_path)
    single.load_state_dict(state["model"])
    assert largest_gap(single.state_dict(), saved["model"]) == 0


@pytest.mark.slow
def test_a_killed_save_leaves_the_previous_checkpoint_and_is_never_loaded(tmp_path):
    dtype = torch.float32
    saved = launch(fsdp_train_and_save, 2, args=(batches(2, 4), tmp_path, dtype), echo=False, timeout=120)
    with pytest.raises(WorkerFailed, match="^rank 1 was killed by signal SIGKILL"):
        launch(save_and_get_killed, 2, args=(tmp_path, 3, 1, dtype), echo=False, timeout=60)
    partial = tmp_path / ".step-00000003.partial"
    assert partial.is_dir() and any(partial.iterdir())  # shards were written...
    assert not (partial / ".metadata").exists() and not (tmp_path / "step-00000003").exists()  # ...not finished
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000002"

    single = model(dtype, seed=3)
    state = {"model": single.state_dict()}
    assert load_sharded(state, tmp_path) == tmp_path / "step-00000002"
    assert largest_gap(state["model"], saved["model"]) == 0
    with pytest.raises(CheckpointError, match=r"not a complete checkpoint.*last complete one is .*step-00000002"):
        load_sharded(state, partial)

    # The next save of the same step clears what the killed one left and completes (here from one process, which
    # DCP allows without a process group); a complete checkpoint is never overwritten.
    save_sharded({"model": single.state_dict()}, tmp_path, step=3)
    assert not partial.exists() and latest_checkpoint(tmp_path) == tmp_path / "step-00000003"
    with pytest.raises(CheckpointError, match="exists already"):
        save_sharded({"model": single.state_dict()}, tmp_path, step=3)


def test_a_folder_that_is_not_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        latest_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        load_sharded({}, tmp_path / "missing")
    (tmp_path / "step-00000001").mkdir()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_sharded({}, tmp_path / "step-00000001")


@pytest.mark.slow
def test_fsdp_memory_worker_times_steps_after_counting_the_bytes():
    from mparlib.vit import vit

    got = launch(sharding.fsdp_memory_worker, 2, kwargs=dict(size="smoke", batch=2, steps=1, min_repeats=3,
                                                             min_seconds=0.0), echo=False, timeout=300)
    t = got["step_s"]
    assert t["repeats"] == len(t["times"]) >= 3 and t["min"] <= t["q1"] <= t["median"] <= t["q3"] <= t["max"]
    assert sorted(t["times"])[0] == t["min"] and sum(t["times"]) == pytest.approx(t["total"])
    torch.manual_seed(0)  # the reference: the same ViT in one process after one Adam step
    net = vit("smoke")
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    nn.functional.cross_entropy(net(torch.randn(2, 1, 28, 28)), torch.randint(0, 10, (2,))).backward()
    optimizer.step()
    single = sharding.held_bytes(net, optimizer)
    for part in ("params", "grads", "optimizer"):  # the timed steps came after the count: half per rank (+ padding)
        assert single[part] / 2 <= got["bytes_per_rank"][part] <= 1.15 * single[part] / 2, part
