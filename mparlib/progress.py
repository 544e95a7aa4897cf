"""Where the code runs, and progress bars that suit it: Jupyter, a terminal, or a quiet build. Explained in 00_setup."""
import importlib.util
import os
import sys


def in_kernel():
    """True when running inside a Jupyter kernel (where rich display works). Explained in 00_setup."""
    ip = sys.modules.get("IPython")
    if ip is None:
        return False
    shell = ip.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def quiet():
    """True when progress output should be left out: under pytest, or with ``MPARLIB_QUIET=1``. Explained in 00_setup.

    The stored notebooks are built with ``MPARLIB_QUIET=1``, so the book shows results, not progress bars.
    """
    return "PYTEST_CURRENT_TEST" in os.environ or bool(os.environ.get("MPARLIB_QUIET"))


def progress_bar(iterable, total=None, desc=None, enabled=None, unit="batch"):
    """``iterable`` with a tqdm bar that counts its items, or ``None`` when none should show. Explained in 00_setup.

    ``enabled=None`` shows it in a terminal, or in Jupyter when ipywidgets is installed (tqdm draws a widget there),
    and never when :func:`quiet`. Without ipywidgets a kernel gets the text bar.
    """
    kernel = in_kernel()
    widgets = kernel and importlib.util.find_spec("ipywidgets") is not None
    if enabled is None:
        tty = getattr(sys.stderr, "isatty", None)
        enabled = not quiet() and (widgets or (not kernel and tty is not None and tty()))
    if not enabled:
        return None
    if widgets:
        from tqdm.auto import tqdm
    else:  # a text bar; also in a kernel without ipywidgets, where tqdm.auto would fail
        from tqdm.std import tqdm
    # The bar only counts: it never iterates ``iterable`` itself. tqdm.auto's bar calls iter() on its iterable when
    # it is made and again when it is looped over, which for a DataLoader starts its workers twice and draws the
    # shuffle of the next epoch, so a run with the bar trained on other batches than the same run without it.
    return _Counted(iterable, tqdm(total=total, desc=desc, leave=False, unit=unit, file=sys.stderr))


class _Counted:
    """``iterable`` looped over once, ``bar`` advanced by one per item; ``close()`` closes the bar."""

    def __init__(self, iterable, bar):
        self.iterable, self.bar = iterable, bar

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.bar.update(1)

    def close(self):
        self.bar.close()
