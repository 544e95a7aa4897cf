"""Stored outputs show what the chapter means to show, and nothing of the machine that built them.

The book and the stored notebooks are what most readers see of a run, so every output of every notebook, in both
languages, is checked for:

- absolute paths (``/tmp/...``, ``/home/...``, ``/work/...``, ``C:\\...``): they name the build machine's folders
  and mean nothing to a reader; print a name relative to something the reader knows instead;
- warnings (``UserWarning``, ``DeprecationWarning``, ``FutureWarning``, a line starting ``Warning:``);
- error and noise lines of libraries: ``ERROR:``, profiler lines (``USDT:``, ``STAGE:``), C++ log lines
  (``[W1130 12:00:00.000 file.cpp:12]``, ``W1130 12:00:00 ...``), a Python traceback printed as text, and error
  outputs of cells that are not tagged ``raises-exception``;
- empty sections: a printed header (a line ending with ":") and then nothing at all.

A chapter that shows one of these on purpose says so in ``ALLOWED`` below (chapter, a pattern of the line, and
why); an entry that no longer matches anything fails, so the list stays as small as the chapters need.
"""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[a-z][a-z]/[0-9][0-9]_*.ipynb"))

# {(chapter stem, regular expression matching the whole line): why the chapter shows it}
ALLOWED = {}

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
ABSOLUTE_PATH = re.compile(r"(?:^|(?<=[\s'\"(\[=,;（「]))/[\w.@+-]+/[\w.@+/-]*"  # /tmp/x, /home/me/..., '/work/a'
                           r"|(?<![\w])[A-Za-z]:[\\/](?![\\/])[\w.]")  # C:\Users, D:/data
NOISE = re.compile(r"^(?:ERROR:|USDT:|STAGE:|Traceback \(most recent call last\))"  # library logs, printed tracebacks
                   r"|^\[[WEF][^\]\n]*\.(?:cpp|cc|cu|h|hpp):\d+\]"  # C++ logs: [W1130 12:00:00.000 ProcessGroup.cpp:12]
                   r"|^[WEF]\d{4} \d\d:\d\d:\d\d")  # glog without brackets: W1130 12:00:00.123 ...
HEADER = re.compile(r"[:：]\s*$")  # a line that announces what follows
CLASS_WARNING = re.compile(r"\b[A-Z]\w*Warning\b")  # UserWarning, FutureWarning, ...
LINE_WARNING = re.compile(r"^\s*warning:", re.I)


def line_problems(line):
    """What is wrong with one output line; [] when nothing is."""
    problems = []
    if ABSOLUTE_PATH.search(line):
        problems.append(f"an absolute path ({ABSOLUTE_PATH.search(line).group()!r})")
    if CLASS_WARNING.search(line) or LINE_WARNING.match(line):
        problems.append("a warning")
    if NOISE.match(line):
        problems.append("an error or log line of a library")
    return problems


def output_items(cell):
    """The outputs of one code cell in order, as ``("text", line)`` for every line of text (streams, text results,
    tracebacks without colour codes) and ``("other", kind)`` for a figure or another rich result."""
    for out in cell.get("outputs", []):
        kind = out["output_type"]
        if kind == "stream":
            text = "".join(out["text"])
        elif kind == "error":
            text = ANSI.sub("", "\n".join(out.get("traceback") or [f"{out['ename']}: {out['evalue']}"]))
        else:
            data = out.get("data", {})
            if set(data) - {"text/plain"}:
                yield "other", kind
                continue
            text = "".join(data.get("text/plain", ""))
        for line in text.splitlines():
            yield "text", line


def cell_problems(cell):
    """``(problem, line)`` for one code cell of a stored notebook."""
    problems = []
    tags = cell.get("metadata", {}).get("tags", [])
    if "raises-exception" not in tags:
        problems += [(f"an error ({out.get('ename')}) in a cell not tagged raises-exception", out.get("evalue", ""))
                     for out in cell.get("outputs", []) if out["output_type"] == "error"]
    items = list(output_items(cell))
    for kind, line in items:
        if kind == "text":
            problems += [(p, line) for p in line_problems(line)]
    last = [(kind, line) for kind, line in items if kind == "other" or line.strip()][-1:]
    if last and last[0][0] == "text" and HEADER.search(last[0][1]):
        problems.append(("an empty section: a header with nothing after it", last[0][1]))
    return problems


def allowed(stem, line, allow=ALLOWED):
    return any(s == stem and re.fullmatch(pattern, line) for s, pattern in allow)


def notebook_problems(path, allow=ALLOWED):
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    stem = Path(path).stem
    return [f"cell {cell.get('id')}: {problem}: {line[:160]!r}"
            for cell in nb["cells"] if cell["cell_type"] == "code"
            for problem, line in cell_problems(cell) if not allowed(stem, line, allow)]


def code_cell(*outputs, tags=()):
    return {"cell_type": "code", "id": "x", "metadata": {"tags": list(tags)}, "outputs": list(outputs), "source": ""}


