"""The fast path, mparlib.fastpath (chapter 07_performance), against the classic loop it must not change.

One step of the fast path with its extras switched off equals the classic fp32 step; its optimizer equals a reference
SGD; bf16 autocast stays close to fp32; on real Fashion-MNIST a small residual network trained with the fast path
is at least as accurate as with the classic loop. Small models keep these tests to seconds; the speed itself is
measured in benchmarks/train_throughput.py, not here.
"""
import copy
import json
import math
import re

import pytest
import torch
from torch import nn

from mparlib import data, fastpath, sources
from mparlib import loop as T
from mparlib import step as S
from mparlib.errors import ConfigError, MparlibError, TrainingDiverged
from mparlib.models import Residual
from test_train import synthetic  # the same three-class toy data as the classic loop's tests

CPU = torch.device("cpu")
HAVE_REAL = all((sources.SYSTEM_DIR / (s + ".gz")).is_file() or (sources.SYSTEM_DIR / s).is_file()
                for s in sources.FILES["train"] + sources.FILES["test"])
needs_real = pytest.mark.skipif(not HAVE_REAL,
                                reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
# every extra of the fast path off: what remains must be the classic step
PLAIN = fastpath.FastPath(channels_last=False, precision="fp32", fused=False, momentum=0.0, nesterov=False,
                          weight_decay=0.0, label_smoothing=0.0, warmup=None)


def small_net(seed=0):
    """A small residual network with batch norm: (N, 1, H, W) -> (N, 10)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         Residual(16, 32, use_1x1conv=True, strides=2), Residual(32, 32),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def batch(n=16, size=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)


def fast_steps(net, fast, batches, lr):
    """Run the fast path's helpers (as train() combines them) on ``batches``; return the loss sums."""
    fast = fast.resolve(CPU)
    if fast.channels_last:
        net.to(memory_format=torch.channels_last)
    opt = fastpath.make_fast_optimizer(net, lr, fast)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=fast.label_smoothing)
    dtype = torch.bfloat16 if fast.precision == "bf16" else None
    out = []
    for X, y in batches:
        X, y = fastpath.move_batch_fast(X, y, CPU, fast.channels_last)
        out.append(S.train_step(net, X, y, loss_fn, opt, lambda: S.autocast_context(CPU, dtype))[0])
    return out


def classic_steps(net, batches, lr):
    opt, loss_fn = S.make_optimizer(net, lr), nn.CrossEntropyLoss()
    return [S.train_step(net, *S.move_batch(X, y, CPU), loss_fn, opt, lambda: S.autocast_context(CPU))[0]
            for X, y in batches]


