"""tools/notebooks.py: how a chapter source becomes two notebooks, and what a hosted notebook's first cell does."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
try:
    import links
    import notebooks as builder
finally:
    sys.path.pop(0)

REPO = ("course-owner", "course-repo", "main")
MD = "# %% [markdown]\n# <!-- en -->\n# {en}\n# <!-- ja -->\n# {ja}\n"


def source(tmp_path, text, name="00_tiny"):
    path = tmp_path / "src" / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def error_of(tmp_path, text):
    with pytest.raises(builder.SourceError) as info:
        builder.parse(source(tmp_path, text))
    return str(info.value)


# --- reading the percent format -----------------------------------------------------------------------------------

def test_a_titled_cell_marker_starts_a_new_cell(tmp_path):
    cells = builder.parse(source(tmp_path, "# %%\nx = 1\n\n# %% Load the data\ny = 2\n"))
    assert [(c.kind, c.body, c.meta, c.line) for c in cells] == [
        ("code", "x = 1", {}, 1), ("code", "y = 2", {"title": "Load the data"}, 4)]


def test_tags_and_markdown_cells(tmp_path):
    text = MD.format(en="Hello", ja="こんにちは") + '\n# %% tags=["nbval-ignore-output", "raises-exception"]\n1 / 0\n'
    cells = builder.parse(source(tmp_path, text))
    assert cells[0] == builder.Cell("markdown", {"en": "Hello", "ja": "こんにちは"}, {}, 1)
    assert cells[1] == builder.Cell("code", "1 / 0", {"tags": ["nbval-ignore-output", "raises-exception"]}, 7)


def test_a_cell_marker_inside_a_string_is_not_a_cell(tmp_path):
    cells = builder.parse(source(tmp_path, '# %%\ns = """\n# %% not a cell\n"""\n\n# %%\nt = 2\n'))
    assert [c.body for c in cells] == ['s = """\n# %% not a cell\n"""', "t = 2"]
    assert [c.line for c in cells] == [1, 6]


def test_raw_cells_are_refused_with_their_line(tmp_path):
    message = error_of(tmp_path, "# %%\nx = 1\n\n# %% [raw]\nsome text\n")
    assert "00_tiny.py:4:" in message and "raw cell" in message


def test_a_cell_that_is_inactive_in_notebooks_counts_as_raw(tmp_path):
    assert "00_tiny.py:1: a raw cell" in error_of(tmp_path, '# %% active="py"\nx = 1\n')


def test_unknown_cell_options_are_refused(tmp_path):
    message = error_of(tmp_path, "# %%\nx = 1\n# %% colour=\"red\"\ny = 2\n")
    assert "00_tiny.py:3:" in message and "colour" in message


def test_a_second_english_part_is_refused_with_both_lines(tmp_path):
    text = "# %% [markdown]\n# <!-- en -->\n# one\n# <!-- en -->\n# two\n# <!-- ja -->\n# 三\n"
    message = error_of(tmp_path, text)
    assert "00_tiny.py:4: a second <!-- en --> marker" in message and "line 2" in message


def test_a_missing_japanese_part_is_refused(tmp_path):
    message = error_of(tmp_path, "# %%\nx = 1\n\n# %% [markdown]\n# <!-- en -->\n# only English\n")
    assert "00_tiny.py:4:" in message and "no <!-- ja --> part" in message


def test_an_empty_part_is_refused(tmp_path):
    message = error_of(tmp_path, "# %% [markdown]\n# <!-- en -->\n# text\n# <!-- ja -->\n#\n")
    assert "00_tiny.py:4:" in message and "empty" in message


def test_text_before_the_first_language_marker_is_refused(tmp_path):
    message = error_of(tmp_path, "# %% [markdown]\n#\n# stray words\n# <!-- en -->\n# a\n# <!-- ja -->\n# b\n")
    assert "00_tiny.py:3: markdown text before" in message and "stray words" in message


def test_text_before_the_first_cell_marker_is_refused(tmp_path):
    message = error_of(tmp_path, "import os\n\n# %%\nx = 1\n")
    assert "00_tiny.py:1: text before the first '# %%'" in message


