"""Checks of chapter 06's exercises: DDP's gradient average by hand, the sampler's epochs, rank 0's checkpoint.

Every check runs the learner's worker on fresh gloo processes through :func:`run_children`, with 2 and then 3
processes: a function of this module (the "child") prepares the inputs on each rank, calls the learner's function,
and returns what the learner's code gave or left. The check, in the kernel, computes the expected values itself (a
child never holds them: the learner's code runs in its process) and compares. The child's own failures come back
as a :class:`CheckFault`, so that a bug of the check is never taken for a wrong answer. Chapters 08-10 use the same
helpers. Explained in 06_ddp.
"""
import contextlib
import importlib
import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import launch
from ..lang import tr
from . import sandbox
from .core import Stop, exercise, first_mismatch, importable, is_starter, mismatch_text, not_attempted, right, \
    run_ranks, whole, wrong


# ---- Helpers shared by the distributed checks of chapters 06-10 ------------------------------------------------
@dataclass
class CheckFault:
    """What a child returns when the check's own code failed on a rank (never the learner's). For check authors: see the
    package docstring."""
    trace: str


def learner_function(module, name):
    """Import the learner's function ``module.name`` in a child process. For check authors: see the package
    docstring."""
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    return fn


def run_children(answer, child, runs, kwargs=None, timeout=20, limit=45):
    """Run ``child(module, name, *args, **kwargs)`` on ``nproc`` fresh processes, where ``module.name`` is the
    learner's ``answer``, once per ``(nproc, args)`` of ``runs``, one run after the other (e.g. 2 and then 3
    processes, so that a hard-coded world size is wrong); a list of each run's rank values (a fault of the check's
    own child raises).

    Judged apart, the runs start from one clean worker, which sends back the ranks' values as plain data: the check
    in the kernel holds the expected values, which a child never computes (the learner's code shares its process).
    For check authors: see the package docstring."""
    if is_starter(answer):
        raise Stop(not_attempted())
    module, name = importable(answer)
    runs = [(int(n), tuple(a)) for n, a in runs]
    if sandbox.apart():
        out = whole(sandbox.run_apart(ranks_in_worker, module, name, child, runs, kwargs, timeout, limit, True),
                    len(runs))
        return [whole(values, nproc) for (nproc, _), values in zip(runs, out)]
    return ranks_in_worker(module, name, child, runs, kwargs, timeout, limit)


def ranks_in_worker(module, name, child, runs, kwargs, timeout, limit, fork=False):
    """The runs of :func:`run_children` where the learner's code runs; each rank's value with its parts that are
    not plain data marked. ``fork``: in a check's clean worker, whose ranks are forked from it (a copy of the fork
    server that has not computed: as clean, without starting a fork server of its own). For check authors: see the
    package docstring."""
    out = []
    for nproc, args in runs:
        with launch._forking_here() if fork else contextlib.nullcontext():
            results = run_ranks(child, nproc, args=(module, name, *args), kwargs=kwargs, timeout=timeout,
                                limit=limit)
        faults = [r.value.trace for r in results if isinstance(r.value, CheckFault)]
        if faults:
            raise RuntimeError("the check's own code failed in a rank:\n" + faults[0])
        out.append([sandbox.plain_parts(r.value) for r in results])
    return out


def fault():
    """The :class:`CheckFault` of the exception being handled (call it in an ``except`` block). For check authors: see
    the package docstring."""
    return CheckFault(traceback.format_exc())


def close(got, expected, rtol=1e-5, atol=1e-6):
    """True if ``got`` is a tensor equal to ``expected`` within the tolerances. For check authors: see the package
    docstring."""
    return first_mismatch(got, expected, rtol, atol) is None


# ---- 06.1: the gradient average by hand -------------------------------------------------------------------------
def grad_model(seed):
    """A small network with a frozen bias, the same on every rank for ``seed`` (the caller's generator untouched).
    For check authors: see the package docstring."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    model[0].bias.requires_grad_(False)  # a frozen parameter: it has no gradient
    return model


def grads_of(model):
    """``{name: gradient or None}`` of ``model``'s parameters, copied. For check authors: see the package docstring."""
    return {k: None if p.grad is None else p.grad.detach().clone() for k, p in model.named_parameters()}


def batch_grads(seed, world, per_rank, share=None):
    """The gradients of :func:`grad_model` on the batch of a run on ``world`` ranks, or on rank ``share``'s part of
    it. For check authors: see the package docstring."""
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(world * per_rank, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (world * per_rank,), generator=g)
    part = slice(None) if share is None else slice(share * per_rank, (share + 1) * per_rank)
    model = grad_model(seed)
    nn.functional.cross_entropy(model(x[part]), y[part]).backward()
    return model


