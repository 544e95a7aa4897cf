"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP) that are complete or absent, never half there.

Every rank writes its own shards; the save becomes visible only when all of them are on disk, by one rename and a
marker file that names the last complete save. A checkpoint saved by N ranks loads on any number of ranks (DCP
reads from each file the pieces each rank needs), and a save killed part-way is never loaded.
Explained in 09_sharding.
"""
import contextlib
import errno
import hashlib
import io
import json
import os
import pickle
import re
import warnings
from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader

from .checks import flag, positive_int
from .errors import CheckpointError, MparlibError
from .files import atomic_write_bytes
from .lang import tr
from .runfolder import lock_folder

MARKER = "latest"  # a small file in the checkpoint root naming the last complete save
CHECKSUMS = ".mparlib-checksums.json"  # in each save's folder: the SHA-256 of every file DCP wrote
_STEP_NAME = re.compile(r"^step-\d{8}$")
_SHARD_NAME = re.compile(r"^(__\d+_\d+\.distcp|\.metadata)$")  # the files DCP's file system writer creates
# What DCP's index (.metadata) is made of, and nothing else: unpickling it builds these and calls no other code.
_INDEX_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")} | {
    ("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")}


def _distributed():
    return dist.is_available() and dist.is_initialized()


def _rank():
    return dist.get_rank() if _distributed() else 0


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


def _same_everywhere(value):
    """Rank 0's ``value`` (an error or None) on every rank."""
    box = [value]
    if _distributed():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _gathered(value):
    """Every rank's ``value``, in rank order (one process: ``[value]``)."""
    if not _distributed():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _clear_partial(partial):
    """Remove what an earlier, stopped save of this step left in ``partial``; refuse if anything else is there.

    Only the files DCP and this module write are removed, so a folder of the same name holding anything else (files
    of a person or another program, a link) is never deleted.
    """
    if not os.path.lexists(partial):
        return None
    foreign = None
    if partial.is_symlink() or not partial.is_dir():
        foreign = partial.name
    else:
        foreign = next((e.name for e in os.scandir(partial) if e.is_symlink() or not e.is_file()
                        or not (_SHARD_NAME.match(e.name) or e.name == CHECKSUMS)), None)
    if foreign is not None:
        return CheckpointError(tr(
            f"{partial} holds {foreign!r}, which a save did not write, so it is not removed and this step cannot be "
            "saved. Move your files out of it (or delete it yourself if nothing there matters), then save again.",
            f"{partial} には保存処理が書いたものではない {foreign!r} があるので、削除せず、このステップは保存できません。"
            "ファイルを別の場所へ移す（中身が不要なら自分で削除する）と、もう一度保存できます。"))
    for entry in os.scandir(partial):
        os.unlink(entry.path)
    partial.rmdir()
    return None


def _prepare(root, final, partial):
    """Rank 0's checks before a save: an error to raise on every rank, or None (``partial`` then exists, empty)."""
    if final.exists():
        return CheckpointError(tr(f"{final} exists already; a checkpoint is never overwritten. Save under another "
                                  "step or remove the old folder.",
                                  f"{final} はすでにあります。チェックポイントは上書きしません。別のステップで保存するか、"
                                  "古いフォルダを削除してください。"))
    try:
        error = _clear_partial(partial)  # what an earlier save of this step left when it was killed
        if error is None:
            partial.mkdir()
        return error
    except OSError as e:
        return _os_error(e, root, saving=True)


def _record_checksums(partial):
    """Every rank hashes the files it wrote; rank 0 adds the rest (the index) and writes them all down."""
    rank = _rank()
    mine = {e.name: _sha256(e.path) for e in os.scandir(partial)
            if e.name.startswith(f"__{rank}_") and e.name.endswith(".distcp")} if _distributed() else {}
    sums = {}
    for part in _gathered(mine):
        sums.update(part)
    if rank == 0:
        for entry in os.scandir(partial):
            if entry.name != CHECKSUMS and entry.name not in sums:
                sums[entry.name] = _sha256(entry.path)
        atomic_write_bytes(partial / CHECKSUMS, json.dumps(sums, indent=0, sort_keys=True).encode())


