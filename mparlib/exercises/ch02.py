"""Checks of chapter 02's exercises: who answers a name, the `module.` prefix, what a load would miss.

Explained in 02_wrapped_attributes.
"""
import torch
from torch import nn

from ..lang import tr
from ..wrapper import AttrDataParallel
from .core import call, exercise, in_worker, right, wrong


class _Model(nn.Module):
    """A model with extras, one of them colliding with DataParallel's names (``dim``, ``gather``)."""

    def __init__(self):
        super().__init__()
        self.class_names, self.dim = ["cat", "dog"], 8
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        self.head = nn.Linear(8, 2)
        self.register_buffer("scale", torch.ones(1))

    def forward(self, x):
        return self.head(self.body(x)) * self.scale

    def predict(self, x):
        return self(x).argmax(1)

    def gather(self, outputs):
        return outputs


def _owner(wrapper, name):
    tables = [wrapper.__dict__.get(t, {}) for t in ("_parameters", "_buffers", "_modules")]
    if name in vars(wrapper) or hasattr(type(wrapper), name) or any(name in t for t in tables):
        return "wrapper"
    return "model" if hasattr(wrapper.module, name) else None


NAMES_02_1 = ["forward", "predict", "module", "device_ids", "class_names", "head", "dim", "gather", "training",
              "scale", "parameters", "no_such_name", "body", "output_device"]


@exercise("02.1", title=("Who answers the name?", "名前に答える側の判定"), hints=[
    ("Read 'Where attributes live' and the lookup order listed under 'A subclass that works'.",
     "「属性の置き場所」と、「正しく動くサブクラス」の下にある探索の順序を読んでください。"),
    ("Three places belong to the wrapper: its instance __dict__, its class (with the parents), and nn.Module's "
     "tables _parameters, _buffers and _modules. Only a name found in none of them goes to the wrapped model.",
     "ラッパーのものは 3か所です。インスタンスの __dict__、クラス（親クラスを含む）、そして nn.Module の表 "
     "_parameters、_buffers、_modules です。どこにもない名前だけが、ラップされたモデルに回ります。"),
    ("Ask the wrapper's own places first, in the order Python's lookup uses them (the instance's `__dict__`, "
     "then its class), then the three tables that `nn.Module.__getattr__` searches; only when none of them has "
     "the name, ask the wrapped model.",
     "まずラッパー自身の置き場所を、Python の探索と同じ順（インスタンスの `__dict__`"
     "、次にクラス）で調べ、次に `nn.Module.__getattr__` が探す 3"
     "つの表を調べます。どこにも名前がないときだけ、包まれたモデルを調べます。"),
], mistakes={
    "model_first": ("For a name both have (dim, gather), the wrapper wins: Python's own lookup finds it before "
                    "__getattr__ is ever called.",
                    "両方にある名前（dim、gather）では、ラッパーが優先されます。__getattr__ が呼ばれる前に、Python 自身の"
                    "探索で見つかるからです。"),
    "tables_missed": ("`module` is the wrapper's own: it sits in the wrapper's _modules table, not in its __dict__.",
                      "`module` はラッパー自身のものです。__dict__ ではなく、ラッパーの _modules の表にあります。"),
    "none_for_missing": ("A name neither has must give None.", "どちらにもない名前には None を返してください。"),
})
def check_02_1(answer):
    """The check of exercise 02.1, "Who answers the name?". Explained in 02_wrapped_attributes."""
    wrapper = AttrDataParallel(_Model())
    for name in NAMES_02_1:
        got, expected = call(answer, wrapper, name), _owner(wrapper, name)
        if got == expected:
            continue
        key = "none_for_missing" if expected is None else "tables_missed" if name == "module" else \
            "model_first" if got == "model" and hasattr(wrapper.module, name) else None
        return wrong(tr(f"owner(wrapper, {name!r}) returned {got!r}, which is not right.",
                        f"owner(wrapper, {name!r}) が {got!r} を返しましたが、これは正しくありません。"), key)
    return right(tr(f"Right for all {len(NAMES_02_1)} names, collisions included.",
                    f"衝突する名前も含め、{len(NAMES_02_1)}個の名前すべてで正しい答えです。"))


def _strip(state):
    return {(k[len("module."):] if k.startswith("module.") else k): v for k, v in state.items()}


