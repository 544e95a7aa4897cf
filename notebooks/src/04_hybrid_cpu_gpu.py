# %% [markdown]
# <!-- en -->
# # 4. Hybrid CPU/GPU models and model parallelism
#
# Data parallelism copies the whole model to every device. Sometimes the model itself should be spread out
# instead: a huge embedding table that does not fit in GPU memory stays in host memory while the layers after it
# run on the GPU, or a network too big for one GPU is cut into stages on several GPUs. This chapter
#
# 1. reproduces an example from PyTorch's early multi-GPU tutorial, a model half on the CPU and half on the GPU,
#    which no longer runs on today's PyTorch, and fixes it;
# 2. measures what the split costs: host-to-device copies, pageable and pinned memory, `non_blocking`;
# 3. works out when keeping an embedding table on the CPU pays;
# 4. goes beyond the example: a model split across two devices (model parallelism) and fed in micro-batches
#    so that both devices work at the same time (pipeline parallelism), with a proof that the split model
#    computes exactly what the unsplit one does.
# <!-- ja -->
# # 4. CPU と GPU にまたがるモデルとモデル並列
#
# データ並列では、モデル全体をすべてのデバイスに複製します。しかし、モデルそのものを分けて置きたい場面もあります。GPU メモリに収まらない巨大な埋め込みテーブルはホスト（CPU）メモリに残し、その後ろの層だけを GPU で計算する場合や、1枚の GPU に載らないネットワークを段（ステージ）に切って複数の GPU に置く場合です。この章では次のことを扱います。
#
# 1. PyTorch の初期のマルチ GPU チュートリアルにある、半分が CPU、半分が GPU にあるモデルの例を再現します。この例は今の PyTorch では動かないので、直します。
# 2. 分割のコストを測ります。ホストからデバイスへの転送、ページング可能メモリとピン留めメモリ（pinned memory）、`non_blocking` です。
# 3. 埋め込みテーブルを CPU に置くと得をするのはどんなときかを計算します。
# 4. 例の先に進みます。モデルを 2つのデバイスに分け（モデル並列）、マイクロバッチに分けて流すことで両方のデバイスを同時に働かせます（パイプライン並列）。分割したモデルが分割前のモデルとまったく同じ計算をすることも確かめます。

# %% tags=["nbval-ignore-output"]
import time
from statistics import median

import matplotlib.pyplot as plt
import torch
from torch import nn

import mparlib
import mparlib.plot

mparlib.plot.use_course_style()  # a font with Japanese glyphs for this notebook's figures
from mparlib.lang import tr
from mparlib.hybrid import HybridEmbeddingModel, PipelineModel, pipeline_schedule
from mparlib.timing import synchronize

print(mparlib.report())
print(mparlib.profile_line())

# %%
PROFILE = mparlib.profile()
assert PROFILE in ("smoke", "full")
device = mparlib.try_gpu()  # cuda:0 if there is a GPU, else the CPU

# %% tags=["nbval-ignore-output"]
if device.type == "cuda":
    print(tr(f"The embedding table stays on the CPU; the layer after it runs on {device}.",
             f"埋め込みテーブルは CPU に置き、その後ろの層は {device} で計算します。"))
else:
    print(tr("No GPU here: the part meant for the GPU runs on the CPU as well. The code is the same, "
             "but there is no host-to-device copy to pay for.",
             "GPU がないため、GPU に置くはずの部分も CPU で計算します。コードは同じですが、"
             "ホストからデバイスへの転送は発生しません。"))

# %% [markdown]
# <!-- en -->
# ## The example as it was written
#
# The example is a small network: an embedding layer that should stay on the CPU, then a layer that should run
# on the GPU, with the activation copied from one to the other inside `forward`. It registers its two layers by
# passing them as keyword arguments to the base class constructor, `nn.Module.__init__(embedding=..., ...)`.
# That style comes from early PyTorch's `nn.Container`, whose constructor registered its keyword arguments as
# submodules (it is deprecated now); `nn.Module.__init__` takes no submodules. The cell below
# writes a model in that style (moving the second layer to `device`, so it runs anywhere); building it fails with
# a `TypeError` before any tensor is touched, and the cell prints the error:
# <!-- ja -->
# ## 書かれたままの例
#
# 例として取り上げるのは小さなネットワークです。CPU に置いておきたい埋め込み層と、GPU で計算したい層が並び、`forward` の中で活性化を一方から他方へ転送します。この例は 2つの層を基底クラスのコンストラクタにキーワード引数として渡して登録しています（`nn.Module.__init__(embedding=..., ...)`）。この書き方は初期の PyTorch の `nn.Container` に由来します。そのコンストラクタはキーワード引数をサブモジュールとして登録していました（現在は非推奨です）。一方、`nn.Module.__init__` はサブモジュールを受け取りません。次のセルはこの書き方でモデルを作ります（どのマシンでも動くように、2つめの層は `device` に移します）。モデルを作る段階で、テンソルに触れる前に `TypeError` が出ます。セルはそのエラーを表示します。

# %%
class KeywordModel(nn.Module):
    """Submodules handed to nn.Module.__init__ as keyword arguments: the pattern that fails today."""

    def __init__(self, device):
        super().__init__(
            embedding=nn.Embedding(1000, 10),  # meant to stay on the CPU
            linear=nn.Linear(10, 10).to(device),  # meant to run on the GPU
        )

    def forward(self, ids):
        return self.linear(self.embedding(ids).to(self.linear.weight.device))


try:
    model = KeywordModel(device)
    raise AssertionError("nn.Module.__init__ accepted submodules as keyword arguments")
except TypeError as err:
    print(f"TypeError: {err}")
    assert "unexpected keyword argument 'embedding'" in str(err)

# %% [markdown]
# <!-- en -->
# ## A working version
#
# A module registers a submodule when it is assigned as an attribute: `self.embedding = nn.Embedding(...)`.
# `nn.Module.__setattr__` sees a module and stores it in the module's list of children, so `parameters()`,
# `state_dict()` and `.to()` find it. The fixed model does exactly that, keeps the embedding where it was
# created (the CPU), moves only the linear layer, and copies the looked-up rows to the linear layer's device:
# <!-- ja -->
# ## 動くように直した版
#
# サブモジュールは、属性として代入したときに登録されます（`self.embedding = nn.Embedding(...)`）。`nn.Module.__setattr__` は代入された値がモジュールであることを見て子モジュールの一覧に加えるので、`parameters()`、`state_dict()`、`.to()` から見えるようになります。直したモデルはこのとおりに書き、埋め込みは作った場所（CPU）に置いたまま、線形層だけを移します。`forward` では、参照した行だけを線形層のデバイスへ転送します。

