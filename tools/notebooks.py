"""Build the course notebooks from their bilingual sources and execute them.

Each chapter has one source, ``notebooks/src/NN_name.py``, in jupytext's "percent" format, read with jupytext
itself. From it come ``notebooks/en/NN_name.ipynb`` and ``notebooks/ja/NN_name.ipynb``: the same code cells, the
prose in each language, executed with the course's kernel "Python (mparlib)" (``make install`` registers it) and
stored with their outputs. Kernels start in the notebook's folder, so ``mparlib.lang`` knows the edition.

    python tools/notebooks.py build [NAME ...]     # write and execute (all chapters by default)
    python tools/notebooks.py write [NAME ...]     # write without executing (outputs dropped)
    python tools/notebooks.py write --out /tmp/nb  # the same, into another folder
    python tools/notebooks.py prose [NAME ...]     # new prose, stored outputs kept (code cells unchanged)
    python tools/notebooks.py check                # stored notebooks agree with their sources

What a source may hold:

- ``# %%`` starts a code cell and ``# %% [markdown]`` a markdown cell. A cell may have a title (``# %% Setup``,
  kept in the cell's metadata as jupytext does) and tags (``# %% tags=["nbval-ignore-output"]``); any other cell
  option is refused. Nothing but blank lines may come before the first ``# %%``.
- A markdown cell holds an English part and a Japanese part, each opened by its marker line, ``# <!-- en -->``
  and ``# <!-- ja -->``: one of each, and no text before the first marker.
- IPython magics in code cells are written commented, the way jupytext writes them, so that the source stays a
  valid Python file: ``# %load_ext mparlib.launch``, and ``# %%worker NAME`` as the first line of a cell. jupytext
  reads the uncommented spelling (``%load_ext ...``) the same way; either gives the magic in the notebook. A
  comment that merely looks like a magic is written ``# # %time`` and stays a comment.
- Raw cells (``# %% [raw]``, or a cell option such as ``active="py"``) are refused: the course's notebooks have
  code and markdown cells only, and a raw cell would show as unformatted text in JupyterLab and in the book.

Every notebook also starts with what a hosted copy needs (a notebook opened in Colab or Kaggle comes without the
course): a line of "Open in Colab / Kaggle" links when ``book.toml`` names the course's repository (see
``tools/links.py``), and always a code cell that installs the course when ``mparlib`` cannot be imported, and
does nothing (and prints nothing) where it can.

Both editions of a chapter are executed before either is written, and each file is replaced in one step (a
temporary file, then a rename), so a failure leaves the stored pair as it was; the temporary files of a write
that was killed are removed by the next write, and a notebook that would not change is not rewritten.
"""
import argparse
import glob
import json
import os
import re
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import NamedTuple

import jupytext
import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    import links
finally:
    sys.path.pop(0)

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "notebooks" / "src"
OUT = ROOT / "notebooks"
LANGS = ("en", "ja")
KERNEL_NAME = "mparlib"  # registered by `make install` (ipykernel install --sys-prefix --name mparlib)
KERNELSPEC = {"name": KERNEL_NAME, "display_name": "Python (mparlib)", "language": "python"}
LINKS_TAG = "course-links"  # the generated cells carry these tags (and ids), so that tools can tell them apart
INSTALL_TAG = "course-install"
FROM_BOOK_TOML = object()  # default of ``repo``: the repository configured in book.toml (or none)
CELL_OPTIONS = {"tags", "title"}
_LAYOUT_OPTIONS = {"lines_to_next_cell", "region_name", "cell_marker"}  # how jupytext laid the text out: ignored
_LANG_MARK = re.compile(r"^<!--\s*([A-Za-z]{2}(?:[-_][A-Za-z0-9]{2,4})?)\s*-->\s*$")  # <!-- en -->, <!-- fr -->
NAME = re.compile(r"[0-9][0-9]_[A-Za-z0-9_]+")  # a chapter: notebooks/src/NAME.py -> notebooks/<lang>/NAME.ipynb
_TAGS_OPTION = re.compile(r"\btags\s*=\s*")
D2L = "d2l==1.0.3"  # installed without its dependencies, as the Makefile does (its pins break current stacks)


