"""Checks of chapter 08's exercises: an all-gather and a ring reduce-scatter from sends and receives, the ring's
alpha-beta time, DDP's gradient buckets.

The two distributed checks run on 2 and then 3 fresh gloo processes with uneven sizes (the expected tensors are
computed here, in the check, never in a rank); they watch the collectives of
``torch.distributed`` while the learner's code runs (they still work, and are reported: the exercise asks for
sends and receives). The bucket check compares with DDP's own assignment. Explained in 08_collectives.
"""
import random

import torch

from ..collectives import chunk_bounds
from ..lang import tr
from .ch06 import close, fault, learner_function, run_children
from .core import call, call_each, exercise, first_mismatch, mismatch_text, right, type_name, wrong
from .ch07 import near

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_gather_single",
               "broadcast", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
               "all_to_all_single", "gather", "scatter", "reduce")
P2P_HINT = ("Use only dist.send/recv, dist.isend/irecv or dist.batch_isend_irecv with dist.P2POp: the exercise "
            "builds the collective itself.",
            "dist.send/recv、dist.isend/irecv、または dist.P2POp と dist.batch_isend_irecv だけを使ってください。"
            "この問題は集合通信そのものを作る練習です。")


def watched_call(fn, *args):
    """Call ``fn`` while the collectives of torch.distributed are counted; return (result, names used).
    For check authors: see the package docstring."""
    import torch.distributed as dist

    used, real = [], {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def watch(name, original):
        def watched(*a, **k):
            used.append(name)
            return original(*a, **k)
        return watched

    for name, original in real.items():
        setattr(dist, name, watch(name, original))
    try:
        return fn(*args), used
    finally:
        for name, original in real.items():
            setattr(dist, name, original)


def rank_input(rank, n):
    """Rank ``rank``'s input of ``n`` elements: different on every rank, exact in float32. For check authors: see the
    package docstring."""
    return torch.arange(n, dtype=torch.float32) * (rank + 1) + 100 * rank


# ---- 08.1: all-gather from sends and receives --------------------------------------------------------------------
def gather_child(module, name, sizes):
    """The learner's all-gather of uneven tensors on this rank, with the collectives it used. For check authors: see the
    package docstring."""
    import torch.distributed as dist

    fn = learner_function(module, name)
    try:
        rank = dist.get_rank()
        mine = rank_input(rank, sizes[rank])
    except Exception:
        return fault()
    got, used = watched_call(fn, mine.clone(), list(sizes))
    if isinstance(got, (list, tuple)):
        got = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in got]
    return {"got": got, "used": used}


