"""mparlib.models: the non-lazy ResNet-18 is d2l's ResNet-18, and init_weights reaches every layer."""
import pytest
import torch
from torch import nn

from mparlib import models

d2l = pytest.importorskip("d2l.torch")


def d2l_resnet18(num_classes=10, in_channels=1, size=28):
    """d2l's model with its lazy parameters created by one forward pass."""
    net = d2l.resnet18(num_classes, in_channels)
    net.eval()
    with torch.no_grad():
        net(torch.zeros(2, in_channels, size, size))
    return net


def shapes(net):
    return [(name, tuple(p.shape)) for name, p in net.named_parameters()]


def test_resnet18_has_d2l_parameters_in_order():
    ours, ref = models.resnet18(10), d2l_resnet18(10)
    assert [s for _, s in shapes(ours)] == [s for _, s in shapes(ref)]
    assert [n for n, _ in shapes(ours)] == [n for n, _ in shapes(ref)]  # same names too: state dicts interchange
    count = sum(p.numel() for p in ref.parameters())
    assert count == 11_175_818
    assert models.num_params(ours) == count
    assert [(n, tuple(b.shape)) for n, b in ours.named_buffers()] == [(n, tuple(b.shape)) for n, b in ref.named_buffers()]


def test_resnet18_computes_what_d2l_computes():
    torch.manual_seed(0)
    ref = d2l_resnet18(10)
    ours = models.resnet18(10)
    ours.load_state_dict(ref.state_dict())
    X = torch.randn(4, 1, 28, 28)
    for mode in (False, True):  # running statistics, then batch statistics
        ours.train(mode)
        ref.train(mode)
        with torch.no_grad():
            torch.testing.assert_close(ours(X), ref(X), rtol=0, atol=0)


def test_resnet18_other_channels_and_classes():
    ours, ref = models.resnet18(5, in_channels=3), d2l_resnet18(5, in_channels=3, size=32)
    assert shapes(ours) == shapes(ref)
    assert ours(torch.zeros(2, 3, 32, 32)).shape == (2, 5)


def test_resnet18_is_not_lazy():
    net = models.resnet18(10)
    assert models.lazy_modules(net) == []
    assert len(models.lazy_modules(d2l.resnet18(10))) == 35  # 19 convolutions and 16 batch norms of the blocks
    with pytest.raises(ValueError, match="lazy"):
        models.num_params(d2l.resnet18(10))


@pytest.mark.parametrize("bad", [0, -1, 2.5, "10"])
def test_resnet18_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="positive int"):
        models.resnet18(bad)
    with pytest.raises(ValueError, match="positive int"):
        models.resnet18(10, in_channels=bad)


def test_residual_shapes_and_shortcut_check():
    blk = models.Residual(64, 128, use_1x1conv=True, strides=2)
    assert blk(torch.zeros(2, 64, 28, 28)).shape == (2, 128, 14, 14)
    assert models.Residual(8, 8)(torch.zeros(1, 8, 5, 5)).shape == (1, 8, 5, 5)
    with pytest.raises(ValueError, match="use_1x1conv=True"):
        models.Residual(64, 128)


