"""mparlib.sharding and mparlib.sharded_checkpoint: the memory arithmetic, ZeRO from primitives against DDP and one
process, FSDP2 against one process, and sharded checkpoints that reshard (2 ranks -> 4 ranks -> 1 process) and
survive a killed save.

The ranks run on the CPU with gloo (the workers live in tests/sharding_workers.py). Every comparison is against a
reference computed by PyTorch itself: DistributedDataParallel with the same optimizer, or the same model trained in
this process on the whole batches. Tolerances: in float64 the only differences are the order in which the ranks'
gradients are summed, about 1e-16 relative per step, so 1e-10 leaves a margin of a million and still catches any
real mistake (a missing average, a wrong slice: differences of 1e-3 and more after a few steps). In float32 the
same rounding is about 1e-7 relative; 1e-5 absolute on parameters of size ~0.1 after a few steps of lr 1e-3 to 0.1.
"""
import math

import pytest
import torch
from torch import nn

from mparlib import sharding
from mparlib.sharded_checkpoint import latest_checkpoint, load_sharded, save_sharded
from mparlib.errors import CheckpointError, ConfigError, WorkerFailed
from mparlib.launch import launch
from sharding_workers import (OPTIMIZERS, fsdp_load, fsdp_train_and_save, model, save_and_get_killed,
                              zero_vs_ddp)


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


# ------------------------------------------------------------------------------------------------ FSDP2 and checkpoints

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
