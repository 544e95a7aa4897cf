"""`make lab`'s command line (tools/lab.py): what it promises without starting a server or a browser."""
import importlib.util
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("course_lab_tool", ROOT / "tools" / "lab.py")
lab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lab)
STRONG = "Zq3-vX8_pL2.mN7~rT5sKw"


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


def test_the_command_pins_jupyters_own_token_login():
    opts = options(lab.command())
    assert opts["ServerApp.identity_provider_class"] == "jupyter_server.auth.identity.PasswordIdentityProvider"
    assert opts["ServerApp.login_handler_class"] == "jupyter_server.auth.login.LoginHandler"
    assert opts["PasswordIdentityProvider.login_handler_class"] == "jupyter_server.auth.login.LoginFormHandler"
    assert opts["ServerApp.disable_check_xsrf"] == "False"
    # The classes named are the installed Jupyter Server's own defaults.
    from jupyter_server.auth.identity import IdentityProvider
    from jupyter_server.serverapp import ServerApp
    from traitlets.utils.importstring import import_item

    for option, trait in [("ServerApp.identity_provider_class", ServerApp.identity_provider_class),
                          ("ServerApp.login_handler_class", ServerApp.login_handler_class),
                          ("PasswordIdentityProvider.login_handler_class", IdentityProvider.login_handler_class)]:
        default = trait.default_value
        assert import_item(opts[option]) is (import_item(default) if isinstance(default, str) else default), option
    # Nothing that opens the server up, and no token where other users could read it (ps).
    for arg in lab.command():
        trait = arg.split("=", 1)[0].rsplit(".", 1)[-1].lower()
        assert not any(word in trait for word in ("token", "password", "allow_origin", "allow_remote_access")), arg


def test_test_options_only_add_what_they_name():
    base = options(lab.command())
    test = options(lab.command(port=0, browser=False, port_retries=0, expose_app=True))
    assert {k: v for k, v in test.items() if base.get(k) != v} == {
        "ServerApp.port": "0", "ServerApp.open_browser": "False", "ServerApp.port_retries": "0",
        "LabApp.expose_app_in_browser": "True"}


@pytest.mark.parametrize("host, port, problem", [("", 8888, "the host is empty"), ("127.0.0.1", "abc", "not a number"),
                                                 ("127.0.0.1", 70000, "outside 0-65535"),
                                                 ("127.0.0.1", -1, "outside 0-65535")])
def test_bad_settings_are_explained(host, port, problem):
    with pytest.raises(lab.LabError, match=problem):
        lab.command(host, port)


@pytest.mark.parametrize("token, problem", [
    ("", "empty"), ("   ", "empty"), ("x", "too easy to guess"), ("Ab3-Ab3-Ab3-Ab3", "too easy to guess"),
    ("a" * 40, "too easy to guess"), ("ab" * 20, "too easy to guess"), ("correct horse battery", "only letters"),
    ("token&next=http://x", "only letters"), ("トークンとしては長い文字列ですがASCIIではない", "only letters")])
def test_weak_tokens_are_refused(tmp_path, token, problem):
    with pytest.raises(lab.LabError, match=problem):
        lab.environment({"JUPYTER_TOKEN": token}, auth_dir=tmp_path / "auth")
    assert not (tmp_path / "auth").exists(), "nothing is written for a refused token"


def test_strong_tokens_are_kept(tmp_path):
    for token in (STRONG, lab.new_token(), os.urandom(24).hex()):  # the last like the tokens Jupyter makes
        assert lab.environment({"JUPYTER_TOKEN": token}, auth_dir=tmp_path / "a")["JUPYTER_TOKEN"] == token
    made = {lab.environment({}, auth_dir=tmp_path / "b")["JUPYTER_TOKEN"] for _ in range(3)}
    assert len(made) == 3 and all(len(t) >= 40 for t in made), "a new random token at every start"


