"""Mixture of experts (mparlib.experts): routing by hand, the expert-parallel layer against the one-process layer.

The one-process layer built with ``groups = world`` routes each rank's tokens as one group, so the expert-parallel
layer must compute the same outputs and gradients (float64, 1e-12) with and without dropped tokens, on 2 and 4
processes; the bytes passed to every ``all_to_all_single`` must be what the one-process routing predicts; and a few
SGD steps of a MoE ViT with experts on 2 ranks must give the one-process losses.
"""
import math

import pytest
import torch
from torch.nn import functional as F

from experts_workers import CONFIG, layer_checks, train_steps
from mparlib import experts as ep
from mparlib.errors import ConfigError, LaunchError
from mparlib.launch import launch


def hand_layer():
    """4 experts on 4 features; the router is 10 x identity, so a token 1 at feature e goes to expert e."""
    torch.manual_seed(0)
    moe = ep.MoE(4, 8, experts=4, k=1, capacity_factor=1.0)
    with torch.no_grad():
        moe.router.weight.copy_(10 * torch.eye(4))
    x = torch.zeros(8, 4)
    x[:5, 0], x[5:, 1] = 1.0, 1.0  # 5 tokens for expert 0, 3 for expert 1
    return moe, x


def test_dropped_tokens_and_balancing_loss_by_hand():
    moe, x = hand_layer()
    y = moe(x)
    # capacity = ceil(1.0 * 8 tokens * 1 / 4 experts) = 2: expert 0 keeps tokens 0, 1 (drops 3), expert 1 keeps 5, 6
    assert moe.last["capacity"] == 2 and moe.last["dropped"] == 3 + 1
    assert moe.last["kept"].tolist() == [2, 2, 0, 0] and moe.last["routed"].tolist() == [5, 3, 0, 0]
    assert torch.equal(y[[2, 3, 4, 7]], torch.zeros(4, 4)) and (y[[0, 1, 5, 6]] != 0).any(dim=1).all()
    p_top, p_other = math.exp(10) / (math.exp(10) + 3), 1 / (math.exp(10) + 3)
    share, mean_p = [5 / 8, 3 / 8, 0, 0], [(5 * p_top + 3 * p_other) / 8, (3 * p_top + 5 * p_other) / 8]
    assert moe.aux_loss.item() == pytest.approx(4 * (share[0] * mean_p[0] + share[1] * mean_p[1]), rel=1e-6)
    gate = F.softmax(moe.router(x[:1]), dim=-1)[0, 0]
    torch.testing.assert_close(y[0], gate * moe.experts[0](x[0]))
    moe.capacity_factor = 2.0  # capacity 4: only the fifth token of expert 0 is dropped
    moe(x)
    assert moe.last["dropped"] == 1 and moe.last["kept"].tolist() == [4, 3, 0, 0]


def test_an_even_router_has_balancing_loss_one_and_top2_gates_sum_to_one():
    logits = torch.zeros(6, 3)
    r = ep.route(logits, k=1, capacity_factor=10.0)
    assert r.aux_loss.item() == pytest.approx(1.0)  # all probabilities 1/3, all first choices expert 0: 3 * 1 * 1/3
    r2 = ep.route(torch.randn(10, 4), k=2, capacity_factor=10.0)
    assert r2.dropped == 0 and len(r2.token) == 20
    torch.testing.assert_close(torch.zeros(10).index_add(0, r2.token, r2.gate), torch.ones(10))
    assert torch.equal(r2.expert, r2.expert.sort().values)  # grouped by expert
    assert ep.capacity(12, 8, 2, 0.5) == 2


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_expert_parallel_layer_matches_one_process_and_its_bytes_are_predicted(nproc):
    report = launch(layer_checks, nproc, echo=False, timeout=300)
    kind, message = report.pop("uneven")
    assert kind == "ConfigError" and f"3 experts do not divide by {nproc} ranks" in message
    for case, r in report.items():
        assert r["output"] < 1e-12 and r["input grad"] < 1e-12, (case, r)
        assert len(r["grads"]) == 1 + 4 * r["experts here"] and all(d < 1e-12 for d in r["grads"].values()), case
        assert r["experts here"] == 8 // nproc
        assert r["calls"] == ["counts", "dispatch", "combine", "combine backward", "dispatch backward"]
        assert r["counted"] == r["predicted"], case  # rank 0's bytes, from the one-process routing
        assert r["dropped"] == r["dropped one process"]
        per = 8 // nproc
        row = 8 * 8
        assert r["leaving"]["dispatch"] == (sum(r["per_group"][0]) - sum(r["per_group"][0][:per])) * row
    assert report["no drops"]["dropped"] == 0 and report["drops"]["dropped"] > 0


@pytest.mark.slow
def test_moe_vit_on_two_ranks_trains_like_one_process():
    gen = torch.Generator().manual_seed(1)
    images = torch.rand(3, 8, 1, 28, 28, generator=gen)
    labels = torch.randint(0, 10, (3, 8), generator=gen)
    losses = launch(train_steps, 2, args=(images, labels), echo=False, timeout=300)
    torch.manual_seed(0)
    model = ep.moe_vit(CONFIG, experts=4, capacity_factor=1.0, groups=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref = []
    for X, y in zip(images, labels, strict=True):
        loss = F.cross_entropy(model(X), y) + 0.01 * ep.aux_loss(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    assert model.blocks[0].mlp.last["dropped"] > 0  # capacity factor 1.0 drops some: the parity holds with drops


def test_expert_layers_refuse_bad_settings():
    with pytest.raises(ConfigError, match="k"):
        ep.MoE(4, 8, experts=2, k=3)
    with pytest.raises(ConfigError, match="equal groups"):
        ep.MoE(4, 8, groups=3)(torch.zeros(4, 4))
    with pytest.raises(LaunchError, match="in none"):
        ep.ExpertParallelMoE(ep.MoE(4, 8))