def test_fast_step_with_extras_off_equals_the_classic_step():
    """Same start, same batches: SGD through the fast helpers (channels_last on) matches the classic fp32 step."""
    batches = [batch(seed=s) for s in range(3)]
    classic, fast = small_net(), small_net()
    losses_c = classic_steps(classic, batches, lr=0.1)
    losses_f = fast_steps(fast, fastpath.FastPath(**{**PLAIN.to_dict(), "channels_last": True}), batches, lr=0.1)
    torch.testing.assert_close(torch.stack(losses_f), torch.stack(losses_c), rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(fast.state_dict().items(), classic.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    assert fast[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_fast_optimizer_is_nesterov_sgd_with_decay_on_weights_only():
    """The fused (or foreach) optimizer equals PyTorch's reference single-tensor SGD over several steps."""
    fast = fastpath.FastPath().resolve(CPU)
    net, ref = small_net(), small_net()
    opt = fastpath.make_fast_optimizer(net, 0.05, fast)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(p) for p in net.parameters() if p.ndim > 1}
    assert all(g["momentum"] == 0.9 and g["nesterov"] for g in opt.param_groups)
    ref_opt = torch.optim.SGD([{"params": [p for p in ref.parameters() if p.ndim > 1], "weight_decay": 5e-4},
                               {"params": [p for p in ref.parameters() if p.ndim <= 1], "weight_decay": 0.0}],
                              lr=0.05, momentum=0.9, nesterov=True, foreach=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(net.parameters(), ref.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_warmup_cosine_schedule():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.4)
    sched = fastpath.warmup_cosine(opt, total_steps=50, warmup=0.2)
    lrs = []
    for _ in range(50):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    rise = lrs[:10]
    assert rise == pytest.approx([0.4 * (k + 1) / 10 for k in range(10)])  # linear up to the peak lr
    assert max(lrs) == pytest.approx(0.4) and lrs.index(max(lrs)) == 9
    assert all(a > b for a, b in zip(lrs[9:], lrs[10:]))  # then falls at every step
    assert 0 < lrs[-1] < 0.01 * 0.4  # nearly, but not exactly, zero on the last step
    assert lrs[30] == pytest.approx(0.4 * 0.5 * (1 + math.cos(math.pi * 21 / 41)))


def test_bf16_step_is_close_to_fp32():
    """bf16 autocast (any CPU can run it) changes the loss and gradients only at bf16 precision."""
    X, y = batch(32, 16)
    grads, losses = {}, {}
    for dtype in (None, torch.bfloat16):
        net = small_net()
        with S.autocast_context(CPU, dtype):
            loss = nn.functional.cross_entropy(net(X), y)
        loss.backward()
        losses[dtype] = float(loss.detach())
        grads[dtype] = torch.cat([p.grad.flatten() for p in net.parameters()])
    assert losses[torch.bfloat16] == pytest.approx(losses[None], rel=2e-2)
    cos = nn.functional.cosine_similarity(grads[None], grads[torch.bfloat16], dim=0)
    assert cos > 0.99, f"bf16 gradient direction differs: cosine {float(cos):.4f}"


def test_train_with_every_extra_off_matches_the_classic_train():
    """train(fast=...) is the same loop with other helpers: all extras off gives the classic run's numbers."""
    data_ = (synthetic(96, 16, 1), synthetic(48, 16, 2))
    runs = []
    for fast in (None, PLAIN):
        net = small_net()
        h = T.train(net, [CPU], batch_size=16, lr=0.1, num_epochs=2, data=data_, animator=False, init=False,
                    verbose=False, fast=fast)
        runs.append((h, net))
    (hc, nc), (hf, nf) = runs
    assert hc.fast is None and hf.fast["precision"] == "fp32"
    assert hf.train_loss == pytest.approx(hc.train_loss, rel=1e-6)
    assert hf.test_acc == hc.test_acc
    for (name, a), b in zip(nf.state_dict().items(), nc.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    json.dumps(hf.to_dict())  # the settings are plain data


def test_fast_train_learns_and_drops_last_batch_when_asked():
    torch.manual_seed(0)
    h = T.train(small_net(), [CPU], batch_size=16, lr=0.05, num_epochs=3,
                data=(synthetic(200, 16, 1), synthetic(96, 32, 2)), animator=False, verbose=False,
                fast=fastpath.FastPath(drop_last=True))
    assert h.test_acc[-1] >= 0.9  # chance is 1/3
    assert round(h.images_per_s[0] * h.seconds[0]) == 192  # 12 full batches; the last 8 images are skipped


def test_warm_up_leaves_the_model_as_it_was():
    """The compile warm-up runs forward and backward, then restores batch-norm statistics and drops gradients."""
    net = small_net()
    before = copy.deepcopy(net.state_dict())
    X, y = batch()
    net.train()
    fastpath.warm_up(net, net, X, y, nn.CrossEntropyLoss(), lambda: S.autocast_context(CPU), steps=2, graphs=False)
    for (name, a), b in zip(net.state_dict().items(), before.values()):
        assert torch.equal(a, b), name
    assert all(p.grad is None for p in net.parameters())


def test_settings_resolve_for_the_cpu_and_refuse_bad_values(monkeypatch):
    s = fastpath.FastPath().resolve("cpu")
    assert (s.compile, s.cuda_graphs, s.drop_last) == (False, False, False)
    assert s.precision == ("bf16" if fastpath.cpu_has_bf16() else "fp32")
    assert fastpath.FastPath(precision="fp32").resolve("cpu").precision == "fp32"
    assert fastpath.FastPath(compile=True).resolve("cpu").drop_last is True
    with pytest.raises(ValueError, match="precision"):
        fastpath.FastPath(precision="fp16").resolve("cpu")
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        fastpath.FastPath(cuda_graphs=True).resolve("cpu")
    with pytest.raises(ValueError, match="momentum"):
        fastpath.FastPath(momentum=1.0).resolve("cpu")
    with pytest.raises(ValueError, match="warmup"):
        fastpath.FastPath(warmup=1.5).resolve("cpu")
    with pytest.raises(ValueError, match="fast="):
        T.train(small_net(), [CPU], batch_size=16, lr=0.1, num_epochs=1, data=(synthetic(32, 16, 1),) * 2,
                fast="yes")
    monkeypatch.setenv("MPARLIB_LANG", "ja")
    with pytest.raises(ValueError, match="CUDA の GPU が必要"):
        fastpath.FastPath(cuda_graphs=True).resolve("cpu")


@pytest.mark.slow
@needs_real
def test_fast_path_keeps_accuracy_on_fashion_mnist():
    """Same network, data, batches and epochs: the fast path's test accuracy is not below the classic loop's."""
    subset, common = (2000, 500), dict(batch_size=64, num_epochs=2, animator=False, verbose=False, init=False)
    classic = T.train(small_net(), [CPU], lr=0.1, data=dict(subset=subset, resident=False, num_workers=0), **common)
    fast = T.train(small_net(), [CPU], lr=0.05, data=dict(subset=subset), fast=True, **common)
    assert fast.fast["resident"] and fast.fast["channels_last"]
    assert fast.test_acc[-1] > 0.5  # chance is 0.1
    assert fast.test_acc[-1] >= classic.test_acc[-1] - 0.02, (classic.test_acc, fast.test_acc)


@pytest.mark.gpu
def test_fast_step_does_not_wait_for_the_gpu():
    """Batch gathering, forward, backward, fused SGD and the schedule queue work without one host synchronisation."""
    dev = torch.device("cuda:0")
    fast = fastpath.FastPath().resolve(dev)
    net = small_net().to(dev).to(memory_format=torch.channels_last)
    opt = fastpath.make_fast_optimizer(net, 0.05, fast)
    sched = fastpath.warmup_cosine(opt, 10, 0.2)
    loader = data.ResidentLoader((torch.rand(64, 12, 12) * 255).to(torch.uint8), torch.randint(0, 10, (64,)), 16,
                                 shuffle=False, device=dev)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    X0, y0 = next(iter(loader))
    S.train_step(net, *fastpath.move_batch_fast(X0, y0, dev), loss_fn, opt,
                 lambda: S.autocast_context(dev, torch.bfloat16))
    torch.cuda.synchronize()
    total = torch.zeros((), device=dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for X, y in loader:
            total += S.train_step(net, *fastpath.move_batch_fast(X, y, dev), loss_fn, opt,
                                  lambda: S.autocast_context(dev, torch.bfloat16))[0]
            sched.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert math.isfinite(float(total))


@pytest.mark.gpu
def test_compiled_fast_path_with_cuda_graphs_learns():
    dev = torch.device("cuda:0")
    train_iter = [(X.to(dev), y.to(dev)) for X, y in synthetic(512, 32, 1)]
    test_iter = [(X.to(dev), y.to(dev)) for X, y in synthetic(256, 64, 2)]
    h = T.train(small_net(), [dev], batch_size=32, lr=0.05, num_epochs=5, data=(train_iter, test_iter),
                animator=False, verbose=False, fast=True)
    assert h.fast["compile"] and h.fast["cuda_graphs"]
    assert h.fast["precision"] == ("bf16" if fastpath.bf16_native(dev) else "fp32")
    assert h.test_acc[-1] >= 0.9


class ModelBug(Exception):
    """An error of the learner's own model, nothing to do with the compiler."""


class Broken(nn.Module):
    """small_net whose forward raises ModelBug."""

    def __init__(self):
        super().__init__()
        self.net = small_net()

    def forward(self, X):
        raise ModelBug("a bug in forward")


def failing_compile(model, **kwargs):
    """What torch.compile returns when its backend cannot build kernels: a callable that fails."""
    def compiled(*args, **kw):
        raise RuntimeError("backend compiler failed: no C++ compiler found")
    return compiled


def compile_run(net):
    return T.train(net, [CPU], batch_size=16, lr=0.05, num_epochs=1, data=(synthetic(64, 16, 1), synthetic(32, 16, 2)),
                   animator=False, verbose=False, init=False, fast=fastpath.FastPath(compile=True))


def test_a_compiler_failure_is_reported_as_one_when_eager_works(monkeypatch):
    """The same step runs eagerly, so the compiler is to blame: a ConfigError that says FastPath(compile=False)."""
    monkeypatch.setattr(torch, "compile", failing_compile)
    net = small_net()
    before = copy.deepcopy(net.state_dict())
    with pytest.raises(ConfigError, match=r"torch.compile failed on cpu .*fast=FastPath\(compile=False\)") as e:
        compile_run(net)
    assert isinstance(e.value.__cause__, RuntimeError) and "no C++ compiler" in str(e.value.__cause__)
    for (name, a), b in zip(net.state_dict().items(), before.values()):
        assert torch.equal(a, b), name  # the eager check left the model as it was
    assert all(p.grad is None for p in net.parameters())
    monkeypatch.setenv("MPARLIB_LANG", "ja")
    with pytest.raises(ConfigError, match="torch.compile が失敗しました"):
        compile_run(small_net())


@pytest.mark.parametrize("compiler", ["fails", "works"])
def test_a_bug_in_the_model_is_not_blamed_on_the_compiler(compiler, monkeypatch):
    """When the eager step fails too, the model's own exception comes out unchanged, not as a compile failure."""
    monkeypatch.setattr(torch, "compile", failing_compile if compiler == "fails" else lambda model, **kw: model)
    with pytest.raises(ModelBug, match="a bug in forward") as e:
        compile_run(Broken())
    assert not isinstance(e.value, MparlibError)
    assert e.value.__cause__ is None and e.value.__context__ is None  # not chained to the compiler's error


def test_fast_path_stops_at_the_first_non_finite_loss():
    """The fast path reads its sums only at the end of an epoch, yet names the exact first step with a NaN loss."""
    from test_train import NaNAt

    train_iter = NaNAt(synthetic(96, 16, 1), 2, 2)
    with pytest.raises(TrainingDiverged, match=r"became nan in epoch 2, step 2;") as e:
        T.train(small_net(), [CPU], batch_size=16, lr=0.05, num_epochs=3, data=(train_iter, synthetic(32, 16, 2)),
                animator=False, verbose=False, fast=True)
    assert train_iter.passes == 2 and e.value.history.epochs == 1


@pytest.mark.parametrize("setting, match", [
    (dict(weight_decay=float("inf")), "weight_decay=inf"), (dict(momentum=float("nan")), "momentum=nan"),
    (dict(warmup=float("nan")), "warmup=nan"), (dict(label_smoothing=True), "label_smoothing=True"),
    (dict(resident="no"), "resident='no'"), (dict(compile="yes"), "compile='yes'"),
    (dict(warmup_steps=2.5), "warmup_steps=2.5"),
])
def test_settings_refuse_non_finite_and_mistyped_values(setting, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        fastpath.FastPath(**setting).resolve("cpu")


def test_fast_path_with_drop_last_needs_a_batch_size():
    with pytest.raises(ConfigError, match="needs the batch size"):
        T.train(small_net(), [CPU], lr=0.05, num_epochs=1, data=(synthetic(64, 16, 1), synthetic(32, 16, 2)),
                animator=False, verbose=False, fast=fastpath.FastPath(drop_last=True))


@pytest.mark.gpu
def test_fast_epoch_does_not_wait_for_the_gpu():
    """A fast-path epoch queues its steps without a host sync: the syncs of train() (its clocks, the end-of-epoch
    reading of the sums, the evaluation) do not grow with the number of steps."""
    import warnings

    dev = torch.device("cuda:0")

    def syncs(n_batches):
        batches = [(X.to(dev), y.to(dev)) for X, y in synthetic(16 * n_batches, 16, 1)]
        test = [(X.to(dev), y.to(dev)) for X, y in synthetic(32, 16, 2)]
        net = small_net()
        T.train(net, [dev], batch_size=16, lr=0.05, num_epochs=1, data=(batches, test), animator=False,
                verbose=False, fast=fastpath.FastPath(compile=False))  # warm-up and first-step work done here
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                T.train(net, [dev], batch_size=16, lr=0.05, num_epochs=1, data=(batches, test), animator=False,
                        verbose=False, init=False, fast=fastpath.FastPath(compile=False))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in seen)

    assert syncs(4) == syncs(16)  # twelve more steps, not one more wait
