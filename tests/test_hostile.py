"""Hostile and mistaken inputs, grouped by surface: each must end in a clear course error, never run code, lose data,
hang or give a silent wrong result.

Sharded checkpoints are saved and loaded here in one process without a process group (DCP allows it), so these
tests start no processes.
"""
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from mparlib.errors import CheckpointError, ConfigError, OutputLocked
from mparlib.runfolder import lock_folder
from mparlib.sharded_checkpoint import CHECKSUMS, MARKER, latest_checkpoint, load_sharded, save_sharded


def _state(seed=0, width=4):
    torch.manual_seed(seed)
    return {"model": torch.nn.Linear(width, 3).state_dict()}


def _saved(root, step=1, seed=0):
    folder = save_sharded(_state(seed), root, step=step)
    return folder


def _replant(folder, name, data):
    """Replace ``folder/name`` and fix the checksum list to match, as someone planting a file would."""
    import hashlib

    (folder / name).write_bytes(data)
    sums = json.loads((folder / CHECKSUMS).read_text())
    sums[name] = hashlib.sha256(data).hexdigest()
    (folder / CHECKSUMS).write_text(json.dumps(sums))


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


# ------------------------------------------------------------------------------------ sharded checkpoints

def test_a_planted_index_runs_no_code_and_is_refused(tmp_path):
    folder = _saved(tmp_path / "ckpt")
    marker = tmp_path / "ran.txt"
    _replant(folder, ".metadata", pickle.dumps(_RunsCode(marker)))
    with pytest.raises(CheckpointError, match=r"not an index that DCP wrote: it asks for builtins\.exec"):
        load_sharded(_state(), folder)
    assert not marker.exists()


def test_an_object_entry_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran.txt"
    save_sharded({"model": _state()["model"], "note": _RunsCode(marker)}, tmp_path / "ckpt", step=1)
    assert not marker.exists()  # pickling it ran nothing
    with pytest.raises(CheckpointError, match="only full unpickling could rebuild"):
        load_sharded({"model": _state()["model"], "note": None}, tmp_path / "ckpt")
    assert not marker.exists()


def test_plain_entries_beside_tensors_load_back(tmp_path):
    save_sharded({"model": _state(1)["model"], "meta": {"epoch": 3, "name": "run", "betas": (0.9, 0.99)}},
                 tmp_path, step=2)
    state = {"model": _state(2)["model"], "meta": {"epoch": 0, "name": "", "betas": (0.0, 0.0)}}
    assert load_sharded(state, tmp_path) == tmp_path / "step-00000002"
    assert state["meta"] == {"epoch": 3, "name": "run", "betas": (0.9, 0.99)}
    assert all(torch.equal(state["model"][k], v) for k, v in _state(1)["model"].items())