@exercise("08.1", title=("An all-gather from sends and receives", "送信と受信で作るオールギャザー"),
          needs="processes", hints=[
    ("Look at the sections 'The vocabulary' (what all_gather leaves on every rank) and 'A ring all-reduce from "
     "sends and receives' (how two ranks exchange without waiting for each other).",
     "「通信の基本操作」の節（all_gather が各ランクに何を残すか）と「送信と受信で作るリング・オールリデュース」の節"
     "（2つのランクが互いを待たずにやり取りする方法）を見てください。"),
    ("Every rank sends its tensor to every other rank and receives theirs into buffers of the right sizes. A "
     "blocking recv on both sides first waits forever: post the sends and the receives together.",
     "各ランクは自分のテンソルを他のすべてのランクに送り、他のランクのテンソルを正しい大きさのバッファに受け取ります。"
     "両側がブロッキングの recv から始めると永遠に待つので、送信と受信をまとめて発行します。"),
    ("Prepare one receive buffer per rank (your own slot holds your tensor). Build a send and a receive "
     "operation for every other rank, start them all in one batch, then wait for each.",
     "ランクごとに受信バッファを 1"
     "つ用意します（自分の枠には自分のテンソルを入れます）。ほかのすべてのランクについて送信と受信の操作を作り、1"
     "回のバッチでまとめて開始してから、それぞれの完了を待ちます。"),
], mistakes={
    "used_collective": P2P_HINT,
    "rank_order": ("All the tensors arrived, but not in rank order: position r of the list must hold rank r's "
                   "tensor.",
                   "テンソルはすべて届いていますが、ランクの順に並んでいません。リストの r 番目にはランク r の"
                   "テンソルを置きます。"),
    "own_slot": ("The other ranks' tensors are right, but your own position is not: put the rank's own tensor "
                 "there.",
                 "他のランクのテンソルは正しいのですが、自分の位置が違います。そこには自分のテンソルを置きます。"),
})
def check_08_1(answer, layouts=((4, 1), (2, 5, 3))):
    """Compare each rank's list with the tensors every rank holds: uneven sizes, on 2 and then 3 ranks (one size per
    rank). Explained in 08_collectives."""
    runs = run_children(answer, gather_child, [(len(sizes), (tuple(sizes),)) for sizes in layouts])
    for sizes, values in zip(layouts, runs):
        outcome = gather_outcome(values, sizes)
        if outcome is not None:
            return outcome
    used = sorted({name for values in runs for v in values for name in v["used"]})
    if used:
        return wrong(tr(f"The result is right, but your code called {used}.",
                        f"結果は正しいのですが、コードが {used} を呼んでいます。"), "used_collective")
    shown = " and ".join(str(list(sizes)) for sizes in layouts)
    return right(tr(f"On {' and '.join(str(len(s)) for s in layouts)} ranks with sizes {shown}, every rank holds "
                    "every tensor in rank order, from sends and receives alone.",
                    f"ランク {'個と '.join(str(len(s)) for s in layouts)}個（大きさ {'、'.join(str(list(s)) for s in layouts)}）"
                    "のどちらでも、どのランクもすべてのテンソルをランクの順に持ちました。送信と受信だけで作れています。"))


def gather_outcome(values, sizes):
    """The wrong outcome of one run of 08.1 (one size per rank), or None when every rank's list is right.
    For check authors: see the package docstring."""
    expected = [rank_input(r, n) for r, n in enumerate(sizes)]
    for rank, v in enumerate(values):
        got = v["got"]
        if not isinstance(got, (list, tuple)) or len(got) != len(sizes):
            return wrong(tr(f"With {len(sizes)} ranks, rank {rank} returned {type_name(got)}; return a list of "
                            f"{len(sizes)} tensors, one per rank.",
                            f"ランク {len(sizes)}個のとき、ランク {rank} の戻り値が {type_name(got)} です。ランクごとに"
                            f" 1つ、{len(sizes)}個のテンソルのリストを返してください。"), "shape")
        for r, (g, e) in enumerate(zip(got, expected)):
            if close(g, e):
                continue
            where = tr(f"With {len(sizes)} ranks, rank {rank}'s entry {r}",
                       f"ランク {len(sizes)}個のとき、ランク {rank} の {r} 番目の要素")
            others = [close(x, e2) for i, (x, e2) in enumerate(zip(got, expected)) if i != rank]
            if r == rank and all(others):
                key = "own_slot"
            elif sorted(repr(x.tolist()) for x in got if isinstance(x, torch.Tensor)) == \
                    sorted(repr(x.tolist()) for x in expected):
                key = "rank_order"
            else:
                key = None
            return wrong(mismatch_text(where, first_mismatch(g, e)), key)
    return None


# ---- 08.2: the ring's reduce-scatter -------------------------------------------------------------------------------
def scatter_child(module, name, sizes):
    """The learner's ring reduce-scatter of each size in ``sizes``, called on every rank. For check authors: see the
    package docstring."""
    import torch.distributed as dist

    fn = learner_function(module, name)
    out = []
    for n in sizes:
        got, used = watched_call(fn, rank_input(dist.get_rank(), n))
        out.append({"got": got.detach().clone() if isinstance(got, torch.Tensor) else got, "used": used})
    return out


