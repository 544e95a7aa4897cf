"""The device helpers and the course profile (chapter 00_setup)."""
import re

import pytest
import torch

import mparlib
from mparlib import devices
from mparlib.errors import DeviceError


def test_try_all_gpus_never_returns_an_empty_list():
    found = mparlib.try_all_gpus()
    assert len(found) == max(1, mparlib.num_gpus())
    if mparlib.num_gpus() == 0:
        assert found == [torch.device("cpu")]


def test_d2l_returns_an_empty_list_without_a_gpu_which_is_why_the_course_has_its_own():
    from d2l import torch as d2l

    if mparlib.num_gpus() == 0:
        assert d2l.try_all_gpus() == []
    else:
        assert len(d2l.try_all_gpus()) == mparlib.num_gpus()


def test_try_gpu_falls_back_to_the_cpu_only_for_missing_gpus(monkeypatch):
    monkeypatch.setattr(devices, "num_gpus", lambda: 2)
    assert devices.try_gpu(1) == torch.device("cuda:1")
    assert devices.try_gpu(2) == torch.device("cpu")


def test_require_gpus_says_how_many_exist(monkeypatch):
    monkeypatch.setenv("MPARLIB_LANG", "en")
    monkeypatch.setattr(devices, "num_gpus", lambda: 1)
    assert devices.require_gpus(1) == [torch.device("cuda:0")]
    with pytest.raises(DeviceError, match=r"asks for 2 GPU\(s\) but PyTorch sees 1"):
        devices.require_gpus(2)


@pytest.mark.parametrize("gpus, expected", [(0, "smoke"), (1, "full"), (8, "full")])
def test_profile_follows_the_hardware(monkeypatch, gpus, expected):
    monkeypatch.delenv("MPARLIB_PROFILE", raising=False)
    monkeypatch.setattr(devices, "num_gpus", lambda: gpus)
    assert devices.profile() == expected


def test_profile_can_be_overridden_and_rejects_typos(monkeypatch):
    monkeypatch.setenv("MPARLIB_PROFILE", "FULL")
    assert devices.profile() == "full"
    monkeypatch.setenv("MPARLIB_PROFILE", "fast")
    with pytest.raises(ValueError, match="MPARLIB_PROFILE='fast': use one of 'smoke', 'full'"):
        devices.profile()


def test_profile_line_names_the_profile_and_how_to_change_it(monkeypatch):
    monkeypatch.setenv("MPARLIB_PROFILE", "smoke")
    monkeypatch.setenv("MPARLIB_LANG", "en")
    assert "smoke" in devices.profile_line() and "MPARLIB_PROFILE=full" in devices.profile_line()
    monkeypatch.setenv("MPARLIB_LANG", "ja")
    assert "プロファイル" in devices.profile_line()


def test_report_is_one_table_with_versions_and_profile():
    text = mparlib.report()
    keys = [line.split("  ")[0] for line in text.splitlines()]
    assert keys[:2] == ["python", "torch"] and "profile" in keys
    assert torch.__version__ in text
    assert sum(k.startswith("cuda:") for k in keys) == mparlib.num_gpus()


def test_require_gpus_speaks_japanese_in_the_japanese_edition(monkeypatch):
    monkeypatch.setenv("MPARLIB_LANG", "ja")
    monkeypatch.setattr(devices, "num_gpus", lambda: 0)
    with pytest.raises(DeviceError, match="GPU が 2枚必要ですが、PyTorch から見える GPU は 0枚です"):
        devices.require_gpus(2)


def test_the_torch_floor_is_read_from_the_package_and_enforced(monkeypatch):
    import importlib.metadata

    from mparlib.errors import ConfigError
    floor = devices.check_torch("Chapter 12")  # the installed torch passes, and the floor is the package's
    need = ".".join(map(str, floor))
    assert f"torch>={need}" in importlib.metadata.requires("mparlib")
    monkeypatch.setattr(torch, "__version__", f"{floor[0]}.{floor[1] - 1}.1+cpu")
    with pytest.raises(ConfigError, match=rf"Chapter 12 needs torch {re.escape(need)} or newer \(this is "):
        devices.check_torch("Chapter 12")
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: ["numpy>=1.24"])
    with pytest.raises(ConfigError, match="no torch>=X.Y floor"):
        devices.check_torch("Chapter 12")
