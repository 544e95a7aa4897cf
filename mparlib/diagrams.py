"""Schematic figures of the course: what a chapter explains in a picture rather than a measurement.

Each function returns a matplotlib ``Figure`` drawn in the course's style (labels in the notebook's language);
show it with ``display(Image(mparlib.plot.figure_png(fig)))``. Explained in 06_ddp.
"""
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from .lang import tr
from .plot import course_style


def ddp_overview():
    """Schematic: DataParallel's threads vs DDP's processes, and bucketed all-reduce overlapping backward. Explained in 06_ddp."""
    with course_style():
        return _ddp_overview()


def _ddp_overview():
    fig = Figure(figsize=(10, 6.2))
    top, bottom = fig.add_axes([0.01, 0.40, 0.98, 0.58]), fig.add_axes([0.17, 0.08, 0.81, 0.27])
    top.set_xlim(0, 100)
    top.set_ylim(0, 60)
    top.axis("off")

    def box(ax, x, y, w, h, text, color, size=9):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.4", fc=color, ec="0.3", lw=0.8))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)

    # Left: DataParallel, one process with a thread per GPU; GPU 0 scatters, gathers and replicates every step.
    box(top, 1, 2, 45, 50, "", "#f3f3f3")
    top.text(23.5, 56, tr("DataParallel: 1 process, 1 thread per GPU", "DataParallel: 1個のプロセス、GPU ごとに 1本のスレッド"),
             ha="center", fontsize=10)
    box(top, 5, 40, 37, 7, tr("Python interpreter (one GIL)", "Python インタプリタ（GIL は 1つ）"), "#ffe0b3")
    for i in range(2):
        box(top, 5 + 19 * i, 21, 16, 12, tr(f"thread {i}\nreplica {i}", f"スレッド {i}\nレプリカ {i}"), "#fff5cc")
        box(top, 5 + 19 * i, 6, 16, 8, f"GPU {i}", "#dbe9f6")
        top.annotate("", (13 + 19 * i, 15), (13 + 19 * i, 20), arrowprops=dict(arrowstyle="->", color="0.3"))
    top.text(23.5, 36.5, tr("every step: scatter batch, copy model, gather outputs on GPU 0",
                            "毎ステップ: バッチを分配、モデルを複製、出力を GPU 0 に集約"),
             ha="center", fontsize=8)
    # Right: DDP, one process per device; each has its own sampler shard; gradients are all-reduced.
    box(top, 53, 2, 46, 50, "", "#f3f3f3")
    top.text(76, 56, tr("DistributedDataParallel: 1 process per device", "DistributedDataParallel: デバイスごとに 1個のプロセス"),
             ha="center", fontsize=10)
    for i in range(2):
        x0 = 57 + 21 * i
        box(top, x0, 38, 17, 9, tr(f"process {i} (rank {i})\nits own GIL", f"プロセス {i}（ランク {i}）\n専用の GIL"),
            "#ffe0b3", size=8)
        box(top, x0, 25, 17, 8, tr(f"sampler shard {i}\nbatch B/2", f"サンプラーの担当分 {i}\nバッチ B/2"), "#e6f2e6", size=8)
        box(top, x0, 6, 17, 8, tr(f"device {i}", f"デバイス {i}"), "#dbe9f6", size=8)
        top.annotate("", (x0 + 8.5, 15), (x0 + 8.5, 24), arrowprops=dict(arrowstyle="->", color="0.3"))
    top.annotate("", (78, 10), (74.6, 10), arrowprops=dict(arrowstyle="<->", color="#c0392b", lw=1.5))
    top.text(76.3, 17.5, tr("all-reduce\ngradients", "勾配を\nオールリデュース"), ha="center", fontsize=8, color="#c0392b")

    # Bottom: timeline of one backward pass with gradient buckets (schematic, not measured).
    layers = 6  # backward runs from the last layer (L6) to the first (L1); each bucket holds two layers' gradients
    for j in range(layers):
        bottom.barh(1, 1, left=j, color="#7fb3d5", edgecolor="white")
        bottom.text(j + 0.5, 1, tr(f"grad L{layers - j}", f"勾配 L{layers - j}"), ha="center", va="center", fontsize=8)
    for b, ready in enumerate((2, 4, 6)):  # a bucket's all-reduce starts when its last gradient is ready
        bottom.barh(0, 1.6, left=ready, color="#e59866", edgecolor="white")
        bottom.text(ready + 0.8, 0, tr(f"all-reduce\nbucket {b}", f"バケット {b} を\nオールリデュース"), ha="center",
                    va="center", fontsize=7)
    bottom.set_yticks([0, 1], [tr("communication", "通信"), tr("backward\n(compute)", "逆伝播\n（計算）")])
    bottom.set_xlim(0, 8)
    bottom.set_xticks([])
    bottom.set_xlabel(tr("time (schematic) -> a bucket's all-reduce starts as soon as its gradients exist",
                         "時間（模式図）→ バケットの勾配がそろい次第、そのオールリデュースが始まる"), fontsize=9)
    for s in ("top", "right"):
        bottom.spines[s].set_visible(False)
    return fig
