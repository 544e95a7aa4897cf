"""The book builder refuses what a hostile notebook or a planted file would use to publish or delete something.

Each test is one case of an attack on `make book`: a file that is HTML or SVG under an image's name or type, a
processing instruction in an SVG, a notebook or image linked in from outside, an ownership mark committed beside
tracked files, an attachment that would overwrite a figure, an output too large for a page, a build that fails
half-way. The few helpers are copied from tests/test_book.py.
"""
import base64
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # the book builder is a set of scripts beside tools/notebooks.py
import book  # noqa: E402
import book_html  # noqa: E402
import book_pages  # noqa: E402
from test_book import tiny_png  # noqa: E402  (the same one-colour PNG as the builder's own tests)

SCRIPT = b"<script>alert(document.cookie)</script>"
WEBP = b"RIFF\x24\x00\x00\x00WEBPVP8 "  # the first bytes of a WebP file
GIF = b"GIF89a\x01\x00\x01\x00\x00\x00\x00;"
SVG_SCRIPT = b'<svg xmlns="http://www.w3.org/2000/svg"><script>alert(1)</script></svg>'
SVG_PI = (b'<?xml version="1.0" encoding="utf-8"?>\n<?xml-stylesheet type="text/css" '
          b'href="https://example.org/track.css"?>\n<svg xmlns="http://www.w3.org/2000/svg"><rect/></svg>')




def b64(data):
    return base64.b64encode(data).decode("ascii")


def attached(name, mime, data, text=None):
    """A markdown cell that shows one attachment."""
    cell = nbformat.v4.new_markdown_cell(text or f"# Page\n\n![x](attachment:{name})")
    cell.attachments = {name: {mime: data.decode() if mime == "image/svg+xml" else b64(data)}}
    return cell


def notebook_file(path, cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def convert(tmp_path, *cells, name="00_x"):
    """Convert a notebook of ``cells`` (notebooks/en/NAME.ipynb under tmp_path); return the output folder."""
    nb = notebook_file(tmp_path / "notebooks" / "en" / f"{name}.ipynb", list(cells))
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    book_pages.convert(nb, out, "en")
    return out


def published(out):
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())


def make_tiny_notebooks(folder):
    """notebooks/en and notebooks/ja with one chapter each (a heading and a figure)."""
    nbdir = Path(folder) / "notebooks"
    for lang in book.LANGS:
        code = nbformat.v4.new_code_cell("plot()")
        code.outputs = [nbformat.v4.new_output("display_data", data={"image/png": b64(tiny_png())})]
        notebook_file(nbdir / lang / "00_intro.ipynb", [nbformat.v4.new_markdown_cell("# Intro\n\nText."), code])
    return nbdir


# --- 1, 2: an attachment is published only as the image its bytes hold ------------------------------------------

def test_an_attachment_named_like_a_page_is_never_published_as_html(tmp_path):
    page = b"<html><head>" + SCRIPT + b"</head><body><main>hi</main></body></html>"
    with pytest.raises(book.BookError, match=r'attachments\["page.html"\] is declared as WEBP but its bytes are no '
                                             r"image the book publishes"):
        convert(tmp_path, attached("page.html", "image/webp", page))
    # a WebP file that goes on with a script (a polyglot) is published as what it starts as: an image
    out = convert(tmp_path, attached("page.html", "image/webp", WEBP + SCRIPT))
    assert published(out) == ["00_x.md", "figures/00_x/page.webp"]
    assert "](figures/00_x/page.webp)" in (out / "00_x.md").read_text(encoding="utf-8")


def test_a_page_the_build_did_not_make_gets_no_policy_for_its_scripts(tmp_path):
    site = tmp_path / "en"
    site.mkdir()
    page = "<!DOCTYPE html><html><head><meta charset=\"utf-8\">{}</head><body><main>{}</main></body></html>"
    (site / "index.html").write_text(page.format("<script>var path_to_root = '';</script>", "Hello"))
    (site / "figures").mkdir()
    (site / "figures" / "page.html").write_text(page.format(SCRIPT.decode(), "x"))
    with pytest.raises(ValueError, match=r"page.html: an HTML file that is not one of mdBook's pages"):
        book_html.secure_book(site, {"index.html"})
    assert "Content-Security-Policy" not in (site / "figures" / "page.html").read_text()
    (site / "figures" / "page.html").unlink()
    assert book_html.secure_book(site, {"index.html"}) == 1


