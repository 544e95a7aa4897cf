"""The machinery behind ``check`` and ``hint``: the registry, outcomes, calls into the learner's code, ranks.

A chapter's module (``mparlib/exercises/chNN.py``) registers one check function per exercise with
:func:`exercise`; :func:`check` finds it from the exercise number alone (``"08.2"`` imports ``chNN`` = ``ch08``),
so a new chapter needs no central list. A check function receives the learner's answer and returns an
:class:`Outcome` (:func:`right`, :func:`wrong`, :func:`cannot_run`). It runs in the kernel and reaches the
learner's code only through :func:`call`, :func:`call_each`, :func:`in_worker` (a clean worker process, see
:mod:`~mparlib.exercises.sandbox`) or ``ch06.run_children`` (ranks started from such a worker), which bring back
plain data and turn the learner's own failure into a "not attempted", "wrong" or "error" outcome. Anything else a check function raises is the check's fault, and is
reported as such, with its traceback, never as a wrong answer. Explained in 01_dataparallel.
"""
import ast
import importlib
import inspect
import math
import os
import pickle
import re
import signal
import sys
import tempfile
import textwrap
import traceback
from dataclasses import dataclass
from html import escape
from pathlib import Path

import torch

from ..errors import ConfigError, MparlibError, WorkerFailed
from ..files import atomic_write_bytes
from ..lang import tr
from . import sandbox

NUMBER = re.compile(r"^(\d\d)\.(\d+)$")
HERE = Path(__file__).resolve().parent
NEEDS = (None, "gpu", "processes")

# status -> (mark, English, Japanese)
STATUSES = {
    "not attempted": ("○", "not attempted", "未着手"),
    "wrong": ("✗", "wrong", "不正解"),
    "error": ("!", "error", "エラー"),
    "right": ("✓", "right", "正解"),
    "cannot run here": ("–", "cannot run here", "この環境では実行できません"),
    "check failed": ("‼", "the check itself failed", "チェック自体の不具合"),
}

# Mistake hints every exercise knows; an exercise may give its own text for the same key.
COMMON_MISTAKES = {
    "hang": ("A rank waited for a partner that never came. Every collective must be called by every rank, in the "
             "same order; every send needs a matching recv on the other side. Look for an `if rank == ...` around a "
             "collective, or two ranks that both receive first.",
             "あるランクが、来ない相手を待ち続けました。集合通信はすべてのランクが同じ順序で呼ぶ必要があり、send には"
             "相手側の recv が対応していなければなりません。集合通信を囲む `if rank == ...` や、両方のランクが先に受信"
             "しようとしていないかを探してください。"),
    "stuck": ("Your function did not return in time. Look for a loop whose condition never becomes false, a wait that "
              "nothing ends, or far more work than the exercise asks for (and do not catch every exception around "
              "it: the check ends the process that runs it all the same).",
              "関数が時間内に戻りませんでした。条件がいつまでも偽にならないループ、何も終わらせない待ち、問題が求める"
              "よりはるかに多い計算を探してください（そのまわりですべての例外を捕まえても、チェックは実行中のプロセスを"
              "終了します）。"),
    "shape": ("The result has the wrong shape or type: compare what your function returns with what the exercise "
              "asks for.",
              "結果の形状か型が違います。関数が返すものと、問題が求めるものを比べてください。"),
}


@dataclass
class Exercise:
    """One registered exercise: its number, hints, mistake hints and check function. For check authors: see the package docstring."""
    number: str
    check: object
    hints: list
    mistakes: dict
    needs: str | None = None
    title: tuple | None = None
    limit: float = 30.0

    def hint_text(self, level):
        """The hint of ``level`` (1 = where to look ... last = one step short of the code), in the learner's
        language."""
        return tr(*self.hints[level - 1])

    def mistake_text(self, key):
        """The hint for the likely mistake ``key``."""
        pair = self.mistakes.get(key) or COMMON_MISTAKES.get(key)
        return tr(*pair) if pair else None


