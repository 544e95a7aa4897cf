"""The DDP experiment: chapter 5's training with one process per device, as each rank runs it. Explained in 06_ddp.

Each rank trains on its shard of every epoch (``DistributedSampler``) with the course's training step while DDP
averages the gradients during the backward pass; rank 0 alone prints, plots and writes the checkpoint.
"""
import contextlib
import dataclasses
import math
import os
import signal
import types
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .checks import finite_float, one_of, positive_int
from .data import to_float
from .errors import ConfigError, TrainingDiverged
from .lang import tr
from .models import init_weights, resnet18
from .rendezvous import device as rank_device
from .runfolder import checkpoint_path, lock_folder, save_run, shared_checkpoint
from .sources import COUNTS, locate, read_split
from .step import train_step
from .timing import Timer

MODELS = ("resnet18", "mlp")
# Chapter 06's experiment per process (batch and learning rate grow with the processes, as in chapter 5): "full" is
# chapter 5's (DDPConfig's defaults), "smoke" a narrow ResNet-18 on 9,000 images, seconds an epoch on 2 CPU processes.
PROFILES = {"full": {}, "smoke": dict(width=8, epochs=2, batch_size=16, lr=0.005, momentum=0.9, subset=(9000, 1000))}


@dataclasses.dataclass
class DDPConfig:
    """Settings of a DDP training run (the command-line options of ``python -m mparlib.ddp``). Explained in 06_ddp."""

    model: str = "resnet18"  # "resnet18" (chapter 5) or "mlp" (small, without BatchNorm)
    width: int = 64  # channels of the ResNet-18's stem: 64 is d2l's network, 16 a narrow one for quick CPU runs
    epochs: int = 10
    batch_size: int = 256  # the global batch: each of the W processes takes batch_size // W examples per step
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    subset: tuple = None  # (n_train, n_test): the first examples of each split; None = all
    seed: int = 0
    sync_bn: bool = False
    out: str = "runs/ddp"
    resume: bool = False
    data_root: str = None
    crash_at: tuple = None  # (epoch, step): rank 0 kills itself there, to try --resume
    plot: bool = True
    out_locked: bool = False  # the process that started the ranks holds the lock of `out` (python -m mparlib.ddp)

    @classmethod
    def for_profile(cls, profile, world, **changes):
        """Chapter 06's experiment on ``world`` processes; ``changes`` replace settings as given (global batch)."""
        base = cls(**PROFILES[one_of(profile, "profile", tuple(PROFILES))])
        world = positive_int(world, "world", 2)
        return dataclasses.replace(base, **{"batch_size": base.batch_size * world, "lr": base.lr * world, **changes})


def _check_model(name, width):
    one_of(name, "model", MODELS)
    positive_int(width, "width", 64)
    if name == "mlp" and width != 64:
        raise ConfigError(tr(f"width={width!r} applies to model='resnet18' only; the MLP has no width to change.",
                             f"width={width!r} が使えるのは model='resnet18' だけです。MLP には変えられる幅がありません。"))


def make_model(name, width=64):
    """Build ``"resnet18"`` (chapter 5, stem ``width``) or ``"mlp"`` (784-64-10, no BatchNorm). Explained in 06_ddp."""
    _check_model(name, width)
    net = resnet18(10, in_channels=1, width=width) if name == "resnet18" else \
        nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 10))
    init_weights(net)
    return net


def load_split_tensors(split, n=None, root=None):
    """Fashion-MNIST ``split`` as uint8 images ``(N, 28, 28)`` and int64 labels, the first ``n`` examples. Explained in 06_ddp."""
    images, labels = read_split(locate(root), split)
    if n is not None and n > len(labels):
        raise ConfigError(tr(f"{n} {split} examples were asked for; the {split} set has {len(labels)}.",
                             f"{split} のデータが {n}個指定されましたが、{split} セットには {len(labels)}個しか"
                             "ありません。"))
    return images[:n], labels[:n]


