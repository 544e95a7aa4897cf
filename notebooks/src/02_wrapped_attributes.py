# %% [markdown]
# <!-- en -->
# # 2. Attributes of a wrapped module
#
# Real models carry more than `forward`: class names, a `predict` helper, a hidden width, a configuration.
# After `model = nn.DataParallel(model)` all of that seems to be gone. This chapter explains where it went,
# why the one-line fix that circulates in tutorials crashes, what works instead, and how to save and load
# checkpoints so that wrapping never costs you a trained model.
# <!-- ja -->
# # 2. ラップしたモジュールの属性
#
# 実際のモデルは `forward` 以外にも、クラス名、`predict` のような補助メソッド、隠れ層の幅、設定値などを持っています。ところが `model = nn.DataParallel(model)` と書いた途端、それらが見えなくなったように感じます。この章では、属性がどこへ行ったのか、チュートリアルで紹介されている 1行の回避策がなぜ失敗するのか、代わりに何を使えばよいのかを説明します。最後に、ラップしても訓練済みのモデルを失わないチェックポイントの保存と読み込みを扱います。

# %% tags=["nbval-ignore-output"]
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

import mparlib
from mparlib.checkpoint import load_checkpoint, save_checkpoint, unwrap
from mparlib.errors import CheckpointMismatchError
from mparlib.lang import tr
from mparlib.wrapper import AttrDataParallel

print(mparlib.report())
print(mparlib.profile_line())

# %% [markdown]
# <!-- en -->
# The table above depends on your machine. Everything else this chapter checks prints the same on a laptop, on
# one GPU and on many, and takes a few seconds in either course profile.
#
# ## A model with extras
#
# A small classifier with the kind of extras real models have: a list of class names, its hidden width `dim`,
# and a method `predict` that returns names instead of numbers. Batch normalization gives it buffers (running
# statistics) as well as parameters, which matters for checkpoints later.
# <!-- ja -->
# 上の表はマシンによって異なります。それ以外にこの章で検査する出力は、ノート PC でも GPU 1枚でも複数の GPU でも同じで、どちらのプロファイルでも数秒で終わります。
#
# ## 付加情報を持つモデル
#
# 実際のモデルが持っているような付加情報を備えた、小さな分類器を用意します。クラス名のリスト、隠れ層の幅 `dim`、そして数値ではなくクラス名を返すメソッド `predict` です。バッチ正規化を入れてあるので、パラメータに加えてバッファ（移動統計量）も持ちます。これは後半のチェックポイントの話で効いてきます。

# %%
class Classifier(nn.Module):
    """A tiny classifier with class names, a width and a predict() helper."""

    def __init__(self, class_names, dim=16):
        super().__init__()
        self.class_names = list(class_names)
        self.dim = dim
        self.body = nn.Sequential(nn.Linear(4, dim), nn.BatchNorm1d(dim), nn.ReLU())
        self.head = nn.Linear(dim, len(self.class_names))

    def forward(self, x):
        return self.head(self.body(x))

    def predict(self, x):
        """The name of the most likely class for each row of x."""
        with torch.no_grad():
            return [self.class_names[i] for i in self(x).argmax(dim=1).tolist()]


torch.manual_seed(0)
device = mparlib.try_gpu()
names = ["cat", "dog", "bird"]
model = Classifier(names).to(device)
model(torch.randn(32, 4).to(device))  # one training-mode pass moves the running statistics
model.eval()
x = torch.randn(5, 4).to(device)  # drawn on the CPU: the same numbers on every machine
print(model.predict(x))
print(model.class_names, model.dim)

# %% [markdown]
# <!-- en -->
# ## After wrapping, the extras are out of reach
#
# Wrap the model and ask for the same method. The wrapper computes the same `forward`, but `predict` is not
# found:
# <!-- ja -->
# ## ラップしたあとは手の届かない付加情報
#
# モデルをラップして、同じメソッドを呼んでみます。ラッパーは同じ `forward` を計算しますが、`predict` は見つかりません。

# %%
wrapped = nn.DataParallel(model)
try:
    wrapped.predict(x)
except AttributeError as err:
    print("AttributeError:", err)