def test_an_svg_attachment_declared_as_gif_is_refused(tmp_path):
    with pytest.raises(book.BookError, match=r'attachments\["evil.svg"\] is declared as GIF but its bytes are no '
                                             r"image"):
        convert(tmp_path, attached("evil.svg", "image/gif", SVG_SCRIPT))
    with pytest.raises(book.BookError, match=r'attachments\["evil.gif"\] cannot be published: it has a <script>'):
        convert(tmp_path, attached("evil.gif", "image/svg+xml", SVG_SCRIPT))
    out = convert(tmp_path, attached("evil.svg", "image/gif", GIF))  # a real GIF: published under its own type
    assert published(out) == ["00_x.md", "figures/00_x/evil.gif"]


@pytest.mark.parametrize("mime, data, problem", [
    ("image/png", tiny_png()[:4] + b"<html>", "does not hold a PNG image"),  # the notebook check
    ("image/gif", b"<html>" + SCRIPT, "declared as GIF but its bytes are no image"),
    ("image/gif", WEBP, "declared as GIF but its bytes are a WEBP image"),
    ("image/bmp", b"BM....", "is image/bmp; the book publishes PNG, JPEG, GIF, WebP and SVG images only"),
])
def test_attachments_are_checked_by_their_bytes(tmp_path, mime, data, problem):
    with pytest.raises(book.BookError, match=problem):
        convert(tmp_path, attached("a.png", mime, data))


# --- 3: processing instructions in SVG ----------------------------------------------------------------------------

def test_an_svg_with_a_stylesheet_instruction_is_refused_as_output_attachment_and_image(tmp_path):
    figures = book_pages._Figures(tmp_path, "00_x")
    with pytest.raises(book.BookError, match=r"cells\[0\].outputs\[0\] cannot be published: it has a processing "
                                             r"instruction \('<\?xml-stylesheet'\)"):
        book_pages._render_output({"output_type": "display_data", "data": {"image/svg+xml": SVG_PI.decode()}},
                                  figures, "en", "00_x.ipynb: cells[0].outputs[0]")
    with pytest.raises(book.BookError, match="processing instruction"):
        convert(tmp_path, attached("a.svg", "image/svg+xml", SVG_PI))
    (tmp_path / "notebooks" / "en" / "plot.svg").write_bytes(SVG_PI)
    with pytest.raises(book.BookError, match=r"plot.svg \(an image of .*\) cannot be published: it has a processing"):
        convert(tmp_path, nbformat.v4.new_markdown_cell("![plot](plot.svg)"))
    ordinary = SVG_PI.replace(b'<?xml-stylesheet type="text/css" href="https://example.org/track.css"?>\n', b"")
    assert book_html.svg_problem(ordinary) is None, "an XML declaration alone is fine (matplotlib writes one)"
    assert "DOCTYPE" in book_html.svg_problem(b'<!DOCTYPE svg [<!ATTLIST svg onload CDATA "alert(1)">]><svg/>')
    assert "root element is <html>" in book_html.svg_problem(b"<html/>")


# --- 4: notebooks and images linked in from outside -------------------------------------------------------------

def test_a_notebook_linked_from_outside_the_notebooks_folder_is_refused(tmp_path):
    secret = notebook_file(tmp_path / "elsewhere" / "secret.ipynb", [nbformat.v4.new_markdown_cell("# Secret")])
    nbdir = make_tiny_notebooks(tmp_path)
    for lang in book.LANGS:
        os.symlink(secret, nbdir / lang / "01_secret.ipynb")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(book.BookError, match=r"01_secret.ipynb \(a notebook\) lies outside .*notebooks"):
        book_pages.convert(nbdir / "en" / "01_secret.ipynb", out, "en")
    with pytest.raises(book.BookError, match=r"01_secret.ipynb \(a notebook\) lies outside"):
        book.build(notebooks=nbdir, out=tmp_path / "site", stage_dir=tmp_path / "stage", log=lambda *a: None)
    assert not (tmp_path / "site").exists()


