"""Ring attention (mparlib.ring_attention) against one-process attention and against torch's context_parallel.

One process: :func:`merge` of two partial attentions equals attention over all the keys, the splits put a sequence
back together, and ``ring_attention`` outside a process group equals ``F.scaled_dot_product_attention``. Across 2
and 4 ranks (gloo on the CPU, one launch per size): outputs and q/k/v gradients, gathered from the ranks, equal
one-process SDPA in float64 for non-causal and causal attention with both splits; the non-causal output equals
``context_parallel``'s; the balanced causal split computes the same number of score elements on every rank; the
bytes saved for backward per rank are the one process's divided by N, and the largest score block N^2 times smaller.
"""
import math

import pytest
import torch
from torch.nn import functional as F

from mparlib.errors import ConfigError
from mparlib.launch import launch
from mparlib.ring_attention import (SavedBytes, block_attention, chunks_of, merge, ring_attention, shard_sequence,
                                    unshard_sequence)

TIGHT = 1e-12


def _qkv(shape=(2, 3, 16, 8), seed=0):
    torch.manual_seed(seed)
    return [torch.randn(*shape, dtype=torch.float64) for _ in range(3)]


def test_merge_of_two_key_blocks_equals_attention_over_all_keys():
    q, k, v = _qkv()
    out_a, lse_a = block_attention(q, k[:, :, :5], v[:, :, :5])
    out_b, lse_b = block_attention(q, k[:, :, 5:], v[:, :, 5:])
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=TIGHT, atol=TIGHT)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=TIGHT, atol=TIGHT)


def test_merge_with_nothing_seen_yet_returns_the_other_block():
    q, k, v = _qkv()
    out_b, lse_b = block_attention(q, k, v)
    empty = torch.full_like(lse_b, float("-inf"))
    out, lse = merge(torch.zeros_like(out_b), empty, out_b, lse_b)
    assert torch.equal(out, out_b) and torch.equal(lse, lse_b)