CHAPTER_RING = {"ring_reduce_scatter", "ring_all_gather", "ring_all_reduce", "run_ring_steps"}


def calls_chapter(fn, names, module):
    """Whether ``fn`` refers to one of ``names`` of ``module`` (the chapter's own answer), or to the module itself.
    For check authors: see the package docstring."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    seen = set(code.co_names)
    for const in code.co_consts:  # nested functions and lambdas
        seen |= set(getattr(const, "co_names", ()))
    found = [getattr(fn, "__globals__", {}).get(name) for name in seen]
    return any(getattr(obj, "__module__", "") == module and getattr(obj, "__name__", "") in names
               or getattr(obj, "__name__", "") == module for obj in found)


def scatter_key(got, n, rank, k):
    """The likely mistake behind a wrong reduce-scatter chunk (a hint key or None). For check authors: see the package
    docstring."""
    whole = sum(rank_input(r, n) for r in range(k))
    bounds = chunk_bounds(n, k)

    def chunk(t, c):
        return t[bounds[c][0]:bounds[c][1]]

    if close(got, whole):
        return "whole_tensor"
    if close(got, chunk(whole, (rank + 1) % k)):
        return "rotated"
    if close(got, chunk(rank_input(rank, n), rank)):
        return "no_sum"
    if any(close(got, chunk(whole - rank_input(r, n), rank)) for r in range(k)):
        return "one_step_short"
    return None


@exercise("08.2", title=("The ring's reduce-scatter", "リングのリデュース・スキャッター"), needs="processes", hints=[
    ("Look at the section 'A ring all-reduce from sends and receives': its first phase is a reduce-scatter, and "
     "`mparlib.collectives.ring_schedule` lists which chunk each rank sends and receives at each step.",
     "「送信と受信で作るリング・オールリデュース」の節を見てください。その前半がリデュース・スキャッターで、"
     "`mparlib.collectives.ring_schedule` が各ステップで各ランクが送受信するチャンクを示しています。"),
    ("k - 1 steps; at each, send one chunk to rank + 1 while receiving another from rank - 1, and add what arrives "
     "to your own copy of that chunk. Pick the first chunk you send so that the last chunk you complete is chunk "
     "rank, as dist.reduce_scatter leaves it.",
     "k - 1 ステップで、各ステップでは 1つのチャンクを rank + 1 へ送りながら別のチャンクを rank - 1 から受け取り、"
     "届いたものを自分のそのチャンクに足します。最後に完成するのがチャンク rank になるよう（dist.reduce_scatter "
     "と同じ配置）、最初に送るチャンクを選びます。"),
    ("Split the flattened tensor into k chunks with the chapter's bounds. In each of k - 1 steps every rank "
     "passes one chunk to its right and adds the one that arrives from its left; work out from the step number "
     "which chunk to send and which to receive, so that rank r ends with the full sum of chunk r.",
     "平らにしたテンソルを、章の境界で k個のチャンクに分けます。k - 1"
     " 回のステップのそれぞれで、各ランクはチャンクを 1つ右隣に渡し、左隣から届いたものを足します。ランク r"
     " が最後にチャンク r"
     " の完全な和を持つように、ステップ番号から送るチャンクと受け取るチャンクを求めてください。"),
], mistakes={
    "used_collective": P2P_HINT,
    "rotated": ("Your rank holds the full sum of the next rank's chunk. Shift the chunk indices by one so that rank "
                "r ends with chunk r.",
                "あなたのランクには次のランクのチャンクの合計が残っています。ランク r がチャンク r で終わるよう、"
                "チャンクの番号を 1つずらしてください。"),
    "chapter_function": ("Your function calls the chapter's own ring (mparlib.collectives): write the steps yourself "
                         "with isend/irecv, then compare with it.",
                         "関数が章のリング（mparlib.collectives）を呼んでいます。isend/irecv でステップを自分で書き、"
                         "そのあとで章のものと比べてください。"),
    "no_sum": ("The chunk is still this rank's own input: add what you receive at every step.",
               "チャンクがこのランク自身の入力のままです。各ステップで受け取ったものを足してください。"),
    "one_step_short": ("One rank's contribution is missing: the ring needs k - 1 steps on k ranks.",
                       "1つのランクの分が足りません。k ランクのリングには k - 1 ステップが必要です。"),
    "whole_tensor": ("You returned the whole summed tensor: a reduce-scatter leaves each rank only its own chunk "
                     "(chunk_bounds(n, k)[rank]).",
                     "合計したテンソル全体を返しています。リデュース・スキャッターが各ランクに残すのは自分のチャンク "
                     "（chunk_bounds(n, k)[rank]）だけです。"),
})
def check_08_2(answer, runs=((2, (7, 1)), (3, (10, 2)))):
    """Compare each rank's chunk with the sum over ranks: 7 and then 1 element on 2 ranks, 10 and then 2 on 3 ranks
    (an empty chunk in each). Explained in 08_collectives."""
    if calls_chapter(answer, CHAPTER_RING, "mparlib.collectives"):
        return wrong(tr("The answer calls the chapter's ring instead of sending chunks itself.",
                        "答えは自分でチャンクを送らず、章のリングを呼んでいます。"), "chapter_function")
    results = run_children(answer, scatter_child, [(nproc, (tuple(sizes),)) for nproc, sizes in runs])
    for (nproc, sizes), values in zip(runs, results):
        for case, n in enumerate(sizes):
            whole = sum(rank_input(r, n) for r in range(nproc))
            for rank, v in enumerate(values):
                got = v[case]["got"]
                start, stop = chunk_bounds(n, nproc)[rank]
                if close(got.reshape(-1) if isinstance(got, torch.Tensor) else got, whole[start:stop]):
                    continue
                where = tr(f"With {n} elements on {nproc} ranks, rank {rank}'s chunk",
                           f"要素 {n}個、ランク {nproc}個のとき、ランク {rank} のチャンク")
                key = scatter_key(got.reshape(-1), n, rank, nproc) if isinstance(got, torch.Tensor) else "shape"
                return wrong(mismatch_text(where, first_mismatch(got, whole[start:stop])), key)
    used = sorted({name for values in results for v in values for case in v for name in case["used"]})
    if used:
        return wrong(tr(f"The chunks are right, but your code called {used}.",
                        f"チャンクは正しいのですが、コードが {used} を呼んでいます。"), "used_collective")
    said = " and ".join(f"{list(sizes)} elements on {nproc} ranks" for nproc, sizes in runs)
    said_ja = "、".join(f"ランク {nproc}個で要素 {list(sizes)}個" for nproc, sizes in runs)
    return right(tr(f"Each rank holds the summed chunk of its rank, for {said}.",
                    f"{said_ja}のどの場合も、各ランクに自分の番号のチャンクの合計が残りました。"))


# ---- 08.3: the ring's alpha-beta time ----------------------------------------------------------------------------
def ring_seconds(nbytes, k, alpha, beta):
    """The check's reference: the alpha-beta time of a ring all-reduce. For check authors: see the package docstring."""
    return 2 * (k - 1) * alpha + 2 * (k - 1) / k * nbytes * beta


