"""What the published book lets through: an allow-list sanitizer for page content and a Content-Security-Policy.

Notebook prose and outputs come from whoever wrote the notebook, so nothing they hold may run in a reader's
browser. After mdBook has written a page, the part it renders from the course's Markdown (between ``<main>`` and
``</main>``) goes through Ammonia (the ``nh3`` package) with an allow-list of the markup the course itself uses:
text, headings with their anchors, code blocks, tables, images (the book's own files, or inline PNG data), details,
the MathML that latex2mathml writes, the wrapper blocks of notebook outputs and the bar on top of every page.
Scripts, event handlers, ``javascript:`` links, frames, forms, inline SVG and styles that could load anything are
dropped. Then every page gets a Content-Security-Policy that allows only mdBook's own inline scripts (by hash),
the book's own files and Pagefind's WebAssembly; an HTML file that is not one of mdBook's pages stops the build
instead of getting a policy for its scripts. SVG figures are published as files only when ``svg_problem`` finds
nothing that runs, links or loads (processing instructions included).
"""
import base64
import functools
import hashlib
import re
from pathlib import Path

_TEXT_TAGS = {
    "a", "abbr", "b", "bdi", "bdo", "blockquote", "br", "caption", "cite", "code", "col", "colgroup", "dd", "del",
    "details", "dfn", "div", "dl", "dt", "em", "figcaption", "figure", "h1", "h2", "h3", "h4", "h5", "h6", "hr",
    "i", "img", "ins", "kbd", "label", "li", "mark", "nav", "ol", "p", "pre", "q", "s", "samp", "small", "span",
    "strong", "sub", "summary", "sup", "table", "tbody", "td", "tfoot", "th", "thead", "tr", "u", "ul", "var", "wbr",
    "input",  # only as mdBook's image-zoom checkbox: every <input> becomes one (see _FORCED)
}
# Everything latex2mathml writes, plus the few presentation elements a formula may need.
MATHML_TAGS = {
    "math", "mi", "mn", "mo", "ms", "mtext", "mspace", "mrow", "mfrac", "msqrt", "mroot", "mstyle", "mpadded",
    "mphantom", "menclose", "msub", "msup", "msubsup", "munder", "mover", "munderover", "mtable", "mtr", "mtd",
    "semantics", "annotation",
}
_MATHML_ATTRS = {
    "display", "mathvariant", "accent", "accentunder", "fence", "form", "separator", "stretchy", "symmetric",
    "largeop", "movablelimits", "lspace", "rspace", "minsize", "maxsize", "linethickness", "notation", "width",
    "height", "depth", "voffset", "displaystyle", "scriptlevel", "mathcolor", "mathbackground", "columnalign",
    "columnspacing", "columnlines", "rowalign", "rowspacing", "rowlines", "frame", "columnspan", "rowspan", "encoding",
}
_ATTRS = {
    "*": {"class", "id", "title", "lang", "dir", "hidden", "aria-label", "aria-hidden",
          "data-pagefind-body", "data-pagefind-ignore", "data-pagefind-meta"},
    "a": {"href", "hreflang", "download"},
    "img": {"src", "alt", "width", "height"},
    "nav": {"data-mparlib", "data-no-search"},
    "ol": {"start"}, "td": {"colspan", "rowspan", "style"}, "th": {"colspan", "rowspan", "scope", "style"},
    "tr": {"style"}, "table": {"style"}, "div": {"style"}, "col": {"span"}, "colgroup": {"span"}, "details": {"open"},
    **{tag: set(_MATHML_ATTRS) for tag in MATHML_TAGS},
}
_FORCED = {"input": {"type": "checkbox"}}
# Layout properties of tables (pandas and Markdown tables set them) and the page breaks between chapters in
# print.html; none of them can load a resource.
_STYLE = {"text-align", "vertical-align", "white-space", "font-weight", "font-style", "color", "background-color",
          "min-width", "max-width", "width", "break-before", "page-break-before", "break-after", "page-break-after"}
