"""Live training curves that work in JupyterLab, in scripts and under torchrun. Explained in 00_setup.

In a Jupyter kernel the :class:`Animator` shows *one* PNG image and replaces it in place through a display
handle at every update: no ``clear_output`` flicker, and text printed in the same cell stays. Outside a kernel
it writes a PNG file and prints one line per update. It never emits SVG (SVG output embeds a date and random
ids, which breaks notebook regression tests).
"""
import contextlib
import importlib.util
import io
from pathlib import Path

import matplotlib
from matplotlib import font_manager
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .errors import ConfigError
from .lang import tr
from .progress import in_kernel

FONT = "IPAexGothic"  # shipped by matplotlib-fontja; covers Japanese and Latin text
STYLE = {"font.family": [FONT, "DejaVu Sans"], "axes.unicode_minus": False}  # the ASCII minus exists in every font


def _register_font():
    """Make the Japanese font known to matplotlib (no style change); raise a clear error if it is not installed."""
    if FONT in {f.name for f in font_manager.fontManager.ttflist}:
        return
    spec = importlib.util.find_spec("matplotlib_fontja")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(tr("matplotlib-fontja is not installed, so Japanese labels would show as boxes. "
                             "Install it with `pip install matplotlib-fontja` (make install does).",
                             "matplotlib-fontja がインストールされていないため、日本語のラベルが豆腐（□）になります。"
                             "`pip install matplotlib-fontja` でインストールしてください（make install でも入ります）。"))
    for path in sorted(Path(spec.submodule_search_locations[0], "fonts").glob("*.ttf")):
        font_manager.fontManager.addfont(str(path))


def use_course_style():
    """Apply the course's figure style (a Japanese-capable font) to every later figure. Explained in 00_setup.

    An explicit call, once per notebook: importing mparlib changes nothing in matplotlib. The course's own figures
    (:class:`Animator`, the diagrams) use :func:`course_style` around their drawing and need no call.
    """
    _register_font()
    matplotlib.rcParams.update(STYLE)


@contextlib.contextmanager
def course_style():
    """The course's figure style for the figures made inside the ``with`` block only. Explained in 00_setup."""
    _register_font()
    with matplotlib.rc_context(STYLE):
        yield


def figure_png(fig, dpi=100):
    """Render a matplotlib figure to PNG bytes with no timestamp in its metadata. Explained in 00_setup."""
    buf = io.BytesIO()
    FigureCanvasAgg(fig)
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


class Animator:
    """Plot data points as they arrive, like d2l's ``Animator`` but as one in-place PNG. Explained in 00_setup.

    ``Animator(xlabel="epoch", legend=["train loss", "test acc"], xlim=[1, 10])`` then ``add(x, (y1, y2))``
    once per epoch. In a kernel the figure is shown and updated in place; ``path`` also writes it to that PNG file
    (atomically, at every update). Outside a kernel, without a ``path``, each update prints one line and no file is
    written: the course never writes into the working folder unasked. ``echo=False`` keeps that line quiet (a
    caller that prints its own line per epoch).
    """

    def __init__(self, xlabel=None, ylabel=None, legend=None, xlim=None, ylim=None, xscale="linear",
                 yscale="linear", fmts=("-", "m--", "g-.", "r:"), figsize=(4.5, 3.0), title=None,
                 path=None, display=None, echo=None):
        with course_style():
            self.fig = Figure(figsize=figsize)
            self.ax = self.fig.add_subplot()
        self.axes_config = dict(xlabel=xlabel, ylabel=ylabel, xscale=xscale, yscale=yscale, xlim=xlim, ylim=ylim,
                                title=title)  # applied in this order
        self.legend = list(legend or [])
        self.fmts = fmts
        self.X, self.Y = None, None
        self.path = path
        self.display = in_kernel() if display is None else display
        self.echo = not self.display if echo is None else echo  # one printed line per update
        self.handle = None

    def _configure(self):
        self.ax.set(**{k: v for k, v in self.axes_config.items() if v})  # labels, scales, limits, title given
        if self.legend:
            self.ax.legend(self.legend[: len(self.X)])
        self.ax.grid(True, alpha=0.3)
        self.fig.tight_layout()

    def add(self, x, y):
        """Append one point per curve (``y`` is a number or a sequence) and redraw."""
        if not hasattr(y, "__len__"):
            y = [y]
        n = len(y)
        if not hasattr(x, "__len__"):
            x = [x] * n
        if self.X is None:
            self.X, self.Y = [[] for _ in range(n)], [[] for _ in range(n)]
        if n != len(self.X):
            raise ConfigError(tr(f"This Animator draws {len(self.X)} curve(s); add() got {n} value(s).",
                                 f"この Animator が描く曲線は {len(self.X)}本ですが、add() に {n}個の値が渡されました。"))
        for i, (a, b) in enumerate(zip(x, y)):
            if a is not None and b is not None:
                self.X[i].append(float(a))
                self.Y[i].append(float(b))
        with course_style():
            self.ax.cla()
            for xs, ys, fmt in zip(self.X, self.Y, self.fmts):
                # a line through one point would be invisible: give it a marker unless its format has one
                single = {"marker": "o"} if len(xs) == 1 and not any(c in fmt for c in "o.,v^<>sp*hH+xXDd|_") else {}
                self.ax.plot(xs, ys, fmt, **single)
            self._configure()
        self.show()

    def show(self):
        """Publish the current figure: update the display in place and/or write the PNG file, or print a line."""
        with course_style():
            png = figure_png(self.fig)
        if self.display:
            from IPython.display import Image, display

            if self.handle is None:
                self.handle = display(Image(data=png), display_id=True)
            else:
                self.handle.update(Image(data=png))
        if self.path:
            from .files import atomic_write_bytes

            atomic_write_bytes(self.path, png)
        if self.echo:
            names = self.legend or [f"y{i}" for i in range(len(self.Y))]
            last = ", ".join(f"{name} {ys[-1]:.3f}" for name, ys in zip(names, self.Y) if ys)
            xs = [xs[-1] for xs in self.X if xs]
            where = f" -> {self.path}" if self.path else ""
            print(f"[plot] x={xs[-1] if xs else '-'}: {last}{where}", flush=True)
