"""The course's two languages: which one a notebook speaks, and its strings.

Code cells are identical in `notebooks/en` and `notebooks/ja`; only what they *show* (figure labels,
class names, messages) follows the edition. Explained in 00_setup.
"""
import os
from pathlib import Path

LANGS = ("en", "ja")


def lang():
    """Return the language of the running notebook, ``"en"`` or ``"ja"``. Explained in 00_setup.

    ``$MPARLIB_LANG`` wins; otherwise a kernel started in ``notebooks/ja`` (JupyterLab and nbval start
    kernels in the notebook's folder) speaks Japanese; everything else speaks English.
    """
    env = os.environ.get("MPARLIB_LANG", "").strip().lower()
    if env:
        if env not in LANGS:
            raise ValueError(f"MPARLIB_LANG={env!r} is not a course language; use one of {LANGS}.")
        return env
    cwd = Path.cwd()
    return "ja" if cwd.name == "ja" and cwd.parent.name == "notebooks" else "en"


def tr(en, ja):
    """Pick the string for the current language: ``tr("Epoch", "エポック")``. Explained in 00_setup."""
    return ja if lang() == "ja" else en
