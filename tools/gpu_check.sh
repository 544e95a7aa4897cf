#!/usr/bin/env bash
# Run every GPU path of the course once, on a machine with a CUDA GPU and no network, in time-boxed steps:
#
#   1. install   the packages the course needs that the machine lacks, from wheels carried in .whl/
#   2. env       nvidia-smi and the versions of Python, torch, CUDA, cuDNN, NCCL and the course's packages
#   3. pytest    every GPU-marked test: pytest -m gpu (JUnit XML in the results)
#   4. nbval-en  the stored English notebooks, as committed, under nbval as `make test` runs it, in the profile a
#                GPU machine gets by default (MPARLIB_PROFILE unset: full): what a GPU runner checks. JUnit XML,
#                and in summary.txt its line and each notebook's cells, failures and seconds
#   5. bench-*   benchmarks/train_throughput.py (speed-up, TFLOP/s against the measured bf16 peak; time to 0.91
#                test accuracy), benchmarks/ddp_throughput.py (DataParallel vs DDP with nccl), collectives.py,
#                sharding.py and pipeline.py (with one GPU these three use gloo on the CPU: --quick by default)
#   6. nbval-ja  the Japanese edition likewise: the same code as the English one, so it comes second. Both
#                nbval steps come before every step that re-executes a notebook and writes over the stored one
#   7. nb-05, nb-07   chapters 05 and 07 rebuilt in the full profile (both editions, written to notebooks/), then
#                the other chapters as time allows
#   8. summary.json and summary.txt: each step's status, duration, time box and outputs; nvidia-smi; versions
#
# Each step runs under `timeout`: it gets its time box or the time left before the budget runs out, whichever is
# shorter, and a step that fails or runs out of time is recorded and the next one starts. A pytest step stopped at
# its time box ends as after Ctrl-C: its JUnit XML still holds every test it finished. The chapters' boxes come
# from one table (CHAPTERS below: one line per chapter). All steps together need more than one budget of 570 s:
# a run does them in this order until its budget is spent, and --dry-run says how to split the plan into runs
# that each fit (--only). On a machine where torch sees no CUDA GPU the script stops at once, before installing
# or running anything, with exit code 2.
#
#   bash tools/gpu_check.sh                # everything, as far as the budget goes (also: make gpu-check)
#   bash tools/gpu_check.sh --dry-run      # print the steps, their time boxes, commands and reports; run nothing
#   bash tools/gpu_check.sh --only nb-05,nb-07     # install and env, then only these steps (or groups)
#
# Options: --results DIR (default: $OUT if set, else gpu-results/), --budget SECONDS (default 570),
#   --only STEP,... (step names or groups: checks, nbval, benchmarks, notebooks, notebooks-other), --archive /
#   --no-archive (pack the results into one .tar.gz per group; default: packed when the results go to $OUT),
#   --no-cuda-check (run the steps without a GPU: to try this script itself; GPU tests then skip).
# Environment: GPU_CHECK_PYTHON (default .venv/bin/python if it exists, else python3), GPU_CHECK_BUDGET (570),
#   GPU_CHECK_WHEELS (.whl), GPU_CHECK_SITE (/tmp/mparlib-site: where the wheels are installed, and where the
#   notebook kernel of tools/notebooks.py is registered when Jupyter lacks it; GPU_CHECK_KERNEL names another),
#   GPU_CHECK_DATA (.data/fashion-mnist, used as MPARLIB_DATA unless that is set), GPU_CHECK_BOX_<STEP> (a step's
#   time box in seconds, e.g. GPU_CHECK_BOX_NB_05=300), GPU_CHECK_ARGS_<BENCHMARK> (the arguments of collectives,
#   sharding or pipeline in place of --quick, e.g. GPU_CHECK_ARGS_COLLECTIVES="--backend nccl" with 4 GPUs).
# Exit code: 0 when every step passed, 1 when one failed, ran out of time or was skipped, 2 without a GPU.
#
# Results: plain files in the results folder (RESULTS/<step>/log.txt, RESULTS/pytest/junit.xml,
#   RESULTS/nbval-en/junit.xml, RESULTS/env/nvidia-smi.txt, RESULTS/summary.json, RESULTS/summary.txt); the
#   benchmarks' JSON go to benchmarks/results/ and the executed notebooks to notebooks/en and notebooks/ja, as
#   usual. When packed (the GPU machine returns at most 8 files), RESULTS holds summary.json, summary.txt and
#   checks.tar.gz, nbval.tar.gz, benchmarks.tar.gz, notebooks.tar.gz, notebooks-other.tar.gz (with a console
#   log beside them, 8 files); each archive holds gpu-results/<step>/... and
#   the JSON and notebooks its steps wrote, under their paths in the repository, so that
#       tar -xzf RESULTS/benchmarks.tar.gz     (in the repository's top folder)
#   puts the benchmark JSON into benchmarks/results/ and the logs into gpu-results/.
#
# Preparing a GPU machine without network (here, with network): `bash tools/gpu_wheels.sh` downloads the wheels
#   for CPython 3.12 on x86-64 into .whl/ with
#       python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#         --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl NAME==VERSION ...
#   (the pinned list is in tools/gpu_wheels.sh: jupytext, nbformat, nbclient, ipykernel, IPython and their
#   dependencies, nbval, matplotlib-fontja and d2l 1.0.3; about 19 MiB), and copies Fashion-MNIST into
#   .data/fashion-mnist (30 MB). Torch 2.11 and torchvision 0.26 (its matching release) are already on that
#   machine and are never installed. This script installs every carried wheel whose project the machine's Python
#   lacks with
#       python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/mparlib-site WHEEL ...
#   puts /tmp/mparlib-site and the repository's top folder on PYTHONPATH for the steps after it, and registers
#   the kernel tools/notebooks.py asks for (ipykernel install --prefix /tmp/mparlib-site/jupyter; JUPYTER_PATH).
#   tools/notebooks.py executes both editions of a chapter before it writes either: a chapter's box must hold
#   both runs, or neither notebook is written.
#
# A GPU machine that runs one command over a copy of this tree and returns what it writes under $OUT (one H200,
# no network, at most 600 s a command): send .whl and .data along with the tree, allow 600 s, and run
#   set -o pipefail; GPU_CHECK_PYTHON=python3 bash tools/gpu_check.sh 2>&1 | tee "$OUT/console.txt"
# and for the steps that did not fit, the same with each --only line that --dry-run prints, one command each.
set -euo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
ROOT=$(cd "$(dirname "$SELF")/.." && pwd)
cd "$ROOT"

