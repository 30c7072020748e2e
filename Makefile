# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test gradcheck bench learn notebooks clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.stamp-plot: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[plot]'
	touch $@

# the learn extra: the notebooks in Jupyter (ipykernel, jupytext), without the dev extra's torch
$(VENV)/.stamp-learn: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[learn]'
	touch $@ $(VENV)/.stamp-plot

$(VENV)/.stamp-dev: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@ $(VENV)/.stamp-plot $(VENV)/.stamp-learn

demo: $(VENV)/.stamp-plot
	$(BIN)/python demos/reverse.py $(ARGS)

test: $(VENV)/.stamp-dev
	$(BIN)/python -m pytest $(ARGS)

gradcheck: $(VENV)/.stamp-dev
	$(BIN)/python -m npformer.gradcheck

bench: $(VENV)/.stamp-dev
	$(BIN)/python benchmarks/train_step.py --config base

notebooks: $(VENV)/.stamp-learn
	$(BIN)/jupytext --to ipynb notebooks/[0-9][0-9]_*.py

learn: notebooks

clean:
	rm -rf $(VENV) runs notebooks/*.ipynb
