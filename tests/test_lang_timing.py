"""The language switch and the timing helpers (chapter 00_setup)."""
import sys
import time

import pytest

import mparlib.lang
from mparlib.errors import ConfigError, DeviceError
from mparlib.timing import Timer

lang_mod = mparlib.lang


def test_import_gives_the_module():
    assert sys.modules["mparlib.lang"] is mparlib.lang and callable(mparlib.lang.tr)


def test_language_follows_the_notebook_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("MPARLIB_LANG", raising=False)
    for name in ("en", "ja"):
        (tmp_path / "notebooks" / name).mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "notebooks" / "ja")
    assert lang_mod.language() == "ja" and lang_mod.tr("Epoch", "エポック") == "エポック"
    monkeypatch.chdir(tmp_path / "notebooks" / "en")
    assert lang_mod.language() == "en" and lang_mod.tr("Epoch", "エポック") == "Epoch"
    monkeypatch.chdir(tmp_path)
    assert lang_mod.language() == "en"


def test_environment_variable_wins_and_is_checked(monkeypatch):
    monkeypatch.setenv("MPARLIB_LANG", "ja")
    assert lang_mod.language() == "ja"
    monkeypatch.setenv("MPARLIB_LANG", "fr")
    with pytest.raises(ValueError, match="not a course language"):
        lang_mod.language()


def test_timer_measures_laps():
    timer = Timer()
    for _ in range(2):
        with timer:
            time.sleep(0.02)
    assert len(timer.times) == 2
    assert all(0.015 < t < 1.0 for t in timer.times)
    assert timer.sum() == pytest.approx(sum(timer.times))
    assert timer.cumsum()[-1] == pytest.approx(timer.sum())
    assert timer.avg() == pytest.approx(timer.sum() / 2)


def test_timer_stop_without_start_is_a_clear_error():
    with pytest.raises(ConfigError, match="before Timer.start"):
        Timer().stop()
    with pytest.raises(ConfigError, match="no lap was recorded yet"):
        Timer().avg()


def test_timer_synchronises_cuda_before_reading_the_clock(monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    with Timer():
        pass
    assert calls == [None, None]  # before start and before stop, on every GPU
    with Timer("cpu"):
        pass
    assert calls == [None, None]  # a timer of the CPU has nothing to wait for


def test_timer_checks_its_device_once_when_it_is_made(monkeypatch):
    import mparlib.timing

    checked = []
    real = mparlib.timing.check_device
    monkeypatch.setattr(mparlib.timing, "check_device", lambda device, what: checked.append(device) or real(device, what))
    timer = Timer("cpu")
    for _ in range(3):
        with timer:
            pass
    assert checked == ["cpu"] and len(timer.times) == 3


def test_matmul_tflops_is_a_positive_measured_rate():
    import torch

    from mparlib.timing import matmul_tflops

    small, large = matmul_tflops("cpu", torch.float32, n=64, repeats=2), matmul_tflops("cpu", torch.float32, n=256)
    assert 0 < small < 1e3 and 0 < large < 1e3


def test_timing_helpers_refuse_bad_devices_and_sizes():
    import torch

    from mparlib.timing import matmul_tflops, synchronize

    for call in (lambda: synchronize("tpu"), lambda: Timer("tpu"), lambda: matmul_tflops("tpu")):
        with pytest.raises(DeviceError, match="'tpu' is not a device"):
            call()
    missing = f"cuda:{torch.cuda.device_count() + 3}"
    with pytest.raises(DeviceError, match=f"{missing} does not exist"):
        synchronize(missing)
    for kw, match in (({"n": 0}, "n=0"), ({"repeats": True}, "repeats=True"), ({"dtype": torch.int64}, "dtype=")):
        with pytest.raises(ConfigError, match=match):
            matmul_tflops("cpu", **kw)
