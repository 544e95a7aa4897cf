"""`make lab`'s command line (tools/lab.py): what it promises without starting a server or a browser."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("course_lab_tool", ROOT / "tools" / "lab.py")
lab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lab)


def options(cmd):
    """``--Name.trait=value`` options of a command line as a dict."""
    return dict(arg[2:].split("=", 1) for arg in cmd if arg.startswith("--") and "=" in arg)


def test_default_command_serves_the_course_on_this_machine():
    cmd = lab.command()
    opts = options(cmd)
    assert cmd[:3] == [sys.executable, "-m", "jupyterlab"]
    assert opts["ServerApp.ip"] == "127.0.0.1"
    assert opts["ServerApp.port"] == "8888"
    assert opts["ServerApp.root_dir"] == str(ROOT / "notebooks")
    assert opts["ServerApp.open_browser"] == "True"
    # Nothing that weakens authentication or opens the server to other machines.
    for arg in cmd:
        name = arg.split("=", 1)[0].lower()
        assert not any(word in name for word in ("token", "password", "disable_check_xsrf", "allow_origin",
                                                 "allow_remote_access")), arg


def test_test_options_only_add_what_they_name():
    base = options(lab.command())
    test = options(lab.command(port=0, browser=False, port_retries=0, expose_app=True))
    assert {k: v for k, v in test.items() if base.get(k) != v} == {
        "ServerApp.port": "0", "ServerApp.open_browser": "False", "ServerApp.port_retries": "0",
        "LabApp.expose_app_in_browser": "True"}


@pytest.mark.parametrize("host, port, problem", [("", 8888, "HOST is empty"), ("127.0.0.1", "abc", "not a number"),
                                                 ("127.0.0.1", 70000, "outside 0-65535")])
def test_bad_settings_are_explained(host, port, problem):
    with pytest.raises(lab.LabError, match=problem):
        lab.command(host, port)


def test_token_can_be_chosen_but_never_emptied():
    assert lab.environment({}, token="abc123")["JUPYTER_TOKEN"] == "abc123"
    assert "JUPYTER_TOKEN" not in lab.environment({"PATH": "/bin"})  # Jupyter then makes a fresh one
    with pytest.raises(lab.LabError, match="empty"):
        lab.environment({"JUPYTER_TOKEN": " "})


def test_make_lab_refuses_an_empty_token_before_starting():
    env = {"PATH": "/usr/bin:/bin", "JUPYTER_TOKEN": ""}
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "lab.py"), "--no-browser"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "JUPYTER_TOKEN is set but empty" in r.stderr, r.stderr


@pytest.mark.parametrize("host, expected", [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                            ("0.0.0.0", False), ("192.168.1.5", False), ("example.org", False)])
def test_loopback_hosts(host, expected):
    assert lab.is_loopback(host) is expected
