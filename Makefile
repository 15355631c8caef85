# Two commands on a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

HOROVODRUN := $(VENV)/bin/horovodrun --gloo -np 2 -H localhost:2

.PHONY: venv test test-fast demo demo-cosmoflow bench-halo clean

venv: $(STAMP)

$(STAMP): pyproject.toml tools/install_horovod.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test,plot]'
	bash tools/install_horovod.sh $(PY)
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest tests

test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not distributed"

demo: $(STAMP)
	$(HOROVODRUN) $(PY) tools/demo_layers.py

demo-cosmoflow: $(STAMP)
	$(PY) tools/demo_cosmoflow.py

bench-halo: $(STAMP)
	$(HOROVODRUN) $(PY) tools/bench_halo.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