def average_child(module, name, seed=0, per_rank=4):
    """Rank r's share of a batch, backward, the learner's averaging; returns the gradients. For check authors: see the
    package docstring."""
    import torch.distributed as dist

    fn = learner_function(module, name)
    try:
        model = batch_grads(seed, dist.get_world_size(), per_rank, share=dist.get_rank())
    except Exception:
        return fault()
    fn(model)
    return {"got": grads_of(model)}


@exercise("06.1", title=("The gradient average by hand", "手で求める勾配の平均"), needs="processes", hints=[
    ("Look at the formula of the section 'Two halves equal one whole': what does DDP do to every gradient during "
     "the backward pass?",
     "「半分ずつの計算と全体の計算の一致」の節の式を見てください。DDP は逆伝播の最中に各勾配に何をしているでしょうか。"),
    ("Every rank sums each parameter's gradient over all ranks with a collective, then divides by the number of "
     "processes. A frozen parameter has no gradient (p.grad is None).",
     "各ランクが集合通信で各パラメータの勾配を全ランク分合計し、プロセス数で割ります。凍結したパラメータには勾配が"
     "ありません（p.grad is None）。"),
    ("Loop over the parameters that have a gradient. The collective sums in place across the ranks, so a mean "
     "needs one more in-place operation with the world size.",
     "勾配を持つパラメータについてループします。集合通信はランクをまたいでその場で合計するので、平均にするには "
     "world size を使った演算をもう 1つ、その場で行います。"),
], mistakes={
    "missing_division": ("Each gradient is the world size times too large: the all-reduce sums, and DDP averages. "
                         "Divide by dist.get_world_size() (not by a fixed number: the check runs 2 and then 3 "
                         "processes).",
                         "勾配がワールドサイズ倍になっています。オールリデュースは合計し、DDP は平均します。"
                         "dist.get_world_size() で割ってください（固定の数ではありません。チェックは 2個、次に 3個の"
                         "プロセスで動きます）。"),
    "no_all_reduce": ("The gradients are still each rank's own: nothing was exchanged between the processes. Use "
                      "dist.all_reduce on every gradient, in place.",
                      "勾配が各ランク自身のままで、プロセス間で何もやり取りされていません。すべての勾配に "
                      "dist.all_reduce をその場で使ってください。"),
    "wrong_divisor": ("The gradients are averaged, but by the wrong number: divide by dist.get_world_size().",
                      "勾配は平均されていますが、割る数が違います。dist.get_world_size() で割ってください。"),
})
def check_06_1(answer, sizes=(2, 3), seed=0, per_rank=4):
    """Compare every rank's averaged gradients with one process's gradients on the whole batch, on 2 and then 3
    processes. Explained in 06_ddp."""
    runs = run_children(answer, average_child, [(world, (seed, per_rank)) for world in sizes])
    for world, values in zip(sizes, runs):
        expected = grads_of(batch_grads(seed, world, per_rank))
        for rank, v in enumerate(values):
            got_all = v["got"] if isinstance(v, dict) and isinstance(v.get("got"), dict) else {}
            local = grads_of(batch_grads(seed, world, per_rank, share=rank))
            for key, want in expected.items():
                if want is None:
                    continue
                got = got_all.get(key)
                where = tr(f"With {world} processes, rank {rank}'s gradient of {key}",
                           f"プロセス {world}個のとき、ランク {rank} の {key} の勾配")
                if not isinstance(got, torch.Tensor):
                    return wrong(tr(f"{where} is {got!r} after your function.", f"関数のあとの{where}が {got!r} です。"),
                                 "no_all_reduce")
                if close(got, want):
                    continue
                return wrong(mismatch_text(where, first_mismatch(got, want)), average_key(got, want, local[key], world))
    return right(tr(f"On {' and '.join(map(str, sizes))} processes every gradient equals that of one process on the "
                    "whole batch: what DDP computes.",
                    f"{'個と '.join(map(str, sizes))}個のプロセスで、どの勾配も 1個のプロセスがミニバッチ全体で計算した"
                    "勾配と一致しました。DDP が計算するものと同じです。"))


def average_key(got, expected, local, world):
    """The likely mistake behind a wrong averaged gradient (a hint key or None). For check authors: see the package
    docstring."""
    if close(got, world * expected):
        return "missing_division"
    if close(got, local):
        return "no_all_reduce"
    if any(close(got, world * expected / d) for d in range(1, 9) if d != world):
        return "wrong_divisor"
    return None


