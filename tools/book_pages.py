"""One stored notebook -> one Markdown page of the book (with its figures as files), after checking its shape.

Text outputs become fenced blocks, stderr and errors styled ``<pre>`` blocks, PNG/JPEG/SVG figures files under
``figures/<stem>/``, HTML outputs pass through the book's allow-list (``book_html``). A notebook whose JSON does not
have the shape of nbformat 4 is refused with the file, the place in it (``cells[3].outputs[0]``) and the fix.

Figures, attachments and the local images of markdown cells are published only as PNG, JPEG, GIF or WebP (told by
their first bytes, whatever their name or declared type says) or as SVG that passes ``book_html.svg_problem``;
the file name's extension is always the type found. No published file overwrites another, an output over
:data:`OUTPUT_LIMIT` is refused, and a notebook or image that lies (through a symbolic link) outside the
notebooks folder is refused.
"""
import base64
import binascii
import html
import json
import re
import shutil
from pathlib import Path

import book_html

LANGS = ("en", "ja")
LANG_NAMES = {"en": "English", "ja": "日本語"}
OUTPUT_END = "</div><!-- /nb-output -->"
OUTPUT_LIMIT = 10 * 2**20  # bytes of one output (text or figure) on a page; a larger one is refused
IMAGE_MIMES = {"image/png": "png", "image/jpeg": "jpg", "image/gif": "gif", "image/webp": "webp",
               "image/svg+xml": "svg"}

TEXT = {
    "en": {
        "intro_title": "About this book",
        "intro": "This book shows the course notebooks as they were last executed, outputs included. To run them "
                 "yourself, clone the course repository and start JupyterLab with `make lab`; each page also links "
                 "to its notebook file.",
        "chapters": "Chapters",
        "figure": "Output figure",
        "notebook": "Notebook (.ipynb)",
        "colab": "Open in Colab",
        "kaggle": "Open in Kaggle",
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
        "colab": "Colab で開く",
        "kaggle": "Kaggle で開く",
        "bar": "言語の切り替え・ノートブック・検索",
        "not_found_title": "ページが見つかりません",
        "not_found": "このページはありません。[目次](index.md)に戻ってください。",
        "no_search": "検索は http で配信した本でだけ動きます。`make serve-book` を実行し、表示されたアドレスを開いてください。",
    },
}


class BookError(RuntimeError):
    """A problem with the inputs or the build, explained in words (no traceback needed)."""


# ----------------------------------------------------------------------------------------------------------------
# Reading and checking a notebook


def _kind(value):
    """The JSON name of a value's type."""
    for types, name in ((bool, "a boolean"), (str, "a string"), ((int, float), "a number"), (list, "a list"),
                        (dict, "an object")):
        if isinstance(value, types):
            return name
    return "null" if value is None else type(value).__name__


