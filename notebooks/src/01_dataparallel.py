# %% [markdown]
# <!-- en -->
# # 1. DataParallel basics
#
# **Data parallelism** splits each mini-batch into smaller pieces and lets several devices work on the pieces
# at the same time, each with its own copy of the model. PyTorch's simplest tool for it is `nn.DataParallel`:
# wrap a module in it and every call spreads the batch dimension over the GPUs of the machine.
#
# In this chapter you will
#
# - wrap one block of a small network in `nn.DataParallel` and see why the same code also runs without a GPU,
# - watch what a single forward pass does (split, copy, run, collect) with a layer that records what it receives,
# - learn the practical rules that trip people up: where the module must live, where the result lands, why
#   the first GPU fills up first, what happens to batch size and learning rate, and when to prefer
#   `DistributedDataParallel`.
# <!-- ja -->
# # 1. DataParallel の基本
#
# **データ並列**とは、ミニバッチを小さく分け、モデルのコピーを持った複数のデバイスにそれぞれを同時に計算させる手法です。PyTorch でいちばん手軽な道具が `nn.DataParallel` です。モジュールをこれでラップすると、呼び出すたびにバッチの次元がマシン上の GPU に振り分けられます。
#
# この章では次のことを学びます。
#
# - 小さなネットワークのブロックの 1つを `nn.DataParallel` でラップし、同じコードが GPU なしでも動く理由を確かめます。
# - 受け取った入力を記録する層を使って、1回の順伝播で起きること（分割、複製、実行、回収）を目で見ます。
# - つまずきやすい実践上の注意点を押さえます。モジュールを置くべきデバイス、結果が返ってくるデバイス、最初の GPU のメモリだけが先に埋まる理由、バッチサイズと学習率への影響、そして `DistributedDataParallel` を選ぶべき場面です。

# %% tags=["nbval-ignore-output"]
import copy

import matplotlib.pyplot as plt
import torch
from torch import nn

import mparlib
import mparlib.plot

mparlib.plot.use_course_style()  # a font with Japanese glyphs for this notebook's figures
from mparlib.lang import tr
from mparlib.parallel import data_parallel

print(mparlib.report())
print(mparlib.profile_line())

# %% [markdown]
# <!-- en -->
# The table above describes your machine, so it will differ from the one stored in this notebook. Every other
# checked output in this chapter is the same on a laptop, on one GPU and on many. The chapter is small enough
# to run in seconds everywhere, so it does the same work in both course profiles.
# <!-- ja -->
# 上の表はお使いのマシンの情報なので、保存されている出力とは異なります。それ以外の検査対象の出力は、ノート PC でも GPU 1枚でも複数の GPU でも同じになります。この章の計算はどこでも数秒で終わる規模なので、どちらのプロファイルでも同じ内容を実行します。

# %% [markdown]
# <!-- en -->
# ## A network with one data-parallel block
#
# `nn.DataParallel` is an ordinary `nn.Module`, so it can sit anywhere in a network. Here only the middle of
# three linear blocks is wrapped; the blocks before and after it run as usual. The whole model goes to
# `mparlib.try_gpu()`: the first GPU if there is one, otherwise the CPU.
# <!-- ja -->
# ## 1つのブロックだけをデータ並列にしたネットワーク
#
# `nn.DataParallel` もふつうの `nn.Module` なので、ネットワークのどこにでも置けます。ここでは 3つの線形ブロックのうち真ん中だけをラップし、前後のブロックは通常どおり実行します。モデル全体は `mparlib.try_gpu()` が返すデバイス（GPU があれば 1枚目、なければ CPU）に置きます。