# %%
class HybridModel(nn.Module):
    """An embedding table on the CPU, a linear layer on `device`."""

    def __init__(self, device, num_embeddings=1000, dim=10):
        super().__init__()
        self.device = device
        self.embedding = nn.Embedding(num_embeddings, dim)  # created on the CPU and left there
        self.linear = nn.Linear(dim, dim).to(device)

    def forward(self, ids):  # ids: (batch,) integers on the CPU
        x = self.embedding(ids)  # (batch, dim) on the CPU
        x = x.to(self.device)  # host-to-device copy of the rows that were looked up
        return self.linear(x)  # (batch, dim) on `device`


torch.manual_seed(0)
model = HybridModel(device)
ids = torch.tensor([1, 42, 42, 999])
out = model(ids)
print(tr("children:", "子モジュール:"), [name for name, _ in model.named_children()])
print(tr("output shape:", "出力の形状:"), tuple(out.shape))

# %% tags=["nbval-ignore-output"]
print(tr("embedding weight on", "埋め込みの重み:"), model.embedding.weight.device)
print(tr("linear weight on   ", "線形層の重み:  "), model.linear.weight.device)
print(tr("output on          ", "出力:          "), out.device)

# %% [markdown]
# <!-- en -->
# Autograd follows the copy backwards: the gradient of the output arrives on `device`, flows through the linear
# layer there, is copied back to the CPU and reaches the embedding table on the CPU.
# <!-- ja -->
# 自動微分は転送も逆向きにたどります。出力の勾配は `device` 上で線形層を通り、CPU に転送されて、CPU 上の埋め込みテーブルに届きます。

# %%
out.square().mean().backward()
assert model.embedding.weight.device.type == "cpu"
assert model.linear.weight.device == device and out.device == device
assert model.embedding.weight.grad.device.type == "cpu"
assert model.linear.weight.grad.device == device
touched = model.embedding.weight.grad.abs().sum(dim=1).nonzero().flatten().tolist()
print(tr("table rows with a nonzero gradient:", "勾配がゼロでない行:"), touched)

# %% [markdown]
# <!-- en -->
# The course package holds the same model as `mparlib.hybrid.HybridEmbeddingModel`, with clear errors for
# wrong ids and an option for sparse gradients (used below). Loaded with the same weights, it computes the same
# thing:
# <!-- ja -->
# コースのパッケージには同じモデルが `mparlib.hybrid.HybridEmbeddingModel` として入っています。不正な ID に対してわかりやすいエラーを出すことと、疎な勾配を選べること（後で使います）が違いです。同じ重みを読み込めば、同じ計算をします。

# %%
packaged = HybridEmbeddingModel(1000, 10, device=device)
packaged.load_state_dict(model.state_dict())
assert torch.equal(packaged(ids), model(ids))
assert packaged.embedding.weight.device.type == "cpu" and packaged.linear.weight.device == device

# %% [markdown]
# <!-- en -->
# One trap: `model.to(device)` moves *every* parameter, the table included, and the split is gone. Move the
# parts you mean to move, as the constructor does.
#
# ## What the split costs: host-to-device copies
#
# Every forward pass now copies the looked-up rows from host memory to the GPU, and the backward pass copies
# their gradient back. How long does a copy take? It depends on the size and on the kind of host memory:
#
# - **Pageable memory** is what `torch.empty`, `torch.randn` and friends allocate. The operating system may move
#   such pages, so the GPU's copy engine cannot read them directly: the driver first copies the data into a
#   pinned staging buffer, then from there to the GPU.
# - **Pinned (page-locked) memory**, from `tensor.pin_memory()` or `DataLoader(pin_memory=True)`, stays put, so
#   the copy engine reads it directly (DMA).
# - `tensor.to(device, non_blocking=True)` from pinned memory only *queues* the copy and returns at once, so the
#   CPU can prepare the next batch while the copy runs. From pageable memory the call still waits for the data
#   to be staged.
#
# The measurement below times `src.to(device, copy=True)` for sizes from 4 KiB upwards. It records two times per
# copy: when the call returned, and when the copy had really finished (after synchronising). Pinning needs a
# CUDA driver (`pin_memory()` raises an error without one), so those rows are measured only where CUDA exists. On
# a machine without a GPU there is no host-to-device copy at all; the cell measures a CPU-to-CPU copy instead, as a
# baseline for the cost of moving bytes.
# <!-- ja -->
# 落とし穴が 1つあります。`model.to(device)` は、テーブルも含めてすべてのパラメータを移してしまい、分割が消えます。コンストラクタのように、移したい部分だけを移してください。
#
# ## 分割のコスト: ホストからデバイスへの転送
#
# このモデルでは、順伝播のたびに参照した行をホストメモリから GPU へ転送し、逆伝播ではその勾配を送り返します。転送にはどれくらい時間がかかるのでしょうか。答えはサイズと、ホストメモリの種類によって変わります。
#
# - **ページング可能メモリ**は、`torch.empty` や `torch.randn` などが確保するふつうのメモリです。OS がページを動かすことがあるので、GPU のコピーエンジンは直接読めません。ドライバはまずデータをピン留めされた中継用バッファにコピーし、そこから GPU へ送ります。
# - **ピン留めメモリ**（pinned memory、ページロックされたメモリ）は `tensor.pin_memory()` や `DataLoader(pin_memory=True)` で得られ、物理的な位置が固定されています。そのためコピーエンジンが直接読めます（DMA）。
# - ピン留めメモリからの `tensor.to(device, non_blocking=True)` は転送をキューに積むだけで、すぐに戻ります。転送している間に CPU は次のバッチを準備できます。ページング可能メモリからだと、データを中継用バッファに移し終えるまで呼び出しは戻りません。
#
# 次の計測では、4 KiB から始まるいくつかのサイズで `src.to(device, copy=True)` の時間を測ります。1回の転送について、呼び出しが戻った時刻と、（同期したうえで）転送が本当に終わった時刻の 2つを記録します。ピン留めには CUDA ドライバが必要なので（ドライバがないと `pin_memory()` はエラーになります）、その行は CUDA がある場合だけ測ります。GPU のないマシンではホストからデバイスへの転送そのものがありません。代わりに CPU から CPU へのコピーを測り、バイトを動かすコストの目安にします。

# %% tags=["nbval-ignore-output"]
SIZES = [4 * 2**10 * 4**k for k in range(6 if PROFILE == "smoke" else 9)]  # 4 KiB ... 4 MiB (smoke) / 256 MiB
REPEATS = 5 if PROFILE == "smoke" else 10


def copy_times(src, device, non_blocking, repeats=REPEATS):
    """Median seconds until `src.to(device)` returns, and until the copy has finished; also the last copy."""
    returned, finished = [], []
    for r in range(repeats + 1):  # the first run warms up (allocator, driver)
        synchronize(device)
        t0 = time.perf_counter()
        dst = src.to(device, non_blocking=non_blocking, copy=True)
        t1 = time.perf_counter()
        synchronize(device)  # wait for the copy itself (a no-op on the CPU)
        t2 = time.perf_counter()
        if r:
            returned.append(t1 - t0)
            finished.append(t2 - t0)
    return median(returned), median(finished), dst


