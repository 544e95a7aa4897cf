"""The layout planner (mparlib.planner) against the real model and against arithmetic done by hand.

Parameters are compared with ``sum(p.numel())`` of the course's ViT, FLOPs with ``FlopCounterMode`` (PyTorch's math
attention kernel, whose matmuls it sees), activation bytes with what autograd really saves for a block (a
saved-tensor hook, each storage once). The rest is arithmetic written out in the tests' comments, the published
activation formula of Korthikanti et al. (2022), refused layouts and the ranking of a small grid.
"""
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mparlib import planner
from mparlib.collectives import predict_seconds
from mparlib.errors import ConfigError
from mparlib.schedules import bubble_formula
from mparlib.vit import Block, ViTConfig, vit

CONFIGS = [ViTConfig(), ViTConfig(dim=256, depth=6, heads=8, hidden=512), ViTConfig(dim=48, depth=3, heads=3,
                                                                                     hidden=200, patch=7, classes=5)]


def saved_storage_bytes(module, x, backend):
    """Bytes of every storage autograd keeps for the backward of ``module(x)``, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with sdpa_kernel(backend), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


@pytest.mark.parametrize("config", CONFIGS)
def test_parameters_equal_the_real_vit(config):
    model = vit("smoke", **config.__dict__)
    assert planner.ModelShape.from_vit(config).parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("config", CONFIGS)
def test_flops_equal_what_the_flop_counter_sees(config):
    shape, model = planner.ModelShape.from_vit(config), vit("smoke", **config.__dict__)
    x = torch.randn(3, 1, 28, 28)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as forward:
        model(x)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as both:
        model(x).sum().backward()
    assert 3 * forward.get_total_flops() == shape.flops_per_sample() * 3
    # the convention counts a gradient for the images too (3 x forward); nobody computes it: the patch
    # embedding's 2 x pixels x dim x tokens FLOPs per sample are missing from the real backward
    conv = 2 * config.patch ** 2 * config.dim * shape.seq * 3
    assert both.get_total_flops() == shape.flops_per_sample() * 3 - conv


def test_flops_of_the_smoke_vit_by_hand():
    # d = 64, s = 49, f = 128, 4 blocks, 16 pixels per patch, 10 classes
    # block per token: projections 2 x 4 x 64^2 = 32768, scores and A V 4 x 49 x 64 = 12544, MLP 2 x 2 x 64 x 128
    # = 32768: 78080; x 49 tokens x 4 blocks = 15,303,680; patches 2 x 16 x 64 x 49 = 100,352; head 2 x 64 x 10
    # = 1,280; forward 15,405,312; x 3
    assert planner.ModelShape.from_vit(ViTConfig()).flops_per_sample() == 3 * 15_405_312


@pytest.mark.parametrize("backend, attention", [(SDPBackend.FLASH_ATTENTION, "flash"), (SDPBackend.MATH, "scores")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("config", CONFIGS)
def test_activation_bytes_equal_what_a_block_saves(backend, attention, dtype, config):
    # the course's CPU attention is the fused kernel (its backward is ScaledDotProductFlashAttentionForCpuBackward0)
    batch, tokens = 3, (28 // config.patch) ** 2
    block = Block(config.dim, config.heads, config.hidden).to(dtype)
    x = torch.randn(batch, tokens, config.dim, dtype=dtype, requires_grad=True)
    shape = planner.ModelShape.from_vit(config)
    shape = planner.ModelShape(**{**shape.__dict__, "attention": attention})
    e = torch.finfo(dtype).bits // 8
    predicted = planner.activation_bytes_per_layer(shape, e) * batch * tokens
    assert saved_storage_bytes(block, x, backend) == predicted


def test_the_default_cpu_kernel_is_the_flash_one():
    block, x = Block(64, 4, 128), torch.randn(2, 49, 64, requires_grad=True)
    names = set()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: names.add(type(t.grad_fn).__name__) or t, lambda t: t):
        block(x)
    assert any("Flash" in n for n in names)
    shape = planner.ModelShape.from_vit(ViTConfig())
    assert saved_storage_bytes(block, x, SDPBackend.FLASH_ATTENTION) == planner.activation_bytes_per_layer(shape) * 98


@pytest.mark.parametrize("dim, heads, seq", [(4096, 32, 2048), (12288, 96, 2048), (1024, 16, 512)])
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_korthikanti_formula_is_the_special_case(dim, heads, seq, tp):
    # 16-bit values, dropout, scores kept, MLP 4d, no norm statistics: s b d (34 + 5 a s / d) per layer
    shape = planner.ModelShape(layers=1, dim=dim, heads=heads, hidden=4 * dim, seq=seq, attention="scores",
                               dropout=True)
    per_token = lambda **kw: planner.activation_bytes_per_layer(shape, 2, tp=tp, norm_stats=False, **kw)  # noqa: E731
    full = dim * (34 + 5 * heads * seq / dim)
    assert per_token(sp=tp > 1, regather=True) == pytest.approx(full / tp, rel=1e-12)
    # tensor parallelism alone: s b d (10 + 24 / t + 5 a s / (d t))
    assert per_token() == pytest.approx(dim * (10 + 24 / tp + 5 * heads * seq / (dim * tp)), rel=1e-12)


def test_two_layer_model_on_two_data_parallel_ranks_with_zero1_by_hand():
    model = planner.ModelShape(layers=2, dim=8, heads=2, hidden=32, seq=4, vocab=16)
    n = model.parameters()
    # 2 blocks x (norms 4 x 8 + attention 4 x 64 + MLP 2 x 8 x 32) + table 16 x 8 + head 16 x 8 + final norm 16
    assert n == 2 * (32 + 256 + 512) + 128 + 128 + 16 == 1872
    layout = planner.Layout(dp=2, zero=1)
    mem = planner.memory_per_rank(model, layout, global_batch=6, precision="fp32", optimizer="adam")
    # fp32 Adam: params 4N, grads 4N, optimizer state 8N / 2 ranks
    assert (mem.parameters, mem.gradients, mem.optimizer) == (4 * n, 4 * n, 8 * n / 2)
    # 3 samples of 4 tokens per rank, 2 blocks; per token 4 bytes x (4 d norms' inputs and outputs + 4 d q, k, v
    # and attention output + 2 f MLP) + 2 heads' log-sum-exp x 4 + 4 statistics x 4 = 4 x 128 + 8 + 16 = 536
    # and, as the last rank too, the 16 output scores of each token in fp32 plus the loss's fp32 copy: 3 x 4 x 16 x 8
    assert mem.activations == 3 * 4 * 2 * 536 + 3 * 4 * 16 * 8
    assert mem.total == 4 * n + 4 * n + 4 * n + 3 * 4 * 2 * 536 + 3 * 4 * 16 * 8


@pytest.mark.parametrize("stage, shards", [(0, (1, 1, 1)), (1, (1, 1, 4)), (2, (1, 4, 4)), (3, (4, 4, 4))])
def test_zero_stages_shard_what_chapter_09_says(stage, shards):
    model = planner.ModelShape(layers=4, dim=16, heads=2, hidden=64, seq=8, vocab=32)
    n = model.parameters()
    mem = planner.memory_per_rank(model, planner.Layout(dp=4, zero=stage), 8, precision="mixed")
    # mixed precision with Adam: 2 + 2 + 12 = 16 bytes per parameter
    assert (mem.parameters, mem.gradients, mem.optimizer) == (2 * n / shards[0], 2 * n / shards[1], 12 * n / shards[2])


def test_tensor_and_pipeline_parallel_parameters_by_hand():
    # 4 blocks of d 8, f 32, biases, LayerNorm; a token table of 16 rows, an untied head
    model = planner.ModelShape(layers=4, dim=8, heads=2, hidden=32, seq=4, vocab=16, bias=True)
    local = planner.local_parameters(model, planner.Layout(tp=2, pp=2, micro_batches=2))
    # first stage: 2 blocks; per block norms 32 whole; q, k, v (64 + 8 each) and out's weight 64 split by 2;
    # out's bias 8 whole; fc1 (256 + 32) and fc2's weight 256 split by 2, fc2's bias 8 whole; table 128 / 2
    block = 32 + (3 * 72 + 64) / 2 + 8 + (288 + 256) / 2 + 8
    assert local == {"dense": 2 * block + 64, "experts": 0}
    # without a pipeline the rank also holds the head (weight and bias split by 2) and the final norm (whole)
    assert planner.local_parameters(model, planner.Layout(tp=2))["dense"] == 4 * block + 64 + (128 + 16) / 2 + 16


def test_experts_are_split_by_ep_and_data_parallel_over_dp():
    model = planner.ModelShape(layers=2, dim=8, heads=2, hidden=16, seq=4, experts=4, top_k=2)
    local = planner.local_parameters(model, planner.Layout(dp=2, ep=2))
    assert local["experts"] == 2 * 4 * (2 * 8 * 16) / 2  # 2 layers x 4 experts x 256 weights, half of them here
    assert planner.Layout(dp=2, ep=2).data_ranks() == 4 and planner.Layout(dp=2, ep=2).data_ranks(experts=True) == 2


@pytest.mark.parametrize("schedule, v, m, p, expected", [
    ("gpipe", 1, 8, 4, 8), ("1f1b", 1, 8, 4, 4), ("1f1b", 1, 4, 4, 4), ("zbv", 2, 8, 4, 4),
    ("interleaved1f1b", 2, 16, 4, 5.5),  # (p v + p - 1) / v = (8 + 3) / 2
    ("gpipe", 1, 8, 1, 1)])  # without a pipeline, accumulated micro-batches run one at a time
def test_micro_batches_in_flight_follow_the_schedules(schedule, v, m, p, expected):
    layout = planner.Layout(pp=p, micro_batches=m, schedule=schedule, stages_per_rank=v)
    assert planner.in_flight(layout) == pytest.approx(expected)
    if schedule == "interleaved1f1b":
        assert planner.in_flight(layout) == pytest.approx(p * (1 + (p - 1) / (p * v)))


def cluster(**changes):
    base = dict(devices_per_node=4, memory_bytes=1e9, flops_per_s=1e9, alpha_intra=1e-5, beta_intra=1e-9,
                alpha_inter=1e-4, beta_inter=1e-8)
    return planner.Cluster(**{**base, **changes})


def test_data_parallel_step_time_by_hand():
    model = planner.ModelShape(layers=2, dim=8, heads=2, hidden=32, seq=4, vocab=16)
    n, flops = model.parameters(), model.flops_per_sample()
    t = planner.step_time(model, planner.Layout(dp=2), 6, cluster(), precision="fp32")
    assert t.compute == pytest.approx(flops * 6 / (2 * 1e9))
    # one all-reduce of all the gradients as one flat vector: alpha + 2 (2 - 1) / 2 x 4N bytes x beta
    assert t.dp == pytest.approx(1e-5 + 4 * n * 1e-9)
    assert t.total == pytest.approx(t.compute + t.dp)
    half = planner.step_time(model, planner.Layout(dp=2), 6, cluster(), precision="fp32", overlap=0.5)
    assert half.total == pytest.approx(t.compute + t.dp / 2)


def test_tensor_parallel_step_time_uses_the_link_the_group_needs():
    model = planner.ModelShape(layers=2, dim=8, heads=8, hidden=32, seq=4, vocab=16)
    act = 3 * 4 * 8 * 4  # 3 samples x 4 tokens x 8 features x 4 bytes
    for tp, alpha, beta in [(4, 1e-5, 1e-9), (8, 1e-4, 1e-8)]:  # 4 devices per node: tp 8 crosses nodes
        t = planner.step_time(model, planner.Layout(tp=tp), 3, cluster(), precision="fp32")
        # 2 blocks x (2 all-reduces forward: out, fc2; 4 backward: q, k, v, fc1), each 2 (t - 1) / t of the activation
        assert t.tp == pytest.approx(12 * alpha + 12 * 2 * (tp - 1) / tp * act * beta)
        sp = planner.step_time(model, planner.Layout(tp=tp, sp=True), 3, cluster(), precision="fp32")
        # sequence parallel: per block 2 all-gathers + 2 reduce-scatters forward (attention's and the MLP's shared
        # input, out's and fc2's outputs) and as many backward, each (t - 1) / t of the activation
        assert sp.tp == pytest.approx(16 * alpha + 16 * (tp - 1) / tp * act * beta)


def test_the_bubble_is_bubble_formulas_share_of_the_step():
    model = planner.ModelShape(layers=8, dim=8, heads=2, hidden=32, seq=4, vocab=16)
    for schedule, v in [("gpipe", 1), ("1f1b", 1), ("interleaved1f1b", 2)]:
        t = planner.step_time(model, planner.Layout(pp=4, micro_batches=4, schedule=schedule, stages_per_rank=v),
                              8, cluster())
        share = bubble_formula(4, 4, schedule=schedule, stages_per_rank=v)
        busy = t.compute + t.tp + t.cp + t.ep + t.pp
        assert t.bubble / (busy + t.bubble) == pytest.approx(share)


def test_a_cluster_from_a_fit_predicts_chapter_08s_all_reduce_times():
    fit = {"alpha": 2e-4, "beta": 1.5e-9}
    for k in (2, 4, 8):
        c = planner.Cluster.from_fit(fit, k, flops_per_s=1e10, memory_bytes=1e9)
        for n in (4096, 2**24):
            sent = 2 * (k - 1) / k * n
            assert planner.collective_seconds(c, k, 1, sent) == pytest.approx(predict_seconds(fit, n))


def test_context_and_expert_parallel_traffic_by_hand():
    model = planner.ModelShape(layers=2, dim=8, heads=2, hidden=16, seq=8, experts=4, top_k=2, kv_heads=1)
    big = cluster(devices_per_node=64, alpha_intra=0.0)
    t = planner.step_time(model, planner.Layout(cp=4), 2, big)
    # 2 samples x 8 / 4 tokens; K and V: 2 x kv width 4 x 4 bytes each; forward 3 sends, backward 3 + 4, 2 blocks
    assert t.cp == pytest.approx(2 * (3 + 3 + 4) * (2 * 2) * (2 * 4 * 4) * 1e-9)
    t = planner.step_time(model, planner.Layout(ep=2), 2, big)
    # 1 sample x 8 tokens x top 2 x 8 features x 4 bytes, half of it leaves; 4 all-to-alls x 2 blocks
    assert t.ep == pytest.approx(8 * (8 * 2 * 8 * 4) / 2 * 1e-9)


@pytest.mark.parametrize("kwargs, model_kw, batch, words", [
    (dict(tp=3), {}, 8, "heads=4 does not divide by tp=3"),
    (dict(cp=3), {}, 8, "seq=16 does not divide by cp=3"),
    (dict(ep=2), {}, 8, "has none"),
    (dict(pp=8, micro_batches=8), {}, 8, "cannot fill"),
    (dict(dp=3), {}, 8, "global_batch=8 does not divide"),
    (dict(tp=4), dict(kv_heads=2), 8, "kv_heads=2 does not divide by tp=4"),
])
def test_layouts_the_model_cannot_take_are_refused(kwargs, model_kw, batch, words):
    model = planner.ModelShape(layers=4, dim=16, heads=4, hidden=32, seq=16, **model_kw)
    with pytest.raises(ConfigError, match=words):
        planner.memory_per_rank(model, planner.Layout(**kwargs), batch)


@pytest.mark.parametrize("kwargs, words", [
    (dict(sp=True), "tp=1 has none"), (dict(pp=4, micro_batches=2), "micro_batches >= 4"),
    (dict(zero=4), "zero=4"), (dict(schedule="1F1B"), "schedule='1F1B'"), (dict(tp=0), "tp=0"),
    (dict(schedule="zbv", pp=2, micro_batches=2), "places 2 stage"),
])
def test_impossible_layouts_are_refused_with_the_fix(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        planner.Layout(**kwargs)


def test_errors_speak_japanese_in_the_japanese_edition(monkeypatch):
    monkeypatch.setenv("MPARLIB_LANG", "ja")
    with pytest.raises(ConfigError, match="割り切れません"):
        planner.Layout(tp=3).check(planner.ModelShape(layers=2, dim=8, heads=2, hidden=8, seq=4), 4)
    with pytest.raises(ConfigError, match="ステージの数以上"):
        planner.Layout(pp=4, micro_batches=2)


def test_bad_shapes_and_clusters_are_refused():
    with pytest.raises(ConfigError, match="heads=3"):
        planner.ModelShape(layers=2, dim=8, heads=3, hidden=8, seq=4)
    with pytest.raises(ConfigError, match="top_k=3"):
        planner.ModelShape(layers=2, dim=8, heads=2, hidden=8, seq=4, experts=2, top_k=3)
    with pytest.raises(ConfigError, match="beta_inter"):
        cluster(beta_inter=-1)
    with pytest.raises(ConfigError, match="overlap"):
        planner.step_time(planner.ModelShape(layers=2, dim=8, heads=2, hidden=8, seq=4), planner.Layout(), 1,
                          cluster(), overlap=2)


def test_published_shapes_have_their_published_sizes():
    # model cards: 8.03B, 70.6B, 405B; Mixtral 8x7B: 46.7B
    sizes = {"llama3-8b": 8.03e9, "llama3-70b": 70.6e9, "llama3-405b": 405.9e9, "mixtral-8x7b": 46.7e9}
    for name, size in sizes.items():
        assert planner.ModelShape.published(name).parameters() == pytest.approx(size, rel=2e-3)


def test_the_ranking_on_a_tiny_grid_is_stable_and_explained():
    model = planner.ModelShape(layers=8, dim=64, heads=8, hidden=256, seq=64, vocab=256)
    c = cluster(memory_bytes=2e6, flops_per_s=1e12)
    rows = planner.plan(model, c, 8, 16, tp=(1, 2, 4, 8), pp=(1, 2, 4), zero=(0, 1, 3), recompute=(False,))
    again = planner.plan(model, c, 8, 16, tp=(1, 2, 4, 8), pp=(1, 2, 4), zero=(0, 1, 3), recompute=(False,))
    assert [r.layout for r in rows] == [r.layout for r in again]
    fits = [r.fits for r in rows]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    for group in (True, False):
        times = [r.time.total for r in rows if r.fits == group]
        assert times == sorted(times)
    assert all(r.layout.world() == 8 and r.fits == (r.memory.total <= 2e6) for r in rows)
    # 8 ranks on nodes of 4: tp 8 crosses the slow link, so the fastest layout keeps tp inside a node
    assert rows[0].layout.tp <= 4
    # with a free network nothing beats plain data parallelism with its whole batch on each rank: no bubble
    free = cluster(alpha_intra=0, beta_intra=0, alpha_inter=0, beta_inter=0, memory_bytes=1e12)
    best = planner.plan(model, free, 8, 16, tp=(1, 2), pp=(1, 2), zero=(0,), recompute=(False,))
    assert best[0].layout.pp == 1 and best[0].time.bubble == 0 and best[-1].layout.pp == 2


def test_recompute_trades_memory_for_a_third_more_compute():
    model = planner.ModelShape.published("llama3-8b")
    base = planner.Layout(dp=4, tp=8, sp=True, pp=2, micro_batches=16, zero=1)
    again = planner.Layout(dp=4, tp=8, sp=True, pp=2, micro_batches=16, zero=1, recompute=True)
    h100 = planner.Cluster.h100()
    t0, t1 = (planner.step_time(model, x, 64, h100, "mixed") for x in (base, again))
    assert t1.compute == pytest.approx(t0.compute * 4 / 3)
    m0, m1 = (planner.memory_per_rank(model, x, 64, "mixed") for x in (base, again))
    # kept: 16 blocks x 2 micro-batches in flight x 8192 tokens x 4096 / 8 x 2 bytes, and one block in full
    per_token = planner.activation_bytes_per_layer(model, 2, tp=8, sp=True)
    assert m1.activations == 8192 * (16 * 2 * 4096 / 8 * 2 + per_token)
    assert m0.activations == 8192 * 16 * 2 * per_token
    assert math.isclose(m1.parameters, m0.parameters)


def test_labels_name_every_degree_that_is_not_one():
    assert planner.Layout().label() == "1 rank"
    assert planner.Layout(dp=64, tp=8, sp=True, pp=16, micro_batches=32, schedule="interleaved1f1b",
                          stages_per_rank=2, zero=1, recompute=True).label() == "dp64 tp8+sp pp16 i1F1B x2 ZeRO-1 rc"
    assert planner.Layout(cp=2, ep=4).label() == "cp2 ep4 DDP"


def test_flops_of_gated_grouped_query_and_expert_models_by_hand():
    # d 8, 2 heads sharing 1 key/value head (kv width 4), gated MLP 16, 4 tokens, 10-word head on every token
    # per token: projections 2 (2 x 64 + 2 x 8 x 4) = 384, scores 4 x 4 x 8 = 128, MLP 2 x 3 x 8 x 16 = 768;
    # x 4 tokens = 5120; head 2 x 8 x 10 x 4 = 640; x 3
    gated = planner.ModelShape(layers=1, dim=8, heads=2, kv_heads=1, hidden=16, seq=4, vocab=10, gated=True)
    assert gated.flops_per_sample() == 3 * (5120 + 640)
    # 4 experts of width 16, 2 per token: MLP 2 x (2 x 2 x 8 x 16) = 1024, router 2 x 8 x 4 = 64
    moe = planner.ModelShape(layers=1, dim=8, heads=2, hidden=32, seq=4, vocab=10, experts=4, top_k=2,
                             expert_hidden=16)
    assert moe.flops_per_sample() == 3 * (4 * (2 * (2 * 64 + 2 * 64) + 128 + 1024 + 64) + 640)


def test_fsdp_holds_two_blocks_whole_and_one_blocks_gradients():
    """ZeRO-3: two blocks' parameters gathered (one computing, one prefetched) and one block's gradients before their
    reduce-scatter, fp32: 2 x 4 + 4 = 12 bytes per parameter of one block; nothing of the kind at ZeRO-1 or on 1 rank."""
    config = ViTConfig()
    shape = planner.ModelShape.from_vit(config)
    block = sum(p.numel() for p in Block(config.dim, config.heads, config.hidden).parameters())
    fsdp = planner.memory_per_rank(shape, planner.Layout(dp=4, zero=3), 16)
    assert fsdp.gathered == 12 * block
    assert fsdp.total == pytest.approx(fsdp.parameters + fsdp.gradients + fsdp.optimizer + fsdp.activations + 12 * block)
    assert planner.memory_per_rank(shape, planner.Layout(dp=4, zero=1), 16).gathered == 0
    assert planner.memory_per_rank(shape, planner.Layout(dp=1, zero=3), 16).gathered == 0
    with_tp = planner.memory_per_rank(shape, planner.Layout(dp=2, zero=3, tp=2), 16)
    assert with_tp.gathered < fsdp.gathered  # a tensor-parallel rank gathers only its half of the matrices


@pytest.mark.parametrize("config", CONFIGS)
def test_tensors_are_the_real_vits_parameters(config):
    shape, model = planner.ModelShape.from_vit(config), vit("smoke", **config.__dict__)
    real = {name: tuple(p.shape) for name, p in model.blocks[0].named_parameters()}
    assert shape.block_tensors() == real  # the names the tensor-parallel plan splits, and their shapes
    outer = {name: s for part in shape.outer_tensors().values() for name, s in part.items()}
    real = {name: p for name, p in model.named_parameters() if not name.startswith("blocks.")}
    assert set(outer) == set(real)
    for name, p in real.items():  # the patch embedding is kept flat, (dim, pixels): the same dim 0 and size
        assert (outer[name][0], math.prod(outer[name])) == (p.shape[0], p.numel()), name


def test_the_tensor_parallel_plan_splits_the_layers_it_names():
    gated = planner.ModelShape(layers=1, dim=8, heads=2, hidden=32, seq=4, vocab=16, gated=True, bias=True)
    assert planner.tp_layers(gated) == {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise",
                                        "attn.out": "rowwise", "mlp.fc1": "colwise", "mlp.gate": "colwise",
                                        "mlp.fc2": "rowwise"}
    units = planner.rank_tensors(gated, planner.Layout(tp=2))
    block = units[0][2]
    assert block["mlp.gate.weight"] == (16, 8) and block["mlp.gate.bias"] == (16,)  # column-wise: outputs split
    assert block["mlp.fc2.weight"] == (8, 16) and block["mlp.fc2.bias"] == (8,)  # row-wise: inputs; bias whole
    col = planner.collectives(gated, planner.Layout(tp=2), 2)
    # per block 2 row-wise outputs forward, 5 column-wise input gradients backward (q, k, v, fc1, gate)
    assert planner.by_kind(col) == {"all_reduce": {"calls": 7, "bytes": 7 * 2 * 4 * 8 * 4}}


def test_fsdp_calls_with_and_without_a_pipeline_by_hand():
    # 4 blocks of 8 x 8 attention and 8 x 32 MLP (no biases, RMSNorm) and a token table of 30 rows
    model = planner.ModelShape(layers=4, dim=8, heads=2, hidden=32, seq=4, vocab=30, norm="rmsnorm")
    block = 16 + 4 * 64 + 2 * 256  # two norms, q k v out, fc1 fc2: dim 0 of each divides by 4
    col = planner.by_kind(planner.collectives(model, planner.Layout(dp=4, zero=3, micro_batches=3), 24))
    root = 32 * 8 + 8 + 32 * 8  # the table and the head, 30 rows padded to 32, and the final norm
    # FSDP2's defaults, 3 micro-batches: each block gathered forward and backward, the root once, all reduce-scattered
    assert col["all_gather"] == {"calls": 4 * 6 + 3, "bytes": 4 * (4 * 6 * block + 3 * root)}
    assert col["reduce_scatter"] == {"calls": 5 * 3, "bytes": 4 * 3 * (4 * block + root)}
    piped = planner.Layout(dp=2, zero=3, pp=2, micro_batches=4)
    for rank, outer in ((0, 30 * 8), (1, 30 * 8 + 8)):  # first stage: the table; last: the head and the norm (30
        # rows divide by 2: no padding)
        col = planner.collectives(model, piped, 16, rank=rank)
        kinds = planner.by_kind(c for c in col if c.part == "dp")
        # inside torch's pipelining: a block gathered m + 1 = 5 times, the root once, one reduce-scatter each
        assert kinds["all_gather"] == {"calls": 2 * 5 + 1, "bytes": 4 * (2 * 5 * block + outer)}
        assert kinds["reduce_scatter"] == {"calls": 3, "bytes": 4 * (2 * block + outer)}
        act = 16 // 2 // 4 * 4 * 8 * 4  # 2 samples x 4 tokens x 8 x 4 bytes, one send and one receive each
        assert planner.by_kind(c for c in col if c.part == "pp") == {k: {"calls": 4, "bytes": 4 * act}
                                                                     for k in ("send", "recv")}


def test_pipeline_ranks_hold_the_stages_of_their_schedule():
    assert planner.Layout(pp=4, micro_batches=4).stages_of(1) == [1]
    assert planner.Layout(pp=4, micro_batches=8, schedule="interleaved1f1b", stages_per_rank=2).stages_of(1) == [1, 5]
    assert planner.Layout(pp=4, micro_batches=8, schedule="zbv", stages_per_rank=2).stages_of(0) == [0, 7]
    model = planner.ModelShape(layers=8, dim=8, heads=2, hidden=32, seq=4, vocab=16)
    zbv = planner.Layout(pp=4, micro_batches=8, schedule="zbv", stages_per_rank=2)
    # the V puts the first and the last stage on rank 0: it holds the table and the head; rank 1 neither
    roots = {r: [u for u in planner.rank_tensors(model, zbv, r) if u[1] == "root"] for r in (0, 1)}
    assert set(roots[0][0][2]) == {"tokens.weight", "head.weight", "norm.weight", "norm.bias"} and not roots[1]
    with pytest.raises(ConfigError, match="rank"):
        zbv.stages_of(4)


def test_the_data_parallel_step_adds_what_its_code_holds():
    model = planner.ModelShape(layers=4, dim=8, heads=2, hidden=32, seq=4, vocab=30, norm="rmsnorm")
    n = model.parameters()
    ddp = planner.memory_per_rank(model, planner.Layout(dp=4), 8)
    # fp32 Adam: after the backward pass the flat copy of all gradients (4n) stands where the activations were
    assert ddp.flat_copy == 4 * n and ddp.gathered == 0
    assert ddp.total == 16 * n + max(ddp.activations, 4 * n)
    zero1 = planner.memory_per_rank(model, planner.Layout(dp=4, zero=1), 8)
    assert zero1.flat_copy == 4 * n and planner.memory_per_rank(model, planner.Layout(dp=4, zero=2), 8).flat_copy == 0
    alone = planner.memory_per_rank(model, planner.Layout(), 8)
    assert alone.flat_copy == 0 and alone.total == 16 * n + alone.activations  # one rank: nothing to average
    piped = planner.Layout(dp=2, zero=3, pp=2, micro_batches=4)
    local = planner.local_parameters(model, piped)["dense"]
    fsdp = planner.memory_per_rank(model, piped, 16)
    # inside torch's pipelining FSDP2 keeps the stage's weights and its accumulated gradients whole
    assert (fsdp.parameters, fsdp.gradients, fsdp.gathered) == (4 * local / 2, 4 * local, 4 * local)
    assert fsdp.optimizer == 8 * local / 2 and fsdp.flat_copy == 0


def test_selective_recomputation_drops_the_scores_and_recomputes_them():
    # the math kernel's scores, kept: a s (e + 1 + e) bytes per token with dropout; selective recomputation drops them
    model = planner.ModelShape(layers=2, dim=8, heads=2, hidden=32, seq=16, vocab=16, attention="scores",
                               dropout=True)
    none, sel = (planner.memory_per_rank(model, planner.Layout(recompute=r), 4) for r in (False, "selective"))
    flash = planner.activation_bytes_per_layer(planner.ModelShape(**{**model.__dict__, "attention": "flash"}), 4)
    scores = planner.activation_bytes_per_layer(model, 4)
    assert scores - flash == 2 * 16 * (4 + 1 + 4) - 4 * 2  # a s (e + 1 + e), less the fused kernel's a lse values
    assert none.activations - sel.activations == 4 * 16 * 2 * (scores - flash)  # 4 samples x 16 tokens x 2 blocks
    c = planner.Cluster(8, 1e10, 1e10, 0.0, 0.0, 0.0, 0.0)
    extra = planner.step_time(model, planner.Layout(recompute="selective"), 4, c).compute \
        - planner.step_time(model, planner.Layout(), 4, c).compute
    assert extra == pytest.approx(2 * 4 * 16 * 8 * 16 * 4 / 1e10)  # 2 blocks x 4 s d x s per sample, 4 samples
    fused = planner.ModelShape(layers=2, dim=8, heads=2, hidden=32, seq=16, vocab=16)  # a fused kernel: no change
    assert planner.memory_per_rank(fused, planner.Layout(recompute="selective"), 4) == \
        planner.memory_per_rank(fused, planner.Layout(), 4)
    assert planner.Layout(recompute="selective").label() == "rc-attn" and planner.Layout(recompute=True).label() == "rc"
    for bad in (1, "full", None):
        with pytest.raises(ConfigError, match="recompute"):
            planner.Layout(recompute=bad)


def test_a_kind_measured_on_its_own_is_priced_by_its_own_alpha_and_beta():
    base = cluster(devices_per_node=8)
    sends = planner.Collective("pp", "send", 4, 4000.0, 2, 8)
    gathers = planner.Collective("dp", "all_gather", 3, 8000.0, 4, 8)
    assert sends.seconds(base) == pytest.approx(4 * 1e-5 + 4000 * 1e-9)  # the link: alpha per call, all bytes sent
    own = planner.Cluster(**{**base.__dict__, "kind_costs": (("send", 2e-6, 5e-10),)})
    assert sends.seconds(own) == pytest.approx(4 * 2e-6 + 4000 * 5e-10)
    assert gathers.seconds(own) == gathers.seconds(base) == pytest.approx(3 * 1e-5 + 8000 * 3 / 4 * 1e-9)
    assert planner.Collective("pp", "recv", 4, 4000.0, 2, 8).seconds(own) == 0  # the other half of a send
    with pytest.raises(ConfigError, match="kind"):
        planner.Cluster(**{**base.__dict__, "kind_costs": (("sendrecv", 1e-6, 1e-9),)})