@exercise("08.3", title=("The ring's time in the alpha-beta model", "α-β モデルでのリングの時間"), hints=[
    ("Look at the section 'What communication costs', the paragraph on the ring.",
     "「通信にかかる時間」の節の、リングについての段落を見てください。"),
    ("Count the ring's steps for k ranks (both phases), and the bytes one step moves over a link; every step pays "
     "the latency once.",
     "k ランクのリングのステップ数（前半と後半の両方）と、1ステップで 1本のリンクを流れるバイト数を数えます。"
     "ステップごとにレイテンシを 1回払います。"),
    ("Count the steps of both phases on a ring of k ranks, and the cost of one step in the alpha-beta model "
     "when each step moves one k-th of the message.",
     "k ランクのリングで 2つの段階を合わせたステップの数と、1ステップでメッセージの k分の 1"
     " を送るときの、α-β モデルでの 1ステップのコストを求めます。"),
], mistakes={
    "one_phase": ("Your time is half the ring's: the all-reduce has two phases, reduce-scatter and all-gather, of "
                  "k - 1 steps each.",
                  "リングの時間の半分になっています。オールリデュースにはリデュース・スキャッターとオールギャザーの 2つの"
                  "段階があり、それぞれ k - 1 ステップです。"),
    "whole_message": ("Each step moves one chunk, nbytes / k, not the whole message.",
                      "各ステップで送るのはメッセージ全体ではなく 1つのチャンク、nbytes / k です。"),
    "k_steps": ("A ring of k ranks needs k - 1 steps per phase, not k.",
                "k ランクのリングでは、各段階のステップ数は k ではなく k - 1 です。"),
})
def check_08_3(answer, points=30, seed=0):
    """Compare with the alpha-beta formula at random points; a mistake is named when it explains every point.
    Explained in 08_collectives."""
    rng = random.Random(seed)
    hypotheses = {"one_phase": lambda n, k, a, b: ring_seconds(n, k, a, b) / 2,
                  "whole_message": lambda n, k, a, b: 2 * (k - 1) * (a + n * b),
                  "k_steps": lambda n, k, a, b: 2 * k * (a + n / k * b)}
    first, fits = None, dict.fromkeys(hypotheses, True)
    cases = [(rng.randint(1, 2**30), rng.randint(2, 64), 10 ** rng.uniform(-6, -3), 10 ** rng.uniform(-12, -8))
             for _ in range(points)]
    *values, one_rank = call_each(answer, cases + [(1000, 1, 1e-5, 1e-9)])
    for (n, k, alpha, beta), got in zip(cases, values):
        for key, formula in hypotheses.items():
            fits[key] = fits[key] and near(got, formula(n, k, alpha, beta), 1e-6)
        if first is None and not near(got, ring_seconds(n, k, alpha, beta), 1e-6):
            first = tr(f"{n} bytes on {k} ranks, alpha {alpha:.3g} s, beta {beta:.3g} s/byte: your time is {got!r}.",
                       f"{n}バイト、{k}ランク、α {alpha:.3g} 秒、β {beta:.3g} 秒/バイト: あなたの時間は {got!r} です。")
    if first is None and not (isinstance(one_rank, (int, float)) and not isinstance(one_rank, bool) and one_rank == 0):
        first = tr("On 1 rank there is nothing to send, so the time should be 0.",
                   "ランクが 1つなら送るものはないので、時間は 0 のはずです。")
    if first is None:
        return right(tr(f"The ring's time agrees at {points} random points.",
                        f"ランダムな {points}点でリングの時間が一致しました。"))
    return wrong(first, next((key for key, ok in fits.items() if ok), None))


