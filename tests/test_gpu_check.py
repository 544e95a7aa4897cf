"""tools/gpu_check.sh, the time-boxed check of every GPU path, tried on a machine without a GPU.

Without CUDA it must stop at once (exit code 2) before installing or running anything; its plan (order, time boxes,
commands, reports, the runs it splits into) is read from its dry run; and its step machinery (installing carried
wheels, a failing step, a step that outlives its time box, a pytest stopped at its box, packing the results) runs
for real with `--no-cuda-check`, with a stand-in Python that fails, hangs or plays nbval in place of the real ones.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import nbformat
import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
WHEELS_SCRIPT = ROOT / "tools" / "gpu_wheels.sh"
STEP_LINE = re.compile(r"^\s*(\d+) (\S+)\s+(\S+)\s+box\s+(\d+) s  (.*)$")
RUN_LINE = re.compile(r"^  about (\d+) s: bash tools/gpu_check.sh (?:--budget \d+ )?--only (\S+)$")
DEVICE_CALL_LIMIT_S = 600  # the GPU machine's limit for one command
CHAPTERS = [p.stem for p in sorted((ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py"))]


def run(*args, env=None, timeout=120, script=SCRIPT):
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_") and k != "OUT"}
    base.update({"GPU_CHECK_PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}, **(env or {}))
    return subprocess.run(["bash", str(script), *args], cwd=ROOT, env=base, capture_output=True, text=True,
                          timeout=timeout)


def plan(*args, env=None, script=SCRIPT):
    """The dry run's steps as (name, group, box seconds, command), in order."""
    r = run("--dry-run", *args, env=env, script=script)
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


