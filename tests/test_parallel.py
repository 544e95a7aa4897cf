"""mparlib.parallel: the teaching primitives compute exactly what one device computes.

The reference is always a real computation: the same module called once on the whole batch, torch.chunk, the
behaviour PyTorch documents for DataParallel, or (on GPUs) torch.nn.parallel itself.
"""
import copy
import dataclasses
import os
import pickle
import sys
import threading
import traceback
from collections import namedtuple

import pytest
import torch
from torch import nn

from mparlib.checkpoint import load_checkpoint, save_checkpoint, state_dict_of, unwrap
from mparlib.errors import CheckpointError, CheckpointMismatchError, ConfigError, DeviceError
from mparlib.parallel import data_parallel, gather, parallel_apply, replicate, scatter, scatter_kwargs
from mparlib.wrapper import AttrDataParallel

CPU = torch.device("cpu")
TOL = {torch.float64: 1e-12, torch.float32: 1e-6}


def simulated(k):
    """k simulated devices: the CPU listed k times."""
    return ["cpu"] * k


def leaves(obj):
    """The tensors of a nested output, in order, with their paths."""
    if isinstance(obj, torch.Tensor):
        return [("", obj)]
    if isinstance(obj, dict):
        return [(f"[{k!r}]{p}", t) for k, v in obj.items() for p, t in leaves(v)]
    if isinstance(obj, (tuple, list)):
        return [(f"[{i}]{p}", t) for i, v in enumerate(obj) for p, t in leaves(v)]
    return []


def loss_of(output):
    """A scalar that depends on every output element."""
    return sum((t.float() if not t.is_floating_point() else t).pow(2).mean() for _, t in leaves(output))


