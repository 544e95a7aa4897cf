"""Chapter 4: a model spread over devices computes what the same model on one device computes.

References are ordinary single-device models holding the same weights: ``nn.Embedding`` + ``nn.Linear`` for the
hybrid model, the unsplit ``nn.Sequential`` for the pipelined one. Comparisons run in float64, where splitting a
batch into micro-batches changes results only by rounding.
"""
import pytest
import torch
from torch import nn

from mparlib.errors import ConfigError, DeviceError
from mparlib.hybrid import HybridEmbeddingModel, PipelineModel, pipeline_schedule

TOL = dict(rtol=1e-12, atol=1e-12)


def mlp(depth=4, width=16, d_in=8, d_out=3, norm=None, seed=0):
    """A float64 MLP: (Linear, [norm,] Tanh) x depth, then Linear."""
    torch.manual_seed(seed)
    layers, d = [], d_in
    for _ in range(depth):
        layers.append(nn.Linear(d, width))
        if norm is not None:
            layers.append(norm(width))
        layers.append(nn.Tanh())
        d = width
    layers.append(nn.Linear(d, d_out))
    return nn.Sequential(*layers).double()


def unprefixed(name):
    """``stages.1.4.weight`` -> ``4.weight``: a pipeline parameter's name in the unsplit model."""
    assert name.startswith("stages.")
    return name.split(".", 2)[2]


def assert_same_as_unsplit(net, pipe, x):
    """Outputs and every parameter's gradient of ``pipe`` equal those of ``net`` on ``x`` (float64)."""
    ref = net(x)
    out = pipe(x)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.cpu(), ref, **TOL)
    weights = torch.linspace(-1, 1, ref.numel(), dtype=ref.dtype).reshape(ref.shape)  # a loss that mixes all outputs
    (ref * weights).sum().backward()
    (out * weights.to(out.device)).sum().backward()
    grads = {n: p.grad for n, p in net.named_parameters()}
    names = [unprefixed(n) for n, _ in pipe.named_parameters()]
    assert names == list(grads), "the split model holds exactly the unsplit model's parameters, in order"
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), grads[unprefixed(n)], **TOL)


# --- pipeline_schedule ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("stages,micro", [(1, 1), (2, 1), (2, 4), (3, 5), (4, 2)])
def test_schedule_runs_every_stage_on_every_micro_batch_once_in_order(stages, micro):
    sched = pipeline_schedule(stages, micro)
    pairs = [(s, i) for _, s, i in sched]
    assert sorted(pairs) == [(s, i) for s in range(stages) for i in range(micro)]
    tick = {(s, i): t for t, s, i in sched}
    for s in range(1, stages):
        for i in range(micro):
            assert tick[(s, i)] > tick[(s - 1, i)], "a stage runs after the previous stage has its input"
    for i in range(1, micro):
        assert tick[(0, i)] > tick[(0, i - 1)], "micro-batches enter in order"
    per_tick = {}
    for t, s, _ in sched:
        per_tick.setdefault(t, []).append(s)
    assert all(len(v) == len(set(v)) for v in per_tick.values()), "a device does one thing per tick"
    assert max(per_tick) + 1 == stages + micro - 1
    assert [t for t, _, _ in sched] == sorted(t for t, _, _ in sched), "issued tick by tick"


def test_schedule_issues_later_stages_first_within_a_tick():
    assert pipeline_schedule(2, 3) == [(0, 0, 0), (1, 1, 0), (1, 0, 1), (2, 1, 1), (2, 0, 2), (3, 1, 2)]


@pytest.mark.parametrize("args", [(0, 2), (2, 0), (2.0, 2), (2, -1)])
def test_schedule_rejects_bad_counts(args):
    with pytest.raises(ValueError, match="positive int"):
        pipeline_schedule(*args)


# --- PipelineModel -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("micro", [1, 2, 3, 4, 10, 16])
def test_two_stage_pipeline_matches_unsplit_model(micro):
    net = mlp()
    pipe = PipelineModel.from_sequential(net, ["cpu", "cpu"], micro_batches=micro)
    x = torch.randn(10, 8, dtype=torch.float64)  # 10 samples: uneven micro-batches for 3 and 4, size 1 for 16
    assert_same_as_unsplit(net, pipe, x)