# %% [markdown]
# <!-- en -->
# The same happens to every name the model defines and the wrapper does not:
# <!-- ja -->
# モデルにはあってラッパーにはない名前は、どれも同じ結果になります。

# %%
for name in ["predict", "class_names", "head", "body"]:
    print(tr(f"{name:<12} on the model: {hasattr(model, name)!s:<5}  on the wrapper: {hasattr(wrapped, name)}",
             f"{name:<12} モデル: {hasattr(model, name)!s:<5}  ラッパー: {hasattr(wrapped, name)}"))

# %% [markdown]
# <!-- en -->
# ### Where attributes live
#
# Python looks up `wrapped.predict` in two stages. First the normal lookup: the instance's `__dict__`, then the
# class and its parents. Only if that fails does it call the class's `__getattr__`. `nn.Module` stores
# parameters, buffers and submodules in three tables (`_parameters`, `_buffers`, `_modules`) instead of
# `__dict__`, and its `__getattr__` searches those tables, *of the wrapper only*. The model sits in the
# wrapper's `_modules` under the name `module`; its methods and attributes are one level further down, where
# nobody looks.
# <!-- ja -->
# ### 属性の置き場所
#
# Python は `wrapped.predict` を 2段階で探します。まず通常の探索で、インスタンスの `__dict__`、次にクラスとその親クラスを調べます。そこで見つからなかったときにだけ、クラスの `__getattr__` を呼びます。`nn.Module` はパラメータ、バッファ、サブモジュールを `__dict__` ではなく 3つの表（`_parameters`、`_buffers`、`_modules`）にしまっていて、`__getattr__` はその表を探します。ただし、探すのはラッパー自身の表だけです。モデルはラッパーの `_modules` に `module` という名前で入っていて、そのメソッドや属性はさらに 1段下にあるため、誰にも探されません。

# %%
print(tr("'module' in the wrapper's __dict__:    ", "ラッパーの __dict__ に 'module' がある:   "), "module" in vars(wrapped))
print(tr("the wrapper's _modules:                ", "ラッパーの _modules:                      "), list(wrapped._modules))
print(tr("wrapped.module is model:               ", "wrapped.module は model そのもの:         "), wrapped.module is model)
print(tr("'class_names' in the model's __dict__: ", "モデルの __dict__ に 'class_names' がある:"), "class_names" in vars(model))
print(tr("'predict' in the model's class:        ", "モデルのクラスに 'predict' がある:        "), "predict" in vars(Classifier))

# %% [markdown]
# <!-- en -->
# Why doesn't `nn.DataParallel` simply pass unknown names on to the model? Because it has many names of its
# own, and a model may well use the same ones: `module`, `device_ids`, `output_device`, `dim`, `forward`,
# `replicate`, `scatter`, `parallel_apply`, `gather`, plus everything `nn.Module` defines (`train`, `to`,
# `parameters`, `state_dict`, ...). Automatic forwarding would make the meaning of such a name depend on
# which object happens to define it. `Classifier.dim` is an example, as we will see below.
#
# The plain way out always works: go through `.module`.
# <!-- ja -->
# では、なぜ `nn.DataParallel` は知らない名前をモデルへ転送しないのでしょうか。ラッパー自身が多くの名前を持っていて、モデルが同じ名前を使うことも十分ありうるからです。`module`、`device_ids`、`output_device`、`dim`、`forward`、`replicate`、`scatter`、`parallel_apply`、`gather`、さらに `nn.Module` が定義するすべての名前（`train`、`to`、`parameters`、`state_dict` など）があります。自動で転送すると、こうした名前の意味が、たまたまどちらのオブジェクトが定義しているかで変わってしまいます。後で見るように、`Classifier.dim` がその例です。
#
# 素直な解決策は、必ず `.module` を経由することです。これはいつでも動きます。

# %%
print(wrapped.module.predict(x))
print(unwrap(wrapped).class_names)  # mparlib.unwrap also removes DDP and torch.compile wrappers

