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


class Residual(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm, plus a shortcut. Explained in 05_multi_gpu_resnet.

    ``Residual(64, 128, use_1x1conv=True, strides=2)`` maps ``(N, 64, H, W)`` to ``(N, 128, H/2, W/2)``.
    Attribute names and their order (conv1, conv2, conv3, bn1, bn2) follow d2l's block, so the two models'
    parameters line up one to one.
    """

    def __init__(self, in_channels, out_channels, use_1x1conv=False, strides=1):
        super().__init__()
        if not use_1x1conv and (in_channels != out_channels or strides != 1):
            raise ValueError(
                f"Residual({in_channels}, {out_channels}, strides={strides}) changes the shape, so the shortcut "
                "needs a 1x1 convolution: pass use_1x1conv=True."
            )
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


def resnet_block(in_channels, out_channels, num_residuals, first_block=False):
    """A stage of ``num_residuals`` blocks; all but the first stage halve height and width. Explained in 05_multi_gpu_resnet."""
    blk = []
    for i in range(num_residuals):
        if i == 0 and not first_block:
            blk.append(Residual(in_channels, out_channels, use_1x1conv=True, strides=2))
        else:
            blk.append(Residual(out_channels, out_channels))
    return nn.Sequential(*blk)


def resnet18(num_classes, in_channels=1):
    """d2l's modified ResNet-18 (3x3 stem, no max-pool) with ordinary layers. Explained in 05_multi_gpu_resnet.

    Input ``(N, in_channels, H, W)`` -> logits ``(N, num_classes)``; 11,175,818 parameters for 10 classes and
    one input channel, the same as ``d2l.resnet18(10)`` after its first forward pass.
    """
    if not (isinstance(num_classes, int) and num_classes > 0):
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}.")
    if not (isinstance(in_channels, int) and in_channels > 0):
        raise ValueError(f"in_channels must be a positive int, got {in_channels!r}.")
    net = nn.Sequential(
        nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1),  # (N, 64, H, W)
        nn.BatchNorm2d(64),
        nn.ReLU(),
    )
    net.add_module("resnet_block1", resnet_block(64, 64, 2, first_block=True))  # (N, 64, H, W)
    net.add_module("resnet_block2", resnet_block(64, 128, 2))  # (N, 128, H/2, W/2)
    net.add_module("resnet_block3", resnet_block(128, 256, 2))  # (N, 256, H/4, W/4)
    net.add_module("resnet_block4", resnet_block(256, 512, 2))  # (N, 512, H/8, W/8)
    net.add_module("global_avg_pool", nn.AdaptiveAvgPool2d((1, 1)))  # (N, 512, 1, 1)
    net.add_module("fc", nn.Sequential(nn.Flatten(), nn.Linear(512, num_classes)))  # (N, num_classes)
    return net


def lazy_modules(net):
    """Names of the submodules whose parameters do not exist yet (lazy layers before a forward). Explained in 05_multi_gpu_resnet."""
    return [name for name, m in net.named_modules()
            if any(is_lazy(p) for p in m.parameters(recurse=False))
            or any(is_lazy(b) for b in m.buffers(recurse=False))]


def num_params(net):
    """Number of parameters of a model; raises a clear error if some are still lazy. Explained in 05_multi_gpu_resnet."""
    lazy = lazy_modules(net)
    if lazy:
        raise ValueError(f"{len(lazy)} layer(s) are lazy and have no parameters yet (e.g. {lazy[0]!r}): "
                         "run one forward pass on an example batch first.")
    return sum(p.numel() for p in net.parameters())


def init_weights(net, example_input=None, *, std=0.01):
    """Draw every Conv2d/Linear weight from N(0, std^2), lazy layers included. Explained in 05_multi_gpu_resnet.

    As d2l's ``init_weights`` for the weights; in addition biases become zero and batch-norm layers are reset
    (scale 1, shift 0, fresh running statistics), so a second training run on the same model starts afresh.
    Lazy layers are first materialised by one forward pass on ``example_input`` (e.g. ``torch.zeros(1, 1, 28, 28)``)
    without gradients; without an example, a model with lazy layers raises a clear error instead of
    silently keeping them at their default init. Returns the number of Conv2d/Linear weights initialised.
    """
    lazy = lazy_modules(net)
    if lazy:
        if example_input is None:
            raise ValueError(
                f"{len(lazy)} layer(s) are lazy and have no weights yet (e.g. {lazy[0]!r}). Pass an example batch, "
                "e.g. init_weights(net, torch.zeros(1, 1, 28, 28)), so they can be created before initialisation."
            )
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


# --- Chapter 4 ---
# Models that live on more than one device: an embedding table kept in host memory, and a network cut into
# stages, one per device, fed micro-batch by micro-batch. Explained in 04_hybrid_cpu_gpu.


def _as_device(device, what):
    """``device`` as a ``torch.device`` that exists on this machine, or a clear error."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{what}={device!r} is not a device; use e.g. 'cpu' or 'cuda:0'.") from e
    if device.type == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if device.index is None else device.index
        if index >= have:
            raise ValueError(
                f"{what}={str(device)!r} does not exist: PyTorch sees {have} GPU(s). Use mparlib.try_gpu(), or "
                "simulated devices such as ['cpu', 'cpu'] on a machine without enough GPUs."
            )
    return device


