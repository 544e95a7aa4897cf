"""Build the course notebooks from their bilingual sources and execute them.

Each chapter has one source, ``notebooks/src/NN_name.py``, in the "percent" format: ``# %%`` starts a code cell
(optionally ``# %% tags=["nbval-ignore-output"]``), ``# %% [markdown]`` starts a markdown cell holding an
``<!-- en -->`` part and a ``<!-- ja -->`` part. From it come ``notebooks/en/NN_name.ipynb`` and
``notebooks/ja/NN_name.ipynb``: the same code cells, the prose in each language, executed and stored with outputs
(kernels start in the notebook's folder, so ``mparlib.lang()`` knows the edition).

    python tools/notebooks.py build [NAME ...]     # write and execute (all chapters by default)
    python tools/notebooks.py write [NAME ...]     # write without executing (outputs dropped)
    python tools/notebooks.py check                # stored notebooks agree with their sources
"""
import argparse
import ast
import json
import re
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "notebooks" / "src"
LANGS = ("en", "ja")
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
_CELL = re.compile(r"^# %%(?P<md> \[markdown\])?(?:\s+tags=(?P<tags>\[.*\]))?\s*$")
_LANG_MARK = re.compile(r"^<!--\s*(en|ja)\s*-->\s*$")


def parse(path):
    """Read a source file into a list of cells: ``("code", text, tags)`` or ``("markdown", {lang: text}, tags)``."""
    cells, kind, tags, lines = [], None, [], []

    def flush():
        if kind is None:
            return
        if kind == "code":
            text = "\n".join(lines).strip("\n")
            if text.strip():
                cells.append(("code", text, tags))
            return
        parts, current = {}, None
        for raw in lines:
            line = raw[2:] if raw.startswith("# ") else raw[1:] if raw.startswith("#") else raw
            m = _LANG_MARK.match(line.strip())
            if m:
                current = m.group(1)
                parts[current] = []
            elif current is not None:
                parts[current].append(line)
            elif line.strip():
                raise ValueError(f"{path}: markdown text before an <!-- en --> / <!-- ja --> marker: {line!r}")
        missing = [lang for lang in LANGS if lang not in parts]
        if missing:
            raise ValueError(f"{path}: a markdown cell lacks its {missing} part:\n" + "\n".join(lines[:5]))
        cells.append(("markdown", {k: "\n".join(v).strip("\n") for k, v in parts.items()}, tags))

    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        m = _CELL.match(line)
        if m:
            flush()
            kind = "markdown" if m.group("md") else "code"
            tags = ast.literal_eval(m.group("tags")) if m.group("tags") else []
            lines = []
        elif kind is None:
            if line.strip():
                raise ValueError(f"{path}:{n}: text before the first '# %%' cell marker")
        else:
            lines.append(line)
    flush()
    return cells


def notebook(cells, lang):
    """Make an (unexecuted) notebook in one language from parsed cells."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": KERNELSPEC, "language_info": {"name": "python"}, "mparlib": {"lang": lang}}
    for kind, body, tags in cells:
        meta = {"tags": list(tags)} if tags else {}
        if kind == "code":
            nb.cells.append(nbformat.v4.new_code_cell(body, metadata=meta))
        else:
            nb.cells.append(nbformat.v4.new_markdown_cell(body[lang], metadata=meta))
    for i, cell in enumerate(nb.cells):  # stable ids keep diffs small
        cell.id = f"c{i:03d}"
    return nb


def execute(nb, folder, timeout=1800):
    """Run every cell with the current Python's kernel, in ``folder``; stop at an unexpected error."""
    import os

    from nbclient import NotebookClient

    os.environ["MPARLIB_QUIET"] = "1"  # stored notebooks carry no progress bars (learners see them live)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(folder)}},
                            record_timing=False, allow_error_names=[])
    client.execute()
    return nb


def write(nb, path):
    """Save a notebook with stable formatting (sorted keys, one trailing newline)."""
    text = json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n"
    Path(path).write_text(text, encoding="utf-8")


def build(names, run=True):
    for name in names:
        cells = parse(SRC / f"{name}.py")
        for lang in LANGS:
            folder = ROOT / "notebooks" / lang
            nb = notebook(cells, lang)
            t0 = time.perf_counter()
            if run:
                execute(nb, folder)
            write(nb, folder / f"{name}.ipynb")
            print(f"{lang}/{name}.ipynb: {'executed' if run else 'written'} in {time.perf_counter() - t0:.1f} s", flush=True)


def check(names):
    """Return a list of problems: stored notebooks whose cells differ from their source."""
    problems = []
    for name in names:
        cells = parse(SRC / f"{name}.py")
        for lang in LANGS:
            path = ROOT / "notebooks" / lang / f"{name}.ipynb"
            if not path.exists():
                problems.append(f"{path.relative_to(ROOT)} is missing: run `make notebooks`")
                continue
            stored = nbformat.read(path, as_version=4)
            want = notebook(cells, lang)
            got = [(c.cell_type, c.source, c.metadata.get("tags", [])) for c in stored.cells]
            exp = [(c.cell_type, c.source, c.metadata.get("tags", [])) for c in want.cells]
            if got != exp:
                problems.append(f"{path.relative_to(ROOT)} is out of step with notebooks/src/{name}.py: run "
                                f"`python tools/notebooks.py build {name}`")
    return problems


def chapters():
    return sorted(p.stem for p in SRC.glob("[0-9][0-9]_*.py"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["build", "write", "check"])
    ap.add_argument("names", nargs="*", help="chapters such as 01_dataparallel (default: all)")
    args = ap.parse_args(argv)
    names = args.names or chapters()
    unknown = [n for n in names if not (SRC / f"{n}.py").exists()]
    if unknown:
        ap.error(f"no source for {unknown} in {SRC.relative_to(ROOT)}; known chapters: {chapters()}")
    if args.command == "check":
        problems = check(names)
        print("\n".join(problems) or f"{len(names)} chapter(s) in step with their sources")
        return 1 if problems else 0
    build(names, run=args.command == "build")
    return 0


if __name__ == "__main__":
    sys.exit(main())
