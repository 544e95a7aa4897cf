"""Every exercise's check can fail and can pass: it accepts its solution, says "not attempted" for the starter the
chapter ships, and rejects each planted wrong answer with the hint meant for that mistake. Generic over every
chapter module present in mparlib/exercises/ (solutions/chNN.py and tests/planted/chNN.py go with it)."""
import ast
import importlib
import os
import re
import shutil
import sys
import time
import types
from html import unescape as html_unescape
from pathlib import Path

import pytest

from mparlib.exercises import check, hint, registered
from mparlib.exercises import core
from mparlib.workers import write_worker

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "notebooks" / "src"
EXERCISES = registered()
CHAPTERS = sorted({n[:2] for n in EXERCISES})
STARTER = re.compile(r"^# Exercise (\d\d\.\d+): starter$", re.MULTILINE)
CHECK_CALL = re.compile(r"""check\(["'](\d\d\.\d+)["'],\s*([A-Za-z_][A-Za-z0-9_]*)""")


def solutions(chapter):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"solutions.ch{chapter}").SOLUTIONS


def planted(chapter):
    return importlib.import_module(f"planted.ch{chapter}").PLANTED


def source(chapter):
    return next(SRC.glob(f"{chapter}_*.py")).read_text(encoding="utf-8")


def cells(text):
    """``(kind, body)`` of each cell of a jupytext percent source."""
    out = []
    for block in re.split(r"^# %%(?= |$)", text, flags=re.MULTILINE)[1:]:  # "# %%worker" is a magic, not a cell
        head, _, body = block.partition("\n")
        out.append(("markdown" if "[markdown]" in head else "code", body))
    return out


def editions(text):
    """The English and the Japanese prose of a chapter source."""
    en, ja = [], []
    for kind, body in cells(text):
        if kind == "markdown":
            md = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in body.splitlines())
            first, _, second = md.partition("<!-- ja -->")
            en.append(first.replace("<!-- en -->", ""))
            ja.append(second)
    return "\n".join(en), "\n".join(ja)


def starters(chapter, tmp_module):
    """``{number: the starter's answer}``: each marked starter cell run as the learner would find it."""
    return starters_in(source(chapter), f"starter_{chapter}", tmp_module)


def starters_in(text, name, tmp_module):
    """The starters of a chapter source ``text``: plain cells run in a module ``name``, ``%%worker`` cells written
    as the worker module they name."""
    found = {}
    names = dict(CHECK_CALL.findall(text))
    for kind, body in cells(text):
        match = STARTER.search(body)
        if kind != "code" or not match:
            continue
        lines = body.strip("\n").splitlines()
        if lines[0].startswith("# %%worker "):  # a distributed starter: the module that the check's processes import
            module = write_worker(lines[0].split()[2], "\n".join(lines[1:]))
        else:
            module = tmp_module(name)
            exec(compile(body, f"<starter {match.group(1)}>", "exec"), module.__dict__)
        found[match.group(1)] = getattr(module, names[match.group(1)])
    return found


@pytest.fixture
def tmp_module():
    def make(name):
        return types.ModuleType(name)
    return make


def test_every_chapter_after_the_setup_has_at_least_three_exercises():
    chapters = sorted(p.name[:2] for p in SRC.glob("[0-9][0-9]_*.py") if p.name[:2] != "00")
    assert chapters, "no chapter sources found"
    for chapter in chapters:
        assert sum(n.startswith(chapter + ".") for n in EXERCISES) >= 3, chapter


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_check_accepts_its_solution(chapter):
    answers = solutions(chapter)
    numbers = [n for n in EXERCISES if n.startswith(chapter + ".")]
    assert sorted(answers) == numbers
    for number in numbers:
        outcome = check(number, answers[number])
        expected = "cannot run here" if EXERCISES[number].needs == "gpu" and outcome.status != "right" else "right"
        assert outcome.status == expected, (number, repr(outcome))


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_shipped_starter_is_not_attempted(chapter, tmp_module):
    found = starters(chapter, tmp_module)
    assert sorted(found) == [n for n in EXERCISES if n.startswith(chapter + ".")]
    for number, answer in found.items():
        outcome = check(number, answer)
        assert outcome.status == "not attempted", (number, repr(outcome))
        assert outcome.hint == EXERCISES[number].hint_text(1)


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_planted_wrong_answer_is_rejected_with_its_hint(chapter):
    cases = planted(chapter)
    assert {n for n, _, _ in cases} == {n for n in EXERCISES if n.startswith(chapter + ".")}
    for number, key, answer in cases:
        outcome = check(number, answer)
        assert outcome.status in ("wrong", "error"), (number, key, repr(outcome))
        assert outcome.hint_key == key, (number, key, repr(outcome))
        assert outcome.hint == EXERCISES[number].mistake_text(key)