@pytest.mark.parametrize("split", ["contiguous", "balanced"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_shard_and_unshard_round_trip(world, split):
    x = torch.arange(2 * 16 * 3.0).view(2, 1, 16, 3)
    pieces = [shard_sequence(x, r, world, split) for r in range(world)]
    assert all(p.shape == (2, 1, 16 // world, 3) for p in pieces)
    assert torch.equal(unshard_sequence(pieces, split), x)


def test_balanced_split_gives_each_rank_an_early_and_a_late_chunk():
    assert [chunks_of(r, 4, "balanced")[0] for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert chunks_of(2, 4)[0] == [2]


def test_unknown_split_and_uneven_length_are_refused():
    with pytest.raises(ConfigError, match="split"):
        chunks_of(0, 2, "random")
    with pytest.raises(ConfigError, match="multiple of 4"):
        shard_sequence(torch.zeros(1, 1, 10, 2), 0, 2, "balanced")


@pytest.mark.parametrize("causal", [False, True])
def test_one_process_ring_attention_equals_sdpa_with_gradients(causal):
    q, k, v = _qkv()
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    theirs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*ours, causal=causal)
    ref = F.scaled_dot_product_attention(*theirs, is_causal=causal)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref, rtol=TIGHT, atol=TIGHT)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=TIGHT, atol=TIGHT)


def test_saved_bytes_counts_what_sdpa_keeps_for_backward():
    q, k, v = (t.float().requires_grad_() for t in _qkv((2, 2, 32, 8)))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH), SavedBytes() as saved:
        F.scaled_dot_product_attention(q, k, v)
    weights = 2 * 2 * 32 * 32 * 4  # the math backend keeps the softmax weights (B, H, T, T)
    assert saved.bytes >= weights + 2 * q.numel() * 4  # and at least k and v (q may be kept pre-scaled)
    with SavedBytes() as mine:
        ring_attention(q, k, v)
    assert mine.bytes == 4 * q.numel() * 4 + 2 * 2 * 32 * 4  # q, k, v, out and the log-sum-exp per query


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def ring_report(request):
    import ring_attention_workers as workers

    return request.param, launch(workers.everything, request.param, echo=False, timeout=300)


@pytest.mark.slow
def test_ring_attention_equals_sdpa_outputs_and_gradients(ring_report):
    world, report = ring_report
    for case, r in report["sdpa"].items():
        assert len(r["diffs"]) == 4 and max(r["diffs"]) < 1e-10, (world, case, r["diffs"])


@pytest.mark.slow
def test_balanced_causal_split_does_equal_work_and_contiguous_does_not(ring_report):
    world, report = ring_report
    balanced = [s["score_elements"] for s in report["sdpa"][(True, "balanced")]["stats"]]
    naive = [s["score_elements"] for s in report["sdpa"][(True, "contiguous")]["stats"]]
    assert len(set(balanced)) == 1
    assert naive == sorted(naive) and naive[-1] == world * naive[0]  # rank r computes r + 1 blocks
    assert sum(balanced) < sum(naive)  # fewer masked entries computed: the diagonal blocks are smaller
    full = [s["score_elements"] for s in report["sdpa"][(False, "contiguous")]["stats"]]
    assert all(f == 2 * 3 * 16 * 16 // world for f in full)  # B H T^2 / N: the whole score matrix, shared out


@pytest.mark.slow
def test_ring_attention_equals_context_parallel(ring_report):
    world, report = ring_report
    assert report["context_parallel"]["diff"] < 1e-10, world


@pytest.mark.slow
def test_context_parallel_on_the_cpu_gathers_the_keys_and_values(ring_report):
    """What chapter 11 says torch does on the CPU: two all-gathers (keys, values), not a ring of exchanges."""
    world, report = ring_report
    assert report["context_parallel"]["collectives"] == {"all_gather": 2, "reduce_scatter": 0, "all_reduce": 0}, (world, report)


@pytest.mark.slow
def test_saved_bytes_per_rank_shrink_by_the_number_of_ranks(ring_report):
    world, report = ring_report
    one = {}
    for length in report["saved"][0]:
        q, k, v = (t.float().requires_grad_() for t in _qkv((2, 2, length, 8)))
        stats = {}
        with SavedBytes() as saved:
            ring_attention(q, k, v, stats=stats)
        one[length] = (saved.bytes, stats["largest_block"])
    for per_rank in report["saved"]:
        for length, (saved, block) in per_rank.items():
            assert saved * world == one[length][0], (world, length)
            assert block * world ** 2 == one[length][1], (world, length)


@pytest.mark.slow
def test_measure_overlap_times_every_part_on_every_rank(ring_report):
    world, report = ring_report
    overlap = report["overlap"]
    assert overlap["ranks"] == world and overlap["seq_len"] == 16 and overlap["repeats"] >= 3
    assert overlap["bytes_per_step"] == 2 * 2 * 3 * (16 // world) * 8 * 4  # k and v: B x H x T/N x d float32
    for name in ("compute", "communication", "ring"):
        median, low, high = overlap["ms_per_step"][name]
        assert 0 < low <= median <= high, (name, overlap["ms_per_step"][name])
    assert 0 <= overlap["hidden"] <= 1 and set(overlap["load"]) == {"before", "after", "busy"}


@pytest.mark.slow
def test_measure_balance_counts_what_the_ring_computes(ring_report):
    world, report = ring_report
    for split in ("contiguous", "balanced"):
        ring = [s["score_elements"] for s in report["sdpa"][(True, split)]["stats"]]  # the ring's own count
        ranks = report["balance"][split]
        assert [r["score_elements"] for r in ranks] == ring, (world, split)
        assert all(r["ms_min_max"][0] <= r["ms"] <= r["ms_min_max"][1] for r in ranks)


def test_vit_attend_hook_and_tokens_keep_the_model_unchanged():
    from mparlib.vit import vit

    torch.manual_seed(0)
    model = vit("smoke", patch=7).double()
    x = torch.rand(3, 1, 28, 28, dtype=torch.float64)
    ref = model(x)
    assert model.tokens(x).shape == (3, 16, 64)
    for block in model.blocks:
        block.attn.attend = ring_attention  # outside a process group: the whole sequence as one block
    torch.testing.assert_close(model(x), ref, rtol=TIGHT, atol=TIGHT)
