# %% [markdown]
# <!-- en -->
# # 3. `data_parallel` from primitives
#
# `nn.DataParallel` is built from four functions in `torch.nn.parallel`, and they can be used on their own:
#
# - `replicate(module, devices)`: one copy of the module per device;
# - `scatter(inputs, devices)`: split the inputs along the first dimension, one chunk per device;
# - `parallel_apply(replicas, inputs)`: run each replica on its chunk, all at once;
# - `gather(outputs, device)`: concatenate the outputs along the first dimension on one device.
#
# This chapter takes them one at a time on small tensors, composes them into a `data_parallel` function, and
# then proves what the composition promises: the same outputs and the same gradients as a single device, for
# any batch size, including batches smaller than the number of devices.
# <!-- ja -->
# # 3. プリミティブから作る `data_parallel`
#
# `nn.DataParallel` は `torch.nn.parallel` にある 4つの関数で組み立てられていて、それぞれ単独でも使えます。
#
# - `replicate(module, devices)`: デバイスごとにモジュールのコピーを 1つ作ります。
# - `scatter(inputs, devices)`: 入力を 0次元目に沿ってチャンクに分け、各デバイスに 1つずつ分配（scatter）します。
# - `parallel_apply(replicas, inputs)`: 各レプリカに自分のチャンクを同時に計算させます。
# - `gather(outputs, device)`: 各デバイスの出力を 0次元目に沿って連結し、1つのデバイスに集約（gather）します。
#
# この章では、まず小さなテンソルでこれらを 1つずつ試し、次に組み合わせて `data_parallel` 関数を作ります。そして、この組み合わせが約束することを証明します。どんなバッチサイズでも（デバイスの数より小さなバッチでも）、出力と勾配が 1つのデバイスで計算した場合と同じになることです。

# %% tags=["nbval-ignore-output"]
import copy

import matplotlib.pyplot as plt
import torch
from matplotlib.patches import FancyBboxPatch
from torch import nn

import mparlib
import mparlib.parallel
import mparlib.plot

mparlib.plot.use_course_style()  # a font with Japanese glyphs for this notebook's figures
from mparlib.lang import tr

print(mparlib.report())
print(mparlib.profile_line())

# %% [markdown]
# <!-- en -->
# The table above depends on your machine; every other checked output prints the same on a laptop, on one GPU
# and on many. The whole chapter takes seconds, so both course profiles run the same cells.
#
# ## PyTorch's primitives need GPUs
#
# First the functions from `torch.nn.parallel` themselves. Asked to use the CPU, three of them refuse on every
# machine: `replicate` and `scatter` accept only GPU devices, and `gather` refuses tensors that live on the CPU.
# <!-- ja -->
# 上の表はマシンによって異なります。それ以外の検査対象の出力は、ノート PC でも GPU 1枚でも複数の GPU でも同じです。章全体が数秒で終わるので、どちらのプロファイルでも同じセルを実行します。
#
# ## PyTorch のプリミティブは GPU が必要
#
# まずは `torch.nn.parallel` の関数そのものを試します。CPU を使うよう指示すると、そのうち 3つはどのマシンでも拒否します。`replicate` と `scatter` は GPU のデバイスしか受け付けず、`gather` は CPU 上のテンソルを受け付けません。

# %%
def attempt(step, run):
    """Run one step; print and return the exception it raises, or None if it ran."""
    try:
        run()
    except Exception as err:
        print(f"{step:<15} {type(err).__name__}: {err}")
        return err
    print(f"{step:<15} {tr('ran', '実行できました')}")
    return None


torch.manual_seed(0)
net = nn.Linear(4, 2)
x = torch.randn(5, 4)
two_cpus = ["cpu", "cpu"]
refused = {
    "replicate": attempt("replicate", lambda: nn.parallel.replicate(net, two_cpus)),
    "scatter": attempt("scatter", lambda: nn.parallel.scatter(x, two_cpus)),
    "gather": attempt("gather", lambda: nn.parallel.gather([x[:3], x[3:]], "cpu")),
}

# %%
assert isinstance(refused["replicate"], ValueError)
assert isinstance(refused["scatter"], ValueError)
assert isinstance(refused["gather"], AssertionError)

# %% [markdown]
# <!-- en -->
# `parallel_apply` and the composed `nn.parallel.data_parallel` fail too on a machine without a GPU, with a
# message that depends on how PyTorch was installed (for example `Found no NVIDIA driver on your system`). On a
# GPU machine `parallel_apply` may run CPU modules. So the next printout depends on the machine, and the
# `assert` checks only the rule that holds everywhere: without a GPU, it fails.
# <!-- ja -->
# `parallel_apply` と、4つを組み合わせた `nn.parallel.data_parallel` も、GPU のないマシンでは失敗します。メッセージは PyTorch のインストール方法によって変わります（例: `Found no NVIDIA driver on your system`）。GPU のあるマシンでは、`parallel_apply` は CPU 上のモジュールを実行できる場合があります。そのため次の表示はマシンによって異なり、`assert` はどこでも成り立つ規則、つまり「GPU がなければ失敗する」ことだけを確かめます。

