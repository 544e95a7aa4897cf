"""tools/gpu_check.sh, the one-call check of every GPU path, tried on a machine without a GPU.

Without CUDA it must stop at once (exit code 2) before installing or running anything; its plan (order, time boxes,
commands) is read from its dry run; and its step machinery (installing carried wheels, a failing step, a step that
outlives its time box, packing the results) runs for real with `--no-cuda-check`, with a stand-in Python that
fails or hangs in place of the benchmarks.
"""
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
WHEELS_SCRIPT = ROOT / "tools" / "gpu_wheels.sh"
STEP_LINE = re.compile(r"^\s*(\d+) (\S+)\s+(\S+)\s+box\s+(\d+) s  (.*)$")
DEVICE_CALL_LIMIT_S = 600  # the GPU machine's limit for one command


def run(*args, env=None, timeout=120):
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_") and k != "OUT"}
    base.update({"GPU_CHECK_PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}, **(env or {}))
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=base, capture_output=True, text=True,
                          timeout=timeout)


def plan(*args, env=None):
    """The dry run's steps as (name, group, box seconds, command), in order."""
    r = run("--dry-run", *args, env=env)
    assert r.returncode == 0, r.stderr
    steps = [STEP_LINE.match(line).groups() for line in r.stdout.splitlines() if STEP_LINE.match(line)]
    assert [int(s[0]) for s in steps] == list(range(1, len(steps) + 1))
    return [(name, group, int(box), cmd) for _, name, group, box, cmd in steps], r.stdout


def make_wheel(folder, dist, module, source):
    """A minimal pure-Python wheel, enough for pip to install."""
    name = f"{dist.replace('-', '_')}-0.1"
    path = folder / f"{name}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}/__init__.py", source)
        z.writestr(f"{name}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        z.writestr(f"{name}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                              "Tag: py3-none-any\n")
        z.writestr(f"{name}.dist-info/RECORD", "")
    return path


def alive(pid):
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has ended; only its parent has not collected it


def test_without_cuda_it_stops_before_installing_or_running_anything(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "mparlib-gpu-probe", "mparlib_gpu_probe", "VALUE = 1\n")
    site, results = tmp_path / "site", tmp_path / "results"
    r = run("--results", str(results), env={"GPU_CHECK_WHEELS": str(wheels), "GPU_CHECK_SITE": str(site)})
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == ""
    assert r.stderr.startswith("gpu_check: no CUDA GPU here: ")
    assert "torch.cuda.is_available() is False" in r.stderr
    assert "stopped before installing or running anything" in r.stderr
    assert not site.exists() and not results.exists()


def test_a_missing_python_is_named_and_also_stops_the_check(tmp_path):
    r = run("--results", str(tmp_path / "results"), env={"GPU_CHECK_PYTHON": str(tmp_path / "no-python")})
    assert r.returncode == 2
    assert f"no Python at '{tmp_path / 'no-python'}'" in r.stderr
    assert not (tmp_path / "results").exists()