REGISTRY = {}
SHOWN = {}  # number -> the last hint level hint() showed


LIMITS = {None: 30.0, "gpu": 30.0, "processes": 240.0}  # seconds a whole check may run (about 10x its longest here)


def exercise(number, hints, mistakes=None, needs=None, title=None, limit=None):
    """Register the decorated function as the check of exercise ``number`` ("01.1"). For check authors: see the package docstring.

    ``hints``: two or more ``(en, ja)`` pairs, level 1 first (where to look), the last one step short of the code,
    never the answer. ``mistakes``: ``{key: (en, ja)}``, the hint for each likely mistake a :func:`wrong` outcome
    can name.
    ``needs``: ``None``, ``"gpu"`` (else the outcome is "cannot run here") or ``"processes"`` (distributed).
    ``limit``: seconds the check may spend in the learner's code, which is then ended (default: :data:`LIMITS` by
    ``needs``). Every check is judged apart: it runs in the kernel, and the learner's code (reached through
    :func:`call`, :func:`call_each`, :func:`in_worker` or ``ch06.run_children``) in clean worker processes
    (:mod:`~mparlib.exercises.sandbox`): the check's values and verdict stay out of the answer's reach.
    """
    if not (isinstance(number, str) and NUMBER.match(number)):
        raise ConfigError(f"exercise({number!r}): use a number like '01.1' (chapter.exercise).")
    if not (isinstance(hints, (list, tuple)) and len(hints) >= 2
            and all(isinstance(h, tuple) and len(h) == 2 for h in hints)):
        raise ConfigError(f"exercise({number!r}): give at least two hints, each an (en, ja) pair.")
    if needs not in NEEDS:
        raise ConfigError(f"exercise({number!r}): needs={needs!r}; use one of {NEEDS}.")

    def register(fn):
        REGISTRY[number] = Exercise(number, fn, list(hints), dict(mistakes or {}), needs, title,
                                    float(limit or LIMITS[needs]))
        return fn

    return register


def lookup(number):
    """The :class:`Exercise` of ``number``, importing its chapter's module on first use. For check authors: see the package docstring."""
    match = NUMBER.match(number) if isinstance(number, str) else None
    if match and number not in REGISTRY:
        try:
            importlib.import_module(f"mparlib.exercises.ch{match.group(1)}")
        except ModuleNotFoundError as e:
            if e.name != f"mparlib.exercises.ch{match.group(1)}":
                raise
    if number not in REGISTRY:
        known = ", ".join(sorted(REGISTRY)) or "-"
        raise ConfigError(tr(f"There is no exercise {number!r}. Write the number as a string, e.g. check(\"01.1\", "
                             f"my_function). Exercises loaded so far: {known}.",
                             f"練習問題 {number!r} はありません。番号は check(\"01.1\", my_function) のように文字列で"
                             f"書いてください。読み込み済みの練習問題: {known}。"))
    return REGISTRY[number]


def registered():
    """Every exercise of every chapter module present, by number (imports them all). For check authors: see the package docstring."""
    for path in sorted(HERE.glob("ch[0-9][0-9].py")):
        importlib.import_module(f"mparlib.exercises.{path.stem}")
    return dict(sorted(REGISTRY.items()))