def test_the_token_goes_into_a_private_config_folder_read_first(tmp_path):
    env = lab.environment({"JUPYTER_CONFIG_PATH": "/etc/somewhere", "JUPYTER_TOKEN_FILE": "/tmp/t"}, token=STRONG,
                          auth_dir=tmp_path / "auth")
    folder = tmp_path / "auth"
    assert env["JUPYTER_CONFIG_PATH"].split(os.pathsep) == [str(folder), "/etc/somewhere"]
    assert "JUPYTER_TOKEN_FILE" not in env and env["JUPYTER_TOKEN"] == STRONG
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for name in ("jupyter_server_config.json", "jupyter_lab_config.json"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600
        config = json.loads((folder / name).read_text())
        assert config["IdentityProvider"]["token"] == config["PasswordIdentityProvider"]["token"] == STRONG


def run_lab(*args, env=None, script=ROOT / "tools" / "lab.py"):
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run([sys.executable, str(script), "--no-browser", *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args, env, message", [
    ((), {"JUPYTER_TOKEN": ""}, "JUPYTER_TOKEN is set but empty"),
    ((), {"JUPYTER_TOKEN": "x"}, "JUPYTER_TOKEN is too easy to guess (1 character, 1 different)"),
    (("--port", "abc"), {}, "the port 'abc' is not a number; use e.g. --port 8888 (make lab PORT=8888)"),
    (("--port", "99999"), {}, "the port 99999 is outside 0-65535"),
    (("--host", ""), {}, "the host is empty; use --host 127.0.0.1 (make lab HOST=127.0.0.1)"),
    (("--host", "host.invalid"), {}, "--host host.invalid: no such address"),
])
def test_make_lab_refuses_bad_settings_before_starting(tmp_path, args, env, message):
    r = run_lab(*args, env={"JUPYTER_RUNTIME_DIR": str(tmp_path), **env})
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "jupyterlab" not in r.stdout.lower()


def test_make_lab_without_the_notebooks_folder_says_so(tmp_path):
    (tmp_path / "tools").mkdir()
    script = shutil.copy(ROOT / "tools" / "lab.py", tmp_path / "tools" / "lab.py")
    r = run_lab(script=script, env={"JUPYTER_RUNTIME_DIR": str(tmp_path)})
    assert r.returncode == 2 and "the course folder" in r.stderr and "is missing" in r.stderr, r.stderr


def test_a_taken_port_moves_to_the_next_free_one_or_is_explained():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert lab.free_port("127.0.0.1", port) != port
        with pytest.raises(lab.LabError, match=f"ports {port}-{port} are all in use"):
            lab.free_port("127.0.0.1", port, tries=1)
    with pytest.raises(lab.LabError, match="not an address of this machine"):
        lab.free_port("192.0.2.1", 8888)  # TEST-NET-1: never an address of this machine


@pytest.fixture
def started(monkeypatch, tmp_path):
    """Run ``main`` up to the point where it would become JupyterLab; return what it would run."""
    seen = {}
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.delenv("JUPYTER_TOKEN", raising=False)

    def fake_execve(path, cmd, env):
        seen.update(path=path, cmd=cmd, env=env)
        raise SystemExit(0)

    monkeypatch.setattr(lab.os, "execve", fake_execve)

    def run(*args):
        with pytest.raises(SystemExit):
            lab.main(["--no-browser", *args])
        return seen

    return run


def test_make_lab_prints_the_address_with_the_token(started, capsys):
    seen = started("--port", "0")
    err = capsys.readouterr().err
    token, port = seen["env"]["JUPYTER_TOKEN"], options(seen["cmd"])["ServerApp.port"]
    assert f"open http://127.0.0.1:{port}/lab?token={token}" in err
    assert port != "0" and options(seen["cmd"])["ServerApp.port_retries"] == "0", "the printed port is the real one"
    folder = Path(seen["env"]["JUPYTER_CONFIG_PATH"].split(os.pathsep)[0])
    assert folder.name == f"course-lab-{os.getpid()}"  # the server keeps this process's id (exec)
    assert json.loads((folder / "jupyter_server_config.json").read_text())["IdentityProvider"]["token"] == token


def test_a_public_host_warns_with_the_flags_that_exist(started, capsys):
    started("--host", "0.0.0.0", "--port", "0")
    err = capsys.readouterr().err
    assert "warning: listening on 0.0.0.0" in err and "--host 127.0.0.1" in err and "make lab HOST=127.0.0.1" in err


def test_folders_of_servers_that_stopped_are_removed(started, tmp_path):
    gone = tmp_path / "runtime" / "course-lab-999999999"
    gone.mkdir(parents=True)
    mine = tmp_path / "runtime" / f"course-lab-{os.getppid()}"  # a process that is running
    mine.mkdir()
    started("--port", "0")
    assert not gone.exists() and mine.exists()


@pytest.mark.parametrize("host, expected", [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                            ("0.0.0.0", False), ("192.168.1.5", False), ("example.org", False)])
def test_loopback_hosts(host, expected):
    assert lab.is_loopback(host) is expected


# A learner's config that opens other doors: a password (here the hash of an empty one, which lets anyone in who
# leaves the password field empty) and every origin with credentials.
OPEN_CONFIG = {"PasswordIdentityProvider": {"hashed_password": "argon2:$argon2id$v=19$m=10240,t=10,p=8$x$y",
                                            "password_required": True},
               "ServerApp": {"password": "sha1:0e112c3ddfce:a68df677475c2b47b6e86d0467eec97ac5f4b85a",
                             "allow_origin_pat": ".*", "allow_origin": "*", "allow_credentials": True,
                             "tornado_settings": {"headers": {"Access-Control-Allow-Origin": "*"}}}}


def test_the_private_config_sets_passwords_and_origins_back_to_the_defaults(tmp_path):
    """The private folder is read last (it wins) and gives each setting that could open a door its default."""
    from jupyter_server.auth.identity import PasswordIdentityProvider
    from jupyter_server.serverapp import ServerApp

    lab.environment({}, token=STRONG, auth_dir=tmp_path / "auth")
    classes = {"ServerApp": ServerApp, "PasswordIdentityProvider": PasswordIdentityProvider}
    for name in ("jupyter_server_config.json", "jupyter_lab_config.json"):
        config = json.loads((tmp_path / "auth" / name).read_text())
        for cls, settings in OPEN_CONFIG.items():
            for key in settings:
                default = classes[cls].class_traits()[key].default()
                assert config[cls][key] == default, f"{cls}.{key} is left to the learner's config"
        assert config["PasswordIdentityProvider"]["allow_password_change"] is False, "no new password from the form"


def test_make_lab_names_each_setting_of_the_learner_that_it_overrides(started, capsys, tmp_path, monkeypatch):
    own = tmp_path / "learner"
    own.mkdir()
    (own / "jupyter_server_config.json").write_text(json.dumps(OPEN_CONFIG))
    (own / "jupyter_lab_config.py").write_text("c.ServerApp.identity_provider_class = 'mine.Open'\n"
                                               "c.ServerApp.port = 9999\n")
    (own / "jupyter_config.py").write_text("raise RuntimeError('a broken config')\n")
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(own))
    monkeypatch.setenv("JUPYTER_CONFIG_PATH", str(tmp_path / "runtime" / "course-lab-1"))  # an older server's
    started("--port", "0")
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    named = sorted(line.split(" sets ")[1].split(";")[0] for line in warned if " sets " in line)
    assert named == ["PasswordIdentityProvider.hashed_password", "PasswordIdentityProvider.password_required",
                     "ServerApp.allow_credentials", "ServerApp.allow_origin", "ServerApp.allow_origin_pat",
                     "ServerApp.identity_provider_class", "ServerApp.password", "ServerApp.tornado_settings"]
    assert all("the course's JupyterLab overrides it" in line for line in warned if " sets " in line)
    assert any("jupyter_config.py cannot be read here" in line for line in warned)
    assert not any("course-lab-" in line for line in warned), "the course's own folders are not the learner's"
