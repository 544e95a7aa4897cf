"""Checks of chapter 11's exercises: the log-sum-exp merge, the balanced causal split, an expert layer's split sizes.

The merge is checked against PyTorch's own attention over all the keys; the split by its properties (every token
once, equal causal work) and against the chapter's ``shard_sequence``; the split sizes against a count of the rows by
the rank that holds their expert. Explained in 11_sequence_context_experts.
"""
import random

import torch
from torch.nn import functional as F

from .. import ring_attention
from ..lang import tr
from .ch08 import calls_chapter
from .core import Stop, call, call_each, exercise, first_mismatch, mismatch_text, right, wrong


# ---- 11.1: merging two partial attentions ----------------------------------------------------------------------
def merge_cases(seed=0):
    """Queries, keys and values of a few shapes, with the point where the keys are cut in two. For check authors: see
    the package docstring."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for b, h, tq, tk, d, cut in ((1, 1, 3, 5, 4, 2), (2, 3, 4, 8, 8, 6), (1, 2, 5, 6, 4, 1)):
        q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * 3 for n in (tq, tk, tk))
        cases.append((q, k, v, cut))
    return cases


@exercise("11.1", title=("Merging two partial attentions", "2つの部分的なアテンションの合わせ方"), hints=[
    ("Look at the section 'Combining partial attentions: the log-sum-exp rule'.",
     "「部分的なアテンションの合わせ方: log-sum-exp の規則」の節を見てください。"),
    ("Each part is softmax over its own keys. Over both sets the softmax denominator is exp(lse_a) + exp(lse_b), so "
     "each part's output is scaled by its share of that sum; the new lse is the log of the sum.",
     "それぞれの部分は、自分のキーだけでのソフトマックスです。両方を合わせたソフトマックスの分母は "
     "exp(lse_a) + exp(lse_b) なので、各部分の出力をその和に占める割合で縮めます。新しい lse はその和の対数です。"),
    ("Work in log space: one PyTorch function combines the two parts' lse into the whole one, and each part's "
     "output is weighted by the exponential of its own lse minus the combined one, broadcast over the feature "
     "dimension.",
     "対数の空間で考えます。2つの部分の lse から全体の lse を求めるのは PyTorch の関数 1"
     "つです。各部分の出力は、自分の lse から全体の lse"
     " を引いたものの指数で重み付けし、特徴量の次元にブロードキャストします。"),
], mistakes={
    "chapter_function": ("Your function calls the chapter's merge: write the rule yourself, then compare with it.",
                         "関数が章の merge を呼んでいます。規則を自分で書き、そのあとで章のものと比べてください。"),
    "plain_average": ("You average the two parts with equal weights: a part over more (or larger) scores must weigh "
                      "more. Use the lse values.",
                      "2つの部分を同じ重みで平均しています。スコアの多い（大きい）部分ほど重みが大きくなるはずです。"
                      "lse を使ってください。"),
    "lse_not_updated": ("The output is right, but the returned lse is not the log of the summed exponentials: the next "
                        "merge of the ring would go wrong.",
                        "出力は正しいのですが、返した lse が指数の和の対数になっていません。リングの次の合わせ方が"
                        "狂います。"),
    "no_broadcast": ("Shapes: lse is (B, H, T) and out (B, H, T, d); the weights need unsqueeze(-1).",
                     "形状: lse は (B, H, T)、out は (B, H, T, d) です。重みには unsqueeze(-1) が必要です。"),
})
def check_11_1(answer):
    """Merge attention over two halves of the keys; compare with one attention over all of them.
    Explained in 11_sequence_context_experts."""
    if calls_chapter(answer, {"merge"}, "mparlib.ring_attention"):
        return wrong(tr("The answer calls the chapter's merge instead of combining the parts itself.",
                        "答えは自分で部分を合わせず、章の merge を呼んでいます。"), "chapter_function")
    for i, (q, k, v, cut) in enumerate(merge_cases()):
        out_a, lse_a = ring_attention.block_attention(q, k[..., :cut, :], v[..., :cut, :])
        out_b, lse_b = ring_attention.block_attention(q, k[..., cut:, :], v[..., cut:, :])
        got = call(answer, out_a, lse_a, out_b, lse_b, on_error=lambda e: "no_broadcast")
        if not (isinstance(got, tuple) and len(got) == 2):
            return wrong(tr("Return the pair (out, lse).", "組 (out, lse) を返してください。"), "shape")
        out, lse = got
        expected = F.scaled_dot_product_attention(q, k, v)  # PyTorch's attention over all the keys
        where = tr(f"Case {i + 1}, the merged output", f"場合 {i + 1} の合わせた出力")
        mismatch = first_mismatch(out, expected, 1e-9, 1e-9)
        if mismatch:
            key = "plain_average" if torch.allclose(out, (out_a + out_b) / 2) else None
            return wrong(mismatch_text(where, mismatch), key)
        full_lse = torch.logsumexp(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        mismatch = first_mismatch(lse, full_lse, 1e-9, 1e-9)
        if mismatch:
            return wrong(mismatch_text(tr(f"Case {i + 1}, the merged lse", f"場合 {i + 1} の合わせた lse"), mismatch),
                         "lse_not_updated")
    return right(tr("Merged halves equal PyTorch's attention over all the keys, output and lse, in 3 shapes.",
                    "3通りの形状で、合わせた結果が、すべてのキーに対する PyTorch のアテンションと出力も lse も"
                    "一致しました。"))


# ---- 11.2: the balanced causal split ----------------------------------------------------------------------------
def causal_work(positions):
    """Score elements a rank computes under a causal mask for queries at ``positions`` (key j <= query i).
    For check authors: see the package docstring."""
    return sum(int(p) + 1 for p in positions)


def _positions(got):
    """``got`` as a list of ints when it is a list, tuple or 1-d tensor of whole numbers; else ``None``."""
    if isinstance(got, torch.Tensor):
        got = got.tolist() if got.dim() == 1 else None
    if not isinstance(got, (list, tuple)):
        return None
    try:
        return [int(p) for p in got] if all(float(p) == int(p) for p in got) else None
    except (TypeError, ValueError, OverflowError):
        return None


@exercise("11.2", title=("The balanced causal split", "負荷を均した因果的な分割"), hints=[
    ("Look at the section 'Causal attention and the balanced split'.",
     "「因果的アテンションと負荷を均した分割」の節を見てください。"),
    ("Cut the sequence into 2N equal chunks; a rank takes one early chunk and the matching late one, so the short and "
     "long rows of the causal mask pair up.",
     "系列を 2N 個の等しいチャンクに切ります。各ランクは前のほうのチャンク 1つと、それに対応する後ろのほうのチャンク "
     "1つを取るので、因果マスクの短い行と長い行が組になります。"),
    ("Cut the sequence into 2 x world equal chunks. Rank r takes one chunk from the front and its mirror image "
     "from the back, so that every rank gets one cheap and one expensive chunk.",
     "系列を 2 x world 個の等しいチャンクに分けます。ランク r は前から 1つ、それと対になる 1"
     "つを後ろから取り、どのランクも軽いチャンクと重いチャンクを 1つずつ持つようにします。"),
], mistakes={
    "chapter_function": ("Your function calls the chapter's split: work the positions out yourself.",
                         "関数が章の分割を呼んでいます。位置を自分で求めてください。"),
    "contiguous": ("Each rank holds one contiguous slice: under a causal mask the last rank then does N times the "
                   "first one's work.",
                   "各ランクが連続した 1つの範囲を持っています。因果マスクのもとでは、最後のランクが最初のランクの N倍の"
                   "仕事をします。"),
    "off_by_one": ("Every token is held once, but the work is not equal: check the index of the late chunk "
                   "(2N - 1 - r, counting chunks from 0).",
                   "どのトークンも 1回ずつ持たれていますが、仕事が等しくありません。後ろのチャンクの番号（0 から数えて "
                   "2N - 1 - r）を確かめてください。"),
    "not_a_partition": ("Some token is held by no rank, or by two: the ranks' positions must cover the sequence "
                        "exactly once.",
                        "どのランクも持たないトークンか、2つのランクが持つトークンがあります。ランクの位置は系列を"
                        "ちょうど 1回ずつ覆わなければなりません。"),
})
def check_11_2(answer):
    """The positions of every rank for a few lengths and world sizes: a partition with equal causal work, in the
    chapter's order. Explained in 11_sequence_context_experts."""
    if calls_chapter(answer, {"shard_sequence", "chunks_of"}, "mparlib.ring_attention"):
        return wrong(tr("The answer calls the chapter's split instead of computing the positions.",
                        "答えは位置を求めず、章の分割を呼んでいます。"), "chapter_function")
    for length, world in ((8, 2), (16, 4), (24, 3), (12, 1)):
        held = []
        for rank, got in enumerate(call_each(answer, [(length, world, rank) for rank in range(world)])):
            positions = _positions(got)
            if positions is None:
                return wrong(tr(f"For length {length} on {world} ranks, rank {rank}: your function returned {got!r}; "
                                "return the rank's positions as a list of ints.",
                                f"長さ {length}、{world}ランクのランク {rank} で、関数は {got!r} を返しました。ランクの"
                                "位置を int のリストで返してください。"), "shape")
            held.append(positions)
        every = sorted(p for ps in held for p in ps)
        where = tr(f"length {length} on {world} ranks", f"長さ {length}、{world}ランク")
        if every != list(range(length)):
            return wrong(tr(f"With {where}, the ranks' positions do not cover the sequence once.",
                            f"{where} のとき、ランクの位置が系列をちょうど 1回ずつ覆っていません。"), "not_a_partition")
        work = [causal_work(ps) for ps in held]
        if len(set(work)) > 1:
            contiguous = all(ps == list(range(r * length // world, (r + 1) * length // world))
                             for r, ps in enumerate(held))
            return wrong(tr(f"With {where}, the ranks compute {work} score elements.",
                            f"{where} のとき、各ランクが計算するスコアの要素数は {work} です。"),
                         "contiguous" if contiguous else "off_by_one")
        for rank in range(world):
            ref = ring_attention.shard_sequence(torch.arange(length)[None, None, :, None], rank, world, "balanced")
            if held[rank] != ref.reshape(-1).tolist():
                return wrong(tr(f"With {where}, rank {rank}'s positions {held[rank]} split the work evenly but in "
                                "another way than the chapter's (an early chunk, then its late partner).",
                                f"{where} のとき、ランク {rank} の位置 {held[rank]} は仕事を均等に分けますが、章の分け方"
                                "（前のチャンク、次にその相手の後ろのチャンク）とは違います。"), "off_by_one")
    return right(tr("Every token once, equal causal work on every rank, and the chapter's layout, for 4 cases.",
                    "4通りの場合で、どのトークンも 1回ずつ、どのランクも同じ因果的な仕事量、章と同じ配置でした。"))


# ---- 11.3: the split sizes of an expert layer's all-to-all -------------------------------------------------------
@exercise("11.3", title=("The split sizes of the dispatch", "配送の分割の大きさ"), hints=[
    ("Look at the section 'Experts on different ranks': which rank holds which experts?",
     "「ランクごとに異なるエキスパート」の節を見てください。どのランクがどのエキスパートを持つでしょうか。"),
    ("With E experts on N ranks, rank d holds experts d*E/N to (d+1)*E/N - 1, in order; count this rank's rows by "
     "the rank of their expert.",
     "E 個のエキスパートを N 個のランクに置くと、ランク d が持つのは、順に d*E/N から (d+1)*E/N - 1 の"
     "エキスパートです。このランクの行を、そのエキスパートを持つランクごとに数えます。"),
    ("Map each row's expert to the rank that holds it (the experts are split into world equal blocks), then "
     "count the rows per rank, ranks without rows included.",
     "各行のエキスパートを、それを持つランクに対応させます（エキスパートは world"
     " 個の等しいブロックに分かれています）。そのあとランクごとの行数を、行のないランクも含めて数えます。"),
], mistakes={
    "per_expert": ("You count rows per expert: all_to_all_single wants one size per rank (sum the experts each rank "
                   "holds).",
                   "エキスパートごとに行を数えています。all_to_all_single が必要とするのはランクごとの大きさです"
                   "（各ランクが持つエキスパートの分を足します）。"),
    "round_robin": ("Your sizes place expert e on rank e % N; the chapter places the experts in order, E/N per rank.",
                    "エキスパート e をランク e % N に置いた大きさになっています。章ではエキスパートを順に、ランクごとに "
                    "E/N 個ずつ置きます。"),
    "missing_rank": ("A rank that receives nothing still needs its size 0: the list has one entry per rank.",
                     "何も受け取らないランクにも大きさ 0 が必要です。リストにはランクごとに 1つの値があります。"),
})
def check_11_3(answer, cases=30, seed=0):
    """Random routings: the learner's sizes against the count of rows per holding rank.
    Explained in 11_sequence_context_experts."""
    rng = random.Random(seed)
    drawn = []
    for i in range(cases):
        world = rng.choice([1, 2, 4, 8])
        experts = world * rng.choice([1, 2, 4])
        rows = rng.randint(0, 40)
        top = rng.randint(1, experts)  # routings that leave some experts (and ranks) without rows
        expert_of_row = torch.sort(torch.tensor([rng.randrange(top) for _ in range(rows)], dtype=torch.long)).values
        drawn.append((expert_of_row, experts, world))
    for (expert_of_row, experts, world), got in zip(drawn, call_each(answer, [(e.clone(), x, w) for e, x, w in drawn])):
        rows = len(expert_of_row)
        expected = torch.bincount(expert_of_row // (experts // world), minlength=world).tolist()
        got_list = _positions(got)
        got_list = got if got_list is None else got_list
        if got_list == expected:
            continue
        shown = tr(f"{rows} rows to experts {sorted(set(expert_of_row.tolist()))} of {experts} on {world} ranks: your "
                   f"sizes are {got_list}.",
                   f"{experts}個のエキスパートを {world}ランクに置き、{rows}行がエキスパート "
                   f"{sorted(set(expert_of_row.tolist()))} へ行くとき、あなたの大きさは {got_list} です。")
        if not isinstance(got_list, list):
            raise Stop(wrong(shown, "shape"))
        per_expert = torch.bincount(expert_of_row, minlength=experts).tolist()
        robin = torch.bincount(expert_of_row % world, minlength=world).tolist()
        key = ("per_expert" if got_list == per_expert else "round_robin" if got_list == robin
               else "missing_rank" if len(got_list) < world else None)
        return wrong(shown, key)
    return right(tr(f"Split sizes right for {cases} random routings (1 to 8 ranks, ranks without rows included).",
                    f"ランダムな {cases}通りのルーティング（1〜8ランク、行のないランクを含む）で、分割の大きさが"
                    "正しくなりました。"))