def test_a_flipped_bit_in_a_shard_is_named(tmp_path):
    folder = _saved(tmp_path)
    shard = next(folder.glob("__*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    state = _state(5)
    with pytest.raises(CheckpointError, match=rf"{shard.name} differ from what was saved"):
        load_sharded(state, tmp_path)
    assert torch.equal(state["model"]["weight"], _state(5)["model"]["weight"])  # nothing was loaded


def test_a_truncated_shard_is_named(tmp_path):
    folder = _saved(tmp_path)
    shard = next(folder.glob("__*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{shard.name} differ"):
        load_sharded(_state(), tmp_path)


def test_a_checkpoint_without_checksums_is_refused(tmp_path):
    folder = _saved(tmp_path)
    (folder / CHECKSUMS).unlink()
    with pytest.raises(CheckpointError, match="no readable list of checksums"):
        load_sharded(_state(), folder)


def test_a_save_from_before_checksums_loads_when_asked_and_still_runs_no_code(tmp_path):
    folder = _saved(tmp_path / "old", seed=3)
    (folder / CHECKSUMS).unlink()  # as saved by a version of the course that wrote no checksums
    state = _state(4)
    with pytest.raises(CheckpointError, match=r"unverified=True"):
        load_sharded(state, folder)
    assert load_sharded(state, folder, unverified=True) == folder
    assert all(torch.equal(state["model"][k], v) for k, v in _state(3)["model"].items())
    marker = tmp_path / "ran.txt"
    (folder / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(CheckpointError, match=r"not an index that DCP wrote"):
        load_sharded(_state(), folder, unverified=True)
    assert not marker.exists()


def test_unverified_never_skips_a_list_of_checksums_that_is_there(tmp_path):
    folder = _saved(tmp_path)
    shard = next(folder.glob("__*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{shard.name} differ"):
        load_sharded(_state(), tmp_path, unverified=True)
    with pytest.raises(ConfigError, match="unverified='yes'"):
        load_sharded(_state(), tmp_path, unverified="yes")


def test_a_shape_mismatch_says_what_to_fix(tmp_path):
    _saved(tmp_path)
    with pytest.raises(CheckpointError, match="another shape than the one given to fill"):
        load_sharded(_state(width=5), tmp_path)


def test_latest_pointing_outside_the_root_is_not_followed(tmp_path):
    _saved(tmp_path / "other", step=1, seed=1)
    _saved(tmp_path / "mine", step=1)
    (tmp_path / "mine" / MARKER).write_text("../other/step-00000001\n")
    with pytest.raises(CheckpointError, match=r"which is not a save of this root.*not followed"):
        load_sharded(_state(), tmp_path / "mine")


def test_latest_naming_a_missing_folder_says_so(tmp_path):
    folder = _saved(tmp_path)
    folder.rename(tmp_path / "moved")
    with pytest.raises(CheckpointError, match=r"names step-00000001, but .* is missing"):
        latest_checkpoint(tmp_path)


def test_a_folder_given_by_mistake_is_not_called_a_broken_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="is not a checkpoint: give the checkpoint root") as e:
        load_sharded(_state(), tmp_path)
    assert "delete" not in str(e.value)


@pytest.mark.parametrize("step", [1.9, -1, True, "3"])
def test_a_step_that_is_not_a_whole_number_is_refused(tmp_path, step):
    with pytest.raises(ConfigError, match=f"step={step!r}"):
        save_sharded(_state(), tmp_path, step=step)
    assert not any(tmp_path.glob("*step*"))


def test_a_save_never_deletes_a_partial_folder_it_did_not_write(tmp_path):
    partial = tmp_path / ".step-00000004.partial"
    partial.mkdir()
    (partial / "notes.txt").write_text("not a shard")
    with pytest.raises(CheckpointError, match=r"holds 'notes.txt', which a save did not write"):
        save_sharded(_state(), tmp_path, step=4)
    assert (partial / "notes.txt").read_text() == "not a shard"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "__0_0.distcp").write_text("keep")
    partial2 = tmp_path / ".step-00000005.partial"
    partial2.symlink_to(outside)
    with pytest.raises(CheckpointError, match="which a save did not write"):
        save_sharded(_state(), tmp_path, step=5)
    assert (outside / "__0_0.distcp").read_text() == "keep"


def test_what_a_killed_save_left_is_cleared_by_the_next_save(tmp_path):
    partial = tmp_path / ".step-00000004.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    assert save_sharded(_state(), tmp_path, step=4) == tmp_path / "step-00000004" and not partial.exists()


def test_one_checkpoint_root_has_one_writer(tmp_path):
    with lock_folder(tmp_path, what="--out"):  # another run holds the root
        with pytest.raises(OutputLocked, match="in use by another run"):
            save_sharded(_state(), tmp_path, step=1)
    assert not (tmp_path / MARKER).exists()
    save_sharded(_state(), tmp_path, step=1)
    assert os.path.isdir(tmp_path / "step-00000001") and Path(tmp_path / MARKER).read_text() == "step-00000001\n"


# ------------------------------------------------------------------------------------ the launcher's surfaces

@pytest.mark.parametrize("name, ascii_name", [("ｍｙ＿ｗｏｒｋｅｒｓ", "my_workers"), ("ｗｏｒｋｅｒｓ２", "workers2")])
def test_a_full_width_worker_name_is_refused_with_the_ascii_one(name, ascii_name):
    from mparlib.workers import write_worker

    with pytest.raises(ConfigError, match=rf"full-width \(zenkaku\).*%%worker {ascii_name}$"):
        write_worker(name, "x = 1\n")


# ------------------------------------------------------------------------------------ the language setting

def test_an_unknown_language_never_hides_the_error_being_reported(monkeypatch):
    from mparlib.checks import finite_float

    monkeypatch.setenv("MPARLIB_LANG", "fr")
    with pytest.warns(UserWarning, match=r"MPARLIB_LANG='fr' is not a course language.*shown in English"):
        with pytest.raises(ConfigError, match=r"^train: lr=nan: use a positive, finite number"):
            finite_float(float("nan"), "lr", 0.1, "train")


@pytest.mark.slow
def test_a_multiprocessing_queue_still_reaches_the_ranks():
    import multiprocessing

    from launch_workers import puts_rank
    from mparlib.launch import launch

    queue = multiprocessing.get_context("spawn").Queue()
    assert launch(puts_rank, 2, args=(queue,), echo=False, limit=300) == 0
    assert sorted(queue.get(timeout=60) for _ in range(2)) == [0, 1]