def test_leading_blank_lines_are_fine(tmp_path):
    assert [c.body for c in builder.parse(source(tmp_path, "\n\n# %%\nx = 1\n"))] == ["x = 1"]


def test_a_notebook_header_is_refused(tmp_path):
    text = "# ---\n# jupyter:\n#   kernelspec:\n#     name: other\n#     display_name: Other\n# ---\n\n# %%\nx = 1\n"
    assert "00_tiny.py:1: a notebook header" in error_of(tmp_path, text)


def test_magics_reach_the_notebook_whether_commented_or_not(tmp_path):
    text = ("# %%\n# %load_ext mparlib.launch\n\n# %%\n%load_ext mparlib.launch\n\n"
            "# %%\n# %%worker my_workers\nimport os\n\n# %%\n%%worker my_workers\nimport os\n\n"
            "# %%\n# # %time is only a comment here\nx = 1\n")
    cells = builder.parse(source(tmp_path, text))
    assert [c.body for c in cells] == ["%load_ext mparlib.launch", "%load_ext mparlib.launch",
                                      "%%worker my_workers\nimport os", "%%worker my_workers\nimport os",
                                      "# %time is only a comment here\nx = 1"]
    en, ja = (builder.notebook(cells, lang, "00_tiny", repo=None) for lang in ("en", "ja"))
    assert [c.source for c in en.cells if c.cell_type == "code"] == [c.source for c in ja.cells
                                                                       if c.cell_type == "code"]
    # jupytext writes the magics commented (the spelling the sources use) and reads them back unchanged.
    text_again = jupytext.writes(en, fmt="py:percent")
    assert "\n# %load_ext mparlib.launch\n" in text_again and "\n# %%worker my_workers\n" in text_again
    assert [c.source for c in jupytext.reads(text_again, fmt="py:percent").cells] == [c.source for c in en.cells]


def test_every_chapter_source_parses_and_keeps_its_cells_in_order():
    for name in builder.chapters():
        cells = builder.parse(builder.SRC / f"{name}.py")
        assert cells and cells[0].kind == "markdown", name
        assert [c.line for c in cells] == sorted(c.line for c in cells), name


# --- the generated notebook ---------------------------------------------------------------------------------------

def test_notebooks_use_the_course_kernel_and_start_with_the_install_cell(tmp_path):
    cells = builder.parse(source(tmp_path, MD.format(en="Hi", ja="やあ") + "\n# %%\nx = 1\n"))
    nb = builder.notebook(cells, "en", "00_tiny", repo=None)
    assert nb.metadata["kernelspec"] == {"name": "mparlib", "display_name": "Python (mparlib)", "language": "python"}
    assert [(c.cell_type, c.id) for c in nb.cells] == [("code", "course-install"), ("markdown", "c000"),
                                                       ("code", "c001")]
    assert nb.cells[0].source == builder.install_cell_source(None)
    nbformat.validate(nb)


@pytest.mark.parametrize("lang, words", [("en", ["Open in Colab", "Open in Kaggle"]),
                                         ("ja", ["Colab で開く", "Kaggle で開く"])])
def test_a_configured_repository_adds_links_to_the_notebooks_own_path(tmp_path, lang, words):
    cells = builder.parse(source(tmp_path, MD.format(en="Hi", ja="やあ") + "\n# %%\nx = 1\n"))
    nb = builder.notebook(cells, lang, "00_tiny", repo=REPO)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.metadata["tags"] == [builder.LINKS_TAG]
    urls = links.hosted_links(REPO, f"notebooks/{lang}/00_tiny.ipynb")
    for word, url in zip(words, (urls["colab"], urls["kaggle"])):
        assert f"[{word}]({url})" in first.source
    assert nb.cells[1].source == builder.install_cell_source(REPO)
    other = builder.notebook(cells, "ja" if lang == "en" else "en", "00_tiny", repo=REPO)
    assert [c.source for c in nb.cells if c.cell_type == "code"] == [c.source for c in other.cells
                                                                      if c.cell_type == "code"]