class _Shape:
    """Checks one notebook's JSON against the parts of nbformat 4 the book reads; the first problem raises."""

    OUTPUT_TYPES = ("stream", "display_data", "execute_result", "error")
    IMAGES = {"image/png": b"\x89PNG\r\n\x1a\n", "image/jpeg": b"\xff\xd8\xff"}

    def __init__(self, path):
        self.path = Path(path)

    def fail(self, where, problem):
        raise BookError(
            f"{self.path}: {where} {problem}. The book reads notebooks in the nbformat 4 layout. Fix that part (in "
            f"JupyterLab, or in the file with a text editor), or rebuild a course chapter from its source with "
            f"`python tools/notebooks.py build {self.path.stem}`.")

    def text(self, value, where):
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return
        self.fail(where, f"is {_kind(value)}; it must be a string or a list of strings")

    def mapping(self, value, where):
        if not isinstance(value, dict):
            self.fail(where, f"is {_kind(value)}; it must be an object")
        return value

    def image(self, mime, payload, where):
        self.text(payload, where)
        try:
            data = base64.b64decode(re.sub(r"\s+", "", "".join(payload)), validate=True)
        except (binascii.Error, ValueError) as err:
            self.fail(where, f"is not valid base64 ({err})")
        if mime in self.IMAGES and not data.startswith(self.IMAGES[mime]):
            self.fail(where, f"does not hold a {mime.split('/')[1].upper()} image (its first bytes are {data[:8]!r})")

    def bundle(self, data, where):
        for mime, payload in self.mapping(data, where).items():
            if mime in self.IMAGES:
                self.image(mime, payload, f'{where}["{mime}"]')
            elif not mime.endswith("json"):
                self.text(payload, f'{where}["{mime}"]')

    def output(self, out, where):
        kind = self.mapping(out, where).get("output_type")
        if kind not in self.OUTPUT_TYPES:
            self.fail(f"{where}.output_type", f"is {kind!r}; it must be one of {', '.join(self.OUTPUT_TYPES)}")
        if kind == "stream":
            self.text(out.get("text", ""), f"{where}.text")
            if not isinstance(out.get("name", "stdout"), str):
                self.fail(f"{where}.name", f"is {_kind(out['name'])}; it must be \"stdout\" or \"stderr\"")
        elif kind == "error":
            self.text(out.get("traceback", []), f"{where}.traceback")
        else:
            self.bundle(out.get("data", {}), f"{where}.data")

    def cell(self, cell, where):
        self.mapping(cell, where)
        kind = cell.get("cell_type")
        if kind not in ("markdown", "code", "raw"):
            self.fail(f"{where}.cell_type", f"is {kind!r}; it must be \"markdown\", \"code\" or \"raw\"")
        self.text(cell.get("source", ""), f"{where}.source")
        tags = self.mapping(cell.get("metadata", {}), f"{where}.metadata").get("tags", [])
        if not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
            self.fail(f"{where}.metadata.tags", f"is {_kind(tags)}; it must be a list of strings")
        for name, bundle in self.mapping(cell.get("attachments") or {}, f"{where}.attachments").items():
            self.bundle(bundle, f'{where}.attachments["{name}"]')
        if kind == "code":
            outputs = cell.get("outputs", [])
            if not isinstance(outputs, list):
                self.fail(f"{where}.outputs", f"is {_kind(outputs)}; it must be a list")
            for j, out in enumerate(outputs):
                self.output(out, f"{where}.outputs[{j}]")

    def notebook(self, nb):
        if not isinstance(nb, dict):
            self.fail("the file", f"holds {_kind(nb)}, not a notebook object")
        if nb.get("nbformat") != 4:
            self.fail("nbformat", f"is {nb.get('nbformat')!r}, not 4 (convert an older notebook with "
                                  "`jupyter nbconvert --to notebook --nbformat 4`)")
        if not isinstance(nb.get("cells"), list):
            self.fail("cells", f"is {_kind(nb.get('cells'))}; it must be a list of cells")
        for i, cell in enumerate(nb["cells"]):
            self.cell(cell, f"cells[{i}]")
        return nb


def read_notebook(path):
    """The notebook at ``path`` as plain JSON, checked; BookError names the file, the place and the fix.

    (Plain JSON: nbformat's schema validation would take most of the build's time.)
    """
    path = Path(path)
    hint = f"Rebuild a course chapter with `python tools/notebooks.py build {path.stem}`."
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise BookError(f"cannot read {path}: {err.strerror or err}. {hint}") from None
    if not raw.strip():
        raise BookError(f"{path} is empty: a notebook is a JSON file. {hint}")
    try:
        nb = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise BookError(f"{path} is not UTF-8 text (byte {err.start}): a notebook is a JSON file. {hint}") from None
    except json.JSONDecodeError as err:
        raise BookError(f"{path} is not JSON (line {err.lineno}, column {err.colno}: {err.msg}). {hint}") from None
    return _Shape(path).notebook(nb)


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


def _b64(value):
    return base64.b64decode(re.sub(r"\s+", "", _joined(value)))