def test_every_exercise_named_in_the_prose_has_a_check_and_both_editions_name_it():
    named = {}
    for path in sorted(SRC.glob("[0-9][0-9]_*.py")):
        en, ja = editions(path.read_text(encoding="utf-8"))
        named[path.stem[:2]] = (set(re.findall(r"### Exercise (\d\d\.\d+):", en)),
                                set(re.findall(r"### 練習問題 (\d\d\.\d+):", ja)))
    for chapter, (en, ja) in named.items():
        assert en <= set(EXERCISES) and ja <= set(EXERCISES), (chapter, en - set(EXERCISES), ja - set(EXERCISES))
    for number in EXERCISES:
        en, ja = named[number[:2]]
        assert number in en and number in ja, number
    texts = {c: source(c) for c in CHAPTERS}
    for number in EXERCISES:
        assert re.search(rf"""check\(["']{re.escape(number)}["']""", texts[number[:2]]), number


def test_no_module_of_the_package_imports_the_solutions():
    for path in (ROOT / "mparlib").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "solutions" or n.startswith("solutions.") for n in names), path
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert "solutions." not in node.value or path.name == "__init__.py", path


# ---- The machinery --------------------------------------------------------------------------------------------
@pytest.fixture
def scratch_exercise():
    """Exercise 99.1, registered for one test; its check function is given by the test."""
    def register(fn, **kwargs):
        kwargs.setdefault("hints", [("where", "どこ"), ("idea", "考え"), ("nearly", "ほぼ")])
        core.exercise("99.1", **kwargs)(fn)
        return "99.1"
    yield register
    core.REGISTRY.pop("99.1", None)
    core.SHOWN.pop("99.1", None)


def test_a_check_that_breaks_is_its_own_fault_never_a_wrong_answer(scratch_exercise):
    def broken(answer):
        return {}["missing"]  # a bug in the check

    outcome = check(scratch_exercise(broken), lambda: 1)
    assert outcome.status == "check failed" and "KeyError" in outcome.details
    assert "wrong" not in repr(outcome).splitlines()[0]


def test_a_check_naming_an_unknown_mistake_is_its_own_fault(scratch_exercise):
    outcome = check(scratch_exercise(lambda answer: core.wrong("no", "no_such_key")), lambda: 1)
    assert outcome.status == "check failed" and "no_such_key" in outcome.details


def test_the_learners_error_shows_their_traceback_without_the_checks_frames(scratch_exercise):
    def learner(x):
        return [1, 2][x]

    outcome = check(scratch_exercise(lambda answer: core.call(answer, 5) and core.right()), learner)
    assert outcome.status == "error" and "IndexError" in outcome.details and "return [1, 2][x]" in outcome.details
    assert "core.py" not in outcome.details


def test_not_attempted_is_seen_in_the_source_without_calling(scratch_exercise, monkeypatch):
    calls = []

    def starter(x):
        """A docstring does not count as an answer."""
        raise NotImplementedError("99.1")

    def partial(x):
        if x:
            return 1
        raise NotImplementedError("the rest")

    number = scratch_exercise(lambda answer: calls.append(answer) or core.call(answer, 0) or core.right())
    assert core.is_starter(starter) and not core.is_starter(partial) and not core.is_starter(len)
    assert check(number, starter).status == "not attempted" and calls == []
    assert check(number, partial).status == "not attempted" and calls == [partial]  # found by calling
    assert check(number, None).status == "not attempted"


def test_a_gpu_exercise_cannot_run_without_a_gpu_and_is_never_wrong(scratch_exercise, monkeypatch):
    monkeypatch.setattr(core.torch.cuda, "is_available", lambda: False)
    outcome = check(scratch_exercise(lambda answer: core.wrong("no"), needs="gpu"), lambda: 1)
    assert outcome.status == "cannot run here" and not outcome.hint


