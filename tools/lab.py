"""Start JupyterLab on the course notebooks: on this machine only, and always behind a strong token.

    python tools/lab.py [--host 127.0.0.1] [--port 8888] [--no-browser]      # what `make lab` runs

The server serves ``notebooks/`` (the chapters are under ``en/`` and ``ja/``) and listens on 127.0.0.1 unless
told otherwise. It always asks for a token, whatever the learner's own Jupyter configuration says: the script
makes a new random token at every start (or takes ``JUPYTER_TOKEN``, which must be at least 16 characters with
at least 8 different ones), and prints the address with it. Settings in the learner's config files that would
weaken the login (an empty ``IdentityProvider.token``, the legacy ``ServerApp.token``, another identity provider
or login handler) are overridden:

- the token goes into a private config folder (mode 0700, file 0600) put first on ``JUPYTER_CONFIG_PATH``, the
  folder Jupyter reads with the highest priority, and into ``JUPYTER_TOKEN``. It is not put on the command line,
  where every user of a shared machine could read it in the process list;
- the same folder sets back to Jupyter's defaults what would open another door: a password (an empty one lets
  anyone log in with an empty password field: ``PasswordIdentityProvider.hashed_password``, the legacy
  ``ServerApp.password``, ``password_required``, ``allow_password_change``), and what would let other web sites
  call the server with the learner's login (``ServerApp.allow_origin``, ``allow_origin_pat``,
  ``allow_credentials``, headers in ``tornado_settings``). Each such setting found in the learner's config files
  is named in a warning at the start (:func:`overridden_settings`);
- the command line (which beats every config file) fixes Jupyter's own identity provider and login handlers
  and keeps the XSRF check on. (``ServerApp.allow_unauthenticated_access`` stays at its default: a config can
  only make it stricter, and turning it off here makes Jupyter print warnings about two websocket endpoints of
  its terminal and language-server extensions at every start, which check the login themselves.)

``make lab`` runs this script; the tests in ``tests/e2e`` start JupyterLab with the same :func:`command` and
:func:`environment`, so what they check is what a learner gets.
"""
import argparse
import errno
import ipaddress
import json
import os
import re
import secrets
import shutil
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
HOST = "127.0.0.1"
PORT = 8888
PORT_TRIES = 50  # like Jupyter's own port_retries: the next free port when the one asked for is taken
TOKEN_MIN_LENGTH = 16
TOKEN_MIN_DIFFERENT = 8
_TOKEN = re.compile(r"[A-Za-z0-9._~-]+")  # characters that need no escaping in the printed URL
_AUTH_DIR_PREFIX = "course-lab-"
# Command-line settings (they beat config files) that keep Jupyter's own token login in force.
AUTH_OPTIONS = [
    "--ServerApp.identity_provider_class=jupyter_server.auth.identity.PasswordIdentityProvider",
    "--ServerApp.login_handler_class=jupyter_server.auth.login.LoginHandler",
    "--PasswordIdentityProvider.login_handler_class=jupyter_server.auth.login.LoginFormHandler",
    "--ServerApp.disable_check_xsrf=False",
]


# Settings that the private config folder sets back to Jupyter's defaults, whatever the learner's files say.
PINNED = {
    "PasswordIdentityProvider": {"hashed_password": "", "password_required": False, "allow_password_change": False},
    "ServerApp": {"password": "", "allow_origin": "", "allow_origin_pat": "", "allow_credentials": False,
                  "tornado_settings": {}},
}
# What a learner's config may set and the course overrides (the settings above, the token, the classes).
OVERRIDDEN = {f"{cls}.{name}" for cls, names in PINNED.items() for name in names} | {
    "IdentityProvider.token", "PasswordIdentityProvider.token", "ServerApp.token", "ServerApp.password_required",
    "ServerApp.allow_password_change", *(opt[2:].split("=", 1)[0] for opt in AUTH_OPTIONS)}
CONFIG_NAMES = ("jupyter_config", "jupyter_server_config", "jupyter_lab_config")  # the files JupyterLab reads


class LabError(Exception):
    """A setting that would start JupyterLab in a way the course does not allow, with a hint to fix it."""


def is_loopback(host):
    """True when ``host`` names this machine only (127.0.0.1, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def running_as_root():
    """True when this process runs as the Unix superuser (as in many containers and CI machines)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def new_token():
    """A fresh random token (43 URL-safe characters, 256 bits)."""
    return secrets.token_urlsafe(32)