NBVAL_JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest" \
errors="0" failures="1" skipped="0" tests="3" time="2.3">
<testcase classname="notebooks.en.00_setup.ipynb" name="Cell 0" time="1.5" />
<testcase classname="notebooks.en.00_setup.ipynb" name="Cell 1" time="0.5"><failure message="x">x</failure></testcase>
<testcase classname="notebooks.en.01_dataparallel.ipynb" name="Cell 0" time="0.2" />
</testsuite></testsuites>"""


def alive(pid):
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has ended; only its parent has not collected it


@pytest.mark.slow
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
    groups = {s[0]: s[1] for s in steps}
    benchmarks = ["bench-train-throughput", "bench-train-tta", "bench-ddp", "bench-collectives", "bench-sharding",
                  "bench-pipeline"]
    rebuilds = [n for n in names if n.startswith("nb-")]
    assert names == ["install", "env", "pytest", "nbval-en"] + benchmarks + ["nbval-ja"] + rebuilds
    # every chapter is rebuilt once; 05 and 07 (group notebooks) before the others (as time allows)
    assert sorted(rebuilds) == sorted(f"nb-{c[:2]}" for c in CHAPTERS)
    assert rebuilds[:2] == ["nb-05", "nb-07"] and {groups[n] for n in rebuilds[2:]} == {"notebooks-other"}
    assert [groups[n] for n in ("install", "env", "pytest", "nbval-en", "bench-ddp", "nbval-ja", "nb-05")] == [
        "checks", "checks", "checks", "nbval", "benchmarks", "nbval", "notebooks"]
    assert all(box > 0 for _, _, box, _ in steps)
    # the whole run ends inside one command on the GPU machine (600 s): the budget, plus a step's grace after
    # SIGTERM
    budget = int(re.search(r"in a budget of (\d+) s", text).group(1))
    assert 0 < budget <= DEVICE_CALL_LIMIT_S - 25
    assert not (tmp_path / "r").exists()

    cmd = {s[0]: s[3] for s in steps}
    assert "--no-index --no-deps" in cmd["install"] and "--target" in cmd["install"] and " nbval " in cmd["install"]
    assert re.search(r"-m pytest -m gpu -p no:cacheprovider .*--junitxml=\S+ tests$", cmd["pytest"])
    assert "--continue-on-collection-errors" in cmd["pytest"] and "--ignore=tests/e2e" in cmd["pytest"]
    tput, tta = cmd["bench-train-throughput"], cmd["bench-train-tta"]
    assert "benchmarks/train_throughput.py --only throughput --out benchmarks/results/" in tput
    assert "benchmarks/train_throughput.py --only time-to-accuracy --out benchmarks/results/" in tta
    assert tput.split("--out ")[1] != tta.split("--out ")[1]
    assert cmd["bench-ddp"].endswith("benchmarks/ddp_throughput.py")
    for b in ("collectives", "sharding", "pipeline"):
        assert cmd[f"bench-{b}"].endswith(f"benchmarks/{b}.py --quick")
    for n, chapter in [("nb-05", "05_multi_gpu_resnet"), ("nb-07", "07_performance")]:
        assert cmd[n].startswith("MPARLIB_PROFILE=full ") and cmd[n].endswith(f"tools/notebooks.py build {chapter}")


def test_nbval_runs_the_readmes_command_over_each_edition_before_any_notebook_is_rebuilt(tmp_path):
    results = tmp_path / "r"
    steps, text = plan("--results", str(results))
    names = [s[0] for s in steps]
    cmd = {s[0]: s[3] for s in steps}
    recipe = re.search(r"^test:.*\n\t\$\(PY\) -m pytest (.*) \$\(PYTEST_ARGS\)$", (ROOT / "Makefile").read_text(),
                       re.M).group(1)
    assert recipe == "--nbval --nbval-current-env --nbval-sanitize-with tests/sanitize.cfg -p no:cacheprovider"
    for lang in ("en", "ja"):
        nbval = cmd[f"nbval-{lang}"]
        # the profile a GPU machine gets by default (mparlib.profile(): full with a GPU), not the caller's
        assert nbval.startswith("env -u MPARLIB_PROFILE ") and "MPARLIB_PROFILE=" not in nbval
        assert f"-m pytest {recipe} " in nbval and nbval.endswith(f" notebooks/{lang}")
        assert re.search(r"--junitxml=\S+junit.xml", nbval)
        assert f"     report: {results}/nbval-{lang}/junit.xml; its pytest summary line and counts in " \
               f"{results}/summary.txt" in text.splitlines()
        assert names.index(f"nbval-{lang}") < min(i for i, n in enumerate(names) if n.startswith("nb-"))
    assert names.index("nbval-en") < names.index("nbval-ja")
    box = {s[0]: s[2] for s in steps}
    assert box["nbval-en"] == box["nbval-ja"] > box["nb-05"] // 2 + box["nb-07"] // 2
    r = run("--dry-run", "--archive", "--results", str(results))
    assert f"     report: gpu-results/nbval-en/junit.xml in {results}/nbval.tar.gz; its pytest summary line" in r.stdout


def runs_of(text):
    """The dry run's split into runs: (seconds, [step or group, ...]) in order."""
    return [(int(m.group(1)), m.group(2).split(",")) for m in map(RUN_LINE.match, text.splitlines()) if m]


def test_a_plan_longer_than_the_budget_is_split_into_runs_that_each_fit(tmp_path):
    steps, text = plan()
    budget = int(re.search(r"in a budget of (\d+) s", text).group(1))
    runs = runs_of(text)
    assert len(runs) > 1 and all(seconds <= budget - 25 for seconds, _ in runs)
    assert runs[0][1] == ["checks", "nbval-en"] and ["benchmarks"] in [r[1] for r in runs]
    groups = {}
    for name, group, _, _ in steps:
        groups.setdefault(group, []).append(name)
    ran = [n for _, only in runs for w in only for n in (groups[w] if w in groups else [w])]
    assert ran == [s[0] for s in steps]  # every step once, in the plan's order (nbval before the rebuilds)
    assert "note: nbval-en's box of" in text  # the box one run cannot hold is said
    # each suggested run is a plan that fits the budget by itself
    for seconds, only in runs:
        sub, sub_text = plan("--only", ",".join(only))
        assert not runs_of(sub_text)
    steps, text = plan("--only", "nb-05")
    assert not runs_of(text)
    r = run("--dry-run", "--budget", "1200", "--only", "nbval")
    boxes = {s[0]: s[2] for s in plan()[0]}
    box = boxes["install"] + boxes["env"] + boxes["nbval-en"]  # the run always installs and records the environment
    assert f"  about {box} s: bash tools/gpu_check.sh --budget 1200 --only nbval-en" in r.stdout.splitlines()