def test_the_configured_notebooks_folder_must_be_inside_the_repository(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "book-theme", root / "book-theme")
    shutil.copy(ROOT / "book.toml", root / "book.toml")
    os.symlink(make_tiny_notebooks(tmp_path / "elsewhere"), root / "notebooks")
    with pytest.raises(book.BookError, match="lies outside the repository"):
        book.build(root=root, log=lambda *a: None)
    assert sorted(p.name for p in root.iterdir()) == ["book-theme", "book.toml", "notebooks"]


def test_an_image_linked_from_outside_or_that_is_no_image_is_refused(tmp_path):
    (tmp_path / "secret.png").write_bytes(tiny_png())
    folder = tmp_path / "notebooks" / "en"
    folder.mkdir(parents=True)
    os.symlink(tmp_path / "secret.png", folder / "linked.png")
    with pytest.raises(book.BookError, match=r"linked.png \(an image of .*\) lies outside .*notebooks"):
        convert(tmp_path, nbformat.v4.new_markdown_cell("![x](linked.png)"))
    with pytest.raises(book.BookError, match=r"lies outside"):
        convert(tmp_path, nbformat.v4.new_markdown_cell("![x](../../secret.png)"))
    (folder / "page.png").write_bytes(b"<html>" + SCRIPT)
    with pytest.raises(book.BookError, match=r"page.png \(an image of .*\) is declared as PNG but its bytes are no"):
        convert(tmp_path, nbformat.v4.new_markdown_cell("![x](page.png)"))
    (folder / "photo.html").write_bytes(tiny_png())  # an image under a page's name is published as an image
    out = convert(tmp_path, nbformat.v4.new_markdown_cell("![x](photo.html)"))
    assert published(out) == ["00_x.md", "assets/photo.png"]


# --- 5: an ownership mark planted beside tracked files ----------------------------------------------------------

def git(folder, *args):
    subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org",
                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.org"})


