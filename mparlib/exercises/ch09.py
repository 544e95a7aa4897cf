"""Checks of chapter 09's exercises: ZeRO's bytes per rank, a flat parameter's shards and back, a ZeRO step.

The byte count is checked at random points against the chapter's own arithmetic (``mparlib.sharding``); the
shards by their properties (equal sizes, zero padding, concatenation to the whole); the ZeRO step on 2 and then 3
fresh gloo processes against one process's SGD steps on the whole batch (computed here, never in a rank), for a
model whose size does not divide by 3.
Explained in 09_sharding.
"""
import math
import random

import torch
from torch import nn

from ..lang import tr
from ..sharding import PRECISIONS, STATES_PER_PARAMETER, bytes_per_parameter, zero_bytes_per_rank
from .ch06 import close, fault, learner_function, run_children
from .ch07 import near
from .core import call, call_each, exercise, first_mismatch, mismatch_text, right, wrong


# ---- 09.1: bytes per rank under ZeRO ---------------------------------------------------------------------------
def zero_total(n_params, world, stage, per_parameter, shift=0, everything=None):
    """Total bytes per rank, or those of a likely mistake (stage shifted, everything or nothing sharded).
    For check authors: see the package docstring."""
    order = ("optimizer", "grads", "params")  # stage s shards the first s of these
    total = 0
    for i, part in enumerate(order):
        sharded = (i < stage + shift) if everything is None else everything
        total += n_params * per_parameter[part] / (world if sharded else 1)
    return total


@exercise("09.1", title=("Bytes per rank under ZeRO", "ZeRO でのランクあたりのバイト数"), hints=[
    ("Look at the section 'Where the memory goes' and `mparlib.sharding.zero_bytes_per_rank`'s docstring: what "
     "does each stage shard?",
     "「メモリの内訳」の節と `mparlib.sharding.zero_bytes_per_rank` の説明を見てください。各ステージは何を"
     "シャーディングするでしょうか。"),
    ("Three parts: parameters, gradients, optimizer state (bytes per parameter given in per_parameter). Stage 0 "
     "keeps all three whole on every rank; stage 1 divides the optimizer state by the world size, stage 2 also "
     "the gradients, stage 3 also the parameters.",
     "部分は 3つ、パラメータ、勾配、オプティマイザの状態です（パラメータあたりのバイト数は per_parameter に"
     "あります）。ステージ 0 は 3つとも各ランクに丸ごと持ちます。ステージ 1 はオプティマイザの状態をワールドサイズで"
     "割り、ステージ 2 は勾配も、ステージ 3 はパラメータも割ります。"),
    ("For each of the three parts, decide from the stage whether it is sharded (ZeRO-1 shards the optimizer "
     "state, ZeRO-2 the gradients too, ZeRO-3 the parameters as well); a sharded part costs a world-th of "
     "itself per rank. Add the three up.",
     "3つの部分それぞれについて、ステージからシャーディングされるかどうかを決めます（ZeRO-1"
     " はオプティマイザの状態、ZeRO-2 はさらに勾配、ZeRO-3"
     " はパラメータも）。シャーディングされた部分は、ランクあたりその world 分の 1 です。3"
     "つを足し合わせます。"),
], mistakes={
    "stage_shift": ("Your numbers are those of the neighbouring stage: stage 1 shards only the optimizer state, "
                    "stage 2 adds the gradients, stage 3 the parameters.",
                    "隣のステージの値になっています。ステージ 1 がシャーディングするのはオプティマイザの状態だけで、"
                    "ステージ 2 で勾配が、ステージ 3 でパラメータが加わります。"),
    "all_sharded": ("You divide every part by the world size whatever the stage: only stage 3 shards all three.",
                    "ステージによらずすべての部分をワールドサイズで割っています。3つすべてを分けるのはステージ 3 だけです。"),
    "none_sharded": ("You divide nothing by the world size: that is stage 0 (DDP) only.",
                     "何もワールドサイズで割っていません。それはステージ 0（DDP）だけです。"),
})
def check_09_1(answer, points=40, seed=0):
    """Compare with the chapter's arithmetic at random points; a mistake is named when it explains every point.
    Explained in 09_sharding."""
    rng = random.Random(seed)
    hypotheses = {"stage_shift": [1, -1], "all_sharded": [True], "none_sharded": [False]}
    fits = {key: [True] * len(v) for key, v in hypotheses.items()}
    first = None
    drawn = []
    for i in range(points):
        n, world, stage = rng.randint(10**5, 10**11), rng.choice([2, 3, 4, 8, 16, 64, 512]), i % 4
        drawn.append((n, world, stage, rng.choice(sorted(PRECISIONS)), rng.choice(sorted(STATES_PER_PARAMETER))))
    cases = [(n, world, stage, dict(bytes_per_parameter(p, o))) for n, world, stage, p, o in drawn]
    for (n, world, stage, precision, optimizer), got in zip(drawn, call_each(answer, cases)):
        per = bytes_per_parameter(precision, optimizer)
        expected = sum(zero_bytes_per_rank(n, world, stage, precision, optimizer).values())
        fits["stage_shift"] = [ok and near(got, zero_total(n, world, stage, per, shift=s), 1e-9)
                               for ok, s in zip(fits["stage_shift"], hypotheses["stage_shift"])]
        for key in ("all_sharded", "none_sharded"):
            fits[key] = [fits[key][0] and near(got, zero_total(n, world, stage, per, everything=key == "all_sharded"),
                                               1e-9)]
        if first is None and not near(got, expected, 1e-9):
            first = tr(f"{n} parameters on {world} ranks, stage {stage}, bytes per parameter {per}: your total is "
                       f"{got!r}.",
                       f"パラメータ {n}個、{world}ランク、ステージ {stage}、パラメータあたりのバイト数 {per}: "
                       f"あなたの合計は {got!r} です。")
    if first is None:
        return right(tr(f"Bytes per rank agree at {points} random points (all stages, precisions and optimizers).",
                        f"ランダムな {points}点（すべてのステージ、精度、オプティマイザ）で、ランクあたりのバイト数が"
                        "一致しました。"))
    return wrong(first, next((key for key, oks in fits.items() if any(oks)), None))