# ---- Outcomes ------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What a check found: ``status`` (one of :data:`STATUSES`), a message, a hint. For check authors: see the package docstring.

    ``hint_key`` names the likely mistake behind a wrong answer (``None``: no particular one, hint level 1 is shown).
    ``details`` holds a traceback (the learner's for "error", the check's own for "check failed").
    """
    status: str
    message: str = ""
    hint_key: str | None = None
    details: str = ""
    number: str = ""
    hint: str = ""
    levels: int = 0  # how many hint levels the exercise has (0: no hint goes with this outcome)

    @property
    def ok(self):
        """True only for a right answer."""
        return self.status == "right"

    def heading(self):
        mark, en, ja = STATUSES[self.status]
        return f"{mark} {tr('Exercise', '練習問題')} {self.number}: {tr(en, ja)}"

    def __repr__(self):
        parts = [self.heading()]
        if self.message:
            parts.append(self.message)
        if self.details:
            parts.append(self.details.rstrip())
        if self.hint:
            parts.append(tr("Hint: ", "ヒント: ") + self.hint)
        if self.levels:
            parts.append(self._more())
        return "\n".join(parts)

    def _more(self):
        return tr(f"More hints: hint({self.number!r}) shows the next of its {self.levels} levels, one at a time.",
                  f"さらにヒント: hint({self.number!r}) を実行するたびに、全 {self.levels}段階のヒントを 1段階ずつ"
                  "表示します。")

    def _repr_html_(self):
        def text(s):
            return re.sub(r"`([^`]+)`", r"<code>\1</code>", escape(s))

        css = {"right": "ok", "wrong": "bad", "error": "bad", "check failed": "bad"}.get(self.status, "info")
        out = [f'<div class="exercise-check exercise-{css}"><p><strong>{escape(self.heading())}</strong></p>']
        if self.message:
            out.append(f"<p>{text(self.message)}</p>".replace("\n", "<br>"))
        if self.details:
            out.append(f"<pre>{escape(self.details.rstrip())}</pre>")
        if self.hint:
            out.append(f"<p>{text(tr('Hint: ', 'ヒント: ') + self.hint)}</p>")
        if self.levels:
            out.append(f"<p>{text(self._more())}</p>")
        out.append("</div>")
        return "\n".join(out)


def right(message=""):
    """The answer is right. For check authors: see the package docstring."""
    return Outcome("right", message)


def wrong(message, hint_key=None):
    """The answer is wrong: ``message`` shows the first mismatch (never the expected value when that gives the
    answer away); ``hint_key`` names the likely mistake (a key of the exercise's ``mistakes``).
    For check authors: see the package docstring."""
    return Outcome("wrong", message, hint_key)


def cannot_run(message):
    """This machine cannot run the check (no GPU, ...): never a wrong answer. For check authors: see the package docstring."""
    return Outcome("cannot run here", message)


class Stop(Exception):
    """Raised inside a check function to end it with ``outcome`` (used by :func:`call`). For check authors: see the package docstring."""

    def __init__(self, outcome):
        super().__init__(outcome.status)
        self.outcome = outcome


# ---- The learner's code ---------------------------------------------------------------------------------------
def is_starter(fn):
    """True if ``fn``'s body is only (a docstring and) ``raise NotImplementedError(...)``: an untouched starter.

    Read from the source, without calling it (cheap, even for distributed exercises). For check authors: see the package docstring.
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    body = [n for n in node.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def learner_traceback(exc):
    """``exc``'s traceback without the check's own frames (from the learner's first frame on).
    For check authors: see the package docstring."""
    frames = traceback.extract_tb(exc.__traceback__)
    start = next((i for i, f in enumerate(frames) if not f.filename.startswith(str(HERE))), len(frames))
    lines = traceback.format_list(frames[start:]) if start < len(frames) else []
    return "".join(["Traceback (most recent call last):\n", *lines, *traceback.format_exception_only(exc)])


def not_attempted():
    """The outcome for an untouched starter. For check authors: see the package docstring."""
    return Outcome("not attempted", tr("The starter is unchanged: replace `raise NotImplementedError` with your "
                                       "code, run its cell again, then this check.",
                                       "スターターはまだそのままです。`raise NotImplementedError` を自分のコードに"
                                       "置き換えてそのセルを実行し直してから、このチェックを実行してください。"))


def learner_error(exc, where=""):
    """The outcome for an exception the learner's code raised. For check authors: see the package docstring."""
    return Outcome("error", tr(f"Your code raised {type(exc).__name__}{where}:", f"あなたのコードで{where}"
                               f" {type(exc).__name__} が発生しました:"), details=learner_traceback(exc))


def call(fn, *args, on_error=None, **kwargs):
    """Call the learner's ``fn``; its ``NotImplementedError`` or other exception ends the check with "not
    attempted" or "error" (a :class:`Stop`). ``on_error(exc)`` may name the likely mistake behind an exception
    (a hint key, or ``None``). For check authors: see the package docstring."""
    if not callable(fn):
        raise Stop(wrong(tr(f"Pass your function to check (got {type(fn).__name__}).",
                            f"check には関数を渡してください（渡されたのは {type(fn).__name__}）。"), "shape"))
    if sandbox.apart():  # the check runs here, the learner's code in a clean worker
        return sandbox.run_apart(_call_here, fn, args, kwargs, on_error)
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise Stop(not_attempted()) from None
    except Exception as e:
        outcome = learner_error(e)
        outcome.hint_key = safe_key(on_error, e)
        raise Stop(outcome) from None


def in_worker(driver, *args, **kwargs):
    """``driver(*args, **kwargs)`` where the learner's code runs: in a clean worker when the check is judged apart
    (its value comes back as plain data), else right here. ``driver`` is a module-level function of the check's
    module that builds what the learner's code works on, reaches it through :func:`call`, and returns what the check
    needs to see (outputs, gradients, the state of what it was given). For check authors: see the package docstring."""
    if sandbox.apart():
        return sandbox.run_apart(driver, *args, **kwargs)
    return driver(*args, **kwargs)


def _call_here(fn, args, kwargs, on_error):
    """:func:`call` in the worker that runs the learner's code (see :mod:`~mparlib.exercises.sandbox`)."""
    return call(fn, *args, on_error=on_error, **kwargs)


def call_each(fn, cases):
    """``[fn(*case) for case in cases]``, as :func:`call` would make each call; judged apart, all of them in one
    worker. For check authors: see the package docstring."""
    if not callable(fn):
        call(fn)  # says what to pass instead
    if sandbox.apart():
        return whole(sandbox.run_apart(_call_each, fn, list(cases)), len(cases))
    return [call(fn, *case) for case in cases]


def whole(values, count):
    """``values`` when it is a list of ``count`` values, as a worker sends it; else the check ends with an error: the
    learner's code replaced the worker's reply (a check that compared what came would find nothing wrong in an empty
    list). For check authors: see the package docstring."""
    if isinstance(values, list) and len(values) == count:
        return values
    if isinstance(values, (list, tuple)):
        got_en, got_ja = f"{len(values)} came back", f"{len(values)}個しか返ってきませんでした"
    else:
        got_en, got_ja = f"a {type_name(values)} came back", f"{type_name(values)} が返ってきました"
    raise Stop(Outcome("error", tr(
        f"Your code interfered with the process that ran it: {count} results were due and {got_en}. Return your "
        "values from the function; do not write the check's files or end its processes.",
        f"あなたのコードが、それを実行したプロセスに干渉しました。結果は {count}個のはずが、{got_ja}。値は関数から"
        "返し、チェックのファイルを書いたりそのプロセスを終了させたりしないでください。")))


def _call_each(fn, cases):
    """``fn(*case)`` for every case, in the worker: the values as plain data, for :func:`compare_cases`."""
    return [sandbox.plain(call(fn, *case)) for case in cases]


def safe_key(on_error, exc):
    """The hint key ``on_error`` gives for ``exc`` (``None`` when there is none or it fails)."""
    try:
        return on_error(exc) if on_error else None
    except Exception:
        return None


def value(answer, kind=(int, float)):
    """The learner's answer when it is a value (``None`` or a starter function: not attempted).
    For check authors: see the package docstring."""
    if answer is None:
        raise Stop(not_attempted())
    if callable(answer):
        answer = call(answer)
    return as_number(answer, kind)


def as_number(got, kind=(int, float)):
    """``got``, a value the learner's code gave back, when it is a finite number of ``kind``; else a wrong answer
    naming what came back. For check authors: see the package docstring."""
    if not isinstance(got, kind) or isinstance(got, bool) or (isinstance(got, float) and not math.isfinite(got)):
        raise Stop(wrong(tr(f"Your answer is {got!r}; the exercise asks for a number.",
                            f"答えが {got!r} です。この問題の答えは数値です。"), "shape"))
    return got


# ---- check and hint ---------------------------------------------------------------------------------------------
def check(number, answer=None, **options):
    """Check the learner's ``answer`` to exercise ``number`` and return the :class:`Outcome` (shown as the cell's
    result). Explained in 01_dataparallel."""
    ex = lookup(number)
    outcome = decide(ex, answer, options)
    outcome.number = number
    if outcome.status in ("wrong", "not attempted") or (outcome.status == "error" and outcome.hint_key):
        mistake = ex.mistake_text(outcome.hint_key) if outcome.hint_key else None
        outcome.hint, outcome.levels = mistake or ex.hint_text(1), len(ex.hints)
        if mistake is None:  # level 1 is on the page now: hint() goes on from level 2
            SHOWN[number] = max(SHOWN.get(number, 0), 1)
    return outcome


def decide(ex, answer, options):
    """Run ``ex``'s check function on ``answer``; sort out whose failure an exception is."""
    if answer is None:
        return not_attempted()
    if ex.needs == "gpu" and not torch.cuda.is_available():
        return cannot_run(tr("This exercise needs a CUDA GPU, and this machine has none. Nothing is wrong with your "
                             "answer: run the check on a machine with a GPU.",
                             "この練習問題には CUDA GPU が必要ですが、このマシンにはありません。答えが間違っている"
                             "わけではありません。GPU のあるマシンでチェックしてください。"))
    if callable(answer) and is_starter(answer):
        return not_attempted()
    with sandbox.judged_apart(ex.limit), torch.random.fork_rng(devices=[]):  # the learner's generator untouched
        return judge(ex, answer, options)


def judge(ex, answer, options):
    """``ex``'s check function on ``answer``, in this process: its outcome, or "check failed" with the traceback
    when the check itself broke."""
    try:
        try:
            outcome = ex.check(answer, **options)
        except Stop as s:
            outcome = s.outcome
        if not isinstance(outcome, Outcome):
            raise TypeError(f"the check of {ex.number} returned {outcome!r}, not an Outcome")
        if outcome.hint_key and ex.mistake_text(outcome.hint_key) is None:
            raise KeyError(f"the check of {ex.number} named the unknown mistake {outcome.hint_key!r}")
        return outcome
    except Exception as e:
        return Outcome("check failed", tr(
            "The check itself failed: this is not a verdict on your answer. Please report it with the text below.",
            "チェック自体が失敗しました。あなたの答えの判定ではありません。下の内容を添えて報告してください。"),
            details="".join(traceback.format_exception(e)))


def hint(number, level=None):
    """Print the next hint level of exercise ``number`` (or ``level``), or say that there is none left; the last
    stops short of the code. Explained in 01_dataparallel."""
    ex = lookup(number)
    if level is None and SHOWN.get(number, 0) >= len(ex.hints):
        print(tr(f"Exercise {number} has no more hints: all {len(ex.hints)} levels have been shown. "
                 f"hint({number!r}, {len(ex.hints)}) shows the last one again.",
                 f"練習問題 {number} のヒントはもうありません。全 {len(ex.hints)}段階を表示しました。"
                 f"hint({number!r}, {len(ex.hints)}) で最後のヒントをもう一度表示します。"))
        return
    if level is None:
        level = SHOWN.get(number, 0) + 1
    if not (isinstance(level, int) and 1 <= level <= len(ex.hints)):
        raise ConfigError(tr(f"hint({number!r}, {level!r}): use a level from 1 to {len(ex.hints)}.",
                             f"hint({number!r}, {level!r}): 段階は 1 から {len(ex.hints)} までで指定してください。"))
    SHOWN[number] = max(SHOWN.get(number, 0), level)
    print(tr(f"Hint {level} of {len(ex.hints)} for exercise {number}: ",
             f"練習問題 {number} のヒント {level}/{len(ex.hints)}: ") + ex.hint_text(level))


# ---- Comparing ------------------------------------------------------------------------------------------------
def first_mismatch(got, expected, rtol=1e-5, atol=1e-6):
    """``None`` if the tensors agree, else ``(index, learner's value)`` of the first element that differs (or
    ``("shape", got.shape)``). For check authors: see the package docstring."""
    if not isinstance(got, torch.Tensor):
        return ("type", type_name(got))
    if got.shape != expected.shape:
        return ("shape", tuple(got.shape))
    got_c, exp_c = got.detach().cpu(), expected.detach().cpu()
    if got_c.is_floating_point() or exp_c.is_floating_point():
        bad = ~torch.isclose(got_c.double(), exp_c.double(), rtol=rtol, atol=atol, equal_nan=False)
    else:
        bad = got_c != exp_c
    if not bad.any():
        return None
    index = tuple(int(i) for i in bad.nonzero()[0])
    return (index, got_c[index].item())


def type_name(value):
    """The name of the type of a value the learner's code gave back (the worker's name for one that was not plain
    data). For check authors: see the package docstring."""
    return value.type_name if isinstance(value, sandbox.Opaque) else type(value).__name__


def mismatch_text(where, mismatch):
    """The learner-facing sentence for a :func:`first_mismatch` result; ``where`` names the output ("rank 1's
    result"). For check authors: see the package docstring."""
    kind, val = mismatch
    if kind == "type":
        return tr(f"{where} is a {val}, not a tensor.", f"{where}がテンソルではなく {val} です。")
    if kind == "shape":
        return tr(f"{where} has shape {val}, not the expected one.", f"{where}の形状が {val} で、期待される形状と違います。")
    return tr(f"{where} first differs at index {list(kind)}: your value is {val:.6g}.",
              f"{where}はインデックス {list(kind)} で最初に食い違います。あなたの値は {val:.6g} です。")


def show_call(fn, args):
    """``name(arg, ...)`` as the learner would write the call. For check authors: see the package docstring."""
    name = getattr(fn, "__name__", "answer")
    return f"{name}({', '.join(repr(a) for a in args)})"


def compare_cases(answer, cases, reference, detectors=(), same=None):
    """Check a formula: call ``answer(*case)`` for each case and compare with ``reference(*case)`` (never shown).

    ``same(got, expected)`` decides equality (default ``==``; floats: relative 1e-6). ``detectors``: ``(key,
    predicate(case, got, expected))`` pairs; the first that holds names the mistake. Returns an :class:`Outcome`.
    For check authors: see the package docstring.
    """
    same = same or close_enough
    for case, got in zip(cases, call_each(answer, cases)):
        expected = reference(*case)
        if same(got, expected):
            continue
        key = next((k for k, predicate in detectors if safe(predicate, case, got, expected)), None)
        return wrong(tr(f"{show_call(answer, case)} returned {got!r}, which is not right.",
                        f"{show_call(answer, case)} が {got!r} を返しましたが、これは正しくありません。"), key)
    return right(tr(f"Your function agrees with the check on all {len(cases)} cases.",
                    f"{len(cases)}通りのすべての場合で、あなたの関数はチェックと一致しました。"))


def safe(predicate, *args):
    """``predicate(*args)``, or False if it raises (a learner's odd value must not crash a mistake detector).
    For check authors: see the package docstring."""
    try:
        return bool(predicate(*args))
    except Exception:
        return False


def close_enough(got, expected, rel=1e-6):
    """Equality of numbers (relative ``rel``), sequences of them, or anything else by ``==``.
    For check authors: see the package docstring."""
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        return isinstance(got, (int, float)) and not isinstance(got, bool) and math.isclose(
            got, expected, rel_tol=rel, abs_tol=1e-12)
    if isinstance(expected, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(expected) and all(
            close_enough(g, e, rel) for g, e in zip(got, expected))
    return got == expected


def ratio(got, expected):
    """``got / expected`` for numbers (``None`` if not defined): the mistake detectors' favourite.
    For check authors: see the package docstring."""
    try:
        return float(got) / float(expected) if float(expected) != 0 else None
    except (TypeError, ValueError):
        return None


# ---- Distributed exercises -------------------------------------------------------------------------------------
@dataclass
class RankResult:
    """What one rank of :func:`run_ranks` left: the learner's ``value`` or ``error``.

    ``error`` is ``None`` or ``(kind, "Type: message", traceback)`` with kind "error", "not attempted", "hang"
    (a collective that timed out or lost its partner) or "stuck" (still running at the time limit).
    For check authors: see the package docstring.
    """
    rank: int
    value: object = None
    error: tuple | None = None


HANG = re.compile(r"timed out|timeout|connection closed|connection reset|broken pipe|peer", re.IGNORECASE)


class StillRunning(Exception):
    """Raised by the alarm in a rank whose code runs past the check's time limit."""


def rank_harness(module, qualname, args, kwargs, folder, limit):
    """The function each rank of :func:`run_ranks` runs: the learner's function (or a check's child that calls it),
    imported by name; writes a :class:`RankResult`. Nothing of the check's expected values is in this process: the
    learner's code could reach it. For check authors: see the package docstring."""
    import torch.distributed as dist

    rank = dist.get_rank()
    result = RankResult(rank)
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)

    def alarm(signum, frame):
        raise StillRunning(f"still running after {limit} s")

    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(int(limit))
    try:
        result.value = fn(*args, **kwargs)
        if isinstance(result.value, torch.Tensor):
            result.value = result.value.detach().cpu()
    except NotImplementedError as e:
        result.error = ("not attempted", f"NotImplementedError: {e}", "")
    except StillRunning as e:
        result.error = ("stuck", str(e), learner_traceback(e))
    except Exception as e:
        kind = "hang" if HANG.search(str(e)) or type(e).__name__ == "DistBackendError" else "error"
        summary = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\] ", "", f"{type(e).__name__}: {e}".splitlines()[0])
        result.error = (kind, summary[:300], learner_traceback(e))
    finally:
        signal.alarm(0)
    try:
        data = pickle.dumps(result)
    except Exception:  # noqa: BLE001 - a value that cannot travel (a generator, a lock): its parts as plain data
        result.value = sandbox.plain_parts(result.value)
        data = pickle.dumps(result)
    atomic_write_bytes(Path(folder) / f"rank{rank}.pkl", data)
    return None


def importable(fn):
    """``(module, qualname)`` by which a fresh process imports the learner's ``fn``; else a :class:`Stop` saying
    to write it in a ``%%worker`` cell. For check authors: see the package docstring."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not callable(fn) or module in (None, "__main__", "__mp_main__") or "<" in name:
        raise Stop(wrong(tr(
            "The other processes cannot import this function: write it in a cell that starts with "
            "`%%worker my_workers` (after `%load_ext mparlib.launch`), then `from my_workers import ...` and check "
            "that.",
            "このままでは他のプロセスがこの関数をインポートできません。`%load_ext mparlib.launch` のあと "
            "`%%worker my_workers` で始まるセルに書き、`from my_workers import ...` でインポートしたものをチェック"
            "してください。"), "shape"))
    return module, name


MARGIN = 10  # seconds past a check's limit after which run_ranks has the launcher kill every rank


def run_ranks(fn, nproc, args=(), kwargs=None, *, timeout=20, limit=45):
    """Run the learner's ``fn(*args, **kwargs)`` on ``nproc`` fresh processes (a fresh process group); return the
    list of :class:`RankResult`, or end the check (:class:`Stop`) when a rank failed or hung, naming the rank.

    What rank 0 prints is shown as it comes. ``timeout`` bounds each collective; ``limit`` (seconds) the learner's
    code on a rank: an alarm in the rank first, then, for code that catches or ignores it, the launcher kills every
    rank ``MARGIN`` seconds later. A check judged apart calls this in its worker (see
    :func:`~mparlib.exercises.ch06.run_children`). For check authors: see the package docstring.
    """
    from ..launch import launch

    if is_starter(fn):
        raise Stop(not_attempted())
    module, name = importable(fn)
    with tempfile.TemporaryDirectory(prefix="mparlib-check-") as folder:
        try:
            launch(rank_harness, nproc, args=(module, name, tuple(args), dict(kwargs or {}), folder, limit),
                   timeout=timeout, limit=limit + MARGIN)
        except WorkerFailed as e:
            if e.limit is not None:  # the learner's code outlived the alarm (caught it, or ignored the signal)
                raise Stop(wrong(tr(
                    f"Your function was still running {limit:g} s after it started and did not stop when told to, so "
                    f"every rank was ended at {limit + MARGIN:g} s. Look for a loop that never ends, or a wait that "
                    "nothing wakes (and do not catch every exception around it).",
                    f"あなたの関数は開始から {limit:g} 秒たっても実行中で、止めるよう伝えても止まらなかったので、"
                    f"{limit + MARGIN:g} 秒の時点ですべてのランクを終了しました。終わらないループや、何も起こさない待ちを"
                    "探してください（そのまわりですべての例外を捕まえないでください）。"), "stuck")) from None
            raise Stop(Outcome("error", tr(f"A process ended abruptly ({e.cause or 'rank ' + str(e.rank)}):",
                                           f"プロセスが突然終了しました（{e.cause or 'ランク ' + str(e.rank)}）:"),
                               details=str(e))) from None
        except MparlibError as e:  # a course error the learner's code raised in a rank
            raise Stop(learner_error(e, tr(" in a rank", "（あるランク）"))) from None
        results = []
        for r in range(nproc):
            path = Path(folder) / f"rank{r}.pkl"
            results.append(pickle.loads(path.read_bytes()) if path.exists() else RankResult(r, error=(
                "error", "no result", "")))
    settle(results, timeout, limit)
    return results


def settle(results, timeout, limit):
    """End the check for ranks that failed: "not attempted", a hang naming the waiting and the missing ranks, or the
    learner's error from the first failing rank. For check authors: see the package docstring."""
    errors = {r.rank: r.error for r in results if r.error}
    if not errors:
        return
    if any(kind == "not attempted" for kind, _, _ in errors.values()):
        raise Stop(not_attempted())
    waited = [r for r, (kind, _, _) in errors.items() if kind in ("hang", "stuck")]
    if waited and all(kind in ("hang", "stuck") for kind, _, _ in errors.values()):
        done = [r.rank for r in results if not r.error]
        first = waited[0]
        msg = tr(f"Rank {first} waited in a collective or send/recv that its partner never joined "
                 f"(given up after {timeout:g} s; stuck ranks: {waited}; ranks that returned: {done}). "
                 f"Rank {first}'s error: {errors[first][1]}",
                 f"ランク {first} は、相手が加わらない集合通信か send/recv で待ち続けました（{timeout:g} 秒で打ち"
                 f"切り。止まったランク: {waited}、戻ったランク: {done}）。ランク {first} のエラー: {errors[first][1]}")
        if errors[first][0] == "stuck":
            msg = tr(f"Rank {first} was still running after {limit:g} s (ranks stuck: {waited}).",
                     f"ランク {first} は {limit:g} 秒たってもまだ実行中でした（止まったランク: {waited}）。")
        raise Stop(wrong(msg, "hang"))
    first = min(r for r, (kind, _, _) in errors.items() if kind == "error")
    kind, summary, trace = errors[first]
    raise Stop(Outcome("error", tr(f"Rank {first} raised {summary}", f"ランク {first} で {summary} が発生しました"),
                       details=trace))


def environment_note():
    """One line naming this machine for a measured answer's message. For check authors: see the package docstring."""
    return f"torch {torch.__version__}, {os.cpu_count()} CPU cores, Python {sys.version.split()[0]}"