class SourceError(ValueError):
    """A chapter source that cannot become notebooks; the message starts with ``file:line``."""


class BuildError(RuntimeError):
    """Executing a notebook failed or could not start; the message says which edition and cell, and what to do."""


class Cell(NamedTuple):
    """One cell of a source: ``kind`` "code" (``body`` is its text) or "markdown" (``body`` is ``{lang: text}``)."""

    kind: str
    body: object
    meta: dict  # "tags" and/or "title", when the source gives them
    line: int  # where the cell starts in the source (1-based)


def _cell_starts(lines):
    """``(line, marked)`` for each cell, split exactly as ``jupytext.reads`` splits ``lines``: the 0-based line
    where the cell starts, and whether that line is a cell marker (``# %% ...``).

    jupytext does not report positions, so this runs its percent-format cell reader over the lines the way
    ``jupytext.reads`` does; ``parse`` checks that both found the same number of cells.
    """
    from jupytext.formats import get_format_implementation
    from jupytext.header import header_to_metadata_and_cell

    impl = get_format_implementation(".py", "percent")
    _, _, header_cell, pos = header_to_metadata_and_cell(lines, impl.header_prefix, impl.header_suffix,
                                                         impl.extension)
    starts = [] if header_cell is None else [(0, False)]
    fmt = {"extension": ".py", "format_name": "percent"}
    while pos < len(lines):
        reader = impl.cell_reader_class(fmt, "python")
        marked = bool(reader.start_code_re.match(lines[pos]) or reader.alternative_start_code_re.match(lines[pos]))
        _, used = reader.read(lines[pos:])
        starts.append((pos, marked))
        pos += used
    return starts


def _uncomment(line):
    return line[2:] if line.startswith("# ") else line[1:] if line.startswith("#") else line


def _split_languages(where, text, file_lines, start, end):
    """``{lang: text}`` of a markdown cell, or a :class:`SourceError` naming the line that is wrong.

    ``text`` is the cell as jupytext read it; ``file_lines[start:end]`` is the same cell in the source, used for
    line numbers only (a marker's line is found by its place among the cell's marker lines).
    """
    body = [(n + 1, _uncomment(file_lines[n]).strip()) for n in range(start + 1, end)]
    marker_lines = [n for n, t in body if _LANG_MARK.match(t)]
    first_text = next((n for n, t in body if t), start + 1)
    parts, seen, k = {}, {}, 0
    for line in text.splitlines():
        m = _LANG_MARK.match(line.strip())
        if m:
            lang = m.group(1)
            at = marker_lines[k] if k < len(marker_lines) else start + 1
            k += 1
            if lang not in LANGS:
                raise SourceError(f"{where}:{at}: an unknown language marker <!-- {lang} -->; a markdown cell has "
                                  "an English part ('# <!-- en -->') and a Japanese part ('# <!-- ja -->') only.")
            if lang in parts:
                raise SourceError(f"{where}:{at}: a second <!-- {lang} --> marker in one markdown cell (the first is "
                                  f"on line {seen[lang]}); a cell has one English and one Japanese part, so remove "
                                  "one or start a new cell with '# %% [markdown]'.")
            parts[lang], seen[lang], current = [], at, lang
        elif parts:
            parts[current].append(line)
        elif line.strip():
            raise SourceError(f"{where}:{first_text}: markdown text before the cell's first <!-- en --> or <!-- ja --> "
                              f"marker: {line.strip()[:60]!r}; put it after '# <!-- en -->' or '# <!-- ja -->'.")
    missing = [lang for lang in LANGS if lang not in parts]
    if missing:
        what = " and ".join(f"<!-- {lang} -->" for lang in missing)
        raise SourceError(f"{where}:{start + 1}: this markdown cell has no {what} part; every markdown cell holds "
                          "'# <!-- en -->' with the English text and '# <!-- ja -->' with the Japanese text.")
    texts = {lang: "\n".join(lines).strip("\n") for lang, lines in parts.items()}
    for lang, value in texts.items():
        if not value.strip():
            raise SourceError(f"{where}:{seen[lang]}: the <!-- {lang} --> part of this markdown cell is empty.")
    return texts