_SCHEME = re.compile(r"^\s*([A-Za-z][A-Za-z0-9+.-]*):")
_PNG_DATA = re.compile(r"^data:image/png;base64,[A-Za-z0-9+/=\s]+$")


def _attribute(tag, name, value):
    """Keep a link or image address only when it is harmless; every other allowed attribute passes unchanged."""
    if name not in ("href", "src"):
        return value
    scheme = _SCHEME.match(value)
    if tag == "img":  # the book's own figure files, or a PNG inside the page
        if scheme:
            return value if _PNG_DATA.match(value.strip()) else None
        return None if value.strip().startswith("//") else value
    if scheme and scheme.group(1).lower() not in ("http", "https", "mailto"):
        return None  # javascript:, data:, vbscript:, file:, ...
    return value


@functools.cache
def _cleaner():
    import nh3  # Ammonia's allow-list sanitizer; `make book` checks that it is installed before it starts

    return nh3.Cleaner(
        tags=_TEXT_TAGS | MATHML_TAGS,
        clean_content_tags={"script", "style", "iframe", "object", "embed", "template", "noscript", "textarea",
                            "select", "svg"},
        attributes=_ATTRS,
        set_tag_attribute_values=_FORCED,
        attribute_filter=_attribute,
        url_schemes={"http", "https", "mailto", "data"},
        filter_style_properties=_STYLE,
        strip_comments=True,
    )


def clean_fragment(fragment):
    """The HTML fragment with everything outside the course's allow-list removed."""
    return _cleaner().clean(fragment)


_MAIN_OPEN, _MAIN_CLOSE = "<main>", "</main>"


def sanitize_page(text):
    """Clean the rendered chapter content of one mdBook page (between its first ``<main>`` and last ``</main>``).

    mdBook renders the content as one balanced tree inside ``<main>``; the rest of the page is its theme (chapter
    titles in the theme are plain text: mdBook drops markup from them). Raises ValueError for a page without it.
    """
    start, end = text.find(_MAIN_OPEN), text.rfind(_MAIN_CLOSE)
    if start < 0 or end < start:
        raise ValueError("no <main> element: not a page of mdBook's theme")
    start += len(_MAIN_OPEN)
    return text[:start] + "\n" + clean_fragment(text[start:end]) + "\n" + text[end:]


_INLINE_SCRIPT = re.compile(r"<script\b([^>]*)>(.*?)</script\s*>", re.S | re.I)


def inline_script_hashes(text):
    """CSP sources (``'sha256-...'``) of the page's inline scripts, in page order, without repeats."""
    hashes = []
    for m in _INLINE_SCRIPT.finditer(text):
        if re.search(r"\bsrc\s*=", m.group(1), re.I):
            continue
        digest = base64.b64encode(hashlib.sha256(m.group(2).encode("utf-8")).digest()).decode("ascii")
        if f"'sha256-{digest}'" not in hashes:
            hashes.append(f"'sha256-{digest}'")
    return hashes


def policy(script_hashes=()):
    """The Content-Security-Policy of a book page (``None``: a page without scripts).

    Pagefind compiles its WebAssembly in a web worker, or on the page itself where no worker can start: that is
    what ``'wasm-unsafe-eval'`` allows (WebAssembly only; JavaScript's ``eval`` stays blocked).

    ``frame-src 'self'`` keeps mdBook's table of contents for readers without JavaScript (an ``<iframe>`` of
    ``toc.html`` inside ``<noscript>``); ``base-uri 'self'`` keeps the ``<base>`` that ``404.html`` carries.
    """
    scripts = " ".join(["'self'", "'wasm-unsafe-eval'", *script_hashes]) if script_hashes is not None else "'none'"
    return ("default-src 'self'; "
            f"script-src {scripts}; "
            "style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data:; "
            "font-src 'self'; "
            "connect-src 'self'; "
            "object-src 'none'; "
            "frame-src 'self'; "
            "base-uri 'self'; "
            "form-action 'none'")


