"""mparlib.checks: one message per kind of mistake, the accepted value returned as the type the caller needs."""
import math

import numpy as np
import pytest

from mparlib import checks
from mparlib.errors import ConfigError, DeviceError


@pytest.mark.parametrize("value", [1, 7, np.int64(3)])
def test_positive_int_accepts_ints_and_returns_plain_ints(value):
    got = checks.positive_int(value, "n")
    assert got == value and type(got) is int


@pytest.mark.parametrize("value", [0, -1, True, False, 2.0, "2", None, np.float32(2)])
def test_positive_int_refuses_what_is_not_a_positive_int(value):
    with pytest.raises(ConfigError, match=rf"^n={value!r}: use a positive int such as 256\.$".replace("(", r"\(")
                       .replace(")", r"\)")):
        checks.positive_int(value, "n", 256)


def test_minimum_where_and_the_error_class_are_the_callers():
    assert checks.positive_int(0, "workers", 2, minimum=0) == 0
    with pytest.raises(ConfigError, match=r"^load: workers=-1: use an int >= 0 such as 2\.$"):
        checks.positive_int(-1, "workers", 2, "load", minimum=0)
    with pytest.raises(DeviceError, match="gpus=0"):
        checks.positive_int(0, "gpus", error=DeviceError)


def test_int_in_bounds_are_inclusive():
    assert checks.int_in(1024, "port", 1024, 65535) == 1024 and checks.int_in(65535, "port", 1024, 65535) == 65535
    for bad in (1023, 65536, True, 2000.0):
        with pytest.raises(ConfigError, match="from 1024 to 65535"):
            checks.int_in(bad, "port", 1024, 65535)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0, -0.1, True, "0.1", None])
def test_finite_float_refuses_nan_inf_zero_bools_and_strings(value):
    with pytest.raises(ConfigError, match="positive, finite"):
        checks.finite_float(value, "lr")


def test_finite_float_variants():
    assert checks.finite_float(np.float32(0.5), "lr") == 0.5 and type(checks.finite_float(1, "lr")) is float
    assert checks.finite_float(0, "momentum", minimum=0) == 0.0
    assert checks.finite_float(-3, "shift", positive=False) == -3.0
    with pytest.raises(ConfigError, match=r">= 0"):
        checks.finite_float(-1, "momentum", 0.9, minimum=0)
    with pytest.raises(ConfigError, match="a finite number such as"):
        checks.finite_float(math.nan, "shift", positive=False)


def test_seconds_flag_and_one_of():
    assert checks.seconds(None) is None and checks.seconds(5) == 5.0
    with pytest.raises(ConfigError, match="timeout=-1"):
        checks.seconds(-1)
    with pytest.raises(ConfigError, match="timeout=None"):
        checks.seconds(None, allow_none=False)
    assert checks.flag(True, "verify") is True and checks.flag(None, "resident", allow_none=True) is None
    for bad in (1, 0, "yes", None):
        with pytest.raises(ConfigError, match=r"use True or False\.$"):
            checks.flag(bad, "verify")
    assert checks.one_of("gloo", "backend", ("gloo", "nccl")) == "gloo"
    for bad in ("mpi", ["gloo"], None):
        with pytest.raises(ConfigError, match=r"use one of 'gloo', 'nccl'\.$"):
            checks.one_of(bad, "backend", ("gloo", "nccl"))


def test_messages_follow_the_learners_language(monkeypatch):
    monkeypatch.setenv("MPARLIB_LANG", "ja")
    with pytest.raises(ConfigError, match=r"^train: batch_size=0: 256 のような正の整数を指定してください。$"):
        checks.positive_int(0, "batch_size", 256, "train")
    with pytest.raises(ConfigError, match="True か False"):
        checks.flag("no", "verify")
