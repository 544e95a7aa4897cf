# Two commands for learners: `make lab` and `make test`. Everything else is for maintainers and instructors.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mparlib-installed
HOST   ?= 127.0.0.1
PORT   ?= 8888
PYTEST_ARGS ?=

.PHONY: lab test test-quick install notebooks check-notebooks book serve-book bench clean-book

# (Re)install only when the venv is new or pyproject.toml changed: a second `make` installs nothing.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "mparlib needs Python 3.10 or newer; found " + sys.version.split()[0])'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[course,test]'
	$(PY) -m pip install --no-deps d2l==1.0.3
	$(PY) -m ipykernel install --sys-prefix --name mparlib --display-name "Python (mparlib)"
	@touch $(STAMP)

install: $(STAMP)

# JupyterLab on this machine only, with token authentication (the URL with the token is printed and opened in
# the browser). tests/e2e starts it with the same command.
lab: $(STAMP)
	$(PY) tools/lab.py --host '$(HOST)' --port '$(PORT)'

# Unit tests, the browser tests, and nbval over every stored notebook in both languages.
test: $(STAMP)
	$(PY) -m pytest --nbval --nbval-current-env --nbval-sanitize-with tests/sanitize.cfg -p no:cacheprovider $(PYTEST_ARGS)

# The inner loop: the unit tests without nbval, the browsers and the tests marked slow (every multi-process test,
# and any other that takes a second or more on 2 CPU cores). `make test` stays the whole suite and is what CI runs.
QUICK_MARKS ?= not slow and not e2e and not browser and not gpu
test-quick: $(STAMP)
	$(PY) -m pytest -p no:cacheprovider -m '$(QUICK_MARKS)' tests $(PYTEST_ARGS)

# Rebuild the notebooks from notebooks/src and execute them (NAMES="01_dataparallel" for one chapter).
notebooks: $(STAMP)
	$(PY) tools/notebooks.py build $(NAMES)

check-notebooks: $(STAMP)
	$(PY) tools/notebooks.py check

# The course as a static bilingual book from the stored notebooks: site/en, site/ja (Pagefind search) and
# site/index.html, every page sanitized and with a Content-Security-Policy. EXECUTE=1 re-executes every notebook
# first; SITE_URL=/course/ when site/ is hosted under a sub-path (slashes are added where missing). The builder
# is tools/book.py (with tools/book_*.py); it imports neither torch nor the course package.
EXECUTE   ?= 0
SITE_URL  ?= /
BOOK_PORT ?= 8000

book: $(STAMP)
	@if [ "$(EXECUTE)" = 1 ]; then $(PY) tools/notebooks.py build; fi
	$(PY) tools/book.py build --site-url '$(SITE_URL)'

# The built book on this machine only (Pagefind's search needs http, not file://).
serve-book: book
	$(PY) tools/book.py serve --host $(HOST) --port $(BOOK_PORT)

clean-book:
	$(PY) tools/book.py clean

# Speed claims, measured as ratios within one run; each script writes JSON to benchmarks/results/.
bench: $(STAMP)
	$(PY) benchmarks/data_iterators.py
	$(PY) benchmarks/parallel_overhead.py
	$(PY) benchmarks/ddp_throughput.py
	$(PY) benchmarks/train_throughput.py
	$(PY) benchmarks/launch_start.py
	$(PY) benchmarks/check_overhead.py
	$(PY) benchmarks/collectives.py
	$(PY) benchmarks/sharding.py
	$(PY) benchmarks/pipeline.py
	$(PY) benchmarks/long_context.py
	$(PY) benchmarks/planner.py

# On a machine with a CUDA GPU: every GPU path once in about 10 minutes (the GPU tests, the benchmarks' GPU modes,
# the chapters in the full profile), results in gpu-results/; without a GPU it stops at once with exit code 2.
# Needs no venv (a GPU machine without network has none): GPU_CHECK_ARGS="--dry-run" prints the plan.
.PHONY: gpu-check
gpu-check:
	bash tools/gpu_check.sh $(GPU_CHECK_ARGS)