class HybridEmbeddingModel(nn.Module):
    """An embedding table in host (CPU) memory feeding a linear layer on ``device``. Explained in 04_hybrid_cpu_gpu.

    ``HybridEmbeddingModel(1000, 10, device="cuda:0")`` maps integer ids of shape ``(N,)`` or ``(N, L)`` to
    outputs ``(N, out)`` or ``(N, L, out)`` on ``cuda:0``. The table stays on the CPU; only the looked-up rows
    (``N x L x dim`` numbers) are copied to the device, and their gradient comes back the same way.
    ``device=None`` picks ``mparlib.try_gpu()``, which is the CPU on a machine without a GPU. ``sparse=True``
    gives the table a sparse gradient holding only the looked-up rows (``torch.optim.SGD`` accepts it).
    Do not call ``model.to("cuda")`` on it: that moves the table too (the model still works, but the split is gone).
    """

    def __init__(self, num_embeddings=1000, dim=10, out_features=None, device=None, sparse=False):
        super().__init__()
        for name, value in (("num_embeddings", num_embeddings), ("dim", dim), ("out_features", out_features)):
            if value is not None and not (isinstance(value, int) and value > 0):
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if device is None:
            from .devices import try_gpu

            device = try_gpu()
        self.device = _as_device(device, "device")
        self.embedding = nn.Embedding(num_embeddings, dim, sparse=sparse)  # weight (num_embeddings, dim), on the CPU
        self.linear = nn.Linear(dim, out_features or dim).to(self.device)  # on self.device

    def forward(self, ids):
        if ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"HybridEmbeddingModel takes integer ids (torch.long), got a {ids.dtype} tensor; "
                            "convert it with ids.long().")
        ids = ids.to(self.embedding.weight.device)  # the lookup happens where the table is (the CPU)
        n = self.embedding.num_embeddings
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise IndexError(f"ids must lie in [0, {n - 1}] for a table of {n} rows; "
                             f"got values from {int(ids.min())} to {int(ids.max())}.")
        x = self.embedding(ids)  # (N, [L,] dim) on the CPU
        x = x.to(self.device)  # the only host-to-device copy: the rows that were looked up
        return self.linear(x)  # (N, [L,] out) on self.device


def pipeline_schedule(num_stages, micro_batches):
    """The order in which :class:`PipelineModel` issues its work. Explained in 04_hybrid_cpu_gpu.

    Returns a list of ``(tick, stage, micro_batch)``: at tick ``t`` stage ``s`` works on micro-batch ``t - s``
    (a GPipe-style forward). Within a tick the last stage is issued first, so each device's queue gets work
    as early as possible. ``num_stages + micro_batches - 1`` ticks in all.
    """
    for name, value in (("num_stages", num_stages), ("micro_batches", micro_batches)):
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return [(t, s, t - s) for t in range(num_stages + micro_batches - 1)
            for s in reversed(range(num_stages)) if 0 <= t - s < micro_batches]


