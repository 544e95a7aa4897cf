"""The language switch and the timing helpers (chapter 00_setup)."""
import sys
import time

import pytest

import mparlib.lang  # noqa: F401  (the module; the package exports its function `lang`)
from mparlib.timing import Accumulator, Timer

lang_mod = sys.modules["mparlib.lang"]


def test_language_follows_the_notebook_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("MPARLIB_LANG", raising=False)
    for name in ("en", "ja"):
        (tmp_path / "notebooks" / name).mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "notebooks" / "ja")
    assert lang_mod.lang() == "ja" and lang_mod.tr("Epoch", "エポック") == "エポック"
    monkeypatch.chdir(tmp_path / "notebooks" / "en")
    assert lang_mod.lang() == "en" and lang_mod.tr("Epoch", "エポック") == "Epoch"
    monkeypatch.chdir(tmp_path)
    assert lang_mod.lang() == "en"


def test_environment_variable_wins_and_is_checked(monkeypatch):
    monkeypatch.setenv("MPARLIB_LANG", "ja")
    assert lang_mod.lang() == "ja"
    monkeypatch.setenv("MPARLIB_LANG", "fr")
    with pytest.raises(ValueError, match="not a course language"):
        lang_mod.lang()


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
    with pytest.raises(RuntimeError, match="before Timer.start"):
        Timer().stop()


def test_timer_synchronises_cuda_before_reading_the_clock(monkeypatch):
    calls = []
    monkeypatch.setattr("mparlib.timing.synchronize", lambda device=None: calls.append(device))
    with Timer():
        pass
    assert len(calls) == 2


def test_accumulator_sums_and_checks_arity():
    acc = Accumulator(2)
    acc.add(1, 2)
    acc.add(0.5, 3)
    assert (acc[0], acc[1]) == (1.5, 5.0)
    with pytest.raises(ValueError, match="holds 2 values, got 1"):
        acc.add(1)
    acc.reset()
    assert acc.data == [0.0, 0.0]


def test_matmul_tflops_is_a_positive_measured_rate():
    import torch

    from mparlib.timing import matmul_tflops

    small, large = matmul_tflops("cpu", torch.float32, n=64, repeats=2), matmul_tflops("cpu", torch.float32, n=256)
    assert 0 < small < 1e3 and 0 < large < 1e3
