"""Argument checks shared by every entry point: one message per kind of mistake, in the learner's language.

Each check returns the value it accepted (normalised: an ``int``, a ``float``, a ``bool``) or raises
:class:`~mparlib.errors.ConfigError` naming the argument, the value it got and an example of a good one.
``where`` names the function or command the argument belongs to (``"load_fashion_mnist"``), when that helps.
Explained in 00_setup.
"""
import math
import numbers

from .errors import ConfigError
from .lang import tr


def _fail(where, en, ja, error=ConfigError):
    prefix = f"{where}: " if where else ""
    raise error(tr(prefix + en, prefix + ja))


def is_int(value):
    """True for an ``int`` (or numpy integer) that is not a ``bool``. Explained in 00_setup."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_int(value, name, example=2, where=None, *, minimum=1, error=ConfigError):
    """``value`` as an ``int`` of at least ``minimum`` (1 by default), or a clear error. Explained in 00_setup."""
    if not (is_int(value) and value >= minimum):
        if minimum == 1:
            _fail(where, f"{name}={value!r}: use a positive int such as {example}.",
                  f"{name}={value!r}: {example} のような正の整数を指定してください。", error)
        _fail(where, f"{name}={value!r}: use an int >= {minimum} such as {example}.",
              f"{name}={value!r}: {example} のような {minimum} 以上の整数を指定してください。", error)
    return int(value)


def int_in(value, name, low, high, example=None, where=None, *, error=ConfigError):
    """``value`` as an ``int`` with ``low <= value <= high``, or a clear error. Explained in 00_setup."""
    if not (is_int(value) and low <= value <= high):
        ex = low if example is None else example
        _fail(where, f"{name}={value!r}: use an int from {low} to {high}, such as {ex}.",
              f"{name}={value!r}: {low} から {high} までの整数（{ex} など）を指定してください。", error)
    return int(value)


def finite_float(value, name, example=0.1, where=None, *, positive=True, minimum=None, error=ConfigError):
    """``value`` as a finite ``float`` (positive by default, or at least ``minimum``), or a clear error.

    Explained in 00_setup.
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok and minimum is not None:
        ok = value >= minimum
    elif ok and positive:
        ok = value > 0
    if not ok:
        if minimum is not None:
            _fail(where, f"{name}={value!r}: use a finite number >= {minimum} such as {example}.",
                  f"{name}={value!r}: {example} のような {minimum} 以上の有限の数を指定してください。", error)
        if positive:
            _fail(where, f"{name}={value!r}: use a positive, finite number such as {example}.",
                  f"{name}={value!r}: {example} のような正の有限の数を指定してください。", error)
        _fail(where, f"{name}={value!r}: use a finite number such as {example}.",
              f"{name}={value!r}: {example} のような有限の数を指定してください。", error)
    return float(value)


def seconds(value, name="timeout", where=None, *, allow_none=True):
    """A positive, finite number of seconds (or ``None`` when ``allow_none``), or a clear error. Explained in 00_setup."""
    if value is None and allow_none:
        return None
    return finite_float(value, name, 30, where)


def flag(value, name, where=None, *, allow_none=False):
    """``value`` if it is ``True`` or ``False`` (or ``None`` when ``allow_none``), else a clear error.

    Explained in 00_setup.
    """
    if isinstance(value, bool) or (allow_none and value is None):
        return value
    if allow_none:
        _fail(where, f"{name}={value!r}: use True, False or None.",
              f"{name}={value!r} は使えません。True、False、または None を指定してください。")
    _fail(where, f"{name}={value!r}: use True or False.",
          f"{name}={value!r} は使えません。True か False を指定してください。")


def one_of(value, name, choices, where=None, *, error=ConfigError):
    """``value`` if it is one of ``choices``, else a clear error listing them. Explained in 00_setup."""
    if isinstance(value, (str, int, float, type(None))) and value in choices:
        return value
    shown = ", ".join(repr(c) for c in choices)
    _fail(where, f"{name}={value!r}: use one of {shown}.", f"{name}={value!r} は使えません。{shown} のどれかを指定してください。",
          error)