def test_check_finds_a_notebook_with_another_kernel(tmp_path):
    src = source(tmp_path, "# %%\nx = 1\n")
    out = tmp_path / "out"
    for lang in builder.LANGS:
        (out / lang).mkdir(parents=True)
    builder.build(["00_tiny"], run=False, src=src.parent, out=out, repo=None)
    assert builder.check(["00_tiny"], src=src.parent, out=out, repo=None) == []
    path = out / "en" / "00_tiny.ipynb"
    nb = nbformat.read(path, as_version=4)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nbformat.write(nb, path)
    problems = builder.check(["00_tiny"], src=src.parent, out=out, repo=None)
    assert len(problems) == 1 and "en/00_tiny.ipynb is out of step" in problems[0]


# --- the install cell's logic, offline ----------------------------------------------------------------------------

@pytest.fixture
def cell_world(monkeypatch, tmp_path):
    """Run the install cell as a kernel would, with ``mparlib`` importable or not and pip replaced by a recorder."""
    calls = []
    real_find_spec = importlib.util.find_spec

    def run(repo, *, importable=False, colab=False, kaggle=False, folder="elsewhere"):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: real_find_spec(name, *a) if importable or name != "mparlib" else None)
        monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append((cmd, kw)))
        if colab:
            monkeypatch.setitem(sys.modules, "google.colab", type(sys)("google.colab"))
        else:
            monkeypatch.delitem(sys.modules, "google.colab", raising=False)
        if kaggle:
            monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
        else:
            monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
        cwd = tmp_path / folder
        cwd.mkdir(parents=True, exist_ok=True)
        monkeypatch.chdir(cwd)
        exec(compile(builder.install_cell_source(repo), "<install cell>", "exec"), {})
        return calls

    run.calls = calls
    return run


@pytest.mark.parametrize("host", ["colab", "kaggle"])
def test_on_a_hosted_runtime_the_cell_installs_the_course_from_the_repository(cell_world, host):
    calls = cell_world(REPO, **{host: True})
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    assert [cmd for cmd, _ in calls] == [pip + ["mparlib @ git+https://github.com/course-owner/course-repo.git@main"],
                                         pip + ["--no-deps", "d2l==1.0.3"]]
    assert all(kw.get("check") is True for _, kw in calls), "a failed pip must stop the notebook"
    requirement = Requirement(calls[0][0][-1])
    assert requirement.name == "mparlib" and requirement.url == "git+" + links.clone_url(REPO) + "@main"


@pytest.mark.parametrize("repo", [REPO, None])
def test_where_mparlib_imports_the_cell_does_nothing(cell_world, capsys, repo):
    assert cell_world(repo, importable=True, colab=True) == []
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("folder, words", [("notebooks/en", "Run make lab"), ("elsewhere", "Run make lab"),
                                           ("notebooks/ja", "make lab を実行")])
@pytest.mark.parametrize("repo", [REPO, None])
def test_outside_colab_and_kaggle_the_cell_explains_how_to_install(cell_world, repo, folder, words):
    with pytest.raises(ModuleNotFoundError, match=words):
        cell_world(repo, folder=folder)
    assert cell_world.calls == [], "nothing is installed outside Colab and Kaggle"


def test_without_a_repository_even_colab_gets_the_explanation(cell_world):
    with pytest.raises(ModuleNotFoundError, match="make lab"):
        cell_world(None, colab=True, kaggle=True)
    assert cell_world.calls == []


# --- writing and executing ----------------------------------------------------------------------------------------