# %% [markdown]
# <!-- en -->
# ## The one-line subclass, and why it recurses
#
# A widespread suggestion is a subclass that forwards every missing name to the wrapped module:
# `def __getattr__(self, name): return getattr(self.module, name)`. On today's PyTorch it never returns. The cell
# below runs it with the recursion limit lowered (and restored afterwards) so that it fails in a fraction of a
# second instead of after thousands of calls.
# <!-- ja -->
# ## 1行で書くサブクラスと、それが再帰する理由
#
# よく紹介されているのが、見つからない名前をすべてラップしたモジュールへ転送するサブクラスです。`def __getattr__(self, name): return getattr(self.module, name)` の 1行だけです。しかし現在の PyTorch では、これは決して値を返しません。次のセルでは再帰の上限を一時的に下げて（終わったら元に戻します）実行し、何千回も呼び出す前にすぐ失敗させます。

# %% tags=["raises-exception"]
class ForwardingDataParallel(nn.DataParallel):
    def __getattr__(self, name):
        return getattr(self.module, name)  # the tutorial's one line


limit = sys.getrecursionlimit()
sys.setrecursionlimit(len(traceback.extract_stack()) + 30)  # fail after about 30 nested calls
try:
    ForwardingDataParallel(model).predict(x)
finally:
    sys.setrecursionlimit(limit)

# %% [markdown]
# <!-- en -->
# The traceback repeats one line until Python gives up. Follow the lookup of `predict`:
#
# 1. `predict` is not in the wrapper's `__dict__` or class, so Python calls `ForwardingDataParallel.__getattr__(self, "predict")`.
# 2. That evaluates `self.module`. But `module` is not in `__dict__` either: it lives in `self._modules`, and only
#    `nn.Module.__getattr__` knows to look there. The subclass has replaced that method, so Python calls
#    `ForwardingDataParallel.__getattr__(self, "module")`.
# 3. That evaluates `self.module` again, which calls `__getattr__(self, "module")` again, and so on.
#
# We can watch the names being requested with a copy that logs each call and stops after five. (It behaves
# like `nn.Module` while the wrapper is being built, because on a one-GPU machine `nn.DataParallel.__init__`
# itself reads `self.module`.)
# <!-- ja -->
# トレースバックには同じ行が繰り返し現れ、最後に Python があきらめます。`predict` の探索を順に追ってみましょう。
#
# 1. `predict` はラッパーの `__dict__` にもクラスにもないので、Python は `ForwardingDataParallel.__getattr__(self, "predict")` を呼びます。
# 2. そこで `self.module` が評価されます。ところが `module` も `__dict__` にはありません。`self._modules` の中にあり、そこを探すことを知っているのは `nn.Module.__getattr__` だけです。サブクラスがこのメソッドを置き換えてしまったので、Python は `ForwardingDataParallel.__getattr__(self, "module")` を呼びます。
# 3. その中で再び `self.module` が評価され、また `__getattr__(self, "module")` が呼ばれ、以下同様に続きます。
#
# 呼び出しのたびに名前を記録し、5回で止まるようにした版で、要求される名前を観察してみます（GPU が 1枚のマシンでは `nn.DataParallel.__init__` 自体が `self.module` を読むので、ラッパーを組み立てている間は `nn.Module` と同じように振る舞わせています）。

# %%
asked = []


class TracedForwarding(nn.DataParallel):
    """The one-line __getattr__, logging each requested name and stopping after five calls."""

    tracing = False  # a class attribute: found by the normal lookup, never through __getattr__

    def __getattr__(self, name):
        if not self.tracing:
            return super().__getattr__(name)
        asked.append(name)
        if len(asked) == 5:
            raise RuntimeError(tr("stopped after 5 calls", "5回で打ち切りました"))
        return getattr(self.module, name)


traced = TracedForwarding(model)
traced.tracing = True
try:
    traced.predict(x)
except RuntimeError as err:
    print(err)
print(asked)

# %% [markdown]
# <!-- en -->
# ## A subclass that works
#
# The fix is to ask `nn.Module`'s own `__getattr__` first. It finds the wrapper's parameters, buffers and
# submodules, `module` among them, without recursion. Only names it cannot find go to the wrapped model:
# <!-- ja -->
# ## 正しく動くサブクラス
#
# 直し方は、まず `nn.Module` 自身の `__getattr__` に尋ねることです。これならラッパーのパラメータ、バッファ、サブモジュール（`module` もその 1つ）を再帰なしで見つけられます。そこで見つからなかった名前だけを、ラップしたモデルに転送します。