def add_policy(text, script_hashes=()):
    """Put the policy into the page's ``<head>``, before its first script, stylesheet or ``<base>``."""
    meta = f'<meta http-equiv="Content-Security-Policy" content="{policy(script_hashes)}">'
    m = re.search(r"<meta\s+charset=[^>]*>", text, re.I) or re.search(r"<head\b[^>]*>", text, re.I)
    if not m:
        raise ValueError("no <head> element to hold the Content-Security-Policy")
    first_load = re.search(r"<(script|link|base|style)\b", text, re.I)
    if first_load and first_load.start() < m.end():
        raise ValueError("the page loads something before its <meta charset>; the policy would come too late")
    return text[:m.end()] + "\n" + meta + text[m.end():]


def secure_book(folder, pages=None):
    """Sanitize and add the policy to every mdBook page under ``folder`` (Pagefind's files aside).

    ``pages`` (paths relative to ``folder``, e.g. ``{"index.html", "01_x.html"}``) are the pages mdBook made; any
    other HTML file is refused, so that no file a notebook brought in gets its scripts allow-listed. Returns the
    number of pages. Raises ValueError naming a page that cannot be secured.
    """
    count = 0
    for path in sorted(Path(folder).rglob("*.html")):
        rel = path.relative_to(folder)
        if rel.parts[0] == "pagefind":
            continue
        if pages is not None and rel.as_posix() not in pages:
            raise ValueError(f"{path}: an HTML file that is not one of mdBook's pages; the book publishes no HTML "
                             "file of a notebook's")
        text = path.read_text(encoding="utf-8")
        try:
            if path.name != "toc.html":  # the table of contents for readers without JavaScript has no content
                text = sanitize_page(text)
            text = add_policy(text, inline_script_hashes(text))
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
        path.write_text(text, encoding="utf-8")
        count += 1
    return count


_SVG_ELEMENTS_REFUSED = {"script", "foreignobject", "iframe", "embed", "object", "handler", "listener", "set",
                         "animate", "animatemotion", "animatetransform"}
_OUTSIDE_URL = re.compile(r"@import|url\(\s*['\"]?(?!#)", re.I)  # CSS that would load another file


def svg_problem(data):
    """Why an SVG figure cannot be published as a file of the site (None when it can).

    Opened on its own, an SVG file runs its scripts with the site's rights, so a figure may hold shapes, text,
    styles and references inside itself, nothing that runs, links or loads.
    """
    import xml.etree.ElementTree as ET

    text = data.decode("utf-8", errors="replace")
    if "<!ENTITY" in text:
        return "it declares XML entities"
    if re.search(r"<!DOCTYPE[^>]*\[", text, re.I):
        return "its DOCTYPE has declarations of its own"
    pi = re.search(r"<\?[^\s?>]*", re.sub(r"^\ufeff?<\?xml\s[^>]*\?>", "", text))  # the XML declaration aside
    if pi:
        return f"it has a processing instruction ({pi.group(0)[:40]!r}); one such as <?xml-stylesheet?> loads a file"
    try:
        root = ET.fromstring(data)
    except ET.ParseError as err:
        return f"it is not well-formed XML ({err})"
    if str(root.tag).rsplit("}", 1)[-1] != "svg":
        return f"its root element is <{str(root.tag).rsplit('}', 1)[-1]}>, not <svg>"
    for el in root.iter():
        name = str(el.tag).rsplit("}", 1)[-1].lower()
        if name in _SVG_ELEMENTS_REFUSED:
            return f"it has a <{name}> element"
        for attr, value in el.attrib.items():
            attr = attr.rsplit("}", 1)[-1].lower()
            if attr.startswith("on"):
                return f"<{name}> has an event handler ({attr})"
            if attr in ("href", "src") and not (value.startswith("#") or _PNG_DATA.match(value.strip())):
                return f"<{name}> refers to {value[:60]!r} outside the figure"
            if _OUTSIDE_URL.search(value):
                return f"<{name}> {attr}={value[:60]!r} loads another file"
        if name == "style" and _OUTSIDE_URL.search(el.text or ""):
            return "its stylesheet loads another file"
    return None