def stream(text, name="stdout"):
    return {"output_type": "stream", "name": name, "text": text}


def test_rule_lines():
    for good in ["test accuracy 0.91", "saved as checkpoint.pt", "GB/s", "10 / 4 = 2.5", "sec/epoch",
                 "see https://pytorch.org/docs/stable/notes/cuda.html", "(m + S - 1) / m", "files: ['rank0.log']",
                 "RuntimeError: Found no NVIDIA driver on your system (http://www.nvidia.com/Download/index.aspx)",
                 "レプリカ 0（cpu）: 形状 (3, 10)", "warnings are off", "no ERROR: here, mid-line"]:
        assert line_problems(good) == [], good
    for bad in ["[plot] x=1.0 -> /tmp/mparlib-06-wn_dgtm7/plot.png", "ランク 0 のログ（/tmp/mparlib-ddp-x/rank0.log）:",
                "/work/main/mparlib/plot.py:101: UserWarning: marker is redundantly defined",
                "  File '/home/me/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py', line 3",
                "data in C:\\Users\\me\\data", "FutureWarning: `torch.cuda.amp.autocast(args...)` is deprecated",
                "Warning: this will change", "DeprecationWarning", "ERROR:2026-11-30 20:21:05 31658:31658 "
                "DeviceProperties.cpp:56] gpuGetDeviceCount failed with code 35",
                "USDT:2026-11-30 20:21:04 31658:31658 SyncActivityProfilerHandler.cpp:39] profiler_start",
                "STAGE:2024-01-01 00:00:00 1:1 ActivityProfilerController.cpp:312] Completed Stage: Warm Up",
                "[W1130 20:21:04.123456 31658 ProcessGroupNCCL.cpp:1234] Warning: something",
                "[W socket.cpp:464] [c10d] The server socket has failed to bind", "W1130 20:21:04.123 1 x.cc:1] x",
                "Traceback (most recent call last):"]:
        assert line_problems(bad), bad


def test_rule_cells():
    assert cell_problems(code_cell(stream("accuracy: 0.91\n"))) == []
    figure = {"output_type": "display_data", "metadata": {}, "data": {"image/png": "", "text/plain": "<Figure>"}}
    assert cell_problems(code_cell(stream("the figure:\n"), figure)) == [], "a header before a figure is not empty"
    empty = cell_problems(code_cell(stream("ランク 0 のログの末尾:\n"), stream("\n\n")))
    assert [p for p, _ in empty] == ["an empty section: a header with nothing after it"]
    error = {"output_type": "error", "ename": "ValueError", "evalue": "bad", "traceback": [
        "\x1b[31mValueError\x1b[39m Traceback", "File \x1b[32m/work/main/mparlib/x.py:3\x1b[39m, in f"]}
    assert {p.split(" (")[0] for p, _ in cell_problems(code_cell(error))} == {
        "an error", "an absolute path"}, "an unexpected error, and the path in its traceback"
    assert [p for p, _ in cell_problems(code_cell(error, tags=["raises-exception"]))] == [
        "an absolute path ('/work/main/mparlib/x.py')"], "an expected error may not show a path either"
    stderr = code_cell(stream("/usr/lib/x.py:1: UserWarning: careful\n  warnings.warn(\n", name="stderr"))
    assert len(cell_problems(stderr)) == 2


def test_rule_allow_list(tmp_path):
    nb = {"cells": [code_cell(stream("USDT: profiler_start\nok\n"))], "metadata": {}, "nbformat": 4,
          "nbformat_minor": 5}
    path = tmp_path / "07_x.ipynb"
    path.write_text(json.dumps(nb), encoding="utf-8")
    assert len(notebook_problems(path, allow={})) == 1
    assert notebook_problems(path, allow={("07_x", r"USDT: .*"): "shown on purpose"}) == []
    assert len(notebook_problems(path, allow={("06_y", r"USDT: .*"): "another chapter"})) == 1


def test_every_allowed_line_is_still_there_and_has_a_reason():
    for (stem, pattern), reason in ALLOWED.items():
        assert reason.strip(), f"{stem}: say why {pattern!r} is shown"
        lines = [line for path in NOTEBOOKS if path.stem == stem
                 for cell in json.loads(path.read_text(encoding="utf-8"))["cells"] if cell["cell_type"] == "code"
                 for kind, line in output_items(cell) if kind == "text"]
        assert any(re.fullmatch(pattern, line) for line in lines), f"{stem}: {pattern!r} matches nothing; remove it"


def test_there_are_notebooks_to_check():
    assert {p.parent.name for p in NOTEBOOKS} == {"en", "ja"} and len(NOTEBOOKS) >= 2


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_stored_outputs_are_clean(path):
    problems = notebook_problems(path)
    assert not problems, f"{path.parent.name}/{path.name}:\n" + "\n".join(problems)
