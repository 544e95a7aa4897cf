"""The built book in a real browser (Debian's chromium, headless): Japanese search, language switch, math.

Both books are served over http from 127.0.0.1 under a sub-path, as a static host would; Pagefind's search only
works over http. Screenshots go to tests/artifacts/.
"""
import functools
import json
import re
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import book  # noqa: E402
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
TERMS = ("データ並列", "勾配降下法", "オールリデュース", "ミニバッチ", "レプリカ", "勾配")


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def www(tmp_path_factory):
    """A folder served at http://127.0.0.1:PORT/; yields (folder, base URL)."""
    folder = tmp_path_factory.mktemp("www")
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


# Every Content-Security-Policy violation on a page, as the browser reports it to the page itself.
RECORD_VIOLATIONS = """window.__violations = [];
document.addEventListener('securitypolicyviolation',
    e => window.__violations.push(e.violatedDirective + ' ' + (e.blockedURI || 'inline')));"""


@pytest.fixture
def page(browser, www):
    """A fresh page that records every request, script error and policy violation (console or event)."""
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    context.add_init_script(RECORD_VIOLATIONS)
    pg = context.new_page()
    pg.requests, pg.errors, pg.console = [], [], []
    pg.on("request", lambda r: pg.requests.append(r.url))
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    pg.on("console", lambda m: pg.console.append(m.text) if m.type == "error" else None)
    yield pg
    context.close()


def no_violations(pg):
    """The page reported no policy violation and no console error (a blocked script logs one)."""
    assert pg.evaluate("window.__violations") == [], pg.evaluate("window.__violations")
    assert [m for m in pg.console if "Content Security Policy" in m or "Content-Security-Policy" in m] == []


def search(pg, term):
    """Type ``term`` into the page's search box; return the pages of the results (no #fragments, no repeats)."""
    box = pg.wait_for_selector(".mparlib-search .pagefind-ui__search-input", timeout=15000)
    box.fill("")
    pg.wait_for_selector(".pagefind-ui__result-link", state="detached", timeout=15000)
    box.fill(term)
    # the summary line ("N results for TERM" / "TERMのN件の検索結果") appears once this search has finished
    pg.wait_for_function("t => (document.querySelector('.pagefind-ui__message') || {}).textContent?.includes(t)",
                         arg=term, timeout=15000)
    pg.wait_for_selector(".pagefind-ui__result-link", timeout=15000)
    pg.wait_for_timeout(300)  # let the remaining results render
    hrefs = pg.eval_on_selector_all(".pagefind-ui__result-link", "els => els.map(e => e.getAttribute('href'))")
    return list(dict.fromkeys(h.split("#")[0] for h in hrefs))


def only_local(pg, base):
    outside = [u for u in pg.requests if not u.startswith(base + "/") and not u.startswith("data:")]
    assert outside == [], f"the book fetched from outside the site: {outside}"


@pytest.fixture(scope="module")
def tiny_book(www):
    """The tiny course of test_book built into the served folder, at /tiny/."""
    folder, base = www
    try:
        from test_book import make_tiny_notebooks
    except ImportError:  # tests/ imported as a package
        from tests.test_book import make_tiny_notebooks

    nbdir = make_tiny_notebooks(folder.parent / "tiny-src")
    book.build(notebooks=nbdir, out=folder / "tiny", stage_dir=folder.parent / "tiny-stage", log=lambda *a: None)
    return base