# %% tags=["nbval-ignore-output"]
refused["parallel_apply"] = attempt("parallel_apply", lambda: nn.parallel.parallel_apply([net, net], [x[:3], x[3:]]))
refused["data_parallel"] = attempt("data_parallel", lambda: nn.parallel.data_parallel(net, x, two_cpus))
if mparlib.num_gpus() == 0:
    assert refused["parallel_apply"] is not None and refused["data_parallel"] is not None

# %% [markdown]
# <!-- en -->
# To watch the data flow on any machine, the course uses `mparlib.parallel`: the same four functions, following
# the same rules, but accepting any list of devices. `["cpu"] * 3` lists the CPU three times, which gives three
# **simulated devices**: three replicas, three threads, one processor. Where the machine has GPUs, the same
# functions take `["cuda:0", "cuda:1", ...]`; the last section compares them with PyTorch's on real GPUs.
# <!-- ja -->
# どのマシンでもデータの流れを観察できるように、このコースでは `mparlib.parallel` を使います。同じ規則に従う同じ 4つの関数ですが、どんなデバイスのリストでも受け付けます。`["cpu"] * 3` は CPU を 3回並べたリストで、3つの**模擬デバイス**になります。レプリカが 3つ、スレッドが 3つ、プロセッサは 1つです。GPU のあるマシンでは、同じ関数に `["cuda:0", "cuda:1", ...]` を渡せます。最後の節では、本物の GPU 上で PyTorch の関数と結果を比べます。

# %%
from mparlib.parallel import gather, parallel_apply, replicate, scatter

devices = ["cpu"] * 3

# %% [markdown]
# <!-- en -->
# ## The four primitives, one at a time
#
# ### `replicate`
#
# Each replica holds copies of the original parameters, on its own device. The copies are made by a
# differentiable operation (`grad_fn` is a copy), not detached: gradients that reach a replica's weights flow on
# into the original's. Because they are not leaf tensors, the replicas' weights never receive a `.grad` of their own.
# <!-- ja -->
# ## 4つのプリミティブを 1つずつ
#
# ### `replicate`
#
# 各レプリカは、元のパラメータのコピーを自分のデバイス上に持ちます。コピーは切り離された（detach された）値ではなく、微分可能な演算で作られます（`grad_fn` がコピー演算になっています）。そのため、レプリカの重みに届いた勾配は、そのまま元の重みまで逆伝播します。レプリカの重みは葉テンソル（leaf tensor）ではないので、自分自身の `.grad` を持つことはありません。

# %%
replicas = replicate(net, devices)
for i, replica in enumerate(replicas):
    w = replica.weight
    print(tr(f"replica {i} on {w.device}: same values {torch.equal(w, net.weight)}, same tensor {w is net.weight}, "
             f"grad_fn {type(w.grad_fn).__name__}",
             f"レプリカ {i}（{w.device}）: 値が同じ {torch.equal(w, net.weight)}、同じテンソル {w is net.weight}、"
             f"grad_fn {type(w.grad_fn).__name__}"))

# %% [markdown]
# <!-- en -->
# ### `scatter`
#
# `scatter` splits along dimension 0 with `torch.chunk`: chunks of `ceil(7 / 3) = 3` rows, the last one smaller.
# As in chapter 1, row `i` of the test batch is filled with the number `i`, so each chunk shows which rows it
# holds.
# <!-- ja -->
# ### `scatter`
#
# `scatter` は `torch.chunk` で 0次元目に沿って分割します。各チャンクは `ceil(7 / 3) = 3` 行で、最後だけが小さくなります。1章と同じく、テスト用バッチの `i` 行目は数値 `i` で埋めてあるので、各チャンクがどの行を持っているかがわかります。

# %%
x = torch.arange(7, dtype=torch.float32).unsqueeze(1).repeat(1, 4)  # row i is filled with i
chunks = scatter(x, devices)
for i, chunk in enumerate(chunks):
    print(tr(f"chunk {i} on {chunk.device}: shape {tuple(chunk.shape)}, rows {chunk[:, 0].int().tolist()}",
             f"チャンク {i}（{chunk.device}）: 形状 {tuple(chunk.shape)}、行 {chunk[:, 0].int().tolist()}"))

# %% [markdown]
# <!-- en -->
# Inputs are often more than one tensor. `scatter` splits every tensor inside tuples, lists and dicts along
# the same dimension, and hands everything else (numbers, strings, `None`) to every chunk unchanged:
# <!-- ja -->
# 入力は 1つのテンソルとは限りません。`scatter` はタプル、リスト、辞書の中のテンソルをすべて同じ次元で分割し、それ以外のもの（数値、文字列、`None`）はそのまま各チャンクに渡します。