def image_type(data):
    """The extension of the image in ``data`` told by its first bytes: png, jpg, gif, webp, or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def _publishable(data, ext, where):
    """The extension ``data`` is published with: ``ext`` ("svg" or a binary type) when the bytes are that image."""
    if len(data) > OUTPUT_LIMIT:
        raise BookError(f"{where} is {len(data) / 2**20:.1f} MB; the book publishes figures up to "
                        f"{OUTPUT_LIMIT // 2**20} MB. Save a smaller figure, or clear that cell's output.")
    if ext == "svg":
        problem = book_html.svg_problem(data)
        if problem:
            raise BookError(f"{where} cannot be published: {problem}. Save the figure as PNG, or as SVG without "
                            "scripts, links or external files.")
        return ext
    found = image_type(data)
    if found is None or found != ext:
        raise BookError(f"{where} is declared as {ext.upper()} but its bytes are "
                        f"{'a ' + found.upper() + ' image' if found else 'no image the book publishes'} (first "
                        f"bytes {data[:8]!r}); the book publishes PNG, JPEG, GIF, WebP and SVG images only.")
    return ext


class _Figures:
    """Writes the images of one notebook under ``figures/<stem>/`` and hands back their relative paths.

    Every file gets a name of its own (``fig001.png``, or an attachment's name) with the extension of the type its
    bytes hold; a name already used gets ``-2``, ``-3``, ... so that nothing is overwritten."""

    def __init__(self, out_dir, stem):
        self.out_dir, self.stem, self.count, self.used = Path(out_dir), stem, 0, set()

    def save(self, data, ext, name=None, where=""):
        ext = _publishable(data, ext, where or "a figure")
        self.count += 1
        base = f"fig{self.count:03d}"
        if name:
            base = re.sub(r"[^\w-]+", "_", Path(name).stem).strip("_") or "attachment"
        file, n = f"{base}.{ext}", 1
        while file.lower() in self.used:
            n += 1
            file = f"{base}-{n}.{ext}"
        self.used.add(file.lower())
        rel = Path("figures") / self.stem / file
        path = self.out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return rel.as_posix()


def _render_output(out, figures, lang, where=""):
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
            return _block("display", f"![{alt}]({figures.save(_b64(data[mime]), ext, where=where)})")
    if "image/svg+xml" in data:
        rel = figures.save(_joined(data["image/svg+xml"]).encode("utf-8"), "svg", where=where)
        return _block("display", f"![{alt}]({rel})")
    if "application/vnd.jupyter.widget-view+json" in data:
        return None  # a live widget (progress bar): nothing meaningful in a static page
    page = book_html.clean_fragment(_joined(data["text/html"])) if "text/html" in data else ""
    if page.strip():
        body = "\n".join(line for line in page.splitlines() if line.strip())
        return f'<div class="nb-output nb-html">\n{body}\n{OUTPUT_END}'
    if "text/markdown" in data:  # its raw HTML is cleaned with the rest of the page once mdBook has rendered it
        return _block("markdown", _joined(data["text/markdown"]).strip())
    text = clean_text(_joined(data.get("text/plain")))
    if text.strip():
        return _block("result", _fence(text))
    return None


def _merge_streams(outputs):
    """Join consecutive stream outputs of the same name (kernels split them arbitrarily).

    Returns ``(index, output)`` pairs; the index is that of the first joined output in the cell.
    """
    merged = []
    for j, out in enumerate(outputs):
        last = merged[-1][1] if merged else {}
        if (out.get("output_type") == "stream" and last.get("output_type") == "stream"
                and last.get("name") == out.get("name")):
            merged[-1] = (merged[-1][0], dict(last, text=_joined(last.get("text")) + _joined(out.get("text"))))
        else:
            merged.append((j, dict(out)))
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


def _inside(path, folder, what):
    """``path`` with its links resolved; BookError when that lies outside ``folder``."""
    real = Path(path).resolve()
    if not real.is_relative_to(folder):
        raise BookError(f"{path} ({what}) lies outside {folder} (it is {real}): the book publishes only files "
                        "inside the course's notebooks folder. Copy the file into it instead of linking to it.")
    return real


def _markdown_cell(cell, figures, nb_dir, out_dir, known, where):
    """Markdown cell source with attachments saved, notebook links pointing to pages and local images copied."""
    text = _joined(cell.get("source"))
    for name, bundle in (cell.get("attachments") or {}).items():
        for mime, payload in bundle.items():
            if mime.startswith("image/"):
                at = f'{where}.attachments["{name}"]'
                if mime not in IMAGE_MIMES:
                    raise BookError(f"{at} is {mime}; the book publishes PNG, JPEG, GIF, WebP and SVG images only.")
                data = _joined(payload).encode() if mime == "image/svg+xml" else _b64(payload)
                rel = figures.save(data, IMAGE_MIMES[mime], name=Path(name).name, where=at)
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
        notebooks = Path(nb_dir).absolute().parent.resolve()
        src = Path(nb_dir) / target
        if not src.is_file():
            return m.group(0)
        src = _inside(src, notebooks, f"an image of {where}")
        data = src.read_bytes()
        ext = _publishable(data, "svg" if src.suffix.lower() == ".svg" else image_type(data) or src.suffix[1:],
                           f"{src} (an image of {where})")
        dest, n = Path(out_dir) / "assets" / f"{src.stem}.{ext}", 1
        while dest.exists() and dest.read_bytes() != data:  # another image of the same name
            n += 1
            dest = dest.with_name(f"{src.stem}-{n}.{ext}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        return f"{m.group(1)}assets/{dest.name}{m.group(3)}"

    return _MD_IMAGE.sub(image, text)


def convert(nb_path, out_dir, lang=None, known=()):
    """Write ``<stem>.md`` (and its figures) for one notebook into ``out_dir``; return ``(stem, title)``.

    ``known`` holds the stems of the other chapters, so that ``[...](03_primitives.ipynb)`` becomes a page link.
    Cell tags ``remove-cell``, ``remove-input`` and ``remove-output`` hide parts of a cell in the book; the cells that
    tools/notebooks.py adds for hosted notebooks (tags ``course-links``, ``course-install``) are left out.
    """
    nb_path, out_dir = Path(nb_path), Path(out_dir)
    lang = lang or (nb_path.parent.name if nb_path.parent.name in LANGS else "en")
    _inside(nb_path, nb_path.absolute().parent.parent.resolve(), "a notebook")
    nb = read_notebook(nb_path)
    stem = nb_path.stem
    figures = _Figures(out_dir, stem)
    fig_dir = out_dir / "figures" / stem
    if fig_dir.exists():
        shutil.rmtree(fig_dir)
    parts = []
    for i, cell in enumerate(nb["cells"]):
        where = f"{nb_path}: cells[{i}]"
        tags = set(cell.get("metadata", {}).get("tags", []))
        if tags & {"remove-cell", "course-links", "course-install"}:  # the pages have their own links; the
            continue                                                  # install cell serves hosted notebooks only
        if cell.get("cell_type") == "markdown":
            parts.append(_markdown_cell(cell, figures, nb_path.parent, out_dir, set(known) | {stem}, where))
        elif cell.get("cell_type") == "code":
            source = _joined(cell.get("source"))
            if "remove-input" not in tags and "hide-input" not in tags and source.strip():
                parts.append(_fence(source, "python"))
            if "remove-output" not in tags and "hide-output" not in tags:
                for j, out in _merge_streams(cell.get("outputs", [])):
                    rendered = _render_output(out, figures, lang, f"{where}.outputs[{j}]")
                    if rendered and len(rendered.encode("utf-8")) > OUTPUT_LIMIT:
                        raise BookError(f"{where}.outputs[{j}] is {len(rendered.encode('utf-8')) / 2**20:.1f} MB; "
                                        f"the book publishes outputs up to {OUTPUT_LIMIT // 2**20} MB a page. Print "
                                        "less in that cell, or tag it remove-output.")
                    if rendered:
                        parts.append(rendered)
        # raw cells are not shown
    (out_dir / f"{stem}.md").write_text("\n\n".join(parts) + "\n", encoding="utf-8")
    return stem, notebook_title(nb, stem)
