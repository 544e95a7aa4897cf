"""mparlib.checkpoint: what save_checkpoint accepts, load_checkpoint loads; it replaces only its own files; every
unreadable file gives a CheckpointError that names it. The reference for "loads back" is torch.load itself with
weights_only=True, the way load_checkpoint reads."""
import argparse
import dataclasses
import os
import pickle
import re
import socket
import subprocess
import sys
from collections import OrderedDict, namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from mparlib.checkpoint import CHECKPOINT_FORMAT, load_checkpoint, save_checkpoint
from mparlib.errors import CheckpointError, ConfigError, DeviceError


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def listing(folder):
    return sorted(p.name for p in Path(folder).iterdir())


# ---------------------------------------------------------------- what can be saved


@dataclasses.dataclass
class Config:
    lr: float = 0.1


Point = namedtuple("Point", "x y")


@pytest.mark.parametrize("value, expected", [
    (Path("/runs/a"), "/runs/a"),
    (np.float64(0.25), 0.25),
    (np.int64(7), 7),
    (np.bool_(True), True),
    (argparse.Namespace(lr=0.1, out=Path("runs"), seed=np.int32(3)), {"lr": 0.1, "out": "runs", "seed": 3}),
    (np.arange(6, dtype=np.float32).reshape(2, 3), torch.arange(6, dtype=torch.float32).reshape(2, 3)),
    ({"a", "b"}, {"a", "b"}),
    ({"history": [{"epoch": 1, "loss": float("nan")}], "shape": torch.Size([2, 3]), "dtype": torch.float16,
      "device": torch.device("cpu"), "blob": b"\x00\x01", "z": 1 + 2j, (1, "k"): None},
     {"history": [{"epoch": 1, "loss": float("nan")}], "shape": torch.Size([2, 3]), "dtype": torch.float16,
      "device": torch.device("cpu"), "blob": b"\x00\x01", "z": 1 + 2j, (1, "k"): None}),
    ([Path("x"), (np.float32(1.5),)], ["x", (1.5,)]),
], ids=["Path", "np.float64", "np.int64", "np.bool_", "argparse.Namespace", "np.ndarray", "set", "plain values",
        "nested conversions"])
def test_every_value_save_checkpoint_accepts_loads_back_with_weights_only(tmp_path, value, expected):
    path = save_checkpoint(net(), tmp_path / "c.pt", value=value)
    raw = torch.load(path, weights_only=True)  # what load_checkpoint can read, by construction
    assert raw["format"] == CHECKPOINT_FORMAT
    got = load_checkpoint(net(), path)["value"]
    assert type(got) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected) and got.dtype == expected.dtype
    elif isinstance(expected, set):
        assert got == expected  # a set's repr follows the string hashes, which change from run to run
    else:
        assert repr(got) == repr(expected)  # repr: nan == nan, and types of nested values show


class Custom:
    pass


@pytest.mark.parametrize("value, where, hint", [
    (Custom(), "extra", r"vars\(value\)"),
    (Config(), "extra", r"dataclasses.asdict\(value\)"),
    ({"cfg": {"inner": Point(1, 2)}}, r"extra\['cfg'\]\['inner'\]", r"value._asdict\(\)"),
    ([1, frozenset({2})], r"extra\[1\]", r"set\(value\)"),
    (torch.Generator(), "extra", r"value.get_state\(\)"),
    (np.array(["a", None], dtype=object), "extra", "vars"),
    (range(3), "extra", "tolist"),
], ids=["custom class", "dataclass", "namedtuple", "frozenset", "torch.Generator", "object array", "range"])
def test_values_that_would_not_load_back_are_refused_before_writing_naming_the_entry(tmp_path, value, where, hint):
    with pytest.raises(CheckpointError, match=rf"save_checkpoint: {where} is of type .*weights_only=True.*{hint}"):
        save_checkpoint(net(), tmp_path / "c.pt", extra=value)
    assert listing(tmp_path) == []


def test_a_value_that_contains_itself_is_refused(tmp_path):
    loop = []
    loop.append(loop)
    with pytest.raises(CheckpointError, match=r"loop\[0\] contains itself"):
        save_checkpoint(net(), tmp_path / "c.pt", loop=loop)


def test_a_module_whose_extra_state_would_not_load_back_is_refused_naming_the_key(tmp_path):
    class WithState(nn.Linear):
        def get_extra_state(self):
            return Custom()

        def set_extra_state(self, state):
            pass

    with pytest.raises(CheckpointError, match=r"model\['_extra_state'\] is of type"):
        save_checkpoint(WithState(2, 2), tmp_path / "c.pt")


def test_the_state_dicts_metadata_survives_so_batchnorm_versions_load(tmp_path):
    model = net()
    save_checkpoint(model, tmp_path / "c.pt", out=Path("x"))  # a conversion elsewhere in the payload
    assert hasattr(torch.load(tmp_path / "c.pt", weights_only=True)["model"], "_metadata")
    target = net()
    with torch.no_grad():
        target[0].weight.add_(1)
    load_checkpoint(target, tmp_path / "c.pt")
    assert same_state(target, model)


