"""A JupyterLab server started the way `make lab` starts it, and a headless Chromium to drive it.

The server runs from ``tools/lab.py`` (the command `make lab` runs) on 127.0.0.1, a free port and a fresh token,
with its settings, runtime files and the browser profile in a temporary folder, so the test neither reads nor
changes the learner's own Jupyter settings. It is always shut down at the end, kernels included.
"""
import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts"  # kept by CI
# Debian's package (tests/conftest.py skips these tests without it); Playwright never downloads a browser here.
CHROMIUM = "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else shutil.which("chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
START_TIMEOUT = 90  # seconds for JupyterLab to answer on 2 busy cores
# JupyterLab settings for the throwaway profile: no "Jupyter news?" prompt, no update check, and no autosave, so
# running the chapters in the browser never writes into the course's notebooks.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
}


def load_lab_tool():
    """Import ``tools/lab.py`` (the module behind `make lab`)."""
    spec = importlib.util.spec_from_file_location("course_lab_tool", ROOT / "tools" / "lab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class LabServer:
    """A running JupyterLab: its process, address, token and the helpers the tests use."""

    def __init__(self, proc, url, token, port, log_path, runtime_dir):
        self.proc, self.url, self.token, self.port = proc, url, token, port
        self.log_path, self.runtime_dir = log_path, runtime_dir
        self.seen = {}  # pid -> psutil.Process of every process this server started (kernels)

    def request(self, path, method="GET", token=True, data=None):
        """Call the server; return ``(status, headers, body)`` without following redirects."""
        headers = {"Authorization": f"token {self.token}"} if token is True else (
            {"Authorization": f"token {token}"} if token else {})
        body = None if data is None else json.dumps(data).encode()
        req = urllib.request.Request(self.url + path.lstrip("/"), data=body, method=method, headers=headers)
        opener = urllib.request.build_opener(_NoRedirect)
        try:
            with opener.open(req, timeout=30) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def api(self, path, method="GET", data=None):
        """Call the REST API with the token and return the decoded JSON (or None)."""
        status, _, body = self.request(path, method, data=data)
        assert status < 300, f"{method} {path} answered {status}: {body[:300]!r}"
        return json.loads(body) if body else None

    def processes(self):
        """The server process and everything it started (kernels run in their own sessions but are children)."""
        try:
            me = psutil.Process(self.proc.pid)
            procs = [me] + me.children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for p in procs[1:]:
            self.seen.setdefault(p.pid, p)
        return procs

    def log_tail(self, n=40):
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def _server_env(tmp, token, lab_tool, config=None, files=None):
    """The learner's environment minus what would make the run depend on their settings or on pytest.

    ``config`` is merged into the learner's ``jupyter_server_config.json``; ``files`` (name -> text) are written
    beside it: the tests use them to play a learner whose own Jupyter config would weaken the login."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "JUPYTER", "JPY_")) and k not in ("MPARLIB_LANG", "IPYTHONDIR")}
    dirs = {"JUPYTER_CONFIG_DIR": tmp / "config", "JUPYTER_DATA_DIR": tmp / "data",
            "JUPYTER_RUNTIME_DIR": tmp / "runtime", "IPYTHONDIR": tmp / "ipython",
            "JUPYTERLAB_SETTINGS_DIR": tmp / "config" / "lab" / "user-settings",
            "JUPYTERLAB_WORKSPACES_DIR": tmp / "data" / "lab" / "workspaces"}
    for name, folder in dirs.items():
        folder.mkdir(parents=True, exist_ok=True)
        env[name] = str(folder)
    # JupyterLab makes a checkpoint of every notebook it opens; keep those out of the course folders.
    server_config = {"FileCheckpoints": {"checkpoint_dir": str(tmp / "checkpoints")}, **(config or {})}
    (dirs["JUPYTER_CONFIG_DIR"] / "jupyter_server_config.json").write_text(json.dumps(server_config))
    for name, text in (files or {}).items():
        (dirs["JUPYTER_CONFIG_DIR"] / name).write_text(text, encoding="utf-8")
    for plugin, values in LAB_SETTINGS.items():
        f = dirs["JUPYTERLAB_SETTINGS_DIR"] / f"{plugin}.jupyterlab-settings"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(values), encoding="utf-8")
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"  # quiets a debugger notice in the kernel log
    return lab_tool.environment(env, token=token, auth_dir=tmp / "auth")


def _wait_until_up(proc, runtime_dir, token, log_path):
    """Wait for the server's info file (it holds the port it picked), then for its API to answer."""
    deadline = time.monotonic() + START_TIMEOUT
    info_file = runtime_dir / f"jpserver-{proc.pid}.json"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {proc.returncode} before answering; its log "
                               f"({log_path}):\n{Path(log_path).read_text(errors='replace')[-3000:]}")
        if info_file.exists():
            try:
                info = json.loads(info_file.read_text())
                req = urllib.request.Request(info["url"] + "api/status", headers={"Authorization": f"token {token}"})
                with urllib.request.urlopen(req, timeout=5) as r:
                    if r.status == 200:
                        return info
            except (OSError, ValueError, KeyError):
                pass
        time.sleep(0.25)
    raise RuntimeError(f"JupyterLab did not answer within {START_TIMEOUT} s; its log ({log_path}):\n"
                       f"{Path(log_path).read_text(errors='replace')[-3000:]}")