def test_hints_come_one_level_at_a_time_say_when_none_is_left_and_a_level_on_request(scratch_exercise, capsys):
    number = scratch_exercise(lambda answer: core.right())
    for _ in range(4):
        hint(number)
    hint(number, 1)
    lines = capsys.readouterr().out.splitlines()
    assert [line.rsplit(": ", 1)[1] for line in lines[:3]] == ["where", "idea", "nearly"]
    assert lines[3].startswith("Exercise 99.1 has no more hints: all 3 levels have been shown.")
    assert lines[4].rsplit(": ", 1)[1] == "where" and len(lines) == 5
    with pytest.raises(ValueError):
        hint(number, 4)


def test_an_outcome_shows_one_hint_and_hint_goes_on_from_the_next_level(scratch_exercise, monkeypatch, capsys):
    number = scratch_exercise(lambda answer: core.right())
    outcome = check(number, None)
    shown = repr(outcome) + outcome._repr_html_()
    assert "not attempted" in shown and "where" in shown and "idea" not in shown and "nearly" not in shown
    assert "<details>" not in shown and "hint('99.1') shows the next of its 3 levels" in shown
    hint(number)
    assert capsys.readouterr().out.rstrip().endswith(": idea")
    monkeypatch.setenv("MPARLIB_LANG", "ja")
    outcome = check(number, None)
    shown = repr(outcome) + outcome._repr_html_()
    assert "未着手" in shown and "ヒント: どこ" in shown and "考え" not in shown and "ほぼ" not in shown


def test_unknown_numbers_are_refused_with_the_format_to_use():
    with pytest.raises(ValueError, match="01.1"):
        check(1.1, None)
    with pytest.raises(ValueError, match="no exercise"):
        check("98.1", None)


# ---- Fresh processes ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ranks_run_the_learners_function_and_give_back_each_ranks_value():
    import torch

    import exercise_workers as w

    results = core.run_ranks(w.good_sum, 2, args=(torch.ones(3),))
    assert [r.rank for r in results] == [0, 1]
    for r in results:  # x * 1 on rank 0 plus x * 2 on rank 1
        assert r.error is None and torch.equal(r.value, torch.full((3,), 3.0))


@pytest.mark.slow
@pytest.mark.parametrize("name, waiting", [("skipping_sum", "Rank 0"), ("both_receive", "Rank 0")])
def test_a_deadlocking_answer_ends_at_the_collectives_timeout_naming_the_rank(name, waiting):
    import torch

    import exercise_workers as w

    start = time.monotonic()
    with pytest.raises(core.Stop) as stop:
        core.run_ranks(getattr(w, name), 2, args=(torch.ones(3),), timeout=5)  # the checks' default: 20 s
    assert time.monotonic() - start < 5 + 20  # the timeout, plus starting and ending two processes
    outcome = stop.value.outcome
    assert outcome.status == "wrong" and outcome.hint_key == "hang" and outcome.message.startswith(waiting)


@pytest.mark.slow
def test_an_answer_that_catches_the_alarm_is_ended_from_outside_at_the_stated_limit(monkeypatch):
    import torch

    import exercise_workers as w

    monkeypatch.setattr(core, "MARGIN", 2)  # the checks' margin is 10 s: the same path, waited out sooner
    start = time.monotonic()
    with pytest.raises(core.Stop) as stop:
        core.run_ranks(w.catches_every_exception, 2, args=(torch.ones(3),), limit=3)
    assert 3 + 2 <= time.monotonic() - start < 3 + 2 + 10
    outcome = stop.value.outcome
    assert outcome.status == "wrong" and outcome.hint_key == "stuck" and "still running 3 s" in outcome.message
    assert "ended at 5 s" in outcome.message


def test_what_a_checked_answer_prints_is_shown_and_its_value_judged(scratch_exercise, capsys):
    def answer(x):
        print("looking at", x)
        return x + 1

    number = scratch_exercise(lambda a: core.right() if core.call(a, 41) == 42 else core.wrong("no"))
    assert check(number, answer).status == "right"
    assert capsys.readouterr().out == "looking at 41\n"


def test_the_check_runs_in_the_kernel_and_the_answer_apart_even_where_cuda_is_in_use(scratch_exercise, monkeypatch):
    monkeypatch.setattr(core.torch.cuda, "is_initialized", lambda: True)  # once, a fork of such a kernel was avoided
    pids = []
    number = scratch_exercise(lambda a: pids.append(os.getpid()) or core.right()
                              if core.call(a) not in (None, os.getpid()) else core.wrong("same process"))
    assert check(number, os.getpid).status == "right" and pids == [os.getpid()]