# %%
class ForwardingFixed(nn.DataParallel):
    def __getattr__(self, name):
        try:
            return super().__getattr__(name)  # the wrapper's own tables, including "module"
        except AttributeError:
            return getattr(super().__getattr__("module"), name)


fixed = ForwardingFixed(model)
print(fixed.predict(x))
print(fixed.class_names, type(fixed.head).__name__)

# %% [markdown]
# <!-- en -->
# `mparlib.AttrDataParallel` is the same idea with clearer error messages and a test suite; the rest of the
# course uses it. Its lookup order for `wrapper.name` is:
#
# 1. what Python finds by itself: methods and properties of the class (`forward`, `train`, `parameters`, ...)
#    and the wrapper's own instance attributes (`device_ids`, `training`, ...);
# 2. the wrapper's own parameters, buffers and submodules, above all `module`;
# 3. the attribute of that name on the wrapped model.
#
# So `nn.DataParallel`'s names always win, and the model's extras fill the gaps.
# <!-- ja -->
# `mparlib.AttrDataParallel` も同じ考え方で、エラーメッセージをわかりやすくし、テストで裏付けたものです。このコースの以降の章ではこちらを使います。`wrapper.name` を探す順序は次のとおりです。
#
# 1. Python が自分で見つけるもの: クラスのメソッドとプロパティ（`forward`、`train`、`parameters` など）と、ラッパー自身のインスタンス属性（`device_ids`、`training` など）
# 2. ラッパー自身のパラメータ、バッファ、サブモジュール（特に `module`）
# 3. ラップしたモデルにある同名の属性
#
# つまり `nn.DataParallel` 自身の名前が常に優先され、足りないところをモデルの付加情報が埋めます。

# %%
awrapped = AttrDataParallel(model)
print(awrapped.predict(x))
print(awrapped.class_names)
print(tr("awrapped.module is model:", "awrapped.module は model そのもの:"), awrapped.module is model)
print(tr("forward is DataParallel's:", "forward は DataParallel のもの:"), type(awrapped).forward is nn.DataParallel.forward)
print(tr("device_ids is DataParallel's:", "device_ids はラッパー自身のもの:"),
      awrapped.device_ids is vars(awrapped)["device_ids"])

# %%
for name in ["predict", "class_names", "head", "body", "module", "device_ids"]:
    assert getattr(awrapped, name) == getattr(fixed, name), name
assert awrapped.predict(x) == model.predict(x)

# %% [markdown]
# <!-- en -->
# ### When names collide
#
# `Classifier` has an attribute `dim`, its hidden width. `nn.DataParallel` also has a `dim`: the dimension it
# splits along (0). But it creates that attribute only on a machine with GPUs; without one, its constructor
# stops early, and a forwarding wrapper would then answer `dim` with the model's `16` on a laptop and with its own
# `0` on a GPU machine. `AttrDataParallel` therefore sets `dim`, `output_device` and `src_device_obj` itself on
# every machine: `awrapped.dim` is the wrapper's `0` everywhere, and the model's value is one `.module` away.
# <!-- ja -->
# ### 名前が衝突するとき
#
# `Classifier` には隠れ層の幅を表す属性 `dim` があります。`nn.DataParallel` にも `dim`（分割する次元、値は 0）があります。ただし `nn.DataParallel` がこの属性を作るのは GPU のあるマシンだけで、GPU がなければコンストラクタは途中で終わります。そのままでは、転送するラッパーは `dim` に対して、ノート PC ではモデルの `16` を、GPU のあるマシンでは自分の `0` を返してしまいます。そこで `AttrDataParallel` は、どのマシンでも `dim`、`output_device`、`src_device_obj` を自分で設定します。`awrapped.dim` はどこでもラッパーの `0` で、モデルの値は `.module` を付ければ得られます。

# %%
print("model.dim:", model.dim, "  awrapped.dim:", awrapped.dim, "  awrapped.module.dim:", awrapped.module.dim)

# %%
assert awrapped.dim == 0 and awrapped.output_device == vars(awrapped)["output_device"]  # the same on every machine
assert awrapped.module.dim == model.dim == 16