def _alive(proc):
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _describe(proc):
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:200]}"
    except psutil.Error:
        return str(proc.pid)


def _stop(server):
    """Shut the server down through its API, then make sure it and every kernel it started are gone.

    Returns a description of each process that outlived the clean shutdown (all killed by then)."""
    server.processes()  # remember the current kernels before they go
    if server.url:
        try:
            server.request("api/shutdown", method="POST")
            server.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            pass
    stray = [p for p in server.seen.values() if _alive(p)]
    if stray:  # give kernels a moment to exit on their own before calling them strays
        _, stray = psutil.wait_procs(stray, timeout=10)
    if server.proc.poll() is None:
        try:
            stray.insert(0, psutil.Process(server.proc.pid))
        except psutil.NoSuchProcess:
            pass
    described = [_describe(p) for p in stray]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if server.proc.poll() is None:
            try:
                os.killpg(server.proc.pid, sig)  # the server runs in its own process group
                server.proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        for p in stray:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(stray, timeout=10)
        if not alive and server.proc.poll() is not None:
            break
    return described


def start_lab(tmp, token=None, config=None, files=None, plain=False):
    """Start JupyterLab as `make lab` does (headless, 127.0.0.1, a free port) and wait until it answers.

    ``plain=True`` leaves out what the course adds for the login (its command-line options and private config
    folder): the tests' control case, which shows that a given learner config really weakens a bare server."""
    lab_tool = load_lab_tool()
    token = token or secrets.token_urlsafe(32)
    env = _server_env(tmp, token, lab_tool, config, files)
    cmd = lab_tool.command(port=0, browser=False, port_retries=0, expose_app=True)
    if plain:
        cmd = [arg for arg in cmd if arg not in lab_tool.AUTH_OPTIONS]
        del env["JUPYTER_CONFIG_PATH"]  # only the course's private folder is on it (_server_env drops the rest)
    log_path = tmp / "jupyterlab.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    server = LabServer(proc, None, token, None, log_path, tmp / "runtime")
    try:
        info = _wait_until_up(proc, tmp / "runtime", token, log_path)
    except BaseException:
        _stop(server)
        raise
    server.url, server.port = info["url"], info["port"]
    return server


def stop_lab(server):
    """Shut ``server`` down; fail if it or one of its kernels outlived the clean shutdown."""
    stray = _stop(server)
    assert not stray, ("still running after /api/shutdown (now killed): " + "; ".join(stray)
                       + "\nJupyterLab's log:\n" + server.log_tail())


@pytest.fixture
def start_lab_server(tmp_path):
    """``start(**kwargs)`` starts a server with :func:`start_lab` in a folder of its own; all stop at the end.

    A ``plain=True`` server may have a broken login (that is what it is for), so it is simply stopped, by signal
    if its API refuses."""
    started = []

    def start(**kwargs):
        folder = tmp_path / f"lab{len(started)}"
        folder.mkdir()
        started.append((start_lab(folder, **kwargs), kwargs.get("plain", False)))
        return started[-1][0]

    yield start
    problems = []
    for server, plain in started:  # stop every one, even after a failure
        if plain:
            try:
                os.killpg(server.proc.pid, signal.SIGTERM)
                server.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            _stop(server)
        else:
            try:
                stop_lab(server)
            except AssertionError as e:
                problems.append(str(e))
    assert not problems, "\n\n".join(problems)


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    """JupyterLab as `make lab` starts it, headless, on 127.0.0.1, a free port and a fresh token."""
    server = start_lab(tmp_path_factory.mktemp("jupyterlab"))
    yield server
    stop_lab(server)


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    """A headless Debian Chromium with a fresh profile, driven by Playwright (no browser download)."""
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 1000}, locale="en-US")
        try:
            yield context
        finally:
            context.close()


@pytest.fixture(scope="session")
def artifacts():
    """The folder CI keeps: screenshots of the browser tests."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
