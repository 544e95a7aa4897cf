"""Checkpoints that survive wrapping: the plain module under a wrapper, its state dict, atomic save and load.

A model wrapped in ``nn.DataParallel``, ``DistributedDataParallel`` or ``torch.compile`` names its parameters
``module.x`` or ``_orig_mod.x``; these helpers always save the plain names, so a checkpoint loads into a plain or a
wrapped model alike. Explained in 02_wrapped_attributes.

Three promises, each checked when saving rather than discovered when loading:

- **It loads back.** ``load_checkpoint`` reads with ``torch.load(..., weights_only=True)``, which rebuilds only
  tensors, numbers, strings, ``None``, dtypes, devices and lists, tuples, sets and dicts of them. ``save_checkpoint``
  converts the few values that have an exact such form (a ``Path`` becomes its ``str``, a NumPy number a Python
  number, a NumPy array a tensor, an ``argparse.Namespace`` a dict) and refuses anything else, naming the entry.
- **It replaces only its own files.** An existing checkpoint written by ``save_checkpoint`` at the same path is
  replaced (each epoch rewrites it); any other existing file is left untouched unless ``overwrite=True``.
- **It is never half written** (:mod:`mparlib.files`): a crash leaves the previous file as it was.
"""
import argparse
import collections
import dataclasses
import io
import pickle
import re
import stat
import sys
import warnings
import zipfile
from pathlib import Path, PurePath

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parameter import is_lazy

from .checks import flag
from .devices import check_device
from .errors import CheckpointError, CheckpointMismatchError, ConfigError
from .files import atomic_write_bytes
from .lang import tr

CHECKPOINT_FORMAT = "mparlib-checkpoint/1"
_FAMILY = "mparlib-checkpoint/"
_ATOMS = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device, torch.Size,
          type(torch.strided))


def unwrap(model):
    """The plain module under ``DataParallel``, ``DistributedDataParallel`` or ``torch.compile``. Explained in 02_wrapped_attributes."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # torch.compile's wrapper exists once it is imported
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
            model = model._orig_mod  # torch.compile's wrapper keeps the original module here
        else:
            return model


def _check_module(model, what):
    if not isinstance(unwrap(model), nn.Module):
        raise ConfigError(tr(f"{what} takes a model (an nn.Module, wrapped or not) first, got {type(model).__name__}.",
                             f"{what} の最初の引数にはモデル（ラップしていてもいなくてもよい nn.Module）を渡してください。"
                             f"渡されたのは {type(model).__name__} です。"))


def state_dict_of(model):
    """The model's state dict without wrapper prefixes (no ``module.``, no ``_orig_mod.``). Explained in 02_wrapped_attributes."""
    _check_module(model, "state_dict_of")
    plain = unwrap(model)
    for name, t in [*plain.named_parameters(), *plain.named_buffers()]:
        if is_lazy(t):  # a lazy layer before its first forward pass: there is no shape to save yet
            raise ConfigError(tr(
                f"Cannot save {type(plain).__name__}: '{name}' is an uninitialised lazy parameter (its shape is "
                "decided by the first forward pass). Run one dummy forward first, e.g. net(torch.zeros(1, "
                "*input_shape)) with the shape of one example, then save.",
                f"{type(plain).__name__} を save できません。'{name}' はまだ初期化されていない遅延パラメータです"
                "（形は最初の順伝播で決まります）。先にダミーの順伝播を 1回実行してください。例えば 1つの例の形で "
                "net(torch.zeros(1, *input_shape)) を呼び、それから save します。"))
    return plain.state_dict()


def _as_path(path, what):
    if isinstance(path, bool) or not isinstance(path, (str, PurePath)) and not hasattr(path, "__fspath__"):
        raise ConfigError(tr(f"{what}: the path must be a file name (a str or a pathlib.Path), got "
                             f"{type(path).__name__}.",
                             f"{what}: パスにはファイル名（str か pathlib.Path）を渡してください。渡されたのは "
                             f"{type(path).__name__} です。"))
    return Path(path).expanduser()


