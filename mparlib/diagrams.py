"""The course's figures of how work and data move: drawn from the package's own schedules, not measured.

Each function returns a matplotlib ``Figure`` (or draws on the axes it is given) in the course's style, labels in
the notebook's language; show a figure with ``display(Image(mparlib.plot.figure_png(fig)))``. DataParallel vs DDP
(:func:`ddp_overview`, chapter 06); the six collectives and the ring all-reduce, from
:func:`mparlib.collectives.collective_patterns` and :func:`mparlib.collectives.ring_contents` (chapter 08); a
pipeline's timeline (:func:`draw_timeline`, chapter 10). Explained in 06_ddp.
"""
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle

from .collectives import collective_patterns, ring_contents, ring_schedule
from .lang import tr
from .plot import course_style


@course_style()
def ddp_overview():
    """Schematic: DataParallel's threads vs DDP's processes, and bucketed all-reduce overlapping backward. Explained in 06_ddp."""
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


_RANK_COLORS = ("#7fb3d5", "#f5b041", "#82e0aa", "#d7a1e8", "#f1948a", "#a3e4d7", "#f7dc6f", "#bfc9ca")


def _cell(ax, x, y, pieces, k):
    """One box of a tensor: coloured by whose data it holds, labelled ``r.j``, ``0+1.j`` or ``Σj``."""
    if pieces is None:
        ax.add_patch(Rectangle((x, y), 0.92, 0.8, fc="white", ec="0.75", lw=0.6, ls=":"))
        return
    sources, chunk = sorted({r for r, _ in pieces}), min(j for _, j in pieces)
    color = _RANK_COLORS[sources[0] % len(_RANK_COLORS)] if len(sources) == 1 else "0.82"
    ax.add_patch(Rectangle((x, y), 0.92, 0.8, fc=color, ec="0.35", lw=0.6))
    who = "Σ" if len(sources) == k > 1 else "+".join(map(str, sources)) + "."
    ax.text(x + 0.46, y + 0.4, f"{who}{chunk}", ha="center", va="center", fontsize=7)


@course_style()
def collectives_figure(k=4):
    """The six collectives on ``k`` ranks in one picture: whose data is where. Explained in 08_collectives."""
    patterns = collective_patterns(k)
    fig = Figure(figsize=(11, 5.6))
    axes = fig.subplots(2, 3)
    for ax, (name, (before, after)) in zip(axes.flat, patterns.items()):
        for r in range(k):
            y = k - 1 - r
            ax.text(-0.2, y + 0.4, tr(f"rank {r}", f"ランク {r}"), ha="right", va="center", fontsize=8)
            for j in range(k):
                _cell(ax, j, y, before[r][j], k)
                _cell(ax, k + 1.2 + j, y, after[r][j], k)
        ax.annotate("", (k + 1.05, k / 2), (k + 0.1, k / 2), arrowprops=dict(arrowstyle="->", color="0.3"))
        ax.text(k / 2, k + 0.15, tr("before", "前"), ha="center", fontsize=8)
        ax.text(k + 1.2 + k / 2, k + 0.15, tr("after", "後"), ha="center", fontsize=8)
        ax.set_title(f"dist.{name}", fontsize=10, family="monospace")
        ax.set_xlim(-1.6, 2 * k + 1.3)
        ax.set_ylim(-0.3, k + 0.7)
        ax.axis("off")
    fig.text(0.5, 0.01, tr("r.j = chunk j of rank r's data; Σj = chunk j summed over all ranks; "
                           "dotted = not written (or left unspecified); root = rank 0",
                           "r.j = ランク r のデータのチャンク j、Σj = 全ランクのチャンク j の和、点線 = 書き込まれない"
                           "（または内容が決まらない）位置、ルート = ランク 0"), ha="center", fontsize=8)
    fig.subplots_adjust(left=0.06, right=0.99, top=0.93, bottom=0.06, wspace=0.25, hspace=0.3)
    return fig