# %% [markdown]
# <!-- en -->
# The lesson: forwarding is a convenience for names the wrapper does not have. For anything that could collide,
# write `wrapper.module.name`.
#
# Assignment does not forward at all. `awrapped.class_names = [...]` creates an attribute on the wrapper, and the
# model keeps its own list:
# <!-- ja -->
# ここから言えるのは、転送はラッパーが持っていない名前のための便宜にすぎない、ということです。衝突しうる名前には `wrapper.module.name` と書きましょう。
#
# 代入はまったく転送されません。`awrapped.class_names = [...]` はラッパーに新しい属性を作るだけで、モデルのリストは元のままです。

# %%
awrapped.class_names = ["CAT", "DOG", "BIRD"]
print("awrapped.class_names:", awrapped.class_names)
print("model.class_names:   ", model.class_names)
del awrapped.class_names  # back to forwarding
print(tr("after del:           ", "del の後:            "), awrapped.class_names)

# %% [markdown]
# <!-- en -->
# ## Checkpoints across wrapped and plain models
#
# The extra level shows up in the state dict too: every key of the wrapper starts with `module.`.
# <!-- ja -->
# ## ラップしたモデルとしていないモデルの間のチェックポイント
#
# 1段の入れ子は状態辞書（state dict）にも現れます。ラッパーのキーはすべて `module.` で始まります。

# %%
plain_keys, wrapped_keys = list(model.state_dict()), list(wrapped.state_dict())
for plain_key, wrapped_key in list(zip(plain_keys, wrapped_keys))[:4]:
    print(f"{plain_key:<28} {wrapped_key}")
print(tr(f"... {len(plain_keys)} keys in both", f"... キーはどちらも {len(plain_keys)}個"))

# %% [markdown]
# <!-- en -->
# A checkpoint saved from the wrapper therefore does not load into a plain model (the usual situation: train
# on several GPUs, evaluate on a laptop), and vice versa. `load_state_dict` is strict by default and lists every
# key it misses:
# <!-- ja -->
# そのため、ラッパーから保存したチェックポイントはラップしていないモデルに読み込めません（複数の GPU で訓練し、ノート PC で評価するというよくある状況です）。逆も同じです。`load_state_dict` は既定で厳密にキーを照合し、足りないキーをすべて列挙します（メッセージは PyTorch のもので、英語のまま表示されます）。

# %%
fresh = Classifier(names)
try:
    fresh.load_state_dict(wrapped.state_dict())
except RuntimeError as err:
    lines = str(err).splitlines()
    print(f"{type(err).__name__}: {lines[0]}")
    for line in lines[1:]:
        print("   ", line.strip()[:90], "...")

# %% [markdown]
# <!-- en -->
# Two rules avoid the problem:
#
# - **Save** the plain model's state: `unwrap(model).state_dict()` (or `model.module.state_dict()`). Then
#   the file has no prefix, whatever was wrapped when you saved.
# - **Load** with the prefix removed if it is there. PyTorch has a helper for old files,
#   `torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, "module.")`:
# <!-- ja -->
# 次の 2つの規則を守れば、この問題は起きません。
#
# - **保存**するときは、ラップしていないモデルの状態を保存します。`unwrap(model).state_dict()`（または `model.module.state_dict()`）です。こうすれば、保存時にラップしていたかどうかに関係なく、ファイルのキーに接頭辞が付きません。
# - **読み込む**ときは、接頭辞があれば取り除きます。古いファイルのために、PyTorch には `torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, "module.")` という補助関数があります。

# %%
state = wrapped.state_dict()
consume_prefix_in_state_dict_if_present(state, "module.")  # edits the dict in place
print(fresh.load_state_dict(state))