def copy_of_the_script(tmp_path, chapters):
    """The script in a tree of its own, with these chapters in notebooks/src."""
    (tmp_path / "tools").mkdir()
    script = tmp_path / "tools" / "gpu_check.sh"
    shutil.copy(SCRIPT, script)
    shutil.copy(ROOT / "tools" / "notebooks.py", tmp_path / "tools")  # names the notebook kernel
    (tmp_path / "notebooks" / "src").mkdir(parents=True)
    for c in chapters:
        (tmp_path / "notebooks" / "src" / f"{c}.py").write_text("# %%\n")
    return script


def test_a_new_chapter_is_one_line_in_the_chapter_table(tmp_path):
    script = copy_of_the_script(tmp_path, CHAPTERS + ["13_new_chapter"])
    r = run("--dry-run", script=script)
    assert r.returncode == 2
    assert "notebooks/src/13_new_chapter.py has no line in CHAPTERS of" in r.stderr and "add one" in r.stderr
    before = {s[0]: s[2] for s in plan(script=SCRIPT)[0]}
    text = script.read_text()
    last = re.search(r"^12_planning .*$", text, re.M).group(0)
    script.write_text(text.replace(last, last + "\n13_new_chapter           40 notebooks-other", 1))
    steps, _ = plan(script=script)
    after = {s[0]: s[2] for s in steps}
    assert [s[0] for s in steps][-1] == "nb-13" and after["nb-13"] > 2 * 40
    nb_start = int(re.search(r"NB_START=(\d+)", text).group(1))
    assert after["nbval-en"] == after["nbval-ja"] == before["nbval-en"] + 40 + nb_start
    (tmp_path / "notebooks" / "src" / "03_primitives.py").unlink()  # a line without its chapter is refused too
    r = run("--dry-run", script=script)
    assert r.returncode == 2 and "names 03_primitives, but there is no notebooks/src/03_primitives.py" in r.stderr


def test_each_benchmark_step_uses_a_script_and_flags_that_exist():
    steps, _ = plan()
    for name, _, _, command in steps:
        if not name.startswith("bench-"):
            continue
        path = re.search(r"(benchmarks/\w+\.py)", command).group(1)
        source = (ROOT / path).read_text()
        for flag in re.findall(r"(?<= )--[\w-]+", command):
            assert f'"{flag}"' in source, (name, flag)
        for value in re.findall(r"--only (\S+)", command):
            assert f'"{value}"' in source, (name, value)