# ---- 06.2: the sampler's epochs ---------------------------------------------------------------------------------
def reference_shares(size, epochs, seed, rank, world, shuffle=True, set_epoch=True):
    """What ``DistributedSampler`` gives rank ``rank`` in each epoch. For check authors: see the package docstring."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(size), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
    out = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def sampler_child(module, name, size, epochs, seed):
    """The learner's epochs of indices on this rank, as lists of ints where they are. For check authors: see the
    package docstring."""
    shares = learner_function(module, name)(list(range(size)), epochs, seed=seed)
    try:
        return {"got": [[int(i) for i in epoch] for epoch in shares]}
    except (TypeError, ValueError):  # not lists of indices: what came back, as text
        return {"got": repr(shares)[:200]}


def sampler_mistake(values, size, epochs, seed):
    """The likely mistake behind wrong shares (a hint key) and the rank to name. For check authors: see the package
    docstring."""
    world = len(values)
    for rank, v in enumerate(values):
        if v["got"] != reference_shares(size, epochs, seed, rank, world):
            break
    got = v["got"]
    for key, kwargs in (("forgot_set_epoch", {"set_epoch": False}), ("no_shuffle", {"shuffle": False})):
        if got == reference_shares(size, epochs, seed, rank, world, **kwargs):
            return rank, key
    if got == reference_shares(size, epochs, 0, rank, world):
        return rank, "seed_ignored"
    if any(len(e) >= size for e in got):
        return rank, "not_split"
    first = set().union(*(set(w["got"][0]) for w in values if w["got"]))
    if len(first) < size:
        return rank, "different_orders"
    return rank, None


@exercise("06.2", title=("A new order every epoch", "エポックごとに新しい順序"), needs="processes", hints=[
    ("Look at the section 'The sampler: each process its own share, a new order every epoch' and its cell.",
     "「サンプラー: 各プロセスに専用の担当分、エポックごとに新しい順序」の節とそのセルを見てください。"),
    ("A DistributedSampler built inside a worker reads the rank and the world size from the process group. The "
     "order comes from seed + epoch, so the sampler must be told the epoch before each pass.",
     "ワーカーの中で作った DistributedSampler は、ランクとワールドサイズをプロセスグループから読みます。順序は "
     "seed + epoch から作られるので、各回の前にサンプラーにエポックを伝える必要があります。"),
    ("PyTorch's DistributedSampler does the sharding; what gives each epoch a new order is the call that tells "
     "it the epoch, made before you iterate over it.",
     "シャーディングは PyTorch の DistributedSampler"
     " が行います。エポックごとに新しい順序にするのは、反復する前にエポックを伝える呼び出しです。"),
], mistakes={
    "forgot_set_epoch": ("Every epoch has the same order: the sampler was never told the epoch. Call "
                         "sampler.set_epoch(epoch) at the start of each epoch.",
                         "どのエポックも同じ順序です。サンプラーにエポックを伝えていません。各エポックの始めに "
                         "sampler.set_epoch(epoch) を呼んでください。"),
    "no_shuffle": ("The shares come in the data set's own order: pass shuffle=True (the default).",
                   "担当分がデータセットの元の順序のままです。shuffle=True（既定値）にしてください。"),
    "seed_ignored": ("The order is that of seed 0: pass the function's seed to the sampler.",
                     "順序がシード 0 のものです。関数の seed をサンプラーに渡してください。"),
    "not_split": ("A rank received the whole data set: let the sampler split it over the ranks (inside a worker it "
                  "reads the rank and world size from the process group).",
                  "あるランクがデータセット全体を受け取りました。サンプラーにランク間で分けさせてください（ワーカーの"
                  "中ではランクとワールドサイズをプロセスグループから読みます）。"),
    "different_orders": ("The ranks' shares of an epoch do not cover the data set: they overlap because the ranks "
                         "shuffled differently. Every rank must use the same seed.",
                         "1エポックの各ランクの担当分がデータセット全体を覆っていません。ランクごとに違うシャッフルを"
                         "したため重なっています。すべてのランクで同じシードを使ってください。"),
})
def check_06_2(answer, sizes=(2, 3), size=10, epochs=3, seed=5):
    """Compare each rank's shares with DistributedSampler's, epoch by epoch, on 2 and then 3 ranks (10 examples on 3
    ranks: padded). Explained in 06_ddp."""
    runs = run_children(answer, sampler_child, [(world, (size, epochs, seed)) for world in sizes])
    for world, values in zip(sizes, runs):
        bad = [v["got"] for v in values if not (isinstance(v["got"], list) and len(v["got"]) == epochs)]
        if bad:
            said = bad[0] if isinstance(bad[0], str) else repr(bad[0])  # a str is the repr the child made
            return wrong(tr(f"Your function returned {said}; it should return one list of indices per epoch "
                            f"({epochs} lists).",
                            f"関数の戻り値が {said} です。エポックごとに 1つ、合わせて {epochs}個のインデックスの"
                            "リストを返してください。"), "shape")
        if all(v["got"] == reference_shares(size, epochs, seed, rank, world) for rank, v in enumerate(values)):
            continue
        rank, key = sampler_mistake(values, size, epochs, seed)
        expected = reference_shares(size, epochs, seed, rank, world)
        epoch = next(e for e, (a, b) in enumerate(zip(values[rank]["got"], expected)) if a != b)
        return wrong(tr(f"With {world} ranks, rank {rank}'s share in epoch {epoch} is {values[rank]['got'][epoch]}, "
                        "not the expected one.",
                        f"ランク {world}個のとき、ランク {rank} のエポック {epoch} の担当分が "
                        f"{values[rank]['got'][epoch]} で、期待されるものと違います。"), key)
    return right(tr(f"On {' and '.join(map(str, sizes))} ranks, {size} examples, {epochs} epochs: the shares match "
                    "DistributedSampler's, with a new order every epoch.",
                    f"ランク {'個と '.join(map(str, sizes))}個、データ {size}個、{epochs}エポック: 担当分が "
                    "DistributedSampler と一致し、エポックごとに順序が変わりました。"))


# ---- 06.3: rank 0's checkpoint -------------------------------------------------------------------------------------
def save_child(module, name, folder, delay=1.5):
    """The learner saves a DDP model's checkpoint; torch.save is watched, and on rank 0 it waits until the other
    ranks have returned (or ``delay`` seconds, when they wait for it as they should). For check authors: see the package
    docstring."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    fn = learner_function(module, name)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        model = DDP(save_model())
        path = str(Path(folder) / "checkpoint.pt")
        saves, real_save = [], torch.save

        def watched_save(obj, f, *args, **kwargs):
            saves.append(str(f))
            end = time.monotonic() + delay  # a slow disk: a rank that does not wait finds no file yet
            while rank == 0 and time.monotonic() < end and len(list(Path(folder).glob("returned-*"))) < world - 1:
                time.sleep(0.05)
            return real_save(obj, f, *args, **kwargs)
    except Exception:
        return fault()
    torch.save = watched_save
    try:
        fn(model, path)
        there = os.path.exists(path)
        if rank > 0:
            Path(folder, f"returned-{rank}").touch()  # lets rank 0's slow save go on
    finally:
        torch.save = real_save
    dist.barrier()  # the check's own wait, so that rank 0 reads the file once every rank has returned
    saved = None
    if rank == 0 and os.path.exists(path):
        try:
            saved = torch.load(path, weights_only=True)
        except Exception as e:  # not plain tensors, or a broken file: the check says which
            saved = f"{type(e).__name__}: {str(e)[:200]}"
    return {"saves": saves, "there": there, "saved": saved, "path": path}