# ---- What a checkpoint may hold --------------------------------------------------------------------------------
def _type_name(value):
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _hint(value):
    """How to turn ``value`` into something that loads with ``weights_only=True``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return "dataclasses.asdict(value)"
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return "value._asdict()"
    if isinstance(value, frozenset):
        return "set(value)"
    if isinstance(value, torch.Tensor):
        return "value.as_subclass(torch.Tensor)"
    if isinstance(value, torch.Generator):
        return "value.get_state()"
    if hasattr(value, "state_dict"):
        return "value.state_dict()"
    return "vars(value), value.tolist() or str(value)"


def _refuse(where, value, why=None):
    why_en, why_ja = why or (f"is of type {_type_name(value)}", f"の型は {_type_name(value)} です")
    hint = "a copy without the cycle" if why else _hint(value)
    raise CheckpointError(tr(
        f"save_checkpoint: {where} {why_en}, which load_checkpoint could not read back: it loads with "
        "weights_only=True, which rebuilds only tensors, numbers, strings, None, dtypes, devices and lists, tuples, "
        f"sets and dicts of them. Nothing was written. Save it in such a form instead, e.g. {hint}.",
        f"save_checkpoint: {where} {why_ja}。load_checkpoint は weights_only=True で読み込むため、テンソル、数値、"
        "文字列、None、dtype、device と、それらのリスト・タプル・集合・辞書しか復元できず、これは読み戻せません。"
        f"何も書き込んでいません。{hint} のような形に変えてから保存してください。"))


def _portable(value, where, active=()):
    """``value`` as something ``torch.load(weights_only=True)`` rebuilds; the same object when nothing changes."""
    t = type(value)
    if t in _ATOMS or t in (torch.Tensor, nn.Parameter):
        return value
    if isinstance(value, PurePath):
        return str(value)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.generic):
        item = value.item()  # np.float64(0.5) -> 0.5, np.int64(3) -> 3, np.bool_ -> bool
        return item if type(item) in _ATOMS else _refuse(where, value)
    if np is not None and isinstance(value, np.ndarray):
        try:
            return torch.from_numpy(np.ascontiguousarray(value))  # comes back as a tensor
        except TypeError:
            return _refuse(where, value)
    if isinstance(value, argparse.Namespace):
        return _portable(dict(vars(value)), where, active)  # comes back as a dict
    if t not in (dict, collections.OrderedDict, list, tuple, set):
        return _refuse(where, value)
    if id(value) in active:
        _refuse(where, value, ("contains itself", "は自分自身を含んでいます"))
    active = (*active, id(value))
    if t in (set, list, tuple):
        items = [_portable(v, f"{where} (an element)" if t is set else f"{where}[{i}]", active)
                 for i, v in enumerate(value)]
        return value if all(a is b for a, b in zip(items, value)) else t(items)
    pairs = [(_portable(k, f"{where} (a key)", active), _portable(v, f"{where}[{k!r}]", active))
             for k, v in value.items()]
    if all(k is k0 and v is v0 for (k, v), (k0, v0) in zip(pairs, value.items())):
        return value
    new = t(pairs)
    if hasattr(value, "_metadata"):  # a state dict's per-module versions, read by load_state_dict
        new._metadata = value._metadata
    return new


# ---- Saving ----------------------------------------------------------------------------------------------------
def _is_course_checkpoint(path):
    """True for a file that ``save_checkpoint`` wrote (it carries the format marker)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # tensors are not read
    except Exception:  # noqa: BLE001 - anything unreadable is, by definition, not ours
        return False
    return isinstance(payload, dict) and str(payload.get("format", "")).startswith(_FAMILY)


def _refuse_special(path, what):
    """Refuse a path that exists as something other than a regular file (a FIFO would block, a device is no file)."""
    try:
        mode = path.stat().st_mode
    except OSError:  # absent (or a dangling link): nothing to refuse
        return
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        kind = "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else \
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a special file"
        kind_ja = {"a FIFO (named pipe)": "FIFO（名前付きパイプ）", "a socket": "ソケット", "a device": "デバイス"}.get(
            kind, "特殊なファイル")
        raise CheckpointError(tr(f"{what}: {path} is {kind}, not a regular file; a checkpoint is never written into "
                                 "or read from one (it could block forever). Give the name of an ordinary file.",
                                 f"{what}: {path} は通常のファイルではなく{kind_ja}です。チェックポイントをそこへ書いたり"
                                 "そこから読んだりはしません（永遠に待ち続けることがあります）。ふつうのファイルの名前を"
                                 "指定してください。"))