# %% [markdown]
# <!-- en -->
# `mparlib.save_checkpoint(model, path, **extra)` follows the first rule for plain and wrapped models alike,
# stores extra values such as the epoch, and writes the file atomically (a temporary file, then a rename, done by
# `mparlib.files.atomic_write_bytes`), so a crash never leaves half a checkpoint. It replaces only a checkpoint it
# wrote itself, never another file, unless told `overwrite=True`. `mparlib.state_dict_of(model)` is the state
# dict it saves: the plain module's, under any wrapper. `mparlib.load_checkpoint(model, path)` loads into a plain
# or a wrapped model, strips `module.` when needed, refuses any mismatch, and returns the extra values.
#
# Let us check that nothing is lost on the way plain → file → wrapped → file → plain. "Nothing" means every
# parameter and every buffer (the batch-norm running statistics and its batch counter), bit for bit.
# <!-- ja -->
# `mparlib.save_checkpoint(model, path, **extra)` は、ラップしたモデルでもしていないモデルでも 1つ目の規則どおりに保存し、エポック数などの追加の値も一緒に保存します。ファイルは一時ファイルに書いてから名前を変える方法（`mparlib.files.atomic_write_bytes`）でアトミックに書き込むので、途中で落ちても壊れたチェックポイントが残ることはありません。上書きするのは自分で書いたチェックポイントだけで、それ以外のファイルは `overwrite=True` を指定しない限り上書きしません。保存する状態辞書は `mparlib.state_dict_of(model)` が返すもので、どのラッパーの下でもラップしていないモジュールの状態辞書です。`mparlib.load_checkpoint(model, path)` は、ラップしたモデルにもしていないモデルにも読み込め、必要なら `module.` を取り除き、食い違いがあれば読み込みを拒否し、追加の値を返します。
#
# 「ラップしていないモデル → ファイル → ラップしたモデル → ファイル → ラップしていないモデル」と渡しても何も失われないことを確かめます。ここで「何も」とは、すべてのパラメータとすべてのバッファ（バッチ正規化の移動統計量とバッチ数のカウンタ）を、1ビットの違いもなく、という意味です。

# %%
def same_state(a, b):
    """True if two models hold bit-identical parameters and buffers under the same names."""
    sa, sb = unwrap(a).state_dict(), unwrap(b).state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


with tempfile.TemporaryDirectory() as folder:
    first, second = Path(folder) / "plain.pt", Path(folder) / "wrapped.pt"
    save_checkpoint(model, first, epoch=3)

    torch.manual_seed(1)
    middle = nn.DataParallel(Classifier(names).to(device))  # different random weights
    print(tr("before loading, same as the original:", "読み込む前、元のモデルと同じ:"), same_state(middle, model))
    extra = load_checkpoint(middle, first)
    print(tr("extra values:", "追加の値:"), extra)
    save_checkpoint(middle, second, epoch=extra["epoch"] + 1)

    last = Classifier(names)
    load_checkpoint(last, second)
    print(tr("after the round trip, same as the original:", "往復した後、元のモデルと同じ:"), same_state(last, model))
    print(tr("keys in the file:", "ファイルのキー:"), list(torch.load(second, weights_only=True)["model"])[:3], "...")

# %%
assert same_state(last, model)
last.eval()
assert last.predict(x.cpu()) == model.predict(x)

# %% [markdown]
# <!-- en -->
# A checkpoint that does not fit the model is an error that says what differs, never a silent partial load.
# Here the model has four classes but the file was saved from a three-class model:
# <!-- ja -->
# モデルに合わないチェックポイントはエラーになり、何が違うのかを教えてくれます。黙って一部だけ読み込むことはありません。次の例では、3クラスのモデルから保存したファイルを 4クラスのモデルに読み込もうとしています。

# %%
with tempfile.TemporaryDirectory() as folder:
    path = Path(folder) / "three_classes.pt"
    save_checkpoint(model, path)
    try:
        load_checkpoint(Classifier(["cat", "dog", "bird", "fish"]), path)
        raise AssertionError("a mismatched checkpoint must not load")
    except CheckpointMismatchError as err:
        print(type(err).__name__)
        for key, saved, wanted in err.shapes:
            print(tr(f"  {key}: file {tuple(saved)}, model {tuple(wanted)}",
                     f"  {key}: ファイル {tuple(saved)}、モデル {tuple(wanted)}"))