def check_token(token, name="JUPYTER_TOKEN"):
    """Raise :class:`LabError` unless ``token`` is long and varied enough to protect a server that runs code."""
    make = "python -c \"import secrets; print(secrets.token_urlsafe(32))\""
    if not isinstance(token, str) or not token.strip():
        raise LabError(f"{name} is set but empty. The course's JupyterLab always asks for a token: unset {name} "
                       f"(a new token is then made at every start) or set it to a long random string, e.g. {make}")
    if not _TOKEN.fullmatch(token):
        raise LabError(f"{name} may use only letters, digits and - _ . ~ (so that the printed address works as "
                       f"is); make one with {make}")
    if len(token) < TOKEN_MIN_LENGTH or len(set(token)) < TOKEN_MIN_DIFFERENT:
        count = f"{len(token)} character{'s' * (len(token) != 1)}, {len(set(token))} different"
        raise LabError(f"{name} is too easy to guess ({count}): use "
                       f"at least {TOKEN_MIN_LENGTH} characters with at least {TOKEN_MIN_DIFFERENT} different "
                       f"ones, e.g. {make}, or unset {name} to get a new token at every start.")
    return token


def _check_host_and_port(host, port):
    if not host or not str(host).strip():
        raise LabError("the host is empty; use --host 127.0.0.1 (make lab HOST=127.0.0.1), this machine only.")
    try:
        port = int(port)
    except (TypeError, ValueError):
        raise LabError(f"the port {port!r} is not a number; use e.g. --port 8888 (make lab PORT=8888).") from None
    if not 0 <= port <= 65535:
        raise LabError(f"the port {port} is outside 0-65535; use e.g. --port 8888 (make lab PORT=8888).")
    return port


def command(host=HOST, port=PORT, *, browser=True, port_retries=None, expose_app=False, root=NOTEBOOKS, python=None):
    """The JupyterLab command line (a list) that ``make lab`` runs; start it with :func:`environment`.

    ``port=0`` lets the system pick a free port; ``port_retries=0`` fails instead of moving to another port when
    ``port`` is taken; ``expose_app`` makes the page's JupyterLab object readable from the browser (the browser
    test reads cell outputs through it). No option here weakens authentication, and :data:`AUTH_OPTIONS` are
    always there.
    """
    port = _check_host_and_port(host, port)
    cmd = [
        python or sys.executable, "-m", "jupyterlab",
        f"--ServerApp.ip={host}",
        f"--ServerApp.port={port}",
        f"--ServerApp.root_dir={root}",
        f"--ServerApp.open_browser={bool(browser)}",
        *AUTH_OPTIONS,
    ]
    if running_as_root():  # containers and CI run as root; Jupyter refuses to start there without this
        cmd.append("--ServerApp.allow_root=True")
    if port_retries is not None:
        cmd.append(f"--ServerApp.port_retries={int(port_retries)}")
    if expose_app:
        cmd.append("--LabApp.expose_app_in_browser=True")
    return cmd


def auth_config(token):
    """The Jupyter settings that carry the token and :data:`PINNED` (written to the private config folder)."""
    return {"IdentityProvider": {"token": token},
            "PasswordIdentityProvider": {**PINNED["PasswordIdentityProvider"], "token": token},
            "ServerApp": dict(PINNED["ServerApp"])}


def overridden_settings(folders=None):
    """``(file, "Class.name")`` for each setting of :data:`OVERRIDDEN` in the config files JupyterLab would read.

    ``folders`` defaults to Jupyter's config path (the course's own private folders left out). A file that cannot
    be read here gives ``(file, None)``; JupyterLab reports its problem when it reads it."""
    from jupyter_core.paths import jupyter_config_path
    from traitlets.config.loader import JSONFileConfigLoader, PyFileConfigLoader

    found = []
    for folder in map(Path, jupyter_config_path() if folders is None else folders):
        if folder.name.startswith(_AUTH_DIR_PREFIX):
            continue
        for name in CONFIG_NAMES:
            paths = [folder / f"{name}.py", folder / f"{name}.json", *sorted((folder / f"{name}.d").glob("*.json"))]
            for path in filter(Path.is_file, paths):
                loader = PyFileConfigLoader if path.suffix == ".py" else JSONFileConfigLoader
                try:
                    config = loader(path.name, str(path.parent)).load_config()
                except Exception:  # any error of the learner's own file; JupyterLab will report it
                    found.append((path, None))
                    continue
                found += [(path, f"{cls}.{key}") for cls in sorted(config) if isinstance(config[cls], dict)
                          for key in sorted(config[cls]) if f"{cls}.{key}" in OVERRIDDEN]
    return found