def test_tiny_book_japanese_search_math_and_switch(page, tiny_book):
    """Compound words (勾配降下法, データ並列) find their chapter; math renders as MathML; the switch lands right."""
    base = tiny_book
    page.goto(f"{base}/tiny/ja/01_math.html")
    assert page.get_attribute("html", "lang") == "ja"
    for term in ("勾配降下法", "データ並列"):
        assert search(page, term) == ["/tiny/ja/00_intro.html"], term
    assert search(page, "お金") == ["/tiny/ja/01_math.html"]
    titles = page.eval_on_selector_all(".pagefind-ui__result-title > a", "els => els.map(e => e.textContent.trim())")
    assert titles[0] == "平均の数式", titles  # the chapter's title, not the book's
    box = page.evaluate("""() => { const m = document.querySelector('math[display=block]');
                                    const r = m.getBoundingClientRect();
                                    return [r.width, r.height, getComputedStyle(m).display]; }""")
    assert box[0] > 50 and box[1] > 20 and box[2] == "block math", box  # laid out by the MathML engine
    looks = page.evaluate("""() => ['.nb-stdout pre', '.nb-stderr-text', '.nb-error-text'].map(sel => {
        const el = document.querySelector(sel), st = getComputedStyle(el);
        return [st.backgroundColor, getComputedStyle(el.closest('.nb-output')).borderLeftColor,
                getComputedStyle(el, '::before').content]; })""")
    stdout, stderr, error = looks
    assert stderr[0] != stdout[0] and stderr[1] != stdout[1], looks  # warnings look different from stdout
    assert error[0] != stdout[0] and error[0] != stderr[0], looks
    assert "stderr" in stderr[2] and stdout[2] in ("none", "normal"), looks  # labelled
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "book-tiny-ja-search.png"))
    no_violations(page)  # search, its WebAssembly and mdBook's scripts all run under the page's policy
    page.click("a.mparlib-lang")
    page.wait_for_url(f"{base}/tiny/en/01_math.html")
    assert page.get_attribute("html", "lang") == "en"
    assert search(page, "averaging") == ["/tiny/en/01_math.html"]
    no_violations(page)
    # The policy is enforced, not only written: a script put into the page now does not run, and is reported.
    page.evaluate("""() => { const s = document.createElement('script');
                             s.textContent = 'window.__injected = true'; document.body.appendChild(s); }""")
    page.wait_for_function("window.__violations.length > 0", timeout=5000)
    assert page.evaluate("window.__injected === undefined")
    assert page.evaluate("window.__violations")[0].startswith("script-src")
    only_local(page, base)
    assert page.errors == []


def test_search_without_a_worker_runs_under_the_policy(page, tiny_book):
    """Where no web worker can start, Pagefind runs its WebAssembly on the page itself: the policy allows that."""
    page.add_init_script("delete window.Worker;")
    page.goto(f"{tiny_book}/tiny/en/01_math.html")
    assert page.evaluate("typeof Worker") == "undefined"
    assert search(page, "averaging") == ["/tiny/en/01_math.html"]
    no_violations(page)
    assert page.errors == []


def _pick_term():
    """A Japanese course term and the real chapter that uses it most (from the stored ja notebooks' prose)."""
    counts = {}
    for path in sorted((ROOT / "notebooks" / "ja").glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        prose = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        for term in TERMS:
            counts.setdefault(term, {})[path.stem] = prose.count(term)
    for term in TERMS:
        best = max(counts.get(term, {"": 0}).items(), key=lambda kv: kv[1])
        if best[1]:
            return term, best[0]
    pytest.fail("no stored Japanese notebook uses any of the course terms " + ", ".join(TERMS))


def test_real_book_japanese_search_and_language_switch(page, www):
    """Open a Japanese page of the real course, search a course term, get its chapter, switch to English."""
    folder, base = www
    found = sorted(p.stem for p in (ROOT / "notebooks" / "ja").glob("[0-9][0-9]_*.ipynb"))
    assert found, "no stored notebooks in notebooks/ja: run `make notebooks`"
    book.build(out=folder / "course", stage_dir=folder.parent / "course-stage", log=lambda *a: None)
    term, chapter = _pick_term()

    page.goto(f"{base}/course/ja/{found[0]}.html")
    assert page.get_attribute("html", "lang") == "ja"
    hits = search(page, term)
    assert f"/course/ja/{chapter}.html" in hits, f"searching {term!r}: {hits}"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "book-ja-search.png"))

    page.click(f".pagefind-ui__result-link[href^='/course/ja/{chapter}.html']")
    page.wait_for_url(re.compile(rf".*/course/ja/{chapter}\.html.*"))
    page.click("a.mparlib-lang")
    page.wait_for_url(f"{base}/course/en/{chapter}.html")
    assert page.get_attribute("html", "lang") == "en"
    assert page.locator("a.mparlib-lang").get_attribute("href") == f"../ja/{chapter}.html"
    page.screenshot(path=str(ARTIFACTS / "book-en-switched.png"), full_page=False)
    no_violations(page)
    only_local(page, base)
    assert page.errors == []