def save_sharded(state, root, step):
    """Save ``state`` with DCP, every rank its shards, into ``root/step-NNNNNNNN``. Explained in 09_sharding.

    Each rank writes its own shards into a temporary folder ``root/.step-NNNNNNNN.partial`` (DCP's coordinator
    writes the index, ``.metadata``, last), then a checksum of every file is recorded. Only when every rank has
    finished does rank 0 rename the folder to its final name (one atomic step) and then rewrite the marker
    ``root/latest`` (atomically too). A save stopped at any point leaves the previous checkpoint and the marker as
    they were: a save is complete or absent. Rank 0 holds the root's lock (as a run holds ``--out``) for the whole
    save, so two runs never write into one root at once; a save deletes nothing it did not write. Returns the
    folder of this save.
    """
    step = positive_int(step, "step", 10, "save_sharded", minimum=0)
    root = Path(root)
    name = f"step-{step:08d}"
    final, partial = root / name, root / f".{name}.partial"
    with contextlib.ExitStack() as held:
        error = None
        if _rank() == 0:
            try:
                held.enter_context(lock_folder(root, what=tr("checkpoint root", "チェックポイントのルート")))
                error = _prepare(root, final, partial)
            except MparlibError as e:
                error = e
        error = _same_everywhere(error)
        if error is not None:
            raise error
        _barrier()
        with _single_process_is_meant(), _explained(partial, saving=True):
            dcp.save(state, checkpoint_id=partial)
        _barrier()  # every rank's files are on disk, and the coordinator's .metadata too
        _record_checksums(partial)
        if _rank() == 0:
            os.replace(partial, final)
            atomic_write_bytes(root / MARKER, (name + "\n").encode())
        _barrier()
    return final


def _os_error(e, folder, saving):
    """A course error for an ``OSError`` met while writing or reading the checkpoint in ``folder``."""
    if e.errno == errno.ENOSPC:
        return CheckpointError(tr(
            f"The disk holding {folder} is full ({e}): the save stopped part-way and the previous checkpoint is kept. "
            "Free some space (delete old step-* folders you no longer need) or save to another disk.",
            f"{folder} のあるディスクがいっぱいです（{e}）。保存は途中で止まり、前のチェックポイントはそのまま残って"
            "います。空き領域を作る（不要になった古い step-* フォルダを削除する）か、別のディスクに保存してください。"))
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CheckpointError(tr(
            f"{folder} cannot be {'written' if saving else 'read'} ({e}): the folder is read-only or belongs to another "
            "user. Choose a folder of your own, or fix its permissions.",
            f"{folder} に{'書き込め' if saving else 'アクセスでき'}ません（{e}）。読み取り専用か、別のユーザーのフォルダ"
            "です。自分のフォルダを選ぶか、アクセス権を直してください。"))
    return CheckpointError(tr(f"{folder}: the checkpoint could not be {'saved' if saving else 'read'} ({e}).",
                              f"{folder}: チェックポイントを{'保存' if saving else '読み込'}めませんでした（{e}）。"))


def _failure_of(exc):
    """The first underlying error of a DCP ``CheckpointException`` (one per failed rank), else ``exc`` itself."""
    failures = getattr(exc, "failures", None) or {}
    for rank in sorted(failures):
        inner = failures[rank]
        return getattr(inner, "exc", None) or inner
    return exc


@contextlib.contextmanager
def _explained(folder, saving):
    """Turn DCP's raw errors into course errors that say what was wrong and how to fix it."""
    try:
        yield
    except MparlibError:
        raise
    except (CheckpointException, OSError, RuntimeError, AssertionError, ValueError, KeyError) as e:
        cause = _failure_of(e)
        if isinstance(cause, MparlibError):
            raise cause from None
        if isinstance(cause, OSError):
            raise _os_error(cause, folder, saving) from None
        text = f"{type(cause).__name__}: {str(cause)[:300]}"
        if not saving and re.search(r"[Ss]ize mismatch|mismatch sizes|shape", text):
            how = tr("a tensor of the checkpoint has another shape than the one given to fill: build the model with "
                     "the settings of the run that saved it (sizes, width, number of layers).",
                     "チェックポイントのテンソルの形が、読み込み先のテンソルと異なります。保存した実行と同じ設定"
                     "（サイズ、幅、層の数）でモデルを作ってください。")
        elif not saving and "Missing key" in text:
            how = tr("the state to fill has an entry that the checkpoint lacks: load into the same structure that "
                     "was saved (the same keys, e.g. {'model': ..., 'optim': ...}).",
                     "読み込み先の状態に、チェックポイントにない項目があります。保存したときと同じ構造（同じキー、"
                     "例えば {'model': ..., 'optim': ...}）に読み込んでください。")
        else:
            how = tr("see the cause above.", "原因は上のとおりです。")
        raise CheckpointError(tr(f"{folder}: DCP could not {'save' if saving else 'load'} the checkpoint ({text}): "
                                 f"{how}", f"{folder}: DCP がチェックポイントを{'保存' if saving else '読み込'}めません"
                                 f"でした（{text}）。{how}")) from None