# ---------------------------------------------------------------- overwriting


def test_a_checkpoint_written_by_save_checkpoint_is_replaced_every_epoch(tmp_path):
    path = tmp_path / "c.pt"
    for epoch in (1, 2, 3):
        save_checkpoint(net(), path, epoch=epoch)
    assert load_checkpoint(net(), path) == {"epoch": 3}
    assert listing(tmp_path) == ["c.pt"]


@pytest.mark.parametrize("kind", ["tensor", "state dict", "text", "empty", "pickle"])
def test_any_other_existing_file_is_kept_unless_overwrite_is_true(tmp_path, kind):
    path = tmp_path / "mine.pt"
    write = {"tensor": lambda: torch.save(torch.ones(3), path),
             "state dict": lambda: torch.save(net().state_dict(), path),
             "text": lambda: path.write_text("my notes"),
             "empty": lambda: path.write_bytes(b""),
             "pickle": lambda: path.write_bytes(pickle.dumps({"a": 1}))}
    write[kind]()
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match=f"{path} exists and is not a checkpoint written by save_checkpoint; "
                                              "it was left untouched.*overwrite=True"):
        save_checkpoint(net(), path)
    assert path.read_bytes() == before and listing(tmp_path) == ["mine.pt"]
    save_checkpoint(net(), path, overwrite=True)
    assert load_checkpoint(net(), path) == {}


def test_a_folder_is_never_replaced(tmp_path):
    (tmp_path / "run").mkdir()
    for overwrite in (False, True):
        with pytest.raises(CheckpointError, match="is a folder; give a file name such as"):
            save_checkpoint(net(), tmp_path / "run", overwrite=overwrite)
    assert (tmp_path / "run").is_dir()


