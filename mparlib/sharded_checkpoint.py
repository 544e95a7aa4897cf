"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP) that are complete or absent, never half there.

Every rank writes its own shards; the save becomes visible only when all of them are on disk, by one rename and a
marker file that names the last complete save. A checkpoint saved by N ranks loads on any number of ranks (DCP
reads from each file the pieces each rank needs), and a save killed part-way is never loaded.
Explained in 09_sharding.
"""
import contextlib
import os
import shutil
import warnings
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .errors import CheckpointError
from .files import atomic_write_bytes
from .lang import tr

MARKER = "latest"  # a small file in the checkpoint root naming the last complete save


def _distributed():
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_is_meant():
    """Without a process group DCP warns that it assumes one process: here that is what the caller asked for."""
    with warnings.catch_warnings():
        if not _distributed():
            warnings.filterwarnings("ignore", message=r"torch\.distributed is .*uninitialized")
        yield


def _barrier():
    if _distributed():
        dist.barrier()


def save_sharded(state, root, step):
    """Save ``state`` with DCP, every rank its shards, into ``root/step-NNNNNNNN``. Explained in 09_sharding.

    Each rank writes its own shards into a temporary folder ``root/.step-NNNNNNNN.partial`` (DCP's coordinator
    writes the index, ``.metadata``, last). Only when every rank has finished does rank 0 rename the folder to its
    final name (one atomic step) and then rewrite the marker ``root/latest`` (atomically too). A save stopped at
    any point leaves the previous checkpoint and the marker as they were: a save is complete or absent. Returns the
    folder of this save.
    """
    root = Path(root)
    name = f"step-{int(step):08d}"
    final, partial = root / name, root / f".{name}.partial"
    message = None
    if not _distributed() or dist.get_rank() == 0:
        if final.exists():
            message = tr(f"{final} exists already; a checkpoint is never overwritten. Save under another step or "
                         "remove the old folder.",
                         f"{final} はすでにあります。チェックポイントは上書きしません。別のステップで保存するか、"
                         "古いフォルダを削除してください。")
        else:
            shutil.rmtree(partial, ignore_errors=True)  # what an earlier save of this step left when it was killed
            partial.mkdir(parents=True)
    verdict = [message]  # rank 0's (None or an error message), the same on every rank
    if _distributed():
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointError(verdict[0])
    _barrier()
    with _single_process_is_meant():
        dcp.save(state, checkpoint_id=partial)
    _barrier()  # every rank's files are on disk, and the coordinator's .metadata too
    if not _distributed() or dist.get_rank() == 0:
        os.replace(partial, final)
        atomic_write_bytes(root / MARKER, (name + "\n").encode())
    _barrier()
    return final


def _check_complete(folder):
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(tr(f"{folder}: no such checkpoint folder.", f"{folder}: そのチェックポイントのフォルダは"
                                 "ありません。"))
    if folder.name.endswith(".partial") or not (folder / ".metadata").is_file():
        root = folder.parent
        last = (root / MARKER).read_text().strip() if (root / MARKER).is_file() else None
        hint_en = f" The last complete one is {root / last}." if last else ""
        hint_ja = f"最後に完了したチェックポイントは {root / last} です。" if last else ""
        raise CheckpointError(tr(
            f"{folder} is not a complete checkpoint: its save was stopped part-way (a killed process, a full disk, a "
            "machine that went down), so it lacks the index that DCP writes last (.metadata) and it was never "
            f"renamed to its final name. It is never loaded; delete it.{hint_en}",
            f"{folder} は完全なチェックポイントではありません。保存が途中で止まった（プロセスが強制終了された、"
            "ディスクがいっぱいになった、マシンが落ちた）ため、DCP が最後に書く索引（.metadata）がなく、最終的な名前"
            f"にも変わっていません。このフォルダは読み込まないので、削除してください。{hint_ja}"))
    return folder


def latest_checkpoint(root):
    """The folder of the last complete save under ``root`` (its marker file says which). Explained in 09_sharding."""
    root = Path(root)
    if not (root / MARKER).is_file():
        raise CheckpointError(tr(f"{root} holds no complete checkpoint (no '{MARKER}' file): save one with "
                                 "save_sharded first.",
                                 f"{root} には完了したチェックポイントがありません（'{MARKER}' ファイルがありません）。"
                                 "先に save_sharded で保存してください。"))
    return _check_complete(root / (root / MARKER).read_text().strip())


def load_sharded(state, path):
    """Load ``state`` in place from :func:`save_sharded`'s checkpoint, on any number of ranks. Explained in 09_sharding.

    ``path`` is a checkpoint root (its latest complete save is loaded) or one save's folder. ``state`` holds the
    tensors to fill, laid out for the ranks that load: DTensors of any sharding, or plain tensors in a process
    without a process group. DCP reads from each file the pieces that each rank needs. Returns the folder read.
    """
    path = Path(path)
    folder = latest_checkpoint(path) if (path / MARKER).is_file() else _check_complete(path)
    with _single_process_is_meant():
        dcp.load(state, checkpoint_id=folder)
    return folder