def save_checkpoint(model, path, /, *, overwrite=False, **extra):
    """Save a plain or wrapped model (plus ``extra`` values such as ``epoch=3``) atomically. Explained in 02_wrapped_attributes.

    The keys carry no ``module.`` prefix, so the file loads into a plain or a wrapped model alike. The module's
    three promises hold: ``extra`` values that would not load back are refused before a byte is written; an existing
    file that ``save_checkpoint`` did not write (your own ``torch.save`` file, notes, data) is left untouched and an
    error is raised, unless ``overwrite=True``; a crash never leaves half a checkpoint. Returns ``path``.
    """
    _check_module(model, "save_checkpoint")
    flag(overwrite, "overwrite", "save_checkpoint")
    for key in ("model", "format"):
        if key in extra:
            raise ConfigError(tr(f"save_checkpoint: '{key}' is used by the checkpoint itself; name the extra value "
                                 "differently.",
                                 f"save_checkpoint: '{key}' はチェックポイント自身が使う名前です。追加の値には別の名前を"
                                 "付けてください。"))
    path = _as_path(path, "save_checkpoint")
    if path.is_dir():
        raise CheckpointError(tr(f"save_checkpoint: {path} is a folder; give a file name such as {path / 'model.pt'}.",
                                 f"save_checkpoint: {path} はフォルダです。{path / 'model.pt'} のようにファイル名を"
                                 "指定してください。"))
    _refuse_special(path, "save_checkpoint")
    if (path.exists() or path.is_symlink()) and not overwrite and not _is_course_checkpoint(path):
        raise CheckpointError(tr(
            f"save_checkpoint: {path} exists and is not a checkpoint written by save_checkpoint; it was left "
            "untouched. Choose another file name, move that file away first, or pass overwrite=True to replace it.",
            f"save_checkpoint: {path} はすでにあり、save_checkpoint が書いたチェックポイントではないため、そのままに"
            "しました。別のファイル名を選ぶか、先にそのファイルを移動するか、置き換えてよければ overwrite=True を"
            "指定してください。"))
    payload = {"format": CHECKPOINT_FORMAT, "model": _portable(state_dict_of(model), "model")}
    payload.update((key, _portable(value, key)) for key, value in extra.items())
    try:
        serialised = io.BytesIO()
        torch.save(payload, serialised)
        atomic_write_bytes(path, serialised.getbuffer())  # a temporary file, then a rename
    except OSError as e:
        reason = e.strerror or str(e)
        raise CheckpointError(tr(
            f"save_checkpoint: could not write {path}: {reason}. The file that was there before (if any) is "
            "unchanged. Free some space or choose a folder you can write to.",
            f"save_checkpoint: {path} を書き込めませんでした（{reason}）。以前からあったファイルは変わっていません。"
            "空き容量を確保するか、書き込めるフォルダを選んでください。")) from e
    return path


# ---- Loading ---------------------------------------------------------------------------------------------------
def _unreadable(path, en, ja):
    return CheckpointError(tr(f"load_checkpoint: {path} {en} It was left unchanged. Pass a file written by "
                              "save_checkpoint or by torch.save(model.state_dict(), path).",
                              f"load_checkpoint: {path} {ja}ファイルは変更していません。save_checkpoint か "
                              "torch.save(model.state_dict(), path) で書いたファイルを渡してください。"))