# %%
labels = torch.arange(7)
for i, part in enumerate(scatter({"x": x, "labels": labels, "scale": 0.5}, devices)):
    print(tr(f"chunk {i}: x {tuple(part['x'].shape)}, labels {part['labels'].tolist()}, scale {part['scale']}",
             f"チャンク {i}: x {tuple(part['x'].shape)}、labels {part['labels'].tolist()}、scale {part['scale']}"))

# %% [markdown]
# <!-- en -->
# ### `parallel_apply`
#
# `parallel_apply` starts one thread per replica and calls `replicas[i](chunks[i])` in each. On GPUs the threads
# launch kernels on different devices, which then compute at the same time. The lists must have the same length.
# <!-- ja -->
# ### `parallel_apply`
#
# `parallel_apply` はレプリカごとに 1つのスレッドを起動し、それぞれで `replicas[i](chunks[i])` を呼び出します。GPU の場合、各スレッドが別々のデバイスにカーネルを起動し、デバイスが同時に計算します。2つのリストの長さは同じでなければなりません。

# %%
outputs = parallel_apply(replicas, chunks)
for i, out in enumerate(outputs):
    print(tr(f"output {i} on {out.device}: shape {tuple(out.shape)}", f"出力 {i}（{out.device}）: 形状 {tuple(out.shape)}"))

# %% [markdown]
# <!-- en -->
# ### `gather`
#
# `gather` moves every output to one device and concatenates them along dimension 0, in replica order. The
# result is the output for the whole batch, and it is differentiable: `backward` on it reaches every replica.
# <!-- ja -->
# ### `gather`
#
# `gather` はすべての出力を 1つのデバイスに移し、レプリカの順に 0次元目に沿って連結します。結果はバッチ全体の出力で、微分可能です。ここから `backward` を呼ぶと、勾配はすべてのレプリカに届きます。

# %%
y = gather(outputs, "cpu")
print(tr("gathered:", "集約した結果:"), tuple(y.shape), tr("| same as net(x):", "| net(x) と同じ:"), torch.allclose(y, net(x)))

# %% [markdown]
# <!-- en -->
# ## Composing them: `data_parallel`
#
# Put together, the four steps are PyTorch's functional `data_parallel`, and the heart of `nn.DataParallel`.
# With no devices it simply calls the module. Note the line `replicas = replicas[:len(inputs)]`: `scatter` can
# return fewer chunks than there are devices, and `parallel_apply` needs one input per replica.
# <!-- ja -->
# ## 組み合わせる: `data_parallel`
#
# 4つの手順をまとめると、PyTorch の関数版 `data_parallel` になります。これは `nn.DataParallel` の中心部分でもあります。デバイスの指定がなければ、モジュールをそのまま呼び出します。`replicas = replicas[:len(inputs)]` の行に注目してください。`scatter` はデバイスの数より少ないチャンクを返すことがあり、`parallel_apply` はレプリカ 1つにつき入力 1つを必要とするからです。

# %%
def data_parallel(module, input, device_ids, output_device=None):
    """Compute module(input) with one replica per device in device_ids."""
    if not device_ids:  # nowhere to split to: an ordinary call
        return module(input)
    if output_device is None:
        output_device = device_ids[0]
    replicas = replicate(module, device_ids)
    inputs = scatter(input, device_ids)
    replicas = replicas[:len(inputs)]  # fewer chunks than devices: leave the extra replicas out
    outputs = parallel_apply(replicas, inputs)
    return gather(outputs, output_device)


print(tr("3 simulated devices:", "模擬デバイス 3つ:"), tuple(data_parallel(net, x, devices).shape))
print(tr("no devices:         ", "デバイスなし:    "), tuple(data_parallel(net, x, []).shape))

# %%
torch.testing.assert_close(data_parallel(net, x, devices), net(x))
torch.testing.assert_close(data_parallel(net, x, devices), mparlib.parallel.data_parallel(net, x, devices))

# %% [markdown]
# <!-- en -->
# `mparlib.parallel.data_parallel` is the same function with two additions that PyTorch's version also has:
# keyword arguments for the module (`module_kwargs`, split together with the inputs by `mparlib.scatter_kwargs`,
# so that the i-th chunk of each always meets on the same device) and a choice of the dimension to split (`dim`).
# Every device list goes through `mparlib.check_devices`, which checks each entry with `mparlib.check_device`: a
# GPU that does not exist here, or the CPU mixed with GPUs, is refused with a message saying what to use instead.
#
# The picture of one call, for the 7-row batch on 3 devices above:
# <!-- ja -->
# `mparlib.parallel.data_parallel` も同じ関数で、PyTorch の関数版と同じく 2つの機能を足してあります。モジュールへのキーワード引数（`module_kwargs`。入力と一緒に `mparlib.scatter_kwargs` で分割するので、それぞれの i 番目のチャンクは必ず同じデバイスに届きます）と、分割する次元の指定（`dim`）です。デバイスのリストはすべて `mparlib.check_devices` を通り、各要素を `mparlib.check_device` で確かめます。このマシンにない GPU や、GPU と CPU の混在は、代わりに何を使えばよいかを添えたメッセージで拒否します。
#
# 上の 7行のバッチを 3つのデバイスで処理する 1回の呼び出しを図にすると、次のようになります。