def _states_02_2():
    model = _Model()
    plain = model.state_dict()
    yield {"module." + k: v for k, v in plain.items()}
    yield dict(plain)
    inner = nn.Sequential()
    inner.add_module("module", nn.Linear(2, 2))  # a submodule really named "module"
    yield {"module." + k: v for k, v in nn.ModuleDict({"encoder": inner}).state_dict().items()}
    yield {"module.module.weight": torch.zeros(2), "module.embedding.weight": torch.ones(3)}


def _their_strip(answer, state):
    """Where the learner's code runs: their renamed dict, and whether they changed the one they were given."""
    before = dict(state)
    got = call(answer, state)
    return got, state != before or list(state) != list(before)


@exercise("02.2", title=("Removing the `module.` prefix", "`module.` の接頭辞の除去"), hints=[
    ("See 'Checkpoints across wrapped and plain models': which keys does a wrapper add, and where?",
     "「ラップしたモデルとしていないモデルの間のチェックポイント」を見てください。ラッパーはどのキーの、どこに何を"
     "加えますか。"),
    ("Only a prefix at the very start of a key is the wrapper's; the same word later in a key may be a real "
     "submodule's name. Return a new dict and leave the one you were given as it is.",
     "ラッパーが加えたのは、キーの先頭にある接頭辞だけです。キーの途中にある同じ語は、本物のサブモジュールの名前"
     "かもしれません。新しい dict を返し、受け取った dict は変えないでください。"),
    ("Build a new dict in the same order. Each key decides for itself whether it starts with the prefix; take "
     "the prefix off by its length, not with `str.lstrip` (which strips characters of a set, not a prefix).",
     "同じ順序で新しい dict"
     " を作ります。接頭辞で始まるかどうかはキーごとに判定し、接頭辞は長さで取り除きます。`str.lstrip`"
     " は使いません（接頭辞ではなく、集合に含まれる文字を取り除くからです）。"),
], mistakes={
    "everywhere": ("You removed `module.` inside keys too: `encoder.module.weight` belongs to a submodule that is "
                   "really called `module`.",
                   "キーの途中の `module.` まで取り除いています。`encoder.module.weight` は、本当に `module` という"
                   "名前のサブモジュールのものです。"),
    "lstrip": ("A key lost letters of its own name: str.lstrip(\"module.\") strips any of the characters m, o, d, "
               "u, l, e and the dot, not the prefix.",
               "キーが自分の名前の文字まで失っています。str.lstrip(\"module.\") が取り除くのは m、o、d、u、l、e と"
               "ピリオドのどれかの文字で、接頭辞ではありません。"),
    "mutated": ("The dict you were given was changed. Build and return a new one.",
                "受け取った dict が変わっています。新しい dict を作って返してください。"),
    "values": ("The keys are right but a value is not the tensor that was stored under that key.",
               "キーは正しいのですが、値がそのキーに保存されていたテンソルではありません。"),
})
def check_02_2(answer):
    """The check of exercise 02.2, "Removing the `module.` prefix". Explained in 02_wrapped_attributes."""
    for state in _states_02_2():
        before = dict(state)
        got, mutated = in_worker(_their_strip, answer, state)
        expected = _strip(before)
        if mutated:
            return wrong(tr("Your function changed the dict it was given.", "関数が受け取った dict を変えました。"),
                         "mutated")
        if not isinstance(got, dict) or list(got) != list(expected):
            keys = list(got)[:6] if isinstance(got, dict) else got
            lost = isinstance(got, dict) and any(k.lstrip("module.") in got for k in before if k not in got)
            inner = isinstance(got, dict) and any(".module." in k for k in before) and \
                not any(".module." in k for k in got)
            return wrong(tr(f"For keys {list(before)[:4]}... your keys are {keys}.",
                            f"キー {list(before)[:4]}... に対するあなたのキーは {keys} です。"),
                         "lstrip" if lost else "everywhere" if inner else None)
        if any(not (isinstance(got[k], torch.Tensor) and torch.equal(got[k], expected[k])) for k in expected):
            return wrong(tr("A value changed on the way.", "途中で値が変わりました。"), "values")
    return right(tr("Right for wrapped, plain and tricky state dicts.",
                    "ラップしたもの、していないもの、紛らわしいもの、どの状態辞書でも正しい答えです。"))


