"""Sequence parallelism (mparlib.sequence_parallel) against the unsplit block, by hand and with PyTorch's plan.

An ``mparlib.vit.Block`` split along the sequence (norms on this rank's tokens, attention and MLP tensor-parallel in
between) must give the unsplit block's output, input gradient and every parameter's gradient (float64, 1e-12), on 2
and 4 processes; the collectives counted by ``CommDebugMode`` must be the predicted all-gathers and reduce-scatters,
and no all-reduce inside the block. The bytes saved for backward must be what the shapes predict.
"""
import pytest
import torch
import torch.distributed as dist

from mparlib import sequence_parallel as sp
from mparlib.errors import ConfigError, LaunchError
from mparlib.launch import launch
from mparlib.vit import Block, MLP
from sequence_workers import all_checks


def predicted_saved(world, mode, batch=4, tokens=16, dim=32, hidden=64, heads=4, size=8):
    """Bytes a block saves for backward per rank (the sizes of sequence_workers.saved_bytes), from its shapes.

    Split by heads or hidden features under tensor parallelism: q, k, v and the attention output, which the output
    projection saves again as a view of the same storage (4 x BTd), GELU's input and fc2's input (2 x BTh), attention's log-sum-exp (B heads T). Whole under tensor
    parallelism: the inputs of the two norms and their outputs (4 x BTd), the norms' means and inverse deviations
    (4 x BT). Sequence parallelism cuts the norms' inputs and statistics by the ranks; their gathered outputs stay
    whole (the column-parallel layers save them).
    """
    btd, bth, bt, bht = (batch * tokens * dim, batch * tokens * hidden, batch * tokens, batch * heads * tokens)
    split = (4 * btd + 2 * bth + bht) / world
    if mode == "full":
        return size * (4 * btd + 2 * bth + bht + 4 * btd + 4 * bt)
    if mode == "tensor":
        return size * (split + 4 * btd + 4 * bt)
    return size * (split + 2 * btd + (2 * btd + 4 * bt) / world)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_sequence_parallel_block_matches_the_unsplit_block(nproc):
    report = launch(all_checks, nproc, echo=False, timeout=300)
    for version in ("mine", "pytorch"):
        r = report[version]
        assert r["names"], version
        assert r["output"] < 1e-12 and r["input grad"] < 1e-12, (version, r)
        assert all(d < 1e-12 for d in r["grads"].values()), (version, r["grads"])
        passes = {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 0}
        assert r["counts"] == {"forward": passes, "backward": passes}, version
    mine = report["mine"]
    assert {p: {**c, "all_reduce": 0} for p, c in mine["expected"].items()} == mine["counts"]
    assert mine["heads"] == 4 // nproc
    assert mine["synced"] == 6  # 2 norms x (weight, bias) + the 2 row-parallel biases: partial sums over tokens
    saved = report["saved"]
    for mode in ("full", "tensor", "sequence"):
        assert saved[mode] == predicted_saved(nproc, mode), (mode, saved)
    assert saved["sequence"] < saved["tensor"] < saved["full"]
    kind, message = report["errors"]["uneven"]
    assert kind == "ConfigError" and f"7 tokens does not divide by {nproc} ranks" in message


def test_sequence_parallel_refuses_to_work_outside_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(LaunchError, match="in none"):
        sp.gather_sequence(torch.zeros(1, 4, 2))
    with pytest.raises(LaunchError, match="in none"):
        sp.shard_sequence(torch.zeros(1, 4, 2))
    with pytest.raises(ConfigError, match="lacks norm1"):
        sp.split_block(MLP(4, 8))


def test_saved_bytes_counts_activations_once_and_skips_parameters():
    torch.manual_seed(0)
    block = Block(8, 2, 16)
    x = torch.randn(1, 4, 8, requires_grad=True)
    with sp.SavedBytes(block) as saved:
        block(x)
    assert saved.bytes == predicted_saved(1, "full", batch=1, tokens=4, dim=8, hidden=16, heads=2, size=4)
    lin = torch.nn.Linear(8, 8)
    with sp.SavedBytes(lin) as only_input:
        lin(x)
    assert only_input.bytes == x.numel() * 4  # the weight (saved for the input's gradient) is not an activation