# %%
def box(ax, x, y, text, color, width=2.1, height=1.0):
    ax.add_patch(FancyBboxPatch((x - width / 2, y - height / 2), width, height, boxstyle="round,pad=0.06",
                                facecolor=color, edgecolor="black"))
    ax.text(x, y, text, ha="center", va="center", fontsize=8.5)


def arrow(ax, start, end, color):
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="-|>", color=color, lw=1.4))


def rows(n):
    return tr(f"{n} row" if n == 1 else f"{n} rows", f"{n}行")


sizes = [len(chunk) for chunk in scatter(x, devices)]
lanes = [4.2 - 1.7 * i for i in range(len(sizes))]
steps = {"replicate": "tab:gray", "scatter": "tab:blue", "parallel_apply": "tab:green", "gather": "tab:red"}
fig, ax = plt.subplots(figsize=(10, 5))
box(ax, 1.1, 5.0, tr("module\non device 0", "モジュール\n（デバイス 0）"), "whitesmoke")
box(ax, 1.1, 1.0, tr(f"mini-batch: {rows(len(x))}\non device 0",
                    f"ミニバッチ: {rows(len(x))}\n（デバイス 0）"), "#dbe9f6")
for i, (y_lane, size) in enumerate(zip(lanes, sizes)):
    box(ax, 4.6, y_lane, tr(f"device {i}\nreplica {i}\nchunk {i}: {rows(size)}",
                            f"デバイス {i}\nレプリカ {i}\nチャンク {i}: {rows(size)}"),
        "#f3f3f3", width=2.4, height=1.2)
    box(ax, 7.6, y_lane, tr(f"output {i}\n{rows(size)}", f"出力 {i}\n{rows(size)}"), "#e4f2e4", width=1.8)
    arrow(ax, (2.2, 4.9), (3.4, y_lane + 0.25), steps["replicate"])
    arrow(ax, (2.2, 1.1), (3.4, y_lane - 0.25), steps["scatter"])
    arrow(ax, (5.8, y_lane), (6.7, y_lane), steps["parallel_apply"])
    arrow(ax, (8.5, y_lane), (9.4, lanes[1]), steps["gather"])
box(ax, 10.5, lanes[1], tr(f"output: {rows(sum(sizes))}\non output_device",
                          f"出力: {rows(sum(sizes))}\n（output_device）"), "#f8e0e0")
places = {"replicate": (2.8, 5.9), "scatter": (2.8, -0.25), "parallel_apply": (6.2, 5.9), "gather": (9.2, 5.9)}
japanese = {"replicate": "複製", "scatter": "分配", "parallel_apply": "並列実行", "gather": "集約"}
for n, (name, color) in enumerate(steps.items(), 1):
    ax.text(*places[name], tr(f"{n}. {name}", f"{n}. {japanese[name]} ({name})"), color=color, fontsize=10,
            ha="center", va="center")
ax.set_xlim(-0.1, 11.8)
ax.set_ylim(-0.6, 6.2)
ax.axis("off")
ax.set_title(tr("Data flow of data_parallel", "data_parallel のデータの流れ"), fontsize=12)
fig.tight_layout()
plt.show()

# %% [markdown]
# <!-- en -->
# ## Proof: the same outputs and the same gradients
#
# Does splitting change anything? The claim is that `data_parallel(module, X, devices)` computes the same output
# as `module(X)`, and that a loss computed on it gives every parameter the same gradient. We check it for batches
# that divide evenly (8 rows), that do not (7), and that are smaller than the number of devices (2), on 1 to 4
# simulated devices. Computing in float64 leaves rounding no room to hide a difference, so the tolerance is
# `1e-12`.
# <!-- ja -->
# ## 証明: 同じ出力と同じ勾配
#
# 分割によって何かが変わるのでしょうか。主張は、`data_parallel(module, X, devices)` が `module(X)` と同じ出力を計算し、そこから計算した損失がどのパラメータにも同じ勾配を与える、というものです。割り切れるバッチ（8行）、割り切れないバッチ（7行）、デバイスの数より小さいバッチ（2行）について、1〜4個の模擬デバイスで確かめます。float64 で計算すれば丸め誤差に差が隠れる余地はないので、許容誤差は `1e-12` とします。