# %% [markdown]
# <!-- en -->
# ## Summary
#
# - `nn.DataParallel` keeps the model as its submodule `module`; `nn.Module.__getattr__` searches only the
#   wrapper's own tables, so the model's methods and attributes raise `AttributeError` on the wrapper.
# - The tutorial's one-line `__getattr__` recurses forever: `self.module` is itself found only through
#   `__getattr__`. Asking `super().__getattr__` first fixes it; `mparlib.AttrDataParallel` does that.
# - The wrapper's own names win over the model's; `dim` even depends on whether the machine has a GPU. Use
#   `wrapper.module.name` whenever a name could collide, and assign through `.module`.
# - Save `unwrap(model).state_dict()` (or use `mparlib.save_checkpoint`), and checkpoints move freely between
#   wrapped and plain models, bit for bit.
# <!-- ja -->
# ## まとめ
#
# - `nn.DataParallel` はモデルをサブモジュール `module` として保持します。`nn.Module.__getattr__` が探すのはラッパー自身の表だけなので、モデルのメソッドや属性をラッパー経由で参照すると `AttributeError` になります。
# - チュートリアルの 1行の `__getattr__` は無限に再帰します。`self.module` 自体が `__getattr__` を通してしか見つからないからです。先に `super().__getattr__` に尋ねれば直り、`mparlib.AttrDataParallel` はそのように実装されています。
# - ラッパー自身の名前はモデルの名前より優先されます。`dim` に至っては、マシンに GPU があるかどうかで意味が変わります。衝突しうる名前には `wrapper.module.name` を使い、代入も `.module` を通して行いましょう。
# - `unwrap(model).state_dict()` を保存すれば（または `mparlib.save_checkpoint` を使えば）、チェックポイントはラップしたモデルとしていないモデルの間を 1ビットも失わずに行き来できます。

# %% [markdown]
# <!-- en -->
# ## Exercises
#
# Each exercise has a **starter** cell whose function body is `raise NotImplementedError`: replace that line with your
# code, run the cell, then run the check cell below it. The check says *not attempted*, *wrong* (the first difference
# and one hint for the likely mistake), *error* (your exception, or your code ending its process), *right*, *cannot
# run here* or *the check itself failed* (never a verdict on your answer); it never prints the answer. Your function
# runs in a fresh worker process and is stopped after 30 s. `hint("02.1")` prints the next hint level each time you
# call it and says when none is left; `hint("02.1", 2)` prints a given level.
# <!-- ja -->
# ## 練習問題
#
# 各練習問題には、本体が `raise NotImplementedError` だけの関数を含む**スターター**のセルがあります。その行を自分のコードに置き換えてセルを実行し、すぐ下のチェックのセルを実行してください。チェックの結果は「未着手」、「不正解」（最初の違いと、ありがちな間違いに合わせたヒント 1つ）、「エラー」（発生した例外、またはコードがプロセスを終了させたこと）、「正解」、「この環境では実行できません」、「チェック自体の不具合」（あなたの答えの判定ではありません）のどれかで、答えそのものは表示しません。関数は新しいワーカープロセスで実行し、30秒で止めます。`hint("02.1")` は呼ぶたびに次の段階のヒントを表示し、もう残っていなければそう伝えます。`hint("02.1", 2)` は指定した段階のヒントを表示します。

# %%
from mparlib.exercises import check, hint

# %% [markdown]
# <!-- en -->
# ### Exercise 02.1: Who answers the name?
#
# Write `owner(wrapper, name)` for an `AttrDataParallel` wrapper: return `"wrapper"` if `wrapper.name` is answered
# by the wrapper itself, `"model"` if the lookup goes on to the wrapped model, and `None` if neither has the name.
# Decide it from where the name lives, without calling `getattr(wrapper, name)`. The check asks about methods,
# buffers, submodules, plain attributes and names that both have.
# <!-- ja -->
# ### 練習問題 02.1: 名前に答える側の判定
#
# `AttrDataParallel` のラッパーについて、`wrapper.name` にラッパー自身が答えるなら `"wrapper"`、探索がラップされたモデルまで進むなら `"model"`、どちらにもその名前がなければ `None` を返す `owner(wrapper, name)` を書いてください。`getattr(wrapper, name)` を呼ばずに、名前がどこにあるかから判断します。チェックはメソッド、バッファ、サブモジュール、ふつうの属性、両方にある名前について尋ねます。