def _read_source(path, where):
    """The text of a source: UTF-8 without a byte-order mark, else a :class:`SourceError` saying where and why."""
    raw = path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):
        raise SourceError(f"{where}:1: the file starts with a byte-order mark (BOM); save it as UTF-8 without BOM.")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise SourceError(f"{where}:{line}: byte {raw[err.start:err.start + 1]!r} is not UTF-8 (a file saved as "
                          "Latin-1 or Shift JIS?); save the file as UTF-8.") from None


def _bad_tags(lines):
    """``(line, text)`` of the first cell marker whose ``tags=`` is not a JSON list of strings, or None."""
    for n, line in enumerate(lines):
        m = _TAGS_OPTION.search(line) if line.startswith("# %%") else None
        if m:
            try:
                tags = json.JSONDecoder().raw_decode(line, m.end())[0]
            except ValueError:
                tags = None
            if not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
                return n + 1, line.strip()
    return None


def _jupytext(text, lines, where):
    """``jupytext.reads`` of a source; a source it cannot read becomes a :class:`SourceError`."""
    try:
        return jupytext.reads(text, fmt="py:percent")
    except Exception as err:  # jupytext raises several types (validation, parsing) for a malformed source
        bad = _bad_tags(lines)
        if bad:
            raise SourceError(f"{where}:{bad[0]}: cannot read the tags in {bad[1]!r}; tags must be a list of "
                              "strings, e.g. tags=[\"nbval-ignore-output\"].") from None
        first = str(err).strip().splitlines()[:1] or [type(err).__name__]
        raise SourceError(f"{where}: jupytext cannot read this source ({first[0]}); check the '# %%' lines.") from None


def parse(path):
    """Read a chapter source into a list of :class:`Cell`; raise :class:`SourceError` (``file:line``) if it is wrong."""
    path = Path(path)
    where = os.path.relpath(path, ROOT) if path.is_relative_to(ROOT) else str(path)
    text = _read_source(path, where)
    lines = text.splitlines()
    nb = _jupytext(text, lines, where)
    starts = _cell_starts(lines)
    if len(starts) != len(nb.cells):
        raise SourceError(f"{where}: jupytext read {len(nb.cells)} cells but {len(starts)} cell starts were found; "
                          "the installed jupytext splits cells differently from what this tool expects.")
    header = sorted(k for k in nb.metadata if k != "jupytext")
    if header:
        raise SourceError(f"{where}:1: a notebook header ('# ---' ... '# ---', here with {header}) is not used by "
                          "the course's sources: the tool writes the notebooks' metadata; remove the header.")
    cells = []
    for i, (cell, (start, marked)) in enumerate(zip(nb.cells, starts)):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(lines)
        at = f"{where}:{start + 1}"
        if not marked:
            if cell.source.strip():
                raise SourceError(f"{at}: text before the first '# %%' cell marker; start the file with "
                                  "'# %% [markdown]' or '# %%'.")
            continue
        if cell.cell_type == "raw":
            raise SourceError(f"{at}: a raw cell ({lines[start].strip()!r}); the course's notebooks have code and "
                              "markdown cells only: use '# %% [markdown]' or '# %%'.")
        options = {k: v for k, v in cell.metadata.items() if k not in _LAYOUT_OPTIONS}
        unknown = sorted(set(options) - CELL_OPTIONS)
        if "incorrectly_encoded_metadata" in unknown:
            raise SourceError(f"{at}: cannot read the cell options in {lines[start].strip()!r}; write them as "
                              "'# %% Title tags=[\"a\", \"b\"]'.")
        if unknown:
            raise SourceError(f"{at}: cell option(s) {unknown} in {lines[start].strip()!r}; the course's cells take "
                              "only a title and tags=[...].")
        tags = options.get("tags", [])
        if not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
            raise SourceError(f"{at}: tags must be a list of strings, e.g. tags=[\"nbval-ignore-output\"].")
        meta = {"tags": list(tags)} if tags else {}
        if "title" in options:
            meta["title"] = str(options["title"])
        if cell.cell_type == "code":
            source = cell.source.strip("\n")
            if source.strip():
                cells.append(Cell("code", source, meta, start + 1))
        else:
            cells.append(Cell("markdown", _split_languages(where, cell.source, lines, start, end), meta, start + 1))
    if not cells:
        raise SourceError(f"{where}: the source has no cells; a chapter starts with '# %% [markdown]' and its "
                          "'# <!-- en -->' and '# <!-- ja -->' parts.")
    return cells