# ---- 09.2 and 09.3: a flat parameter's shards ----------------------------------------------------------------------
def flat_cases(seed=0):
    """Lists of tensors of uneven total sizes, with the world sizes to shard them over. For check authors: see the
    package docstring."""
    rng = random.Random(seed)
    cases = []
    for world in (2, 3, 4, 5):
        shapes = [tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 4))]
        g = torch.Generator().manual_seed(world)
        cases.append(([torch.randn(s, generator=g) for s in shapes], world))
    cases.append(([torch.randn(3)], 4))  # fewer elements than ranks... almost: one rank holds only padding
    cases.append(([torch.randn(2)], 5))
    return cases


def reference_shards(tensors, world):
    """Each rank's shard of the flattened, zero-padded tensors. For check authors: see the package docstring."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    size = math.ceil(flat.numel() / world)
    padded = torch.cat([flat, flat.new_zeros(size * world - flat.numel())])
    return list(padded.split(size))


@exercise("09.2", title=("Shard a flat parameter", "フラットなパラメータのシャーディング"), hints=[
    ("Look at `mparlib.sharding.ShardedOptimizer` in the section 'ZeRO from primitives': how does it cut the "
     "parameters among the ranks?",
     "「プリミティブから作る ZeRO」の節の `mparlib.sharding.ShardedOptimizer` を見てください。パラメータを"
     "ランクにどう分けているでしょうか。"),
    ("Flatten every tensor and concatenate them; every rank gets the same number of elements, S = ceil(total / "
     "world), so the buffer is padded with zeros up to world x S. Rank r takes elements r S to (r + 1) S.",
     "すべてのテンソルをフラットにしてつなげます。どのランクも同じ個数 S = ceil(total / world) を受け持つので、"
     "バッファを world x S までゼロで埋めます。ランク r は r S から (r + 1) S までの要素を受け持ちます。"),
    ("Flatten and concatenate the tensors, pad with zeros up to a multiple of world, and give rank r the r-th "
     "of the equal slices.",
     "テンソルを平らにして連結し、0 を詰めて長さを world の倍数にし、ランク r に r"
     " 番目の等しいスライスを渡します。"),
], mistakes={
    "no_padding": ("The shards differ in size: pad the flat buffer with zeros to a multiple of the world size, so "
                   "that every rank's shard has ceil(total / world) elements.",
                   "シャードの大きさがそろっていません。フラットなバッファをワールドサイズの倍数までゼロで埋め、どのランクの"
                   "シャードも ceil(total / world) 個にしてください。"),
    "wrong_slice": ("This shard is another rank's: rank r takes the r-th slice of S elements.",
                    "このシャードは別のランクのものです。ランク r は S 個ずつの r 番目のスライスを受け持ちます。"),
})
def check_09_2(answer):
    """Compare every rank's shard with the slices of the padded flat buffer (uneven totals, a rank of padding
    only). Explained in 09_sharding."""
    for tensors, world in flat_cases():
        expected = reference_shards(tensors, world)
        for rank in range(world):
            got = call(answer, [t.clone() for t in tensors], rank, world)
            if close(got, expected[rank]):
                continue
            where = tr(f"With sizes {[tuple(t.shape) for t in tensors]} on {world} ranks, rank {rank}'s shard",
                       f"大きさ {[tuple(t.shape) for t in tensors]}、{world}ランクのとき、ランク {rank} のシャード")
            key = None
            if isinstance(got, torch.Tensor) and got.shape != expected[rank].shape:
                key = "no_padding"
            elif any(close(got, e) for e in expected):
                key = "wrong_slice"
            return wrong(mismatch_text(where, first_mismatch(got, expected[rank])), key)
    return right(tr("Every rank's shard is its slice of the zero-padded flat buffer, for totals that do not divide.",
                    "割り切れない合計でも、各ランクのシャードはゼロで埋めたフラットなバッファのそのランクのスライスでした。"))


@exercise("09.3", title=("Back from the shards", "シャードからの復元"), hints=[
    ("This is what the all-gather of ZeRO's step undoes (section 'ZeRO from primitives'): the ranks' shards, in "
     "rank order, make the padded flat buffer.",
     "これは ZeRO のステップのオールギャザーが元に戻すものです（「プリミティブから作る ZeRO」の節）。ランクの順に"
     "並べたシャードが、パディングを含むフラットなバッファになります。"),
    ("Concatenate the shards; then cut the tensors off the front one after another, each with as many elements as "
     "its shape holds, and reshape. What is left at the end is padding.",
     "シャードをつなげ、前から順に、それぞれの形状が持つ個数ずつ切り出して形状を戻します。最後に残るのはパディングです。"),
    ("Concatenate the shards back into one flat buffer, then walk the shapes with a running offset, cutting "
     "out each tensor's number of elements and giving it its shape back. The padding at the end is never read.",
     "シャードを連結して 1"
     "つの平らなバッファに戻し、オフセットを進めながら形状を順にたどって、各テンソルの要素数だけ切り出して形を戻します。末尾の詰め物は読みません。"),
], mistakes={
    "shape_lost": ("The values are right but a tensor has the wrong shape: reshape each piece to its shape.",
                   "値は正しいのですが、形状の違うテンソルがあります。切り出した各部分を元の形状にしてください。"),
})
def check_09_3(answer):
    """Unshard the reference shards and compare with the original tensors. Explained in 09_sharding."""
    for tensors, world in flat_cases():
        got = call(answer, reference_shards(tensors, world), [tuple(t.shape) for t in tensors])
        if not isinstance(got, (list, tuple)) or len(got) != len(tensors):
            return wrong(tr(f"Your function returned {type(got).__name__} of length {len(got) if isinstance(got, (list, tuple)) else '-'}; "
                            f"return a list of {len(tensors)} tensors.",
                            f"戻り値の型と長さが {type(got).__name__}、"
                            f"{len(got) if isinstance(got, (list, tuple)) else '-'} です。{len(tensors)}個のテンソルの"
                            "リストを返してください。"), "shape")
        for i, (g, t) in enumerate(zip(got, tensors)):
            if close(g, t, 0, 0):
                continue
            where = tr(f"On {world} ranks, tensor {i}", f"{world}ランクのとき、テンソル {i}")
            key = "shape_lost" if isinstance(g, torch.Tensor) and g.numel() == t.numel() and \
                torch.equal(g.reshape(-1), t.reshape(-1)) else None
            return wrong(mismatch_text(where, first_mismatch(g, t, 0, 0)), key)
    return right(tr("Every tensor came back exactly, padding dropped.",
                    "パディングを除いて、すべてのテンソルが正確に元に戻りました。"))


# ---- 09.4: a ZeRO step -------------------------------------------------------------------------------------------
def zero_model(seed):
    """A model of 5 x 4 + 4 + 4 x 4 = 40 parameters: on 3 ranks the flat buffer needs padding (the caller's generator
    untouched). For check authors: see the package docstring."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 4, bias=False)).double()


