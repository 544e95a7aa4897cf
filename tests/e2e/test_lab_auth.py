"""A real JupyterLab started as `make lab` starts it keeps its token, whatever the learner's Jupyter config says.

Each test writes config files into the server's own (temporary) JUPYTER_CONFIG_DIR, the folder where a learner's
``~/.jupyter`` settings live, starts the server, and calls its REST API with no token, a wrong token and the
right one. No browser is needed.
"""
import http.cookiejar
import json
import stat
import urllib.error
import urllib.parse
import urllib.request
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


def open_config():
    """A password whose hash is that of "" (anyone who leaves the field empty logs in), and every origin allowed
    (by pattern, and by headers added to every answer)."""
    from jupyter_server.auth.security import passwd

    empty = passwd("")
    headers = {"Access-Control-Allow-Origin": "https://attacker.example", "Access-Control-Allow-Credentials": "true"}
    return {"PasswordIdentityProvider": {"hashed_password": empty},
            "ServerApp": {"password": empty, "allow_origin_pat": ".*", "allow_credentials": True,
                          "tornado_settings": {"headers": headers}}}


def login(server, password):
    """Fill the login form as a browser would; return the status of the answer and the browser (its cookies)."""
    jar = http.cookiejar.CookieJar()
    browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    browser.open(server.url + "login", timeout=30).read()
    xsrf = next(c.value for c in jar if c.name == "_xsrf")
    form = urllib.parse.urlencode({"password": password, "_xsrf": xsrf}).encode()
    try:
        with browser.open(urllib.request.Request(server.url + "login?next=/api/status", data=form), timeout=30) as r:
            return r.status, browser
    except urllib.error.HTTPError as err:
        return err.code, browser


def cross_origin_headers(browser, server):
    """The CORS headers of the answer to another web site's page that calls the API with the login cookie."""
    req = urllib.request.Request(server.url + "api/contents", headers={"Origin": "https://attacker.example"})
    try:
        with browser.open(req, timeout=30) as r:
            headers = dict(r.headers)
    except urllib.error.HTTPError as err:
        headers = dict(err.headers)
    return {k: v for k, v in headers.items() if k.startswith("Access-Control-")}


def test_an_empty_password_and_open_origins_in_the_learners_config_are_overridden(start_lab_server):
    """The learner's config sets a password whose hash is that of "" and lets every web site call the server with
    the login cookie. (Without the course's settings, the empty password logs in and the answer carries
    ``Access-Control-Allow-Origin: https://attacker.example`` with ``Allow-Credentials: true``.)"""
    server = start_lab_server(config=open_config())
    assert login(server, "")[0] in (401, 403), "an empty password logged in"
    status, browser = login(server, server.token)  # the learner, with the token
    assert status == 200, status
    assert cross_origin_headers(browser, server) == {}, "another web site may call the server as the learner"
    assert_token_required(server)