def test_write_replaces_the_file_in_one_step(tmp_path, monkeypatch):
    path = tmp_path / "00_tiny.ipynb"
    path.write_text("the stored notebook", encoding="utf-8")
    nb = builder.notebook(builder.parse(source(tmp_path, "# %%\nx = 1\n")), "en", "00_tiny", repo=None)

    def broken_rename(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_rename)
    with pytest.raises(OSError, match="disk full"):
        builder.write(nb, path)
    assert path.read_text(encoding="utf-8") == "the stored notebook"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00_tiny.ipynb", "src"], "a temporary file was left"
    monkeypatch.undo()
    nb.cells[0].source = 42  # not a notebook any more: refused before anything is written
    with pytest.raises(nbformat.ValidationError):
        builder.write(nb, path)
    assert path.read_text(encoding="utf-8") == "the stored notebook"
    nb.cells[0].source = "x = 1"
    builder.write(nb, path)
    assert json.loads(path.read_text(encoding="utf-8"))["cells"][1]["source"] == "x = 1"
    assert path.stat().st_mode & 0o044 == 0o044 & ~_umask(), "the new notebook is readable like any new file"


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_missing_course_kernel_is_explained(tmp_path, monkeypatch):
    monkeypatch.setattr(builder, "kernel_available", lambda name=builder.KERNEL_NAME: False)
    nb = builder.notebook(builder.parse(source(tmp_path, "# %%\nx = 1\n")), "en", "00_tiny", repo=None)
    with pytest.raises(builder.BuildError, match="make install"):
        builder.execute(nb, tmp_path)


TINY = MD.format(en="Where am I?", ja="ここはどこ?") + """
# %%
# %%capture captured
print("hidden")

# %%
import os, pathlib
print(pathlib.Path.cwd().name, captured.stdout.strip(), os.environ.get("MPARLIB_QUIET"))
"""


def _editions(tmp_path, text):
    src = source(tmp_path, text)
    out = tmp_path / "out"
    for lang in builder.LANGS:
        (out / lang).mkdir(parents=True)
        (out / lang / "00_tiny.ipynb").write_text(f"stored {lang}", encoding="utf-8")
    return src.parent, out


@pytest.mark.slow
def test_a_failure_in_the_japanese_edition_leaves_both_notebooks_untouched(tmp_path):
    text = TINY + '\n# %%\nassert pathlib.Path.cwd().name != "ja", "only the Japanese edition fails"\n'
    src, out = _editions(tmp_path, text)
    with pytest.raises(builder.BuildError) as info:
        builder.build(["00_tiny"], src=src, out=out, repo=None, timeout=120)
    message = str(info.value)
    assert message.startswith("ja/00_tiny.ipynb: cell 4 (source line 15) failed"), message
    assert "AssertionError: only the Japanese edition fails" in message and "Neither edition" in message
    assert [(out / lang / "00_tiny.ipynb").read_text(encoding="utf-8") for lang in builder.LANGS] == [
        "stored en", "stored ja"]


@pytest.mark.slow
def test_both_editions_run_in_their_folders_with_the_course_kernel(tmp_path, monkeypatch):
    monkeypatch.delenv("MPARLIB_QUIET", raising=False)  # the tool sets it for the kernel by itself
    src, out = _editions(tmp_path, TINY)
    builder.build(["00_tiny"], src=src, out=out, repo=None, timeout=120)
    for lang in builder.LANGS:
        nb = nbformat.read(out / lang / "00_tiny.ipynb", as_version=4)
        assert nb.metadata["kernelspec"]["name"] == "mparlib"
        install, _, capture, show = nb.cells
        assert install.outputs == [] and install.execution_count == 1, "mparlib imports: the cell shows nothing"
        assert capture.outputs == [], "%%capture ran as a cell magic"
        assert [o.get("text") for o in show.outputs] == [f"{lang} hidden 1\n"], "folder, magic, quiet progress"
    assert builder.check(["00_tiny"], src=src, out=out, repo=None) == []


def test_stored_tracebacks_carry_no_paths_of_the_machine_that_built_them():
    root = str(builder.ROOT)
    text = (f"File {root}/mparlib/launch.py:12, {root}/.venv/lib/python3.11/site-packages/torch/nn/x.py, "
            "/usr/lib/python3.11/argparse.py and /tmp/mparlib-workers-ab12/ddp_workers.py")
    got = builder.portable_paths(text)
    assert got == ("File mparlib/launch.py:12, site-packages/torch/nn/x.py, python3.11/argparse.py and "
                   "<temporary folder>/ddp_workers.py")
    assert builder.portable_paths("no path here: 3/4 of a batch") == "no path here: 3/4 of a batch"