@pytest.fixture
def planted(tmp_path):
    """A repository whose tracked folder docs/ (book.toml: site = "docs") holds a committed ownership mark."""
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "book-theme", root / "book-theme")
    text = (ROOT / "book.toml").read_text(encoding="utf-8")
    assert '\nsite = "site"\n' in text
    (root / "book.toml").write_text(text.replace('\nsite = "site"\n', '\nsite = "docs"\n'), encoding="utf-8")
    make_tiny_notebooks(root)
    (root / "docs").mkdir()
    (root / "docs" / book.OWNED).write_text("made by `python tools/book.py build`\n")
    (root / "docs" / "guide.md").write_text("the course's own documentation\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "course")
    return root


def test_a_planted_mark_does_not_let_the_build_or_clean_delete_tracked_files(planted):
    with pytest.raises(book.BookError, match=r"docs holds files tracked by git \(such as .*\).*Nothing was deleted"):
        book.build(root=planted, log=lambda *a: None)
    with pytest.raises(book.BookError, match=r"docs holds files tracked by git"):
        book.clean(planted)
    assert (planted / "docs" / "guide.md").read_text() == "the course's own documentation\n"
    assert not (planted / "build").exists(), "refused before anything was written"
    git(planted, "rm", "-q", "--cached", "-r", "docs")  # once nothing in it is tracked, the mark counts again
    book._check_owned(planted / "docs", "site")


# --- 6: attachments never overwrite figures; an output too large for a page ---------------------------------------

def test_an_attachment_does_not_overwrite_a_figure_of_the_same_name(tmp_path):
    red, blue = tiny_png((200, 0, 0)), tiny_png((0, 0, 200))
    code = nbformat.v4.new_code_cell("plot()")
    code.outputs = [nbformat.v4.new_output("display_data", data={"image/png": b64(blue)})]
    again = attached("fig002.png", "image/png", red, "![again](attachment:fig002.png)")
    out = convert(tmp_path, attached("fig002.png", "image/png", red), code, again)  # the code's figure is fig002
    assert published(out) == ["00_x.md", "figures/00_x/fig002-2.png", "figures/00_x/fig002-3.png",
                              "figures/00_x/fig002.png"]
    page = (out / "00_x.md").read_text(encoding="utf-8")
    shown = [line.split("](")[1].rstrip(")") for line in page.splitlines() if "](figures/" in line]
    assert [(out / rel).read_bytes() for rel in shown] == [red, blue, red], "every image shows what its cell holds"


def test_an_output_over_the_limit_is_refused_naming_its_cell(tmp_path):
    big = nbformat.v4.new_code_cell("print('x' * 11_000_000)")
    big.outputs = [nbformat.v4.new_output("stream", name="stdout", text="x" * (book_pages.OUTPUT_LIMIT + 1))]
    small = nbformat.v4.new_code_cell("print(1)")
    small.outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
    with pytest.raises(book.BookError, match=r"00_x.ipynb: cells\[1\].outputs\[0\] is 10.0 MB; the book publishes "
                                             r"outputs up to 10 MB a page.*remove-output"):
        convert(tmp_path, small, big)
    figure = nbformat.v4.new_code_cell("plot()")
    figure.outputs = [nbformat.v4.new_output("display_data", data={
        "image/png": b64(tiny_png() + b"\0" * book_pages.OUTPUT_LIMIT)})]
    with pytest.raises(book.BookError, match=r"cells\[0\].outputs\[0\] is 10.0 MB; the book publishes figures up "
                                             r"to 10 MB"):
        convert(tmp_path, figure)


# --- 7: a failed build leaves the last good site as it was -----------------------------------------------------

@pytest.mark.slow
def test_a_build_that_fails_late_leaves_the_last_site_whole(tmp_path, monkeypatch):
    nbdir = make_tiny_notebooks(tmp_path)
    site = tmp_path / "site"
    book.build(notebooks=nbdir, out=site, stage_dir=tmp_path / "stage", log=lambda *a: None)
    before = {p.relative_to(site): p.read_bytes() for p in site.rglob("*") if p.is_file()}
    assert Path("en/00_intro.html") in before and Path("en/pagefind/pagefind.js") in before

    def fails(folder, pages=None):
        raise ValueError(f"{folder}/00_intro.html: no <head> element")

    monkeypatch.setattr(book_html, "secure_book", fails)  # after mdBook has written every page
    with pytest.raises(book.BookError, match="cannot secure the page"):
        book.build(notebooks=nbdir, out=site, stage_dir=tmp_path / "stage", log=lambda *a: None)
    assert {p.relative_to(site): p.read_bytes() for p in site.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notebooks", "site", "stage"], "nothing half-built left"
    monkeypatch.undo()
    book.build(notebooks=nbdir, out=site, stage_dir=tmp_path / "stage", log=lambda *a: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notebooks", "site", "stage"]
    assert (site / "en" / "00_intro.html").is_file() and (site / book.OWNED).is_file()


# --- mdBook's own directives cannot pull a file of the machine into a page ---------------------------------------

def test_an_include_directive_in_a_notebook_publishes_no_file_of_the_machine(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-42\n")
    nbdir = make_tiny_notebooks(tmp_path)
    for lang in book.LANGS:
        prose = nbformat.v4.new_markdown_cell(f"# Include\n\n{{{{#include {secret}}}}}\n\n"
                                              "{{#include ../../../secret.txt}}")
        code = nbformat.v4.new_code_cell("print(...)")
        code.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"{{{{#include {secret}}}}}\n")]
        notebook_file(nbdir / lang / "01_include.ipynb", [prose, code])
    site = tmp_path / "site"
    book.build(notebooks=nbdir, out=site, stage_dir=tmp_path / "stage", log=lambda *a: None)
    for path in site.rglob("*"):
        assert not path.is_file() or b"TOP-SECRET" not in path.read_bytes(), path
    assert "{{#include" in (site / "en" / "01_include.html").read_text(encoding="utf-8"), "shown as written"