DEFAULT_BUDGET=570               # seconds of wall time for the whole run (one command there may take 600)
BUDGET=${GPU_CHECK_BUDGET:-$DEFAULT_BUDGET}
RESERVE=15                       # kept back for the summary and the archives
KILL_AFTER=10                    # a step that ignores SIGTERM at its time limit is killed this much later
MIN_STEP=20                      # a step that would get less than this (or than its box) is skipped
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.whl}
SITE=${GPU_CHECK_SITE:-/tmp/mparlib-site}
DATA=${GPU_CHECK_DATA:-$ROOT/.data/fashion-mnist}
if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
  PY=$GPU_CHECK_PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then
  PY=$ROOT/.venv/bin/python
else
  PY=python3
fi
# What the steps after `install` import: a missing one fails that step with its name.
IMPORTS="jupytext nbformat nbclient nbval jupyter_client ipykernel IPython matplotlib_inline matplotlib_fontja \
d2l.torch"
# The chapters, one line each: NAME SECONDS GROUP; a new chapter is one more line (a chapter in notebooks/src without
# one, or a line without a chapter, stops the script). SECONDS: one edition executed in the full profile on one
# H200, estimated until measured (summary.txt lists each notebook's seconds under nbval: correct the line from it).
# An edition's nbval step gets their sum plus NB_START s per notebook and PYTEST_START s; a chapter's rebuild
# (nb-NN) twice its SECONDS (both editions) plus REBUILD_START s. GROUP: notebooks (rebuilt right after nbval-ja)
# or notebooks-other (rebuilt after those, as time allows).
CHAPTERS='
00_setup                 20 notebooks-other
01_dataparallel          15 notebooks-other
02_wrapped_attributes    10 notebooks-other
03_primitives            15 notebooks-other
04_hybrid_cpu_gpu        20 notebooks-other
05_multi_gpu_resnet     100 notebooks
06_ddp                   80 notebooks-other
07_performance          180 notebooks
08_collectives           30 notebooks-other
09_sharding              90 notebooks-other
10_model_parallel        30 notebooks-other
11_sequence_context_experts 40 notebooks-other
12_planning              60 notebooks-other
'
PYTEST_START=30 NB_START=5 REBUILD_START=30
# The Jupyter kernel tools/notebooks.py executes with (`make install` registers it; a bare machine has none).
KERNEL=$(sed -n 's/^KERNEL_NAME = "\([^"]*\)".*/\1/p' "$ROOT/tools/notebooks.py" 2>/dev/null | head -n 1)
KERNEL=${GPU_CHECK_KERNEL:-${KERNEL:-python3}}

say() { printf '[gpu-check] %s\n' "$*"; }
die() { printf 'gpu_check: %s\n' "$*" >&2; exit 2; }
q() { printf '%q' "$1"; }

usage() { sed -n '2,/^set -euo pipefail$/p' "$SELF" | sed '$d; s/^# \{0,1\}//'; }

# --- the steps run inside a step's time box (the script calls itself) ---------------------------------------