def zero_batches(world, steps=2, per_rank=3, seed=0):
    """The ``steps`` batches (inputs, targets) of a run on ``world`` ranks, ``per_rank`` examples each.
    For check authors: see the package docstring."""
    g = torch.Generator().manual_seed(seed + 7)
    xs = [torch.randn(world * per_rank, 5, generator=g, dtype=torch.float64) for _ in range(steps)]
    ys = [torch.randn(world * per_rank, 4, generator=g, dtype=torch.float64) for _ in range(steps)]
    return list(zip(xs, ys))


def zero_reference(world, lr=0.3, steps=2, per_rank=3, seed=0):
    """One process's SGD on the whole batches: the parameters after each step. For check authors: see the package
    docstring."""
    whole = zero_model(seed)
    sgd = torch.optim.SGD(whole.parameters(), lr=lr)
    history = []
    for x, y in zero_batches(world, steps, per_rank, seed):
        sgd.zero_grad()
        nn.functional.mse_loss(whole(x), y).backward()
        sgd.step()
        history.append([p.detach().clone() for p in whole.parameters()])
    return history


def zero_child(module, name, lr=0.3, steps=2, per_rank=3, seed=0):
    """Steps of the learner's ZeRO update on this rank's share of each batch: the parameters after each.
    For check authors: see the package docstring."""
    import torch.distributed as dist

    fn = learner_function(module, name)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        share = slice(rank * per_rank, (rank + 1) * per_rank)
        batches = [(x[share].clone(), y[share].clone()) for x, y in zero_batches(world, steps, per_rank, seed)]
        model = zero_model(seed)
    except Exception:
        return fault()
    history = []
    for x, y in batches:
        try:
            model.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
        except Exception:
            return fault()
        fn(list(model.parameters()), lr)
        history.append([p.detach().clone() for p in model.parameters()])
    return {"history": history}


