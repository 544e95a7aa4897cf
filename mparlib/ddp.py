"""DistributedDataParallel: one process per device, started by torchrun, by this module or from a notebook.

The chapter-5 experiment (ResNet-18 on Fashion-MNIST) with DDP, three ways::

    torchrun --nproc_per_node=2 -m mparlib.ddp --epochs 2       # torchrun starts 2 processes
    python -m mparlib.ddp --nproc 2 --epochs 2                  # this module starts them itself
    launch(train_worker, 2, DDPConfig(epochs=2))                # from Python or a notebook

Starting the processes and the process group lives in :mod:`mparlib.launch`. Each process: joins the process
group (:func:`~mparlib.launch.process_group`), reads its shard of every epoch through a
``DistributedSampler``, computes gradients on ``global batch / world size`` examples, and DDP averages the
gradients with an all-reduce during the backward pass. Rank 0 alone prints, plots and writes the checkpoint.
Explained in 06_ddp.
"""
import argparse
import dataclasses
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .data import to_float  # noqa: F401  (re-exported for the chapter: ddp.to_float)
from .lang import tr
from .launch import (  # noqa: F401  (check_gpus, check_port, free_port: re-exported for the chapter)
    RENDEZVOUS_VARS, DDPError, WorkerFailed, check_gpus, check_port, choose_backend, free_port, launch, process_group,
    rendezvous_env)

CHECKPOINT_FORMAT = "mparlib.ddp/1"  # the "run" entry of a checkpoint written by train_worker


# ---------------------------------------------------------------------------------------------------------------
# The experiment: data, model, training, checkpoints
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class DDPConfig:
    """Settings of a DDP training run (the command-line options of ``python -m mparlib.ddp``). Explained in 06_ddp.

    ``batch_size`` is the *global* batch: each of the ``W`` processes takes ``batch_size // W`` examples per step.
    """

    model: str = "resnet18"  # "resnet18" (chapter 5) or "mlp" (small, without BatchNorm)
    epochs: int = 10
    batch_size: int = 256  # global, split across the processes
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    subset: tuple = None  # (n_train, n_test): the first examples of each split; None = all
    resize: int = None
    seed: int = 0
    sync_bn: bool = False
    out: str = "runs/ddp"
    resume: bool = False
    data_root: str = None
    crash_at: tuple = None  # (epoch, step): rank 0 kills itself there, to try --resume
    plot: bool = True


SAME_ON_RESUME = ("model", "batch_size", "lr", "momentum", "weight_decay", "subset", "resize", "seed", "sync_bn")


def make_model(name, resize=None):
    """Build a model by name: ``"resnet18"`` (chapter 5) or ``"mlp"`` (784-64-10, no BatchNorm). Explained in 06_ddp."""
    from .models import init_weights, resnet18

    side = resize or 28
    if name == "resnet18":
        net = resnet18(10, in_channels=1)
    elif name == "mlp":
        net = nn.Sequential(nn.Flatten(), nn.Linear(side * side, 64), nn.ReLU(), nn.Linear(64, 10))
    else:
        raise DDPError(tr(f"model={name!r} is unknown: use 'resnet18' or 'mlp'.",
                          f"model={name!r} は不明なモデルです。'resnet18' か 'mlp' を指定してください。"))
    init_weights(net)
    return net


def load_split_tensors(split, n=None, root=None):
    """Fashion-MNIST ``split`` as uint8 images ``(N, 28, 28)`` and int64 labels, the first ``n`` examples. Explained in 06_ddp."""
    from .data import locate, read_split

    images, labels = read_split(locate(root), split)
    if n is not None:
        if n > len(labels):
            raise DDPError(tr(f"{n} {split} examples were asked for; the {split} set has {len(labels)}.",
                              f"{split} のデータが {n}個指定されましたが、{split} セットには {len(labels)}個しかありません。"))
        images, labels = images[:n], labels[:n]
    return images, labels