# ---------------------------------------------------------------------------------------------------------------
# A zoo of modules: each entry builds (module, make_inputs) with make_inputs(batch, dtype) -> (args, kwargs).
# ---------------------------------------------------------------------------------------------------------------
class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(4, 6, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(6, 3)

    def forward(self, x):  # (B, 1, 8, 8) -> (B, 3)
        return self.head(self.features(x))


class BatchNormEval(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
        with torch.no_grad():  # running statistics that are not the defaults, so using them shows
            self[1].running_mean.uniform_(-1, 1)
            self[1].running_var.uniform_(0.5, 2)
        self.eval()


class TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(5, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.head(h), h


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(5, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return {"logits": self.head(h), "embedding": h, "name": "dict-out"}


class KeywordArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, x, *, mask, scale=1.0):  # mask: (B,) per example; scale: one number
        return self.lin(x * mask.unsqueeze(-1)) * scale


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(7, 3)

    def forward(self, x, y):
        return self.lin(torch.cat([x, y], dim=1))


class TiedWeights(nn.Module):
    """One parameter used twice (encoder and transposed decoder) and one submodule applied twice."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(5, 4, bias=False)
        self.mid = nn.Linear(4, 4)
        self.out_bias = nn.Parameter(torch.zeros(5))

    def forward(self, x):
        h = self.mid(torch.tanh(self.mid(self.enc(x))))
        return h @ self.enc.weight + self.out_bias


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(5, 4, batch_first=True)

    def forward(self, x):  # (B, T, 5) -> (B, T, 4)
        return self.gru(x)[0]


def vec(b, dtype):
    return torch.randn(b, 5, dtype=dtype)


ZOO = {
    "linear": (lambda: nn.Linear(5, 3), lambda b, dt: ((vec(b, dt),), {})),
    "conv net": (ConvNet, lambda b, dt: ((torch.randn(b, 1, 8, 8, dtype=dt),), {})),
    "batchnorm in eval mode": (BatchNormEval, lambda b, dt: ((vec(b, dt),), {})),
    "tuple output": (TupleOut, lambda b, dt: ((vec(b, dt),), {})),
    "dict output": (DictOut, lambda b, dt: ((vec(b, dt),), {})),
    "keyword arguments": (KeywordArgs, lambda b, dt: ((vec(b, dt),), {"mask": torch.rand(b, dtype=dt),
                                                                      "scale": 0.5})),
    "two positional inputs": (TwoInputs, lambda b, dt: ((vec(b, dt), torch.randn(b, 2, dtype=dt)), {})),
    "tied weights": (TiedWeights, lambda b, dt: ((vec(b, dt),), {})),
    "recurrent (GRU)": (Recurrent, lambda b, dt: ((torch.randn(b, 3, 5, dtype=dt),), {})),
}


def eval_mode_for_conv(net):
    # ConvNet holds a BatchNorm2d; the zoo compares in eval mode (train mode has its own test below).
    return net.eval() if isinstance(net, ConvNet) else net


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("batch", [7, 2], ids=["batch 7 (not divisible)", "batch 2 (smaller than some k)"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("name", list(ZOO))
def test_data_parallel_on_k_simulated_devices_equals_one_plain_call(name, k, batch, dtype):
    build, make_inputs = ZOO[name]
    torch.manual_seed(0)
    net = eval_mode_for_conv(build().to(dtype))
    reference = copy.deepcopy(net)
    args, kwargs = make_inputs(batch, dtype)

    expected = reference(*args, **kwargs)
    loss_of(expected).backward()
    got = data_parallel(net, args, simulated(k), module_kwargs=kwargs)
    loss_of(got).backward()

    tol = TOL[dtype]
    assert type(got) is type(expected)
    assert [p for p, _ in leaves(got)] == [p for p, _ in leaves(expected)]
    for (path, g), (_, e) in zip(leaves(got), leaves(expected)):
        assert g.shape == e.shape and g.dtype == e.dtype, path
        torch.testing.assert_close(g, e, rtol=tol, atol=tol, msg=f"output{path}")
    if isinstance(expected, dict):
        assert got["name"] == expected["name"]
    for (pname, p), (_, q) in zip(net.named_parameters(), reference.named_parameters()):
        assert p.grad is not None, f"no gradient reached {pname}"
        torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol, msg=f"gradient of {pname}")


# ---------------------------------------------------------------------------------------------------------------
# replicate
# ---------------------------------------------------------------------------------------------------------------
def test_replicas_are_distinct_modules_with_their_own_differentiable_copies_of_the_parameters():
    net = ConvNet().double()
    replicas = replicate(net, simulated(3))
    assert len(replicas) == 3
    assert len({id(r) for r in replicas} | {id(net)}) == 4
    originals = dict(net.named_parameters())
    for r in replicas:
        assert type(r) is ConvNet and r.features[0] is not net.features[0]
        copies = dict(r.named_parameters())
        assert copies.keys() == originals.keys()
        for name, p in copies.items():
            assert p is not originals[name] and not p.is_leaf and p.grad_fn is not None, name
            assert torch.equal(p, originals[name]), name
            assert p.data_ptr() != originals[name].data_ptr(), name


def test_backward_through_every_replica_adds_each_replicas_gradient_into_the_original():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    net(x).pow(2).sum().backward()
    once = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad()

    replicas = replicate(net, simulated(3))
    sum(r(x).pow(2).sum() for r in replicas).backward()  # three uses of the same input
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, 3 * once[n], rtol=1e-12, atol=1e-12)


def test_a_parameter_shared_by_two_layers_stays_shared_inside_each_replica():
    net = TiedWeights()
    net.dec = nn.Linear(4, 5, bias=False)
    net.dec.weight = net.enc.weight  # the same Parameter in two layers
    for r in replicate(net, simulated(2)):
        assert r.enc.weight is r.dec.weight
        assert r.enc.weight is not net.enc.weight


def test_replica_0_shares_the_original_buffers_and_the_other_replicas_get_copies():
    net = BatchNormEval()
    bn = net[1]
    r0, r1 = (r[1] for r in replicate(net, simulated(2)))
    assert r0.running_mean is bn.running_mean and r0.num_batches_tracked is bn.num_batches_tracked
    assert r1.running_mean is not bn.running_mean and torch.equal(r1.running_mean, bn.running_mean)


def test_replicas_made_without_grad_mode_do_not_track_gradients():
    with torch.no_grad():
        replica = replicate(nn.Linear(3, 2), simulated(1))[0]
    assert not replica.weight.requires_grad


def test_replicate_explains_that_the_module_must_live_on_the_first_device():
    net = nn.Linear(3, 2, device="meta")
    with pytest.raises(DeviceError, match=r"on device cpu \(devices\[0\]\) but found 'weight' on device: meta"):
        replicate(net, simulated(2))


def test_uninitialised_lazy_layers_ask_for_one_dummy_forward_first():
    net = nn.Sequential(nn.LazyLinear(3), nn.ReLU(), nn.LazyLinear(2))
    with pytest.raises(ConfigError, match="Run one dummy forward first"):
        data_parallel(net, torch.randn(4, 5), simulated(2))
    net(torch.zeros(1, 5))  # the dummy forward fixes the shapes
    assert data_parallel(net, torch.randn(4, 5), simulated(2)).shape == (4, 2)


# ---------------------------------------------------------------------------------------------------------------
# BatchNorm in train mode: PyTorch's replica-0 rule
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [2, 3, 4])
def test_batchnorm_running_statistics_come_from_replica_0s_chunk_only(k):
    """PyTorch documents that DataParallel's replica on device_ids[0] shares the original's buffers, so in-place
    updates made there are kept, and updates made by the other replicas are lost with them."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6)).double().train()
    untouched = copy.deepcopy(net)
    x = torch.randn(9, 5, dtype=torch.float64)
    chunks = x.chunk(k)

    out = data_parallel(net, x, simulated(k))

    # Each replica normalises its own chunk with that chunk's batch statistics (this is not SyncBatchNorm).
    per_chunk = torch.cat([copy.deepcopy(untouched)(c) for c in chunks])
    torch.testing.assert_close(out, per_chunk, rtol=1e-12, atol=1e-12)
    # The original's running statistics moved exactly as if it had seen chunk 0 alone.
    only_first = copy.deepcopy(untouched)
    only_first(chunks[0])
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(net[1], name), getattr(only_first[1], name), rtol=1e-12, atol=1e-12)
    # ...which is not what one pass over the whole batch gives.
    whole = copy.deepcopy(untouched)
    whole(x)
    assert not torch.allclose(net[1].running_mean, whole[1].running_mean)


def test_a_python_attribute_changed_in_forward_is_lost_with_the_replicas_as_pytorch_documents():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.counter = nn.Linear(2, 2), 0

        def forward(self, x):
            self.counter += 1
            return self.lin(x)

    net = Counter()
    data_parallel(net, torch.randn(4, 2), simulated(2))
    assert net.counter == 0


# ---------------------------------------------------------------------------------------------------------------
# scatter
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows, k", [(5, 2), (2, 3), (8, 4), (7, 3), (0, 2)])
def test_scatter_splits_like_torch_chunk(rows, k):
    x = torch.arange(rows * 2.0).reshape(rows, 2)
    chunks = scatter(x, simulated(k))
    expected = x.chunk(k)
    assert [c.shape[0] for c in chunks] == [e.shape[0] for e in expected]
    assert all(torch.equal(c, e) for c, e in zip(chunks, expected))


def test_five_rows_over_two_devices_give_three_and_two_and_two_rows_over_three_give_two_chunks():
    assert [c.shape[0] for c in scatter(torch.zeros(5, 1), simulated(2))] == [3, 2]
    assert [c.shape[0] for c in scatter(torch.zeros(2, 1), simulated(3))] == [1, 1]


Pair = namedtuple("Pair", "x y")


@dataclasses.dataclass
class Batch:
    images: torch.Tensor
    labels: torch.Tensor
    note: str = "train"


def test_scatter_rebuilds_nested_containers_and_passes_other_values_by_reference():
    x, y = torch.randn(5, 3), torch.randn(5)
    tag = object()
    inputs = (x, [Pair(x, y), {"y": y, "tag": tag}], Batch(x, y), 3, None)
    chunks = scatter(inputs, simulated(2))
    assert len(chunks) == 2
    for i, (cx, (pair, d), batch, three, none) in enumerate(chunks):
        rows = x.chunk(2)[i]
        assert torch.equal(cx, rows)
        assert type(pair) is Pair and torch.equal(pair.x, rows) and torch.equal(pair.y, y.chunk(2)[i])
        assert torch.equal(d["y"], y.chunk(2)[i]) and d["tag"] is tag
        assert type(batch) is Batch and torch.equal(batch.labels, y.chunk(2)[i]) and batch.note == "train"
        assert three == 3 and none is None


def test_scatter_along_another_dimension():
    x = torch.randn(2, 5, 3)
    assert [c.shape for c in scatter(x, simulated(2), dim=1)] == [(2, 3, 3), (2, 2, 3)]


def test_scatter_is_differentiable():
    x = torch.randn(5, 2, requires_grad=True)
    a, b = scatter(x, simulated(2))
    (a.sum() + 2 * b.sum()).backward()
    assert torch.equal(x.grad, torch.tensor([1.0] * 3 + [2.0] * 2).unsqueeze(1).expand(5, 2))


def test_scatter_kwargs_keeps_positional_and_keyword_chunks_together():
    x, mask = torch.arange(5.0), torch.arange(5.0) * 10
    args, kwargs = scatter_kwargs((x,), {"mask": mask, "scale": 2}, simulated(3))
    assert len(args) == len(kwargs) == 3
    for (cx,), kw in zip(args, kwargs):
        assert torch.equal(kw["mask"], cx * 10) and kw["scale"] == 2


def test_scatter_names_the_valid_range_when_the_dimension_is_out_of_range():
    with pytest.raises(ConfigError, match=r"dim=2 is out of range for a tensor of shape \(5, 3\): use a dimension "
                                         r"from -2 to 1"):
        scatter(torch.zeros(5, 3), simulated(2), dim=2)


def test_scatter_refuses_tensors_whose_batch_sizes_disagree():
    with pytest.raises(ValueError, match=r"sizes there must agree; got shapes \(5, 3\), \(4,\)"):
        scatter((torch.zeros(5, 3), torch.zeros(4)), simulated(2))


def test_scatter_refuses_a_scalar_tensor_and_says_what_to_pass_instead():
    with pytest.raises(ValueError, match="0-d tensor"):
        scatter((torch.zeros(4, 2), torch.tensor(3.0)), simulated(2))


# ---------------------------------------------------------------------------------------------------------------
# parallel_apply
# ---------------------------------------------------------------------------------------------------------------
class WaitForAll(nn.Module):
    """Every replica waits until all have started: this can only finish if they run at the same time."""

    def __init__(self, barrier):
        super().__init__()
        self.barrier, self.lin = barrier, nn.Linear(2, 2)

    def forward(self, x):
        self.barrier.wait()
        return self.lin(x)


def test_parallel_apply_runs_the_replicas_at_the_same_time_one_thread_each():
    k = 3
    net = WaitForAll(threading.Barrier(k, timeout=30))
    outs = parallel_apply(replicate(net, simulated(k)), scatter(torch.randn(6, 2), simulated(k)))
    assert [o.shape for o in outs] == [(2, 2)] * k


def test_parallel_apply_carries_grad_mode_into_the_threads():
    replicas = replicate(nn.Linear(2, 2), simulated(2))
    inputs = scatter(torch.randn(4, 2), simulated(2))
    assert all(o.requires_grad for o in parallel_apply(replicas, inputs))
    with torch.no_grad():
        assert not any(o.requires_grad for o in parallel_apply(replicas, inputs))


def test_parallel_apply_carries_inference_mode_into_the_threads():
    with torch.inference_mode():
        replicas = replicate(nn.Linear(2, 2), simulated(2))
        outs = parallel_apply(replicas, scatter(torch.randn(4, 2), simulated(2)))
    assert all(o.is_inference() for o in outs)


def test_parallel_apply_carries_autocast_into_the_threads():
    replicas = replicate(nn.Linear(4, 4), simulated(2))
    inputs = scatter(torch.randn(4, 4), simulated(2))
    assert {o.dtype for o in parallel_apply(replicas, inputs)} == {torch.float32}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert {o.dtype for o in parallel_apply(replicas, inputs)} == {torch.bfloat16}


class FailsOnSecondChunk(nn.Module):
    def forward(self, x):
        if x[0, 0] > 0:
            raise ValueError("this chunk is bad")
        return x


def test_an_exception_in_a_replica_is_raised_in_the_caller_naming_the_replica_and_its_device():
    x = torch.tensor([[-1.0], [1.0]])
    with pytest.raises(ValueError, match=r"in replica 1 on device cpu: this chunk is bad") as info:
        data_parallel(FailsOnSecondChunk(), x, simulated(2))
    original = info.value.__cause__
    assert isinstance(original, ValueError) and str(original) == "this chunk is bad"
    frames = [f.name for f in traceback.extract_tb(original.__traceback__)]
    assert frames[-1] == "forward"  # the replica's own traceback, down to the line that raised


def test_an_exception_that_cannot_be_rebuilt_arrives_as_a_runtime_error_with_the_original_chained():
    class Picky(Exception):
        def __init__(self, code, detail):
            super().__init__(code, detail)

    class Raises(nn.Module):
        def forward(self, x):
            raise Picky(7, "detail")

    with pytest.raises(RuntimeError, match=r"Caught Picky in replica 0 on device cpu") as info:
        parallel_apply([Raises()], [torch.zeros(1)], devices=["cpu"])
    assert isinstance(info.value.__cause__, Picky)


def test_parallel_apply_wants_one_input_per_module():
    with pytest.raises(ValueError, match="2 modules but 1 inputs"):
        parallel_apply([nn.Identity(), nn.Identity()], [torch.zeros(1)])


# ---------------------------------------------------------------------------------------------------------------
# gather
# ---------------------------------------------------------------------------------------------------------------
def test_gather_concatenates_tensors_inside_tuples_lists_dicts_and_namedtuples():
    a, b = torch.randn(3, 2), torch.randn(2, 2)
    outs = [(a, [a], {"z": a, "n": None, "s": "same"}, Pair(a, a)), (b, [b], {"z": b, "n": None, "s": "same"},
                                                                     Pair(b, b))]
    t, (l0,), d, pair = gather(outs, "cpu")
    ab = torch.cat([a, b])
    assert torch.equal(t, ab) and torch.equal(l0, ab) and torch.equal(d["z"], ab)
    assert d["n"] is None and d["s"] == "same" and type(pair) is Pair and torch.equal(pair.y, ab)


def test_gather_is_differentiable():
    a, b = torch.randn(3, 2, requires_grad=True), torch.randn(2, 2, requires_grad=True)
    (gather([a, b], "cpu") * 3).sum().backward()
    assert torch.equal(a.grad, torch.full((3, 2), 3.0)) and torch.equal(b.grad, torch.full((2, 2), 3.0))


def test_gather_along_another_dimension():
    assert gather([torch.zeros(2, 3), torch.zeros(2, 1)], "cpu", dim=1).shape == (2, 4)


def test_gather_of_per_replica_scalars_returns_one_entry_per_replica_with_a_warning():
    with pytest.warns(UserWarning, match="scalars"):
        v = gather([torch.tensor(1.0), torch.tensor(2.0)], "cpu")
    assert torch.equal(v, torch.tensor([1.0, 2.0]))


def test_gather_lists_the_shapes_when_the_other_dimensions_differ():
    with pytest.raises(ValueError, match=r"same shape in every other dimension.*got \(3, 2\), \(2, 5\)"):
        gather([torch.zeros(3, 2), torch.zeros(2, 5)], "cpu")


def test_gather_names_the_valid_range_when_the_dimension_is_out_of_range():
    with pytest.raises(ConfigError, match=r"dim=3 is out of range .* from -2 to 1"):
        gather([torch.zeros(3, 2), torch.zeros(2, 2)], "cpu", dim=3)


def test_gather_refuses_values_it_cannot_combine():
    with pytest.raises(ConfigError, match="Return a tensor instead"):
        gather([("a", torch.zeros(1)), ("b", torch.zeros(1))], "cpu")


# ---------------------------------------------------------------------------------------------------------------
# data_parallel and device checks
# ---------------------------------------------------------------------------------------------------------------
class Recorder(nn.Module):
    """Remembers which module object ran and on how many rows (the list is shared with every replica)."""

    def __init__(self):
        super().__init__()
        self.lin, self.calls, self.lock = nn.Linear(2, 2), [], threading.Lock()

    def forward(self, x=None):
        with self.lock:
            self.calls.append((self, None if x is None else x.shape[0]))
        return self.lin(torch.ones(1, 2) if x is None else x)


def test_empty_device_ids_call_the_module_directly():
    net = Recorder()
    data_parallel(net, torch.randn(5, 2), [])
    assert net.calls == [(net, 5)]


def test_a_batch_smaller_than_the_device_count_uses_only_as_many_replicas_as_chunks():
    net = Recorder()
    out = data_parallel(net, torch.randn(2, 2), simulated(4))
    assert out.shape == (2, 2)
    assert sorted(rows for _, rows in net.calls) == [1, 1]
    assert all(module is not net for module, _ in net.calls)


def test_a_module_without_inputs_runs_once():
    net = Recorder()
    assert data_parallel(net, None, simulated(3)).shape == (1, 2)
    assert len(net.calls) == 1


def test_a_gpu_that_does_not_exist_is_refused_saying_how_many_there_are():
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = f"cuda:{have + 6}"
    expected = "no CUDA GPU" if have == 0 else f"{have} CUDA GPU"
    with pytest.raises(ValueError, match=rf"{missing} does not exist: this machine has {expected}"):
        data_parallel(nn.Linear(2, 2), torch.randn(4, 2), [missing])
    with pytest.raises(ValueError, match=rf"{missing} does not exist"):
        gather([torch.zeros(1)], missing)


def test_mixing_gpus_and_the_cpu_is_refused_in_pytorchs_words():
    # PyTorch raises "ValueError: Expected a non cpu device, but got: cpu" here (compared on GPUs below).
    with pytest.raises(ValueError, match=r"^Expected a non cpu device, but got: cpu\. .*\['cpu'\] \* k"):
        replicate(nn.Linear(2, 2), ["cuda:0", "cpu"])


def test_a_single_device_instead_of_a_list_is_explained():
    with pytest.raises(DeviceError, match="must be a list of devices"):
        data_parallel(nn.Linear(2, 2), torch.randn(4, 2), "cpu")


def test_data_parallel_checks_its_device_list_once_and_the_steps_do_not_check_again(monkeypatch):
    import mparlib.parallel

    seen = []

    def counted(name):
        real = getattr(mparlib.parallel, name)
        return lambda *args, **kwargs: seen.append(name) or real(*args, **kwargs)

    for name in ("check_devices", "check_device"):
        monkeypatch.setattr(mparlib.parallel, name, counted(name))
    data_parallel(nn.Linear(2, 2), torch.randn(5, 2), simulated(3))
    assert seen == ["check_devices"]
    seen.clear()
    replicate(nn.Linear(2, 2), simulated(2))
    scatter(torch.randn(4, 2), simulated(2))
    gather([torch.zeros(1)], "cpu")
    assert seen == ["check_devices", "check_devices", "check_device"]  # each primitive called directly checks


def test_simulated_data_parallel_checks_its_devices_when_it_is_built():
    from mparlib.step import SimulatedDataParallel

    with pytest.raises(DeviceError, match="devices='tpu' is not a device"):
        SimulatedDataParallel(nn.Linear(2, 2), ["cpu", "tpu"])
    with pytest.raises(DeviceError, match="must be a list of devices"):
        SimulatedDataParallel(nn.Linear(2, 2), "cpu")
    sim = SimulatedDataParallel(nn.Linear(2, 2), simulated(2))
    assert sim.devices == [CPU, CPU] and sim(torch.randn(4, 2)).shape == (4, 2)


# ---------------------------------------------------------------------------------------------------------------
# AttrDataParallel
# ---------------------------------------------------------------------------------------------------------------
class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 3)
        self.temperature = 0.5
        self.scale = nn.Parameter(torch.ones(1))
        self.register_buffer("class_counts", torch.arange(3.0))
        self.device_ids = "the model's own device_ids"  # names that DataParallel also has:
        self.module = nn.Identity()                     # the wrapper's must win

    @property
    def num_classes(self):
        return self.encoder.out_features

    def embed(self, x):
        return self.encoder(x) * self.scale

    def forward(self, x):
        return self.embed(x) / self.temperature


def wrap(net, cls=AttrDataParallel):
    device = "cuda:0" if torch.cuda.is_available() else "cpu"  # DataParallel wants the model on device 0
    return cls(net.to(device)), device


def test_attributes_methods_properties_and_submodules_of_the_wrapped_module_are_reachable():
    net = Classifier()
    dp, device = wrap(net)
    assert dp.temperature == 0.5
    assert dp.num_classes == 3
    assert dp.encoder is net.encoder
    assert dp.scale is net.scale and dp.class_counts is net.class_counts
    x = torch.randn(2, 4, device=device)
    torch.testing.assert_close(dp.embed(x), net.embed(x))


def test_dataparallels_own_names_win_over_the_wrapped_modules():
    net = Classifier()
    dp, device = wrap(net)
    assert dp.module is net
    assert dp.device_ids == nn.DataParallel(Classifier().to(device)).device_ids
    assert dp.forward.__self__ is dp
    dp.eval()
    net.train()
    assert dp.training is False and net.training is True


def test_the_wrapper_still_computes_the_wrapped_modules_output():
    torch.manual_seed(0)
    net = Classifier().double()
    dp, device = wrap(net)
    x = torch.randn(6, 4, dtype=torch.float64, device=device)
    torch.testing.assert_close(dp(x), net(x), rtol=1e-12, atol=1e-12)


def test_an_unknown_name_says_that_neither_the_wrapper_nor_the_module_has_it():
    dp, _ = wrap(Classifier())
    with pytest.raises(AttributeError, match="neither 'AttrDataParallel' nor the module it wraps "
                                             r"\('Classifier'\) has an attribute 'no_such_thing'"):
        dp.no_such_thing


def test_an_error_inside_a_property_of_the_wrapped_module_reads_as_on_the_plain_module():
    class Broken(nn.Module):
        @property
        def size(self):
            return self.missing_inside

    net = Broken()
    with pytest.raises(AttributeError) as plain:
        net.size
    dp, _ = wrap(net)
    with pytest.raises(AttributeError) as wrapped:
        dp.size
    assert str(wrapped.value) == str(plain.value)


def test_the_wrapper_survives_deepcopy_and_pickle():
    dp, _ = wrap(Classifier())
    for clone in (copy.deepcopy(dp), pickle.loads(pickle.dumps(dp))):
        assert clone.temperature == 0.5 and clone.module is not dp.module


class TutorialDataParallel(nn.DataParallel):
    """The one-line attribute forwarding as the tutorial publishes it."""

    def __getattr__(self, name):
        return getattr(self.module, name)


def test_the_tutorials_one_line_getattr_recurses_forever():
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(300)  # fail fast; the default limit only makes the same error slower
    try:
        for name in ("temperature", "module"):  # even the wrapped module itself cannot be reached
            with pytest.raises(RecursionError):
                # (on a one-GPU machine DataParallel.__init__ already reads self.module and recurses there)
                getattr(TutorialDataParallel(Classifier()), name)
    finally:
        sys.setrecursionlimit(limit)


# ---------------------------------------------------------------------------------------------------------------
# unwrap and checkpoints
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_unwrap_finds_the_plain_module_under_every_wrapper():
    net = Classifier()
    assert unwrap(net) is net
    assert unwrap(nn.DataParallel(net)) is net
    assert unwrap(AttrDataParallel(nn.DataParallel(net))) is net
    assert unwrap(torch.compile(net)) is net


def test_unwrap_sees_through_distributed_data_parallel(tmp_path):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed with gloo and no process group running")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        net = nn.Linear(2, 2)
        assert unwrap(nn.parallel.DistributedDataParallel(net)) is net
    finally:
        dist.destroy_process_group()


def bits(t):
    """The raw bytes of a tensor, so that equality means bit for bit (-0.0 differs from 0.0)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and sa[key].shape == sb[key].shape, key
        assert torch.equal(bits(sa[key]), bits(sb[key])), key


def trained_convnet(seed):
    torch.manual_seed(seed)
    net = ConvNet().train()
    net(torch.randn(8, 1, 8, 8))  # moves the BatchNorm running statistics away from their defaults
    return net


def test_checkpoints_round_trip_plain_to_wrapped_to_plain_bit_for_bit(tmp_path):
    original = trained_convnet(0)
    save_checkpoint(original, tmp_path / "plain.pt", epoch=3)

    wrapped = AttrDataParallel(trained_convnet(1))
    assert load_checkpoint(wrapped, tmp_path / "plain.pt") == {"epoch": 3}
    assert_same_state(wrapped.module, original)
    save_checkpoint(wrapped, tmp_path / "wrapped.pt")
    assert all(not k.startswith("module.") for k in torch.load(tmp_path / "wrapped.pt")["model"])

    again = trained_convnet(2)
    load_checkpoint(again, tmp_path / "wrapped.pt")
    assert_same_state(again, original)
    assert again.features[1].num_batches_tracked.item() == 1


def test_a_bare_state_dict_saved_from_dataparallel_loads_into_a_plain_model(tmp_path):
    original = trained_convnet(0)
    torch.save(nn.DataParallel(original).state_dict(), tmp_path / "dp.pt")  # keys start with "module."
    plain = trained_convnet(1)
    assert load_checkpoint(plain, tmp_path / "dp.pt") == {}
    assert_same_state(plain, original)


def test_extra_values_such_as_the_optimizer_state_come_back(tmp_path):
    net = nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(4, 3)).sum().backward()
    opt.step()
    save_checkpoint(nn.DataParallel(net), tmp_path / "ckpt.pt", optimizer=opt.state_dict(), epoch=5)
    extra = load_checkpoint(nn.Linear(3, 2), tmp_path / "ckpt.pt")
    assert extra["epoch"] == 5
    buf = extra["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(buf, opt.state_dict()["state"][0]["momentum_buffer"])


def test_a_checkpoint_that_does_not_match_lists_missing_and_unexpected_keys(tmp_path):
    save_checkpoint(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)), tmp_path / "two.pt")
    target = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    before = copy.deepcopy(target)
    with pytest.raises(CheckpointMismatchError) as info:
        load_checkpoint(target, tmp_path / "two.pt")
    message = str(info.value)
    assert "missing from the checkpoint (3): 1.num_batches_tracked, 1.running_mean, 1.running_var" in message
    assert info.value.shapes == [("1.weight", (2, 3), (3,)), ("1.bias", (2,), (3,))]
    assert "shape of '1.weight': checkpoint (2, 3), model (3,)" in message
    assert_same_state(target, before)  # nothing was half-loaded


def test_unexpected_keys_are_listed_and_strict_false_loads_the_rest_with_a_warning(tmp_path):
    save_checkpoint(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)), tmp_path / "two.pt")
    target = nn.Sequential(nn.Linear(3, 3))
    with pytest.raises(CheckpointMismatchError, match=r"unexpected in the checkpoint \(2\): 1.bias, 1.weight"):
        load_checkpoint(target, tmp_path / "two.pt")
    with pytest.warns(UserWarning, match=r"unexpected in the checkpoint \(2\): 1.bias, 1.weight"):
        load_checkpoint(target, tmp_path / "two.pt", strict=False)
    saved = torch.load(tmp_path / "two.pt")["model"]
    assert torch.equal(target[0].weight, saved["0.weight"])


@pytest.mark.parametrize("crash_in", ["torch.save", "os.fsync"],
                         ids=["while serialising", "after writing the temporary file"])
def test_a_failed_save_leaves_the_previous_checkpoint_intact_and_no_temporary_file(tmp_path, monkeypatch, crash_in):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(nn.Linear(2, 2), path, epoch=1)
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    module, name = crash_in.split(".")
    monkeypatch.setattr({"torch": torch, "os": os}[module], name, crash)
    with pytest.raises(CheckpointError, match="disk full") as info:
        save_checkpoint(nn.Linear(2, 2), path, epoch=2)
    assert f"could not write {path}: disk full" in str(info.value) and ".tmp" not in str(info.value)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    assert load_checkpoint(nn.Linear(2, 2), path) == {"epoch": 1}


def test_a_file_that_is_not_a_checkpoint_is_explained_when_loading(tmp_path):
    torch.save({"model_state_dict": nn.Linear(2, 2).state_dict(), "epoch": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"found \['epoch', 'model_state_dict'\]"):
        load_checkpoint(nn.Linear(2, 2), tmp_path / "other.pt")


def test_saving_never_overwrites_a_file_that_is_not_a_checkpoint(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my results")
    with pytest.raises(CheckpointError, match="not a checkpoint written by save_checkpoint; it was left untouched"):
        save_checkpoint(nn.Linear(2, 2), notes)
    assert notes.read_text() == "my results"


def test_saving_an_uninitialised_lazy_model_asks_for_a_dummy_forward(tmp_path):
    with pytest.raises(ConfigError, match="Run one dummy forward first"):
        save_checkpoint(nn.LazyLinear(2), tmp_path / "lazy.pt")
    assert not (tmp_path / "lazy.pt").exists()


def test_state_dict_of_has_no_wrapper_prefixes():
    net = Classifier()
    assert state_dict_of(AttrDataParallel(net)).keys() == net.state_dict().keys()
    assert state_dict_of(torch.compile(net)).keys() == net.state_dict().keys()


# ---------------------------------------------------------------------------------------------------------------
# On GPUs: the teaching versions against torch.nn.parallel
# ---------------------------------------------------------------------------------------------------------------
def gpus():
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


@pytest.mark.gpu
def test_on_gpus_the_teaching_primitives_match_torch_nn_parallel():
    devices = gpus()
    torch.manual_seed(0)
    net = ConvNet().double().eval().to(devices[0])
    theirs_net = copy.deepcopy(net)
    x = torch.randn(2 * len(devices) + 1, 1, 8, 8, dtype=torch.float64, device=devices[0])

    ours = data_parallel(net, x, devices)
    loss_of(ours).backward()
    theirs = nn.parallel.data_parallel(theirs_net, x, [d.index for d in devices])
    loss_of(theirs).backward()

    assert ours.device == theirs.device == devices[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(net.named_parameters(), theirs_net.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.gpu
def test_on_gpus_each_primitive_matches_its_torch_nn_parallel_counterpart():
    devices = gpus()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double().to(devices[0])
    x = torch.randn(2 * len(devices) + 1, 5, dtype=torch.float64, device=devices[0])

    ours_in, theirs_in = scatter(x, devices), nn.parallel.scatter(x, devices)
    assert [(t.shape, t.device) for t in ours_in] == [(t.shape, t.device) for t in theirs_in]
    ours_out = parallel_apply(replicate(net, devices), ours_in, devices=devices)
    theirs_out = nn.parallel.parallel_apply(nn.parallel.replicate(net, devices), list(theirs_in), devices=devices)
    for o, t in zip(ours_out, theirs_out):
        assert o.device == t.device
        torch.testing.assert_close(o, t, rtol=1e-12, atol=1e-12)
    # Gathering the same outputs gives the same bits.
    assert torch.equal(gather(theirs_out, "cpu"), nn.parallel.gather(theirs_out, "cpu"))
    assert torch.equal(gather(theirs_out, devices[0]), nn.parallel.gather(theirs_out, devices[0]))


@pytest.mark.gpu
def test_on_gpus_batchnorm_running_statistics_match_torch_nn_parallel():
    devices = gpus()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6)).double().train().to(devices[0])
    theirs_net = copy.deepcopy(net)
    x = torch.randn(3 * len(devices) + 1, 5, dtype=torch.float64, device=devices[0])
    data_parallel(net, x, devices)
    nn.parallel.data_parallel(theirs_net, x, [d.index for d in devices])
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(net[1], name), getattr(theirs_net[1], name), rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
def test_on_gpus_autocast_reaches_the_replicas_as_in_torch_nn_parallel():
    devices = gpus()
    net = nn.Linear(8, 8).to(devices[0])
    x = torch.randn(4 * len(devices), 8, device=devices[0])
    with torch.autocast("cuda", dtype=torch.float16):
        ours = data_parallel(net, x, devices)
        theirs = nn.parallel.data_parallel(net, x, [d.index for d in devices])
    assert ours.dtype == theirs.dtype == torch.float16


@pytest.mark.gpu
def test_on_gpus_mixing_a_gpu_and_the_cpu_gives_pytorchs_error():
    net = nn.Linear(2, 2).to("cuda:0")
    with pytest.raises(Exception) as theirs:
        nn.parallel.replicate(net, ["cuda:0", "cpu"])
    with pytest.raises(type(theirs.value)) as ours:
        replicate(net, ["cuda:0", "cpu"])
    assert str(ours.value).startswith(str(theirs.value))


@pytest.mark.gpu
def test_on_gpus_a_gpu_past_the_last_one_is_refused_saying_how_many_exist():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"cuda:{n} does not exist: this machine has {n} CUDA GPU"):
        replicate(nn.Linear(2, 2).to("cuda:0"), [f"cuda:{i}" for i in range(n + 1)])


# ---------------------------------------------------------------------------------------------------------------
# AttrDataParallel's lookup order on machines with and without a GPU
# ---------------------------------------------------------------------------------------------------------------
class NamesLikeDataParallel(Classifier):
    """A model whose plain attributes share every name that DataParallel sets on a GPU machine."""

    def __init__(self):
        super().__init__()
        self.dim, self.output_device, self.src_device_obj = "model's dim", "model's device", "model's src"


def names_dataparallel_sets_with_gpus(monkeypatch):
    """The instance attributes nn.DataParallel.__init__ sets when it sees GPUs (two, simulated)."""
    dp_module = sys.modules[nn.DataParallel.__module__]
    with monkeypatch.context() as m:
        m.setattr(dp_module, "_get_available_device_type", lambda: "cuda")
        m.setattr(dp_module, "_get_all_device_indices", lambda: [0, 1])
        m.setattr(dp_module, "_check_balance", lambda device_ids: None)
        reference = nn.DataParallel(nn.Linear(2, 2))
    return set(vars(reference)) - set(vars(nn.Module()))


def test_dataparallels_names_win_on_machines_with_and_without_gpus(monkeypatch):
    names = names_dataparallel_sets_with_gpus(monkeypatch)
    assert {"dim", "output_device", "src_device_obj", "device_ids"} <= names
    net = NamesLikeDataParallel()
    dp, _ = wrap(net)
    for name in names:
        assert name in vars(dp), f"{name} would fall through to the wrapped model"
        assert getattr(dp, name) != getattr(net, name), name
    assert dp.dim == 0 and dp.module is net
    assert dp.temperature == 0.5  # names DataParallel does not have still reach the model
    if not torch.cuda.is_available():
        assert dp.output_device is None and dp.src_device_obj is None and dp.device_ids == []
        plain = nn.DataParallel(NamesLikeDataParallel())
        assert "dim" not in vars(plain)  # the cause: without a GPU, DataParallel.__init__ stops early


# ---------------------------------------------------------------------------------------------------------------
# Bad arguments: a clear error of the course's classes, before anything runs
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, error, match", [
    (lambda: replicate(lambda x: x, simulated(2)), ConfigError, "replicate copies an nn.Module, got function"),
    (lambda: replicate(nn.Linear(2, 2), []), DeviceError, "is empty"),
    (lambda: scatter(torch.zeros(4, 2), simulated(2), dim=0.5), ConfigError, "dim=0.5 must be an int"),
    (lambda: scatter(torch.zeros(4, 2), simulated(2), dim=True), ConfigError, "dim=True must be an int"),
    (lambda: scatter(torch.zeros(4, 2), "cpu"), DeviceError, "must be a list of devices"),
    (lambda: scatter_kwargs((torch.zeros(4),), [("mask", 1)], simulated(2)), ConfigError,
     "kwargs must be a dict of keyword arguments, got list"),
    (lambda: parallel_apply(nn.Linear(2, 2), [torch.zeros(1, 2)]), ConfigError, "modules must be a list"),
    (lambda: parallel_apply([nn.Identity()], torch.zeros(1, 2)), ConfigError, "inputs must be a list"),
    (lambda: parallel_apply([nn.Identity()], [torch.zeros(1)], [{}, {}]), ConfigError, "1 modules but 2 kwargs_tup"),
    (lambda: parallel_apply([nn.Identity()], [torch.zeros(1)], devices=["cpu", "cpu"]), ConfigError,
     "1 modules but 2 devices"),
    (lambda: parallel_apply([nn.Identity()], [torch.zeros(1)], devices=["tpu"]), DeviceError, "not a device"),
    (lambda: gather(torch.zeros(4, 2), "cpu"), ConfigError, "outputs must be a list .* got Tensor"),
    (lambda: gather([], "cpu"), ConfigError, "gather got no outputs"),
    (lambda: gather([torch.zeros(1)], "tpu"), DeviceError, "target_device='tpu' is not a device"),
    (lambda: gather([torch.zeros(1), None], "cpu"), ConfigError, "is a tensor on some replicas and not on others"),
    (lambda: gather([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}], "cpu"), ConfigError, "different keys"),
    (lambda: gather([[torch.zeros(1)], [torch.zeros(1)] * 2], "cpu"), ConfigError, "different lengths"),
    (lambda: data_parallel(nn.Linear(2, 2), torch.zeros(4, 2), None), ConfigError, "device_ids=None"),
    (lambda: data_parallel(nn.Linear(2, 2), torch.zeros(4, 2), simulated(2), module_kwargs=[1]), ConfigError,
     "module_kwargs must be a dict"),
    (lambda: data_parallel(nn.Linear(2, 2), torch.zeros(4, 2), simulated(2), output_device="cuda:99"), DeviceError,
     "output_device=cuda:99 does not exist"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_arguments_to_the_primitives_are_explained(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_errors_speak_japanese_in_the_japanese_edition(monkeypatch):
    monkeypatch.setenv("MPARLIB_LANG", "ja")
    with pytest.raises(ConfigError, match="scatter の dim=2 は、形 \\(5, 3\\) のテンソルの範囲外です"):
        scatter(torch.zeros(5, 3), simulated(2), dim=2)
    with pytest.raises(ConfigError, match="遅延パラメータ"):
        replicate(nn.LazyLinear(2), simulated(2))
    with pytest.raises(ValueError, match="デバイス cpu のレプリカ 1 で ValueError が発生しました: this chunk is bad"):
        data_parallel(FailsOnSecondChunk(), torch.tensor([[-1.0], [1.0]]), simulated(2))
