"""Resuming a DDP run: what its checkpoint holds, and the checks before continuing it. Explained in 06_ddp.

After every epoch rank 0 writes chapter 2's checkpoint format (plain parameter names, written atomically) with what
resuming needs beside the model: the optimizer state, the finished epochs, the sampler's seed and epoch, the random
state, the history and the settings that must not change. ``--resume`` reads it back on rank 0, checks it, and
sends it to every rank.
"""
import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from .errors import CheckpointError, MparlibError
from .lang import tr

CHECKPOINT_FORMAT = "mparlib.ddp/1"  # the "run" entry of a checkpoint written by save_run
SAME_ON_RESUME = ("model", "width", "batch_size", "lr", "momentum", "weight_decay", "subset", "seed", "sync_bn")
_ADDED_LATER = {"width": 64}  # settings older checkpoints lack, with the value those runs used


def sampler_state(sampler, next_epoch):
    """What a ``DistributedSampler`` needs to reproduce its next epoch: seed, epoch and layout. Explained in 06_ddp."""
    return {"seed": sampler.seed, "epoch": next_epoch, "shuffle": sampler.shuffle, "drop_last": sampler.drop_last,
            "num_replicas": sampler.num_replicas}


def checkpoint_path(cfg):
    """Where a run keeps its checkpoint: ``OUT/checkpoint.pt``. Explained in 06_ddp."""
    return Path(cfg.out) / "checkpoint.pt"


def read_checkpoint(cfg):
    """The checkpoint that ``--resume`` continues, checked: a ``CheckpointError`` says what is wrong. Explained in 06_ddp.

    Without ``resume`` there must be no checkpoint in ``cfg.out`` (it would be overwritten); with it there must be one
    written by :func:`train_worker`. Nothing is ever changed on disk here.
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
    now = {k: v for k, v in dataclasses.asdict(cfg).items() if k in SAME_ON_RESUME}
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731  (a tuple is saved as a list)
    then = {k: ckpt["config"].get(k, _ADDED_LATER.get(k)) for k in SAME_ON_RESUME}
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
    box = [None, None]  # error (class name, message), checkpoint
    if dist.get_rank() == 0:
        try:
            box[1] = read_checkpoint(cfg)
        except MparlibError as e:
            box[0] = (type(e).__name__, str(e))
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointError(box[0][1])
    return box[1]


def save_run(cfg, net, optimizer, sampler, epoch, history, world):
    """Rank 0's checkpoint after ``epoch``: chapter 2's format plus what resuming needs. Explained in 06_ddp."""
    from .checkpoint import save_checkpoint

    save_checkpoint(net, checkpoint_path(cfg), run=CHECKPOINT_FORMAT, epoch=epoch + 1,
                    optimizer=optimizer.state_dict(), sampler=sampler_state(sampler, epoch + 1),
                    rng=torch.get_rng_state(), history=history, world_size=world,
                    config={k: v for k, v in dataclasses.asdict(cfg).items() if k in SAME_ON_RESUME})