@pytest.mark.slow
def test_an_error_on_one_rank_is_the_learners_error_naming_that_rank():
    import torch

    import exercise_workers as w

    with pytest.raises(core.Stop) as stop:
        core.run_ranks(w.failing_on_rank1, 2, args=(torch.ones(3),), timeout=20)
    outcome = stop.value.outcome
    assert outcome.status == "error" and outcome.message.startswith("Rank 1 raised IndexError")
    assert "chunk 2 does not exist" in outcome.details


def test_a_worker_cell_starter_is_not_attempted_without_starting_processes(scratch_exercise, tmp_module,
                                                                           monkeypatch):
    import mparlib.launch

    def no_processes(*args, **kwargs):
        raise AssertionError("a starter must be recognised without starting processes")

    monkeypatch.setattr(mparlib.launch, "launch", no_processes)
    text = ('# %%\n# %%worker ex_scratch_workers\n# Exercise 99.1: starter\nimport torch.distributed as dist\n\n\n'
            'def my_sum(x):\n    """Sum over ranks."""\n    raise NotImplementedError("99.1")\n\n\n'
            '# %%\ncheck("99.1", my_sum)\n')
    number = scratch_exercise(lambda answer: core.run_ranks(answer, 2) and core.right(), needs="processes")
    answer = starters_in(text, "unused", tmp_module)[number]
    assert answer.__module__ == "ex_scratch_workers"
    assert check(number, answer).status == "not attempted"


def test_a_notebook_function_is_refused_before_any_process_starts():
    def local(x):
        return x

    with pytest.raises(core.Stop) as stop:
        core.run_ranks(local, 2)
    assert "%%worker" in stop.value.outcome.message


# ---- The book ---------------------------------------------------------------------------------------------------
def build_book(tmp_path, solutions):
    """The book of chapter 01 built in a copy of the repository's settings, with `solutions` set as given."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import book
    finally:
        sys.path.pop(0)
    root = tmp_path / f"solutions-{solutions}"
    root.mkdir()
    settings = (ROOT / "book.toml").read_text(encoding="utf-8")
    assert "\nsolutions = false\n" in settings  # the published book has no solutions
    (root / "book.toml").write_text(settings.replace("\nsolutions = false\n", f"\nsolutions = {str(solutions).lower()}\n"),
                                    encoding="utf-8")
    shutil.copytree(ROOT / "book-theme", root / "book-theme")
    shutil.copytree(ROOT / "solutions", root / "solutions")
    for lang in ("en", "ja"):
        (root / "notebooks" / lang).mkdir(parents=True)
        shutil.copy(ROOT / "notebooks" / lang / "01_dataparallel.ipynb", root / "notebooks" / lang)
    book.build(root=root, log=lambda *a: None)
    return root / "site"


@pytest.mark.slow
def test_the_book_shows_hints_and_leaves_solutions_out_unless_book_toml_asks(tmp_path):
    for solutions in (False, True):
        site = build_book(tmp_path, solutions)
        for lang, title in (("en", "Solutions (for instructors)"), ("ja", "解答（講師用）")):
            chapter = (site / lang / "01_dataparallel.html").read_text(encoding="utf-8")
            first, later = (EXERCISES["01.1"].hints[0], EXERCISES["01.1"].hints[1:])
            shown = html_unescape(chapter)
            assert first[lang == "ja"] in shown  # level 1, shown with the starter's "not attempted"
            assert not any(h[lang == "ja"] in shown for h in later)  # the later levels only on request
            texts = "".join(p.read_text(encoding="utf-8") for p in (site / lang).rglob("*.html"))
            assert ("def chunk_sizes(batch, k):\n    \"\"\"01.1" in html_unescape(texts)) == solutions
            assert (site / lang / "solutions.html").exists() == solutions and (title in texts) == solutions


def test_the_exercise_modules_keep_the_package_rules():
    # tests/test_layout.py reads mparlib/*.py; the same rules hold one level down
    for path in sorted((ROOT / "mparlib" / "exercises").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno < 60, f"{path.name}:{node.lineno} {node.name}"
            if isinstance(node, ast.ImportFrom):
                assert not any(a.name.startswith("_") for a in node.names), f"{path.name}:{node.lineno}"
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node) or ""
                assert doc.strip(), f"{path.name}: {node.name} has no docstring"


BAD_RETURNS = {"None": None, "a string": "42", "NaN": float("nan"), "an int": 7, "a 0-d tensor": "tensor0",
               "a short tuple": (1,), "a tensor of another shape": "tensor35", "a tensor without gradients": "tensor2"}


def returns(kind):
    """An answer (usable as a function of any arguments, or as a value) that gives back one odd value."""
    made = {"tensor0": lambda: core.torch.tensor(1.5), "tensor35": lambda: core.torch.zeros(3, 5),
            "tensor2": lambda: core.torch.ones(2)}
    value = BAD_RETURNS[kind]
    return lambda *args, **kwargs: made[value]() if isinstance(value, str) and value in made else value


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_whatever_an_answer_returns_is_the_learners_outcome_never_a_failed_check(chapter):
    numbers = [n for n, ex in EXERCISES.items() if n.startswith(chapter + ".") and ex.needs is None]
    for number in numbers:
        for kind in BAD_RETURNS:
            outcome = check(number, returns(kind))
            assert outcome.status == "wrong", (number, kind, repr(outcome)[:400])


BAD_WORKER = """
import torch