# ---- 08.4: DDP's gradient buckets -------------------------------------------------------------------------------
def ddp_buckets(grad_bytes, cap_bytes, first_cap_bytes=None):
    """DDP's own bucket assignment for float32 gradients of these sizes, in ready order. For check authors: see the
    package docstring."""
    import torch.distributed as dist

    tensors = [torch.empty(n // 4) for n in grad_bytes]
    caps = [cap_bytes] if first_cap_bytes is None else [first_cap_bytes, cap_bytes]
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, caps)
    return [list(b) for b in buckets]


def buckets_below_cap(grad_bytes, cap_bytes, first_cap_bytes=None):
    """The buckets of the likely mistake: a bucket is closed before a gradient would take it above its cap.
    For check authors: see the package docstring."""
    buckets, current, size = [], [], 0
    for i, n in enumerate(grad_bytes):
        cap = first_cap_bytes if first_cap_bytes is not None and not buckets else cap_bytes
        if current and size + n > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    return buckets + [current] if current else buckets


@exercise("08.4", title=("DDP's gradient buckets", "DDP の勾配のバケット"), hints=[
    ("Look at the section 'Inside DDP': in which order are gradients packed, and when is a bucket full?",
     "「DDP の内部」の節を見てください。勾配はどの順に詰められ、バケットはいつ満杯になるでしょうか。"),
    ("Go through the gradients in the order they become ready (the order given). Add each to the open bucket; as "
     "soon as the bucket holds at least its cap, close it. The first bucket may have its own, smaller cap.",
     "勾配ができあがる順（与えられた順）にたどります。各勾配を開いているバケットに加え、バケットが上限以上になった"
     "時点で閉じます。最初のバケットだけは別の、小さな上限を持つことがあります。"),
    ("Walk the gradients in the given order and add each to the open bucket. Close the bucket as soon as its "
     "size reaches the cap (the first cap for the first bucket, when one is given), and close what is left at "
     "the end.",
     "与えられた順に勾配をたどり、それぞれを開いているバケットに加えます。バケットの大きさが上限に達したらすぐに閉じ（最初の上限が与えられていれば、最初のバケットにはそれを使います）、最後に残りを閉じます。"),
], mistakes={
    "closes_early": ("Your buckets never exceed the cap: DDP adds the gradient first and closes the bucket once it "
                     "holds at least the cap, so a bucket may end above it.",
                     "あなたのバケットは上限を超えません。DDP は先に勾配を加え、上限以上になった時点でバケットを"
                     "閉じるので、バケットは上限を超えて終わることがあります。"),
    "first_bucket": ("The first bucket has its own cap (first_cap_bytes, DDP's 1 MiB by default); the others use "
                     "cap_bytes.",
                     "最初のバケットには専用の上限（first_cap_bytes。DDP の既定では 1 MiB）があり、残りは cap_bytes を"
                     "使います。"),
})
def check_08_4(answer, cases=30, seed=0):
    """Compare with DDP's own assignment (torch's C++ function) on random gradient sizes. Explained in
    08_collectives."""
    rng = random.Random(seed)
    for i in range(cases):
        grad_bytes = [4 * rng.randint(1, 2000) for _ in range(rng.randint(1, 12))]
        cap = 4 * rng.randint(200, 3000)
        first = 4 * rng.randint(50, 600) if i % 2 else None
        expected = ddp_buckets(grad_bytes, cap, first)
        got = call(answer, list(grad_bytes), cap, first)
        try:
            got = [[int(j) for j in b] for b in got]
        except (TypeError, ValueError):
            return wrong(tr(f"Your function returned {got!r}; return a list of buckets, each a list of indices.",
                            f"戻り値が {got!r} です。バケットのリスト（各バケットはインデックスのリスト）を返して"
                            "ください。"), "shape")
        if got == expected:
            continue
        key = None
        if first is not None and got == ddp_buckets(grad_bytes, cap):
            key = "first_bucket"
        elif got == buckets_below_cap(grad_bytes, cap, first):
            key = "closes_early"
        cap_text = f"{cap}" + ("" if first is None else tr(f", first bucket {first}", f"、最初のバケット {first}"))
        return wrong(tr(f"Gradients of {grad_bytes} bytes with cap {cap_text}: your buckets are {got}.",
                        f"勾配 {grad_bytes} バイト、上限 {cap_text}: あなたのバケットは {got} です。"), key)
    return right(tr(f"Your buckets equal DDP's own in {cases} random cases.",
                    f"ランダムな {cases}通りで、あなたのバケットは DDP 自身のものと一致しました。"))