@pytest.mark.parametrize("split_at", [None, [1, 5], [3, 6]])
def test_three_stage_pipeline_matches_unsplit_model(split_at):
    net = mlp(depth=3)  # 7 layers
    pipe = PipelineModel.from_sequential(net, ["cpu"] * 3, split_at=split_at, micro_batches=4)
    assert len(pipe.stages) == 3
    assert sum(len(s) for s in pipe.stages) == len(net)
    assert_same_as_unsplit(net, pipe, torch.randn(9, 8, dtype=torch.float64))


def test_training_steps_match_unsplit_model():
    net = mlp()
    pipe = PipelineModel.from_sequential(net, ["cpu", "cpu"], micro_batches=4)
    opt_a = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(12, 8, dtype=torch.float64), torch.randint(3, (12,))
        for model, opt in ((net, opt_a), (pipe, opt_b)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    state = dict(net.named_parameters())
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p, state[unprefixed(n)], **TOL)


def test_pipeline_really_runs_micro_batches():
    """Each stage is called once per micro-batch, and stage 1 sees stage 0's output of the same micro-batch."""
    net = mlp(depth=2)
    pipe = PipelineModel.from_sequential(net, ["cpu", "cpu"], micro_batches=3)
    calls = []
    for s, stage in enumerate(pipe.stages):
        stage.register_forward_hook(lambda m, inp, out, s=s: calls.append((s, inp[0].shape[0])))
    pipe(torch.randn(7, 8, dtype=torch.float64))
    assert calls == [(0, 3), (1, 3), (0, 2), (1, 2), (0, 2), (1, 2)]


@pytest.mark.parametrize("rows, micro, sizes", [(5, 4, [2, 1, 1, 1]), (30, 7, [5, 5, 4, 4, 4, 4, 4]),
                                                (3, 4, [1, 1, 1]), (8, 4, [2, 2, 2, 2])])
def test_the_batch_is_cut_into_exactly_the_micro_batches_asked_for(rows, micro, sizes):
    net = mlp(depth=2)
    pipe = PipelineModel.from_sequential(net, ["cpu", "cpu"], micro_batches=micro)
    seen = []
    pipe.stages[0].register_forward_hook(lambda m, inp, out: seen.append(inp[0].shape[0]))
    x = torch.randn(rows, 8, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), net(x), rtol=1e-12, atol=1e-12)
    assert seen == sizes


def test_batchnorm_sees_micro_batches_in_training_but_not_in_eval():
    """The documented caveat: in training mode batch statistics come from each micro-batch."""
    net = mlp(norm=nn.BatchNorm1d)
    x = torch.randn(16, 8, dtype=torch.float64)
    pipe = PipelineModel.from_sequential(net.eval(), ["cpu", "cpu"], micro_batches=4).eval()
    torch.testing.assert_close(pipe(x), net(x), **TOL)  # eval: running statistics, no mixing of samples
    pipe.train(), net.train()
    assert not torch.allclose(pipe(x), net(x), rtol=1e-6, atol=1e-6)
    # and the running statistics were updated once per micro-batch instead of once per batch
    assert not torch.allclose(pipe.stages[0][1].running_mean, net[1].running_mean, rtol=1e-6, atol=1e-6)


def test_from_sequential_leaves_the_original_alone():
    net = mlp()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    pipe = PipelineModel.from_sequential(net, ["cpu", "cpu"])
    ids = {id(p) for p in net.parameters()}
    assert not ids & {id(p) for p in pipe.parameters()}, "the stages are copies"
    with torch.no_grad():
        for p in pipe.parameters():
            p.add_(1.0)
    for n, p in net.named_parameters():
        assert torch.equal(p, before[n])


def test_pipeline_output_lies_on_the_last_device():
    pipe = PipelineModel.from_sequential(mlp(), [torch.device("cpu"), "cpu"], micro_batches=2)
    assert pipe.devices == [torch.device("cpu")] * 2
    assert pipe(torch.randn(4, 8, dtype=torch.float64)).device == torch.device("cpu")


