"""The course's two languages: which one a notebook speaks, and its strings. Explained in 00_setup.

Code cells are identical in `notebooks/en` and `notebooks/ja`; only what they *show* (figure labels,
class names, messages) follows the edition.
"""
import os
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