def _not_a_checkpoint(folder):
    """The error for a folder that is not one complete save, with advice that fits what it is."""
    root = folder.parent
    last = (root / MARKER).read_text().strip() if (root / MARKER).is_file() else None
    hint_en = f" The last complete one is {root / last}." if last and _STEP_NAME.match(last) else ""
    hint_ja = f"最後に完了したチェックポイントは {root / last} です。" if hint_en else ""
    if not re.match(r"^\.?step-\d{8}(\.partial)?$", folder.name):  # not a folder a save made (the home folder?)
        return CheckpointError(tr(
            f"{folder} is not a checkpoint: give the checkpoint root that save_sharded wrote (it holds '{MARKER}') or "
            "one of its step-NNNNNNNN folders. Nothing was changed.",
            f"{folder} はチェックポイントではありません。save_sharded が書いたチェックポイントのルート（'{MARKER}' が"
            "あります）か、その中の step-NNNNNNNN フォルダを指定してください。何も変更していません。"))
    return CheckpointError(tr(
        f"{folder} is not a complete checkpoint: its save was stopped part-way (a killed process, a full disk, a "
        "machine that went down), so it lacks the index that DCP writes last (.metadata) and it was never "
        f"renamed to its final name. It is never loaded; delete it.{hint_en}",
        f"{folder} は完全なチェックポイントではありません。保存が途中で止まった（プロセスが強制終了された、"
        "ディスクがいっぱいになった、マシンが落ちた）ため、DCP が最後に書く索引（.metadata）がなく、最終的な名前"
        f"にも変わっていません。このフォルダは読み込まないので、削除してください。{hint_ja}"))


def _check_complete(folder):
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(tr(f"{folder}: no such checkpoint folder.", f"{folder}: そのチェックポイントのフォルダは"
                                 "ありません。"))
    if folder.name.endswith(".partial") or not (folder / ".metadata").is_file():
        raise _not_a_checkpoint(folder)
    return folder


def latest_checkpoint(root):
    """The folder of the last complete save under ``root`` (its marker file says which). Explained in 09_sharding."""
    root = Path(root)
    if not (root / MARKER).is_file():
        raise CheckpointError(tr(f"{root} holds no complete checkpoint (no '{MARKER}' file): save one with "
                                 "save_sharded first.",
                                 f"{root} には完了したチェックポイントがありません（'{MARKER}' ファイルがありません）。"
                                 "先に save_sharded で保存してください。"))
    name = (root / MARKER).read_text(errors="replace").strip()
    if not _STEP_NAME.match(name):  # e.g. ../other-run/step-1: never leave the root
        raise CheckpointError(tr(
            f"{root / MARKER} names {name[:100]!r}, which is not a save of this root (save_sharded writes a name like "
            "step-00000012 there). It was not followed. Load a step-NNNNNNNN folder directly, or save again to "
            "rewrite the marker.",
            f"{root / MARKER} には {name[:100]!r} と書かれていますが、これはこのルートの保存ではありません（save_sharded "
            "は step-00000012 のような名前を書きます）。たどっていません。step-NNNNNNNN フォルダを直接読み込むか、もう一度"
            "保存して目印を書き直してください。"))
    if not (root / name).is_dir():
        raise CheckpointError(tr(
            f"{root / MARKER} names {name}, but {root / name} is missing (moved or deleted by hand?). Load another "
            "step-NNNNNNNN folder of this root directly, or save again.",
            f"{root / MARKER} は {name} を指していますが、{root / name} がありません（手で移動か削除した？）。この"
            "ルートの別の step-NNNNNNNN フォルダを直接読み込むか、もう一度保存してください。"))
    return _check_complete(root / name)


class _IndexUnpickler(pickle.Unpickler):
    """Builds DCP's index from its own classes, dtypes and containers; refuses every other global."""

    def find_class(self, module, name):
        if (module, name) in _INDEX_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


