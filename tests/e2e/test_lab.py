"""The course the way a learner meets it: `make lab`, open the first chapter, Run All Cells, watch the plot.

JupyterLab is started by the same code as `make lab` (``tools/lab.py``) and driven by a headless Debian Chromium.
Each edition of ``00_setup`` must run without errors, show the training plot as one PNG that is redrawn in place,
and (in Japanese) render Japanese prose. Screenshots go to ``tests/artifacts/``.
"""
import ipaddress
import json
import re
import socket
import time
from pathlib import Path

import psutil
import pytest


pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
CHAPTER = "00_setup"
KERNEL_READY_TIMEOUT = 120  # s: the page loads and the kernel starts (2 shared cores)
RUN_TIMEOUT = 300  # s: Run All Cells finishes (the smoke profile takes well under a minute)
JAPANESE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff]")  # kana and kanji

# --- JavaScript run in the JupyterLab page (the server is started with expose_app so window.jupyterapp exists) ---
JS_HELPERS = """
window.__e2eFind = (path) => {
  const app = window.jupyterapp;
  if (!app) return null;
  for (const w of app.shell.widgets('main')) {
    if (w.context && w.context.path === path && w.content && w.content.widgets) return w;
  }
  return null;
};
window.__e2eHash = (s) => {  // FNV-1a of the whole string, plus its length
  let h = 0x811c9dc5;
  for (let i = 0; i < s.length; i++) { h ^= s.charCodeAt(i); h = Math.imul(h, 0x01000193) >>> 0; }
  return s.length + ':' + h.toString(16);
};
"""

JS_READY = """(path) => {
  const panel = window.__e2eFind(path);
  if (!panel) return {ready: false, why: 'notebook not open yet'};
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const dialogs = [...document.querySelectorAll('.jp-Dialog')].map(d => d.innerText.slice(0, 300));
  return {ready: !!(panel.context.isReady && kernel && kernel.status === 'idle'),
          why: kernel ? 'kernel ' + kernel.status : 'no kernel yet', cells: panel.content.widgets.length, dialogs};
}"""

JS_WATCH = """([path, watched]) => {
  const panel = window.__e2eFind(path);
  const state = {executed: new Set(), images: {}};
  window.__e2eState = state;
  panel.content.widgets.forEach((cell, i) => {
    if (cell.model.type !== 'code') return;
    cell.model.stateChanged.connect((_, change) => {
      if (change.name !== 'executionCount') return;
      if (change.newValue !== null && change.newValue !== undefined) state.executed.add(i);
    });
  });
  for (const i of watched) {  // every image shown in the plot cell, whether added or redrawn
    const seen = {added: 0, srcs: []};
    state.images[i] = seen;
    const note = (img) => { const h = window.__e2eHash(img.src || ''); if (!seen.srcs.includes(h)) seen.srcs.push(h); };
    new MutationObserver((records) => {
      for (const r of records) {
        if (r.type === 'attributes' && r.target.tagName === 'IMG') note(r.target);
        for (const n of r.addedNodes || []) {
          if (n.nodeType !== 1) continue;
          for (const img of (n.tagName === 'IMG' ? [n] : n.querySelectorAll('img'))) { seen.added++; note(img); }
        }
      }
    }).observe(panel.content.widgets[i].node, {subtree: true, childList: true, attributes: true,
                                               attributeFilter: ['src']});
  }
}"""

JS_PROGRESS = """(path) => {
  const panel = window.__e2eFind(path);
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const code = panel.content.widgets.filter(c => c.model.type === 'code');
  const prompts = code.map(c => (c.node.querySelector('.jp-InputPrompt') || {}).textContent || '');
  return {kernel: kernel ? kernel.status : 'none', executed: window.__e2eState.executed.size, code: code.length,
          running: prompts.filter(p => p.includes('*')).length,
          dialogs: [...document.querySelectorAll('.jp-Dialog')].map(d => d.innerText.slice(0, 300))};
}"""