def save_model():
    """The model whose checkpoint 06.3 asks for, the same in every process (the caller's generator untouched).
    For check authors: see the package docstring."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


@exercise("06.3", title=("Rank 0's checkpoint", "ランク 0 のチェックポイント"), needs="processes", hints=[
    ("Look at the section 'The chapter-5 experiment with 2 processes, a crash, and a resume': who writes the "
     "checkpoint, and how?",
     "「5章の実験を 2個のプロセスで: 障害と再開」の節を見てください。チェックポイントを書くのは誰で、どう書くでしょうか。"),
    ("One rank writes (rank 0), into a temporary file that is then renamed, so a crash never leaves half a file. "
     "Save the model inside the DDP wrapper (no 'module.' prefix). The other ranks must not go on before the file "
     "exists.",
     "書くのは 1つのランク（ランク 0）だけです。一時ファイルに書いてから名前を変えるので、落ちても中途半端なファイルは"
     "残りません。DDP のラッパーの内側のモデルを保存します（'module.' の接頭辞なし）。ほかのランクはファイルができる"
     "まで先に進んではいけません。"),
    ("Only rank 0 writes, and it writes a temporary file in the same folder first, then renames it over the "
     "target in one step. Every rank then waits at a barrier, outside the `if`.",
     "書くのはランク 0 だけです。まず同じフォルダに一時ファイルを書き、それを 1"
     "回の操作で目的の名前に置き換えます。そのあと、`if` の外で、すべてのランクがバリアで待ちます。"),
], mistakes={
    "every_rank_saves": ("More than one rank called torch.save: only rank 0 should write the checkpoint.",
                         "複数のランクが torch.save を呼びました。チェックポイントを書くのはランク 0 だけです。"),
    "missing_barrier": ("A rank returned before the file existed: the ranks that do not write must wait for rank 0 "
                        "(a barrier that every rank calls).",
                        "ファイルができる前に戻ったランクがあります。書かないランクはランク 0 を待つ必要があります"
                        "（すべてのランクが呼ぶバリア）。"),
    "module_prefix": ("The saved names start with 'module.': that is the DDP wrapper's state_dict. Save "
                      "model.module.state_dict(), so that a plain model can load it.",
                      "保存した名前が 'module.' で始まっています。これは DDP のラッパーの state_dict です。ふつうの"
                      "モデルで読み込めるよう、model.module.state_dict() を保存してください。"),
    "not_atomic": ("torch.save wrote straight into the final path: a crash while writing would leave a broken "
                   "checkpoint. Write to a temporary file, then os.replace it onto the path.",
                   "torch.save が最終的なパスに直接書いています。書き込み中に落ちると壊れたチェックポイントが残ります。"
                   "一時ファイルに書き、os.replace でそのパスに置き換えてください。"),
    "no_file": ("After your function no checkpoint exists at the path it was given.",
                "関数のあと、渡したパスにチェックポイントがありません。"),
})
def check_06_3(answer, sizes=(2, 3)):
    """Run the learner's save on 2 and then 3 ranks with a slow rank-0 disk; check who saved, the wait, what was
    saved and atomicity. Explained in 06_ddp."""
    with tempfile.TemporaryDirectory(prefix="mparlib-check-06-") as folder:
        for world in sizes:
            Path(folder, str(world)).mkdir()
        runs = run_children(answer, save_child, [(world, (str(Path(folder, str(world))),)) for world in sizes])
    for world, values in zip(sizes, runs):
        outcome = save_outcome(values, world)
        if outcome is not None:
            return outcome
    return right(tr(f"On {' and '.join(map(str, sizes))} ranks, rank 0 alone wrote the checkpoint, atomically, "
                    "without 'module.', and every rank waited for it.",
                    f"ランク {'個と '.join(map(str, sizes))}個のどちらでも、ランク 0 だけがチェックポイントをアトミックに、"
                    "'module.' なしで書き、すべてのランクがそれを待ちました。"))


def save_outcome(values, world):
    """The wrong outcome of one run of 06.3 on ``world`` ranks, or None when it was right. For check authors: see the
    package docstring."""
    where = tr(f"With {world} ranks: ", f"ランク {world}個のとき: ")
    savers = [rank for rank, v in enumerate(values) if v["saves"]]
    if any(rank != 0 for rank in savers):
        return wrong(where + tr(f"ranks {savers} called torch.save.", f"ランク {savers} が torch.save を呼びました。"),
                     "every_rank_saves")
    saved, expected = values[0]["saved"], save_model().state_dict()
    if saved is None:
        return wrong(where + tr("no checkpoint file was written.", "チェックポイントのファイルが書かれていません。"),
                     "no_file")
    late = [rank for rank, v in enumerate(values) if not v["there"]]
    if late:
        return wrong(where + tr(f"when your function returned on rank {late[0]}, the checkpoint did not exist yet.",
                                f"ランク {late[0]} で関数が戻ったとき、チェックポイントはまだありませんでした。"),
                     "missing_barrier")
    keys = sorted(saved, key=repr) if isinstance(saved, dict) else None
    if keys is None:
        return wrong(where + tr(f"the checkpoint cannot be read as a dict of tensors ({saved!r}).",
                                f"チェックポイントをテンソルの dict として読めません（{saved!r}）。"))
    if any(isinstance(k, str) and k.startswith("module.") for k in keys):
        return wrong(where + tr(f"the checkpoint's names are {keys}.", f"チェックポイントの名前が {keys} です。"),
                     "module_prefix")
    if keys != sorted(expected) or not all(close(saved[k], v, 0, 0) for k, v in expected.items()):
        return wrong(where + tr(f"the checkpoint holds {keys}, which are not the model's parameters.",
                                f"チェックポイントの中身 {keys} がモデルのパラメータと違います。"))
    if values[0]["path"] in values[0]["saves"]:
        return wrong(where + tr("rank 0's torch.save wrote the final path directly.",
                                "ランク 0 の torch.save が最終的なパスに直接書きました。"), "not_atomic")
    return None
