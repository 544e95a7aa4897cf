"""Live training curves that work in JupyterLab, in scripts and under torchrun. Explained in 00_setup.

In a Jupyter kernel the :class:`Animator` shows *one* PNG image and replaces it in place through a display
handle at every update: no ``clear_output`` flicker, and text printed in the same cell stays. Outside a kernel
it writes a PNG file and prints one line per update. It never emits SVG (SVG output embeds a date and random
ids, which breaks notebook regression tests).
"""
import io
import sys
import warnings

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

try:  # a Japanese-capable font for every figure of the course (IPAex Gothic also covers Latin text)
    import matplotlib_fontja  # noqa: F401  (registers the font and selects it)
except ImportError:  # pragma: no cover - the course's install always has it
    warnings.warn("matplotlib-fontja is not installed: Japanese labels will show as boxes. "
                  "Install it with `pip install matplotlib-fontja`.", stacklevel=2)
matplotlib.rcParams["axes.unicode_minus"] = False  # the ASCII minus exists in every font


def in_kernel():
    """True when running inside a Jupyter kernel (where rich display works). Explained in 00_setup."""
    ip = sys.modules.get("IPython")
    if ip is None:
        return False
    shell = ip.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def figure_png(fig, dpi=100):
    """Render a matplotlib figure to PNG bytes with no timestamp in its metadata."""
    buf = io.BytesIO()
    FigureCanvasAgg(fig)
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


class Animator:
    """Plot data points as they arrive, like d2l's ``Animator`` but as one in-place PNG. Explained in 00_setup.

    ``Animator(xlabel="epoch", legend=["train loss", "test acc"], xlim=[1, 10])`` then ``add(x, (y1, y2))``
    once per epoch. ``path`` names the PNG written outside a kernel (and, if given, inside one too).
    """

    def __init__(self, xlabel=None, ylabel=None, legend=None, xlim=None, ylim=None, xscale="linear",
                 yscale="linear", fmts=("-", "m--", "g-.", "r:"), figsize=(4.5, 3.0), title=None,
                 path=None, display=None):
        self.fig = Figure(figsize=figsize)
        self.ax = self.fig.add_subplot()
        self.axes_config = dict(xlabel=xlabel, ylabel=ylabel, xlim=xlim, ylim=ylim, xscale=xscale,
                                yscale=yscale, title=title)
        self.legend = list(legend or [])
        self.fmts = fmts
        self.X, self.Y = None, None
        self.path = path
        self.display = in_kernel() if display is None else display
        self.handle = None
        if not self.display and path is None:
            self.path = "animator.png"

    def _configure(self):
        ax, c = self.ax, self.axes_config
        if c["xlabel"]:
            ax.set_xlabel(c["xlabel"])
        if c["ylabel"]:
            ax.set_ylabel(c["ylabel"])
        ax.set_xscale(c["xscale"])
        ax.set_yscale(c["yscale"])
        if c["xlim"]:
            ax.set_xlim(c["xlim"])
        if c["ylim"]:
            ax.set_ylim(c["ylim"])
        if c["title"]:
            ax.set_title(c["title"])
        if self.legend:
            ax.legend(self.legend[: len(self.X)])
        ax.grid(True, alpha=0.3)
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
            raise ValueError(f"This Animator draws {len(self.X)} curve(s); add() got {n} value(s).")
        for i, (a, b) in enumerate(zip(x, y)):
            if a is not None and b is not None:
                self.X[i].append(float(a))
                self.Y[i].append(float(b))
        self.ax.cla()
        for xs, ys, fmt in zip(self.X, self.Y, self.fmts):
            single = {"marker": "o"} if len(xs) == 1 else {}  # a line through one point would be invisible
            self.ax.plot(xs, ys, fmt, **single)
        self._configure()
        self.show()

    def show(self):
        """Publish the current figure: update the display in place, or write the PNG file."""
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
            if not self.display:
                last = ", ".join(
                    f"{name} {ys[-1]:.3f}" for name, ys in zip(self.legend or [f"y{i}" for i in range(len(self.Y))], self.Y) if ys
                )
                xs = [xs[-1] for xs in self.X if xs]
                print(f"[plot] x={xs[-1] if xs else '-'}: {last} -> {self.path}", flush=True)