def check_run(cfg, world, backend):
    """Refuse settings that cannot work with ``world`` processes, before anything starts. Explained in 06_ddp."""
    _check_model(cfg.model, cfg.width)
    positive_int(cfg.epochs, "epochs", 10)
    positive_int(cfg.batch_size, "batch_size", 256)
    finite_float(cfg.lr, "lr", 0.1)
    finite_float(cfg.momentum, "momentum", 0.9, minimum=0)
    finite_float(cfg.weight_decay, "weight_decay", 5e-4, minimum=0)
    if cfg.subset is not None and (len(cfg.subset) != 2 or min(cfg.subset) < 1):
        raise ConfigError(tr(f"subset={cfg.subset!r}: use (n_train, n_test) with positive numbers, e.g. (1024, 256).",
                             f"subset={cfg.subset!r}: (訓練データ数, テストデータ数) を正の数で指定してください"
                             "（例: (1024, 256)）。"))
    if cfg.sync_bn and backend != "nccl":
        raise ConfigError(tr(
            "--sync-bn converts BatchNorm to SyncBatchNorm, which works only on GPUs (PyTorch rejects CPU tensors in "
            "it); this run uses gloo on the CPU. Drop --sync-bn, or run on GPUs with nccl.",
            "--sync-bn は BatchNorm を SyncBatchNorm に置き換えますが、SyncBatchNorm は GPU でしか動きません（PyTorch は "
            "CPU のテンソルを受け付けません）。この実行は CPU 上の gloo を使います。--sync-bn を外すか、nccl で GPU 上で"
            "実行してください。"))
    if cfg.batch_size < world or cfg.batch_size % world:
        lower = max(world, cfg.batch_size // world * world)
        raise ConfigError(tr(
            f"The global batch of {cfg.batch_size} cannot be split evenly across {world} processes (each takes "
            f"batch_size // world_size examples per step). Use a multiple of {world}, e.g. {lower} or {lower + world}.",
            f"全体のバッチサイズ {cfg.batch_size} は {world}個のプロセスに均等に分けられません（各プロセスは 1ステップで "
            f"batch_size // world_size 個のデータを使います）。{world} の倍数（例: {lower} や {lower + world}）を指定して"
            "ください。"))
    n_train, n_test = cfg.subset or (COUNTS["train"], COUNTS["test"])
    for n, what_en, what_ja in ((n_train, "training", "訓練"), (n_test, "test", "テスト")):
        if n < world:
            raise ConfigError(tr(
                f"The {what_en} set has {n} example(s) but the run has {world} processes, so at least one rank would "
                "have no data of its own (DistributedSampler would only repeat other ranks' examples). Use at least "
                f"{world} examples or at most {n} processes.",
                f"{what_ja}データは {n}個しかないのに、プロセスは {world}個あります。そのため、自分専用のデータを持たない"
                f"ランクができてしまいます（DistributedSampler は他のランクのデータを繰り返すだけです）。データを "
                f"{world}個以上にするか、プロセスを {n}個以下にしてください。"))


def _log(*msg):
    if dist.get_rank() == 0:
        print(*msg, flush=True)


def train_worker(cfg):
    """Train ``cfg.model`` with DDP in this process (one rank of many); returns the run's history. Explained in 06_ddp.

    Call it inside :func:`~mparlib.rendezvous.process_group` (``launch`` and ``main`` do). Returns, on every rank, a
    dict with ``history`` (one dict per epoch), ``checkpoint``, ``world_size``, ``backend`` and ``per_rank_batch``.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    check_run(cfg, world, dist.get_backend())
    with lock_folder(cfg.out, what="--out") if rank == 0 and not cfg.out_locked else contextlib.nullcontext():
        run = _setup(cfg, rank, world, rank_device())
        for epoch in range(run.start_epoch, cfg.epochs):
            h = _epoch(cfg, run, epoch)
            run.history.append(h)
            if rank == 0:
                save_run(cfg, run.net, run.optimizer, run.sampler, epoch, run.history, world)
                print(tr(f"epoch {epoch + 1}/{cfg.epochs}: train loss {h['train_loss']:.3f}, train acc "
                         f"{h['train_acc']:.3f}, test acc {h['test_acc']:.3f}, {h['images_per_s']:.1f} images/s",
                         f"エポック {epoch + 1}/{cfg.epochs}: 訓練損失 {h['train_loss']:.3f}、訓練精度 {h['train_acc']:.3f}、"
                         f"テスト精度 {h['test_acc']:.3f}、{h['images_per_s']:.1f} 画像/秒"), flush=True)
                if run.animator is not None:
                    run.animator.add(h["epoch"], (h["train_loss"], h["train_acc"], h["test_acc"]))
    return {"history": run.history, "checkpoint": str(checkpoint_path(cfg)), "world_size": world,
            "backend": dist.get_backend(), "per_rank_batch": run.per_rank}


def _setup(cfg, rank, world, device):
    """Data, model, optimizer and (with ``resume``) the checkpoint's state: everything an epoch needs."""
    ckpt = shared_checkpoint(cfg)
    run = types.SimpleNamespace(per_rank=cfg.batch_size // world, device=device, rank=rank,
                                start_epoch=0, history=[], loss_fn=nn.CrossEntropyLoss(), timer=Timer(device))
    # Data: every rank holds the (small) data set; the sampler gives each rank its own shard of every epoch.
    n_train, n_test = cfg.subset or (None, None)
    train_set = TensorDataset(*load_split_tensors("train", n_train, cfg.data_root))
    run.test_x, run.test_y = load_split_tensors("test", n_test, cfg.data_root)
    run.sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    run.loader = DataLoader(train_set, batch_size=run.per_rank, sampler=run.sampler)
    run.test_idx = torch.arange(rank, len(run.test_y), world)  # evaluation: rank r takes r, r+W, ... (no padding)

    # Model: the same seed everywhere, and DDP broadcasts rank 0's parameters when it wraps the model anyway.
    torch.manual_seed(cfg.seed)
    net = make_model(cfg.model, cfg.width)
    run.net = net = (nn.SyncBatchNorm.convert_sync_batchnorm(net) if cfg.sync_bn else net).to(device)
    run.optimizer = torch.optim.SGD(net.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if ckpt is not None:  # every rank loads it: the optimizer state (momentum) lives in each process
        run.net.load_state_dict(ckpt["model"])
        run.optimizer.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"].cpu())
        run.start_epoch, run.history = ckpt["epoch"], ckpt["history"]
        if ckpt["world_size"] != world:
            _log(tr(f"note: the checkpoint was written by {ckpt['world_size']} processes and {world} continue it; "
                    "the training continues, but the data order differs from an uninterrupted run.",
                    f"注意: チェックポイントは {ckpt['world_size']}個のプロセスが書いたもので、{world}個のプロセスで"
                    "続けます。訓練は続きますが、データの順序は中断しなかった場合と異なります。"))
        if run.start_epoch >= cfg.epochs:
            _log(tr(f"the checkpoint has already completed {run.start_epoch} of {cfg.epochs} epochs: nothing to do "
                    "(raise --epochs to train longer).",
                    f"チェックポイントはすでに {cfg.epochs}エポック中 {run.start_epoch}エポックを終えています。続ける"
                    "訓練はありません（長く訓練するには --epochs を増やしてください）。"))
    run.model = DDP(run.net, device_ids=[device.index] if device.type == "cuda" else None)
    _log(tr(f"DDP: {world} processes, backend {dist.get_backend()}, global batch {cfg.batch_size} = {world} x "
            f"{run.per_rank}, {len(train_set)} training examples",
            f"DDP: プロセス {world}個、バックエンド {dist.get_backend()}、全体のバッチサイズ {cfg.batch_size} = {world} x "
            f"{run.per_rank}、訓練データ {len(train_set)}件")
         + (tr(f", resuming after epoch {run.start_epoch}", f"、{run.start_epoch}エポック目の後から再開")
            if run.start_epoch else ""))
    run.animator = _animator(cfg, world, run.history) if rank == 0 and cfg.plot else None
    return run


def _epoch(cfg, run, epoch):
    """One epoch on every rank, then the test accuracy: this epoch's history entry (the same on every rank)."""
    run.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank; without it every epoch repeats
    run.model.train()
    stats = torch.zeros(3, dtype=torch.float64, device=run.device)  # loss sum, correct, examples (this rank)
    first_bad = torch.full((), math.inf, dtype=torch.float64, device=run.device)  # first step with a bad loss
    run.timer.start()
    for step, (x, y) in enumerate(run.loader):
        if cfg.crash_at and run.rank == 0 and (epoch + 1, step + 1) == tuple(cfg.crash_at):
            print(tr(f"simulated crash: rank 0 kills itself at epoch {epoch + 1}, step {step + 1}",
                     f"障害の模擬: ランク 0 が {epoch + 1}エポック目の {step + 1}ステップ目で自らを強制終了します"),
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = to_float(x).to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)  # (B, 1, 28, 28)
        # DDP all-reduces (averages) the gradients bucket by bucket during the backward pass of this step
        loss_sum, correct, n = train_step(run.model, x, y, run.loss_fn, run.optimizer)
        stats += torch.stack([loss_sum.double(), correct.double(), stats.new_tensor(n)])
        first_bad = torch.minimum(first_bad, torch.where(torch.isfinite(loss_sum), math.inf, step + 1.0))  # no sync
    seconds = run.timer.stop()
    dist.all_reduce(stats)  # sum over ranks
    dist.all_reduce(first_bad, op=dist.ReduceOp.MIN)  # the earliest bad step on any rank
    if math.isfinite(first_bad):
        kept = tr(f"the checkpoint of epoch {epoch} was kept", f"{epoch}エポック目のチェックポイントを残しました") \
            if epoch else tr("no epoch had finished, so no checkpoint was written",
                             "終わったエポックがないため、チェックポイントは書いていません")
        lr = run.optimizer.param_groups[0]["lr"]
        raise TrainingDiverged(tr(
            f"The training loss became NaN or infinite at epoch {epoch + 1}, step {int(first_bad)}: the run "
            f"stopped and {kept}. Lower the learning rate (now {lr:g}) or check the data for NaN.",
            f"{epoch + 1}エポック目の {int(first_bad)}ステップ目で訓練損失が NaN か無限大になったので、訓練を止め、"
            f"{kept}。学習率（現在 {lr:g}）を下げるか、データに NaN がないか確かめてください。"))
    test_acc = evaluate(run.net, run.test_x, run.test_y, run.test_idx, run.per_rank * 2, run.device)
    return {"epoch": epoch + 1, "train_loss": float(stats[0] / stats[2]), "train_acc": float(stats[1] / stats[2]),
            "test_acc": test_acc, "seconds": seconds, "images_per_s": float(stats[2]) / seconds}


def _animator(cfg, world, history):
    from .plot import Animator  # matplotlib: only rank 0 of a plotted run needs it

    animator = Animator(xlabel=tr("epoch", "エポック"), xlim=[1, cfg.epochs],
                        legend=[tr("train loss", "訓練損失"), tr("train acc", "訓練精度"), tr("test acc", "テスト精度")],
                        title=tr(f"DDP, {world} processes ({dist.get_backend()})",
                                 f"DDP、{world}個のプロセス（{dist.get_backend()}）"),
                        path=Path(cfg.out) / "plot.png", display=False, echo=False)  # the epoch line says it
    for h in history:
        animator.add(h["epoch"], (h["train_loss"], h["train_acc"], h["test_acc"]))
    return animator


@torch.no_grad()
def evaluate(net, images, labels, idx, batch_size, device):
    """Accuracy over all ranks: each rank scores its examples ``idx``, the counts are summed. Explained in 06_ddp."""
    for b in net.buffers():  # BatchNorm statistics: evaluate every shard with rank 0's (those in the checkpoint)
        dist.broadcast(b, src=0)
    net.eval()  # net is the model inside DDP, whose forward would synchronise the ranks: scoring needs no sync
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # correct, examples
    for i in idx.split(batch_size):
        x, y = to_float(images[i]).to(device), labels[i].to(device)
        counts[0] += (net(x).argmax(1) == y).sum()
        counts[1] += len(i)
    dist.all_reduce(counts)
    net.train()
    return float(counts[0] / counts[1])
