"""A run's folder: one run at a time, and the checkpoint that ``--resume`` continues. Explained in 06_ddp.

The lock is ``flock`` on ``FOLDER/.mparlib.lock``: the system releases it however the process ends (a crashed run
leaves no stale lock), and the file names the holder. The checkpoint is chapter 2's format (written atomically) plus
what resuming needs: optimizer state, finished epochs, sampler, random state, history, the settings that must stay.
"""
import contextlib
import dataclasses
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint import save_checkpoint
from .errors import CheckpointError, ConfigError, OutputLocked
from .lang import tr

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

LOCK_NAME = ".mparlib.lock"
CHECKPOINT_FORMAT = "mparlib.ddp/1"  # the "run" entry of a checkpoint written by save_run
SAME_ON_RESUME = ("model", "width", "batch_size", "lr", "momentum", "weight_decay", "subset", "seed", "sync_bn")
_ADDED_LATER = {"width": 64}  # settings older checkpoints lack, with the value those runs used


@contextlib.contextmanager
def lock_folder(folder, what="folder"):
    """``with lock_folder(out):`` holds ``out`` for one run, or raises ``OutputLocked``. Explained in 06_ddp."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(tr(f"{what} {folder} is a file, not a folder: choose a folder for the run's files.",
                             f"{what} に指定された {folder} はフォルダではなくファイルです。訓練のファイルを置くフォルダを"
                             "指定してください。"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    if fcntl is None:  # Windows: no advisory locks here; the course's runs are started on Linux and macOS
        yield path
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (OSError, ValueError):
            info = {}
        os.close(fd)
        holder = tr(f"process {info.get('pid')} on {info.get('host')}, started {info.get('started')}: "
                    f"{info.get('command')}", f"{info.get('host')} のプロセス {info.get('pid')}、{info.get('started')} "
                    f"開始: {info.get('command')}") if info else tr("a process that is starting", "起動中のプロセス")
        raise OutputLocked(tr(
            f"{what} {folder} is in use by another run ({holder}): two runs in one folder would overwrite each "
            f"other's checkpoints and mix their logs. Wait for it to finish, stop it, or choose another {what}.",
            f"{what} の {folder} は別の訓練が使っています（{holder}）。1つのフォルダで 2つの訓練を動かすと、チェック"
            f"ポイントを上書きし合い、ログも混ざります。その訓練が終わるのを待つか、止めるか、別の {what} を指定して"
            "ください。")) from None
    try:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join(sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        yield path
    finally:  # the lock file stays (it holds no data); the lock is given up
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def sampler_state(sampler, next_epoch):
    """What a ``DistributedSampler`` needs to reproduce its next epoch: seed, epoch and layout. Explained in 06_ddp."""
    return {"seed": sampler.seed, "epoch": next_epoch, "shuffle": sampler.shuffle, "drop_last": sampler.drop_last,
            "num_replicas": sampler.num_replicas}


def checkpoint_path(cfg):
    """Where a run keeps its checkpoint: ``OUT/checkpoint.pt``. Explained in 06_ddp."""
    return Path(cfg.out) / "checkpoint.pt"


def _settings(cfg):
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k in SAME_ON_RESUME}


def read_checkpoint(cfg):
    """The checkpoint that ``--resume`` continues, checked: a ``CheckpointError`` says what is wrong. Explained in 06_ddp.

    Without ``resume`` there must be no checkpoint in ``cfg.out`` (it would be overwritten); with it there must be one
    written by a DDP training run (:func:`save_run`). Nothing is ever changed on disk here.
    """
    path = checkpoint_path(cfg)
    if not cfg.resume:
        if path.exists():
            raise CheckpointError(tr(f"{path} already exists and would be overwritten. Continue that run with --resume, "
                                     "or choose another folder with --out.",
                                     f"{path} がすでにあり、上書きしてしまいます。その訓練を --resume で続けるか、--out で"
                                     "別のフォルダを選んでください。"))
        return None
    if not path.is_file():
        raise CheckpointError(tr(f"--resume was given but {path} does not exist: start without --resume, or point --out "
                                 "at the folder of the run to continue.",
                                 f"--resume が指定されましたが、{path} がありません。--resume なしで始めるか、--out に"
                                 "続けたい訓練のフォルダを指定してください。"))
    foreign = tr(f"{path} was not written by a mparlib.ddp training run (or is damaged), so it cannot be resumed; it "
                 "was left unchanged. Start a new run in another --out.",
                 f"{path} は mparlib.ddp の訓練が書いたものではない（または壊れている）ので、再開できません。ファイルは"
                 "そのままにしてあります。別の --out で新しい訓練を始めてください。")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, text, a foreign pickle...
        raise CheckpointError(f"{foreign} ({type(e).__name__}: {str(e)[:200]})") from None
    need = {"run": str, "epoch": int, "model": dict, "optimizer": dict, "rng": torch.Tensor, "history": list,
            "world_size": int, "config": dict, "sampler": dict}
    if not (isinstance(ckpt, dict) and ckpt.get("run") == CHECKPOINT_FORMAT
            and all(isinstance(ckpt.get(k), t) for k, t in need.items())):
        raise CheckpointError(foreign)
    now, then = _settings(cfg), {k: ckpt["config"].get(k, _ADDED_LATER.get(k)) for k in SAME_ON_RESUME}
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731  (a tuple is saved as a list)
    diff = [f"{k}: checkpoint {then[k]!r}, now {now[k]!r}" for k in SAME_ON_RESUME if norm(then[k]) != norm(now[k])]
    if diff:
        raise CheckpointError(tr("--resume continues a run with the same settings, but these differ: ",
                                 "--resume は同じ設定で訓練を続けますが、次の設定が異なります: ") + "; ".join(diff)
                              + tr(". Pass the original values (only --epochs may grow), or start a new run in "
                                   "another --out.", "。元の値を指定する（増やしてよいのは --epochs だけです）か、"
                                   "別の --out で新しい訓練を始めてください。"))
    return ckpt


def shared_checkpoint(cfg):
    """Rank 0 reads and checks the checkpoint; every rank gets it (other hosts need no copy). Explained in 06_ddp."""
    box = [None]  # the checkpoint (or None), or the error that refuses it
    if dist.get_rank() == 0:
        try:
            box[0] = read_checkpoint(cfg)
        except CheckpointError as e:
            box[0] = e
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], CheckpointError):
        raise box[0]
    return box[0]


def save_run(cfg, net, optimizer, sampler, epoch, history, world):
    """Rank 0's checkpoint after ``epoch``: chapter 2's format plus what resuming needs. Explained in 06_ddp."""
    save_checkpoint(net, checkpoint_path(cfg), run=CHECKPOINT_FORMAT, epoch=epoch + 1,
                    optimizer=optimizer.state_dict(), sampler=sampler_state(sampler, epoch + 1),
                    rng=torch.get_rng_state(), history=history, world_size=world, config=_settings(cfg))