def _read(path, map_location):
    """``torch.load(path, weights_only=True)``, with every way of failing put in words that name ``path``."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise CheckpointError(tr(f"load_checkpoint: cannot read {path}: {e.strerror or e}.",
                                 f"load_checkpoint: {path} を読めません（{e.strerror or e}）。")) from None
    if not head:
        raise _unreadable(path, "is empty (0 bytes): a save that never finished, or not a checkpoint.",
                          "は空（0 バイト）です。書き込みが終わらなかったか、チェックポイントではありません。")
    if head.startswith(b"PK") and not zipfile.is_zipfile(path):
        raise _unreadable(path, "is truncated or damaged: it starts like a PyTorch file but its end is missing "
                                "(an interrupted copy or download?).",
                          "は途中で切れているか壊れています。PyTorch のファイルとして始まっていますが、末尾がありません"
                          "（コピーやダウンロードが途中で止まった可能性があります）。")
    if not head.startswith((b"PK", b"\x80")):
        raise _unreadable(path, f"is not a PyTorch file (it starts with the bytes {head!r}; a text file?).",
                          f"は PyTorch のファイルではありません（先頭のバイト列は {head!r} です。テキストファイル"
                          "かもしれません）。")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f" (it needs {found[1]})" if found else ""
        what_ja = f"（{found[1]} が必要です）" if found else ""
        raise _unreadable(path, f"holds Python objects other than tensors, numbers, strings and containers{what}, so "
                                "it was not written by save_checkpoint and is not loaded: unpickling such objects "
                                "can run arbitrary code.",
                          f"にはテンソル・数値・文字列・コンテナ以外の Python オブジェクトが入っています{what_ja}。"
                          "save_checkpoint が書いたファイルではありません。そのようなオブジェクトの復元は任意の"
                          "コードを実行しうるため、読み込みません。") from None
    except (RuntimeError, EOFError, OSError, ValueError, IndexError, KeyError, zipfile.BadZipFile) as e:
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise _unreadable(path, f"is damaged or not a PyTorch file ({reason}).",
                          f"は壊れているか、PyTorch のファイルではありません（{reason}）。") from None


def _describe(missing, unexpected, shapes):
    lines = []
    if missing:
        lines.append(tr(f"missing from the checkpoint ({len(missing)}): {', '.join(missing)}",
                        f"チェックポイントにないキー（{len(missing)}個）: {', '.join(missing)}"))
    if unexpected:
        lines.append(tr(f"unexpected in the checkpoint ({len(unexpected)}): {', '.join(unexpected)}",
                        f"モデルにないキー（{len(unexpected)}個）: {', '.join(unexpected)}"))
    for key, have, want in shapes:
        lines.append(tr(f"shape of '{key}': checkpoint {tuple(have)}, model {tuple(want)}",
                        f"'{key}' の形: チェックポイント {tuple(have)}、モデル {tuple(want)}"))
    return "\n  ".join(lines)


def _split_payload(path, payload):
    """``(state dict, extra values)`` of a loaded file, or a clear error for a file of another kind."""
    if isinstance(payload, dict) and str(payload.get("format", "")).startswith(_FAMILY):
        if payload["format"] != CHECKPOINT_FORMAT:
            raise CheckpointError(tr(
                f"load_checkpoint: {path} has the format {payload['format']!r}, written by another version of the "
                f"course; this version reads {CHECKPOINT_FORMAT!r}. Load it with the version that wrote it.",
                f"load_checkpoint: {path} の形式は {payload['format']!r} で、別の版のコースが書いたものです。この版が"
                f"読めるのは {CHECKPOINT_FORMAT!r} です。書いた版のコースで読み込んでください。"))
        state = payload.get("model")
        if not isinstance(state, dict):
            raise _unreadable(path, "is damaged: its 'model' entry is not a state dict.",
                              "は壊れています。'model' の項目が状態辞書ではありません。")
        return state, {k: v for k, v in payload.items() if k not in ("format", "model")}
    if isinstance(payload, dict) and any(isinstance(v, torch.Tensor) for v in payload.values()):
        return payload, {}  # a bare state dict: torch.save(model.state_dict(), path)
    if not isinstance(payload, dict):
        kind = type(payload).__name__
        raise CheckpointError(tr(
            f"load_checkpoint: {path} holds a {kind}, not a checkpoint from save_checkpoint or a state dict. "
            "Save the model with save_checkpoint(model, path) or torch.save(model.state_dict(), path).",
            f"load_checkpoint: {path} に入っているのは {kind} で、save_checkpoint のチェックポイントでも状態辞書でも"
            "ありません。save_checkpoint(model, path) か torch.save(model.state_dict(), path) でモデルを保存して"
            "ください。"))
    found = sorted(map(str, payload))[:10]
    raise CheckpointError(tr(
        f"load_checkpoint: {path} holds neither a checkpoint from save_checkpoint nor a state dict (found "
        f"{found}). If the state dict sits under one of these keys, load the file with torch.load and call "
        "model.load_state_dict(...) on that entry.",
        f"load_checkpoint: {path} には save_checkpoint のチェックポイントも状態辞書も入っていません（中身: {found}）。"
        "このどれかのキーの下に状態辞書があるなら、torch.load でファイルを読み、その項目を "
        "model.load_state_dict(...) に渡してください。"))


def _checkpoint_file(path):
    """``path`` as a ``Path`` to an existing file, or a clear error for a folder or a missing file."""
    path = _as_path(path, "load_checkpoint")
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.pt"))[:3]
        hint_en = f" (it holds {', '.join(inside)})" if inside else ""
        hint_ja = f"（中には {', '.join(inside)} があります）" if inside else ""
        raise CheckpointError(tr(f"load_checkpoint: {path} is a folder{hint_en}; pass the checkpoint file inside it, "
                                 f"e.g. {path / (inside[0] if inside else 'checkpoint.pt')}.",
                                 f"load_checkpoint: {path} はフォルダです{hint_ja}。"
                                 f"{path / (inside[0] if inside else 'checkpoint.pt')} のように、中のチェックポイント"
                                 "ファイルを指定してください。"))
    _refuse_special(path, "load_checkpoint")
    if not path.is_file():
        where = "" if path.parent.is_dir() else tr(f" (the folder {path.parent} does not exist either)",
                                                  f"（フォルダ {path.parent} もありません）")
        raise CheckpointError(tr(f"load_checkpoint: there is no file at {path}{where}. Check the name, or save one "
                                 "first with save_checkpoint(model, path).",
                                 f"load_checkpoint: {path} にファイルがありません{where}。名前を確かめるか、先に "
                                 "save_checkpoint(model, path) で保存してください。"))
    return path


def _check_keys(path, plain, state, strict):
    """Refuse a state dict that does not fit ``plain`` (with ``strict=False``: warn about the keys that differ)."""
    expected = plain.state_dict()
    for prefix in ("module.", "_orig_mod."):  # left by wrappers; strip them unless the model itself uses them
        while state and all(k.startswith(prefix) for k in state) and not all(k.startswith(prefix) for k in expected):
            consume_prefix_in_state_dict_if_present(state, prefix)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [(k, state[k].shape, expected[k].shape) for k in expected
              if k in state and isinstance(state[k], torch.Tensor) and not is_lazy(expected[k])
              and state[k].shape != expected[k].shape]
    if shapes or (strict and (missing or unexpected)):
        raise CheckpointMismatchError(tr(
            f"{path} does not match {type(plain).__name__}:\n  {_describe(missing, unexpected, shapes)}\n"
            "Build the same architecture as the one that was saved (or pass strict=False to load the matching "
            "keys and be told about the rest).",
            f"{path} は {type(plain).__name__} と一致しません:\n  {_describe(missing, unexpected, shapes)}\n"
            "保存したときと同じ構造のモデルを作ってください（一致するキーだけ読み込み、残りを知らせてほしければ "
            "strict=False を指定します）。"), missing, unexpected, shapes)
    if missing or unexpected:
        warnings.warn(tr("load_checkpoint(strict=False) loaded the matching keys only:\n  ",
                         "load_checkpoint(strict=False) は一致するキーだけを読み込みました:\n  ")
                      + _describe(missing, unexpected, []), stacklevel=3)


def load_checkpoint(model, path, strict=True, map_location="cpu"):
    """Load a checkpoint into a plain or wrapped model and return the extra values saved with it. Explained in 02_wrapped_attributes.

    Reads files from :func:`save_checkpoint` and also bare state dicts (``torch.save(model.state_dict(), path)``),
    with or without the ``module.`` prefix that ``DataParallel`` adds. Every key must match: a missing or
    unexpected key raises :class:`CheckpointMismatchError` listing them. With ``strict=False`` the matching keys are
    loaded and the others are reported in a warning, never skipped silently; differing shapes are always an error.
    A file that cannot be read (missing, a folder, empty, truncated, not a PyTorch file, or holding arbitrary
    Python objects) raises :class:`CheckpointError` naming it; the model is then left as it was.
    """
    _check_module(model, "load_checkpoint")
    flag(strict, "strict", "load_checkpoint")
    if isinstance(map_location, (str, int, torch.device)) and not isinstance(map_location, bool):
        map_location = check_device(map_location, "map_location")
    elif not (map_location is None or isinstance(map_location, dict) or callable(map_location)):
        raise ConfigError(tr(f"load_checkpoint: map_location={map_location!r}; use a device such as 'cpu' or "
                             "'cuda:0' (or a dict or function, as torch.load accepts).",
                             f"load_checkpoint: map_location={map_location!r} は使えません。'cpu' や 'cuda:0' の"
                             "ようなデバイス（または torch.load と同じく辞書か関数）を指定してください。"))
    path = _checkpoint_file(path)
    state, extra = _split_payload(path, _read(path, map_location))
    plain = unwrap(model)
    _check_keys(path, plain, state, strict)
    plain.load_state_dict(state, strict=strict)
    return extra