def conv_linear(net):
    return [m for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


def test_init_weights_reaches_lazy_layers_that_d2ls_check_skips():
    torch.manual_seed(0)
    # d2l's way: a type check before any forward pass only sees the stem convolution and the final layer
    net = d2l.resnet18(10)
    seen = [m for m in net.modules() if type(m) in (nn.Linear, nn.Conv2d)]
    assert len(seen) == 2
    # ours: materialise with the example, then initialise all 21 layers
    with pytest.raises(ValueError, match="example"):
        models.init_weights(net)
    assert models.init_weights(net, torch.zeros(1, 1, 28, 28)) == 21
    assert models.lazy_modules(net) == []
    layers = conv_linear(net)
    assert len(layers) == 21
    for m in layers:
        assert abs(float(m.weight.detach().std()) - 0.01) < 0.0015, m
        assert m.bias is None or not m.bias.any()


def test_init_weights_resets_batch_norm():
    net = models.resnet18(10)
    net.train()
    with torch.no_grad():
        net(torch.randn(4, 1, 28, 28) * 3 + 1)  # moves the running statistics away from 0 and 1
    bn = net[1]
    assert bn.num_batches_tracked == 1 and bn.running_mean.abs().sum() > 0
    models.init_weights(net)
    assert bn.num_batches_tracked == 0
    assert torch.equal(bn.running_mean, torch.zeros(64)) and torch.equal(bn.running_var, torch.ones(64))
    assert net.training  # init leaves the mode as it was


def test_init_weights_keeps_mode_when_materialising():
    net = nn.Sequential(nn.LazyConv2d(4, 3), nn.LazyBatchNorm2d(), nn.Flatten(), nn.LazyLinear(3))
    net.train()
    models.init_weights(net, torch.zeros(2, 1, 6, 6))
    assert net.training
    assert net[1].num_batches_tracked == 0  # the example did not count as a training batch


@pytest.mark.parametrize("call, match", [
    (lambda: models.resnet18(True), "resnet18: num_classes=True: use a positive int"),
    (lambda: models.resnet18(10, in_channels=False), "resnet18: in_channels=False: use a positive int"),
    (lambda: models.Residual(8, 8, strides=0), "Residual: strides=0: use a positive int"),
    (lambda: models.Residual(8, 8.0), "Residual: out_channels=8.0: use a positive int"),
    (lambda: models.Residual(8, 8, use_1x1conv="no"), "use_1x1conv='no': use True or False"),
    (lambda: models.init_weights(models.resnet18(10), std=float("nan")), "std=nan: use a positive, finite number"),
    (lambda: models.init_weights(models.resnet18(10), std=0), "std=0: use a positive, finite number"),
    (lambda: models.init_weights(models.resnet18(10), std=True), "std=True"),
    (lambda: models.init_weights(d2l.resnet18(10), example_input=[[0.0]]), "example_input must be a tensor"),
    (lambda: models.init_weights("resnet18"), "init_weights takes a model"),
    (lambda: models.num_params({"w": torch.ones(2)}), "num_params takes a model"),
    (lambda: models.lazy_modules(None), "lazy_modules takes a model"),
])
def test_bad_arguments_are_refused_with_the_course_error(call, match):
    from mparlib.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        call()


def test_an_infinite_std_would_otherwise_fill_the_weights_with_infinities():
    """Why init_weights checks std itself: PyTorch's normal_ draws +-inf for std=inf without a word."""
    w = torch.empty(3, 3)
    nn.init.normal_(w, std=float("inf"))
    assert torch.isinf(w).all()
    from mparlib.errors import ConfigError

    with pytest.raises(ConfigError, match="std=inf: use a positive, finite number"):
        models.init_weights(nn.Linear(3, 3), std=float("inf"))


@pytest.mark.parametrize("width", [16, 8])
def test_a_narrower_resnet18_keeps_every_layer_and_only_scales_channels(width):
    """width=w is d2l's network with every channel count multiplied by w/64: same layers, kernels, strides."""
    wide, narrow = models.resnet18(10), models.resnet18(10, width=width)
    pairs = list(zip(wide.named_modules(), narrow.named_modules()))
    assert len(pairs) == len(list(wide.modules())) == len(list(narrow.modules()))
    scale = lambda c: c * width // 64  # noqa: E731
    for (name, a), (name_b, b) in pairs:
        assert name == name_b and type(a) is type(b), name
        if isinstance(a, nn.Conv2d):
            assert (b.kernel_size, b.stride, b.padding) == (a.kernel_size, a.stride, a.padding), name
            assert b.out_channels == scale(a.out_channels), name
            assert b.in_channels == (1 if a.in_channels == 1 else scale(a.in_channels)), name
        elif isinstance(a, nn.BatchNorm2d):
            assert b.num_features == scale(a.num_features), name
        elif isinstance(a, nn.Linear):
            assert (b.in_features, b.out_features) == (scale(a.in_features), 10), name
    X = torch.zeros(2, 1, 28, 28)
    assert narrow(X).shape == (2, 10)
    assert models.num_params(narrow) < models.num_params(wide) * (width / 64) ** 2 * 1.1  # ~ the square of the width


def test_width_64_is_the_default_and_bad_widths_are_refused():
    assert models.num_params(models.resnet18(10, width=64)) == models.num_params(models.resnet18(10)) == 11_175_818
    from mparlib.errors import ConfigError

    for bad in (0, -16, 16.0, True, "16"):
        with pytest.raises(ConfigError, match="width=.*: use a positive int"):
            models.resnet18(10, width=bad)