# %%
torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def output_and_grads(forward, X):
    """The output of forward(X) and every parameter's gradient of a loss computed on it."""
    mlp.zero_grad()
    out = forward(X)
    out.pow(2).mean().backward()
    return out.detach(), [p.grad.clone() for p in mlp.parameters()]


def max_gap(a, b):
    return max((s - t).abs().max().item() for s, t in zip(a, b))


proofs = []
for rows in (8, 7, 2):
    X = torch.randn(rows, 6, dtype=torch.float64)
    ref_out, ref_grads = output_and_grads(mlp, X)
    for k in (1, 2, 3, 4):
        out, grads = output_and_grads(lambda X: data_parallel(mlp, X, ["cpu"] * k), X)
        same_out, same_grads = max_gap([out], [ref_out]) < 1e-12, max_gap(grads, ref_grads) < 1e-12
        sizes = [len(chunk) for chunk in scatter(X, ["cpu"] * k)]
        proofs.append(same_out and same_grads)
        print(tr(f"{rows} rows on {k} device(s), chunks {str(sizes):<12} outputs equal: {same_out}, "
                 f"gradients equal: {same_grads}",
                 f"{rows}行を {k}つのデバイスへ: チャンク {str(sizes):<12} 出力が一致 {same_out}、勾配が一致 {same_grads}"))

# %%
assert len(proofs) == 12 and all(proofs)

# %% [markdown]
# <!-- en -->
# Why the gradients agree: the loss is computed on the gathered output, so it is the same function of the same
# numbers. In the backward pass, `gather` hands each replica the gradient for its own rows, and each replica's
# weights are copies of the originals, so their gradients flow back through the copy and **add up** in the
# original parameter's `.grad`. The sum over chunks is exactly the gradient over the whole batch. We can see the
# sum directly: backpropagate through two replicas, then compute each chunk's contribution on its own and add.
# <!-- ja -->
# 勾配が一致する理由は次のとおりです。損失は集約された出力から計算されるので、同じ数値に対する同じ関数です。逆伝播では、`gather` が各レプリカに自分の行の分の勾配を渡します。レプリカの重みは元の重みのコピーなので、勾配はコピー演算を通って逆伝播し、元のパラメータの `.grad` で**足し合わされます**。チャンクごとの勾配をすべて足すと、ちょうどバッチ全体に対する勾配になります。この和を直接確かめてみましょう。2つのレプリカを通して逆伝播した結果と、チャンクごとの寄与を別々に計算して足した結果を比べます。

# %%
two = ["cpu"] * 2
net.zero_grad()
replicas = replicate(net, two)
gather(parallel_apply(replicas, scatter(x, two)), "cpu").sum().backward()
through_replicas = net.weight.grad.clone()

per_chunk = []
for chunk in x.chunk(2):
    net.zero_grad()
    net(chunk).sum().backward()
    per_chunk.append(net.weight.grad.clone())
print(tr("replica weights are leaves (could hold a .grad):", "レプリカの重みは葉テンソル（.grad を持てる）:"),
      any(r.weight.is_leaf for r in replicas))
print(tr("sum of per-chunk gradients equals the gradient through the replicas:",
         "チャンクごとの勾配の和が、レプリカを通した勾配と一致:"),
      torch.allclose(per_chunk[0] + per_chunk[1], through_replicas))

# %% [markdown]
# <!-- en -->
# ## When the batch is smaller than the number of devices
#
# `torch.chunk` never returns empty chunks. A batch of 2 rows on 4 devices gives 2 chunks. More surprisingly, a
# batch of 6 rows gives only 3: `ceil(6 / 4) = 2` rows per chunk. `replicate` always makes one replica per
# device, so the two lists differ in length:
# <!-- ja -->
# ## バッチがデバイスの数より小さいとき
#
# `torch.chunk` は空のチャンクを返しません。2行のバッチを 4つのデバイスに分けるとチャンクは 2つです。少し意外なことに、6行のバッチでも 4つにはなりません。1チャンクあたり `ceil(6 / 4) = 2` 行なので、チャンクは 3つです。一方、`replicate` は常にデバイスごとに 1つのレプリカを作るので、2つのリストの長さが食い違います。

# %%
four = ["cpu"] * 4
for rows in (2, 6, 8):
    X = torch.randn(rows, 6, dtype=torch.float64)
    print(tr(f"{rows} rows on 4 devices: {len(replicate(mlp, four))} replicas, {len(scatter(X, four))} chunks",
             f"{rows}行を 4つのデバイスへ: レプリカ {len(replicate(mlp, four))}個、チャンク {len(scatter(X, four))}個"))

