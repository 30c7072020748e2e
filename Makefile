# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test gradcheck bench notebooks clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.stamp-plot: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[plot]'
	touch $@

$(VENV)/.stamp-dev: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@ $(VENV)/.stamp-plot

demo: $(VENV)/.stamp-plot
	$(BIN)/python demos/reverse.py $(ARGS)

test: $(VENV)/.stamp-dev
	$(BIN)/python -m pytest $(ARGS)

gradcheck: $(VENV)/.stamp-dev
	$(BIN)/python -m npformer.gradcheck

bench: $(VENV)/.stamp-dev
	$(BIN)/python benchmarks/train_step.py --config base

notebooks: $(VENV)/.stamp-dev
	$(BIN)/jupytext --to ipynb notebooks/*.py

clean:
	rm -rf $(VENV) runs notebooks/*.ipynb