JS_RESULT = """(path) => {
  const panel = window.__e2eFind(path);
  const state = window.__e2eState;
  const text = (o) => [].concat(o.text || []).join('');
  return panel.content.widgets.map((cell, i) => {
    const m = cell.model;
    const r = {index: i, type: m.type, tags: m.getMetadata('tags') || [],
               source: m.sharedModel.getSource()};
    if (m.type === 'markdown') {
      const md = cell.node.querySelector('.jp-RenderedMarkdown');
      r.rendered = cell.rendered;
      r.text = md ? md.textContent : '';
    }
    if (m.type === 'code') {
      r.count = m.executionCount;
      r.executed = state.executed.has(i);
      r.prompt = (cell.node.querySelector('.jp-InputPrompt') || {}).textContent || '';
      r.outputs = m.outputs.toJSON().map(o => ({type: o.output_type, name: o.name || null, ename: o.ename || null,
        evalue: o.evalue || null, traceback: (o.traceback || []).join('\\n').slice(-3000),
        text: text(o).slice(-3000), mimes: o.data ? Object.keys(o.data) : []}));
      r.images = [...cell.node.querySelectorAll('.jp-OutputArea-output img')].map(img => ({
        png: img.src.startsWith('data:image/png'), width: img.naturalWidth, height: img.naturalHeight,
        hash: window.__e2eHash(img.src)}));
      r.watch = state.images[i] || null;
    }
    return r;
  });
}"""

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _code_cells(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    return nb, [(i, c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]


def _source(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _listening(server):
    """(pid, address, port) of every listening TCP socket of the server and its kernels."""
    found = []
    for proc in server.processes():
        try:
            conns = proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        found += [(proc.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def _assert_loopback_only(server):
    listening = _listening(server)
    assert (server.proc.pid, "127.0.0.1", server.port) in listening, listening
    public = [x for x in listening if not ipaddress.ip_address(x[1].split("%")[0]).is_loopback]
    assert not public, f"JupyterLab or a kernel listens beyond this machine: {public}"
    return listening


def _close_sessions(server, rel):
    """Shut down the kernel of notebook ``rel`` (as closing it with "Shut Down Kernel" would)."""
    status, _, body = server.request("api/sessions")
    if status == 200:
        for s in json.loads(body):
            if s["path"] == rel:
                server.request(f"api/sessions/{s['id']}", method="DELETE")


def _wait(page, js, arg, done, timeout, what):
    """Poll ``js`` in the page until ``done(result)``; fail with the last result after ``timeout`` seconds."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        last = page.evaluate(js, arg)
        if last and last.get("dialogs"):
            pytest.fail(f"JupyterLab showed a dialog while {what}: {last['dialogs']}")
        if done(last):
            return last
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout} s while {what}; last state: {last}")


def test_server_requires_the_token(lab_server, chromium):
    """Without the token nothing is readable or runnable, by API or in a browser."""
    kernels_before = lab_server.api("api/kernels")
    for path in ("api/contents", "api/contents/en", f"api/contents/en/{CHAPTER}.ipynb", "api/kernels",
                 "api/sessions", "api/kernelspecs"):
        for token in (None, "not-the-token"):
            status, _, _ = lab_server.request(path, token=token)
            assert status == 403, f"GET /{path} with token={token!r} answered {status}, expected 403"
    status, _, _ = lab_server.request("api/kernels", method="POST", token=None, data={"name": "python3"})
    assert status == 403, f"starting a kernel without the token answered {status}"
    assert lab_server.api("api/kernels") == kernels_before, "a kernel was started without the token"
    for path in ("lab", f"lab/tree/en/{CHAPTER}.ipynb", f"files/en/{CHAPTER}.ipynb"):
        status, headers, _ = lab_server.request(path, token=None)
        assert status in (302, 403), f"GET /{path} without the token answered {status}"
        if status == 302:
            assert "/login" in headers.get("Location", ""), headers
    # With the token the course is there.
    names = {item["name"] for item in lab_server.api("api/contents")["content"]}
    assert {"en", "ja"} <= names, names

    chromium.clear_cookies()
    page = chromium.new_page()
    try:
        page.goto(f"{lab_server.url}lab/tree/en/{CHAPTER}.ipynb", wait_until="domcontentloaded")
        assert "/login" in page.url, page.url
        assert page.locator("form input[type=password]").count() >= 1  # the token (or password) form
        assert page.locator(".jp-Notebook").count() == 0
    finally:
        page.close()


def test_server_listens_on_this_machine_only(lab_server):
    """The server's socket is bound to 127.0.0.1: other addresses of this machine refuse the connection."""
    _assert_loopback_only(lab_server)
    others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
              if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback]
    for address in others:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(3)
            with pytest.raises(OSError):
                s.connect((address, lab_server.port))
                pytest.fail(f"JupyterLab answered on {address}:{lab_server.port}")


@pytest.mark.parametrize("lang", ["en", "ja"])
def test_first_chapter_runs_in_jupyterlab(lab_server, chromium, artifacts, lang):
    """Open 00_setup, Run All Cells, and check what the learner sees."""
    rel = f"{lang}/{CHAPTER}.ipynb"
    nb_path = NOTEBOOKS / rel
    assert nb_path.exists(), f"{nb_path} is missing; build it with `make notebooks NAMES={CHAPTER}`"
    stored = nb_path.read_bytes()
    checkpoint = nb_path.parent / ".ipynb_checkpoints" / f"{CHAPTER}-checkpoint.ipynb"
    had_checkpoint = checkpoint.exists()
    nb, code = _code_cells(nb_path)
    plot_cells = [i for i, c in code if "Animator(" in _source(c)]
    assert plot_cells, f"{rel} has no cell that makes an Animator; the test expects the live plot demo"
    shot = artifacts / f"lab-{CHAPTER}-{lang}.png"
    t0 = time.monotonic()

    page = chromium.new_page()
    page.set_default_timeout(60_000)  # clicks and page loads on 2 busy cores
    page.add_init_script(JS_HELPERS)
    try:
        # A workspace of its own, so the page does not also reopen the other edition's notebook.
        page.goto(f"{lab_server.url}lab/workspaces/{CHAPTER}-{lang}/tree/{rel}?token={lab_server.token}")
        ready = _wait(page, JS_READY, rel, lambda r: r["ready"], KERNEL_READY_TIMEOUT, f"opening {rel}")
        assert ready["cells"] == len(nb["cells"]), ready
        t_open = time.monotonic() - t0

        page.evaluate(JS_WATCH, [rel, plot_cells])
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-item[data-command='runmenu:run-all']").click()
        # Finished when every code cell ran, or when the kernel is idle with nothing queued (a run that stopped).
        _wait(page, JS_PROGRESS, rel,
              lambda r: r["executed"] == r["code"] and r["kernel"] == "idle" and r["running"] == 0
              or r["executed"] > 0 and r["kernel"] == "idle" and r["running"] == 0 and _settled(page, rel),
              RUN_TIMEOUT, f"running all cells of {rel}")
        t_run = time.monotonic() - t0 - t_open
        cells = page.evaluate(JS_RESULT, rel)
        session = [s for s in lab_server.api("api/sessions") if s["path"] == rel]
        assert session and session[0]["kernel"]["execution_state"] == "idle", session
        _assert_loopback_only(lab_server)  # the kernel's sockets too

        # Screenshots: the top of the chapter, and the plot.
        page.evaluate("(p) => window.__e2eFind(p).content.widgets[0].node.scrollIntoView()", rel)
        page.wait_for_timeout(500)
        page.screenshot(path=str(shot))
        page.evaluate("([p, i]) => window.__e2eFind(p).content.widgets[i].node.scrollIntoView({block: 'center'})",
                      [rel, plot_cells[0]])
        page.wait_for_timeout(500)
        page.screenshot(path=str(artifacts / f"lab-{CHAPTER}-{lang}-plot.png"))
    except BaseException:
        page.screenshot(path=str(artifacts / f"lab-{CHAPTER}-{lang}-failed.png"))
        raise
    finally:
        page.close()
        _close_sessions(lab_server, rel)  # free the kernel before the next chapter
    print(f"{rel}: opened and kernel ready in {t_open:.1f} s, all cells ran in {t_run:.1f} s")

    # 1. Every code cell ran, and none failed unless it is tagged as an expected failure.
    by_index = {c["index"]: c for c in cells}
    not_run = [c["index"] for c in cells if c["type"] == "code" and not c["executed"]]
    problems = []
    for c in cells:
        if c["type"] != "code":
            continue
        expected = "raises-exception" in c["tags"]
        for o in c["outputs"]:
            if o["type"] == "error" and not expected:
                problems.append(f"cell {c['index']} raised {o['ename']}: {o['evalue']}\n"
                                f"{ANSI.sub('', o['traceback'])}\n--- source:\n{c['source'][:500]}")
            if o["type"] == "stream" and o["name"] == "stderr" and "Traceback (most recent call last)" in o["text"]:
                problems.append(f"cell {c['index']} printed a traceback:\n{ANSI.sub('', o['text'])}")
    assert not problems, f"{rel} shows errors in JupyterLab:\n\n" + "\n\n".join(problems)
    assert not not_run, (f"{rel}: cells {not_run} did not run (Run All stopped early); prompts: "
                         f"{[by_index[i]['prompt'] for i in not_run]}")

    # 2. The Animator shows one PNG, redrawn in place while the cell ran (not a new image per update).
    for i in plot_cells:
        c = by_index[i]
        images = [o for o in c["outputs"] if "image/png" in o["mimes"]]
        assert len(images) == 1, f"cell {i} has {len(images)} PNG outputs; the Animator should update one in place"
        assert len(c["images"]) == 1, f"cell {i} shows {len(c['images'])} images in the page, expected 1"
        img = c["images"][0]
        assert img["png"] and img["width"] > 100 and img["height"] > 100, img
        drawn = c["watch"]["srcs"]
        assert len(drawn) >= 2, f"the plot in cell {i} was drawn {len(drawn)} time(s); it should update as it runs"
        assert img["hash"] in drawn, "the image on screen is none of those drawn while the cell ran"

    # 3. The rendered prose is in the notebook's language.
    markdown = [c for c in cells if c["type"] == "markdown"]
    assert markdown and all(c["rendered"] for c in markdown), "markdown cells are not rendered"
    assert markdown[0]["text"].strip(), "the first markdown cell rendered no text"
    japanese = [c for c in markdown if JAPANESE.search(c["text"])]
    if lang == "ja":
        assert JAPANESE.search(markdown[0]["text"]), f"the Japanese edition starts with {markdown[0]['text'][:200]!r}"
        assert len(japanese) >= len(markdown) / 2, f"{len(japanese)} of {len(markdown)} markdown cells show Japanese"
    else:
        assert len(japanese) < len(markdown) / 2, f"{len(japanese)} of {len(markdown)} English cells show Japanese"

    # 4. Running the chapter in the browser did not write into the course.
    assert nb_path.read_bytes() == stored, f"{nb_path} was changed by opening and running it"
    assert checkpoint.exists() == had_checkpoint, f"{checkpoint} was created"


def _settled(page, rel):
    """After a stop: still idle with nothing running a second later (the queue is really empty)."""
    time.sleep(1.0)
    r = page.evaluate(JS_PROGRESS, rel)
    return r["kernel"] == "idle" and r["running"] == 0