# %%
# Exercise 02.1: starter
def owner(wrapper, name):
    """"wrapper", "model" or None: who answers `wrapper.name` for an AttrDataParallel wrapper."""
    raise NotImplementedError("02.1")


# %%
check("02.1", owner)

# %% [markdown]
# <!-- en -->
# ### Exercise 02.2: Removing the `module.` prefix
#
# Write `strip_module_prefix(state)`: a new state dict in which every key that starts with `module.` loses that
# one prefix; other keys, the order and the tensors stay as they are, and `state` itself is not changed. It is
# what loading a checkpoint saved from a wrapper into a plain model needs. Beware of keys in which `module`
# is a real submodule's name.
# <!-- ja -->
# ### 練習問題 02.2: `module.` の接頭辞の除去
#
# `module.` で始まるキーからその接頭辞を 1つだけ取り除いた、新しい状態辞書を返す `strip_module_prefix(state)` を書いてください。ほかのキー、順序、テンソルはそのままにし、`state` 自体は変えません。ラッパーから保存したチェックポイントをラップしていないモデルに読み込むときに必要な処理です。`module` が本物のサブモジュールの名前になっているキーに気をつけてください。

# %%
# Exercise 02.2: starter
def strip_module_prefix(state):
    """A new state dict with one leading "module." removed from each key that has it."""
    raise NotImplementedError("02.2")


# %%
check("02.2", strip_module_prefix)

# %% [markdown]
# <!-- en -->
# ### Exercise 02.3: What a load would miss
#
# Write `missing_and_unexpected(model, state)`: the keys of the model's state that the checkpoint `state` lacks,
# and the keys of `state` that the model does not have, as two sorted lists, without loading anything into the
# model. The check compares your lists with the keys themselves on incomplete, extended, wrapped and matching
# checkpoints of a model with batch normalization.
# <!-- ja -->
# ### 練習問題 02.3: 読み込みで足りないもの
#
# モデルの状態のうちチェックポイント `state` にないキーと、`state` にあってモデルにないキーを、並べ替えた 2つのリストとして返す `missing_and_unexpected(model, state)` を書いてください。モデルには何も読み込みません。チェックは、バッチ正規化を含むモデルの、欠けたもの、余分なものを含むもの、ラップしたもの、一致するものの各チェックポイントで、あなたのリストをキーそのものと比べます。

# %%
# Exercise 02.3: starter
def missing_and_unexpected(model, state):
    """(missing, unexpected): sorted lists of keys, without loading anything."""
    raise NotImplementedError("02.3")


# %%
check("02.3", missing_and_unexpected)

# %% [markdown]
# <!-- en -->
# ### More questions
#
# 1. Add a property `num_classes` to `Classifier` (returning `len(self.class_names)`). Check that
#    `AttrDataParallel` reaches it and `nn.DataParallel` does not.
# 2. Save a checkpoint the naive way, `torch.save(wrapped.state_dict(), path)`, and load it into a plain
#    `Classifier` with `mparlib.load_checkpoint`. Verify with `same_state` that nothing was lost.
# 3. Make an incomplete checkpoint: `state = unwrap(model).state_dict()`, `del state["head.bias"]`,
#    `torch.save(state, path)`. Load it into a fresh `Classifier` with `load_checkpoint`, once as it is and once
#    with `strict=False`. What does each call tell you, and which values does the model hold afterwards?
# <!-- ja -->
# ### その他の問い
#
# 1. `Classifier` にプロパティ `num_classes`（`len(self.class_names)` を返す）を追加してください。`AttrDataParallel` からは参照でき、`nn.DataParallel` からは参照できないことを確かめます。
# 2. 素朴な方法 `torch.save(wrapped.state_dict(), path)` でチェックポイントを保存し、`mparlib.load_checkpoint` でラップしていない `Classifier` に読み込んでください。`same_state` で何も失われていないことを確かめます。
# 3. 不完全なチェックポイントを作ってください。`state = unwrap(model).state_dict()`、`del state["head.bias"]`、`torch.save(state, path)` の順に実行します。これを `load_checkpoint` で新しい `Classifier` に読み込みます。そのままの場合と `strict=False` を付けた場合で、それぞれ何が報告されるでしょうか。読み込んだ後のモデルはどの値を持っているでしょうか。
