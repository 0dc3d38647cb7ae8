# Two commands for a newcomer: `make course` (run every chapter, write figures and HTML pages)
# and `make test` (sync/export checks, the test suite, every notebook re-executed by nbval).
# Both create the virtual environment .venv from requirements.txt first if needed.
#
# On a machine whose python already has torch and triton (a GPU box, Colab), skip the venv:
#     make test PY=python3
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY ?= $(VENV)/bin/python
CHAPTERS := $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))
BUILD := build
# pytest-xdist workers for make test, one per core: tests spread one by one, notebooks one per worker
# (a notebook's cells run in order in one kernel: see test below)
WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
export MPLBACKEND := Agg
# Python's compiled bytecode, kept in build/pycache (not beside the sources): every process that make
# test starts (the workers, each notebook's and each graded notebook's kernel, the grader's checks
# process, each rank of a distributed launch) imports torch, and without cached bytecode each one
# compiles the ~2000 modules it imports (torch's mostly) again: about 7 s of CPU a process here.
# Where PYTHONDONTWRITEBYTECODE is set (container images often set it), nothing would be cached:
# make's commands run without it.
unexport PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX ?= $(CURDIR)/$(BUILD)/pycache

ifeq ($(PY),$(VENV)/bin/python)
SETUP := $(VENV)/.installed
else
SETUP :=
endif

.PHONY: install export sync check exercises grade grade-all site test test-slow test-newest course outputs bench lab clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check --no-compile -r requirements.txt
	touch $@

export: $(SETUP)
	$(PY) tools/nbtools.py export

sync: $(SETUP)
	$(PY) tools/nbtools.py sync

check: $(SETUP)
	$(PY) tools/nbtools.py check

# Student notebooks: exercises/NN_name.ipynb from the chapters' solution markers, stubs in place of the
# solutions (tools/exercises.py); `make check` fails when they are stale
exercises: $(SETUP)
	$(PY) tools/exercises.py

# Grade a student's notebook: make grade NB=exercises/02_ema.ipynb (GRADE_ARGS="--json out.json" and
# the time limits: python tools/grade.py --help). Runs it in a fresh kernel, then the hidden checks of
# tools/grading/checks_NN.py; prints the result per exercise and writes it as JSON (build/grades/)
grade: $(SETUP)
	@test -n "$(NB)" || { echo "usage: make grade NB=path/to/NN_name.ipynb"; exit 2; }
	$(PY) tools/grade.py "$(NB)" $(GRADE_ARGS)

# Grade a folder of submissions: make grade-all SUBMISSIONS=dir (every .ipynb below it, in parallel); writes
# build/grades/gradebook.csv and build/grades/feedback/ (python tools/grade.py --help)
grade-all: $(SETUP)
	@test -n "$(SUBMISSIONS)" || { echo "usage: make grade-all SUBMISSIONS=path/to/folder"; exit 2; }
	$(PY) tools/grade.py --all "$(SUBMISSIONS)" $(GRADE_ARGS)

# The course as a static website: every chapter with its committed outputs, and the exercises
# (tools/website.py; Sphinx + myst-nb). Open build/site/html/index.html, or serve it:
# python -m http.server -d build/site/html
site: $(SETUP)
	$(PY) tools/website.py

# One thread per worker process (OMP_NUM_THREADS=1): the workers already fill the cores, and torch's
# own threads on top of them would oversubscribe them. The suite and the chapters (nbval) in one run,
# so that neither waits for the other's last, longest item with a core idle: --whole-notebooks
# (tests/conftest.py) hands each chapter's cells to one worker as one unit (one kernel, in order), the
# chapters first, then the tests one by one
test: check
	OMP_NUM_THREADS=1 SCAN_COURSE_FIGURES=$(CURDIR)/$(BUILD)/figures $(PY) -m pytest -q -p no:cacheprovider \
	  -n $(WORKERS) --dist load --whole-notebooks -m "not slow" --nbval-lax --nbval-cell-timeout=1200 tests $(CHAPTERS)

# CI's second job: kernel tests with requirements.txt's pins but the newest Triton and NumPy pip offers:
# scan_lib declares lower bounds only, so a fresh `pip install .` may get them. Those two go to a folder
# of their own, ahead of the venv's on PYTHONPATH (torch and the rest: the venv's, the pins), and the
# tests marked `newest` run: a subset of the kernels' test files (the files below less those ignored),
# which runs every line of scan_lib that those files run (tests/conftest.py lists it and says how it
# was picked), in a fraction of their time: CI's whole run stays under 25 minutes
NEWEST := .venv-newest
test-newest: $(SETUP)
	rm -rf $(NEWEST)
	$(PY) -m pip install -q --disable-pip-version-check --no-compile --upgrade --target $(NEWEST) triton numpy
	PYTHONPATH=$(CURDIR)/$(NEWEST):$(PYTHONPATH) $(PY) -c \
	  "import numpy, triton; print('newest: triton', triton.__version__, 'numpy', numpy.__version__, 'from', triton.__file__)"
	OMP_NUM_THREADS=1 PYTHONPATH=$(CURDIR)/$(NEWEST):$(PYTHONPATH) $(PY) -m pytest -q -p no:cacheprovider \
	  -n $(WORKERS) --dist load -m "newest and not slow" tests \
	  --ignore=tests/test_site.py --ignore=tests/test_nbtools.py --ignore-glob='tests/test_grade*.py' \
	  --ignore=tests/test_bench.py --ignore=tests/test_distributed.py --ignore=tests/test_mamba.py
# (left out above: the tooling, and the modules built on the kernels, the benchmark, the sharded scan
# and the block, whose kernels the other files test)

# The grading runs CI leaves out (each chapter's untouched and partly solved exercise notebooks), minutes
test-slow: $(SETUP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n $(WORKERS) --dist load -m slow tests

course: $(SETUP)
	mkdir -p $(BUILD)/notebooks $(BUILD)/html
	for nb in $(CHAPTERS); do \
	  echo "== $$nb"; \
	  SCAN_COURSE_FIGURES=$(CURDIR)/$(BUILD)/figures $(PY) -m nbconvert --to notebook --execute --ExecutePreprocessor.timeout=3600 \
	    --output-dir $(BUILD)/notebooks "$$nb" || exit 1; \
	done
	$(PY) -m nbconvert --to html --output-dir $(BUILD)/html $(BUILD)/notebooks/*.ipynb
	@echo; echo "Executed chapters: $(BUILD)/notebooks/   HTML pages: open $(CURDIR)/$(BUILD)/html/00_triton.html"

# Refresh the outputs committed in notebooks/*.ipynb (maintainers, on a GPU: make outputs PY=python3,
# or NB=notebooks/05_mamba.ipynb for one chapter): runs each chapter in place and records its fingerprint.
outputs: $(SETUP)
	$(PY) tools/nbtools.py check --inputs-only
	$(PY) tools/nbtools.py execute $(or $(NB),$(CHAPTERS))
	$(PY) tools/exercises.py

# GPU only: correctness first, then scan_lib against every importable peer; CSV to benchmarks/results/,
# plots to figures/ (benchmarks/bench.py says what it measures and how)
bench: $(SETUP)
	$(PY) benchmarks/bench.py $(BENCH_ARGS)

lab: $(SETUP)
	$(PY) -m pip install -q --disable-pip-version-check jupyterlab==4.6.6
	$(PY) -m jupyter lab notebooks/

clean:
	rm -rf $(BUILD)
