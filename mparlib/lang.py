"""The course's two languages: which one a notebook speaks, its strings, and the printer of its tables. Explained in 00_setup.

Code cells are identical in `notebooks/en` and `notebooks/ja`; only what they *show* (figure labels,
class names, messages) follows the edition. Every table and every column of labelled lines that a chapter or
`mparlib` prints goes through :func:`table`: labels are given as ``(en, ja)`` pairs, columns are padded by display
width (a Japanese character takes two columns of a terminal or a notebook's fixed-width font), and lists of items
are joined the way each language writes them (:func:`join`).
"""
import numbers
import os
import re
import unicodedata
import warnings
from pathlib import Path

from .errors import ConfigError

LANGS = ("en", "ja")


def language():
    """The language of the running notebook, ``"en"`` or ``"ja"``. Explained in 00_setup.

    ``$MPARLIB_LANG`` wins; otherwise a kernel started in ``notebooks/ja`` (JupyterLab and nbval start
    kernels in the notebook's folder) speaks Japanese; everything else speaks English.
    """
    env = os.environ.get("MPARLIB_LANG", "").strip().lower()
    if env:
        if env not in LANGS:
            # Both languages at once: the setting that picks the language is the one that is broken.
            raise ConfigError(f"MPARLIB_LANG={env!r} is not a course language; use one of {LANGS}. "
                             f"MPARLIB_LANG={env!r} はコースの言語ではありません。{LANGS} のどれかを指定してください。")
        return env
    cwd = Path.cwd()
    return "ja" if cwd.name == "ja" and cwd.parent.name == "notebooks" else "en"


def tr(en, ja):
    """Pick the string for the current language: ``tr("Epoch", "エポック")``. Explained in 00_setup.

    With a broken ``$MPARLIB_LANG`` the message is given in English, with a warning that says so: the message
    being built (often an error of its own) is never hidden behind the language setting's error.
    """
    try:
        return ja if language() == "ja" else en
    except ConfigError as e:
        warnings.warn(f"{e} Messages are shown in English until it is fixed. / 修正するまでメッセージは英語で表示します。",
                      stacklevel=2)
        return en


def text(label):
    """A label in the current language: an ``(en, ja)`` pair goes through :func:`tr`, anything else through ``str``
    (an ``int`` with thousands separators); :func:`table` and :func:`join` read their cells with it. Explained in 08_collectives."""
    if isinstance(label, tuple) and len(label) == 2 and all(isinstance(part, str) for part in label):
        return tr(*label)
    if isinstance(label, numbers.Integral) and not isinstance(label, bool):
        return f"{label:,}"
    return str(label)


def join(items):
    """Items as one list in the current language: ``a, b, c`` in English, ``a、b、c`` in Japanese (a half-width comma
    between Japanese items reads as a typo there). Items may be ``(en, ja)`` pairs. Explained in 08_collectives."""
    return tr(", ", "、").join(text(item) for item in items)


def display_width(value):
    """Columns ``value`` takes in a terminal: East Asian wide and full-width characters count 2. Explained in 08_collectives."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 0 if unicodedata.combining(c) else 1
               for c in str(value))


def pad(value, width, align="<"):
    """``value`` padded with spaces to ``width`` display columns (``align`` ``"<"`` or ``">"``); never cut. Explained in 08_collectives.

    ``f"{text:<10}"`` counts characters, so a Japanese label of 5 characters, 10 columns wide, ends a table's column
    5 columns too late; this counts columns (:func:`display_width`).
    """
    if align not in ("<", ">"):  # not checks.one_of: checks imports this module
        raise ConfigError(tr(f"pad: align={align!r} is not one of '<' (left) or '>' (right).",
                             f"pad: align={align!r} は '<'（左寄せ）か '>'（右寄せ）のどちらかにしてください。"))
    return _pad(str(value), width, align)


def _pad(value, width, align):
    fill = " " * max(0, width - display_width(value))
    return value + fill if align == "<" else fill + value


_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:e[-+]?\d+)?(?: ?(?:%|x|倍|[kMG]?i?B|m?s|μs|GB/s))?|-|—")


def table(rows, head=None, *, align=None, indent=0, gap=2):
    """Rows as text with columns lined up by display width; the chapters' and mparlib's one table printer. Explained in 08_collectives.

    ``rows``: sequences of cells, each a string, a number or an ``(en, ja)`` pair (:func:`text`); ``head``: the
    header row, or None. A column whose cells are all numbers (``12``, ``3.5e-07``, ``1,024``, ``42%``, ``1.5x``,
    ``3 ms``) is right-aligned, any other left-aligned, unless ``align`` gives one character per column (``"<>>"``).
    Columns are ``gap`` spaces apart, so a cell never runs into the next one however long it is; the last
    left-aligned column is not padded (no trailing spaces).
    """
    lines = ([[text(cell) for cell in head]] if head is not None else []) + [[text(cell) for cell in row] for row in rows]
    if not lines:
        return ""
    ncols = max(len(line) for line in lines)
    lines = [line + [""] * (ncols - len(line)) for line in lines]
    body = lines[1:] if head is not None else lines
    if align is None:
        filled = [[row[c] for row in body if row[c]] for c in range(ncols)]
        align = "".join(">" if cells and all(_NUMBER.fullmatch(cell) for cell in cells) else "<" for cells in filled)
    if len(align) != ncols or set(align) - {"<", ">"}:
        raise ConfigError(tr(f"table: align={align!r} needs one '<' or '>' for each of the {ncols} columns.",
                             f"table: align={align!r} には、{ncols}列のそれぞれに '<' か '>' を 1つずつ指定してください。"))
    widths = [max(display_width(line[c]) for line in lines) for c in range(ncols)]
    return "\n".join((" " * indent + (" " * gap).join(_pad(cell, w, a) for cell, w, a in zip(line, widths, align))).rstrip()
                     for line in lines)
