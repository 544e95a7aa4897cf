"""Start JupyterLab on the course notebooks: on this machine only, with token authentication.

    python tools/lab.py [--host 127.0.0.1] [--port 8888] [--no-browser]

``make lab`` runs this script, and the browser test in ``tests/e2e`` starts JupyterLab with the same
:func:`command`, so what the test checks is what a learner gets. The server serves ``notebooks/`` (the chapters
are under ``en/`` and ``ja/``), listens on 127.0.0.1 unless told otherwise, and always asks for a token: Jupyter
makes a new one at every start and prints the address with it (and opens it in the browser when one exists).
Set ``JUPYTER_TOKEN`` to choose the token yourself; an empty token is refused.
"""
import argparse
import ipaddress
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
HOST = "127.0.0.1"
PORT = 8888


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


def command(host=HOST, port=PORT, *, browser=True, port_retries=None, expose_app=False, root=NOTEBOOKS, python=None):
    """The JupyterLab command line (a list) that ``make lab`` runs.

    ``port=0`` lets the system pick a free port; ``port_retries=0`` fails instead of moving to another port when
    ``port`` is taken; ``expose_app`` makes the page's JupyterLab object readable from the browser (the browser
    test reads cell outputs through it). No option here weakens authentication: the token stays on.
    """
    if not host:
        raise LabError("HOST is empty; use HOST=127.0.0.1 (this machine only).")
    try:
        port = int(port)
    except (TypeError, ValueError):
        raise LabError(f"PORT={port!r} is not a number; use e.g. PORT=8888.") from None
    if not 0 <= port <= 65535:
        raise LabError(f"PORT={port} is outside 0-65535; use e.g. PORT=8888.")
    cmd = [
        python or sys.executable, "-m", "jupyterlab",
        f"--ServerApp.ip={host}",
        f"--ServerApp.port={port}",
        f"--ServerApp.root_dir={root}",
        f"--ServerApp.open_browser={bool(browser)}",
    ]
    if running_as_root():  # containers and CI run as root; Jupyter refuses to start there without this
        cmd.append("--ServerApp.allow_root=True")
    if port_retries is not None:
        cmd.append(f"--ServerApp.port_retries={int(port_retries)}")
    if expose_app:
        cmd.append("--LabApp.expose_app_in_browser=True")
    return cmd


def environment(base=None, token=None):
    """The environment to start JupyterLab with: ``base`` (default: this process's) and, if given, ``token``."""
    env = dict(os.environ if base is None else base)
    if token is not None:
        env["JUPYTER_TOKEN"] = token
    if "JUPYTER_TOKEN" in env and not env["JUPYTER_TOKEN"].strip():
        raise LabError("JUPYTER_TOKEN is set but empty. The course's JupyterLab always asks for a token: "
                       "unset JUPYTER_TOKEN (Jupyter then makes one) or set it to a long random string.")
    return env


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default=HOST, help="address to listen on (default %(default)s: this machine only)")
    parser.add_argument("--port", default=PORT, help="port (default %(default)s; the next free one if taken)")
    parser.add_argument("--no-browser", action="store_true", help="do not open a web browser")
    args = parser.parse_args(argv)
    try:
        cmd = command(args.host, args.port, browser=not args.no_browser)
        env = environment()
    except LabError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if not NOTEBOOKS.is_dir():
        parser.exit(2, f"{parser.prog}: error: the course folder {NOTEBOOKS} is missing; "
                       "run this from a full copy of the course.\n")
    if not is_loopback(args.host):
        print(f"{parser.prog}: warning: listening on {args.host} lets other machines reach this JupyterLab "
              "(the token is still required). Use HOST=127.0.0.1 to keep it on this machine.", file=sys.stderr)
    print(f"{parser.prog}: starting JupyterLab on the course in {NOTEBOOKS}. Begin with en/00_setup.ipynb "
          "(English) or ja/00_setup.ipynb (日本語). Press Ctrl+C twice to stop it.", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)  # JupyterLab replaces this process, so Ctrl+C reaches it directly


if __name__ == "__main__":
    main()