# %% [markdown]
# <!-- en -->
# Without `replicas[:len(inputs)]`, `parallel_apply` receives 4 replicas and 2 inputs and refuses (PyTorch's
# version raises an `AssertionError` with a similar message):
# <!-- ja -->
# `replicas[:len(inputs)]` がなければ、`parallel_apply` は 4つのレプリカと 2つの入力を受け取り、実行を拒否します（PyTorch の関数も、似たメッセージの `AssertionError` を送出します）。

# %%
X = torch.randn(2, 6, dtype=torch.float64)
try:
    parallel_apply(replicate(mlp, four), scatter(X, four))
    raise AssertionError("parallel_apply should refuse 4 replicas for 2 inputs")
except ValueError as err:
    print("ValueError:", err)
print(tr("with the slice:", "スライスを入れると:"), tuple(data_parallel(mlp, X, four).shape))

# %% [markdown]
# <!-- en -->
# ## The exception: batch normalization in training mode
#
# The proof above used a network whose output for a row depends only on that row. Batch normalization in
# training mode breaks that: it normalises each feature with the mean and variance of the rows it sees, and a
# replica sees only its chunk. Its running statistics are updated by replica 0 alone, because replica 0 shares
# the original's buffers while the other replicas' updates are discarded with the replicas. In evaluation mode,
# where the stored statistics are used, the outputs agree again.
# <!-- ja -->
# ## 例外: 訓練モードのバッチ正規化
#
# 上の証明で使ったネットワークでは、ある行の出力はその行だけで決まりました。訓練モードのバッチ正規化はこの前提を崩します。各特徴量を、自分が見た行の平均と分散で正規化するからです。レプリカが見るのは自分のチャンクだけです。また移動統計量を更新するのはレプリカ 0 だけです。レプリカ 0 は元のモジュールとバッファを共有していて、ほかのレプリカの更新はレプリカとともに捨てられるからです。保存された統計量を使う評価モードでは、出力は再び一致します。

# %%
torch.manual_seed(0)
bn_net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8)).double()
whole_batch, first_chunk = copy.deepcopy(bn_net), copy.deepcopy(bn_net)
X = torch.randn(8, 6, dtype=torch.float64)

split_out = data_parallel(bn_net, X, two)  # training mode, 4 rows per replica
whole_out = whole_batch(X)
first_chunk(X[:4])  # what replica 0 saw
print(tr("training mode, outputs equal:", "訓練モード、出力が一致:"), torch.allclose(split_out, whole_out))
print(tr("running mean equals that of replica 0's chunk:", "移動平均がレプリカ 0 のチャンクの平均と一致:"),
      torch.equal(bn_net[1].running_mean, first_chunk[1].running_mean))

whole_batch.load_state_dict(bn_net.state_dict())  # same statistics on both sides
bn_net.eval()
whole_batch.eval()
print(tr("evaluation mode, outputs equal:", "評価モード、出力が一致:"), torch.allclose(data_parallel(bn_net, X, two), whole_batch(X)))

# %% [markdown]
# <!-- en -->
# With several GPUs in training mode each replica normalises with the statistics of its own, smaller chunk. If
# that matters (small per-device batches), `nn.SyncBatchNorm` computes the statistics over all devices; it works
# with `DistributedDataParallel` (chapter 6), not with `nn.DataParallel`.
# <!-- ja -->
# 複数の GPU で訓練するとき、各レプリカは自分の小さなチャンクの統計量で正規化します。これが問題になる場合（デバイスあたりのバッチサイズが小さい場合）は、すべてのデバイスにまたがって統計量を計算する `nn.SyncBatchNorm` を使います。これは `nn.DataParallel` ではなく `DistributedDataParallel` と組み合わせて使います（6章）。

# %% [markdown]
# <!-- en -->
# ## On real GPUs: agreement with `torch.nn.parallel`
#
# With two or more GPUs, the next cell runs PyTorch's own primitives and `mparlib.parallel` on the same GPUs and
# the same batch, and checks that outputs and gradients agree. Elsewhere it says it has nothing to compare.
# <!-- ja -->
# ## 本物の GPU で: `torch.nn.parallel` との一致
#
# GPU が 2枚以上あれば、次のセルは PyTorch 自身のプリミティブと `mparlib.parallel` を同じ GPU、同じバッチで実行し、出力と勾配が一致することを確かめます。それ以外のマシンでは、比べるものがないと表示します。