# shellcheck disable=SC2317  # called as do_$2 below
do_install() {  # install the carried wheels whose project this Python lacks; then check the imports
  local dir=$1 wheels=() todo=() line
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  shopt -u nullglob
  : >"$dir/installed.txt"
  if ((${#wheels[@]} == 0)); then
    echo "no wheels in $WHEELS (bash tools/gpu_wheels.sh downloads them): nothing to install"
  else
    while IFS= read -r line; do
      case $line in
        install\ *) todo+=("${line#install }") ;;
        *) echo "$line" ;;
      esac
    done < <(env -u PYTHONPATH "$PY" - "${wheels[@]}" <<'PY'
import importlib.metadata as md
import os
import sys
for path in sys.argv[1:]:
    name = os.path.basename(path).split("-")[0]
    try:
        print(f"already installed: {name} {md.version(name)} (the carried {os.path.basename(path)} is not used)")
    except md.PackageNotFoundError:
        print(f"install {path}")
PY
    )
    if ((${#todo[@]})); then
      echo "installing ${#todo[@]} wheel(s) into $SITE"
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${todo[@]}"
      printf '%s\n' "${todo[@]##*/}" >"$dir/installed.txt"
      export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    fi
  fi
  if ! "$PY" -c 'import sys; from jupyter_client.kernelspec import KernelSpecManager as K
K().get_kernel_spec(sys.argv[1])' "$KERNEL" >/dev/null 2>&1; then
    echo "registering the Jupyter kernel '$KERNEL' in $SITE/jupyter (this Python, with PYTHONPATH)"
    "$PY" -m ipykernel install --prefix "$SITE/jupyter" --name "$KERNEL" --display-name "Python ($KERNEL)"
    echo "$SITE/jupyter/share/jupyter" >"$dir/jupyter_path.txt"
    export JUPYTER_PATH="$SITE/jupyter/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
  fi
  echo "checking imports: $IMPORTS"
  # shellcheck disable=SC2086  # one argument per module name
  GC_KERNEL=$KERNEL "$PY" - $IMPORTS <<'PY'
import importlib
import sys
missing = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as e:  # an ImportError, or a broken dependency inside the package
        missing.append(f"{name} ({type(e).__name__}: {e})")
if not missing:
    import os
    from jupyter_client.kernelspec import KernelSpecManager
    spec = KernelSpecManager().get_kernel_spec(os.environ["GC_KERNEL"])
    print(f"notebook kernel {os.environ['GC_KERNEL']}:", " ".join(spec.argv[:3]), "in", spec.resource_dir)
if missing:
    sys.exit("cannot import: " + "; ".join(missing) + ". Carry the missing wheels: bash tools/gpu_wheels.sh")
print("all imports work")
PY
}

# shellcheck disable=SC2317  # called as do_$2 below
do_env() {  # nvidia-smi (read only: settings are never changed) and versions
  local dir=$1
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi >"$dir/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed with exit code $?"
    nvidia-smi --format=csv --query-gpu=index,name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem,\
clocks.max.sm,power.limit,temperature.gpu,pstate,compute_mode >"$dir/nvidia-smi-query.csv" 2>&1 ||
      echo "nvidia-smi --query-gpu failed with exit code $?"
    cat "$dir/nvidia-smi-query.csv"
  else
    echo "nvidia-smi is not on the PATH" | tee "$dir/nvidia-smi.txt"
  fi
  "$PY" - "$dir/versions.json" "$ROOT" <<'PY'
import importlib.metadata as md
import json
import os
import platform
import subprocess
import sys

import torch

out = {"python": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
       "cpu_count": os.cpu_count(), "torch": torch.__version__, "cuda_build": torch.version.cuda,
       "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
       "pythonpath": os.environ.get("PYTHONPATH", ""), "jupyter_path": os.environ.get("JUPYTER_PATH", "")}
try:
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
except Exception as e:
    out["nccl"] = f"unavailable ({type(e).__name__}: {e})"
out["gpus"] = []
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    out["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                        "compute_capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count})
out["packages"] = {}
for name in ["torch", "torchvision", "triton", "numpy", "matplotlib", "matplotlib-fontja", "pandas", "scipy",
             "pytest", "nbformat", "nbclient", "nbval", "ipykernel", "ipython", "jupyter-client", "pyzmq", "d2l"]:
    try:
        dist = md.distribution(name)
        out["packages"][name] = {"version": dist.version, "location": str(dist.locate_file(""))}
    except md.PackageNotFoundError:
        out["packages"][name] = None
# the data set the steps get (MPARLIB_DATA: the carried .data/fashion-mnist, unless the caller set it)
folder = os.environ.get("MPARLIB_DATA")
stems = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
missing = [s for s in stems if not folder or not any(os.path.isfile(os.path.join(folder, s + x)) for x in ("", ".gz"))]
if not folder:
    out["fashion_mnist"] = "MPARLIB_DATA is not set: carry .data/fashion-mnist (bash tools/gpu_wheels.sh copies it)"
else:
    out["fashion_mnist"] = f"{folder} lacks {', '.join(missing)}" if missing else folder
try:
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=sys.argv[2], capture_output=True, text=True, timeout=10)
    out["git_commit"] = git.stdout.strip() or None
except OSError:
    out["git_commit"] = None
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=2)
    f.write("\n")
for key in ("python", "torch", "cuda_build", "cudnn", "nccl", "gpus", "fashion_mnist", "git_commit"):
    print(f"{key}: {out[key]}")
PY
}

# shellcheck disable=SC2317  # called as do_$2 below
do_pytest() {  # DIR ARGS...: pytest ARGS, where SIGTERM (the time box) ends the run as Ctrl-C does: pytest then
  # still writes its JUnit XML and summary line for the tests it finished
  shift
  exec "$PY" -c 'import signal, sys
import pytest
signal.signal(signal.SIGTERM, signal.default_int_handler)
sys.exit(pytest.main(sys.argv[1:]))' "$@"
}

if [ "${1:-}" = "--internal-step" ]; then  # the script calling itself for one of the steps above
  "do_$2" "${@:3}"
  exit
fi

# --- options ------------------------------------------------------------------------------------------------

DRY=0 CUDA_CHECK=1 ONLY="" ARCHIVE="" RESULTS=""
while (($#)); do
  case $1 in
    --dry-run) DRY=1 ;;
    --no-cuda-check) CUDA_CHECK=0 ;;
    --archive) ARCHIVE=1 ;;
    --no-archive) ARCHIVE=0 ;;
    --results) RESULTS=${2:?--results needs a folder}; shift ;;
    --results=*) RESULTS=${1#*=} ;;
    --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
    --budget=*) BUDGET=${1#*=} ;;
    --only) ONLY=${2:?--only needs step names}; shift ;;
    --only=*) ONLY=${1#*=} ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
  shift
done
[[ $BUDGET =~ ^[0-9]+$ ]] || die "--budget takes whole seconds, not '$BUDGET'"
if [ -z "$RESULTS" ]; then RESULTS=${OUT:-$ROOT/gpu-results}; fi
RESULTS=$(realpath -m "$RESULTS")
if [ -z "$ARCHIVE" ]; then
  ARCHIVE=0
  if [ -n "${OUT:-}" ] && [ "$RESULTS" = "$(realpath -m "$OUT")" ]; then ARCHIVE=1; fi
fi

# --- the plan -----------------------------------------------------------------------------------------------

S_NAME=() S_GROUP=() S_BOX=() S_CMD=() S_SHOW=() S_REPORT=()
add_step() {  # NAME GROUP BOX COMMAND [WHAT THE DRY RUN SHOWS [REPORT FILE IN THE STEP'S FOLDER]]
  local var
  var="GPU_CHECK_BOX_$(echo "$1" | tr '[:lower:]-' '[:upper:]_')"
  [[ ${!var:-$3} =~ ^[0-9]+$ ]] || die "$var must be whole seconds, not '${!var}'"
  S_NAME+=("$1") S_GROUP+=("$2") S_BOX+=("${!var:-$3}") S_CMD+=("$4") S_SHOW+=("${5:-$4}") S_REPORT+=("${6:-}")
}

CH_NAME=() CH_SEC=() CH_GROUP=()
while read -r name sec group extra; do
  [ -n "$name" ] || continue
  if ! [[ $sec =~ ^[0-9]+$ ]] || [ -n "$extra" ] || { [ "$group" != notebooks ] && [ "$group" != notebooks-other ]; }
  then
    die "CHAPTERS in $SELF: '$name $sec $group${extra:+ $extra}' is not NAME SECONDS notebooks|notebooks-other"
  fi
  [ -f "notebooks/src/$name.py" ] || die "CHAPTERS in $SELF names $name, but there is no notebooks/src/$name.py:
remove its line or correct the name."
  CH_NAME+=("$name") CH_SEC+=("$sec") CH_GROUP+=("$group")
done <<<"$CHAPTERS"
shopt -s nullglob
for src in notebooks/src/[0-9][0-9]_*.py; do
  chapter=$(basename "$src" .py)
  [[ " ${CH_NAME[*]} " == *" $chapter "* ]] || die "$src has no line in CHAPTERS of $SELF: add one
(NAME SECONDS GROUP, e.g. '$chapter 60 notebooks-other'), with the seconds one edition takes in the full profile."
done
shopt -u nullglob
per_edition=$PYTEST_START
for sec in "${CH_SEC[@]}"; do per_edition=$((per_edition + sec + NB_START)); done

P=$(q "$PY")
add_step install checks 45 "bash $(q "$SELF") --internal-step install \"\$STEP_DIR\"" \
  "$P -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $(q "$SITE") \
<each wheel in $(q "$WHEELS") whose project $P lacks>; register the Jupyter kernel '$KERNEL' if Jupyter lacks it; \
then import $IMPORTS"
add_step env checks 25 "bash $(q "$SELF") --internal-step env \"\$STEP_DIR\"" \
  "nvidia-smi > nvidia-smi.txt; nvidia-smi --query-gpu=... --format=csv; $P: versions > versions.json"
PYTEST="bash $(q "$SELF") --internal-step pytest \"\$STEP_DIR\""  # $P -m pytest ..., ending as Ctrl-C at its box
# tests/e2e drive JupyterLab in a browser (never on a GPU; jupyter_server is not carried); a test module that still
# cannot be imported there, e.g. for a package only the book needs, must not stop the others
GPU_TESTS="-m gpu -p no:cacheprovider --ignore=tests/e2e --continue-on-collection-errors -v -rfEs --durations=15 \
--junitxml=\"\$STEP_DIR/junit.xml\" tests"
add_step pytest checks 120 "$PYTEST $GPU_TESTS" "$P -m pytest $GPU_TESTS" junit.xml
# the Makefile's `make test` (README: For maintainers), one edition per step; MPARLIB_PROFILE unset, so that the
# notebooks run in the profile mparlib.profile() gives a GPU machine (full), whatever the caller's environment says
NBVAL="--nbval --nbval-current-env --nbval-sanitize-with tests/sanitize.cfg -p no:cacheprovider -rfE \
--durations=20 --junitxml=\"\$STEP_DIR/junit.xml\""
add_nbval() {  # LANG
  add_step "nbval-$1" nbval "$per_edition" "env -u MPARLIB_PROFILE $PYTEST $NBVAL notebooks/$1" \
    "env -u MPARLIB_PROFILE $P -m pytest $NBVAL notebooks/$1" junit.xml
}
add_nbval en
# shellcheck disable=SC2016  # expanded later, by the step's shell
KIND='${HOST_KIND}'  # expanded when the step runs: e.g. 1x-nvidia-h200, as the benchmark names its files
add_step bench-train-throughput benchmarks 140 "$P benchmarks/train_throughput.py --only throughput \
--out benchmarks/results/train_throughput-$KIND-throughput.json"
add_step bench-train-tta benchmarks 140 "$P benchmarks/train_throughput.py --only time-to-accuracy \
--out benchmarks/results/train_throughput-$KIND-time-to-accuracy.json"
add_step bench-ddp benchmarks 60 "$P benchmarks/ddp_throughput.py"
# nccl needs a GPU per process: with fewer GPUs than ranks these three use gloo on the CPU, so by default they
# only show that they run there (--quick); GPU_CHECK_ARGS_<NAME> gives other arguments ("" for the full run)
for b in collectives sharding pipeline; do
  var="GPU_CHECK_ARGS_${b^^}"
  args=${!var---quick}
  add_step "bench-$b" benchmarks 45 "$P benchmarks/$b.py${args:+ $args}"
done
add_nbval ja
NB="MPARLIB_PROFILE=full $P tools/notebooks.py build"
for group in notebooks notebooks-other; do
  for ((c = 0; c < ${#CH_NAME[@]}; c++)); do
    [ "${CH_GROUP[$c]}" = "$group" ] || continue
    add_step "nb-${CH_NAME[$c]%%_*}" "$group" $((2 * CH_SEC[c] + REBUILD_START)) "$NB ${CH_NAME[$c]}"
  done
done
N=${#S_NAME[@]}

SELECTED=()  # 1 for each step that runs
for ((i = 0; i < N; i++)); do SELECTED+=(1); done
if [ -n "$ONLY" ]; then
  IFS=, read -r -a wanted <<<"$ONLY"
  for w in "${wanted[@]}"; do
    known=0
    for ((i = 0; i < N; i++)); do
      if [ "$w" = "${S_NAME[$i]}" ] || [ "$w" = "${S_GROUP[$i]}" ]; then known=1; fi
    done
    ((known)) || die "--only: no step or group '$w'; steps: ${S_NAME[*]};
groups: checks nbval benchmarks notebooks notebooks-other"
  done
  for ((i = 0; i < N; i++)); do
    SELECTED[i]=0
    case ${S_NAME[$i]} in install|env) SELECTED[i]=1 ;; esac
    for w in "${wanted[@]}"; do
      if [ "$w" = "${S_NAME[$i]}" ] || [ "$w" = "${S_GROUP[$i]}" ]; then SELECTED[i]=1; fi
    done
  done
fi

by_group() {  # STEP,STEP,...: the same list, with a group's name in place of all its selected steps
  local list=",$1," g i all
  for g in checks nbval benchmarks notebooks notebooks-other; do
    all=""
    for ((i = 0; i < N; i++)); do
      if ((SELECTED[i])) && [ "${S_GROUP[$i]}" = "$g" ] && [[ $i -gt 1 ]]; then all+="${S_NAME[$i]},"; fi
    done
    if [ -n "$all" ] && [[ $list == *",$all"* ]]; then list=${list/",$all"/",$g,"}; fi
  done
  list=${list#,}
  echo "${list%,}"
}

if ((DRY)); then
  packed="plain files"
  [ "$ARCHIVE" = 1 ] && packed="packed: one .tar.gz per group"
  echo "gpu_check plan: $N steps in a budget of $BUDGET s of wall time; each step gets its box or the time left"
  echo "  minus $((RESERVE + KILL_AFTER)) s, whichever is shorter (under $MIN_STEP s: skipped); a failed or timed-out"
  echo "  step is recorded and the next one starts"
  echo "python: $PY; results: $RESULTS ($packed)"
  echo "preflight: exit 2 unless $PY sees a CUDA GPU (checked before anything is installed or run)"
  for ((i = 0; i < N; i++)); do
    mark=""
    ((SELECTED[i])) || mark=" (not selected)"
    printf '%2d %-24s %-16s box %4d s  %s%s\n' $((i + 1)) "${S_NAME[$i]}" "${S_GROUP[$i]}" "${S_BOX[$i]}" \
      "${S_SHOW[$i]}" "$mark"
    if [ -n "${S_REPORT[$i]}" ]; then
      where="$RESULTS/${S_NAME[$i]}/${S_REPORT[$i]}"
      [ "$ARCHIVE" = 1 ] && where="gpu-results/${S_NAME[$i]}/${S_REPORT[$i]} in $RESULTS/${S_GROUP[$i]}.tar.gz"
      echo "     report: $where; its pytest summary line and counts in $RESULTS/summary.txt"
    fi
  done
  echo "last: summary.json and summary.txt in $RESULTS"
  # install and env start every run; the other selected steps, in order, fill runs of this budget. A step whose
  # box no run can hold takes what is left of the current run (or a run of its own, when under half is left).
  usable=$((BUDGET - RESERVE - KILL_AFTER)) base=$((S_BOX[0] + S_BOX[1]))
  if ((usable > base)); then
    total=$base load=$base names="" runs=() notes=()
    for ((i = 2; i < N; i++)); do
      ((SELECTED[i])) || continue
      box=${S_BOX[$i]}
      total=$((total + box))
      if ((box > usable - base)); then
        if ((2 * (usable - load) < usable - base)); then runs+=("$load $names") load=$base names=""; fi
        box=$((usable - load))
        notes+=("${S_NAME[$i]}'s box of ${S_BOX[$i]} s does not fit a run of $BUDGET s: there it gets about $box s and \
stops, with the report of what it finished (a larger --budget where a command may run longer)")
      elif [ -n "$names" ] && ((load + box > usable)); then
        runs+=("$load $names") load=$base names=""
      fi
      names+="${names:+,}${S_NAME[$i]}" load=$((load + box))
    done
    [ -n "$names" ] && runs+=("$load $names")
    if ((${#runs[@]} > 1)); then
      echo "the boxes add up to $total s, more than one run of $BUDGET s holds; in runs of $BUDGET s, one command each:"
      more=""
      [ "$BUDGET" = "$DEFAULT_BUDGET" ] || more=" --budget $BUDGET"
      for r in "${runs[@]}"; do
        echo "  about ${r%% *} s: bash tools/gpu_check.sh$more --only $(by_group "${r#* }")"
      done
    fi
    for n in "${notes[@]}"; do echo "note: $n"; done
  fi
  exit 0
fi

# --- preflight: a CUDA GPU, or stop before anything else ----------------------------------------------------

HOST_KIND=cpu
if ((CUDA_CHECK)); then
  rc=0
  probe=$(timeout 120 "$PY" -c '
import sys
try:
    import torch
except Exception as e:
    print(f"{sys.executable} cannot import torch ({type(e).__name__}: {e})")
    sys.exit(3)
if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
    print(f"torch {torch.__version__} (CUDA build: {torch.version.cuda or None}) sees no CUDA GPU "
          "(torch.cuda.is_available() is False)")
    sys.exit(4)
print(torch.cuda.device_count(), torch.cuda.get_device_name(0), sep="\t")
' 2>&1) || rc=$?
  if ((rc)); then
    case $rc in
      4) why="no CUDA GPU here: ${probe##*$'\n'}" ;;
      127) why="cannot look for a CUDA GPU: no Python at '$PY' (set GPU_CHECK_PYTHON)" ;;
      124) why="cannot look for a CUDA GPU: $PY did not answer within 120 s" ;;
      *) why="cannot look for a CUDA GPU: ${probe##*$'\n'}" ;;
    esac
    die "$why.
This check runs the course's GPU paths (pytest -m gpu, the GPU benchmarks, the notebooks in the full profile)
and needs a machine with a CUDA GPU; it stopped before installing or running anything. Without a GPU,
\`make test\` runs everything else, and \`bash tools/gpu_check.sh --dry-run\` prints the plan."
  fi
  HOST_KIND=$(printf '%sx-%s' "${probe%%$'\t'*}" "${probe#*$'\t'}" | tr '[:upper:]' '[:lower:]' |
    sed 's/[^a-z0-9]\{1,\}/-/g; s/^-//; s/-$//')
  say "CUDA: ${probe#*$'\t'} (${probe%%$'\t'*} GPU(s)); host kind $HOST_KIND"
fi
export HOST_KIND

# --- the results folder -------------------------------------------------------------------------------------

# (console.txt: the console log that the command for the GPU machine above tees into the same folder)
if [ -e "$RESULTS" ] && [ -n "$(ls -A "$RESULTS" 2>/dev/null | grep -vx console.txt)" ]; then
  # refill a folder this script wrote before (its summary.json names it); never one that holds other files
  grep -qs '"tool": "tools/gpu_check.sh"' "$RESULTS/summary.json" ||
    die "$RESULTS is not empty and was not written by this script: pass --results with another folder."
  for n in "${S_NAME[@]}"; do rm -rf "${RESULTS:?}/$n"; done
  rm -f "$RESULTS"/summary.json "$RESULTS"/summary.txt "$RESULTS"/{checks,nbval,benchmarks,notebooks,notebooks-other}.tar.gz
fi
mkdir -p "$RESULTS"
if [ "$ARCHIVE" = 1 ]; then WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX"); else WORK=$RESULTS; fi
: >"$WORK/results.tsv"
for ((i = 0; i < N; i++)); do
  printf '%s\t%s\t%s\t%s\t%s\n' $((i + 1)) "${S_NAME[$i]}" "${S_GROUP[$i]}" "${S_BOX[$i]}" "${SELECTED[i]}"
done >"$WORK/plan.tsv"
for ((i = 0; i < N; i++)); do printf '%s\n' "${S_SHOW[$i]}"; done >"$WORK/commands.txt"

export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # mparlib from this tree, also where it is not installed
if [ -z "${MPARLIB_DATA:-}" ] && [ -d "$DATA" ]; then export MPARLIB_DATA=$DATA; fi
TOKEN=gpu-check-$$-$(date +%s)
STARTED=$(date +%Y-%m-%dT%H:%M:%S%z)
export GC_WORK=$WORK GC_RESULTS=$RESULTS GC_ROOT=$ROOT GC_ARCHIVE=$ARCHIVE GC_BUDGET=$BUDGET GC_STARTED=$STARTED \
  GC_PY=$PY

summary() {  # GROUP|all [final]: rewrite summary.json and summary.txt (and that group's archive when packing)
  GC_ELAPSED=$SECONDS "$PY" - "$@" <<'PY' || say "warning: the summary could not be written (exit code $?)"
import contextlib, json, os, re, sys, tarfile, time
import xml.etree.ElementTree as ET
from pathlib import Path

E = os.environ
work, results, root = Path(E["GC_WORK"]), Path(E["GC_RESULTS"]), Path(E["GC_ROOT"])
archive, group, final = E["GC_ARCHIVE"] == "1", sys.argv[1], len(sys.argv) > 2
plan = [line.split("\t") for line in (work / "plan.tsv").read_text().splitlines()]
commands = (work / "commands.txt").read_text().splitlines()
done = {}
for line in (work / "results.tsv").read_text().splitlines():
    idx, status, rc, seconds, timeout, note = (line.split("\t") + [""] * 6)[:6]
    done[idx] = {"status": status, "rc": int(rc) if rc else None, "seconds": int(seconds) if seconds else None,
                 "timeout_s": int(timeout) if timeout else None, "note": note}
running = E.get("GC_RUNNING", "")

def headline(path):
    """The numbers a reader looks for first in a benchmark's JSON."""
    try:
        r = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    h = {"benchmark": r.get("benchmark")}
    if r.get("peak_matmul_tflops"):
        h["peak_matmul_tflops"] = r["peak_matmul_tflops"]
    if r.get("throughput_goal"):
        h["throughput_goal"] = r["throughput_goal"]
        rows = [x for x in r.get("throughput", []) if "fraction_of_peak" in x]
        if rows:
            best = max(rows, key=lambda x: x["achieved_tflops"])
            h["best_tflops"] = {k: best.get(k) for k in ("config", "achieved_tflops", "fraction_of_peak", "peak_used")}
    tta = r.get("time_to_accuracy")
    if isinstance(tta, dict) and "runs" in tta:
        runs = tta["runs"].items()
        h["time_to_accuracy"] = {"target": tta.get("target"), "time_goal_met": tta.get("time_goal_met"),
                                 **{f"{k}_seconds_to_target": v.get("seconds_to_target") for k, v in runs},
                                 **{f"{k}_final_test_acc": (v.get("test_acc") or [None])[-1] for k, v in runs}}
    if r.get("rows"):
        h["rows"] = {x.get("config"): x.get("images_per_s") for x in r["rows"]}
    return h

ANSI = re.compile(r"\x1b\[[0-9;]*m")
PYTEST_END = re.compile(r"^=+ (.*\d+(?:\.\d+)?s(?: \([0-9:]+\))?) =+$")


def tests(junit, step):
    """Counts and failures from a JUnit XML; for nbval, each notebook's cells, failures and seconds, and the
    notebooks of the edition that the run did not reach (stopped at its time box)."""
    suites = ET.parse(junit).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    cases = [c for x in suites for c in x.iter("testcase") if c.get("name")]
    bad = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    t = {k: sum(int(x.get(k, 0)) for x in suites) for k in ("tests", "failures", "errors", "skipped")}
    t["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in bad][:30]
    if step.startswith("nbval-"):
        books = {}
        for c in cases:  # classname: notebooks.en.05_multi_gpu_resnet.ipynb
            b = books.setdefault(c.get("classname", "").removesuffix(".ipynb").split(".")[-1] + ".ipynb",
                                 {"cells": 0, "failed": 0, "seconds": 0.0})
            b["cells"] += 1
            b["failed"] += c in bad
            b["seconds"] = round(b["seconds"] + float(c.get("time") or 0), 1)
        edition = root / "notebooks" / step.removeprefix("nbval-")
        for nb, b in books.items():  # nbval checks each code cell: how many of them the run got to
            with contextlib.suppress(OSError, ValueError):
                b["of"] = sum(c.get("cell_type") == "code" for c in json.loads((edition / nb).read_text())["cells"])
        t["notebooks"] = books
        t["not_reached"] = sorted(p.name for p in edition.glob("*.ipynb") if p.name not in books)
    return t


steps = []
for (idx, name, grp, box, selected), command in zip(plan, commands):
    d = work / name
    s = {"index": int(idx), "name": name, "group": grp, "box_s": int(box), "command": command}
    if idx in done:
        s.update(done[idx])
    elif idx == running:
        s["status"] = "interrupted" if final else "running"
    elif selected == "0":
        s["status"] = "not selected"
    else:
        s["status"] = "not run" if final else "pending"
    log = d / "log.txt"
    if log.exists():
        s["log"] = f"gpu-results/{name}/log.txt" if archive else str(log)
    outs = (d / "outputs.txt").read_text().split() if (d / "outputs.txt").exists() else []
    s["outputs"] = outs
    junit = d / "junit.xml"
    if junit.exists():
        try:
            s["tests"] = tests(junit, name)
        except ET.ParseError as e:
            s["tests"] = {"unreadable": str(e)}
        if log.exists():  # pytest's last line, e.g. "2 failed, 40 passed in 300.12s (0:05:00)"
            ends = [m.group(1) for m in map(PYTEST_END.match, ANSI.sub("", log.read_text(errors="replace"))
                                            .splitlines()) if m]
            s["pytest_summary"] = ends[-1] if ends else None
    heads = [h for h in (headline(root / o) for o in outs if o.endswith(".json")) if h]
    if heads:
        s["headlines"] = heads
    if archive:
        s["archive"] = f"{grp}.tar.gz"
    steps.append(s)

env = work / "env"
versions = json.loads((env / "versions.json").read_text()) if (env / "versions.json").exists() else None
smi = (env / "nvidia-smi-query.csv").read_text() if (env / "nvidia-smi-query.csv").exists() else None

def pack(grp):
    members = [s for s in steps if s["group"] == grp and (work / s["name"]).exists()]
    if not members:
        return
    target = results / f"{grp}.tar.gz"
    tmp = target.with_name(target.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for s in members:
            tar.add(work / s["name"], arcname=f"gpu-results/{s['name']}",
                    filter=lambda m: None if m.name.endswith("/.started") else m)
            for o in s["outputs"]:
                if (root / o).is_file():
                    tar.add(root / o, arcname=o)
    os.replace(tmp, target)

if archive:
    for grp in sorted({s["group"] for s in steps}) if group == "all" else [group]:
        pack(grp)

bad = [s for s in steps if s["status"] not in ("ok", "not selected")]
summary = {"tool": "tools/gpu_check.sh", "started": E["GC_STARTED"], "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "finished": final, "budget_s": int(E["GC_BUDGET"]), "elapsed_s": int(E["GC_ELAPSED"]),
           "python": E["GC_PY"], "results": str(results), "packed": archive,
           "unpack": "in the repository's top folder: tar -xzf RESULTS/<group>.tar.gz" if archive else None,
           "all_ok": final and not bad, "versions": versions, "nvidia_smi": smi, "steps": steps}
if archive:
    big = [p.name for p in results.glob("*.tar.gz") if p.stat().st_size > 16 * 2**20]
    if big:
        summary["warning"] = f"over 16 MiB, which the GPU machine does not return: {big}"

def write(path, text):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)

write(results / "summary.json", json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
v = versions or {}
gpus = ", ".join(g["name"] for g in v.get("gpus", [])) or "-"
lines = [f"mparlib GPU check, started {summary['started']}, {summary['elapsed_s']} s of {summary['budget_s']} s"
         + ("" if final else " (still running)"),
         f"GPU: {gpus}; torch {v.get('torch')}, CUDA {v.get('cuda_build')}, cuDNN {v.get('cudnn')}, "
         f"NCCL {v.get('nccl')}, Python {v.get('python')}",
         f"results: {results}" + (" (tar -xzf each archive in the repository's top folder)" if archive else ""), "",
         f"{'#':>2} {'step':<24} {'status':<12} {'seconds':>7} {'box':>5}  note / outputs"]
for s in steps:
    extra = s.get("note") or ""
    if s["outputs"]:
        extra = (extra + "; " if extra else "") + ", ".join(s["outputs"])
    sec = s.get("seconds")
    lines.append(f"{s['index']:>2} {s['name']:<24} {s['status']:<12} {'' if sec is None else sec:>7} "
                 f"{s['box_s']:>5}  {extra}")
for s in steps:
    t = s.get("tests")
    if t and "tests" in t:
        lines += ["", f"{s['name']}: {t['tests']} tests, {t['failures']} failed, {t['errors']} errors, "
                      f"{t['skipped']} skipped" + (f" (pytest: {s['pytest_summary']})" if s.get("pytest_summary")
                                                   else " (no summary line from pytest)")]
        books = list(t.get("notebooks", {}).items())
        for k, (nb, b) in enumerate(books):
            stopped = s["status"] == "timeout" and k == len(books) - 1 and b["cells"] < b.get("of", 0)
            lines.append(f"  {nb}: {b['cells']}" + (f" of {b['of']}" if "of" in b else "") + f" cells, {b['failed']} "
                         f"failed, {b['seconds']:.0f} s" + (" (stopped here at the time box)" if stopped else ""))
        if t.get("not_reached"):
            lines.append(f"  not reached: {', '.join(t['not_reached'])}")
        lines += [f"  failed: {f}" for f in t["failed"]]
    for h in s.get("headlines", []):
        lines += ["", f"{s['name']}: " + json.dumps(h, ensure_ascii=False)]
if smi:
    lines += ["", "nvidia-smi:", smi.rstrip()]
if summary.get("warning"):
    lines += ["", "warning: " + summary["warning"]]
write(results / "summary.txt", "\n".join(lines) + "\n")
PY
}

record() {  # INDEX STATUS RC SECONDS TIMEOUT NOTE
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "${6//$'\t'/ }" >>"$WORK/results.tsv"
}

reap() {  # end the processes a step left behind (a notebook kernel runs in its own session), found by its token
  local tok=$1 pids=() f pid
  for f in /proc/[0-9]*/environ; do
    pid=${f#/proc/}
    pid=${pid%/environ}
    [ "$pid" = "$$" ] && continue
    if grep -qszxF "GPU_CHECK_TOKEN=$tok" "$f" 2>/dev/null; then pids+=("$pid"); fi
  done
  ((${#pids[@]})) || return 0
  kill -TERM "${pids[@]}" 2>/dev/null || true
  sleep 2
  kill -KILL "${pids[@]}" 2>/dev/null || true
  echo "${#pids[@]}"
}

CHILD="" CURRENT=""
# shellcheck disable=SC2317  # called by the trap
on_signal() {  # the run itself is being stopped: stop the step, keep what is there
  trap - TERM INT
  if [ -n "$CHILD" ]; then kill -TERM "$CHILD" 2>/dev/null || true; fi
  [ -n "$CURRENT" ] && reap "$TOKEN-$CURRENT" >/dev/null
  say "stopped by a signal during step ${CURRENT:-none}; writing the summary"
  GC_RUNNING=$CURRENT summary all final
  exit 130
}
trap on_signal TERM INT

run_step() {  # INDEX (0-based)
  local i=$1 left t rc status note="" t0 killed
  local n=$((i + 1)) name=${S_NAME[$i]} box=${S_BOX[$i]}
  local dir=$WORK/$name
  if ((!SELECTED[i])); then
    record "$n" "not selected" "" "" "" "left out by --only"
    return 0
  fi
  mkdir -p "$dir"
  left=$((BUDGET - SECONDS - RESERVE - KILL_AFTER))
  t=$((box < left ? box : left))
  if ((t < (box < MIN_STEP ? box : MIN_STEP))); then
    record "$n" skipped "" 0 "" "no time left in the $BUDGET s budget"
    say "[$n/$N] $name: skipped, no time left"
    return 0
  fi
  CURRENT=$n
  GC_RUNNING=$n summary "${S_GROUP[$i]}"
  say "[$n/$N] $name: up to $t s (box $box s)"
  touch "$dir/.started"
  t0=$SECONDS
  STEP_DIR=$dir GPU_CHECK_TOKEN=$TOKEN-$n timeout --kill-after="$KILL_AFTER" "$t" \
    bash -c "${S_CMD[$i]}" >"$dir/log.txt" 2>&1 </dev/null &
  CHILD=$!
  if wait "$CHILD"; then rc=0; else rc=$?; fi
  CHILD=""
  case $rc in
    0) status=ok ;;
    124|137) status=timeout note="stopped at its time limit of $t s" ;;
    *) status=failed note="exit code $rc" ;;
  esac
  killed=$(reap "$TOKEN-$n")
  [ -n "$killed" ] && note="${note:+$note; }ended $killed process(es) it left running"
  # what the step wrote into the tree: benchmark JSON, executed notebooks (also where they are packed from)
  { find benchmarks/results notebooks/en notebooks/ja -type f -newer "$dir/.started" ! -name '*.tmp' \
      2>/dev/null || true; } | sort >"$dir/outputs.txt"
  if [ "$name" = install ] && [ -s "$dir/installed.txt" ]; then
    export PYTHONPATH="$ROOT:$SITE${PYTHONPATH#"$ROOT"}"
    note="${note:+$note; }$(wc -l <"$dir/installed.txt") wheel(s) installed into $SITE"
  fi
  if [ "$name" = install ] && [ -s "$dir/jupyter_path.txt" ]; then
    JUPYTER_PATH="$(cat "$dir/jupyter_path.txt")${JUPYTER_PATH:+:$JUPYTER_PATH}"
    export JUPYTER_PATH
    note="${note:+$note; }kernel '$KERNEL' registered"
  fi
  record "$n" "$status" "$rc" $((SECONDS - t0)) "$t" "$note"
  CURRENT=""
  say "[$n/$N] $name: $status in $((SECONDS - t0)) s${note:+ ($note)}"
  if [ "$status" != ok ]; then tail -n 12 "$dir/log.txt" | sed 's/^/    | /'; fi
  summary "${S_GROUP[$i]}"
}

say "results: $RESULTS$([ "$ARCHIVE" = 1 ] && echo " (packed)"); python: $PY; budget $BUDGET s"
for ((i = 0; i < N; i++)); do run_step "$i"; done
summary all final
echo
cat "$RESULTS/summary.txt"
if grep -q '"all_ok": true' "$RESULTS/summary.json"; then exit 0; fi
exit 1
