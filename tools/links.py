"""Where the course is published: its repository address (from ``book.toml``) and the hosted-notebook links.

Set ``repository`` (and optionally ``branch``) in the ``[preprocessor.mparlib]`` table of ``book.toml``:

    repository = "https://github.com/OWNER/REPO"
    branch = "main"

Then every notebook and every page of the book links to Google Colab (one GPU) and Kaggle (up to two GPUs),
which open the notebook straight from the repository. Without ``repository`` there are no such links.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_GITHUB = re.compile(r"^https://github\.com/(?P<owner>[A-Za-z0-9_.-]+)/(?P<repo>[A-Za-z0-9_.-]+?)(?:\.git)?/?$")
_BRANCH = re.compile(r"^[A-Za-z0-9._/-]+$")


class LinkError(ValueError):
    """``repository`` or ``branch`` in ``book.toml`` cannot be turned into links; the message says how to fix it."""


def read_toml(path):
    """The parsed TOML file at ``path``; LinkError says why it cannot be read."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise LinkError("reading book.toml on Python 3.10 needs tomli: `pip install tomli`.") from None
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise LinkError(f"cannot read {path}: {err.strerror or err}.") from None
    except tomllib.TOMLDecodeError as err:
        raise LinkError(f"{path} is not valid TOML: {err}.") from None


def repository(root=ROOT):
    """``(owner, repo, branch)`` from ``book.toml``, or ``None`` when no repository is configured."""
    return from_settings(read_toml(Path(root) / "book.toml").get("preprocessor", {}).get("mparlib", {}))


def from_settings(course):
    """``(owner, repo, branch)`` from the ``[preprocessor.mparlib]`` table (a dict), or ``None`` when unset."""
    url = course.get("repository")
    if url in (None, ""):
        return None
    branch = course.get("branch", "main")
    m = _GITHUB.match(str(url))
    if not m or m.group("repo") in (".", ".."):
        raise LinkError(f"book.toml: repository = {url!r} is not a GitHub address; write it as "
                        "\"https://github.com/OWNER/REPO\" (Colab and Kaggle open notebooks from GitHub), or remove "
                        "the line to publish without hosted-notebook links.")
    if not (isinstance(branch, str) and _BRANCH.match(branch) and ".." not in branch):
        raise LinkError(f"book.toml: branch = {branch!r} is not a branch name; use e.g. \"main\".")
    return m.group("owner"), m.group("repo"), branch


def hosted_links(repo, path):
    """``{"colab": url, "kaggle": url}`` opening the notebook at ``path`` (relative to the repository root)."""
    owner, name, branch = repo
    path = Path(path).as_posix().lstrip("/")
    blob = f"github.com/{owner}/{name}/blob/{branch}/{path}"
    return {"colab": f"https://colab.research.google.com/{blob.replace('github.com/', 'github/', 1)}",
            "kaggle": f"https://www.kaggle.com/kernels/welcome?src=https://{blob}"}


def clone_url(repo):
    """The address ``pip install git+...`` installs the course from."""
    owner, name, _branch = repo
    return f"https://github.com/{owner}/{name}.git"
