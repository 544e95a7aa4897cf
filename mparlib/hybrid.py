"""Models that live on more than one device: an embedding table kept in host memory, and a network cut into
stages, one per device, fed micro-batch by micro-batch. Explained in 04_hybrid_cpu_gpu.
"""
import copy

import torch
from torch import nn

from .checks import flag, is_int, positive_int
from .devices import check_device, check_devices, try_gpu
from .errors import ConfigError
from .lang import tr


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
        positive_int(num_embeddings, "num_embeddings", 1000, "HybridEmbeddingModel")
        positive_int(dim, "dim", 10, "HybridEmbeddingModel")
        if out_features is not None:
            positive_int(out_features, "out_features", 10, "HybridEmbeddingModel")
        flag(sparse, "sparse", "HybridEmbeddingModel")
        self.device = check_device(try_gpu() if device is None else device, "device")
        self.embedding = nn.Embedding(num_embeddings, dim, sparse=sparse)  # weight (num_embeddings, dim), on the CPU
        self.linear = nn.Linear(dim, out_features or dim).to(self.device)  # on self.device

    def forward(self, ids):
        if not isinstance(ids, torch.Tensor):
            raise ConfigError(tr(f"HybridEmbeddingModel takes a tensor of integer ids, got {type(ids).__name__}; "
                                 "build one with torch.tensor(ids).",
                                 "HybridEmbeddingModel には整数 ID のテンソルを渡してください。渡されたのは "
                                 f"{type(ids).__name__} です。torch.tensor(ids) で作れます。"))
        if ids.dtype not in (torch.int32, torch.int64):
            raise ConfigError(tr(f"HybridEmbeddingModel takes integer ids (torch.long), got a {ids.dtype} tensor; "
                                 "convert it with ids.long().",
                                 f"HybridEmbeddingModel が受け取るのは整数の ID（torch.long）ですが、{ids.dtype} の"
                                 "テンソルが渡されました。ids.long() で変換してください。"))
        ids = ids.to(self.embedding.weight.device)  # the lookup happens where the table is (the CPU)
        n = self.embedding.num_embeddings
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise ConfigError(tr(f"ids must lie in [0, {n - 1}] for a table of {n} rows; "
                                 f"got values from {int(ids.min())} to {int(ids.max())}.",
                                 f"{n}行の表なので、ID は [0, {n - 1}] の範囲に収めてください。渡された値は "
                                 f"{int(ids.min())} から {int(ids.max())} です。"))
        x = self.embedding(ids)  # (N, [L,] dim) on the CPU
        x = x.to(self.device)  # the only host-to-device copy: the rows that were looked up
        return self.linear(x)  # (N, [L,] out) on self.device


def pipeline_schedule(num_stages, micro_batches):
    """The order in which :class:`PipelineModel` issues its work. Explained in 04_hybrid_cpu_gpu.

    Returns a list of ``(tick, stage, micro_batch)``: at tick ``t`` stage ``s`` works on micro-batch ``t - s``
    (a GPipe-style forward). Within a tick the last stage is issued first, so each device's queue gets work
    as early as possible. ``num_stages + micro_batches - 1`` ticks in all.
    """
    positive_int(num_stages, "num_stages", 2, "pipeline_schedule")
    positive_int(micro_batches, "micro_batches", 4, "pipeline_schedule")
    return [(t, s, t - s) for t in range(num_stages + micro_batches - 1)
            for s in reversed(range(num_stages)) if 0 <= t - s < micro_batches]