def zero_key(values, expected, before, step, index):
    """The likely mistake behind a wrong parameter after a ZeRO step (first step only). For check authors: see the
    package docstring."""
    try:
        return zero_mistake(values, expected, before, index) if step == 0 else None
    except (IndexError, KeyError, TypeError):  # a rank's history is not what the learner was asked to leave
        return None


def zero_mistake(values, expected, before, index):
    """:func:`zero_key` for the first step, on well-formed histories. For check authors: see the package docstring."""
    got, world = values[0]["history"][0][index], len(values)
    want, start = expected[0][index], before[index]
    if close(got, start + world * (want - start)):
        return "missing_average"
    if any(close(got, start + world / d * (want - start)) for d in range(2, 9) if d != world):
        return "wrong_divisor"
    first = [v["history"][0] for v in values]
    if any(not all(close(a, b, 0, 0) for a, b in zip(first[0], other)) for other in first[1:]):
        return "ranks_differ"
    return None


@exercise("09.4", title=("A ZeRO step", "ZeRO のステップ"), needs="processes", hints=[
    ("Look at `mparlib.sharding.ShardedOptimizer.step` in the section 'ZeRO from primitives': three steps.",
     "「プリミティブから作る ZeRO」の節の `mparlib.sharding.ShardedOptimizer.step` を見てください。3つの段階が"
     "あります。"),
    ("Flatten the local gradients into a buffer padded to world x S; reduce-scatter it (each rank receives the "
     "sum of its slice) and divide by the world size; update this rank's slice of the flat parameters with SGD; "
     "all-gather the slices and copy them back into the parameters.",
     "ローカルな勾配を world x S まで埋めたバッファにフラットに並べ、リデュース・スキャッターします（各ランクは自分のスライスの"
     "合計を受け取ります）。それをワールドサイズで割り、フラットなパラメータのこのランクのスライスを SGD で更新し、スライスを"
     "オールギャザーしてパラメータに書き戻します。"),
    ("Gather the gradients into one padded flat buffer and reduce-scatter it, so that each rank gets the sum "
     "over ranks of its own shard; average it, update only your shard of the parameters, all-gather the shards "
     "and copy the result back into the parameters.",
     "勾配を詰め物付きの 1"
     "つの平らなバッファに集めてリデュース・スキャッターし、各ランクが自分のシャードのランク間の和を受け取るようにします。それを平均し、自分のシャードのパラメータだけを更新し、シャードをオールギャザーして、結果をパラメータに書き戻します。"),
], mistakes={
    "missing_average": ("The parameters moved the world size times too far: the reduce-scatter sums the "
                        "gradients, and data parallelism averages them. Divide by dist.get_world_size().",
                        "パラメータがワールドサイズ倍動いています。リデュース・スキャッターは勾配を合計しますが、データ"
                        "並列では平均します。dist.get_world_size() で割ってください。"),
    "wrong_divisor": ("The parameters moved by the wrong fraction of the step: the summed gradients are divided by "
                      "a number other than the world size. Divide by dist.get_world_size(), never by a fixed number "
                      "(the check runs 2 and then 3 ranks).",
                      "パラメータの動く量が違います。合計した勾配をワールドサイズ以外の数で割っています。固定の数では"
                      "なく dist.get_world_size() で割ってください（チェックはランク 2個、次に 3個で動きます）。"),
    "ranks_differ": ("The ranks end with different parameters: every rank must receive every other rank's updated "
                     "slice (the all-gather) and use the gradients summed over all ranks (the reduce-scatter).",
                     "ランクごとにパラメータが違っています。どのランクも他のすべてのランクの更新済みのスライスを受け取り"
                     "（オールギャザー）、全ランクで合計した勾配を使う（リデュース・スキャッター）必要があります。"),
})
def check_09_4(answer, sizes=(2, 3), lr=0.3, steps=2):
    """Two ZeRO steps on 2 and then 3 ranks (3: padded) against one process's SGD on the whole batch, parameter by
    parameter. Explained in 09_sharding."""
    runs = run_children(answer, zero_child, [(world, (lr, steps)) for world in sizes])
    names = ["0.weight", "0.bias", "2.weight"]
    before = [p.detach().clone() for p in zero_model(0).parameters()]
    for world, values in zip(sizes, runs):
        expected = zero_reference(world, lr, steps)
        for step in range(steps):
            for rank, v in enumerate(values):
                got_step = v["history"][step] if isinstance(v, dict) and len(v.get("history", ())) > step else []
                for index, want in enumerate(expected[step]):
                    got = got_step[index] if index < len(got_step) else None
                    if close(got, want, 1e-6, 1e-9):
                        continue
                    where = tr(f"With {world} ranks, after step {step + 1}, rank {rank}'s {names[index]}",
                               f"ランク {world}個で、ステップ {step + 1} のあと、ランク {rank} の {names[index]}")
                    key = zero_key(values, expected, before, step, index) if isinstance(got, torch.Tensor) else None
                    return wrong(mismatch_text(where, first_mismatch(got, want, 1e-6, 1e-9)), key)
    return right(tr(f"After {steps} steps on {' and '.join(map(str, sizes))} ranks every parameter equals one "
                    "process's SGD on the whole batch.",
                    f"ランク {'個と '.join(map(str, sizes))}個のどちらでも、{steps}ステップ進めたあと、どのパラメータも "
                    "1個のプロセスがミニバッチ全体で SGD を進めた値と一致しました。"))