def test_save_arguments_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="takes a model"):
        save_checkpoint({"w": torch.ones(1)}, tmp_path / "c.pt")
    with pytest.raises(ConfigError, match="save_checkpoint: overwrite='yes': use True or False"):
        save_checkpoint(net(), tmp_path / "c.pt", overwrite="yes")
    with pytest.raises(ConfigError, match="the path must be a file name"):
        save_checkpoint(net(), 3)
    for key in ("model", "format"):
        with pytest.raises(ConfigError, match=f"'{key}' is used by the checkpoint itself"):
            save_checkpoint(net(), tmp_path / "c.pt", **{key: 1})
    save_checkpoint(net(), tmp_path / "c.pt", path="extra values may be called path")
    assert listing(tmp_path) == ["c.pt"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into read-only folders")
def test_an_unwritable_folder_is_reported_naming_the_target_not_the_temporary_file(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(CheckpointError) as info:
            save_checkpoint(net(), folder / "c.pt")
    finally:
        folder.chmod(0o700)
    assert f"could not write {folder / 'c.pt'}: Permission denied" in str(info.value)
    assert ".tmp" not in str(info.value)


def test_a_write_error_names_the_target_not_the_temporary_file(tmp_path, monkeypatch):
    real_replace = os.replace

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", src)  # what the OS reports: the temporary name

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(net(), tmp_path / "c.pt")
    monkeypatch.setattr(os, "replace", real_replace)
    assert f"could not write {tmp_path / 'c.pt'}: Permission denied" in str(info.value)
    assert ".tmp" not in str(info.value) and listing(tmp_path) == []


# ---------------------------------------------------------------- a writer that died mid-write


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# The host part of a temporary file's name, .<name>.<host>.<pid>.<random>.tmp (mparlib.files describes it).
HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def leftover(path, pid, host=HOST):
    tmp = path.parent / f".{path.name}.{host}.{pid}.0123abcd.tmp"
    tmp.write_bytes(b"half a checkpoint")
    return tmp


def test_the_next_save_removes_a_dead_writers_temporary_file_and_keeps_a_live_ones(tmp_path):
    path = tmp_path / "c.pt"
    stale = leftover(path, dead_pid())
    other_host = leftover(path, dead_pid(), host="another-node")  # a shared folder: cannot tell, so kept
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = leftover(path, live.pid)
        unrelated = tmp_path / ".notes.txt.x.1.ab.tmp"
        unrelated.write_text("not ours")
        save_checkpoint(net(), path, epoch=1)
        assert not stale.exists()
        assert busy.exists() and other_host.exists() and unrelated.exists()
    finally:
        live.kill()
        live.wait()
    assert load_checkpoint(net(), path) == {"epoch": 1}


@pytest.mark.slow
def test_a_killed_save_leaves_the_previous_file_and_the_leftover_goes_next_time(tmp_path, child_env):
    path = tmp_path / "c.pt"
    save_checkpoint(net(), path, epoch=1)
    code = ("import os, torch\n"
            "from mparlib.checkpoint import save_checkpoint\n"
            "os.fsync = lambda fd: os._exit(9)  # killed after writing, before the data is on disk and renamed\n"
            f"save_checkpoint(torch.nn.Linear(3, 4), {str(path)!r}, epoch=2)\n")
    assert subprocess.run([sys.executable, "-c", code], env=child_env()).returncode == 9
    leftovers = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) == 1 and load_checkpoint(net(), path) == {"epoch": 1}
    assert leftovers[0].name.startswith(f".c.pt.{HOST}.")
    save_checkpoint(net(), path, epoch=2)
    assert listing(tmp_path) == ["c.pt"]


# ---------------------------------------------------------------- files that cannot be loaded


@pytest.fixture
def model_and_state(tmp_path):
    model = net()
    return model, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind, match", [
    ("missing", "there is no file at"),
    ("missing folder", r"\(the folder .* does not exist either\)"),
    ("folder", "is a folder .*pass the checkpoint file inside it"),
    ("empty", r"is empty \(0 bytes\)"),
    ("truncated", "is truncated or damaged"),
    ("text", "is not a PyTorch file .*a text file"),
    ("foreign pickle", "holds Python objects other than tensors.*it needs .*Custom"),
    ("plain tensor", "holds a Tensor, not a checkpoint"),
    ("other dict", r"found \['epoch', 'weights'\]"),
    ("newer format", "'mparlib-checkpoint/9', written by another version of the course"),
    ("damaged model entry", "its 'model' entry is not a state dict"),
])
def test_every_unreadable_file_gives_a_checkpoint_error_naming_it(tmp_path, model_and_state, kind, match):
    path = tmp_path / "c.pt"
    save_checkpoint(net(), tmp_path / "good.pt")
    good = (tmp_path / "good.pt").read_bytes()
    if kind == "missing folder":
        path = tmp_path / "nowhere" / "c.pt"
    elif kind == "folder":
        path = tmp_path
    elif kind != "missing":
        path.write_bytes({
            "empty": b"", "truncated": good[:len(good) // 2], "text": b"epoch 3: loss 0.5\n",
            "foreign pickle": b"", "plain tensor": b"", "other dict": b"", "newer format": b"",
            "damaged model entry": b""}[kind])
        if kind == "foreign pickle":
            torch.save({"model": Custom()}, path)
        elif kind == "plain tensor":
            torch.save(torch.ones(2), path)
        elif kind == "other dict":
            torch.save({"epoch": 1, "weights": [1.0]}, path)
        elif kind == "newer format":
            torch.save({"format": "mparlib-checkpoint/9", "model": {}}, path)
        elif kind == "damaged model entry":
            torch.save({"format": CHECKPOINT_FORMAT, "model": 3}, path)
    model, state = model_and_state
    with pytest.raises(CheckpointError, match=match) as info:
        load_checkpoint(model, path)
    message = str(info.value)
    assert str(path) in message and "weights_only=False" not in message
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # the model is untouched


def test_load_arguments_are_checked(tmp_path):
    path = save_checkpoint(net(), tmp_path / "c.pt")
    with pytest.raises(ConfigError, match="takes a model"):
        load_checkpoint(OrderedDict(), path)
    with pytest.raises(ConfigError, match="load_checkpoint: strict=1: use True or False"):
        load_checkpoint(net(), path, strict=1)
    with pytest.raises(ConfigError, match="map_location=3.5"):
        load_checkpoint(net(), path, map_location=3.5)
    with pytest.raises(DeviceError, match="'tpu' is not a device"):
        load_checkpoint(net(), path, map_location="tpu")
    missing = f"cuda:{torch.cuda.device_count() + 3}"
    with pytest.raises(DeviceError, match=f"map_location={missing} does not exist"):
        load_checkpoint(net(), path, map_location=missing)
    assert load_checkpoint(net(), path, map_location=torch.device("cpu")) == {}
    assert load_checkpoint(net(), path, map_location=lambda storage, loc: storage) == {}


def test_checkpoint_errors_speak_japanese_in_the_japanese_edition(tmp_path, monkeypatch):
    monkeypatch.setenv("MPARLIB_LANG", "ja")
    (tmp_path / "notes.pt").write_text("x")
    with pytest.raises(CheckpointError, match="save_checkpoint が書いたチェックポイントではないため、そのままにしました"):
        save_checkpoint(net(), tmp_path / "notes.pt")
    with pytest.raises(CheckpointError, match="は PyTorch のファイルではありません"):
        load_checkpoint(net(), tmp_path / "notes.pt")
    with pytest.raises(CheckpointError, match=r"cfg の型は .*Custom です。.*weights_only=True"):
        save_checkpoint(net(), tmp_path / "c.pt", cfg=Custom())


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_fifo_is_refused_at_once_and_never_blocks(tmp_path, overwrite):
    fifo = tmp_path / "model.pt"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match=r"is a FIFO \(named pipe\), not a regular file"):
        save_checkpoint(nn.Linear(2, 2), fifo, overwrite=overwrite)
    with pytest.raises(CheckpointError, match=r"is a FIFO \(named pipe\), not a regular file"):
        load_checkpoint(nn.Linear(2, 2), fifo)
    assert fifo.is_fifo()


def test_a_device_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="is a device, not a regular file"):
        save_checkpoint(nn.Linear(2, 2), "/dev/null", overwrite=True)
