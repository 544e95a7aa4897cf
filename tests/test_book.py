"""The static book: notebook -> Markdown conversion, the mdBook preprocessor, and the built bilingual site.

Fast tests run on a tiny en/ja notebook pair made here; the site tests build the real book from every stored
notebook in notebooks/en and notebooks/ja (and fail when there are none).
"""
import base64
import html.parser
import json
import os
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest

from mparlib import book

ROOT = Path(__file__).resolve().parents[1]
BOOK_PY = ROOT / "mparlib" / "book.py"


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
    result = book.build(out=tmp / "site", stage_dir=tmp / "stage", log=print)
    result["found"] = found
    return result


# ---------------------------------------------------------------------------------------------------------------
# Site checks shared by the tiny and the real book


class _Page(html.parser.HTMLParser):
    """Collects a page's lang, ids, links (href/src) and resources it would load."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.lang, self.ids, self.links, self.loads, self.tags = None, set(), [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
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


def parse(path):
    page = _Page()
    page.feed(Path(path).read_text(encoding="utf-8"))
    return page


def broken_links(site):
    """Every relative href/src in every page of ``site`` that does not lead to a file (or to a missing #id)."""
    site, problems, cache = Path(site), [], {}
    for path in site.rglob("*.html"):
        if "pagefind" in path.relative_to(site).parts:
            continue
        page = cache.setdefault(path, parse(path))
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
                ids = cache.setdefault(target, parse(target)).ids
                if unquote(parts.fragment) not in ids:
                    problems.append(f"{path.relative_to(site)}: <{tag}> {link} -> no id {parts.fragment!r}")
    return problems


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
    stem, title = book.convert(nbdir / "en" / "00_intro.ipynb", out, "en", known={"00_intro", "01_math"})
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
    out = book._render_output(nb.cells[1].outputs[0], None, "en")
    assert out == '<div class="nb-output nb-result">\n\n```text\n42\n```\n\n' + book.OUTPUT_END


def test_convert_rich_outputs(tmp_path):
    figures = book._Figures(tmp_path, "00_x")
    table = book._render_output({"output_type": "execute_result", "data": {
        "text/html": "<div>\n<style scoped>td {}</style>\n\n<table><tr><td>1</td></tr></table>\n</div>",
        "text/plain": "   a\n0  1"}}, figures, "en")
    assert table.startswith('<div class="nb-output nb-html">\n<div>') and "\n\n" not in table  # one HTML block
    scripted = book._render_output({"output_type": "display_data", "data": {
        "text/html": "<script>alert(1)</script>", "text/plain": "Plot"}}, figures, "en")
    assert "<script" not in scripted and "Plot" in scripted
    widget = {"output_type": "display_data", "data": {"application/vnd.jupyter.widget-view+json": {"model_id": "m"},
                                                      "text/plain": "HBox(children=(...))"}}
    assert book._render_output(widget, figures, "en") is None
    svg = book._render_output({"output_type": "display_data", "data": {"image/svg+xml": "<svg/>"}}, figures, "ja")
    assert "![出力の図](figures/00_x/fig001.svg)" in svg and (tmp_path / "figures/00_x/fig001.svg").read_text() == "<svg/>"


def test_convert_bad_notebook_says_what_to_do(tmp_path):
    bad = tmp_path / "00_bad.ipynb"
    bad.write_text("{not json")
    with pytest.raises(book.BookError, match="cannot read .*00_bad.ipynb.*tools/notebooks.py build"):
        book.convert(bad, tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# Math


def test_math_inline_and_display():
    md, errors = book.render_math("a $x_1 * y$ b\n\n$$\\frac{1}{k}\\sum_j g_j$$\n")
    assert errors == []
    assert "$" not in md
    assert md.count("<math") == 2 and '<math display="block">' in md and '<math display="inline">' in md
    assert "<mfrac>" in md and "&#42;" in md and "_" not in md  # Markdown never sees * or _ of the formula


def test_math_leaves_code_outputs_and_money_alone():
    src = ("cost `$5 and $6` here, \\$3\n\n```python\nprint('$x$')\n```\n\n"
           '<div class="nb-output nb-stdout">\n\n```text\n$y$\n```\n\n' + book.OUTPUT_END + "\n\n"
           '<pre class="nb-stderr-text"><code>$z$\n\n$w$</code></pre>\n\nand $a$')
    md, errors = book.render_math(src)
    assert errors == []
    assert md.count("<math") == 1
    assert "`$5 and $6`" in md and "\\$3" in md and "print('$x$')" in md and "$y$" in md and "$w$" in md


def test_math_multiline_display_and_aligned():
    md, errors = book.render_math("$$\n\\begin{aligned} a &= b \\\\ c &= d \\end{aligned}\n$$")
    assert errors == [] and md.count("<mtr>") == 2 and "&</mi>" not in md


def test_math_error_is_reported_and_shown_raw():
    md, errors = book.render_math("bad $\\frac{1}{$ and $\\notacommand x$")
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
