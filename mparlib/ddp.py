"""DistributedDataParallel: the chapter-5 experiment with one process per device. Explained in 06_ddp.

Three ways to start it::

    torchrun --nproc_per_node=2 -m mparlib.ddp --epochs 2       # torchrun starts 2 processes
    python -m mparlib.ddp --nproc 2 --epochs 2                  # this module starts them itself
    launch(train_worker, 2, args=(DDPConfig(epochs=2),))        # from Python or a notebook (mparlib.launch)

Each process joins the process group (:func:`mparlib.launch.process_group`), reads its shard of every epoch through
a ``DistributedSampler``, and runs the course's one training step (:func:`mparlib.step.train_step`) on
``global batch / world size`` examples while DDP averages the gradients with an all-reduce during the backward pass.
Rank 0 alone prints, plots and writes the checkpoint (atomically, after every epoch, in a locked output folder).
"""
import argparse
import dataclasses
import math
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .data import COUNTS, to_float
from .errors import ConfigError, LaunchError, MparlibError, TrainingDiverged, WorkerFailed
from .lang import tr
from .locks import lock_folder
from .launch import RENDEZVOUS_VARS, choose_backend, device as rank_device, launch, process_group, rendezvous_env
from .resume import checkpoint_path, read_checkpoint, save_run, shared_checkpoint
from .step import train_step
from .timing import Timer


@dataclasses.dataclass
class DDPConfig:
    """Settings of a DDP training run (the command-line options of ``python -m mparlib.ddp``). Explained in 06_ddp.

    ``batch_size`` is the *global* batch: each of the ``W`` processes takes ``batch_size // W`` examples per step.
    """

    model: str = "resnet18"  # "resnet18" (chapter 5) or "mlp" (small, without BatchNorm)
    width: int = 64  # channels of the ResNet-18's stem: 64 is d2l's network, 16 a narrow one for quick CPU runs
    epochs: int = 10
    batch_size: int = 256  # global, split across the processes
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


def make_model(name, width=64):
    """Build a model by name: ``"resnet18"`` (chapter 5) or ``"mlp"`` (784-64-10, no BatchNorm). Explained in 06_ddp.

    ``width`` is the ResNet-18's stem width (``mparlib.models.resnet18``); the MLP has none and takes only 64.
    """
    from .models import init_weights, resnet18

    if name == "resnet18":
        net = resnet18(10, in_channels=1, width=width)
    elif name == "mlp" and width != 64:
        raise ConfigError(tr(f"width={width!r} applies to model='resnet18' only; the MLP has no width to change.",
                             f"width={width!r} が使えるのは model='resnet18' だけです。MLP には変えられる幅がありません。"))
    elif name == "mlp":
        net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 10))
    else:
        raise ConfigError(tr(f"model={name!r} is unknown: use 'resnet18' or 'mlp'.",
                             f"model={name!r} は不明なモデルです。'resnet18' か 'mlp' を指定してください。"))
    init_weights(net)
    return net


def load_split_tensors(split, n=None, root=None):
    """Fashion-MNIST ``split`` as uint8 images ``(N, 28, 28)`` and int64 labels, the first ``n`` examples. Explained in 06_ddp."""
    from .data import locate, read_split

    images, labels = read_split(locate(root), split)
    if n is not None:
        if n > len(labels):
            raise ConfigError(tr(f"{n} {split} examples were asked for; the {split} set has {len(labels)}.",
                                 f"{split} のデータが {n}個指定されましたが、{split} セットには {len(labels)}個しか"
                                 "ありません。"))
        images, labels = images[:n], labels[:n]
    return images, labels