# %% tags=["nbval-ignore-output"]
gpus = [torch.device("cuda", i) for i in range(mparlib.num_gpus())]
if len(gpus) >= 2:
    torch.manual_seed(0)
    theirs = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(gpus[0])
    ours = copy.deepcopy(theirs)
    X = torch.randn(11, 6, device=gpus[0])

    chunks_theirs, chunks_ours = nn.parallel.scatter(X, gpus), scatter(X, gpus)
    print(tr("chunks:", "チャンク:"), [tuple(c.shape) for c in chunks_theirs], [str(c.device) for c in chunks_ours])
    assert len(chunks_theirs) == len(chunks_ours)
    assert all(torch.equal(a, b) and a.device == b.device for a, b in zip(chunks_theirs, chunks_ours))

    out_theirs = nn.parallel.data_parallel(theirs, X, gpus)
    out_ours = mparlib.parallel.data_parallel(ours, X, gpus)
    out_theirs.pow(2).mean().backward()
    out_ours.pow(2).mean().backward()
    out_gap = (out_theirs - out_ours).abs().max().item()
    grad_gap = max((a.grad - b.grad).abs().max().item() for a, b in zip(theirs.parameters(), ours.parameters()))
    print(tr(f"on {len(gpus)} GPUs: output on {out_ours.device}, largest output difference {out_gap:.1e}, "
             f"largest gradient difference {grad_gap:.1e}",
             f"GPU {len(gpus)}枚: 出力のデバイス {out_ours.device}、出力の差の最大値 {out_gap:.1e}、"
             f"勾配の差の最大値 {grad_gap:.1e}"))
    assert out_ours.device == out_theirs.device == gpus[0]
    assert out_gap < 1e-5 and grad_gap < 1e-5
else:
    print(tr(f"{len(gpus)} GPU(s) here: torch.nn.parallel needs at least 2 to split anything, so there is "
             "nothing to compare.",
             f"このマシンの GPU は {len(gpus)}枚です。torch.nn.parallel で分割するには 2枚以上必要なので、"
             "比べるものがありません。"))

# %% [markdown]
# <!-- en -->
# ## Summary
#
# - `replicate`, `scatter`, `parallel_apply` and `gather` are the whole of data parallelism in one process;
#   `data_parallel` is the four in a row, plus `replicas[:len(inputs)]` for batches that give fewer chunks than
#   devices.
# - PyTorch's versions need GPUs; `mparlib.parallel` follows the same rules on any list of devices, including
#   simulated ones (`["cpu"] * k`).
# - Replica weights are differentiable copies, so backward sums each chunk's gradient into the original
#   parameters: outputs and gradients equal those of a single device, for any batch size.
# - Batch normalization in training mode is the exception: per-chunk statistics, and running statistics from
#   replica 0 only.
# <!-- ja -->
# ## まとめ
#
# - `replicate`、`scatter`、`parallel_apply`、`gather` の 4つで、1つのプロセス内のデータ並列はすべて表せます。`data_parallel` はこの 4つを順に呼ぶだけで、チャンクの数がデバイスの数より少ない場合に備えて `replicas[:len(inputs)]` を加えてあります。
# - PyTorch の関数は GPU を必要とします。`mparlib.parallel` は同じ規則に従いつつ、模擬デバイス（`["cpu"] * k`）を含むどんなデバイスのリストでも動きます。
# - レプリカの重みは微分可能なコピーなので、逆伝播は各チャンクの勾配を元のパラメータで足し合わせます。そのため、どんなバッチサイズでも出力と勾配は 1つのデバイスの場合と同じです。
# - 訓練モードのバッチ正規化は例外です。統計量はチャンクごとに計算され、移動統計量はレプリカ 0 だけが更新します。

# %% [markdown]
# <!-- en -->
# ## Exercises
#
# Each exercise has a **starter** cell whose function body is `raise NotImplementedError`: replace that line with your
# code, run the cell, then run the check cell below it. The primitives imported above (`replicate`, `scatter`,
# `parallel_apply`, `gather`) are yours to use. The check says *not attempted*, *wrong* (the first difference and one
# hint for the likely mistake), *error* (your exception, or your code ending its process), *right*, *cannot run here*
# or *the check itself failed* (never a verdict on your answer); it never prints the answer. Your function runs in a
# fresh worker process and is stopped after 30 s. `hint("03.1")` prints the next hint level each time you call it and
# says when none is left; `hint("03.1", 2)` prints a given level.
# <!-- ja -->
# ## 練習問題
#
# 各練習問題には、本体が `raise NotImplementedError` だけの関数を含む**スターター**のセルがあります。その行を自分のコードに置き換えてセルを実行し、すぐ下のチェックのセルを実行してください。上でインポートしたプリミティブ（`replicate`、`scatter`、`parallel_apply`、`gather`）は自由に使えます。チェックの結果は「未着手」、「不正解」（最初の違いと、ありがちな間違いに合わせたヒント 1つ）、「エラー」（発生した例外、またはコードがプロセスを終了させたこと）、「正解」、「この環境では実行できません」、「チェック自体の不具合」（あなたの答えの判定ではありません）のどれかで、答えそのものは表示しません。関数は新しいワーカープロセスで実行し、30秒で止めます。`hint("03.1")` は呼ぶたびに次の段階のヒントを表示し、もう残っていなければそう伝えます。`hint("03.1", 2)` は指定した段階のヒントを表示します。

