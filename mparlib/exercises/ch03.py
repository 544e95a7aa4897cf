"""Checks of chapter 03's exercises: scattering a batch, data_parallel along another dimension, chunk losses.

Explained in 03_primitives.
"""
import contextlib
import random

import torch
from torch import nn

from ..lang import tr
from ..parallel import scatter
from .core import call, exercise, first_mismatch, in_worker, mismatch_text, right, wrong


def _batches_03_1():
    torch.manual_seed(3)
    yield {"x": torch.randn(10, 3), "y": torch.arange(10), "train": True}, ["cpu"] * 4
    yield {"x": torch.randn(7, 2), "mask": torch.ones(7, 5, dtype=torch.bool), "name": "val"}, ["cpu"] * 3
    yield {"x": torch.randn(2, 4), "y": torch.arange(2), "scale": 0.5}, ["cpu"] * 4
    yield {"x": torch.randn(9, 1), "y": torch.arange(9)}, ["cpu"] * 2


def _describe(parts):
    if not isinstance(parts, list):
        return type(parts).__name__
    return [{k: (tuple(v.shape) if isinstance(v, torch.Tensor) else v) for k, v in p.items()}
            if isinstance(p, dict) else type(p).__name__ for p in parts]


def _same_parts(got, expected):
    if not (isinstance(got, list) and len(got) == len(expected)):
        return False
    for g, e in zip(got, expected):
        if not isinstance(g, dict) or list(g) != list(e):
            return False
        for k, v in e.items():
            if isinstance(v, torch.Tensor):
                if not (isinstance(g[k], torch.Tensor) and g[k].shape == v.shape and torch.equal(g[k], v)):
                    return False
            elif g[k] is not v and g[k] != v:
                return False
    return True


@exercise("03.1", title=("Scattering a batch", "バッチの分配"), hints=[
    ("Read the `scatter` section: what does it do with a dict, and with values that are not tensors?",
     "`scatter` の節を読んでください。dict や、テンソルでない値をどう扱いますか。"),
    ("One dict per device that gets rows: the i-th chunk of every tensor, under the same keys, and every other "
     "value as it is. Chunks follow torch.chunk, so there may be fewer dicts than devices.",
     "行を受け取るデバイスごとに dict を 1つ作ります。各テンソルの i番目のチャンクを同じキーで入れ、ほかの値はその"
     "まま入れます。チャンクは torch.chunk に従うので、dict の数がデバイスの数より少ないこともあります。"),
    ("Chunk every tensor the same way (`Tensor.chunk`). The number of chunks, not `len(devices)`, is how many "
     "dicts you return; dict i holds chunk i of each tensor, moved to device i, and every other value as it "
     "is.",
     "どのテンソルも同じように分けます（`Tensor.chunk`）。返す dict の数は "
     "`len(devices)` ではなく、できたチャンクの数です。i 番目の dict は、各テンソルの i"
     " 番目のチャンクをデバイス i に移したものと、テンソル以外の値をそのまま持ちます。"),
], mistakes={
    "transposed": ("You returned the chunks grouped by key (one entry per key). scatter returns one object per "
                   "device, each with all the keys.",
                   "チャンクをキーごとにまとめて返しています。scatter はデバイスごとに、すべてのキーを持つオブジェクトを"
                   "1つずつ返します。"),
    "empty_chunks": ("Some of your chunks have no rows, or their sizes differ from torch.chunk's. With fewer rows "
                     "than devices, the extra devices get nothing: leave them out.",
                     "行のないチャンクがあるか、チャンクの大きさが torch.chunk と違います。行がデバイスより少ないとき、"
                     "余ったデバイスには何も渡しません。リストから外してください。"),
    "non_tensor": ("A value that is not a tensor (a flag, a name, a number) is missing or changed: every device "
                   "gets it as it is.",
                   "テンソルでない値（フラグ、名前、数値）が欠けているか変わっています。どのデバイスにもそのまま"
                   "渡します。"),
})
def check_03_1(answer):
    """The check of exercise 03.1, "Scattering a batch". Explained in 03_primitives."""
    for batch, devices in _batches_03_1():
        got = call(answer, dict(batch), list(devices))
        expected = scatter(batch, devices)
        if _same_parts(got, expected):
            continue
        tensors = [k for k, v in batch.items() if isinstance(v, torch.Tensor)]
        plain = [k for k in batch if k not in tensors]
        if isinstance(got, dict):
            key = "transposed"
        elif isinstance(got, list) and all(isinstance(g, dict) for g in got) and got and \
                any(k not in g or g[k] != batch[k] for g in got for k in plain):
            key = "non_tensor"
        elif isinstance(got, list) and (len(got) != len(expected) or any(
                isinstance(g, dict) and isinstance(g.get(tensors[0]), torch.Tensor) and
                g[tensors[0]].shape[0] != e[tensors[0]].shape[0] for g, e in zip(got, expected))):
            key = "empty_chunks"
        else:
            key = None
        rows = batch[tensors[0]].shape[0]
        return wrong(tr(f"For a batch of {rows} rows on {len(devices)} devices you returned {_describe(got)}.",
                        f"{rows}行のバッチを {len(devices)}つのデバイスに分けたとき、あなたの関数は "
                        f"{_describe(got)} を返しました。"), key)
    return right(tr("Right for even, uneven and too-small batches, with non-tensor values.",
                    "割り切れるバッチ、割り切れないバッチ、小さすぎるバッチ、テンソルでない値を含む場合のすべてで正しい"
                    "答えです。"))