def test_the_dry_run_lists_the_steps_in_order_with_their_time_boxes(tmp_path):
    steps, text = plan("--results", str(tmp_path / "r"))
    names = [s[0] for s in steps]
    later_benchmarks = [f"bench-{b}" for b in ("collectives", "sharding", "pipeline")
                        if (ROOT / "benchmarks" / f"{b}.py").exists()]
    others = [f"nb-{p.stem[:2]}" for p in sorted((ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py"))
              if p.stem[:2] not in ("05", "07")]
    assert names == (["install", "env", "pytest", "bench-train-throughput", "bench-train-tta", "bench-ddp"]
                     + later_benchmarks + ["nb-05", "nb-07"] + others)
    groups = {s[0]: s[1] for s in steps}
    assert [groups[n] for n in ("install", "env", "pytest", "bench-ddp", "nb-05", "nb-07")] == [
        "checks", "checks", "checks", "benchmarks", "notebooks", "notebooks"]
    assert {groups[n] for n in others} <= {"notebooks-other"}
    assert all(box > 0 for _, _, box, _ in steps)
    # the whole run ends inside one command on the GPU machine (600 s): the budget, plus a step's grace after
    # SIGTERM
    budget = int(re.search(r"in a budget of (\d+) s", text).group(1))
    assert 0 < budget <= DEVICE_CALL_LIMIT_S - 25
    assert not (tmp_path / "r").exists()

    cmd = {s[0]: s[3] for s in steps}
    assert "--no-index --no-deps" in cmd["install"] and "--target" in cmd["install"]
    assert re.search(r"-m pytest -m gpu -p no:cacheprovider .*--junitxml=\S+ tests$", cmd["pytest"])
    assert "--continue-on-collection-errors" in cmd["pytest"]
    tput, tta = cmd["bench-train-throughput"], cmd["bench-train-tta"]
    assert "benchmarks/train_throughput.py --only throughput --out benchmarks/results/" in tput
    assert "benchmarks/train_throughput.py --only time-to-accuracy --out benchmarks/results/" in tta
    assert tput.split("--out ")[1] != tta.split("--out ")[1]
    assert cmd["bench-ddp"].endswith("benchmarks/ddp_throughput.py")
    for n, chapter in [("nb-05", "05_multi_gpu_resnet"), ("nb-07", "07_performance")]:
        assert cmd[n].startswith("MPARLIB_PROFILE=full ") and cmd[n].endswith(f"tools/notebooks.py build {chapter}")


def test_time_boxes_and_the_budget_can_be_set(tmp_path):
    steps, text = plan("--budget", "300", env={"GPU_CHECK_BOX_NB_05": "77"})
    assert "in a budget of 300 s" in text
    assert dict((s[0], s[2]) for s in steps)["nb-05"] == 77
    r = run("--dry-run", env={"GPU_CHECK_BOX_PYTEST": "soon"})
    assert r.returncode == 2 and "GPU_CHECK_BOX_PYTEST must be whole seconds" in r.stderr


def test_only_selects_steps_and_groups_but_always_installs(tmp_path):
    r = run("--dry-run", "--only", "nb-05,benchmarks")
    assert r.returncode == 0
    chosen = [m.group(2) for m in map(STEP_LINE.match, r.stdout.splitlines())
              if m and not m.group(5).endswith("(not selected)")]
    assert chosen[:2] == ["install", "env"] and "nb-05" in chosen and "bench-ddp" in chosen
    assert "pytest" not in chosen and "nb-07" not in chosen
    r = run("--dry-run", "--only", "nb-99")
    assert r.returncode == 2 and "no step or group 'nb-99'" in r.stderr


@pytest.mark.slow
def test_results_go_to_out_as_a_few_archives_and_a_failing_or_hanging_step_does_not_stop_the_next(tmp_path):
    wheels, site, out = tmp_path / "wheels", tmp_path / "site", tmp_path / "out"
    wheels.mkdir()
    out.mkdir()
    make_wheel(wheels, "mparlib-gpu-probe", "mparlib_gpu_probe", "VALUE = 42\n")
    (wheels / "pytest-0.0-py3-none-any.whl").write_text("never opened: pytest is installed here")
    leftover = tmp_path / "leftover.pid"
    stand_in = tmp_path / "python"  # runs everything with this Python, except the benchmarks
    stand_in.write_text(f"""#!/bin/sh
case "$1" in
  benchmarks/ddp_throughput.py)  # outlives its box and leaves a process behind in a session of its own
    setsid sleep 300 </dev/null >/dev/null 2>&1 &
    echo $! > {leftover}
    exec sleep 300 ;;
  benchmarks/*.py) echo "stand-in: this benchmark fails" >&2; exit 3 ;;
esac
exec {sys.executable} "$@"
""")
    stand_in.chmod(0o755)
    r = run("--no-cuda-check", "--only", "benchmarks",
            env={"OUT": str(out), "GPU_CHECK_PYTHON": str(stand_in), "GPU_CHECK_WHEELS": str(wheels),
                 "GPU_CHECK_SITE": str(site), "GPU_CHECK_BOX_BENCH_DDP": "3",
                 "GPU_CHECK_KERNEL": "mparlib-gpu-check-probe"})
    assert r.returncode == 1, (r.stdout, r.stderr)
    summary = json.loads((out / "summary.json").read_text())
    status = {s["name"]: s for s in summary["steps"]}
    assert summary["finished"] and not summary["all_ok"] and summary["packed"]

    assert status["install"]["status"] == "ok", (out / "summary.txt").read_text()
    assert (site / "mparlib_gpu_probe" / "__init__.py").read_text() == "VALUE = 42\n"
    assert status["env"]["status"] == "ok"
    assert str(site) in summary["versions"]["pythonpath"].split(":")  # later steps import the carried packages
    # a kernel the notebooks need and Jupyter does not know is registered beside the wheels, for the later steps
    kernels = site / "jupyter" / "share" / "jupyter"
    spec = json.loads((kernels / "kernels" / "mparlib-gpu-check-probe" / "kernel.json").read_text())
    assert Path(spec["argv"][0]).exists() and "ipykernel_launcher" in spec["argv"]
    assert "kernel 'mparlib-gpu-check-probe' registered" in status["install"]["note"]
    assert str(kernels) in summary["versions"]["jupyter_path"].split(":")
    assert status["pytest"]["status"] == "not selected" and status["nb-05"]["status"] == "not selected"

    for name in ("bench-train-throughput", "bench-train-tta"):
        assert (status[name]["status"], status[name]["rc"]) == ("failed", 3)
    ddp = status["bench-ddp"]
    assert (ddp["status"], ddp["timeout_s"]) == ("timeout", 3)
    assert "ended 1 process(es) it left running" in ddp["note"]
    assert not alive(int(leftover.read_text()))

    # at most 8 files come back from the GPU machine: the summaries and one archive per group that ran
    assert sorted(p.name for p in out.iterdir()) == ["benchmarks.tar.gz", "checks.tar.gz", "summary.json",
                                                     "summary.txt"]
    with tarfile.open(out / "checks.tar.gz") as tar:
        members = set(tar.getnames())
        log = tar.extractfile("gpu-results/install/log.txt").read().decode()
    assert {"gpu-results/install/log.txt", "gpu-results/env/versions.json"} <= members
    assert "already installed: pytest" in log and "installing 1 wheel(s)" in log
    with tarfile.open(out / "benchmarks.tar.gz") as tar:
        log = tar.extractfile("gpu-results/bench-train-tta/log.txt").read().decode()
    assert "stand-in: this benchmark fails" in log
    text = (out / "summary.txt").read_text()
    assert re.search(r"bench-ddp\s+timeout\s+\d+\s+3 ", text)


def test_an_exhausted_budget_skips_the_steps_and_says_so(tmp_path):
    results = tmp_path / "results"
    r = run("--no-cuda-check", "--budget", "30", "--results", str(results))
    assert r.returncode == 1
    steps = json.loads((results / "summary.json").read_text())["steps"]
    assert {s["status"] for s in steps} == {"skipped"}
    assert all(s["note"] == "no time left in the 30 s budget" for s in steps)


def test_a_results_folder_with_other_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    r = run("--no-cuda-check", "--results", str(tmp_path))
    assert r.returncode == 2 and "was not written by this script" in r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def wheel_lists():
    out = subprocess.run(["bash", str(WHEELS_SCRIPT), "--list-all"], capture_output=True, text=True, check=True)
    lists = {"carried": set(), "on-machine": set(), "not-carried": set()}
    for line in out.stdout.splitlines():
        kind, spec = line.split()
        lists[kind].add(spec.split("==")[0].lower().replace("_", "-"))
    return lists


def test_every_package_of_the_course_is_carried_on_the_gpu_machine_or_left_out_on_purpose():
    lists = wheel_lists()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    names = {re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}
    placed = lists["carried"] | lists["on-machine"] | lists["not-carried"]
    assert names <= placed, names - placed
    assert "d2l" in lists["carried"] and not lists["carried"] & {"torch", "torchvision"}
    assert not lists["carried"] & lists["on-machine"]


def test_the_downloaded_wheels_bring_every_dependency_they_declare():
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if not wheels:
        pytest.skip("no .whl folder here: bash tools/gpu_wheels.sh downloads it")
    from packaging.requirements import Requirement

    lists = wheel_lists()
    known = lists["carried"] | lists["on-machine"] | lists["not-carried"]
    marker_env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                  "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
                  "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    seen = {}
    for path in wheels:
        name = path.name.split("-")[0].lower().replace("_", "-")
        assert name not in seen, f"two wheels of {name}: {seen[name]}, {path.name}"
        seen[name] = path.name
        if name == "d2l":  # installed without its pins, as `make install` does
            continue
        with zipfile.ZipFile(path) as z:
            meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        for line in meta.splitlines():
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1])
                if req.marker is None or req.marker.evaluate(marker_env):
                    assert req.name.lower().replace("_", "-") in known, f"{path.name} needs {req}"
    assert set(seen) == lists["carried"]
