"""The mdBook preprocessor of the course book: TeX math to MathML, the bar on top of every page, the page mark.

mdBook starts it (``book.toml``: ``command = "python3 tools/book.py"``) with ``supports html`` and then with
``[context, book]`` as JSON on stdin, and reads the changed book from stdout. On every chapter it renders
``$...$``/``$$...$$`` to MathML (nothing is fetched when reading), puts the bar with the link to the same page in
the other language, the notebook download and, when ``repository`` is set in ``book.toml``, "Open in Colab" and
"Open in Kaggle" links, and marks the page so that the build can tell the preprocessor ran.
"""
import html
import json
import re
import sys
from pathlib import Path

import links
from book_pages import LANG_NAMES, LANGS, OUTPUT_END, TEXT, BookError

PAGE_MARK = "data-mparlib"  # attribute the preprocessor puts on every page; the build checks it


# ----------------------------------------------------------------------------------------------------------------
# Math


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




# ----------------------------------------------------------------------------------------------------------------
# The bar on top of every page


def page_bar(path, lang, counterpart_exists, title="", hosted=None):
    """The ``<nav>`` put on top of every page: link to the same page in the other language, notebook, search box.

    ``hosted`` (``{"colab": url, "kaggle": url}`` or None) adds the links that open the page's notebook on a hosted
    service. The bar also carries the page's title for Pagefind (which would otherwise take the book title).
    """
    other = "ja" if lang == "en" else "en"
    depth = len(Path(path).parts) - 1
    up = "../" * (depth + 1)
    target = Path(path).with_suffix(".html").as_posix() if counterpart_exists else "index.html"
    stem = Path(path).stem
    items = [f'<a class="mparlib-lang" href="{up}{other}/{target}" hreflang="{other}" lang="{other}">'
             f"{LANG_NAMES[other]}</a>"]
    if stem not in ("index", "404", "solutions"):  # the instructors' page has no notebook
        items.append(f'<a class="mparlib-ipynb" href="{"../" * depth}notebooks/{stem}.ipynb" download>'
                     f"{TEXT[lang]['notebook']}</a>")
        for service, url in (hosted or {}).items():
            items.append(f'<a class="mparlib-hosted mparlib-{service}" href="{html.escape(url)}">'
                         f"{TEXT[lang][service]}</a>")
    if title:
        items.append(f'<span data-pagefind-meta="title" hidden>{html.escape(title.replace("`", ""))}</span>')
    return (f'<nav class="mparlib-bar" {PAGE_MARK}="{lang}" data-pagefind-ignore="all" '
            f'aria-label="{TEXT[lang]["bar"]}" data-no-search="{html.escape(TEXT[lang]["no_search"])}">\n'
            + "\n".join(items) + '\n<div class="mparlib-search"></div>\n</nav>')


def _chapters(items):
    for item in items:
        if isinstance(item, dict) and "Chapter" in item:
            yield item["Chapter"]
            yield from _chapters(item["Chapter"].get("sub_items", []))


def preprocess(context, book):
    """mdBook preprocessor: MathML, the bar and Pagefind's body on every chapter; returns the changed book."""
    config = context.get("config", {})
    lang = config.get("book", {}).get("language") or "en"
    if lang not in LANGS:
        raise BookError(f"book.language is {lang!r}; the course has {LANGS}")
    course = config.get("preprocessor", {}).get("mparlib", {})
    try:
        repo = links.from_settings(course)
    except links.LinkError as err:
        raise BookError(str(err)) from None
    notebooks = Path(course.get("notebooks", "notebooks")).as_posix().strip("/")
    src = Path(context.get("root", ".")) / config.get("book", {}).get("src", "src")
    other_src = src.parent / ("ja" if lang == "en" else "en")  # the build stages both books side by side
    problems = []
    for chapter in _chapters(book.get("items", [])):
        if not chapter.get("path"):
            continue  # a draft chapter has no page
        content, errors = render_math(chapter.get("content", ""))
        problems += [f"{chapter['path']}: cannot render math {e}" for e in errors]
        stem = Path(chapter["path"]).stem
        hosted = links.hosted_links(repo, f"{notebooks}/{lang}/{stem}.ipynb") if repo else None
        bar = page_bar(chapter["path"], lang, (other_src / chapter["path"]).is_file(), chapter.get("name", ""),
                       hosted)
        chapter["content"] = f'{bar}\n\n<div class="mparlib-page" data-pagefind-body>\n\n{content}\n\n</div>\n'
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    return book


def run(argv):
    """The mdBook side of the protocol: ``supports RENDERER`` (exit 0 for html) or ``[context, book]`` on stdin."""
    if argv and argv[0] == "supports":
        return 0 if len(argv) > 1 and argv[1] == "html" else 1
    if sys.stdin.isatty():
        print(__doc__)
        return 2
    try:
        context, book = json.loads(sys.stdin.buffer.read())  # bytes in and out: UTF-8 whatever the locale
        if not (isinstance(context, dict) and isinstance(book, dict)):
            raise ValueError("expected [context, book]")
    except (ValueError, TypeError) as err:
        print(f"error: the preprocessor reads mdBook's [context, book] JSON on stdin ({err}); mdBook runs it "
              "during `mdbook build`.", file=sys.stderr)
        return 1
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