# The first code cell of every notebook. A learner reads it first, so it stays short. It is the same in both
# editions, so its message picks the language when it runs (a kernel started in notebooks/ja speaks Japanese, as
# in mparlib.lang). It installs only on Colab and Kaggle, never into a learner's own Python. Hosted runtimes
# already have Jupyter, PyTorch and the packages d2l imports, so the course goes in without its "course" extra
# (which would reinstall JupyterLab and ipykernel over theirs), and d2l without its dependencies, as in the Makefile.
_NOT_INSTALLED = '''\
here = pathlib.Path.cwd()
if here.name == "ja" and here.parent.name == "notebooks":
    raise ModuleNotFoundError(
        "このカーネルはコースのパッケージ mparlib をインポートできません。コースのコピーの一番上のフォルダで "
        "make lab を実行すると、コースがインストールされて JupyterLab が起動します。このノートブックはそこで"
        "開き、カーネルには「Python (mparlib)」を選んでください（Kernel > Change Kernel）。")
raise ModuleNotFoundError(
    "This kernel cannot import the course's package mparlib. Run make lab in the top folder of a copy of the "
    "course: it installs the course and starts JupyterLab. Open this notebook there, with the kernel "
    "'Python (mparlib)' (Kernel > Change Kernel).")'''

INSTALL_FROM_CLONE = '''\
# The course's code is the package mparlib. Where the course is installed (make lab), this cell does nothing.
import importlib.util, pathlib

if importlib.util.find_spec("mparlib") is None:
{explain}'''

INSTALL_FROM_REPOSITORY = '''\
# Colab and Kaggle open this notebook without the course: there, this cell installs it (about a minute).
# Where the course is installed (make lab), it does nothing.
import importlib, importlib.util, os, pathlib, subprocess, sys

if importlib.util.find_spec("mparlib") is None:
    if "google.colab" in sys.modules or "KAGGLE_KERNEL_RUN_TYPE" in os.environ:
        pip = [sys.executable, "-m", "pip", "install", "--quiet"]
        subprocess.run(pip + [{requirement}], check=True)
        subprocess.run(pip + ["--no-deps", {d2l}], check=True)
        importlib.invalidate_caches()
    else:
{explain}'''

HOSTED_LINKS = {
    "en": "**No GPU at hand?** Run this notebook on a hosted one: [Open in Colab]({colab}) (one GPU) · "
          "[Open in Kaggle]({kaggle}) (two GPUs). Choose a GPU accelerator in the notebook's settings there; the "
          "first code cell installs the course.",
    "ja": "**GPU が手元にない場合**は、クラウドの GPU で実行できます: [Colab で開く]({colab})（GPU 1枚）・"
          "[Kaggle で開く]({kaggle})（GPU 2枚）。開いた先の設定でアクセラレータに GPU を選んでください。"
          "最初のコードセルがコースをインストールします。",
}