@pytest.mark.slow
def test_prose_updates_the_markdown_and_keeps_the_outputs_without_running_anything(tmp_path):
    text = MD.format(en="Old words.", ja="古い文です。") + "\n# %%\nprint(6 * 7)\n"
    src, out = _editions(tmp_path, text)
    builder.build(["00_tiny"], src=src, out=out, repo=None, timeout=120)
    ran = {lang: nbformat.read(out / lang / "00_tiny.ipynb", as_version=4) for lang in builder.LANGS}
    source(tmp_path, text.replace("Old words.", "New words.").replace("古い文です。", "新しい文です。"))
    builder.prose(["00_tiny"], src=src, out=out, repo=None)
    for lang, words in (("en", "New words."), ("ja", "新しい文です。")):
        nb = nbformat.read(out / lang / "00_tiny.ipynb", as_version=4)
        assert [c.source for c in nb.cells if c.cell_type == "markdown"][-1] == words
        assert [c.outputs for c in nb.cells if c.cell_type == "code"] == [
            c.outputs for c in ran[lang].cells if c.cell_type == "code"]
        assert nb.cells[-1].outputs[0]["text"] == "42\n"
    assert builder.check(["00_tiny"], src=src, out=out, repo=None) == []


def test_prose_refuses_a_changed_code_cell_and_writes_neither_edition(tmp_path):
    text = MD.format(en="Words.", ja="文です。") + "\n# %%\nprint(6 * 7)\n"
    src, out = _editions(tmp_path, text)
    builder.build(["00_tiny"], run=False, src=src, out=out, repo=None)
    before = [(out / lang / "00_tiny.ipynb").read_bytes() for lang in builder.LANGS]
    source(tmp_path, text.replace("6 * 7", "6 * 9").replace("Words.", "Other words."))
    with pytest.raises(builder.BuildError, match=r"code cells .* differ .* run `python tools/notebooks.py build"):
        builder.prose(["00_tiny"], src=src, out=out, repo=None)
    assert [(out / lang / "00_tiny.ipynb").read_bytes() for lang in builder.LANGS] == before


# --- hostile or damaged input: a clear error or the right behaviour, never a traceback ----------------------------

def test_a_chapter_name_that_leaves_the_notebooks_folder_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        builder.main(["write", "../../x", "--out", str(tmp_path)])
    assert info.value.code == 2 and "no source for ['../../x']" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing was written"
    src = source(tmp_path, "# %%\nx = 1\n", name="00_ok")
    (tmp_path / "x.py").write_text("# %%\nx = 1\n", encoding="utf-8")  # a source outside notebooks/src ...
    for name in ("../x", "00_ok/../../x", "/abs", ""):  # ... cannot be reached through a name
        with pytest.raises(builder.SourceError, match="is not a chapter name"):
            builder.build([name], run=False, src=src.parent, out=tmp_path / "out", repo=None)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("*.ipynb"))


def test_an_unknown_language_marker_is_refused_with_its_line(tmp_path):
    text = "# %% [markdown]\n# <!-- en -->\n# a\n# <!-- ja -->\n# b\n# <!-- fr -->\n# c\n"
    message = error_of(tmp_path, text)
    assert "00_tiny.py:6: an unknown language marker <!-- fr -->" in message


@pytest.mark.parametrize("text", ["", "\n\n", "# %%\n\n"])
def test_a_source_without_cells_is_refused(tmp_path, text):
    assert "00_tiny.py: the source has no cells" in error_of(tmp_path, text)