def check_run(cfg, world, backend):
    """Refuse settings that cannot work with ``world`` processes, before anything starts. Explained in 06_ddp."""
    if cfg.model not in ("resnet18", "mlp") or (cfg.model == "mlp" and cfg.width != 64):
        make_model(cfg.model, cfg.width)  # its message
    for name, low in (("epochs", 1), ("batch_size", 1), ("width", 1)):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(tr(f"{name}={value!r}: use an int >= {low}.", f"{name}={value!r}: {low} 以上の整数を指定してください。"))
    for name, low, example in (("lr", 0.0, "0.1"), ("momentum", None, "0.9"), ("weight_decay", None, "5e-4")):
        value = getattr(cfg, name)
        bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
        if bad or (low is not None and value <= low) or (low is None and value < 0):
            rule_en, rule_ja = ("a positive", "正の") if low is not None else ("a finite, non-negative", "0 以上の有限の")
            raise ConfigError(tr(f"{name}={value!r}: use {rule_en} number such as {example}.",
                                 f"{name}={value!r}: {example} のような{rule_ja}数を指定してください。"))
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
    n_train, n_test = cfg.subset or (COUNTS["train"], COUNTS["test"])
    if cfg.batch_size < world or cfg.batch_size % world:
        lower = max(world, cfg.batch_size // world * world)
        raise ConfigError(tr(
            f"The global batch of {cfg.batch_size} cannot be split evenly across {world} processes (each takes "
            f"batch_size // world_size examples per step). Use a multiple of {world}, e.g. {lower} or {lower + world}.",
            f"全体のバッチサイズ {cfg.batch_size} は {world}個のプロセスに均等に分けられません（各プロセスは 1ステップで "
            f"batch_size // world_size 個のデータを使います）。{world} の倍数（例: {lower} や {lower + world}）を指定して"
            "ください。"))
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

    Call it inside :func:`~mparlib.launch.process_group` (``launch`` and ``main`` do). Returns, on every rank, a dict
    with ``history`` (one dict per epoch), ``checkpoint``, ``world_size``, ``backend`` and ``per_rank_batch``.
    """
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    check_run(cfg, world, dist.get_backend())
    held = os.environ.get(_LOCK_VAR) == f"{os.getppid()}:{Path(cfg.out).resolve()}"  # by `python -m mparlib.ddp`
    lock = lock_folder(cfg.out, what="--out") if rank == 0 and not held else None  # one run per output folder
    try:
        return _train(cfg, rank, world, device)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg, rank, world, device):
    ckpt = shared_checkpoint(cfg)
    per_rank = cfg.batch_size // world

    # Data: every rank holds the (small) data set; the sampler gives each rank its own shard of every epoch.
    n_train, n_test = cfg.subset or (None, None)
    train_x, train_y = load_split_tensors("train", n_train, cfg.data_root)
    test_x, test_y = load_split_tensors("test", n_test, cfg.data_root)
    train_set = TensorDataset(train_x, train_y)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(train_set, batch_size=per_rank, sampler=sampler)
    test_idx = torch.arange(rank, len(test_y), world)  # evaluation: rank r takes examples r, r+W, ... (no padding)

    # Model: the same seed everywhere, and DDP broadcasts rank 0's parameters when it wraps the model anyway.
    torch.manual_seed(cfg.seed)
    net = make_model(cfg.model, cfg.width)
    if cfg.sync_bn:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net.to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    start_epoch, history = 0, []
    if ckpt is not None:  # every rank loads it: the optimizer state (momentum) lives in each process
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"].cpu())
        start_epoch, history = ckpt["epoch"], ckpt["history"]
        if ckpt["world_size"] != world:
            _log(tr(f"note: the checkpoint was written by {ckpt['world_size']} processes and {world} continue it; the "
                    "training continues, but the data order differs from an uninterrupted run.",
                    f"注意: チェックポイントは {ckpt['world_size']}個のプロセスが書いたもので、{world}個のプロセスで"
                    "続けます。訓練は続きますが、データの順序は中断しなかった場合と異なります。"))
        if start_epoch >= cfg.epochs:
            _log(tr(f"the checkpoint has already completed {start_epoch} of {cfg.epochs} epochs: nothing to do "
                    "(raise --epochs to train longer).",
                    f"チェックポイントはすでに {cfg.epochs}エポック中 {start_epoch}エポックを終えています。続ける訓練は"
                    "ありません（長く訓練するには --epochs を増やしてください）。"))
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    _log(tr(f"DDP: {world} processes, backend {dist.get_backend()}, global batch {cfg.batch_size} = {world} x "
            f"{per_rank}, {len(train_set)} training examples",
            f"DDP: プロセス {world}個、バックエンド {dist.get_backend()}、全体のバッチサイズ {cfg.batch_size} = {world} x "
            f"{per_rank}、訓練データ {len(train_set)}件") + (tr(f", resuming after epoch {start_epoch}",
                                                             f"、{start_epoch}エポック目の後から再開") if start_epoch else ""))
    animator = _animator(cfg, world, history) if rank == 0 and cfg.plot else None
    loss_fn, timer = nn.CrossEntropyLoss(), Timer(device)
    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank; without it every epoch repeats
        model.train()
        stats = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, examples (this rank)
        first_bad = torch.full((), math.inf, dtype=torch.float64, device=device)  # first step with a non-finite loss
        timer.start()
        for step, (x, y) in enumerate(loader):
            if cfg.crash_at and rank == 0 and (epoch + 1, step + 1) == tuple(cfg.crash_at):
                print(tr(f"simulated crash: rank 0 kills itself at epoch {epoch + 1}, step {step + 1}",
                         f"障害の模擬: ランク 0 が {epoch + 1}エポック目の {step + 1}ステップ目で自らを強制終了します"),
                      flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = to_float(x).to(device, non_blocking=True), y.to(device, non_blocking=True)  # (per_rank, 1, 28, 28)
            # DDP all-reduces (averages) the gradients bucket by bucket during the backward pass of this step
            loss_sum, correct, n = train_step(model, x, y, loss_fn, optimizer)
            stats += torch.stack([loss_sum.double(), correct.double(), torch.tensor(float(n), device=device,
                                                                                    dtype=torch.float64)])
            if_bad = torch.where(torch.isfinite(loss_sum), math.inf, step + 1.0)  # kept on the device: no sync per step
            first_bad = torch.minimum(first_bad, if_bad)
        seconds = timer.stop()
        dist.all_reduce(stats)  # sum over ranks
        dist.all_reduce(first_bad, op=dist.ReduceOp.MIN)  # the earliest bad step on any rank
        if math.isfinite(first_bad):
            kept_en = (f"the checkpoint of epoch {epoch} was kept" if epoch else "no epoch had finished, so no "
                       "checkpoint was written")
            kept_ja = (f"{epoch}エポック目のチェックポイントを残しました" if epoch else
                       "終わったエポックがないため、チェックポイントは書いていません")
            lr = optimizer.param_groups[0]["lr"]
            raise TrainingDiverged(tr(
                f"The training loss became NaN or infinite at epoch {epoch + 1}, step {int(first_bad)}: the run "
                f"stopped and {kept_en}. Lower the learning rate (now {lr:g}) or check the data for NaN.",
                f"{epoch + 1}エポック目の {int(first_bad)}ステップ目で訓練損失が NaN か無限大になったので、訓練を止め、"
                f"{kept_ja}。学習率（現在 {lr:g}）を下げるか、データに NaN がないか確かめてください。"))
        test_acc = evaluate(net, test_x, test_y, test_idx, per_rank * 2, device)
        h = {"epoch": epoch + 1, "train_loss": float(stats[0] / stats[2]), "train_acc": float(stats[1] / stats[2]),
             "test_acc": test_acc, "seconds": seconds, "images_per_s": float(stats[2]) / seconds}
        history.append(h)
        if rank == 0:
            save_run(cfg, net, optimizer, sampler, epoch, history, world)
            print(tr(f"epoch {epoch + 1}/{cfg.epochs}: train loss {h['train_loss']:.3f}, train acc {h['train_acc']:.3f}, "
                     f"test acc {h['test_acc']:.3f}, {h['images_per_s']:.1f} images/s",
                     f"エポック {epoch + 1}/{cfg.epochs}: 訓練損失 {h['train_loss']:.3f}、訓練精度 {h['train_acc']:.3f}、"
                     f"テスト精度 {h['test_acc']:.3f}、{h['images_per_s']:.1f} 画像/秒"), flush=True)
            if animator is not None:
                _plot(animator, h)
    return {"history": history, "checkpoint": str(checkpoint_path(cfg)), "world_size": world,
            "backend": dist.get_backend(), "per_rank_batch": per_rank}


def _animator(cfg, world, history):
    from .plot import Animator

    animator = Animator(xlabel=tr("epoch", "エポック"), xlim=[1, cfg.epochs],
                        legend=[tr("train loss", "訓練損失"), tr("train acc", "訓練精度"), tr("test acc", "テスト精度")],
                        title=tr(f"DDP, {world} processes ({dist.get_backend()})",
                                 f"DDP、{world}個のプロセス（{dist.get_backend()}）"),
                        path=Path(cfg.out) / "plot.png", display=False, echo=False)  # the epoch line says it
    for h in history:
        _plot(animator, h)
    return animator


def _plot(animator, h):
    animator.add(h["epoch"], (h["train_loss"], h["train_acc"], h["test_acc"]))


@torch.no_grad()
def evaluate(net, images, labels, idx, batch_size, device):
    """Accuracy over all ranks: each rank scores its examples ``idx``, the counts are summed. Explained in 06_ddp.

    Uses the unwrapped model: DDP's forward may synchronise with the other ranks, which evaluation does not need.
    """
    for b in net.buffers():  # BatchNorm statistics: evaluate every shard with rank 0's (those in the checkpoint)
        dist.broadcast(b, src=0)
    net.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # correct, examples
    for start in range(0, len(idx), batch_size):
        i = idx[start:start + batch_size]
        x, y = to_float(images[i]).to(device), labels[i].to(device)
        counts[0] += (net(x).argmax(1) == y).sum()
        counts[1] += len(i)
    dist.all_reduce(counts)
    net.train()
    return float(counts[0] / counts[1])


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------

def _pair(text):
    try:
        parts = [int(p) for p in text.replace(":", ",").split(",")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts = [parts[0], max(1, parts[0] // 6)]
    if len(parts) != 2 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: use N (N training and N//6 test examples) or N_TRAIN,N_TEST")
    return tuple(parts)


def _crash(text):
    try:
        epoch, step = (int(p) for p in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use EPOCH:STEP, e.g. 2:1") from None
    return epoch, step


def _parser():
    """The command-line options of ``python -m mparlib.ddp``. Explained in 06_ddp."""
    d = DDPConfig()
    ap = argparse.ArgumentParser(
        prog="python -m mparlib.ddp",
        description="Train the chapter-5 ResNet-18 on Fashion-MNIST with DistributedDataParallel.",
        epilog="Start it with `torchrun --nproc_per_node=N -m mparlib.ddp [options]` or with "
               "`python -m mparlib.ddp --nproc N [options]`.")
    ap.add_argument("--nproc", type=int, help="start N local processes (not under torchrun)")
    ap.add_argument("--port", type=int, default=None,
                    help="rendezvous port for --nproc (default: $MASTER_PORT, else one the system picks)")
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    ap.add_argument("--model", default=d.model, choices=["resnet18", "mlp"])
    ap.add_argument("--width", type=int, default=d.width,
                    help="channels of the ResNet-18's stem (default: %(default)s, d2l's network; 16 runs ~10x faster)")
    ap.add_argument("--epochs", type=int, default=d.epochs)
    ap.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch, split across processes")
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--momentum", type=float, default=d.momentum)
    ap.add_argument("--weight-decay", type=float, default=d.weight_decay)
    ap.add_argument("--subset", type=_pair, default=None, metavar="N[,N_TEST]",
                    help="use the first N training (and N_TEST test) examples")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--sync-bn", action="store_true", help="convert BatchNorm to SyncBatchNorm (GPUs only)")
    ap.add_argument("--out", default=d.out, help="folder for checkpoint.pt and plot.png (default: %(default)s)")
    ap.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    ap.add_argument("--data-root", default=None, help="folder holding the Fashion-MNIST files")
    ap.add_argument("--crash-at", type=_crash, default=None, metavar="EPOCH:STEP",
                    help="rank 0 kills itself at that step (to try --resume)")
    ap.add_argument("--no-plot", dest="plot", action="store_false")
    return ap


_LOCK_VAR = "MPARLIB_DDP_OUT_LOCKED"  # "launcher pid:folder", set by main() for the ranks it starts


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM (a `timeout`, a scheduler): stop the ranks as Ctrl+C does


def main(argv=None):
    """Entry point of ``python -m mparlib.ddp`` and ``torchrun -m mparlib.ddp``; returns the exit code. Explained in 06_ddp."""
    args = _parser().parse_args(argv)
    cfg = DDPConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DDPConfig)})
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or all(os.environ.get(k) for k in RENDEZVOUS_VARS)
    try:
        if under_torchrun:
            if args.nproc is not None:
                raise LaunchError(tr("--nproc starts processes, but this one was already started by torchrun: drop "
                                     "--nproc and use torchrun's --nproc_per_node.",
                                     "--nproc はプロセスを起動するオプションですが、このプロセスはすでに torchrun が起動"
                                     "しています。--nproc を外し、torchrun の --nproc_per_node を使ってください。"))
            with process_group(args.backend):
                train_worker(cfg)
            return 0
        if args.nproc is None:
            rendezvous_env()  # raises the error that explains how to start
        if args.nproc < 1:
            raise ConfigError(tr(f"--nproc {args.nproc}: start at least 1 process, e.g. --nproc 2.",
                                 f"--nproc {args.nproc}: プロセスは 1個以上にしてください（例: --nproc 2）。"))
        check_run(cfg, args.nproc, choose_backend(args.backend, args.nproc))
        port = args.port if args.port is not None else int(os.environ.get("MASTER_PORT", 0) or 0)
        if _in_main_thread():
            signal.signal(signal.SIGTERM, _interrupt)
        with lock_folder(cfg.out, what="--out"):  # held for the whole run; rank 0 knows its launcher holds it
            read_checkpoint(cfg)  # refuse now, not after starting the processes
            os.environ[_LOCK_VAR] = f"{os.getpid()}:{Path(cfg.out).resolve()}"
            launch(train_worker, args.nproc, args=(cfg,), backend=args.backend, port=port,
                   log_dir=Path(cfg.out) / "logs")
        return 0
    except MparlibError as e:
        if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:  # one message per machine
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 1 if isinstance(e, WorkerFailed) else 2
    except KeyboardInterrupt:
        if int(os.environ.get("RANK", "0") or 0) == 0:
            print(tr(f"interrupted; the checkpoint of the last finished epoch stays in {cfg.out}: continue with --resume",
                     f"中断しました。最後に終わったエポックのチェックポイントは {cfg.out} に残っています。--resume で続け"
                     "られます"), file=sys.stderr, flush=True)
        return 130


def _in_main_thread():
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    # Run the copy of this module that spawned processes can import (``mparlib.ddp``), not ``__main__``.
    from mparlib.ddp import main as _main

    code = _main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # under torchrun: skip the interpreter's teardown of torch's C++ threads (see the module docs)