# %%
from mparlib.exercises import check, hint

# %% [markdown]
# <!-- en -->
# ### Exercise 03.1: Scattering a batch
#
# A batch often comes as a dict: inputs, labels, a mask, and a few values that are not per example (a flag, a
# name). Write `scatter_batch(batch, devices)` without calling `scatter`: a list with one dict per device that
# receives rows, each with all the keys, holding the device's chunk of every tensor (split along dimension 0 by
# `torch.chunk`'s rule, moved to that device) and every other value unchanged.
# <!-- ja -->
# ### 練習問題 03.1: バッチの分配
#
# バッチは dict で届くことがよくあります。入力、ラベル、マスク、それに例ごとではないいくつかの値（フラグ、名前）です。`scatter` を呼ばずに `scatter_batch(batch, devices)` を書いてください。行を受け取るデバイスごとに 1つの dict を並べたリストを返します。各 dict はすべてのキーを持ち、テンソルはそのデバイスのチャンク（`torch.chunk` の規則で次元 0 に沿って分け、そのデバイスへ移したもの）、ほかの値はそのままです。

# %%
# Exercise 03.1: starter
def scatter_batch(batch, devices):
    """One dict per used device: the device's chunk of each tensor, every other value as it is."""
    raise NotImplementedError("03.1")


# %%
check("03.1", scatter_batch)

# %% [markdown]
# <!-- en -->
# ### Exercise 03.2: `data_parallel` along another dimension
#
# Sequence models often take inputs of shape (time, batch, features): the batch is dimension 1. Write
# `dp_along(module, x, devices, dim)`, this chapter's `data_parallel` for a batch along `dim`, with the result on
# `devices[0]`. The check uses a module that mixes each sequence over time, so splitting along the wrong
# dimension changes the result, and batches smaller than the number of devices.
# <!-- ja -->
# ### 練習問題 03.2: 別の次元に沿った `data_parallel`
#
# 系列のモデルは、形状が（時間、バッチ、特徴）の入力を受け取ることがよくあります。バッチは次元 1 です。バッチが次元 `dim` にある場合の、この章の `data_parallel` にあたる `dp_along(module, x, devices, dim)` を書いてください。結果は `devices[0]` に置きます。チェックは各系列を時間方向に混ぜるモジュールを使うので、違う次元で分けると結果が変わります。デバイスの数より小さいバッチも使います。

# %%
# Exercise 03.2: starter
def dp_along(module, x, devices, dim):
    """module(x) computed with one replica per device, the batch being dimension `dim` of x."""
    raise NotImplementedError("03.2")


# %%
check("03.2", dp_along)

# %% [markdown]
# <!-- en -->
# ### Exercise 03.3: One loss from chunk losses
#
# Suppose each replica computes the mean loss of its own chunk. Write `combine_losses(chunk_losses,
# chunk_sizes)`: from those means (0-d tensors that require gradients) and the chunks' sizes, the loss that one
# device computes on the whole batch, as a tensor through which `backward` works. The check uses uneven splits,
# as `scatter` makes them.
# <!-- ja -->
# ### 練習問題 03.3: チャンクの損失から 1つの損失へ
#
# 各レプリカが、自分のチャンクの平均損失を計算するとします。その平均（勾配を必要とする 0次元のテンソル）とチャンクの大きさから、1つのデバイスがバッチ全体で計算する損失を求める `combine_losses(chunk_losses, chunk_sizes)` を書いてください。結果は `backward` が使えるテンソルにします。チェックは、`scatter` が作るような割り切れない分け方を使います。

# %%
# Exercise 03.3: starter
def combine_losses(chunk_losses, chunk_sizes):
    """The full-batch mean loss from the chunks' mean losses and sizes (differentiable)."""
    raise NotImplementedError("03.3")


# %%
check("03.3", combine_losses)

# %% [markdown]
# <!-- en -->
# ### More questions
#
# 1. Delete the line `replicas = replicas[:len(inputs)]` from this notebook's `data_parallel` and call it with 2
#    rows on 4 devices. Which primitive complains?
# 2. Repeat the proof with the loss `out.pow(2).sum()` instead of `.mean()`. Does the equality still hold? What
#    would change if each replica computed its own mean loss and the losses were added afterwards?
# <!-- ja -->
# ### その他の問い
#
# 1. このノートブックの `data_parallel` から `replicas = replicas[:len(inputs)]` の行を消し、2行のバッチを 4つのデバイスで処理してください。どのプリミティブがエラーを出すでしょうか。
# 2. 証明の損失を `.mean()` ではなく `out.pow(2).sum()` にしてやり直してください。等しさは保たれるでしょうか。また、各レプリカが自分のチャンクで平均の損失を計算し、それらを後から足し合わせたとしたら、何が変わるでしょうか。
