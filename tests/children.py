"""What the tests' child programs get: one environment builder, importable by name (test modules cannot import
``conftest``: the e2e folder has a conftest of its own)."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_child_env(*paths, **extra):
    """The environment for a child Python program: one thread, English messages, no rendezvous variables inherited,
    this checkout (and ``paths``) first on ``PYTHONPATH``; ``extra`` adds or replaces variables."""
    from mparlib.rendezvous import RENDEZVOUS_VARS

    drop = set(RENDEZVOUS_VARS) | {"LOCAL_RANK", "TORCHELASTIC_RUN_ID"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*map(str, paths), str(ROOT), env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", MPARLIB_QUIET="1", MPARLIB_LANG="en")
    env.update({k: str(v) for k, v in extra.items()})
    return env