@pytest.mark.parametrize("devices,kwargs,match", [
    (["cpu"], None, "one device per stage"),
    (["cpu", "cpu"], dict(micro_batches=0), "micro_batches"),
    (["cpu", "cpu"], dict(split_at=[0]), "split_at"),
    (["cpu", "cpu"], dict(split_at=[9]), "split_at"),
    (["cpu", "cpu", "cpu"], dict(split_at=[4, 2]), "increasing"),
    (["cpu", "cuda:7"], {}, "does not exist"),
    (["cpu", "tpu:0"], {}, "not a device"),
])
def test_pipeline_rejects_bad_arguments_clearly(devices, kwargs, match):
    if "cuda:7" in devices and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    net = mlp()  # 9 layers
    if kwargs is not None:
        with pytest.raises(ValueError, match=match):
            PipelineModel.from_sequential(net, devices, **kwargs)
    if not kwargs:  # the same check when the two stages are given directly
        with pytest.raises(ValueError, match=match):
            PipelineModel([net[:4], net[4:]], devices)


def test_pipeline_rejects_a_non_sequential_and_an_empty_batch():
    with pytest.raises(ConfigError, match="nn.Sequential"):
        PipelineModel.from_sequential(nn.Linear(2, 2), ["cpu", "cpu"])
    pipe = PipelineModel.from_sequential(mlp(), ["cpu", "cpu"])
    with pytest.raises(ValueError, match="empty batch"):
        pipe(torch.empty(0, 8, dtype=torch.float64))


# --- HybridEmbeddingModel ------------------------------------------------------------------------------------

def reference_for(hybrid):
    """The same weights as an ordinary single-device model on the CPU."""
    ref = nn.Sequential(nn.Embedding(*hybrid.embedding.weight.shape), nn.Linear(hybrid.linear.in_features,
                                                                                hybrid.linear.out_features))
    ref = ref.to(hybrid.embedding.weight.dtype)
    with torch.no_grad():
        ref[0].weight.copy_(hybrid.embedding.weight)
        ref[1].weight.copy_(hybrid.linear.weight)
        ref[1].bias.copy_(hybrid.linear.bias)
    return ref


def check_hybrid_against_reference(device):
    torch.manual_seed(0)
    model = HybridEmbeddingModel(50, 6, out_features=4, device=device).double()
    ref = reference_for(model)
    ids = torch.tensor([[3, 7, 7], [49, 0, 3]])  # (2, 3), with repeated ids
    out = model(ids)
    assert out.shape == (2, 3, 4) and out.device == torch.device(device)
    torch.testing.assert_close(out.cpu(), ref(ids), **TOL)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * w.to(out.device)).sum().backward()
    (ref(ids) * w).sum().backward()
    assert model.embedding.weight.grad.device.type == "cpu", "the table's gradient comes back to the CPU"
    torch.testing.assert_close(model.embedding.weight.grad, ref[0].weight.grad, **TOL)
    torch.testing.assert_close(model.linear.weight.grad.cpu(), ref[1].weight.grad, **TOL)
    torch.testing.assert_close(model.linear.bias.grad.cpu(), ref[1].bias.grad, **TOL)


def test_hybrid_matches_single_device_model_on_cpu():
    check_hybrid_against_reference("cpu")


@pytest.mark.gpu
def test_hybrid_matches_single_device_model_with_linear_on_gpu():
    check_hybrid_against_reference("cuda:0")


def test_hybrid_places_table_on_cpu_and_layer_on_device():
    model = HybridEmbeddingModel(device="cpu")
    assert model.embedding.weight.shape == (1000, 10) and model.linear.weight.shape == (10, 10)
    assert model.embedding.weight.device.type == "cpu"
    default = HybridEmbeddingModel()
    want = torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    assert default.device == want and default.linear.weight.device == want
    assert default.embedding.weight.device.type == "cpu"
    assert [n for n, _ in default.named_children()] == ["embedding", "linear"]


def test_hybrid_sparse_gradient_touches_only_looked_up_rows():
    torch.manual_seed(0)
    model = HybridEmbeddingModel(100, 8, device="cpu", sparse=True)
    before = model.embedding.weight.detach().clone()
    ids = torch.tensor([5, 17, 5, 99])
    model(ids).sum().backward()
    grad = model.embedding.weight.grad
    assert grad.is_sparse
    assert sorted(grad.coalesce().indices()[0].tolist()) == [5, 17, 99]
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    changed = (model.embedding.weight != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [5, 17, 99]


@pytest.mark.parametrize("ids,error,match", [
    (torch.tensor([1.0, 2.0]), ConfigError, "integer ids"),
    (torch.tensor([0, 1000]), ConfigError, r"\[0, 999\]"),
    (torch.tensor([-1, 3]), ConfigError, r"\[0, 999\]"),
    ([1, 2], ConfigError, r"torch.tensor\(ids\)"),
])
def test_hybrid_rejects_bad_ids_clearly(ids, error, match):
    with pytest.raises(error, match=match):
        HybridEmbeddingModel(device="cpu")(ids)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_embeddings=0), "num_embeddings"),
    (dict(dim=2.5), "dim"),
    (dict(device="cuda:7"), "does not exist"),
])
def test_hybrid_rejects_bad_arguments_clearly(kwargs, match):
    if kwargs.get("device") == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with pytest.raises(ValueError, match=match):
        HybridEmbeddingModel(**kwargs)