def install_cell_source(repo):
    """The first code cell: on Colab or Kaggle, install the course from ``repo`` (``(owner, name, branch)``, or
    ``None`` when no repository is configured); elsewhere, say how to install it; nothing if ``mparlib`` imports."""
    if repo is None:
        return INSTALL_FROM_CLONE.format(explain=textwrap.indent(_NOT_INSTALLED, " " * 4))
    requirement = f"mparlib @ git+{links.clone_url(repo)}@{repo[2]}"
    return INSTALL_FROM_REPOSITORY.format(requirement=json.dumps(requirement), d2l=json.dumps(D2L),
                                          explain=textwrap.indent(_NOT_INSTALLED, " " * 8))


def _repo(repo):
    return links.repository(ROOT) if repo is FROM_BOOK_TOML else repo


def notebook(cells, lang, name, repo=FROM_BOOK_TOML):
    """Make the (unexecuted) notebook ``notebooks/<lang>/<name>.ipynb`` from parsed cells."""
    repo = _repo(repo)
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"}, "mparlib": {"lang": lang}}
    if repo is not None:
        urls = links.hosted_links(repo, f"notebooks/{lang}/{name}.ipynb")
        cell = nbformat.v4.new_markdown_cell(HOSTED_LINKS[lang].format(**urls), metadata={"tags": [LINKS_TAG]})
        cell.id = LINKS_TAG
        nb.cells.append(cell)
    cell = nbformat.v4.new_code_cell(install_cell_source(repo), metadata={"tags": [INSTALL_TAG]})
    cell.id = INSTALL_TAG
    nb.cells.append(cell)
    for i, c in enumerate(cells):
        meta = json.loads(json.dumps(c.meta))
        new = nbformat.v4.new_code_cell if c.kind == "code" else nbformat.v4.new_markdown_cell
        cell = new(c.body if c.kind == "code" else c.body[lang], metadata=meta)
        cell.id = f"c{i:03d}"  # stable ids keep diffs small
        nb.cells.append(cell)
    return nb


def kernel_available(name=KERNEL_NAME):
    """True when Jupyter knows the kernel ``name`` (``make install`` registers "mparlib")."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec(name)
    except NoSuchKernel:
        return False
    return True


def execute(nb, folder, timeout=1800, where="notebook", lines=None):
    """Run every cell with the course's kernel in ``folder``; raise :class:`BuildError` naming the failing cell.

    ``lines[i]`` is the source line of cell ``i`` (for the message). Stored notebooks carry no progress bars:
    the kernel runs with ``MPARLIB_QUIET=1`` (learners see the bars live).
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    if not kernel_available():
        raise BuildError(f"the Jupyter kernel {KERNEL_NAME!r} (\"Python (mparlib)\") is not registered; run "
                         "`make install`, which registers it, then build again.")
    client = NotebookClient(nb, timeout=timeout, kernel_name=KERNEL_NAME, record_timing=False,
                            resources={"metadata": {"path": str(folder)}}, allow_error_names=[])
    try:
        client.execute(env={**os.environ, "MPARLIB_QUIET": "1"})
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as err:
        errors = [(i, o) for i, c in enumerate(nb.cells) if c.cell_type == "code"
                  and "raises-exception" not in c.metadata.get("tags", [])
                  for o in c.get("outputs", []) if o.get("output_type") == "error"]
        if errors:
            index, output = errors[0]
            summary = f"{output.get('ename')}: {output.get('evalue')}"
        else:  # a timeout or a dead kernel: the last cell that started
            index = max((i for i, c in enumerate(nb.cells) if c.get("execution_count")), default=0)
            summary = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip().splitlines()[-1:] or [type(err).__name__]
            summary = summary[0]
        if isinstance(err, CellTimeoutError):
            summary = f"it ran longer than the {timeout} s allowed per cell"
        line = f" (source line {lines[index]})" if lines and lines[index] else ""
        raise BuildError(f"{where}: cell {index}{line} failed: {summary}") from err
    for cell in nb.cells:  # tracebacks of cells that fail on purpose: no paths of the machine that built them
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                out["traceback"] = [portable_paths(t) for t in out.get("traceback", [])]
    return nb