def none(*args, **kwargs):
    return None

def text(*args, **kwargs):
    return "42"

def nan(*args, **kwargs):
    return float("nan")

def integer(*args, **kwargs):
    return 7

def scalar(*args, **kwargs):
    return torch.tensor(1.5)

def short(*args, **kwargs):
    return (1,)

def other_shape(*args, **kwargs):
    return torch.zeros(3, 5)

def generator(*args, **kwargs):
    return (i for i in range(3))
"""
# The distributed exercises whose check reads what the learner's function returns; the others (06.1, 06.3, 09.4)
# read what it left in the model, the parameters or the file, and see an odd return as doing nothing.
READS_RETURN = ("06.2", "08.1", "08.2", "10.1")


@pytest.mark.slow
def test_whatever_a_ranks_function_returns_is_the_learners_outcome_never_a_failed_check():
    from mparlib.workers import write_worker

    module = write_worker("ex_bad_returns", BAD_WORKER)
    numbers = [n for n, ex in EXERCISES.items() if ex.needs == "processes"]
    assert set(READS_RETURN) < set(numbers)
    for number in numbers:
        for kind in ("none", "text", "nan", "integer", "scalar", "short", "other_shape", "generator"):
            outcome = check(number, getattr(module, kind))
            assert outcome.status == "wrong", (number, kind, repr(outcome)[:400])
            if number not in READS_RETURN:
                break


@pytest.mark.slow
def test_a_distributed_check_keeps_its_expected_values_out_of_the_ranks_and_varies_the_world_size():
    """Answers that fooled the checks when a rank computed the reference beside the learner's code, on 3 processes
    only: one copies the whole batch's gradients from any model in reach, two divide by a hard-coded 3."""
    import planted.ch06 as p6
    import planted.ch09 as p9

    for number, answer, key in (("06.1", p6.copy_from_the_check, "no_all_reduce"),
                                ("06.1", p6.divide_by_three, "wrong_divisor"),
                                ("09.4", p9.zero_step_over_three, "wrong_divisor")):
        outcome = check(number, answer)
        assert (outcome.status, outcome.hint_key) == ("wrong", key), (number, repr(outcome)[:400])
    assert "With 2 processes" in check("06.1", p6.divide_by_three).message  # wrong where 3 would have passed
    forged = check("06.2", p6.forge_the_reply)  # a rank that replaces its worker's reply with no runs at all
    assert forged.status == "error" and "2 results were due and 0 came back" in forged.message


@pytest.mark.slow
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_exercises_section_runs_in_a_kernel_that_was_just_started(chapter):
    """Its cells alone, as after a restart: the import cell is all they need (``%%worker`` cells included)."""
    import nbformat
    from nbclient import NotebookClient

    path = next((ROOT / "notebooks" / "en").glob(f"{chapter}_*.ipynb"))
    notebook = nbformat.read(path, as_version=4)
    start = next(i for i, c in enumerate(notebook.cells)
                 if c.cell_type == "markdown" and c.source.lstrip().startswith("## Exercises"))
    notebook.cells = notebook.cells[start:]
    assert any(c.cell_type == "code" and "check(" in c.source for c in notebook.cells), chapter
    NotebookClient(notebook, kernel_name="mparlib", timeout=240,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = "".join(str(o) for c in notebook.cells if c.cell_type == "code" for o in c.outputs)
    assert "not attempted" in outputs and "Traceback" not in outputs, chapter


def test_a_check_leaves_the_learners_random_generator_as_it_was():
    import torch

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    for number, answer in solutions("01").items():
        assert check(number, answer).ok
    assert torch.equal(torch.rand(3), expected)