# --- on real GPUs --------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_pipeline_on_one_gpu_and_the_cpu_matches_unsplit_model():
    net = mlp()
    pipe = PipelineModel.from_sequential(net, ["cpu", "cuda:0"], micro_batches=3)
    assert_same_as_unsplit(net, pipe, torch.randn(10, 8, dtype=torch.float64))


@pytest.mark.gpu
def test_pipeline_on_two_gpus_matches_unsplit_model():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    net = mlp()
    pipe = PipelineModel.from_sequential(net, ["cuda:0", "cuda:1"], micro_batches=4)
    assert [p.device for p in pipe.stages[1].parameters()][0] == torch.device("cuda:1")
    assert_same_as_unsplit(net, pipe, torch.randn(10, 8, dtype=torch.float64))


@pytest.mark.gpu
def test_hybrid_moved_whole_to_gpu_still_runs_but_loses_the_split():
    model = HybridEmbeddingModel(50, 6, device="cuda:0").to("cuda:0")
    assert model.embedding.weight.device.type == "cuda"
    out = model(torch.tensor([1, 2, 3]))
    assert out.device.type == "cuda" and out.shape == (3, 6)


@pytest.mark.parametrize("call, error, match", [
    (lambda: PipelineModel.from_sequential(mlp(), "cpu"), DeviceError, "devices must be a list of devices"),
    (lambda: PipelineModel.from_sequential(mlp(), ["cpu", "cpu"], split_at=4.5), ConfigError, "split_at=4.5"),
    (lambda: PipelineModel.from_sequential(mlp(), ["cpu", "cpu"], split_at=[True]), ConfigError, "split_at"),
    (lambda: PipelineModel(nn.Linear(2, 2), ["cpu"]), ConfigError, "for one stage write \\[module\\]"),
    (lambda: PipelineModel([nn.Linear(2, 2), "relu"], ["cpu", "cpu"]), ConfigError, "stages\\[1\\] is a str"),
    (lambda: PipelineModel([nn.Linear(2, 2)], torch.device("cpu")), DeviceError, "devices must be a list of devices"),
    (lambda: PipelineModel([nn.Linear(2, 2)], 0), DeviceError, "not the single device 0"),
    (lambda: PipelineModel([nn.Linear(2, 2)], []), DeviceError, "devices is empty"),
    (lambda: PipelineModel([nn.Linear(2, 2)], ["cpu"], micro_batches=True), ConfigError, "micro_batches"),
    (lambda: PipelineModel([nn.Linear(2, 2)], ["tpu"]), DeviceError, "devices\\[0\\]='tpu' is not a device"),
    (lambda: PipelineModel([nn.Linear(2, 2)], ["cpu"])([1.0, 2.0]), ConfigError, "batch tensor"),
    (lambda: PipelineModel([nn.Linear(2, 2)], ["cpu"])(torch.tensor(1.0)), ConfigError, "a 0-d tensor"),
    (lambda: HybridEmbeddingModel(num_embeddings=True), ConfigError, "num_embeddings=True: use a positive int"),
    (lambda: HybridEmbeddingModel(device="cpu", sparse="yes"), ConfigError, "sparse='yes'"),
    (lambda: HybridEmbeddingModel(device="tpu"), DeviceError, "not a device"),
    (lambda: pipeline_schedule(True, 2), ConfigError, "num_stages=True: use a positive int"),
])
def test_more_bad_arguments_are_refused_with_the_course_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_split_at_given_as_one_int_cuts_there():
    net = mlp()
    pipe = PipelineModel.from_sequential(net, ["cpu", "cpu"], split_at=4)
    assert [len(s) for s in pipe.stages] == [4, len(net) - 4]