@pytest.mark.slow
def test_a_pytest_step_stopped_at_its_box_keeps_the_junit_xml_of_what_it_finished(tmp_path):
    (tmp_path / "test_probe.py").write_text("import time\n\n\ndef test_quick():\n    pass\n\n\n"
                                             "def test_slow():\n    time.sleep(120)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    env["GPU_CHECK_PYTHON"] = sys.executable
    junit = tmp_path / "junit.xml"
    r = subprocess.run(["timeout", "--kill-after=20", "8", "bash", str(SCRIPT), "--internal-step", "pytest",
                        str(tmp_path), "-p", "no:cacheprovider", f"--junitxml={junit}", str(tmp_path / "test_probe.py")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 124, (r.stdout, r.stderr)
    assert "KeyboardInterrupt" in r.stdout and re.search(r"=+ 1 passed in [\d.]+s", r.stdout)
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase") if c.get("name")}
    assert list(cases) == ["test_quick"] and cases["test_quick"].find("failure") is None


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
    stand_in = tmp_path / "python"  # runs everything with this Python, except the benchmarks and nbval
    stand_in.write_text(f"""#!/bin/sh
case " $* " in
  *" --nbval "*)  # plays nbval over notebooks/en: two notebooks, one failed cell, pytest's last line, then its box
    for a in "$@"; do case $a in --junitxml=*) junit=${{a#--junitxml=}} ;; esac; done
    echo "stand-in nbval, MPARLIB_PROFILE=${{MPARLIB_PROFILE-unset}}"
    cat >"$junit" <<'XML'
{NBVAL_JUNIT}
XML
    echo "==================== 1 failed, 2 passed in 2.00s ===================="
    exec sleep 300 ;;
esac
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
    r = run("--no-cuda-check", "--only", "benchmarks,nbval-en",
            env={"OUT": str(out), "GPU_CHECK_PYTHON": str(stand_in), "GPU_CHECK_WHEELS": str(wheels),
                 "MPARLIB_PROFILE": "smoke",
                 "GPU_CHECK_SITE": str(site), "GPU_CHECK_BOX_BENCH_DDP": "3", "GPU_CHECK_BOX_NBVAL_EN": "4",
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

    nbval = status["nbval-en"]
    assert (nbval["status"], nbval["timeout_s"]) == ("timeout", 4)
    assert nbval["pytest_summary"] == "1 failed, 2 passed in 2.00s"
    code_cells = {name: sum(c.cell_type == "code" for c in nbformat.read(ROOT / "notebooks" / "en" / name, 4).cells)
                  for name in ("00_setup.ipynb", "01_dataparallel.ipynb")}
    assert nbval["tests"]["notebooks"] == {
        "00_setup.ipynb": {"cells": 2, "failed": 1, "seconds": 2.0, "of": code_cells["00_setup.ipynb"]},
        "01_dataparallel.ipynb": {"cells": 1, "failed": 0, "seconds": 0.2, "of": code_cells["01_dataparallel.ipynb"]}}
    assert nbval["tests"]["not_reached"] == sorted(p.name for p in (ROOT / "notebooks" / "en").glob("*.ipynb"))[2:]
    assert nbval["tests"]["failed"] == ["notebooks.en.00_setup.ipynb::Cell 1"]

    # at most 8 files come back from the GPU machine: the summaries and one archive per group that ran
    assert sorted(p.name for p in out.iterdir()) == ["benchmarks.tar.gz", "checks.tar.gz", "nbval.tar.gz",
                                                     "summary.json", "summary.txt"]
    with tarfile.open(out / "checks.tar.gz") as tar:
        members = set(tar.getnames())
        log = tar.extractfile("gpu-results/install/log.txt").read().decode()
    assert {"gpu-results/install/log.txt", "gpu-results/env/versions.json"} <= members
    assert "already installed: pytest" in log and "installing 1 wheel(s)" in log
    with tarfile.open(out / "benchmarks.tar.gz") as tar:
        log = tar.extractfile("gpu-results/bench-train-tta/log.txt").read().decode()
    assert "stand-in: this benchmark fails" in log
    with tarfile.open(out / "nbval.tar.gz") as tar:
        log = tar.extractfile("gpu-results/nbval-en/log.txt").read().decode()
        assert "gpu-results/nbval-en/junit.xml" in tar.getnames()
    assert "stand-in nbval, MPARLIB_PROFILE=unset" in log  # the profile a GPU machine gets by default
    text = (out / "summary.txt").read_text()
    assert re.search(r"bench-ddp\s+timeout\s+\d+\s+3 ", text)
    assert "nbval-en: 3 tests, 1 failed, 0 errors, 0 skipped (pytest: 1 failed, 2 passed in 2.00s)" in text
    assert f"  00_setup.ipynb: 2 of {code_cells['00_setup.ipynb']} cells, 1 failed, 2 s" in text.splitlines()
    assert f"  01_dataparallel.ipynb: 1 of {code_cells['01_dataparallel.ipynb']} cells, 0 failed, 0 s (stopped here " \
           "at the time box)" in text.splitlines()
    assert "  not reached: 02_wrapped_attributes.ipynb, " in text


def test_an_exhausted_budget_skips_the_steps_and_says_so(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "console.txt").write_text("")  # what `... | tee "$OUT/console.txt"` has opened before the script runs
    r = run("--no-cuda-check", "--budget", "30", "--results", str(results))
    assert r.returncode == 1, r.stderr
    assert (results / "console.txt").exists()
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