def check_split(n_examples, global_batch, world_size, what="training"):
    """Raise a clear error when ``world_size`` processes cannot each get their own data. Explained in 06_ddp."""
    if global_batch < world_size or global_batch % world_size:
        lower = max(world_size, global_batch // world_size * world_size)
        raise DDPError(tr(f"The global batch of {global_batch} cannot be split evenly across {world_size} processes "
                          f"(each takes batch_size // world_size examples per step). Use a multiple of {world_size}, "
                          f"e.g. {lower} or {lower + world_size}.",
                          f"全体のバッチサイズ {global_batch} は {world_size}個のプロセスに均等に分けられません（各プロセスは "
                          f"1ステップで batch_size // world_size 個のデータを使います）。{world_size} の倍数（例: {lower} "
                          f"や {lower + world_size}）を指定してください。"))
    check_shards(n_examples, world_size, what)


def check_shards(n_examples, world_size, what="training"):
    """Raise a clear error when a split has fewer examples than processes. Explained in 06_ddp."""
    if n_examples < world_size:
        what_ja = {"training": "訓練", "test": "テスト", "batch": "バッチ"}.get(what, what)
        raise DDPError(tr(f"The {what} set has {n_examples} example(s) but the run has {world_size} processes, so at "
                          f"least one rank would have no data of its own (DistributedSampler would only repeat "
                          f"other ranks' examples). Use at least {world_size} examples or at most {n_examples} "
                          "processes.",
                          f"{what_ja}データは {n_examples}個しかないのに、プロセスは {world_size}個あります。そのため、"
                          f"自分専用のデータを持たないランクができてしまいます（DistributedSampler は他のランクのデータを"
                          f"繰り返すだけです）。データを {world_size}個以上にするか、プロセスを {n_examples}個以下にして"
                          "ください。"))


def sampler_state(sampler, next_epoch):
    """What a ``DistributedSampler`` needs to reproduce its next epoch: seed, epoch and layout. Explained in 06_ddp."""
    return {"seed": sampler.seed, "epoch": next_epoch, "shuffle": sampler.shuffle, "drop_last": sampler.drop_last,
            "num_replicas": sampler.num_replicas}


def _log(rank, *msg):
    if rank == 0:
        print(*msg, flush=True)


def _sync_bn_on_cpu():
    return tr("--sync-bn converts BatchNorm to SyncBatchNorm, which works only on GPUs (PyTorch rejects CPU tensors "
              "in it); this run uses gloo on the CPU. Drop --sync-bn, or run on GPUs with nccl.",
              "--sync-bn は BatchNorm を SyncBatchNorm に置き換えますが、SyncBatchNorm は GPU でしか動きません"
              "（PyTorch は CPU のテンソルを受け付けません）。この実行は CPU 上の gloo を使います。--sync-bn を外すか、"
              "nccl で GPU 上で実行してください。")


def _validate(cfg):
    if cfg.model not in ("resnet18", "mlp"):
        raise DDPError(tr(f"model={cfg.model!r} is unknown: use 'resnet18' or 'mlp'.",
                          f"model={cfg.model!r} は不明なモデルです。'resnet18' か 'mlp' を指定してください。"))
    if cfg.epochs < 1:
        raise DDPError(tr(f"epochs={cfg.epochs}: train for at least 1 epoch.",
                          f"epochs={cfg.epochs}: 1エポック以上を指定してください。"))
    if cfg.lr <= 0:
        raise DDPError(tr(f"lr={cfg.lr}: the learning rate must be positive, e.g. 0.1.",
                          f"lr={cfg.lr}: 学習率は 0.1 のような正の数で指定してください。"))
    if cfg.subset is not None and (len(cfg.subset) != 2 or min(cfg.subset) < 1):
        raise DDPError(tr(f"subset={cfg.subset!r}: use (n_train, n_test) with positive numbers, e.g. (1024, 256).",
                          f"subset={cfg.subset!r}: (訓練データ数, テストデータ数) を正の数で指定してください"
                          "（例: (1024, 256)）。"))


def _checkpoint_path(cfg):
    return Path(cfg.out) / "checkpoint.pt"


def _check_out(cfg):
    """Refuse to overwrite an existing run without --resume; refuse --resume without a checkpoint."""
    path = _checkpoint_path(cfg)
    if cfg.resume and not path.exists():
        raise DDPError(tr(f"--resume was given but {path} does not exist: start without --resume, or point --out at "
                          "the folder of the run to continue.",
                          f"--resume が指定されましたが、{path} がありません。--resume なしで始めるか、--out に続けたい"
                          "訓練のフォルダを指定してください。"))
    if not cfg.resume and path.exists():
        raise DDPError(tr(f"{path} already exists and would be overwritten. Continue that run with --resume, or "
                          "choose another folder with --out.",
                          f"{path} がすでにあり、上書きしてしまいます。その訓練を --resume で続けるか、--out で別の"
                          "フォルダを選んでください。"))


def train_worker(cfg):
    """Train ``cfg.model`` with DDP in this process (one rank of many); rank 0 returns the history. Explained in 06_ddp.

    Call it inside :func:`process_group` (``launch`` and ``main`` do). Returns, on every rank, a dict with
    ``history`` (one dict per epoch), ``checkpoint``, ``world_size``, ``backend`` and ``per_rank_batch``.
    """
    from .timing import Timer

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    _validate(cfg)
    check_split(cfg.subset[0] if cfg.subset else 60_000, cfg.batch_size, world)
    if cfg.subset:
        check_shards(cfg.subset[1], world, what="test")
    if cfg.sync_bn and device.type != "cuda":
        raise DDPError(_sync_bn_on_cpu())
    ckpt = _read_checkpoint(cfg, rank)  # rank 0 reads it and sends it to all: other hosts need no copy of the file
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
    net = make_model(cfg.model, cfg.resize)
    if cfg.sync_bn:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net.to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    start_epoch, history = 0, []
    if ckpt is not None:  # every rank loads it: the optimizer state (momentum) lives in each process
        _check_resume(ckpt, cfg, world, rank)
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"].cpu())
        start_epoch, history = ckpt["epoch"], ckpt["history"]
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)

    _log(rank, f"DDP: {world} processes, backend {dist.get_backend()}, global batch {cfg.batch_size} "
               f"= {world} x {per_rank}, {len(train_set)} training examples"
               + (f", resuming after epoch {start_epoch}" if start_epoch else ""))
    animator = None
    if rank == 0 and cfg.plot:
        from .plot import Animator

        animator = Animator(xlabel=tr("epoch", "エポック"), xlim=[1, cfg.epochs],
                            legend=[tr("train loss", "訓練損失"), tr("train acc", "訓練精度"),
                                    tr("test acc", "テスト精度")],
                            title=tr(f"DDP, {world} processes ({dist.get_backend()})",
                                     f"DDP、{world}個のプロセス（{dist.get_backend()}）"),
                            path=Path(cfg.out) / "plot.png", display=False)
        for h in history:
            animator.add(h["epoch"], (h["train_loss"], h["train_acc"], h["test_acc"]))
    loss_fn = nn.CrossEntropyLoss()
    timer = Timer(device)
    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank; without it every epoch repeats
        model.train()
        stats = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, examples (this rank)
        timer.start()
        for step, (x, y) in enumerate(loader):
            if cfg.crash_at and rank == 0 and (epoch + 1, step + 1) == tuple(cfg.crash_at):
                print(f"simulated crash: rank 0 kills itself at epoch {epoch + 1}, step {step + 1}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = to_float(x, cfg.resize).to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            logits = model(x)  # (per_rank, 10)
            loss = loss_fn(logits, y)  # mean over this rank's examples
            loss.backward()  # DDP all-reduces (averages) the gradients bucket by bucket during backward
            optimizer.step()
            with torch.no_grad():
                stats += torch.stack([loss.detach().double() * len(y), (logits.argmax(1) == y).sum().double(),
                                      torch.tensor(float(len(y)), dtype=torch.float64, device=device)])
        seconds = timer.stop()
        dist.all_reduce(stats)  # sum over ranks
        test_acc = evaluate(net, test_x, test_y, test_idx, per_rank * 2, device, cfg.resize)
        h = {"epoch": epoch + 1, "train_loss": float(stats[0] / stats[2]), "train_acc": float(stats[1] / stats[2]),
             "test_acc": test_acc, "seconds": seconds, "images_per_s": float(stats[2]) / seconds}
        history.append(h)
        if rank == 0:
            from .parallel import save_checkpoint

            # The chapter-2 checkpoint format (model without the "module." prefix, written to a temporary file and
            # renamed, so a crash never leaves half a file), plus what resuming needs.
            save_checkpoint(net, _checkpoint_path(cfg), run=CHECKPOINT_FORMAT, epoch=epoch + 1,
                            optimizer=optimizer.state_dict(), sampler=sampler_state(sampler, epoch + 1),
                            rng=torch.get_rng_state(), history=history, world_size=world,
                            config={k: v for k, v in dataclasses.asdict(cfg).items() if k in SAME_ON_RESUME})
            print(f"epoch {epoch + 1}/{cfg.epochs}: train loss {h['train_loss']:.3f}, train acc {h['train_acc']:.3f},"
                  f" test acc {h['test_acc']:.3f}, {h['images_per_s']:.1f} images/s", flush=True)
            if animator is not None:
                animator.add(epoch + 1, (h["train_loss"], h["train_acc"], h["test_acc"]))
    return {"history": history, "checkpoint": str(_checkpoint_path(cfg)), "world_size": world,
            "backend": dist.get_backend(), "per_rank_batch": per_rank}


def _read_checkpoint(cfg, rank):
    """Rank 0 checks ``--out``/``--resume`` and reads the checkpoint; every rank gets the same answer."""
    box = [None, None]  # error message, checkpoint
    if rank == 0:
        try:
            _check_out(cfg)
            if cfg.resume:
                box[1] = torch.load(_checkpoint_path(cfg), map_location="cpu", weights_only=True)
        except DDPError as e:
            box[0] = str(e)
        except Exception as e:  # a damaged or foreign file
            box[0] = tr(f"{_checkpoint_path(cfg)} cannot be read as a checkpoint ({type(e).__name__}: {e}). It was "
                        "left unchanged; start a new run in another --out.",
                        f"{_checkpoint_path(cfg)} をチェックポイントとして読めません（{type(e).__name__}: {e}）。"
                        "ファイルはそのままにしてあります。別の --out で新しい訓練を始めてください。")
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise DDPError(box[0])
    return box[1]


def _check_resume(ckpt, cfg, world, rank):
    if ckpt.get("run") != CHECKPOINT_FORMAT:
        raise DDPError(tr(f"{_checkpoint_path(cfg)} was not written by a mparlib.ddp training run, so it cannot be "
                          "resumed; it was left unchanged. Start a new run in another --out.",
                          f"{_checkpoint_path(cfg)} は mparlib.ddp の訓練が書いたものではないので、再開できません。"
                          "ファイルはそのままにしてあります。別の --out で新しい訓練を始めてください。"))
    now = {k: v for k, v in dataclasses.asdict(cfg).items() if k in SAME_ON_RESUME}
    diff = [f"{k}: checkpoint {ckpt['config'].get(k)!r}, now {now[k]!r}" for k in SAME_ON_RESUME
            if _norm(ckpt["config"].get(k)) != _norm(now[k])]
    if diff:
        raise DDPError(tr("--resume continues a run with the same settings, but these differ: ",
                          "--resume は同じ設定で訓練を続けますが、次の設定が異なります: ") + "; ".join(diff)
                       + tr(". Pass the original values (only --epochs may grow), or start a new run in another --out.",
                            "。元の値を指定する（増やしてよいのは --epochs だけです）か、別の --out で新しい訓練を"
                            "始めてください。"))
    if ckpt["world_size"] != world:
        _log(rank, f"note: the checkpoint was written by {ckpt['world_size']} processes and {world} continue it; "
                   "the training continues, but the data order differs from an uninterrupted run.")
    if ckpt["epoch"] >= cfg.epochs:
        _log(rank, f"the checkpoint has already completed {ckpt['epoch']} of {cfg.epochs} epochs: nothing to do "
                   "(raise --epochs to train longer).")


def _norm(v):
    return list(v) if isinstance(v, tuple) else v


@torch.no_grad()
def evaluate(net, images, labels, idx, batch_size, device, resize=None):
    """Accuracy over all ranks: each rank scores its examples ``idx``, the counts are summed. Explained in 06_ddp.

    Uses the unwrapped model: DDP's forward may synchronise with the other ranks, which evaluation does not need.
    """
    for b in net.buffers():  # BatchNorm statistics: evaluate every shard with rank 0's (those in the checkpoint)
        dist.broadcast(b, src=0)
    net.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # correct, examples
    for start in range(0, len(idx), batch_size):
        i = idx[start:start + batch_size]
        x, y = to_float(images[i], resize).to(device), labels[i].to(device)
        counts += torch.stack([(net(x).argmax(1) == y).sum().double(), torch.tensor(float(len(i)), device=device,
                                                                                     dtype=torch.float64)])
    dist.all_reduce(counts)
    net.train()
    return float(counts[0] / counts[1])


# ---------------------------------------------------------------------------------------------------------------
# Small workers for the chapter: one step, and throughput
# ---------------------------------------------------------------------------------------------------------------

def one_step_worker(x, y, lr=0.1, seed=0, model="mlp"):
    """One SGD step of DDP where rank r trains on its slice of the batch ``x, y``; returns the new parameters.

    The slices are contiguous: rank r of W takes rows ``r*B/W .. (r+1)*B/W``. Explained in 06_ddp.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    check_split(len(y), len(y), world, what="batch")
    torch.manual_seed(seed)
    net = make_model(model)
    ddp_net = DDP(net)
    share = len(y) // world
    xs, ys = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    optimizer = torch.optim.SGD(ddp_net.parameters(), lr=lr)
    loss = nn.functional.cross_entropy(ddp_net(xs), ys)
    loss.backward()
    optimizer.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _synthetic_batch(n, resize=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    side = resize or 28
    return torch.rand(n, 1, side, side, generator=g), torch.randint(0, 10, (n,), generator=g)


def throughput_worker(model="resnet18", per_rank_batch=16, steps=3, warmup=1, resize=None):
    """Training images per second of DDP over all ranks (random images, SGD steps). Explained in 06_ddp."""
    from .timing import Timer

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    net = DDP(make_model(model, resize).to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = _synthetic_batch(per_rank_batch, resize, seed=rank)
    x, y = x.to(device), y.to(device)
    timer = Timer(device)
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            timer.start()
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    dist.barrier()
    seconds = timer.stop()
    return {"images_per_s": steps * per_rank_batch * world / seconds, "seconds": seconds, "world_size": world,
            "per_rank_batch": per_rank_batch, "backend": dist.get_backend(), "threads": torch.get_num_threads()}


def dataparallel_throughput(model="resnet18", batch_size=32, steps=3, warmup=1, resize=None, devices=None):
    """Training images per second of ``nn.DataParallel`` in this process (the chapter-5 way). Explained in 06_ddp.

    On a machine without GPUs ``DataParallel`` simply calls the model: one process using the CPU's threads.
    """
    from .devices import try_all_gpus
    from .timing import Timer

    devices = devices or try_all_gpus()
    torch.manual_seed(0)
    net = make_model(model, resize).to(devices[0])
    net = nn.DataParallel(net, device_ids=[d.index for d in devices] if devices[0].type == "cuda" else None)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = _synthetic_batch(batch_size, resize)
    x, y = x.to(devices[0]), y.to(devices[0])
    timer = Timer(devices[0])
    for i in range(warmup + steps):
        if i == warmup:
            timer.start()
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    seconds = timer.stop()
    return {"images_per_s": steps * batch_size / seconds, "seconds": seconds, "devices": [str(d) for d in devices],
            "threads": torch.get_num_threads()}


# ---------------------------------------------------------------------------------------------------------------
# The chapter's figure
# ---------------------------------------------------------------------------------------------------------------

def overview_figure():
    """Schematic: DataParallel's threads vs DDP's processes, and bucketed all-reduce overlapping backward. Explained in 06_ddp."""
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyBboxPatch

    fig = Figure(figsize=(10, 6.2))
    top, bottom = fig.add_axes([0.01, 0.40, 0.98, 0.58]), fig.add_axes([0.17, 0.08, 0.81, 0.27])
    top.set_xlim(0, 100)
    top.set_ylim(0, 60)
    top.axis("off")

    def box(ax, x, y, w, h, text, color, size=9):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.4", fc=color, ec="0.3", lw=0.8))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)

    # Left: DataParallel, one process with a thread per GPU; GPU 0 scatters, gathers and replicates every step.
    box(top, 1, 2, 45, 50, "", "#f3f3f3")
    top.text(23.5, 56, tr("DataParallel: 1 process, 1 thread per GPU", "DataParallel: 1個のプロセス、GPU ごとに 1本のスレッド"),
             ha="center", fontsize=10)
    box(top, 5, 40, 37, 7, tr("Python interpreter (one GIL)", "Python インタプリタ（GIL は 1 つ）"), "#ffe0b3")
    for i in range(2):
        box(top, 5 + 19 * i, 21, 16, 12, tr(f"thread {i}\nreplica {i}", f"スレッド {i}\nレプリカ {i}"), "#fff5cc")
        box(top, 5 + 19 * i, 6, 16, 8, f"GPU {i}", "#dbe9f6")
        top.annotate("", (13 + 19 * i, 15), (13 + 19 * i, 20), arrowprops=dict(arrowstyle="->", color="0.3"))
    top.text(23.5, 36.5, tr("every step: scatter batch, copy model, gather outputs on GPU 0",
                            "毎ステップ: バッチを分配、モデルを複製、出力を GPU 0 に集約"),
             ha="center", fontsize=8)
    # Right: DDP, one process per device; each has its own sampler shard; gradients are all-reduced.
    box(top, 53, 2, 46, 50, "", "#f3f3f3")
    top.text(76, 56, tr("DistributedDataParallel: 1 process per device", "DistributedDataParallel: デバイスごとに 1個のプロセス"),
             ha="center", fontsize=10)
    for i in range(2):
        x0 = 57 + 21 * i
        box(top, x0, 38, 17, 9, tr(f"process {i} (rank {i})\nits own GIL", f"プロセス {i}（ランク {i}）\n専用の GIL"),
            "#ffe0b3", size=8)
        box(top, x0, 25, 17, 8, tr(f"sampler shard {i}\nbatch B/2", f"サンプラーの担当分 {i}\nバッチ B/2"), "#e6f2e6", size=8)
        box(top, x0, 6, 17, 8, tr(f"device {i}", f"デバイス {i}"), "#dbe9f6", size=8)
        top.annotate("", (x0 + 8.5, 15), (x0 + 8.5, 24), arrowprops=dict(arrowstyle="->", color="0.3"))
    top.annotate("", (78, 10), (74.6, 10), arrowprops=dict(arrowstyle="<->", color="#c0392b", lw=1.5))
    top.text(76.3, 17.5, tr("all-reduce\ngradients", "勾配を\nオールリデュース"), ha="center", fontsize=8, color="#c0392b")

    # Bottom: timeline of one backward pass with gradient buckets (schematic, not measured).
    layers = 6  # backward runs from the last layer (L6) to the first (L1); each bucket holds two layers' gradients
    for j in range(layers):
        bottom.barh(1, 1, left=j, color="#7fb3d5", edgecolor="white")
        bottom.text(j + 0.5, 1, tr(f"grad L{layers - j}", f"勾配 L{layers - j}"), ha="center", va="center", fontsize=8)
    for b, ready in enumerate((2, 4, 6)):  # a bucket's all-reduce starts when its last gradient is ready
        bottom.barh(0, 1.6, left=ready, color="#e59866", edgecolor="white")
        bottom.text(ready + 0.8, 0, tr(f"all-reduce\nbucket {b}", f"バケット {b} を\nオールリデュース"), ha="center",
                    va="center", fontsize=7)
    bottom.set_yticks([0, 1], [tr("communication", "通信"), tr("backward\n(compute)", "逆伝播\n（計算）")])
    bottom.set_xlim(0, 8)
    bottom.set_xticks([])
    bottom.set_xlabel(tr("time (schematic) -> a bucket's all-reduce starts as soon as its gradients exist",
                         "時間（模式図）→ バケットの勾配がそろい次第、そのオールリデュースが始まる"), fontsize=9)
    for s in ("top", "right"):
        bottom.spines[s].set_visible(False)
    return fig


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


def parser():
    """The command-line options of ``python -m mparlib.ddp``. Explained in 06_ddp."""
    d = DDPConfig()
    ap = argparse.ArgumentParser(
        prog="python -m mparlib.ddp",
        description="Train the chapter-5 ResNet-18 on Fashion-MNIST with DistributedDataParallel.",
        epilog="Start it with `torchrun --nproc_per_node=N -m mparlib.ddp [options]` or with "
               "`python -m mparlib.ddp --nproc N [options]`.")
    ap.add_argument("--nproc", type=int, help="start N local processes (not under torchrun)")
    ap.add_argument("--port", type=int, default=None,
                    help="rendezvous port for --nproc (default: $MASTER_PORT, else a free port)")
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    ap.add_argument("--model", default=d.model, choices=["resnet18", "mlp"])
    ap.add_argument("--epochs", type=int, default=d.epochs)
    ap.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch, split across processes")
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--momentum", type=float, default=d.momentum)
    ap.add_argument("--weight-decay", type=float, default=d.weight_decay)
    ap.add_argument("--subset", type=_pair, default=None, metavar="N[,N_TEST]",
                    help="use the first N training (and N_TEST test) examples")
    ap.add_argument("--resize", type=int, default=None)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--sync-bn", action="store_true", help="convert BatchNorm to SyncBatchNorm (GPUs only)")
    ap.add_argument("--out", default=d.out, help="folder for checkpoint.pt and plot.png (default: %(default)s)")
    ap.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    ap.add_argument("--data-root", default=None, help="folder holding the Fashion-MNIST files")
    ap.add_argument("--crash-at", type=_crash, default=None, metavar="EPOCH:STEP",
                    help="rank 0 kills itself at that step (to try --resume)")
    ap.add_argument("--no-plot", dest="plot", action="store_false")
    return ap


def main(argv=None):
    """Entry point of ``python -m mparlib.ddp`` and ``torchrun -m mparlib.ddp``; returns the exit code. Explained in 06_ddp."""
    args = parser().parse_args(argv)
    cfg = DDPConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DDPConfig)})
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or all(os.environ.get(k) for k in RENDEZVOUS_VARS)
    try:
        if under_torchrun:
            if args.nproc is not None:
                raise DDPError(tr("--nproc starts processes, but this one was already started by torchrun: drop "
                                  "--nproc and use torchrun's --nproc_per_node.",
                                  "--nproc はプロセスを起動するオプションですが、このプロセスはすでに torchrun が起動"
                                  "しています。--nproc を外し、torchrun の --nproc_per_node を使ってください。"))
            with process_group(args.backend):
                train_worker(cfg)
            return 0
        if args.nproc is None:
            rendezvous_env()  # raises the error that explains how to start
        _validate(cfg)
        check_split(cfg.subset[0] if cfg.subset else 60_000, cfg.batch_size, args.nproc)
        if cfg.subset:
            check_shards(cfg.subset[1], args.nproc, what="test")
        if cfg.sync_bn and choose_backend(args.backend) != "nccl":
            raise DDPError(_sync_bn_on_cpu())
        _check_out(cfg)
        if cfg.resume:  # say now, not after starting the processes, if the settings differ from the checkpoint's
            _check_resume(torch.load(_checkpoint_path(cfg), map_location="cpu", weights_only=True), cfg, args.nproc,
                          rank=None)
        port = args.port if args.port is not None else int(os.environ.get("MASTER_PORT", 0) or 0)
        launch(train_worker, args.nproc, cfg, backend=args.backend, port=port, log_dir=Path(cfg.out) / "logs")
        return 0
    except DDPError as e:
        if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:  # one message per machine
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 1 if isinstance(e, WorkerFailed) else 2
    except KeyboardInterrupt:
        if int(os.environ.get("RANK", "0") or 0) == 0:
            print(tr(f"interrupted; the checkpoint of the last finished epoch stays in {cfg.out}: continue with --resume",
                     f"中断しました。最後に終わったエポックのチェックポイントは {cfg.out} に残っています。--resume で続けられます"),
                  file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    # Run the copy of this module that spawned processes can import (``mparlib.ddp``), not ``__main__``.
    from mparlib.ddp import main as _main

    sys.exit(_main())