def _sorted(keys):
    """``keys`` sorted, when they are a list, tuple or set of strings; else ``None``."""
    ok = isinstance(keys, (list, tuple, set)) and all(isinstance(k, str) for k in keys)
    return sorted(keys) if ok else None


def _report(model, state):
    own, theirs = set(model.state_dict()), set(state)
    return sorted(own - theirs), sorted(theirs - own)


def _cases_02_3():
    torch.manual_seed(0)
    model = _Model()
    torch.manual_seed(1)
    full = _Model().state_dict()  # other values: a load would show
    partial = {k: v for k, v in full.items() if k != "head.bias"}
    with_extra = {**full, "head.extra": torch.zeros(1)}
    no_stats = {k: v for k, v in full.items() if "running" not in k and "scale" not in k}
    wrapped = {"module." + k: v for k, v in full.items()}
    return [(model, partial), (model, with_extra), (model, no_stats), (model, wrapped), (model, full)]


def _their_report(answer, model, state):
    """Where the learner's code runs: their report, and whether it changed the model's values (a load)."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = call(answer, model, dict(state))
    return got, any(k not in before or not torch.equal(before[k], v) for k, v in model.state_dict().items())


@exercise("02.3", title=("What a load would miss", "読み込みで足りないもの"), hints=[
    ("Look at the error a strict load_state_dict prints in 'Checkpoints across wrapped and plain models', and at "
     "the model's state dict: which entries does it have besides the parameters?",
     "「ラップしたモデルとしていないモデルの間のチェックポイント」で厳密な load_state_dict が表示するエラーと、"
     "モデルの状態辞書を見てください。パラメータのほかにどんな項目がありますか。"),
    ("Missing: keys the model expects and the file lacks. Unexpected: keys in the file the model does not have. "
     "The model's keys are those of its state dict: parameters and buffers.",
     "足りないキーは、モデルが必要としファイルにないもの。余分なキーは、ファイルにあってモデルにないものです。"
     "モデルのキーは状態辞書のキー、つまりパラメータとバッファです。"),
    ("Treat both as sets of keys: the missing keys are in the model's set and not in the file's, the "
     "unexpected ones the other way round. Sort each result.",
     "両方をキーの集合として扱います。足りないキーはモデルの集合にあってファイルの集合にないもの、余分なキーはその逆です。それぞれの結果を並べ替えます。"),
], mistakes={
    "parameters_only": ("You compared with the parameters alone: the running statistics and other buffers are "
                        "part of a checkpoint too (named_buffers, or simply state_dict).",
                        "パラメータだけと比べています。移動統計量などのバッファもチェックポイントの一部です"
                        "（named_buffers、または state_dict をそのまま使います）。"),
    "swapped": ("Missing and unexpected are swapped: missing keys are the model's, unexpected ones the file's.",
                "足りないキーと余分なキーが入れ替わっています。足りないのはモデルのキー、余分なのはファイルのキーです。"),
    "loaded": ("Your function changed the model: report what a load would do without doing it.",
               "関数がモデルを変えました。読み込んだらどうなるかを、実際には読み込まずに答えてください。"),
})
def check_02_3(answer):
    """The check of exercise 02.3, "What a load would miss". Explained in 02_wrapped_attributes."""
    for model, state in _cases_02_3():
        got, loaded = in_worker(_their_report, answer, model, state)
        expected = _report(model, state)
        if loaded:
            return wrong(tr("The model's values changed.", "モデルの値が変わりました。"), "loaded")
        pair = [_sorted(g) for g in got] if isinstance(got, tuple) and len(got) == 2 else None
        if pair == list(expected):
            continue
        shown = got if not isinstance(got, tuple) else tuple(g if _sorted(g) is None else _sorted(g)[:5] for g in got)
        swapped = pair is not None and pair[::-1] == list(expected)
        params = set(dict(model.named_parameters()))
        params_only = pair is not None and pair[0] == sorted(params - set(state))
        return wrong(tr(f"For a file with {len(state)} keys your function returned {shown}.",
                        f"キーが {len(state)}個のファイルに対して、関数は {shown} を返しました。"),
                     "swapped" if swapped else "parameters_only" if params_only else None)
    return right(tr("Right for missing, unexpected, wrapped and matching files.",
                    "足りないキー、余分なキー、ラップしたもの、一致するもの、どのファイルでも正しい答えです。"))