@pytest.mark.parametrize("data, expected", [
    ("\ufeff# %%\nx = 1\n".encode("utf-8"), "00_tiny.py:1: the file starts with a byte-order mark (BOM)"),
    ("# %%\nx = 'caf\xe9'\n".encode("latin-1"), "00_tiny.py:2: byte b'\\xe9' is not UTF-8"),
    (b'# %% tags="a"\nx = 1\n', "00_tiny.py:1: cannot read the tags in '# %% tags=\"a\"'"),
    (b'# %%\nx = 1\n# %% tags=[1]\nx = 1\n', "00_tiny.py:3: cannot read the tags in '# %% tags=[1]'"),
    (b'# %% tags=[oops\nx = 1\n', "00_tiny.py:1: cannot read the cell options in '# %% tags=[oops'"),
])
def test_unreadable_sources_are_explained(tmp_path, data, expected):
    path = tmp_path / "src" / "00_tiny.py"
    path.parent.mkdir()
    path.write_bytes(data)
    with pytest.raises(builder.SourceError) as info:
        builder.parse(path)
    assert expected in str(info.value)


@pytest.mark.parametrize("damage", ["{not json", '{"nbformat": 4}', "[]", ""])
def test_a_damaged_stored_notebook_is_explained(tmp_path, damage):
    src, out = _editions(tmp_path, MD.format(en="Words.", ja="文です。") + "\n# %%\nx = 1\n")
    builder.build(["00_tiny"], run=False, src=src, out=out, repo=None)
    (out / "ja" / "00_tiny.ipynb").write_text(damage, encoding="utf-8")
    with pytest.raises(builder.BuildError, match=r"ja/00_tiny.ipynb cannot be read as a notebook .*"
                                                 r"`python tools/notebooks.py build 00_tiny`"):
        builder.prose(["00_tiny"], src=src, out=out, repo=None)
    problems = builder.check(["00_tiny"], src=src, out=out, repo=None)
    assert len(problems) == 1 and "cannot be read as a notebook" in problems[0]


def test_prose_without_an_edit_writes_nothing_and_keeps_language_info(tmp_path, capsys):
    src, out = _editions(tmp_path, MD.format(en="Words.", ja="文です。") + "\n# %%\nx = 1\n")
    builder.build(["00_tiny"], run=False, src=src, out=out, repo=None)
    info = {"name": "python", "version": "3.11.2", "mimetype": "text/x-python"}
    for lang in builder.LANGS:  # as the kernel reports it when the notebook runs
        path = out / lang / "00_tiny.ipynb"
        nb = nbformat.read(path, as_version=4)
        nb.metadata["language_info"] = info
        builder.write(nb, path)
    before = {lang: ((out / lang / "00_tiny.ipynb").read_bytes(), (out / lang / "00_tiny.ipynb").stat().st_mtime_ns)
              for lang in builder.LANGS}
    builder.prose(["00_tiny"], src=src, out=out, repo=None)
    assert capsys.readouterr().out.count("unchanged") == 2
    assert {lang: ((out / lang / "00_tiny.ipynb").read_bytes(), (out / lang / "00_tiny.ipynb").stat().st_mtime_ns)
            for lang in builder.LANGS} == before
    source(tmp_path, (MD.format(en="New words.", ja="新しい文です。") + "\n# %%\nx = 1\n"))
    builder.prose(["00_tiny"], src=src, out=out, repo=None)
    assert nbformat.read(out / "en" / "00_tiny.ipynb", as_version=4).metadata["language_info"] == info


def test_a_killed_write_leaves_no_temporary_file_behind_the_next_write(tmp_path):
    path = tmp_path / "00_tiny.ipynb"
    nb = builder.notebook(builder.parse(source(tmp_path, "# %%\nx = 1\n")), "en", "00_tiny", repo=None)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    killed = tmp_path / f".00_tiny.ipynb.{dead}.abc123.tmp"  # what a write killed mid-way leaves
    older = tmp_path / ".00_tiny.ipynb.k2j4x9.tmp"  # the name earlier versions of the tool used
    running = tmp_path / f".00_tiny.ipynb.{os.getppid()}.def456.tmp"  # a write in progress elsewhere
    other = tmp_path / f".01_other.ipynb.{dead}.abc123.tmp"
    for stale in (killed, older, running, other):
        stale.write_text("half a notebook", encoding="utf-8")
    assert builder.write(nb, path) is True
    assert not killed.exists() and not older.exists()
    assert running.exists() and other.exists(), "only this notebook's files of writes that are gone"