class TimeMix(nn.Module):
    """Mix each sequence over time (dim 0): splitting along time would change the result."""

    def forward(self, x):
        return x + x.mean(dim=0, keepdim=True)


class Seen(nn.Module):
    """Write down which module object ran and on how many sequences (dim 1)."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def forward(self, x):
        self.log.append((id(self), x.shape[1]))
        return x


def _case_03_2(log, batch):
    """The model (writing to ``log``) and the input of one case: the same in the kernel and in the worker."""
    torch.manual_seed(4)
    net = nn.Sequential(Seen(log), TimeMix(), nn.Linear(4, 3)).double()
    return net, torch.randn(5, batch, 4, dtype=torch.float64, requires_grad=True)


def _replicas_key(exc):
    return "too_many_replicas" if "parallel_apply" in str(exc) or "replica" in str(exc) else None


def _their_run_03_2(answer, batch, k):
    """Where the learner's code runs: their output, which module ran on how many sequences, and the gradients of
    the input and the parameters through their output (``None`` when it has none)."""
    log = []
    net, x = _case_03_2(log, batch)
    out = call(answer, net, x, ["cpu"] * k, 1, on_error=_replicas_key)
    seen, grads = list(log), None
    if isinstance(out, torch.Tensor) and out.grad_fn is not None and out.is_floating_point():
        with contextlib.suppress(RuntimeError):
            grads = [g.detach() for g in torch.autograd.grad(out.pow(2).mean(), [x, *net.parameters()])]
    return (out.detach() if isinstance(out, torch.Tensor) else out), seen, grads


@exercise("03.2", title=("data_parallel along another dimension", "別の次元に沿った data_parallel"), hints=[
    ("Start from this chapter's `data_parallel` and look at the `dim` argument that `scatter` and `gather` take.",
     "この章の `data_parallel` から始め、`scatter` と `gather` が受け取る引数 `dim` を見てください。"),
    ("Pass the same `dim` to both scatter and gather; keep the line that drops replicas without a chunk.",
     "同じ `dim` を scatter と gather の両方に渡します。チャンクのないレプリカを外す行も残します。"),
    ("Use the chapter's four primitives in order and give `dim` to the two that split and join; between them, "
     "keep only as many replicas as there are inputs.",
     "この章の 4つの基本操作を順に使い、分割と結合の 2つに `dim`"
     " を渡します。その間で、レプリカは入力の数だけ残します。"),
], mistakes={
    "wrong_dim": ("The batch was split along the wrong dimension: each replica saw part of every sequence in time. "
                  "Split and gather along `dim`.",
                  "バッチを違う次元で分けています。各レプリカが、どの系列についても時間の一部しか見ていません。"
                  "`dim` に沿って分割し、集約してください。"),
    "no_replicas": ("The same module object ran every chunk: replicate the module, one copy per device (on GPUs "
                    "each copy must live on its own device).",
                    "すべてのチャンクを同じモジュールのオブジェクトが実行しています。モジュールをデバイスごとに 1つずつ"
                    "複製してください（GPU では各コピーがそれぞれのデバイスに置かれている必要があります）。"),
    "too_many_replicas": ("parallel_apply got more replicas than chunks: with fewer sequences than devices, keep "
                          "only as many replicas as there are chunks.",
                          "parallel_apply にチャンクより多いレプリカを渡しています。系列がデバイスより少ないときは、"
                          "チャンクの数だけレプリカを残してください。"),
})
def check_03_2(answer):
    """The check of exercise 03.2, "data_parallel along another dimension". Explained in 03_primitives."""
    for batch, k in ((7, 3), (2, 4), (8, 4)):
        net, x = _case_03_2([], batch)
        out, seen, grads = in_worker(_their_run_03_2, answer, batch, k)
        mm = first_mismatch(out, net(x))
        if mm is not None:
            key = "wrong_dim" if isinstance(out, torch.Tensor) and any(n == batch for _, n in seen) and len(seen) > 1 \
                else None
            return wrong(mismatch_text(tr(f"Your output for {batch} sequences on {k} devices",
                                          f"{k}つのデバイスで {batch}系列を処理したあなたの出力"), mm), key)
        if len({i for i, _ in seen}) < len(seen) or len(seen) < min(batch, k):
            return wrong(tr(f"The modules that ran: {len({i for i, _ in seen})} distinct objects for {len(seen)} "
                            "chunks.", f"実行したモジュール: {len(seen)}個のチャンクに対して、異なるオブジェクトは "
                            f"{len({i for i, _ in seen})}個。"), "no_replicas")
        if grads is None:
            return wrong(tr("Your output is right but carries no gradient: it must stay connected to the model and "
                            "the input (no .detach(), no torch.no_grad()).",
                            "出力の値は正しいのですが、勾配がありません。モデルと入力につながったままにしてください"
                            "（.detach() や torch.no_grad() は使いません）。"))
        expected = torch.autograd.grad(net(x).pow(2).mean(), [x, *net.parameters()])
        for g, e in zip(grads, expected):
            mm = first_mismatch(g, e, rtol=1e-9, atol=1e-12)
            if mm is not None:
                return wrong(mismatch_text(tr("A gradient", "勾配"), mm))
    return right(tr("Same outputs and gradients as one call, with one replica per chunk, for even, uneven and "
                    "too-small batches.",
                    "割り切れるバッチ、割り切れないバッチ、小さすぎるバッチのすべてで、チャンクごとに 1つのレプリカを使い、"
                    "1回の呼び出しと同じ出力と勾配になりました。"))


def _cases_03_3():
    rng = random.Random(303)
    fixed = [[6, 6, 6, 5], [3, 3, 3, 1], [4, 4], [1], [13, 13, 12]]
    return fixed + [[rng.randint(1, 20) for _ in range(rng.randint(2, 6))] for _ in range(10)]


@exercise("03.3", title=("One loss from chunk losses", "チャンクの損失から 1つの損失へ"), hints=[
    ("Look at the proof section: the loss is the mean over the gathered output, i.e. over all rows.",
     "証明の節を見てください。損失は集約した出力、つまりすべての行についての平均です。"),
    ("A chunk's mean loss stands for as many rows as the chunk has: weight it by its size, and divide by the "
     "total number of rows.",
     "チャンクの平均損失は、そのチャンクの行数分の行を代表します。大きさで重み付けし、全体の行数で割ってください。"),
    ("Turn each chunk's mean back into that chunk's sum (its size times its mean), add them up and divide by "
     "the total number of rows, all with tensor operations.",
     "各チャンクの平均を、大きさを掛けてそのチャンクの合計に戻し、それらを足して全体の行数で割ります。すべてテンソルの演算で行います。"),
], mistakes={
    "mean_of_means": ("You averaged the chunk means. That is right only when all chunks have the same size; the "
                      "last chunk is often smaller.",
                      "チャンクの平均をさらに平均しています。それが正しいのはすべてのチャンクが同じ大きさのときだけで、"
                      "最後のチャンクは小さいことがよくあります。"),
    "sum_of_means": ("You added the chunk means: that is about k times the full-batch loss (and k times its "
                     "gradient).",
                     "チャンクの平均を足し合わせています。これは全体のバッチの損失のおよそ k倍です（勾配も k倍）。"),
    "not_divided": ("You weighted the chunks by their sizes but did not divide by the number of rows.",
                    "チャンクを大きさで重み付けしていますが、全体の行数で割っていません。"),
    "detached": ("Your loss has no gradient: build it with tensor operations (no float(), .item() or .detach()).",
                 "損失に勾配がありません。テンソルの演算で作ってください（float()、.item()、.detach() は使いません）。"),
})
def check_03_3(answer):
    """The check of exercise 03.3, "One loss from chunk losses". Explained in 03_primitives."""
    torch.manual_seed(5)
    for sizes in _cases_03_3():
        rows = torch.randn(sum(sizes), dtype=torch.float64).pow(2)
        chunks = list(rows.split(sizes))
        means = [c.mean().requires_grad_() for c in chunks]
        got = call(answer, means, list(sizes))
        expected = rows.mean()
        if isinstance(got, torch.Tensor) and got.numel() == 1 and torch.isclose(got.double(), expected):
            if not got.requires_grad:
                return wrong(tr("Your loss is right but cannot be differentiated.",
                                "損失の値は正しいのですが、微分できません。"), "detached")
            continue
        value = float(got.detach()) if isinstance(got, torch.Tensor) and got.numel() == 1 else \
            float(got) if isinstance(got, (float, int)) else None
        means_f = [m.item() for m in means]
        key = None
        if value is not None:
            if abs(value - sum(means_f) / len(means_f)) < 1e-9:
                key = "mean_of_means"
            elif abs(value - sum(means_f)) < 1e-9:
                key = "sum_of_means"
            elif abs(value - expected.item() * sum(sizes)) < 1e-6:
                key = "not_divided"
        return wrong(tr(f"For chunks of sizes {sizes} your loss is {value if value is not None else got!r}.",
                        f"大きさ {sizes} のチャンクに対して、あなたの損失は {value if value is not None else got!r} "
                        "です。"), key)
    return right(tr("Your loss equals the full-batch mean for every split, and backward works.",
                    "どの分け方でも全体のバッチの平均と等しく、逆伝播もできます。"))