_SITE = re.compile(r"(?:/[^\s\"'():]+)*/(?:site|dist)-packages/")
_STDLIB = re.compile(r"(?:/[^\s\"'():]+)*/lib/(python3\.\d+)/")
_TEMP = re.compile(re.escape(tempfile.gettempdir()) + r"/[^\s\"'():/]+/")


def portable_paths(text):
    """``text`` with this machine's absolute paths made relative: the repository, site-packages, the standard
    library and temporary folders. nbval does not compare tracebacks, so the stored ones may differ from a rerun's."""
    text = _SITE.sub("site-packages/", text)
    text = _STDLIB.sub(r"\1/", text)
    text = text.replace(str(ROOT) + "/", "")
    return _TEMP.sub("<temporary folder>/", text)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temporaries(path):
    """Remove the temporary files of writes of ``path`` that were killed (their process is gone)."""
    for old in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = old.name[len(path.name) + 2:].split(".", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or not _alive(int(pid)):
            old.unlink(missing_ok=True)


def write(nb, path):
    """Save a notebook with stable formatting (sorted keys, one trailing newline), replacing ``path`` in one step.

    Returns False, writing nothing, when ``path`` already holds exactly this notebook."""
    path = Path(path)
    nbformat.validate(nb)
    data = (json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8")
    _remove_stale_temporaries(path)
    if path.is_file() and path.read_bytes() == data:
        return False
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600 files; a notebook gets the usual permissions
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return True


def _source(src, name):
    """The path of chapter ``name``'s source; a name that is not ``NN_name`` could reach outside the folders."""
    if not (isinstance(name, str) and NAME.fullmatch(name)):
        raise SourceError(f"{name!r} is not a chapter name: chapters are named like 01_dataparallel (two digits, "
                          "'_', then letters, digits or '_') and their sources are notebooks/src/NAME.py.")
    return Path(src) / f"{name}.py"


def _read_stored(path, shown, name):
    """A stored notebook, or a :class:`BuildError` saying it is damaged and how to rebuild it."""
    try:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        return nb
    except Exception as err:  # nbformat raises several types for a file that is not a notebook
        first = str(err).strip().splitlines()[:1] or [type(err).__name__]
        raise BuildError(f"{shown} cannot be read as a notebook ({first[0][:120]}); rebuild it with "
                         f"`python tools/notebooks.py build {name}`.") from None


def build(names, run=True, *, src=SRC, out=OUT, repo=FROM_BOOK_TOML, timeout=1800):
    """Write (and with ``run``, execute) both editions of each chapter; neither is written unless both ran."""
    repo = _repo(repo)
    for name in names:
        cells = parse(_source(src, name))
        done = {}
        for lang in LANGS:
            folder = Path(out) / lang
            nb = notebook(cells, lang, name, repo)
            t0 = time.perf_counter()
            if run:
                generated = len(nb.cells) - len(cells)
                lines = [None] * generated + [c.line for c in cells]
                try:
                    execute(nb, folder, timeout, where=f"{lang}/{name}.ipynb", lines=lines)
                except BuildError as err:
                    raise BuildError(f"{err}\nNeither edition of {name} was written: the stored notebooks are "
                                     "unchanged.") from err.__cause__
            done[lang] = nb, time.perf_counter() - t0
        for lang, (nb, seconds) in done.items():
            write(nb, Path(out) / lang / f"{name}.ipynb")
            print(f"{lang}/{name}.ipynb: {'executed' if run else 'written'} in {seconds:.1f} s", flush=True)


def _options(cell):
    return {k: cell.metadata[k] for k in sorted(CELL_OPTIONS) if k in cell.metadata}


def _code(nb):
    return [(c.source, _options(c)) for c in nb.cells if c.cell_type == "code"]


def prose(names, *, src=SRC, out=OUT, repo=FROM_BOOK_TOML):
    """Write both editions with the markdown of their source and the outputs of the stored notebooks, without
    executing anything: for edits of the prose alone. Raise :class:`BuildError`, writing nothing for that chapter,
    when a code cell differs from the stored one (its outputs would no longer be what it prints: run ``build``)."""
    repo = _repo(repo)
    for name in names:
        cells = parse(_source(src, name))
        done = {}
        for lang in LANGS:
            path = Path(out) / lang / f"{name}.ipynb"
            if not path.exists():
                raise BuildError(f"{lang}/{name}.ipynb does not exist yet: run `python tools/notebooks.py build {name}`")
            stored, nb = _read_stored(path, f"{lang}/{name}.ipynb", name), notebook(cells, lang, name, repo)
            if _code(stored) != _code(nb):
                raise BuildError(f"{lang}/{name}.ipynb: the code cells of notebooks/src/{name}.py differ from the "
                                 f"stored ones, so their outputs would be stale: run `python tools/notebooks.py "
                                 f"build {name}`. Neither edition was written.")
            if "language_info" in stored.metadata:  # what the kernel reported when it ran the notebook
                nb.metadata["language_info"] = stored.metadata["language_info"]
            ran = iter(c for c in stored.cells if c.cell_type == "code")
            for cell in nb.cells:
                if cell.cell_type == "code":
                    old = next(ran)
                    cell.outputs, cell.execution_count = old.outputs, old.execution_count
            done[lang] = nb
        for lang, nb in done.items():
            changed = write(nb, Path(out) / lang / f"{name}.ipynb")
            print(f"{lang}/{name}.ipynb: {'prose updated, outputs kept' if changed else 'unchanged'}", flush=True)


def _comparable(nb):
    cells = [(c.cell_type, c.source, _options(c)) for c in nb.cells]
    return cells, nb.metadata.get("kernelspec", {}).get("name")


def check(names, *, src=SRC, out=OUT, repo=FROM_BOOK_TOML):
    """Return a list of problems: stored notebooks whose cells or kernel differ from what their source gives."""
    repo = _repo(repo)
    problems = []
    for name in names:
        cells = parse(_source(src, name))
        for lang in LANGS:
            path = Path(out) / lang / f"{name}.ipynb"
            shown = os.path.relpath(path, ROOT) if path.is_relative_to(ROOT) else str(path)
            if not path.exists():
                problems.append(f"{shown} is missing: run `make notebooks`")
                continue
            try:
                stored = _read_stored(path, shown, name)
            except BuildError as err:
                problems.append(str(err))
                continue
            if _comparable(stored) != _comparable(notebook(cells, lang, name, repo)):
                problems.append(f"{shown} is out of step with its source notebooks/src/{name}.py: run "
                                f"`python tools/notebooks.py build {name}`")
    return problems


def chapters(src=SRC):
    return sorted(p.stem for p in Path(src).glob("[0-9][0-9]_*.py"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n")[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["build", "write", "prose", "check"])
    ap.add_argument("names", nargs="*", help="chapters such as 01_dataparallel (default: all)")
    ap.add_argument("--out", type=Path, default=OUT, help="folder of the en/ and ja/ editions (default: notebooks)")
    args = ap.parse_args(argv)
    names = args.names or chapters()
    unknown = [n for n in names if n not in chapters()]
    if unknown:
        ap.error(f"no source for {unknown} in {SRC.relative_to(ROOT)}; known chapters: {chapters()}")
    try:
        if args.command == "check":
            problems = check(names, out=args.out)
            print("\n".join(problems) or f"{len(names)} chapter(s) in step with their sources")
            return 1 if problems else 0
        for lang in LANGS:
            (args.out / lang).mkdir(parents=True, exist_ok=True)
        if args.command == "prose":
            prose(names, out=args.out)
        else:
            build(names, run=args.command == "build", out=args.out)
    except (SourceError, BuildError, links.LinkError) as err:
        print(f"{ap.prog}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
