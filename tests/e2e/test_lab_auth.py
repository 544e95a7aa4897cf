"""A real JupyterLab started as `make lab` starts it keeps its token, whatever the learner's Jupyter config says.

Each test writes config files into the server's own (temporary) JUPYTER_CONFIG_DIR, the folder where a learner's
``~/.jupyter`` settings live, starts the server, and calls its REST API with no token, a wrong token and the
right one. No browser is needed.
"""
import json
import stat
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

# Everything a JSON config can say to switch the token off: the current name, the subclass the server really
# uses, the pre-2.0 name, and the same in JupyterLab's and the base Jupyter config files.
NO_TOKEN = {"IdentityProvider": {"token": ""}, "PasswordIdentityProvider": {"token": ""},
            "ServerApp": {"token": "", "disable_check_xsrf": True}}
NO_TOKEN_FILES = {"jupyter_lab_config.json": json.dumps(NO_TOKEN), "jupyter_config.json": json.dumps(NO_TOKEN)}
# A Python config can go further: its own identity provider that lets everyone in, or a legacy login handler.
OPEN_DOOR = '''
from jupyter_server.auth.identity import PasswordIdentityProvider, User
from jupyter_server.auth.login import LegacyLoginHandler


class OpenDoor(PasswordIdentityProvider):
    def get_user(self, handler):
        return User("anyone")


class OpenLogin(LegacyLoginHandler):
    @classmethod
    def get_user(cls, handler):
        return "anyone"


c.ServerApp.identity_provider_class = OpenDoor
c.ServerApp.login_handler_class = OpenLogin
c.PasswordIdentityProvider.login_handler_class = OpenLogin
'''
PATHS = ("api/contents", "api/contents/en", "api/kernels", "api/sessions", "api/kernelspecs")


def statuses(server, token):
    return {path: server.request(path, token=token)[0] for path in PATHS}


def assert_token_required(server):
    assert statuses(server, None) == dict.fromkeys(PATHS, 403), "answered without a token"
    assert statuses(server, "not-the-token-but-long-enough") == dict.fromkeys(PATHS, 403), "a wrong token worked"
    status, _, _ = server.request("api/kernels", method="POST", token=None, data={"name": "python3"})
    assert status == 403, f"starting a kernel without the token answered {status}"
    assert statuses(server, True) == dict.fromkeys(PATHS, 200), "the right token did not work"


def test_a_config_without_token_really_switches_a_bare_server_open(start_lab_server):
    """The control case: without the course's settings, this config turns authentication off."""
    server = start_lab_server(config=NO_TOKEN, files=NO_TOKEN_FILES, plain=True)
    assert statuses(server, None) == dict.fromkeys(PATHS, 200)


def test_the_token_stays_required_with_a_config_that_empties_it(start_lab_server):
    server = start_lab_server(config=NO_TOKEN, files=NO_TOKEN_FILES)
    assert_token_required(server)


def test_the_token_stays_required_with_a_config_that_replaces_the_login(start_lab_server):
    plain = start_lab_server(files={"jupyter_server_config.py": OPEN_DOOR}, plain=True)
    assert statuses(plain, None)["api/contents"] == 200, "control: this config lets anyone into a bare server"
    server = start_lab_server(files={"jupyter_server_config.py": OPEN_DOOR})
    assert_token_required(server)


def test_the_token_is_not_in_the_process_list_and_its_file_is_private(start_lab_server):
    server = start_lab_server()
    cmdline = " ".join(psutil.Process(server.proc.pid).cmdline())
    assert server.token not in cmdline, "other users of the machine could read the token with ps"
    env_path = psutil.Process(server.proc.pid).environ()["JUPYTER_CONFIG_PATH"].split(":")[0]
    folder = Path(env_path)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = sorted(folder.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert_token_required(server)
