"""The two-command setup: one dependency list for pip and conda, and a second `make` that installs nothing."""
import re
import subprocess
from pathlib import Path

import yaml

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def name(requirement):
    """'pagefind[extended]>=1.3' -> 'pagefind'."""
    return re.split(r"[\[<>=!~ ;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def pyproject_packages():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return {name(r) for r in reqs}


def conda_packages():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    names = set()
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            names |= {name(r) for r in dep["pip"] if not r.startswith("-")}
        else:
            names.add(name(dep))
    return names - {"python", "pip"}


def test_conda_and_pip_name_the_same_packages():
    assert conda_packages() == pyproject_packages()


def test_the_course_packages_are_all_there():
    wanted = {"torch", "torchvision", "jupyterlab", "matplotlib", "nbval", "tqdm", "ipykernel", "matplotlib-fontja"}
    assert wanted <= pyproject_packages()
    # d2l is installed without its pins, so it is not a dependency: the Makefile installs it with --no-deps.
    assert "pip install --no-deps d2l==1.0.3" in (ROOT / "Makefile").read_text()
    assert "pip install --no-deps d2l==1.0.3" in (ROOT / "environment.yml").read_text()


def test_d2l_imports_beside_current_numpy_and_matplotlib():
    import numpy
    from d2l import torch as d2l

    assert int(numpy.__version__.split(".")[0]) >= 2 or numpy.__version__ != "1.23.5"
    assert callable(d2l.resnet18)


def test_a_second_make_installs_nothing(tmp_path):
    # With the install stamp newer than pyproject.toml, `make -n` (dry run) lists no install step.
    for target in ("test", "lab"):
        plan = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        assert "pip install" not in plan, f"`make {target}` would reinstall:\n{plan}"
    assert "pytest" in subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True).stdout


def test_a_fresh_checkout_installs_everything_in_one_venv(tmp_path):
    plan = subprocess.run(["make", "-n", "test", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout
    steps = ["-m venv", "pip install -e '.[course,test]'", "pip install --no-deps d2l==1.0.3", "ipykernel install",
             "pytest --nbval"]
    positions = [plan.find(step) for step in steps]
    assert all(p >= 0 for p in positions), plan
    assert positions == sorted(positions), "install steps come before the tests"


def test_ci_installs_system_packages_then_runs_the_readme_command():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    for package in ("dataset-fashion-mnist", "chromium", "fonts-noto-cjk"):
        assert package in ci
    assert ci.rstrip().endswith("make test")
    first_code = re.search(r"```(?:sh|bash)?\n(.*?)```", readme, re.S).group(1).split()
    assert first_code == ["make", "lab"] or first_code[:2] == ["make", "lab"]
    assert "make test" in readme.split("## ")[1], "the README's first section shows both commands"


def test_lab_listens_on_localhost_with_a_token():
    plan = subprocess.run(["make", "-n", "lab"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "127.0.0.1" in plan
    assert "token=''" not in plan and 'token=""' not in plan and "disable_check_xsrf" not in plan