def write_auth_config(token, folder):
    """Write :func:`auth_config` into ``folder`` (made private: 0700, files 0600); return the folder."""
    folder = Path(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    text = json.dumps(auth_config(token), indent=1)
    for name in ("jupyter_server_config.json", "jupyter_lab_config.json"):  # the server's and JupyterLab's files
        path = folder / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(path, 0o600)
    return folder


def environment(base=None, token=None, *, auth_dir):
    """The environment to start JupyterLab with: ``base`` (default: this process's) with the token in force.

    The token is ``token``, else ``JUPYTER_TOKEN`` from ``base`` (checked by :func:`check_token`), else a new
    one; it ends up in ``JUPYTER_TOKEN`` and in a private config folder ``auth_dir`` that goes first on
    ``JUPYTER_CONFIG_PATH``. Raises :class:`LabError` for a weak token.
    """
    env = dict(os.environ if base is None else base)
    if token is None:
        token = env.get("JUPYTER_TOKEN")
        token = new_token() if token is None else token
    check_token(token)
    env.pop("JUPYTER_TOKEN_FILE", None)
    env["JUPYTER_TOKEN"] = token
    folder = str(write_auth_config(token, auth_dir))
    others = [p for p in env.get("JUPYTER_CONFIG_PATH", "").split(os.pathsep) if p and p != folder]
    env["JUPYTER_CONFIG_PATH"] = os.pathsep.join([folder, *others])
    return env


def auth_dir_for(pid):
    """The private config folder of the server that will run as process ``pid`` (under Jupyter's runtime folder).

    Folders of servers that are no longer running are removed on the way."""
    from jupyter_core.paths import jupyter_runtime_dir

    runtime = Path(jupyter_runtime_dir())
    runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
    for old in runtime.glob(f"{_AUTH_DIR_PREFIX}*"):
        other = old.name[len(_AUTH_DIR_PREFIX):]
        if other.isdigit() and int(other) != pid and not _alive(int(other)):
            shutil.rmtree(old, ignore_errors=True)
    return runtime / f"{_AUTH_DIR_PREFIX}{pid}"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_port(host, port, tries=PORT_TRIES):
    """The first port from ``port`` on that ``host`` can listen on (``port=0``: one the system picks).

    Returns the port; raises :class:`LabError` when ``host`` is not an address of this machine, the port needs
    privileges, or ``tries`` ports in a row are taken."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise LabError(f"--host {host}: no such address or host name; use --host 127.0.0.1 "
                       "(make lab HOST=127.0.0.1).") from None
    for candidate in ([0] if port == 0 else range(port, min(port + tries, 65536))):
        picked = None
        try:
            for family, kind, proto, _, address in infos:
                with socket.socket(family, kind, proto) as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does
                    try:
                        s.bind((address[0], picked or candidate, *address[2:]))
                    except OSError as err:  # "localhost" without IPv6: the server skips ::1 as well
                        if err.errno == errno.EADDRNOTAVAIL and host == "localhost" and family == socket.AF_INET6:
                            continue
                        raise
                    picked = s.getsockname()[1]
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                continue
            if err.errno == errno.EACCES:
                raise LabError(f"port {candidate} needs administrator rights; use a port above 1023, e.g. "
                               "--port 8888 (make lab PORT=8888).") from None
            if err.errno == errno.EADDRNOTAVAIL:
                raise LabError(f"--host {host} is not an address of this machine; use --host 127.0.0.1 "
                               "(make lab HOST=127.0.0.1).") from None
            raise LabError(f"cannot listen on {host} port {candidate}: {err.strerror}.") from None
        if picked:
            return picked
    last = min(port + tries, 65536) - 1
    raise LabError(f"ports {port}-{last} are all in use (another JupyterLab?); stop it or choose another port "
                   "with --port (make lab PORT=...).")


def url(host, port, token):
    """The address to open, token included."""
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/lab?token={token}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default=HOST, help="address to listen on (default %(default)s: this machine only)")
    parser.add_argument("--port", default=PORT, help="port (default %(default)s; the next free one if taken)")
    parser.add_argument("--no-browser", action="store_true", help="do not open a web browser")
    args = parser.parse_args(argv)

    def fail(message):
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    for path, setting in overridden_settings():
        print(f"{parser.prog}: warning: {path} " + (f"sets {setting}; the course's JupyterLab overrides it (only "
              "its token logs in, and no other web site may call it)." if setting else "cannot be read here; "
              "JupyterLab will report its problem."), file=sys.stderr)
    try:
        asked = _check_host_and_port(args.host, args.port)
        if not NOTEBOOKS.is_dir():
            fail(f"the course folder {NOTEBOOKS} is missing; run this from a full copy of the course.")
        port = free_port(args.host, asked)
        cmd = command(args.host, port, browser=not args.no_browser, port_retries=0)
        env = environment(auth_dir=auth_dir_for(os.getpid()))  # JupyterLab will run as this very process
    except LabError as e:
        fail(e)
    if asked not in (0, port):
        print(f"{parser.prog}: port {asked} is in use; using {port} instead.", file=sys.stderr)
    if not is_loopback(args.host):
        print(f"{parser.prog}: warning: listening on {args.host} lets other machines reach this JupyterLab "
              "(the token is still required). To keep it on this machine, leave out --host or pass --host "
              "127.0.0.1 (make lab HOST=127.0.0.1).", file=sys.stderr)
    print(f"{parser.prog}: starting JupyterLab on the course in {NOTEBOOKS}. Begin with en/00_setup.ipynb "
          "(English) or ja/00_setup.ipynb (日本語). Press Ctrl+C twice to stop it.\n"
          f"{parser.prog}: open {url(args.host, port, env['JUPYTER_TOKEN'])}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)  # JupyterLab replaces this process, so Ctrl+C reaches it directly


if __name__ == "__main__":
    main()