modes = [("pageable", False, False), ("pageable, non_blocking", False, True)]  # (name, pinned, non_blocking)
if torch.cuda.is_available():
    modes += [("pinned", True, False), ("pinned, non_blocking", True, True)]
else:
    print(tr("No CUDA: measuring CPU-to-CPU copies instead; pinned memory is skipped.",
             "CUDA がないため、代わりに CPU から CPU へのコピーを測ります。ピン留めメモリは測りません。"))

def mode_name(mode):
    """How the table and the figure name a mode, in the notebook's language."""
    return (mode.replace("pageable", tr("pageable", "ページング可能")).replace("pinned", tr("pinned", "ピン留め"))
            .replace(", ", tr(", ", "、")))


copies = []  # one row per (mode, size)
for mode, pinned, non_blocking in modes:
    for nbytes in SIZES:
        src = torch.rand(nbytes // 4)  # float32: 4 bytes per number
        if pinned:
            src = src.pin_memory()
        returned, finished, dst = copy_times(src, device, non_blocking)
        copies.append(dict(mode=mode, bytes=nbytes, returned=returned, finished=finished,
                           equal=torch.equal(dst.cpu(), src), pinned=src.is_pinned()))

print(tr(f"{'size':>11}{'returned':>12}{'finished':>12}{'GB/s':>8}  mode",
         "     サイズ    戻るまで    完了まで    GB/s  方式"))
for c in copies:
    print(f"{c['bytes'] / 2**10:>7.0f} KiB{c['returned'] * 1e6:>9.1f} us{c['finished'] * 1e6:>9.1f} us"
          f"{c['bytes'] / c['finished'] / 1e9:>8.2f}  {mode_name(c['mode'])}")

# %%
assert len(copies) == len(modes) * len(SIZES)
assert all(c["equal"] for c in copies), "every copy holds the source's values"
assert all(0 < c["returned"] <= c["finished"] for c in copies)
assert all(c["pinned"] == ("pinned" in c["mode"]) for c in copies)
for mode, _, _ in modes:
    rows = [c for c in copies if c["mode"] == mode]
    assert rows[-1]["finished"] > rows[0]["finished"], f"{mode}: 4 MiB or more takes longer than 4 KiB"

# %% tags=["nbval-ignore-output"]
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
for (mode, _, _), fmt in zip(modes, ["o-", "s--", "^-", "v--"]):
    rows = [c for c in copies if c["mode"] == mode]
    kib = [c["bytes"] / 2**10 for c in rows]
    label = mode_name(mode)
    axes[0].plot(kib, [c["bytes"] / c["finished"] / 1e9 for c in rows], fmt, label=label)
    axes[1].plot(kib, [c["returned"] * 1e6 for c in rows], fmt, label=label)
axes[0].set_title(tr(f"Copy to {device}: bandwidth", f"{device} への転送: 帯域幅"))
axes[0].set_ylabel(tr("GB/s (until finished)", "GB/s（転送完了まで）"))
axes[1].set_title(tr("Time until .to() returns", ".to() が戻るまでの時間"))
axes[1].set_ylabel(tr("microseconds", "マイクロ秒"))
for ax in axes:
    ax.set_xscale("log", base=2)
    ax.set_xticks([n / 2**10 for n in SIZES], [f"{n // 2**10} KiB" if n < 2**20 else f"{n // 2**20} MiB" for n in SIZES],
                  fontsize=8)
    ax.set_xlabel(tr("copy size", "転送サイズ"))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
axes[1].set_yscale("log")
fig.tight_layout()
plt.show()

# %% [markdown]
# <!-- en -->
# How to read the figure (your numbers are in the table above; they depend on the machine):
#
# - Small copies are dominated by a fixed cost per call, so their bandwidth is low; only large copies approach
#   what the bus can carry. Many small copies cost more than one large copy of the same bytes.
# - On a GPU machine, pinned memory usually reaches a higher bandwidth than pageable memory, which pays for the
#   extra staging copy.
# - With `pinned, non_blocking` the right panel shows the call returning long before the copy is done: that is
#   the time the CPU gets back. With `pageable, non_blocking` it does not.
# - On a CPU-only machine both curves of a panel measure the same thing (`non_blocking` has no effect on a
#   CPU-to-CPU copy), and the pinned rows are absent.
#
# A caution with `non_blocking=True`: until the copy has finished, the source must not be overwritten and the
# result must not be read from the CPU. PyTorch orders the copy before later GPU work on the same stream, so
# using `dst` on the GPU is safe; reading it from the host needs a synchronisation first.
# <!-- ja -->
# 図の読み方は次のとおりです（数値は上の表にあり、マシンによって変わります）。
#
# - 小さな転送は 1回ごとの固定コストが大半を占めるので、帯域幅は低くなります。バスの能力に近づくのは大きな転送だけです。同じバイト数なら、小さな転送を何回も行うより 1回の大きな転送のほうが安く済みます。
# - GPU のあるマシンでは、ピン留めメモリのほうがページング可能メモリより高い帯域幅が出るのがふつうです。中継用バッファへの余分なコピーがないからです。
# - 「ピン留め、non_blocking」では、右の図で呼び出しが転送の完了よりずっと早く戻ります。この差が CPU に返ってくる時間です。「ページング可能、non_blocking」ではそうなりません。
# - GPU のないマシンでは、同じ図の 2本の曲線は同じものを測っています（CPU から CPU へのコピーに `non_blocking` は効きません）。ピン留めメモリの行はありません。
#
# `non_blocking=True` には注意点があります。転送が終わるまでは、転送元を書き換えてはいけませんし、結果を CPU から読んでもいけません。PyTorch は同じストリーム上の後続の GPU の処理を転送の後に並べるので、`dst` を GPU で使うのは安全です。ホストから読むときは、先に同期が必要です。

# %% [markdown]
# <!-- en -->
# ## When does keeping a huge embedding table on the CPU pay?
#
# An embedding table is large, but each step touches only a few of its rows. Take a table of 10 million rows of
# 256 float32 numbers and a batch of 4,096 ids:
# <!-- ja -->
# ## 巨大な埋め込みテーブルを CPU に置いて得をする条件
#
# 埋め込みテーブルは大きくても、1ステップで参照するのはごく一部の行だけです。256個の float32 からなる行が 1,000万行あるテーブルと、4,096個の ID からなるバッチで考えます。

# %%
GiB, MiB = 2**30, 2**20
rows, dim, fp32 = 10_000_000, 256, 4
batch = 4096
table = rows * dim * fp32
moved = batch * dim * fp32  # looked-up rows, one way
lines = [
    (tr("table", "テーブル"), f"{rows:,} x {dim} x {fp32} B = {table / GiB:.2f} GiB"),
    (tr("table + dense gradient", "テーブル + 密な勾配"), f"{2 * table / GiB:.2f} GiB"),
    (tr("... + Adam's two moments", "... + Adam の 2つのモーメント"), f"{4 * table / GiB:.2f} GiB"),
    (tr("rows moved per step, each way", "1ステップで片道に運ぶ行"),
     f"{batch:,} x {dim} x {fp32} B = {moved / MiB:.0f} MiB"),
    (tr("share of the table", "テーブルに占める割合"), f"{moved / table:.3%}"),
]
for label, value in lines:
    print(f"{label}: {value}")


# %% [markdown]
# <!-- en -->
# Trained with Adam and a dense gradient, this table alone needs about 38 GiB of device memory, and the rest of
# the model has to fit in what is left; on the CPU it costs host memory, which is larger and cheaper. The price is the traffic: each
# step moves 4 MiB to the device and 4 MiB of gradient back. At the bandwidth measured above, that takes:
# <!-- ja -->
# Adam と密な勾配で訓練すると、このテーブルだけで 38 GiB ほどのデバイスメモリを使い、残りのモデルはその残りに収めなければなりません。CPU に置けばホストメモリを使うことになり、こちらのほうが大きく安価です。代わりに払うのが転送です。1ステップごとに 4 MiB をデバイスへ送り、4 MiB の勾配を送り返します。上で測った帯域幅では、次の時間がかかります。

# %% tags=["nbval-ignore-output"]
best = max(copies, key=lambda c: c["bytes"] / c["finished"])
bandwidth = best["bytes"] / best["finished"]
print(tr(f"best measured bandwidth ({best['mode']}, {best['bytes'] // 2**10} KiB copies): {bandwidth / 1e9:.2f} GB/s",
         f"測定した最高の帯域幅（{mode_name(best['mode'])}、{best['bytes'] // 2**10} KiB の転送）: {bandwidth / 1e9:.2f} GB/s"))
ms = 2 * moved / bandwidth * 1e3
print(tr(f"moving {moved // MiB} MiB there and {moved // MiB} MiB back: about {ms:.2f} ms per step",
         f"{moved // MiB} MiB を送り {moved // MiB} MiB を戻す時間: 1ステップあたり約 {ms:.2f} ms"))

# %% [markdown]
# <!-- en -->
# So the CPU table pays when (1) the table, its gradient and optimiser state would not fit in device memory or
# would crowd out the rest of the model, and (2) the rows touched per step are few, so the copy time above is
# small next to the step's compute. It does not pay for a small table that fits easily: then the copy is pure
# overhead. Two more things decide it:
#
# - **The update must be sparse too.** A dense gradient for the table is as large as the table, and an optimiser
#   step over all 10 million rows on the CPU would dwarf everything else. With `nn.Embedding(..., sparse=True)` the
#   gradient holds only the looked-up rows, and `torch.optim.SGD` (or `SparseAdam`) updates only them.
# - **The CPU does the lookup and the update**, so it needs cores and memory bandwidth to spare.
#
# Large recommender systems go further and shard tables across the memory of many GPUs, but the arithmetic above
# is the first question to ask. Here is the sparse gradient at work, with the course's model:
# <!-- ja -->
# まとめると、CPU にテーブルを置いて得をするのは、(1) テーブルとその勾配、オプティマイザの状態がデバイスメモリに収まらないか、残りのモデルの場所を圧迫するとき、かつ (2) 1ステップで触れる行が少なく、上の転送時間がステップの計算時間に比べて小さいときです。楽に収まる小さなテーブルなら得はありません。転送がまるごと余計な手間になるだけです。さらに次の 2点も効いてきます。
#
# - **更新も疎にする必要があります。** テーブルの密な勾配はテーブルと同じ大きさで、1,000万行すべてに CPU でオプティマイザのステップを適用すると、他のすべての処理をかすませるほど時間がかかります。`nn.Embedding(..., sparse=True)` にすれば勾配は参照した行だけを持ち、`torch.optim.SGD`（または `SparseAdam`）はその行だけを更新します。
# - **参照と更新は CPU が行います。** そのため CPU のコアとメモリ帯域に余裕が必要です。
#
# 大規模な推薦システムでは、さらに進んでテーブルを多数の GPU のメモリに分割して置きますが、最初に考えるべきなのは上のような計算です。コースのモデルで疎な勾配の動きを見てみます。

# %%
torch.manual_seed(0)
emb_rows = 100_000
dense = HybridEmbeddingModel(emb_rows, 64, device=device)
sparse = HybridEmbeddingModel(emb_rows, 64, device=device, sparse=True)
sparse.load_state_dict(dense.state_dict())
ids = torch.randint(emb_rows, (512,))
for m in (dense, sparse):
    m(ids).square().mean().backward()
g_dense, g_sparse = dense.embedding.weight.grad, sparse.embedding.weight.grad.coalesce()
n_dense, n_rows, n_sparse = g_dense.numel(), g_sparse.indices().shape[1], g_sparse.values().numel()
print(tr(f"dense gradient:  {tuple(g_dense.shape)} {n_dense:,} numbers",
         f"密な勾配: {tuple(g_dense.shape)} {n_dense:,}個の値"))
print(tr(f"sparse gradient: {n_rows} rows x {g_sparse.shape[1]} = {n_sparse:,} numbers",
         f"疎な勾配: {n_rows}行 x {g_sparse.shape[1]} = {n_sparse:,}個の値"))

# %%
assert g_dense.shape == (emb_rows, 64)
assert g_sparse.indices().shape[1] == len(ids.unique())
torch.testing.assert_close(g_sparse.to_dense(), g_dense)
before = sparse.embedding.weight.detach().clone()
torch.optim.SGD(sparse.parameters(), lr=0.1).step()
changed = (sparse.embedding.weight != before).any(dim=1)
assert torch.equal(changed.nonzero().flatten(), ids.unique()), "only the looked-up rows were updated"

# %% [markdown]
# <!-- en -->
# ## Beyond the example: model parallelism
#
# The hybrid model is a special case of **model parallelism**: different layers on different devices. The
# general form cuts a network into *stages*, puts stage *s* on device *s*, and passes activations from one device
# to the next. It lets you train a model that fits on no single device. But done naively it wastes the hardware:
# while device 1 works on the batch, device 0 waits, and the other way round.
#
# **Pipeline parallelism** fixes that by cutting the batch into *micro-batches*, numbered from 0 like the devices.
# As soon as stage 0 has finished micro-batch 0 and handed it on, it starts micro-batch 1 while stage 1 works on
# micro-batch 0. The function
# `pipeline_schedule(num_stages, micro_batches)` lists this order as `(tick, stage, micro-batch)`; at tick *t*,
# stage *s* works on micro-batch *t - s*. Drawn with each stage taking the same time:
# <!-- ja -->
# ## 例の先へ: モデル並列
#
# CPU と GPU にまたがるモデルは、**モデル並列**（層ごとに違うデバイスに置くこと）の特別な場合です。一般には、ネットワークを段（ステージ）に切り、ステージ *s* をデバイス *s* に置いて、活性化をデバイスからデバイスへ渡していきます。こうすると 1つのデバイスには載らないモデルも訓練できます。ただし素朴に実装するとハードウェアが遊びます。デバイス 1 がバッチを計算している間はデバイス 0 が待ち、その逆も同じです。
#
# **パイプライン並列**は、バッチを**マイクロバッチ**に切ることでこれを解決します（番号はデバイスと同じく 0 から数えます）。ステージ 0 はマイクロバッチ 0 を計算して次に渡したら、すぐにマイクロバッチ 1 に取りかかり、その間にステージ 1 がマイクロバッチ 0 を計算します。関数 `pipeline_schedule(num_stages, micro_batches)` はこの順序を `(tick, stage, micro-batch)` の組で返します。時刻 *t* にステージ *s* が計算するのはマイクロバッチ *t - s* です。どのステージも同じ時間がかかるとして図にすると、次のようになります。

# %%
def draw_schedule(ax, num_stages, micro_batches, title):
    """Gantt chart of pipeline_schedule: one row per device; time 1 = one stage on the whole batch."""
    width = 1 / micro_batches  # a micro-batch takes 1/m of the time of the whole batch
    for tick, stage, i in pipeline_schedule(num_stages, micro_batches):
        ax.broken_barh([(tick * width, width)], (stage - 0.4, 0.8), facecolors=f"C{i}", edgecolor="black")
        ax.text((tick + 0.5) * width, stage, str(i), ha="center", va="center")
    end = (num_stages + micro_batches - 1) * width
    ax.axvline(end, color="black", linestyle=":")
    ax.set_yticks(range(num_stages), [tr(f"device {s}", f"デバイス {s}") for s in range(num_stages)])
    ax.set_ylim(num_stages - 0.5, -0.5)
    ax.set_xlim(0, num_stages + 0.1)
    ax.set_title(title, fontsize=10)
    return end


fig, axes = plt.subplots(2, 1, figsize=(8, 3.6), sharex=True)
t_naive = draw_schedule(axes[0], 2, 1, tr("No pipelining: one device works at a time",
                                          "パイプラインなし: 動いているデバイスは常に 1つ"))
t_pipe = draw_schedule(axes[1], 2, 4, tr("4 micro-batches: both devices work at once",
                                         "マイクロバッチ 4個: 2つのデバイスが同時に動く"))
axes[1].set_xlabel(tr("time (1 = one stage on the whole batch); numbers: micro-batch",
                      "時間（1 = 1ステージがバッチ全体を処理する時間）、数字: マイクロバッチ"))
fig.tight_layout()
plt.show()
print(tr(f"forward pass: {t_naive:.2f} without pipelining, {t_pipe:.2f} with 4 micro-batches",
         f"順伝播の時間: パイプラインなしで {t_naive:.2f}、マイクロバッチ 4個で {t_pipe:.2f}"))

# %% [markdown]
# <!-- en -->
# With *S* stages of equal cost and *m* micro-batches, a forward pass takes *(m + S - 1) / m* time units instead
# of *S*. The gap at the start and the end, when some devices idle, is the **pipeline bubble**: a fraction
# *(S - 1) / (m + S - 1)* of the time. More micro-batches shrink the bubble, but each micro-batch is smaller and
# uses a GPU less efficiently, so in practice *m* is a few times *S*. The figure shows the forward pass; GPipe-style
# training runs the backward pass the same way in reverse order, and the optimizer steps once per batch, after
# the gradients of all micro-batches have been summed.
# <!-- ja -->
# 計算量の等しい *S* 個のステージと *m* 個のマイクロバッチでは、順伝播にかかる時間は *S* ではなく *(m + S - 1) / m* になります。最初と最後にどれかのデバイスが遊んでいる部分を**パイプラインバブル**と呼び、その割合は *(S - 1) / (m + S - 1)* です。マイクロバッチを増やすとバブルは縮みますが、1つのマイクロバッチが小さくなって GPU の効率が落ちるので、実際には *m* を *S* の数倍にするのがふつうです。図は順伝播だけを示しています。GPipe 方式の訓練では逆伝播も同じように逆順で流し、すべてのマイクロバッチの勾配を足し合わせた後に、バッチごとに 1回だけオプティマイザのステップを実行します。

# %%
S = 2
for m in (1, 2, 4, 8):
    ticks = 1 + max(t for t, _, _ in pipeline_schedule(S, m))
    units, bubble, speed_up = ticks / m, (S - 1) / (m + S - 1), S * m / (m + S - 1)
    print(tr(f"S={S} m={m}: time {units:.3f}, bubble {bubble:.0%}, ideal speed-up {speed_up:.2f}x",
             f"S={S} m={m}: 時間 {units:.3f}、バブル {bubble:.0%}、理想的な速度向上 {speed_up:.2f}x"))
    assert ticks == m + S - 1

# %% [markdown]
# <!-- en -->
# ### The pipelined forward pass in code
#
# The loop below is all there is to it: walk through the ticks, and at each tick let every stage that has work
# process its micro-batch, copying the activation to the stage's device first. Later stages are issued first
# within a tick, because their input is already waiting from the previous tick.
#
# On GPUs this simple loop really runs the stages at the same time, because a CUDA call only *queues* work on its
# device and returns. The Python loop races ahead, queuing stage 0's next micro-batch on GPU 0 while GPU 1 is still
# busy with the previous one; the copy between GPUs waits for its input by itself. On a CPU every call finishes
# before the next one starts, so the same code runs the stages one after the other.
# <!-- ja -->
# ### パイプライン化した順伝播のコード
#
# 必要なのは次のループだけです。時刻を 1つずつ進め、各時刻で仕事のあるステージがそれぞれのマイクロバッチを処理します。その前に、活性化をそのステージのデバイスへ転送します。1つの時刻の中では後ろのステージから先に発行します。その入力は前の時刻にもう用意できているからです。
#
# GPU ではこの単純なループで本当にステージが同時に動きます。CUDA の呼び出しは自分のデバイスに処理をキューとして積むだけで、すぐに戻るからです。Python のループはどんどん先に進み、GPU 1 が前のマイクロバッチを計算している間に、GPU 0 にステージ 0 の次のマイクロバッチを積みます。GPU 間の転送は、入力ができるまで自動的に待ちます。CPU では呼び出しが終わるまで次に進まないので、同じコードでもステージは 1つずつ順番に動きます。

# %%
def pipelined_forward(stages, devices, x, micro_batches):
    """Run x through stages[s] on devices[s], micro-batch by micro-batch; the output is on devices[-1]."""
    acts = list(x.split(-(-len(x) // micro_batches)))  # micro-batches of (almost) equal size
    for tick, s, i in pipeline_schedule(len(stages), len(acts)):
        acts[i] = stages[s](acts[i].to(devices[s]))  # copy to stage s's device, then compute
    return torch.cat(acts)


# %% [markdown]
# <!-- en -->
# To run it we need two devices. With two GPUs the stages go to `cuda:0` and `cuda:1`. With fewer, the same code
# runs on *simulated* devices: the two stages share one device (`["cuda:0", "cuda:0"]`, or `["cpu", "cpu"]`
# without a GPU). The arithmetic is the same, so the correctness check below means the same everywhere; only the
# timing changes.
# <!-- ja -->
# 実行するには 2つのデバイスが必要です。GPU が 2枚あれば、ステージを `cuda:0` と `cuda:1` に置きます。それより少なければ、同じコードを模擬デバイスで動かします。2つのステージが 1つのデバイスを共有します（GPU があれば `["cuda:0", "cuda:0"]`、なければ `["cpu", "cpu"]`）。計算の中身は同じなので、次の正しさの検査はどこでも同じ意味を持ちます。変わるのは時間だけです。

# %% tags=["nbval-ignore-output"]
if mparlib.num_gpus() >= 2:
    pipe_devices = [torch.device("cuda:0"), torch.device("cuda:1")]
    print(tr("Two GPUs: the stages run on", "GPU が 2枚あります。ステージの置き場所:"), pipe_devices)
else:
    pipe_devices = [device, device]
    print(tr(f"Fewer than two GPUs: both stages share {device} (simulated devices). The results are the same; "
             "there is no speed-up to expect.",
             f"GPU が 2枚ないため、2つのステージが {device} を共有します（模擬デバイス）。"
             "結果は同じですが、速くなることは期待できません。"))

# %% [markdown]
# <!-- en -->
# ### Same outputs, same gradients
#
# A pipelined model must compute exactly what the unsplit model computes. We check that in float64 on a small
# network: the outputs and the gradients of every parameter, for several numbers of micro-batches, including
# sizes that do not divide the batch. `mparlib.hybrid.PipelineModel` packages the loop above as an `nn.Module`
# (`from_sequential` copies an `nn.Sequential` and cuts it into stages, keeping the parameter names behind a
# `stages.<i>.` prefix), so we compare it too.
# <!-- ja -->
# ### 同じ出力、同じ勾配
#
# パイプライン化したモデルは、分割前のモデルとまったく同じ計算をしなければなりません。小さなネットワークで、float64 を使って確かめます。マイクロバッチの数をいくつか変え（バッチを割り切れない数も含めます）、出力とすべてのパラメータの勾配を比べます。`mparlib.hybrid.PipelineModel` は上のループを `nn.Module` にまとめたものです。`from_sequential` は `nn.Sequential` をコピーしてステージに切り分け、パラメータ名は `stages.<i>.` を前に付けた形で保ちます。これも一緒に比べます。

# %%
def make_mlp(width, depth, d_in=32, d_out=10):
    """(Linear, ReLU) x depth, then Linear: an nn.Sequential that is easy to cut."""
    layers, d = [], d_in
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    return nn.Sequential(*layers, nn.Linear(d, d_out))


def outputs_and_grads(forward, params, x):
    """The output of forward(x) and the gradients of params for a loss that mixes all outputs."""
    for p in params:
        p.grad = None
    out = forward(x)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).reshape(out.shape)
    (out * weights).sum().backward()
    return out.cpu(), [p.grad.cpu() for p in params]


torch.manual_seed(0)
net = make_mlp(width=64, depth=4).double()  # 9 layers, unsplit, on the CPU
x = torch.randn(30, 32, dtype=torch.float64)
ref_out, ref_grads = outputs_and_grads(net, list(net.parameters()), x)
worst = 0.0
for m in (1, 2, 4, 7, 30):
    pipe = PipelineModel.from_sequential(net, pipe_devices, split_at=[4], micro_batches=m)
    assert [n.split(".", 2)[2] for n, _ in pipe.named_parameters()] == [n for n, _ in net.named_parameters()]
    stages = list(pipe.stages)
    for forward in (pipe, lambda x: pipelined_forward(stages, pipe_devices, x, m)):
        out, grads = outputs_and_grads(forward, list(pipe.parameters()), x)
        torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
        diffs = [(out - ref_out).abs().max()] + [(g - r).abs().max() for g, r in zip(grads, ref_grads)]
        worst = max(worst, *(d.item() for d in diffs))
print(tr("pipelined = unsplit for 1, 2, 4, 7 and 30 micro-batches (float64, tolerance 1e-12)",
         "マイクロバッチを 1、2、4、7、30個に分けたどの場合も、パイプライン化したモデルは分割前と一致（float64、許容誤差 1e-12）"))

# %% tags=["nbval-ignore-output"]
print(tr("largest difference seen:", "観測した最大の差:"), f"{worst:.1e}")

# %% [markdown]
# <!-- en -->
# The differences are at most rounding: splitting a batch changes the order in which a matrix product adds its
# terms, nothing else. This holds because every layer here treats each sample on its own. A layer that mixes the
# samples of a batch, such as `BatchNorm` in training mode, would see micro-batches instead of the batch and
# compute something else (see the exercises).
#
# ### Timing on this machine
#
# Finally, the time of one training step (forward and backward) of a larger network in float32: unsplit on one
# device, split without micro-batches, and pipelined with 2, 4 and 8 micro-batches.
# <!-- ja -->
# 差は丸め誤差の範囲に収まります。バッチを分けて変わるのは、行列積が項を足し合わせる順序だけだからです。これが成り立つのは、ここでのどの層もサンプルを 1つずつ独立に扱うからです。訓練モードの `BatchNorm` のようにバッチ内のサンプルを混ぜる層は、バッチ全体ではなくマイクロバッチを見ることになり、違う結果を返します（練習問題を見てください）。
#
# ### このマシンでの時間
#
# 最後に、より大きなネットワークを float32 で使い、1回の訓練ステップ（順伝播と逆伝播）の時間を測ります。1つのデバイスで分割せずに動かす場合、分割するがマイクロバッチは使わない場合、マイクロバッチを 2個、4個、8個にしてパイプライン化する場合を比べます。

# %% tags=["nbval-ignore-output"]
width, depth, batch = (256, 4, 256) if PROFILE == "smoke" else (4096, 8, 4096)
steps = 5 if PROFILE == "smoke" else 20
torch.manual_seed(0)
big = make_mlp(width, depth, d_in=width)
xb = torch.randn(batch, width, device=pipe_devices[0])


def step_time(model, x, devices):
    """Median seconds of one forward + backward pass, synchronising every device involved."""
    times = []
    for r in range(steps + 1):
        for d in set(devices):
            synchronize(d)
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        for d in set(devices):
            synchronize(d)
        if r:  # the first step warms up
            times.append(time.perf_counter() - t0)
    return median(times)


timings = {tr("unsplit", "分割なし"): step_time(big.to(pipe_devices[0]), xb, pipe_devices[:1])}
for m in (1, 2, 4, 8):
    pipe = PipelineModel.from_sequential(big, pipe_devices, micro_batches=m)
    timings[tr(f"split, {m} micro-batch(es)", f"分割、マイクロバッチ {m}個")] = step_time(pipe, xb, pipe_devices)
base = timings[tr("unsplit", "分割なし")]
print(tr(f"MLP width {width}, depth {depth}, batch {batch} on {pipe_devices}:",
         f"MLP（幅 {width}、深さ {depth}）、バッチ {batch}、デバイス {pipe_devices}:"))
for name, t in timings.items():
    print(f"  {t * 1e3:8.2f} ms  x{base / t:.2f}  {name}")

# %%
assert len(timings) == 5 and all(t > 0 for t in timings.values())

# %% [markdown]
# <!-- en -->
# What to expect:
#
# - **On simulated devices** (one GPU or the CPU), splitting brings no speed-up: both stages share one device.
#   On the CPU every call runs to its end before the next; on one GPU, the stages' kernels wait in one queue
#   (stream) and run one after the other. More micro-batches mean smaller matrix products and more calls, so the
#   pipelined versions are typically a little slower. What the run does show is that the code works unchanged.
# - **On two real GPUs**, the split model without micro-batches is no faster than one GPU (one GPU idles at any
#   time, and the activations must cross between the GPUs), while micro-batches let the two GPUs overlap,
#   approaching the ideal speed-up in the table above when the stages cost the same and the micro-batches are
#   still large enough to keep a GPU busy. The copy between GPUs goes over NVLink or PCIe, so its cost grows with
#   the activation size at the cut; choose the cut where activations are small.
#
# For real training of very large models, PyTorch ships `torch.distributed.pipelining`, which adds backward-pass
# scheduling and multi-process execution on top of the idea shown here.
#
# ## Summary
#
# - Register submodules by assigning them as attributes; `nn.Module.__init__` takes no submodules, so the
#   keyword-argument style of the original example raises `TypeError`.
# - A hybrid model keeps its embedding table on the CPU, moves only the later layers, and copies the looked-up rows
#   in `forward`; autograd copies their gradients back.
# - Host-to-device copies have a fixed cost per call and a bandwidth limit. Pinned memory copies directly, and
#   with `non_blocking=True` lets the CPU continue while the copy runs.
# - A CPU-side table pays when the table (with its gradient and optimiser state) would not fit in device memory
#   and each step touches few rows; use sparse gradients so the update touches only those rows.
# - Model parallelism puts stages on different devices; micro-batches let the stages overlap. The result equals
#   that of the unsplit model up to rounding, as long as no layer mixes the samples of a batch.
# <!-- ja -->
# 予想される結果は次のとおりです。
#
# - **模擬デバイス**（GPU 1枚、または CPU）では、分割しても速くなりません。2つのステージが 1つのデバイスを共有しているからです。CPU ではどの呼び出しも終わってから次に進み、GPU 1枚ではステージのカーネルが 1本のキュー（ストリーム）に並んで順に実行されます。マイクロバッチを増やすと行列積が小さくなり、呼び出しの回数も増えるので、パイプライン版はたいてい少し遅くなります。この実行で確かめられるのは、コードが変更なしで動くことです。
# - **本物の GPU が 2枚**あれば、マイクロバッチなしで分割したモデルは GPU 1枚より速くなりません（どの時点でも片方の GPU が遊んでいて、さらに活性化が GPU 間を渡る必要があります）。マイクロバッチを使うと 2枚の GPU の計算が重なり、ステージのコストが等しく、マイクロバッチが GPU を忙しくさせるのに十分な大きさを保っていれば、上の表の理想的な速度向上に近づきます。GPU 間の転送は NVLink か PCIe を通るので、そのコストは切れ目での活性化の大きさに比例して増えます。活性化が小さいところで切りましょう。
#
# 非常に大きなモデルを実際に訓練するなら、PyTorch には `torch.distributed.pipelining` があります。ここで示した考え方に、逆伝播のスケジューリングと複数プロセスでの実行を加えたものです。
#
# ## まとめ
#
# - サブモジュールは属性として代入して登録します。`nn.Module.__init__` はサブモジュールを受け取らないので、元の例のキーワード引数の書き方は `TypeError` になります。
# - CPU と GPU にまたがるモデルでは、埋め込みテーブルを CPU に置いたまま後ろの層だけを移し、`forward` の中で参照した行を転送します。勾配は自動微分が送り返します。
# - ホストからデバイスへの転送には、呼び出しごとの固定コストと帯域幅の上限があります。ピン留めメモリは直接転送でき、`non_blocking=True` と組み合わせると転送中も CPU が先に進めます。
# - CPU にテーブルを置いて得をするのは、テーブル（と勾配、オプティマイザの状態）がデバイスメモリに収まらず、1ステップで触れる行が少ないときです。疎な勾配を使い、更新もその行だけにします。
# - モデル並列ではステージを別々のデバイスに置き、マイクロバッチでステージの計算を重ねます。バッチ内のサンプルを混ぜる層がなければ、結果は丸め誤差を除いて分割前のモデルと一致します。

# %% [markdown]
# <!-- en -->
# ## Exercises
#
# Each exercise has a **starter** cell whose function body is `raise NotImplementedError`: replace that line with your
# code, run the cell, then run the check cell below it. The check says *not attempted*, *wrong* (the first difference
# and one hint for the likely mistake), *error* (your exception, or your code ending its process), *right*, *cannot
# run here* or *the check itself failed* (never a verdict on your answer); it never prints the answer. Your function
# runs in a fresh worker process and is stopped after 30 s. `hint("04.1")` prints the next hint level each time you
# call it and says when none is left; `hint("04.1", 2)` prints a given level.
# <!-- ja -->
# ## 練習問題
#
# 各練習問題には、本体が `raise NotImplementedError` だけの関数を含む**スターター**のセルがあります。その行を自分のコードに置き換えてセルを実行し、すぐ下のチェックのセルを実行してください。チェックの結果は「未着手」、「不正解」（最初の違いと、ありがちな間違いに合わせたヒント 1つ）、「エラー」（発生した例外、またはコードがプロセスを終了させたこと）、「正解」、「この環境では実行できません」、「チェック自体の不具合」（あなたの答えの判定ではありません）のどれかで、答えそのものは表示しません。関数は新しいワーカープロセスで実行し、30秒で止めます。`hint("04.1")` は呼ぶたびに次の段階のヒントを表示し、もう残っていなければそう伝えます。`hint("04.1", 2)` は指定した段階のヒントを表示します。

# %%
from mparlib.exercises import check, hint

# %% [markdown]
# <!-- en -->
# ### Exercise 04.1: The bubble
#
# Write `bubble_fraction(stages, micro_batches)`: the share of the ticks of a pipelined forward pass (the order of
# `pipeline_schedule`) in which one stage has nothing to do, as a number between 0 and 1. The check compares it
# with its own formula at many random points.
# <!-- ja -->
# ### 練習問題 04.1: バブル
#
# パイプライン化した順伝播（`pipeline_schedule` の順序）のティックのうち、1つのステージに仕事がないティックの割合を 0 から 1 の数で返す `bubble_fraction(stages, micro_batches)` を書いてください。チェックは、ランダムに選んだ多くの点で、自分の式と比べます。

# %%
# Exercise 04.1: starter
def bubble_fraction(stages, micro_batches):
    """The idle share of one stage's ticks in a pipelined forward pass (0 to 1)."""
    raise NotImplementedError("04.1")


# %%
check("04.1", bubble_fraction)

# %% [markdown]
# <!-- en -->
# ### Exercise 04.2: A model split over two devices
#
# Write `split_in_two(net, devices, split_at)`: a module holding the layers of the `nn.Sequential` `net` before
# index `split_at` as the submodule `first`, on `devices[0]`, and the others as `second`, on `devices[1]`, whose
# forward computes what `net` computes. The check runs it on two GPUs when there are two, else on `["cpu",
# "cpu"]`, compares outputs and gradients with the whole network, and watches that forward hands the activation
# to the second device.
# <!-- ja -->
# ### 練習問題 04.2: 2つのデバイスに分けたモデル
#
# `nn.Sequential` の `net` のうち、位置 `split_at` より前の層をサブモジュール `first` として `devices[0]` に、残りを `second` として `devices[1]` に置き、`net` と同じものを計算するモジュールを返す `split_in_two(net, devices, split_at)` を書いてください。チェックは、GPU が 2枚あればその 2枚で、なければ `["cpu", "cpu"]` で実行し、出力と勾配を分ける前のネットワークと比べ、forward が活性化を 2つ目のデバイスへ渡しているかを見ます。

# %%
# Exercise 04.2: starter
def split_in_two(net, devices, split_at):
    """A module with stages `first` (net[:split_at], on devices[0]) and `second` (the rest, on devices[1])."""
    raise NotImplementedError("04.2")


# %%
check("04.2", split_in_two)

# %% [markdown]
# <!-- en -->
# ### Exercise 04.3: A table's memory
#
# Write `table_bytes(rows, dim, optimizer)`: the bytes that training a float32 embedding table of `rows` x `dim`
# numbers takes on its device, counting the weights, a dense gradient and the optimiser's state, for
# `optimizer` one of `"sgd"` (plain), `"momentum"` and `"adam"`.
# <!-- ja -->
# ### 練習問題 04.3: テーブルのメモリ
#
# `rows` x `dim` 個の数値からなる float32 の埋め込みテーブルを訓練するとき、そのデバイスで必要になるバイト数を返す `table_bytes(rows, dim, optimizer)` を書いてください。重み、密な勾配、最適化手法の状態を数えます。`optimizer` は `"sgd"`（ふつうの SGD）、`"momentum"`、`"adam"` のどれかです。

# %%
# Exercise 04.3: starter
def table_bytes(rows, dim, optimizer):
    """Bytes of a float32 table with its dense gradient and the optimiser's state."""
    raise NotImplementedError("04.3")


# %%
check("04.3", table_bytes)

# %% [markdown]
# <!-- en -->
# ### More questions
#
# 1. **BatchNorm and micro-batches.** Copy `make_mlp` into a `make_mlp_bn` that adds `nn.BatchNorm1d(width)` after
#    each `nn.Linear(d, width)`, set `net = make_mlp_bn(64, 4).double()` in the check cell of "Same outputs, same
#    gradients" and run it. Which assertion fails, and why? Then call `net.eval()` right after building `net`
#    (the pipeline's copies inherit eval mode): does the check pass now? Why would the running statistics of the
#    two models still differ after a few steps in training mode?
# 2. **The memory arithmetic.** Change `rows`, `dim` and `batch` in the arithmetic cell to a table of your own
#    (for example 50 million rows of 128 numbers). Does the table with Adam's state fit in your GPU's memory
#    (`torch.cuda.get_device_properties(0).total_memory`, or 24 GiB if you have no GPU)? How long would the rows of
#    one step take to move at the bandwidth you measured?
# 3. **`.to()` on the whole model.** Create `HybridEmbeddingModel(1000, 10, device=device)`, call `.to(device)` on
#    it, check `model.embedding.weight.device` and run `model(torch.tensor([1, 2, 3]))`. On a GPU machine, does the
#    model still run, and where is the table now? (Without a GPU nothing moves: everything is on the CPU already.)
# <!-- ja -->
# ### その他の問い
#
# 1. **BatchNorm とマイクロバッチ。** `make_mlp` をコピーして、各 `nn.Linear(d, width)` の後ろに `nn.BatchNorm1d(width)` を加えた `make_mlp_bn` を作ってください。「同じ出力、同じ勾配」の検査セルで `net = make_mlp_bn(64, 4).double()` として実行すると、どの assert が失敗するでしょうか。それはなぜでしょうか。次に、`net` を作った直後に `net.eval()` を呼んでください（パイプラインのコピーも評価モードを引き継ぎます）。今度は検査が通るでしょうか。訓練モードで何ステップか進めた後では、2つのモデルの移動統計量がなお食い違うのはなぜでしょうか。
# 2. **メモリの計算。** 計算用のセルの `rows`、`dim`、`batch` を自分で考えたテーブルの値に変えてください（例: 128個の値からなる行が 5,000万行）。Adam の状態を含めたテーブルは、手元の GPU のメモリ（`torch.cuda.get_device_properties(0).total_memory`、GPU がなければ 24 GiB とします）に収まるでしょうか。1ステップ分の行を、測った帯域幅で運ぶには何秒かかるでしょうか。
# 3. **モデル全体に `.to()` を呼ぶ。** `HybridEmbeddingModel(1000, 10, device=device)` を作って `.to(device)` を呼び、`model.embedding.weight.device` を確かめてから `model(torch.tensor([1, 2, 3]))` を実行してください。GPU のあるマシンでは、モデルはまだ動くでしょうか。テーブルは今どこにあるでしょうか（GPU がなければ何も移りません。もともとすべて CPU にあるからです）。