class _SafeReader(FileSystemReader):
    """DCP's file reader, with the index read by :class:`_IndexUnpickler` and its file names checked."""

    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        try:
            index = _IndexUnpickler(io.BytesIO(path.read_bytes())).load()
        except (pickle.UnpicklingError, AttributeError, EOFError, TypeError, ValueError, ImportError) as e:
            raise CheckpointError(tr(
                f"{path} is not an index that DCP wrote: it asks for {e}, which could run code when read, so it was "
                "refused and nothing of it ran. Load only checkpoints you made yourself or got from a source you "
                "trust; delete this one.",
                f"{path} は DCP が書いた索引ではありません。読み込むとコードを実行しうる {e} を求めているので拒否し、"
                "その中身は何も実行していません。自分で作ったか、信頼できる入手先のチェックポイントだけを読み込んで"
                "ください。このチェックポイントは削除してください。")) from None
        if not isinstance(index, dcp_metadata.Metadata) or any(
                not _SHARD_NAME.match(str(getattr(info, "relative_path", ""))) for info in
                (index.storage_data or {}).values()):
            raise CheckpointError(tr(f"{path} is not an index that DCP wrote (or names files outside its folder); "
                                     "it was refused.",
                                     f"{path} は DCP が書いた索引ではない（またはフォルダの外のファイルを指している）"
                                     "ので、拒否しました。"))
        if getattr(index, "storage_meta", None) is None:
            index.storage_meta = dcp_metadata.StorageMeta()
        index.storage_meta.load_id = self.load_id
        return index


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, with non-tensor entries read by ``torch.load(weights_only=True)``, never full pickle."""

    def load_bytes(self, read_item, value):
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(tr(f"An entry of the checkpoint ({read_item.dest_index.fqn}) holds an object that "
                                     f"only full unpickling could rebuild ({str(e)[:200]}); it was refused.",
                                     f"チェックポイントの項目 {read_item.dest_index.fqn} は、完全な unpickle でしか"
                                     f"復元できないオブジェクトです（{str(e)[:200]}）。拒否しました。")) from None
        checked = io.BytesIO()  # what passed the restricted load, handed on to DCP's own planner
        torch.save(obj, checked)
        checked.seek(0)
        super().load_bytes(read_item, checked)


def _verify(folder, unverified=False):
    """Check every file against the checksums written at save time (the ranks share the work); raise if one differs.
    ``unverified``: a folder without a list of checksums (saved before the course wrote them) is let through."""
    listed = folder / CHECKSUMS
    if unverified and not listed.exists():
        return
    try:
        sums = json.loads(listed.read_text())
        ok = isinstance(sums, dict) and all(isinstance(k, str) and _SHARD_NAME.match(k) for k in sums)
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(tr(
            f"{folder} has no readable list of checksums ({CHECKSUMS}), which save_sharded writes with every save, so "
            "a damaged file could not be detected. Load a checkpoint that save_sharded wrote; a checkpoint you saved "
            "yourself with an earlier version of the course (which wrote no checksums) loads with "
            "load_sharded(state, path, unverified=True), still without running any code from it.",
            f"{folder} には save_sharded が保存のたびに書くチェックサムの一覧（{CHECKSUMS}）がないか読めないため、壊れた"
            "ファイルを見つけられません。save_sharded が書いたチェックポイントを読み込んでください。以前の版のコース"
            "（チェックサムを書きませんでした）で自分が保存したチェックポイントは、load_sharded(state, path, "
            "unverified=True) で読み込めます。その場合もファイルのコードは一切実行しません。"))
    world = dist.get_world_size() if _distributed() else 1
    mine = sorted(sums)[_rank()::world]
    bad = [n for n in mine if not (folder / n).is_file() or _sha256(folder / n) != sums[n]]
    bad = sorted(n for part in _gathered(bad) for n in part)
    if bad:
        raise CheckpointError(tr(
            f"{folder}: {', '.join(bad)} differ from what was saved (a damaged disk or copy, a truncated file, or a "
            "change by hand): the checkpoint is not loaded. Load an earlier step-NNNNNNNN folder, or copy the "
            "checkpoint again from where it came.",
            f"{folder}: {', '.join(bad)} が保存したときと異なります（ディスクやコピーの破損、途中で切れたファイル、手での"
            "変更）。このチェックポイントは読み込みません。前の step-NNNNNNNN フォルダを読み込むか、元の場所からもう一度"
            "コピーしてください。"))


def load_sharded(state, path, unverified=False):
    """Load ``state`` in place from :func:`save_sharded`'s checkpoint, on any number of ranks. Explained in 09_sharding.

    ``path`` is a checkpoint root (its latest complete save is loaded) or one save's folder. ``state`` holds the
    tensors to fill, laid out for the ranks that load: DTensors of any sharding, or plain tensors in a process
    without a process group. Every file is checked against its checksum first, and the index is read by an
    unpickler that builds DCP's own classes only (a planted file runs no code). DCP reads from each file the pieces
    that each rank needs. Returns the folder read. ``unverified=True`` also loads a save that has no list of
    checksums (one written before the course recorded them), with the same safe unpickler; a list that is there is
    always checked.
    """
    path = Path(path)
    folder = latest_checkpoint(path) if (path / MARKER).is_file() else _check_complete(path)
    _verify(folder, flag(unverified, "unverified", "load_sharded"))
    reader = _SafeReader(folder)
    reader.read_metadata()  # refuse a planted index here: some releases of DCP catch the reader's error and go on
    with _single_process_is_meant(), _explained(folder, saving=False):
        dcp.load(state, checkpoint_id=folder, storage_reader=reader, planner=_SafePlanner())
    return folder