# %%
class ThreeBlocks(nn.Module):
    """Three linear layers; only the middle one is wrapped in nn.DataParallel."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(10, 20)
        self.middle = nn.DataParallel(nn.Linear(20, 20))  # the batch is split only here
        self.last = nn.Linear(20, 20)

    def forward(self, x):
        h = self.first(x)
        h = self.middle(h)
        return self.last(h)


torch.manual_seed(0)
device = mparlib.try_gpu()
model = ThreeBlocks().to(device)
x = torch.randn(8, 10).to(device)
y = model(x)
print(tr("input: ", "入力:"), tuple(x.shape))
print(tr("output:", "出力:"), tuple(y.shape))

# %% [markdown]
# <!-- en -->
# Nothing in the code mentions how many GPUs there are. On a machine without one it still runs: when PyTorch
# finds no GPU, `nn.DataParallel` keeps an empty list of `device_ids` and its `forward` simply calls the wrapped
# module. On such a machine the wrapper is a pass-through. With GPUs, `device_ids` lists all of them by default.
# <!-- ja -->
# コードのどこにも GPU の枚数は出てきません。GPU のないマシンでもこのまま動きます。PyTorch が GPU を見つけられないと、`nn.DataParallel` は `device_ids` を空のリストにし、`forward` はラップしたモジュールをそのまま呼び出すだけになるからです。つまり GPU のないマシンでは、ラッパーは入力を素通しするだけです。GPU がある場合、`device_ids` には既定ですべての GPU が並びます。

# %% tags=["nbval-ignore-output"]
print(tr("GPUs:", "GPU の枚数:"), mparlib.num_gpus())
print("model.middle.device_ids:", model.middle.device_ids)

# %%
assert model.middle.device_ids == list(range(mparlib.num_gpus()))
h = model.first(x)
torch.testing.assert_close(model.middle(h), model.middle.module(h))  # same result as the bare layer
print(tr("the wrapper computes what the wrapped layer computes", "ラッパーはラップした層と同じ値を計算します"))

# %% [markdown]
# <!-- en -->
# The wrapper holds the original layer as its submodule `module`. That extra level shows up in parameter
# names, which matters when you save and load checkpoints (chapter 2):
# <!-- ja -->
# ラッパーは元の層を `module` という名前のサブモジュールとして保持します。この 1段の入れ子はパラメータ名にも現れ、チェックポイントの保存と読み込みで問題になります（2章で扱います）。

# %%
for name, p in model.named_parameters():
    print(f"{name:<22} {tuple(p.shape)}")

# %% [markdown]
# <!-- en -->
# ## What one forward pass does
#
# With `k` GPUs, a call `wrapper(x)` does four things:
#
# 1. **scatter**: split `x` along dimension 0 (the batch) into at most `k` chunks and send chunk `i` to GPU `i`;
# 2. **replicate**: copy the module from the first GPU to the others;
# 3. **parallel apply**: run replica `i` on chunk `i`, all at the same time (one Python thread per GPU);
# 4. **gather**: concatenate the outputs along dimension 0 on one GPU, the `output_device`.
#
# To watch this happen we put a probe layer in front of the model. It returns its input unchanged and writes
# down what it received: which rows of the batch, the shape, and the device. Each row of the test batch is
# filled with its own index, so a replica's rows tell us which samples it got.
# <!-- ja -->
# ## 1回の順伝播で起きること
#
# GPU が `k` 枚あるとき、`wrapper(x)` の呼び出しでは次の 4つが起きます。
#
# 1. **分配（scatter）**: `x` を 0次元目（バッチの次元）に沿って最大 `k` 個のチャンクに分け、チャンク `i` を GPU `i` に送ります。
# 2. **複製（replicate）**: 1枚目の GPU にあるモジュールを、ほかの GPU にコピーします。
# 3. **並列実行（parallel apply）**: レプリカ `i` にチャンク `i` を同時に計算させます（GPU 1枚につき Python のスレッドが 1つ）。
# 4. **集約（gather）**: 各出力を 0次元目に沿って連結し、1枚の GPU（`output_device`）に集めます。
#
# この流れを観察するために、モデルの先頭にプローブ層を置きます。プローブ層は入力をそのまま返し、受け取ったもの（バッチのどの行か、形状、デバイス）を記録します。テスト用のバッチは各行を自分の行番号で埋めておくので、レプリカが受け取った行の値から、どのサンプルを担当したかがわかります。

# %%
class Probe(nn.Module):
    """Return the input unchanged and log which rows arrived, their shape and their device."""

    def __init__(self, log):
        super().__init__()
        self.log = log  # a plain list; the replicas share it

    def forward(self, x):
        self.log.append({"rows": x[:, 0].int().tolist(), "shape": tuple(x.shape), "device": str(x.device)})
        return x


def numbered_batch(n, features=10):
    """A batch of n rows in which row i is filled with the number i."""
    return torch.arange(n, dtype=torch.float32).unsqueeze(1).repeat(1, features)


def in_batch_order(log):
    """The log sorted by first row. Replicas run in threads, so they finish (and log) in any order."""
    return sorted(log, key=lambda record: record["rows"][0])


log = []
probed = nn.Sequential(Probe(log), nn.Linear(10, 4))
print(numbered_batch(4)[:, :5])

# %% [markdown]
# <!-- en -->
# A machine without GPUs cannot show a real split, but the four steps do not depend on the hardware.
# `mparlib.data_parallel` performs exactly these steps on any list of devices, including the CPU listed several
# times. `["cpu"] * 4` stands for four **simulated devices**: four replicas, four threads, one processor. It makes
# the data flow visible everywhere; it does not make anything faster. Chapter 3 builds this function from its
# parts. Here we only use it, on a batch of 10 rows:
# <!-- ja -->
# GPU のないマシンでは本物の分割は見せられません。しかし 4つの手順そのものはハードウェアに依存しません。`mparlib.data_parallel` は、CPU を何回か並べたリストも含め、どんなデバイスのリストに対してもこの手順をそのまま実行します。`["cpu"] * 4` は 4つの**模擬デバイス**を表します。レプリカが 4つ、スレッドが 4つ、プロセッサは 1つです。どこでもデータの流れを観察できますが、速くはなりません。この関数は 3章で部品から組み立てます。ここでは 10行のバッチで使ってみるだけにします。

# %%
x = numbered_batch(10)
out = data_parallel(probed, x, ["cpu"] * 4)
for i, record in enumerate(in_batch_order(log)):
    print(tr(f"replica {i} on {record['device']}: shape {record['shape']}, rows {record['rows']}",
             f"レプリカ {i}（{record['device']}）: 形状 {record['shape']}、行 {record['rows']}"))
print(tr("gathered output:", "集約した出力:"), tuple(out.shape))

# %%
assert [r["rows"] for r in in_batch_order(log)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
log.clear()
torch.testing.assert_close(out, probed(x))  # the same result as one call on the whole batch
log.clear()

# %% [markdown]
# <!-- en -->
# The chunks follow `torch.chunk`: every chunk has `ceil(10 / 4) = 3` rows except the last, which gets what is
# left. The split does not always use every device. The figure shows three cases; in the last one a batch of 3
# rows meets 4 devices and the fourth device gets nothing to do.
# <!-- ja -->
# チャンクの分け方は `torch.chunk` と同じです。どのチャンクも `ceil(10 / 4) = 3` 行で、最後のチャンクだけが残りの行を受け取ります。分割が常にすべてのデバイスを使うとは限りません。下の図は 3つの場合を示しています。最後の例では 3行のバッチを 4つのデバイスで処理するので、4つ目のデバイスには仕事がありません。

# %%
cases = [(10, 4), (10, 3), (3, 4)]
fig, axes = plt.subplots(len(cases), 1, figsize=(7.5, 6.4))
for ax, (batch, k) in zip(axes, cases):
    data_parallel(probed, numbered_batch(batch), ["cpu"] * k)
    records = in_batch_order(log)
    log.clear()
    for i, record in enumerate(records):  # replica i runs on device i
        start, size = record["rows"][0], len(record["rows"])
        ax.barh(i, size, left=start, height=0.7, color=f"C{i}", edgecolor="black")
        ax.text(start + size / 2, i, tr(f"{size} rows", f"{size}行"), ha="center", va="center", fontsize=8)
    for i in range(len(records), k):
        ax.text(0.1, i, tr("no chunk: idle", "チャンクなし: 待機"), va="center", fontsize=8, color="gray")
    sizes = [len(r["rows"]) for r in records]
    ax.set_title(tr(f"{batch} rows on {k} devices: chunks {sizes}",
                    f"{batch}行を {k}つのデバイスで処理: チャンク {sizes}"), fontsize=10)
    ax.set_xlim(0, 10)
    ax.set_xticks([r + 0.5 for r in range(10)], [str(r) for r in range(10)])
    ax.set_yticks(range(k), [tr(f"device {i}", f"デバイス {i}") for i in range(k)])
    ax.set_ylim(k - 0.5, -0.5)
axes[-1].set_xlabel(tr("row of the mini-batch", "ミニバッチの行番号"))
fig.tight_layout()
plt.show()

# %%
for batch, k in cases:
    sizes = [len(c) for c in torch.arange(batch).chunk(k)]
    print(tr(f"{batch:>2} rows on {k} devices -> {len(sizes)} chunks {sizes}",
             f"{batch:>2}行を {k}つのデバイスへ -> チャンク {len(sizes)}個 {sizes}"))

# %% [markdown]
# <!-- en -->
# Now the real `nn.DataParallel` with the same probe. On a machine with several GPUs it splits the batch over
# all of them. With one GPU it does not split at all: it moves the module to that GPU and calls it once. With
# no GPU it is the pass-through described above. The printout therefore depends on your machine; the `assert`
# in the next cell checks the rule for every case.
# <!-- ja -->
# 次に、同じプローブ層で本物の `nn.DataParallel` を動かします。複数の GPU があるマシンでは、バッチをすべての GPU に分けます。GPU が 1枚なら分割はせず、モジュールをその GPU に移して 1回呼び出すだけです。GPU がなければ、先ほど説明したとおり素通しになります。そのため表示はマシンによって変わります。次のセルの `assert` は、どの場合についてもこの規則を確かめます。

# %% tags=["nbval-ignore-output"]
device = mparlib.try_gpu()
on_gpus = nn.DataParallel(nn.Sequential(Probe(log), nn.Linear(10, 4)).to(device))
out = on_gpus(numbered_batch(10).to(device))
for i, record in enumerate(in_batch_order(log)):
    print(tr(f"call {i} on {record['device']}: shape {record['shape']}, rows {record['rows']}",
             f"呼び出し {i}（{record['device']}）: 形状 {record['shape']}、行 {record['rows']}"))
print(tr("output on", "出力のデバイス:"), out.device)

# %%
expected_calls = len(torch.arange(10).chunk(max(mparlib.num_gpus(), 1)))  # torch.chunk's rule again
assert len(log) == expected_calls, (len(log), expected_calls)
assert sorted(row for record in log for row in record["rows"]) == list(range(10))
assert out.device == device
log.clear()

# %% [markdown]
# <!-- en -->
# ## Practical rules
#
# ### 1. The module must live on `device_ids[0]` first
#
# `nn.DataParallel` copies the module *from* the first GPU in `device_ids` at every forward pass. It does not
# move the module there for you (except in the one-GPU case). If the parameters are still on the CPU, the first
# call fails with `RuntimeError: module must have its parameters and buffers on device cuda:0 ...`. The fix is
# one line before wrapping: `model.to("cuda:0")`. The input may start anywhere; `scatter` moves the chunks.
# With at least two GPUs the next cell shows the error and the fix; elsewhere it only says so.
# <!-- ja -->
# ## 実践上の注意点
#
# ### 1. `device_ids[0]` へのモジュールの事前配置
#
# `nn.DataParallel` は順伝播のたびに、モジュールを `device_ids` の 1枚目の GPU からほかの GPU へコピーします。コピー元の 1枚目の GPU へモジュールを移す処理は（GPU が 1枚の場合を除いて）してくれません。パラメータが CPU に残ったままだと、最初の呼び出しが `RuntimeError: module must have its parameters and buffers on device cuda:0 ...` で失敗します。ラップする前に `model.to("cuda:0")` の 1行を書けば解決します。入力はどのデバイスにあってもかまいません。チャンクは `scatter` が移動してくれます。GPU が 2枚以上あれば次のセルでエラーと修正を実際に示し、それ以外のマシンではその旨を表示するだけです。

# %% tags=["nbval-ignore-output"]
if mparlib.num_gpus() >= 2:
    stray = nn.DataParallel(nn.Linear(10, 4))  # parameters still on the CPU
    try:
        stray(torch.randn(8, 10))
        raise AssertionError("expected a RuntimeError: the module is not on cuda:0")
    except RuntimeError as err:
        print("RuntimeError:", err)
    stray.to("cuda:0")
    print(tr("after .to('cuda:0'): output", ".to('cuda:0') の後の出力:"), tuple(stray(torch.randn(8, 10)).shape))
else:
    print(tr("Fewer than 2 GPUs here: nn.DataParallel never copies the module, so the rule cannot be broken.",
             "このマシンの GPU は 2枚未満です。nn.DataParallel はモジュールをコピーしないので、"
             "この規則に触れることはありません。"))

# %% [markdown]
# <!-- en -->
# ### 2. The result comes back on `output_device`
#
# The gathered output lands on `output_device`, which defaults to `device_ids[0]`; so does the loss you compute
# from it, and the labels must be moved there too. `output_device=-1` sends the result to the CPU.
# <!-- ja -->
# ### 2. `output_device` に返ってくる結果
#
# 集約された出力は `output_device`（既定値は `device_ids[0]`）に置かれます。そこから計算する損失も同じデバイスに乗るので、ラベルもそのデバイスに移しておく必要があります。`output_device=-1` を指定すると結果は CPU に返ります。

# %% tags=["nbval-ignore-output"]
if mparlib.num_gpus() >= 2:
    to_second = nn.DataParallel(nn.Linear(10, 4).to("cuda:0"), output_device=1)
    to_cpu = nn.DataParallel(nn.Linear(10, 4).to("cuda:0"), output_device=-1)
    x = torch.randn(8, 10)
    print("output_device=1: ", to_second(x).device)
    print("output_device=-1:", to_cpu(x).device)
    assert to_second(x).device == torch.device("cuda:1") and to_cpu(x).device.type == "cpu"
else:
    out = nn.DataParallel(nn.Linear(10, 4).to(mparlib.try_gpu()))(torch.randn(8, 10))
    print(tr(f"Fewer than 2 GPUs here: the output is on {out.device}.",
             f"このマシンの GPU は 2枚未満です。出力は {out.device} にあります。"))

# %% [markdown]
# <!-- en -->
# ### 3. The first GPU holds more memory
#
# GPU 0 keeps the original parameters and their gradients, receives the whole input batch, holds the gathered
# output and computes the loss on it. The other GPUs hold only a replica and their chunk. The peak memory of
# GPU 0 is therefore higher, and it is the one that runs out first when the batch grows. With two or more GPUs
# the next cell measures the peak memory of each GPU during one training step.
# <!-- ja -->
# ### 3. メモリを多く使う最初の GPU
#
# GPU 0 は元のパラメータとその勾配を持ち、入力バッチ全体を受け取り、集約した出力とそこから計算する損失も抱えます。ほかの GPU が持つのはレプリカと自分のチャンクだけです。そのため GPU 0 のピークメモリは高くなり、バッチを大きくすると最初にメモリ不足になるのは GPU 0 です。GPU が 2枚以上あれば、次のセルで 1回の訓練ステップ中の各 GPU のピークメモリを測ります。

# %% tags=["nbval-ignore-output"]
if mparlib.num_gpus() >= 2:
    big = nn.DataParallel(nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).to("cuda:0"))
    batch = torch.randn(4096, 1024)
    for i in range(mparlib.num_gpus()):
        torch.cuda.reset_peak_memory_stats(i)
    big(batch).pow(2).mean().backward()
    peaks = [torch.cuda.max_memory_allocated(i) / 2**20 for i in range(mparlib.num_gpus())]
    for i, peak in enumerate(peaks):
        print(f"cuda:{i}: {tr('peak', 'ピーク')} {peak:8.1f} MiB")
    assert peaks[0] >= max(peaks[1:])
    del big, batch
else:
    print(tr("Fewer than 2 GPUs here: nothing to compare.",
             "このマシンの GPU は 2枚未満なので、比べるものがありません。"))

# %% [markdown]
# <!-- en -->
# ### 4. Batch size and learning rate
#
# The batch you pass to the wrapper is the **global batch**; each device sees only its chunk. With a global
# batch of 256, eight GPUs compute on 32 rows each, which may be too few to keep a GPU busy. A common choice is
# to keep the per-device batch size and multiply the global batch by the number of devices.
# <!-- ja -->
# ### 4. バッチサイズと学習率
#
# ラッパーに渡すバッチの大きさが**全体のバッチサイズ**です。各デバイスが見るのは、そのうち自分のチャンクだけです。全体のバッチサイズが 256 なら、8枚の GPU はそれぞれ 32行しか計算しません。これでは GPU を十分に働かせられないことがあります。よく使われるのは、デバイスあたりのバッチサイズを保ったまま、全体のバッチサイズをデバイスの数だけ倍にするやり方です。

# %%
for k in (1, 2, 3, 4, 8):
    per_device = [len(c) for c in torch.arange(256).chunk(k)]
    print(tr(f"global batch 256 on {k} device(s) -> per device {per_device}",
             f"全体のバッチ 256 を {k}つのデバイスへ -> デバイスあたり {per_device}"))

# %% [markdown]
# <!-- en -->
# What the learning rate should be follows from one fact: for the same global batch, one step with
# `nn.DataParallel` computes the same gradient as one step on a single device. The loss is computed on the
# gathered output, i.e. on the whole batch, and the gradients of all replicas flow back into the original
# parameters, where they add up. The next cell takes one SGD step both ways (in float64, so rounding cannot hide
# a difference) and compares the parameters afterwards.
# <!-- ja -->
# 学習率をどうするかは、1つの事実から決まります。全体のバッチサイズが同じなら、`nn.DataParallel` での 1ステップは 1つのデバイスでの 1ステップと同じ勾配を計算します。損失は集約された出力、つまりバッチ全体に対して計算され、すべてのレプリカの勾配は元のパラメータへ逆伝播して足し合わされるからです。次のセルでは両方の方法で SGD を 1ステップ進め（丸め誤差で差が隠れないよう float64 を使います）、その後のパラメータを比べます。

# %%
torch.manual_seed(0)
single = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1)).double()
split = copy.deepcopy(single)
X, Y = torch.randn(64, 10, dtype=torch.float64), torch.randn(64, 1, dtype=torch.float64)
runs = [(single, lambda m, X: m(X)), (split, lambda m, X: data_parallel(m, X, ["cpu"] * 4))]
for net, forward in runs:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    loss = nn.functional.mse_loss(forward(net, X), Y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
gap = max((a - b).abs().max().item() for a, b in zip(single.parameters(), split.parameters()))
print(tr("same parameters after one step:", "1ステップ後のパラメータが一致:"), gap < 1e-12)

# %%
assert gap < 1e-12, gap

# %% [markdown]
# <!-- en -->
# So for an unchanged global batch, keep the learning rate. If you grow the global batch `k`-fold to keep each
# device busy, an epoch has `k` times fewer steps and each gradient averages over more samples. A common starting
# point is then the **linear scaling rule**: multiply the learning rate by `k`, with a few epochs of warm-up
# (Goyal et al., 2017, "Accurate, Large Minibatch SGD"). It is a rule of thumb to check on your task, not a law.
#
# One layer breaks the equality above: **batch normalization** in training mode normalises with the mean and
# variance of the rows it sees, and each replica sees only its chunk. Chapter 3 shows the difference.
# <!-- ja -->
# したがって、全体のバッチサイズを変えないなら学習率もそのままでかまいません。各デバイスを十分に働かせるために全体のバッチサイズを `k` 倍にすると、1エポックあたりのステップ数は `1/k` になり、1回の勾配はより多くのサンプルの平均になります。そのときの出発点としてよく使われるのが**線形スケーリング則**です。学習率を `k` 倍し、最初の数エポックはウォームアップで徐々に上げます（Goyal ら、2017年、"Accurate, Large Minibatch SGD"）。これは経験則なので、自分のタスクで確かめてから使ってください。
#
# ただし、この等しさが成り立たない層が 1つあります。訓練モードの**バッチ正規化**は、自分が見た行の平均と分散で正規化します。各レプリカが見るのは自分のチャンクだけなので、結果が変わります。その違いは 3章で確かめます。

# %% [markdown]
# <!-- en -->
# ### 5. DataParallel or DistributedDataParallel?
#
# `nn.DataParallel` is one line of code, which is why it is the first thing to learn. PyTorch's documentation
# nevertheless recommends `nn.parallel.DistributedDataParallel` (DDP), even on a single machine:
#
# | | `DataParallel` | `DistributedDataParallel` |
# |---|---|---|
# | processes | one process, one thread per GPU (threads compete for Python's GIL) | one process per GPU |
# | model copies | replicated from GPU 0 at **every** forward pass | copied once at the start |
# | gradients | flow back to GPU 0 and are summed there | averaged across GPUs with all-reduce, overlapping the backward pass |
# | memory | GPU 0 carries extra load | balanced |
# | machines | one | one or many |
# | setup | wrap the module | launch processes (`torchrun`), set up a process group |
#
# Chapter 6 trains the same model with DDP and compares the two.
# <!-- ja -->
# ### 5. DataParallel と DistributedDataParallel の使い分け
#
# `nn.DataParallel` は 1行で使えるので、最初に学ぶには最適です。しかし PyTorch のドキュメントは、1台のマシンであっても `nn.parallel.DistributedDataParallel`（DDP）を推奨しています。
#
# | | `DataParallel` | `DistributedDataParallel` |
# |---|---|---|
# | プロセス | 1個のプロセスで、GPU ごとに 1つのスレッド（スレッドは Python の GIL を取り合います） | GPU ごとに 1個のプロセス |
# | モデルのコピー | 順伝播の**たびに** GPU 0 から複製 | 開始時に 1回だけコピー |
# | 勾配 | GPU 0 に逆伝播して足し合わされる | オールリデュース（all-reduce）で GPU 間の平均をとり、逆伝播と重ねて実行 |
# | メモリ | GPU 0 の負担が大きい | 均等 |
# | マシン | 1台のみ | 1台でも複数台でも |
# | 準備 | モジュールをラップするだけ | プロセスを起動し（`torchrun`）、プロセスグループを用意する |
#
# 6章では同じモデルを DDP で訓練し、両者を比べます。

# %% [markdown]
# <!-- en -->
# ## Summary
#
# - `nn.DataParallel(module)` splits the batch dimension over all GPUs; without a GPU it just calls the module,
#   so the same code runs everywhere.
# - One forward pass is scatter, replicate, parallel apply, gather. Chunks follow `torch.chunk`, so some devices
#   may get nothing.
# - Put the module on `device_ids[0]` before the first call; results (and your loss) live on `output_device`;
#   GPU 0 needs the most memory.
# - For the same global batch, the gradient is the one a single device computes (batch normalization in
#   training mode aside); when you grow the batch with the number of devices, revisit the learning rate.
# - For serious training prefer `DistributedDataParallel` (chapter 6).
# <!-- ja -->
# ## まとめ
#
# - `nn.DataParallel(module)` はバッチの次元をすべての GPU に分けます。GPU がなければモジュールをそのまま呼ぶだけなので、同じコードがどこでも動きます。
# - 1回の順伝播は、分配、複製、並列実行、集約の 4段階です。チャンクは `torch.chunk` の規則で作られるので、仕事のないデバイスが出ることもあります。
# - モジュールは最初の呼び出しの前に `device_ids[0]` へ置きます。結果（と損失）は `output_device` に置かれ、GPU 0 がいちばん多くのメモリを使います。
# - 全体のバッチサイズが同じなら、勾配は 1つのデバイスで計算したものと同じです（訓練モードのバッチ正規化は例外）。デバイスの数に合わせてバッチを大きくするときは、学習率を見直します。
# - 本格的な訓練には `DistributedDataParallel` を使いましょう（6章）。

# %% [markdown]
# <!-- en -->
# ## Exercises
#
# Each exercise below has a **starter** cell: a function whose body is `raise NotImplementedError`. Replace that line
# with your code, run the cell, then run the check cell under it. The check runs your function on its own inputs in a
# fresh worker process, compares what comes back here in the kernel, and says one of: *not attempted* (the starter is
# unchanged), *wrong* (the first case that goes wrong and one hint for the likely mistake; a function still running
# after 30 s is stopped, and is wrong too), *error* (your exception and its traceback, or your code ending its
# process), *right*, *cannot run here* (for example, no GPU) or *the check itself failed* (a fault of the check, never
# a verdict on your answer). It never prints the answer. `hint("01.1")` prints the next hint level each time you call
# it, from where to look to one step short of the code, and says when none is left; `hint("01.1", 2)` prints a given
# level. The stored notebook shows the checks of the untouched starters.
# <!-- ja -->
# ## 練習問題
#
# 以下の練習問題には、それぞれ**スターター**のセルがあります。本体が `raise NotImplementedError` だけの関数です。その行を自分のコードに置き換えてセルを実行し、すぐ下のチェックのセルを実行してください。チェックは独自の入力で関数を新しいワーカープロセスで実行し、返ってきたものをこのカーネルで比べて、結果を次のどれかで伝えます。「未着手」（スターターのまま）、「不正解」（最初に食い違った場合と、ありがちな間違いに合わせたヒント 1つ。30秒たっても実行中の関数は止められ、これも不正解です）、「エラー」（発生した例外とトレースバック、またはコードがプロセスを終了させたこと）、「正解」、「この環境では実行できません」（GPU がないなど）、「チェック自体の不具合」（チェックの不具合で、あなたの答えの判定ではありません）です。答えそのものは表示しません。`hint("01.1")` は呼ぶたびに次の段階のヒントを表示し（どこを見ればよいかから、コードの一歩手前まで）、もう残っていなければそう伝えます。`hint("01.1", 2)` のように段階を指定することもできます。保存されているノートブックには、スターターのままでのチェック結果が表示されています。

# %%
from mparlib.exercises import check, hint

# %% [markdown]
# <!-- en -->
# ### Exercise 01.1: Chunk sizes
#
# Write `chunk_sizes(batch, k)`: the number of rows each device receives when `scatter` splits a batch of
# `batch` rows over `k` devices, as a list in device order. Devices that receive nothing do not appear.
# Work it out from the rule of this chapter, without calling `torch.chunk` or `data_parallel`.
# <!-- ja -->
# ### 練習問題 01.1: チャンクの大きさ
#
# `batch` 行のバッチを `scatter` が `k` 個のデバイスに分けるとき、各デバイスが受け取る行数をデバイスの順に並べたリストを返す `chunk_sizes(batch, k)` を書いてください。何も受け取らないデバイスはリストに含めません。`torch.chunk` や `data_parallel` を呼ばずに、この章の規則から求めてください。

# %%
# Exercise 01.1: starter
def chunk_sizes(batch, k):
    """Rows per device, in device order, when a batch of `batch` rows is scattered over `k` devices."""
    raise NotImplementedError("01.1")


# %%
check("01.1", chunk_sizes)

# %% [markdown]
# <!-- en -->
# ### Exercise 01.2: Linear scaling with warm-up
#
# Growing the global batch `k`-fold (one device's batch per device) calls for `k` times the learning rate, reached
# through a warm-up. Write `warmup_lr(step, base_lr, k, warmup_steps)`: the learning rate at optimizer step `step`
# (counted from 0) when the single-device rate is `base_lr`, the warm-up rises linearly from `base_lr` to
# `k * base_lr` over the first `warmup_steps` steps, and the rate stays at `k * base_lr` from then on.
# <!-- ja -->
# ### 練習問題 01.2: ウォームアップ付きの線形スケーリング則
#
# 全体のバッチを `k` 倍にする（デバイスごとに 1台分のバッチを割り当てる）なら、学習率も `k` 倍にし、ウォームアップを経てそこに到達させます。最適化のステップ `step`（0 から数えます）での学習率を返す `warmup_lr(step, base_lr, k, warmup_steps)` を書いてください。1台のときの学習率は `base_lr` で、最初の `warmup_steps` ステップの間に `base_lr` から `k * base_lr` まで直線的に上がり、その後は `k * base_lr` のままです。

# %%
# Exercise 01.2: starter
def warmup_lr(step, base_lr, k, warmup_steps):
    """The learning rate at step `step` under the linear scaling rule with a linear warm-up."""
    raise NotImplementedError("01.2")


# %%
check("01.2", warmup_lr)

# %% [markdown]
# <!-- en -->
# ### Exercise 01.3: One step on simulated devices
#
# Write `dp_sgd_step(model, X, Y, devices, lr)`: one step of plain SGD with learning rate `lr` on the mean squared
# error of `model` on `(X, Y)`, with the batch split over `devices` by `data_parallel`. The check gives you a
# model in float64, a batch of 63 rows (not a multiple of the 4 simulated devices) and compares the parameters
# after your step with one step on a single device.
# <!-- ja -->
# ### 練習問題 01.3: 模擬デバイスでの 1ステップ
#
# `(X, Y)` に対する `model` の平均二乗誤差で、学習率 `lr` のふつうの SGD を 1ステップ進める `dp_sgd_step(model, X, Y, devices, lr)` を書いてください。バッチは `data_parallel` で `devices` に分けます。チェックは float64 のモデルと 63行のバッチ（4つの模擬デバイスで割り切れない行数）を渡し、ステップ後のパラメータを 1つのデバイスでの 1ステップと比べます。

# %%
# Exercise 01.3: starter
def dp_sgd_step(model, X, Y, devices, lr):
    """One SGD step on the MSE loss, with the forward pass split over `devices` by data_parallel."""
    raise NotImplementedError("01.3")


# %%
check("01.3", dp_sgd_step)

# %% [markdown]
# <!-- en -->
# ### More questions
#
# 1. Repeat the one-step comparison of this chapter with 63 rows instead of 64. The result is still the same:
#    explain why, in terms of how the gradients of the replicas are combined.
# 2. Insert `nn.BatchNorm1d(32)` after the first linear layer of `single` and run the comparison again, once as
#    it is and once after calling `.eval()` on both models. Which case keeps the equality?
# <!-- ja -->
# ### その他の問い
#
# 1. この章の 1ステップの比較を 64行ではなく 63行でやり直してください。結果はやはり同じです。レプリカの勾配がどのように合わさるかという観点から、理由を説明してください。
# 2. `single` の最初の線形層の直後に `nn.BatchNorm1d(32)` を入れて、比較をもう一度実行してください。そのままの場合と、両方のモデルで `.eval()` を呼んだ場合の 2通りを試します。等しさが保たれるのはどちらでしょうか。