class PipelineModel(nn.Module):
    """A network cut into stages, one per device, run micro-batch by micro-batch. Explained in 04_hybrid_cpu_gpu.

    ``stages[i]`` is moved to ``devices[i]``. ``forward`` splits the batch (dimension 0) into ``micro_batches``
    chunks whose sizes differ by at most one (one row each when the batch has fewer rows) and follows :func:`pipeline_schedule`; each activation is copied to the next stage's device right
    before that stage needs it. On GPUs a call only queues work, so stage 0 can compute micro-batch ``t + 1``
    while stage 1 computes micro-batch ``t``; with ``micro_batches=1`` it is plain model parallelism, one
    device busy at a time. Devices may repeat (``["cpu", "cpu"]``) to run the same code on one device.
    The output lies on ``devices[-1]``. Layers that mix samples of a batch (``BatchNorm`` in training mode)
    see micro-batches instead of the batch, so such a model computes something different when split.
    """

    def __init__(self, stages, devices, micro_batches=1):
        super().__init__()
        if not hasattr(stages, "__iter__"):
            raise ConfigError(tr(f"PipelineModel: stages must be a list of modules, one per device, got "
                                 f"{type(stages).__name__}; for one stage write [module].",
                                 "PipelineModel: stages にはデバイスごとに 1つのモジュールを並べたリストを渡して"
                                 f"ください。渡されたのは {type(stages).__name__} です。1ステージなら [module] と"
                                 "書きます。"))
        stages, devices = list(stages), check_devices(devices, mixed=True)
        if not stages or len(stages) != len(devices):
            raise ConfigError(tr(f"Give one device per stage: got {len(stages)} stage(s) and {len(devices)} "
                                 "device(s), e.g. devices=['cuda:0', 'cuda:1'] or ['cpu', 'cpu'].",
                                 f"ステージごとにデバイスを 1つ指定してください。ステージは {len(stages)}個、デバイスは "
                                 f"{len(devices)}個です（例: devices=['cuda:0', 'cuda:1'] や ['cpu', 'cpu']）。"))
        for i, stage in enumerate(stages):
            if not isinstance(stage, nn.Module):
                raise ConfigError(tr(f"PipelineModel: stages[{i}] is a {type(stage).__name__}, not an nn.Module.",
                                     f"PipelineModel: stages[{i}] は {type(stage).__name__} で、nn.Module では"
                                     "ありません。"))
        self.micro_batches = positive_int(micro_batches, "micro_batches", 4, "PipelineModel")
        self.devices = devices
        self.stages = nn.ModuleList(stage.to(d) for stage, d in zip(stages, self.devices))

    @classmethod
    def from_sequential(cls, net, devices, split_at=None, micro_batches=1):
        """Copy an ``nn.Sequential`` and cut it before the layer indices ``split_at``. Explained in 04_hybrid_cpu_gpu.

        ``split_at=[2]`` makes stages ``net[:2]`` and ``net[2:]``; the default cuts ``net`` into ``len(devices)``
        parts of nearly equal layer counts. ``net`` itself is left where it is. Parameter names stay those of
        ``net`` behind a ``stages.<i>.`` prefix, so the two models can be compared name by name.
        """
        if not isinstance(net, nn.Sequential):
            raise ConfigError(tr(f"from_sequential cuts an nn.Sequential, got {type(net).__name__}; "
                                 "build the stages yourself and pass them to PipelineModel(stages, devices).",
                                 f"from_sequential が切り分けるのは nn.Sequential です。渡されたのは "
                                 f"{type(net).__name__} です。ステージを自分で作り、PipelineModel(stages, devices) "
                                 "に渡してください。"))
        devices = check_devices(devices, mixed=True)
        n, k = len(net), len(devices)
        if split_at is None:
            split_at = [round(i * n / k) for i in range(1, k)]
        elif is_int(split_at):
            split_at = [split_at]
        cuts = [0, *split_at, n] if isinstance(split_at, (list, tuple)) else []
        if len(cuts) != k + 1 or not all(map(is_int, cuts)) or any(a >= b for a, b in zip(cuts, cuts[1:])):
            raise ConfigError(tr(f"split_at={split_at!r} must hold {k - 1} increasing layer indices between 1 and "
                                 f"{n - 1} for {k} device(s) and a Sequential of {n} layers.",
                                 f"split_at={split_at!r} には、デバイス {k}個と {n}層の Sequential に合わせて、1 から "
                                 f"{n - 1} までの増加する層の番号を {k - 1}個並べてください。"))
        net = copy.deepcopy(net)
        return cls([net[a:b] for a, b in zip(cuts, cuts[1:])], devices, micro_batches)

    def forward(self, x):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise ConfigError(tr("PipelineModel takes a batch tensor of shape (N, ...), got "
                                 f"{type(x).__name__ if not isinstance(x, torch.Tensor) else 'a 0-d tensor'}.",
                                 "PipelineModel には形 (N, ...) のバッチのテンソルを渡してください。渡されたのは "
                                 f"{type(x).__name__ if not isinstance(x, torch.Tensor) else '0次元のテンソル'} です。"))
        if len(x) == 0:
            raise ConfigError(tr("PipelineModel got an empty batch; pass at least one sample.",
                                 "PipelineModel に空のバッチが渡されました。少なくとも 1つのサンプルを渡してください。"))
        # Exactly micro_batches chunks whose sizes differ by at most one (5 rows in 4: 2, 1, 1, 1); a batch with
        # fewer rows than that runs one row per micro-batch.
        chunks = torch.tensor_split(x, min(self.micro_batches, len(x)))
        acts = list(chunks)  # acts[i]: micro-batch i's latest activation, wherever it lives
        for _tick, s, i in pipeline_schedule(len(self.stages), len(chunks)):
            acts[i] = self.stages[s](acts[i].to(self.devices[s]))  # copy to stage s's device, then compute
        return torch.cat(acts) if len(acts) > 1 else acts[0]  # (N, ...) on devices[-1]