@course_style()
def ring_figure(k=4):
    """The ring all-reduce on ``k`` ranks, step by step, drawn from the ring's schedule. Explained in 08_collectives.

    A column per state (start, then after each step), a row per rank, a box per chunk, labelled with the ranks
    summed into it; the chunk a rank received in that step is outlined in red.
    """
    schedule, states = ring_schedule(k, k), ring_contents(k)
    fig = Figure(figsize=(2.0 * len(states) + 0.8, 0.55 * k + 1.4))
    ax = fig.add_axes([0.05, 0.02, 0.94, 0.86])
    width = k + 1.0  # one column: k chunk boxes and a gap
    for t, state in enumerate(states):
        step = schedule[t - 1] if t else None
        title = tr("start", "開始") if t == 0 else f"{step.label()} {t if t < k else t - k + 1}"
        ax.text(t * width + k / 2, k + 0.25, title, ha="center", fontsize=8)
        for r in range(k):
            y = k - 1 - r
            for c in range(k):
                ranks = state[r][c]
                shade = 0.15 + 0.85 * len(ranks) / k
                received = step is not None and step.recv[r] == c
                ax.add_patch(Rectangle((t * width + c, y), 0.92, 0.8, fc=(0.35, 0.55, 0.8, shade),
                                       ec="#c0392b" if received else "0.4", lw=1.8 if received else 0.5))
                ax.text(t * width + c + 0.46, y + 0.4, "".join(str(q) for q in sorted(ranks)), ha="center",
                        va="center", fontsize=6.5)
    for r in range(k):
        ax.text(-0.3, k - 1 - r + 0.4, tr(f"rank {r}", f"ランク {r}"), ha="right", va="center", fontsize=8)
    ax.set_xlim(-1.6, len(states) * width)
    ax.set_ylim(-0.2, k + 0.6)
    ax.axis("off")
    fig.suptitle(tr(f"Ring all-reduce on {k} ranks: box c of a rank = chunk c; digits = ranks summed into it; "
                    "red = received in this step",
                    f"{k}個のランクのリング・オールリデュース: 各ランクの c 番目の箱 = チャンク c、数字 = 足し込まれた"
                    "ランク、赤枠 = このステップで受け取ったチャンク"), fontsize=9)
    return fig


_KINDS = {"F": ("forward", "順伝播"), "B": ("backward", "逆伝播"),
          "I": ("backward, input gradient", "逆伝播（入力の勾配）"),
          "W": ("backward, weight gradient", "逆伝播（重みの勾配）")}
_HATCH = {"F": None, "B": "//", "I": "\\\\", "W": None}
_W_COLOR = "0.78"  # weight-gradient passes: one grey for every micro-batch, so that they stand out as filler


def draw_timeline(ax, records_per_rank, title="", unit=1e3, xlabel=None, row_label=None):
    """Draw each rank's notes as a row of bars: forward filled, backward hatched. Explained in 10_model_parallel.

    ``records_per_rank[r]`` lists rank ``r``'s ``(kind, micro_batch, start, end)`` notes, or the
    ``(kind, micro_batch, start, end, stage)`` of :func:`mparlib.schedules.rank_notes`; times are multiplied by
    ``unit`` (``1e3``: seconds to milliseconds; ``1`` for a simulated schedule counted in ticks). Forward bars are
    coloured by micro-batch and numbered; a whole backward is hatched ``//``, an input-gradient pass ``\\``, and a
    weight-gradient pass is grey. A rank with two stages keeps one row: bars of its second stage carry a prime
    (``3'``). Rows are called "rank r" unless ``row_label`` (a function of ``r``) names them; labels are in the
    notebook's language. Explained further in 12_planning.
    """
    primed = False
    for r, notes in enumerate(records_per_rank):
        stages = sorted({n[4] for n in notes if len(n) > 4})
        for kind, i, start, end, *rest in notes:
            second = bool(rest) and stages.index(rest[0]) > 0
            primed = primed or second
            ax.broken_barh([(start * unit, (end - start) * unit)], (r - 0.4, 0.8),
                           facecolors=_W_COLOR if kind == "W" else f"C{i % 10}", edgecolor="black", linewidth=0.5,
                           hatch=_HATCH[kind], alpha=0.55 if kind in "BI" else 1.0)
            ax.text((start + end) / 2 * unit, r, f"{i}'" if second else str(i), ha="center", va="center", fontsize=8)
    row_label = row_label or (lambda r: tr(f"rank {r}", f"ランク {r}"))
    ax.set_yticks(range(len(records_per_rank)), [row_label(r) for r in range(len(records_per_rank))])
    ax.set_ylim(len(records_per_rank) - 0.5, -0.5)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel if xlabel is not None else tr("time (ms)", "時間（ms）"))
    kinds = [k for k in _KINDS if any(n[0] == k for notes in records_per_rank for n in notes)]
    handles = [Patch(facecolor=_W_COLOR if k == "W" else "white", edgecolor="black", hatch=_HATCH[k],
                     label=tr(*_KINDS[k])) for k in kinds]
    if primed:
        handles.append(Patch(facecolor="none", edgecolor="none", label=tr("3' = micro-batch 3, rank's 2nd stage",
                                                                          "3' = マイクロバッチ 3、ランクの 2つ目のステージ")))
    ax.legend(handles=handles, fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the axes
    return ax