class PipelineModel(nn.Module):
    """A network cut into stages, one per device, run micro-batch by micro-batch. Explained in 04_hybrid_cpu_gpu.

    ``stages[i]`` is moved to ``devices[i]``. ``forward`` splits the batch (dimension 0) into ``micro_batches``
    chunks and follows :func:`pipeline_schedule`; each activation is copied to the next stage's device right
    before that stage needs it. On GPUs a call only queues work, so stage 0 can compute micro-batch ``t + 1``
    while stage 1 computes micro-batch ``t``; with ``micro_batches=1`` it is plain model parallelism, one
    device busy at a time. Devices may repeat (``["cpu", "cpu"]``) to run the same code on one device.
    The output lies on ``devices[-1]``. Layers that mix samples of a batch (``BatchNorm`` in training mode)
    see micro-batches instead of the batch, so such a model computes something different when split.
    """

    def __init__(self, stages, devices, micro_batches=1):
        super().__init__()
        stages, devices = list(stages), list(devices)
        if not stages or len(stages) != len(devices):
            raise ValueError(f"Give one device per stage: got {len(stages)} stage(s) and {len(devices)} "
                             "device(s), e.g. devices=['cuda:0', 'cuda:1'] or ['cpu', 'cpu'].")
        if not (isinstance(micro_batches, int) and micro_batches > 0):
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}.")
        self.devices = [_as_device(d, f"devices[{i}]") for i, d in enumerate(devices)]
        self.stages = nn.ModuleList(stage.to(d) for stage, d in zip(stages, self.devices))
        self.micro_batches = micro_batches

    @classmethod
    def from_sequential(cls, net, devices, split_at=None, micro_batches=1):
        """Copy an ``nn.Sequential`` and cut it before the layer indices ``split_at``. Explained in 04_hybrid_cpu_gpu.

        ``split_at=[2]`` makes stages ``net[:2]`` and ``net[2:]``; the default cuts ``net`` into ``len(devices)``
        parts of nearly equal layer counts. ``net`` itself is left where it is. Parameter names stay those of
        ``net`` behind a ``stages.<i>.`` prefix, so the two models can be compared name by name.
        """
        import copy

        if not isinstance(net, nn.Sequential):
            raise TypeError(f"from_sequential cuts an nn.Sequential, got {type(net).__name__}; "
                            "build the stages yourself and pass them to PipelineModel(stages, devices).")
        n, k = len(net), len(devices)
        if split_at is None:
            split_at = [round(i * n / k) for i in range(1, k)]
        cuts = [0, *split_at, n]
        if len(cuts) != k + 1 or any(not (a < b) for a, b in zip(cuts, cuts[1:])):
            raise ValueError(f"split_at={list(split_at)} must hold {k - 1} increasing layer indices between 1 and "
                             f"{n - 1} for {k} device(s) and a Sequential of {n} layers.")
        net = copy.deepcopy(net)
        return cls([net[a:b] for a, b in zip(cuts, cuts[1:])], devices, micro_batches)

    def forward(self, x):
        if len(x) == 0:
            raise ValueError("PipelineModel got an empty batch; pass at least one sample.")
        chunks = x.split(-(-len(x) // self.micro_batches))  # micro-batches of (almost) equal size
        acts = list(chunks)  # acts[i]: micro-batch i's latest activation, wherever it lives
        for _tick, s, i in pipeline_schedule(len(self.stages), len(chunks)):
            acts[i] = self.stages[s](acts[i].to(self.devices[s]))  # copy to stage s's device, then compute
        return torch.cat(acts) if len(acts) > 1 else acts[0]  # (N, ...) on devices[-1]
