"""The course's models: d2l's modified ResNet-18 with ordinary (non-lazy) layers, and weight init.

d2l builds its ResNet-18 from ``LazyConv2d``/``LazyBatchNorm2d``: their parameters only exist after a first
forward pass, so a weight init that runs earlier silently skips them. Here every layer knows its input
channels, so the model can be initialised, wrapped and replicated right after it is built.
Explained in 05_multi_gpu_resnet.
"""
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parameter import is_lazy

from .checks import finite_float, flag, positive_int
from .errors import ConfigError
from .lang import tr


def _check_net(net, what):
    if not isinstance(net, nn.Module):
        raise ConfigError(tr(f"{what} takes a model (an nn.Module), got {type(net).__name__}.",
                             f"{what} にはモデル（nn.Module）を渡してください。渡されたのは {type(net).__name__} です。"))


class Residual(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm, plus a shortcut. Explained in 05_multi_gpu_resnet.

    ``Residual(64, 128, use_1x1conv=True, strides=2)`` maps ``(N, 64, H, W)`` to ``(N, 128, H/2, W/2)``.
    Attribute names and their order (conv1, conv2, conv3, bn1, bn2) follow d2l's block, so the two models'
    parameters line up one to one.
    """

    def __init__(self, in_channels, out_channels, use_1x1conv=False, strides=1):
        super().__init__()
        for name, value in (("in_channels", in_channels), ("out_channels", out_channels), ("strides", strides)):
            positive_int(value, name, 64, "Residual")
        flag(use_1x1conv, "use_1x1conv", "Residual")
        if not use_1x1conv and (in_channels != out_channels or strides != 1):
            raise ConfigError(tr(
                f"Residual({in_channels}, {out_channels}, strides={strides}) changes the shape, so the shortcut "
                "needs a 1x1 convolution: pass use_1x1conv=True.",
                f"Residual({in_channels}, {out_channels}, strides={strides}) は形を変えるので、ショートカットに "
                "1x1 の畳み込みが必要です。use_1x1conv=True を指定してください。"))
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, stride=strides)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1)
        self.conv3 = nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=strides) if use_1x1conv else None
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)

    def forward(self, X):
        Y = F.relu(self.bn1(self.conv1(X)))
        Y = self.bn2(self.conv2(Y))
        if self.conv3 is not None:
            X = self.conv3(X)
        return F.relu(Y + X)


def _resnet_block(in_channels, out_channels, num_residuals, first_block=False):
    """A stage of ``num_residuals`` blocks; all but the first stage halve height and width."""
    blk = []
    for i in range(num_residuals):
        if i == 0 and not first_block:
            blk.append(Residual(in_channels, out_channels, use_1x1conv=True, strides=2))
        else:
            blk.append(Residual(out_channels, out_channels))
    return nn.Sequential(*blk)


def resnet18(num_classes, in_channels=1, width=64):
    """d2l's modified ResNet-18 (3x3 stem, no max-pool) with ordinary layers. Explained in 05_multi_gpu_resnet.

    Input ``(N, in_channels, H, W)`` -> logits ``(N, num_classes)``. ``width`` is the number of channels of the stem
    and the first stage; the stages have ``width``, ``2 width``, ``4 width`` and ``8 width`` channels. ``width=64``
    is d2l's network: 11,175,818 parameters for 10 classes and one input channel, the same as ``d2l.resnet18(10)``
    after its first forward pass. A smaller width keeps every layer, shape and stride and only narrows the
    channels (``width=16``: about 1/16 of the arithmetic, for quick runs on a CPU).
    """
    positive_int(num_classes, "num_classes", 10, "resnet18")
    positive_int(in_channels, "in_channels", 1, "resnet18")
    w = positive_int(width, "width", 64, "resnet18")
    net = nn.Sequential(
        nn.Conv2d(in_channels, w, kernel_size=3, stride=1, padding=1),  # (N, w, H, W)
        nn.BatchNorm2d(w),
        nn.ReLU(),
    )
    net.add_module("resnet_block1", _resnet_block(w, w, 2, first_block=True))  # (N, w, H, W)
    net.add_module("resnet_block2", _resnet_block(w, 2 * w, 2))  # (N, 2w, H/2, W/2)
    net.add_module("resnet_block3", _resnet_block(2 * w, 4 * w, 2))  # (N, 4w, H/4, W/4)
    net.add_module("resnet_block4", _resnet_block(4 * w, 8 * w, 2))  # (N, 8w, H/8, W/8)
    net.add_module("global_avg_pool", nn.AdaptiveAvgPool2d((1, 1)))  # (N, 8w, 1, 1)
    net.add_module("fc", nn.Sequential(nn.Flatten(), nn.Linear(8 * w, num_classes)))  # (N, num_classes)
    return net


def lazy_modules(net):
    """Names of the submodules whose parameters do not exist yet (lazy layers before a forward). Explained in 05_multi_gpu_resnet."""
    _check_net(net, "lazy_modules")
    return [name for name, m in net.named_modules()
            if any(is_lazy(p) for p in m.parameters(recurse=False))
            or any(is_lazy(b) for b in m.buffers(recurse=False))]


def num_params(net):
    """Number of parameters of a model; raises a clear error if some are still lazy. Explained in 05_multi_gpu_resnet."""
    _check_net(net, "num_params")
    lazy = lazy_modules(net)
    if lazy:
        raise ConfigError(tr(f"{len(lazy)} layer(s) are lazy and have no parameters yet (e.g. {lazy[0]!r}): "
                             "run one forward pass on an example batch first.",
                             f"{len(lazy)}個の層が遅延層で、まだパラメータがありません（例: {lazy[0]!r}）。先に例の"
                             "バッチで順伝播を 1回実行してください。"))
    return sum(p.numel() for p in net.parameters())


def init_weights(net, example_input=None, *, std=0.01):
    """Draw every Conv2d/Linear weight from N(0, std^2), lazy layers included. Explained in 05_multi_gpu_resnet.

    As d2l's ``init_weights`` for the weights; in addition biases become zero and batch-norm layers are reset
    (scale 1, shift 0, fresh running statistics), so a second training run on the same model starts afresh.
    Lazy layers are first materialised by one forward pass on ``example_input`` (e.g. ``torch.zeros(1, 1, 28, 28)``)
    without gradients; without an example, a model with lazy layers raises a clear error instead of
    silently keeping them at their default init. Returns the number of Conv2d/Linear weights initialised.
    """
    _check_net(net, "init_weights")
    finite_float(std, "std", 0.01, "init_weights")
    if example_input is not None and not isinstance(example_input, torch.Tensor):
        raise ConfigError(tr(f"init_weights: example_input must be a tensor batch such as torch.zeros(1, 1, 28, 28), "
                             f"got {type(example_input).__name__}.",
                             "init_weights: example_input には torch.zeros(1, 1, 28, 28) のようなテンソルのバッチを"
                             f"渡してください。渡されたのは {type(example_input).__name__} です。"))
    lazy = lazy_modules(net)
    if lazy:
        if example_input is None:
            raise ConfigError(tr(
                f"{len(lazy)} layer(s) are lazy and have no weights yet (e.g. {lazy[0]!r}). Pass an example batch, "
                "e.g. init_weights(net, torch.zeros(1, 1, 28, 28)), so they can be created before initialisation.",
                f"{len(lazy)}個の層が遅延層で、まだ重みがありません（例: {lazy[0]!r}）。初期化の前に層を作れるよう、"
                "init_weights(net, torch.zeros(1, 1, 28, 28)) のように例のバッチを渡してください。"))
        was_training = net.training
        net.eval()  # no BatchNorm statistics update from the dummy batch
        with torch.no_grad():
            net(example_input)
        net.train(was_training)
    count = 0
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
                count += 1
            elif isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.reset_parameters()  # weight 1, bias 0, running mean 0, running var 1
    return count
