# make setup  - create .venv and install requirements.txt (idempotent; reruns only when it changes)
# make demo   - the whole pipeline end to end on a small embedded corpus (CPU, no downloads)
# make test   - install what the tests need, check formatting and lint (ruff), then run the tests
# make format - apply ruff's formatter and safe lint fixes to the whole tree
# make docs   - regenerate the tables of docs/knobs.md (config.py) and docs/metrics.md (training_metrics.py)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test format docs clean-demo

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and alone, so NeMo's own torch requirement cannot pull a different build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt
	# The top-level modules, scripts/ and benchmarks/ become importable from anywhere (editable: edits apply at once).
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: setup
	OMP_NUM_THREADS=1 bash scripts/demo.sh

clean-demo:
	rm -rf demo_data

test: setup
	# espeak-ng lets the demo tests speak real sentences; without it they use the tone fallback.
	-$(PY) scripts/make_demo_corpus.py --install-espeak
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	OMP_NUM_THREADS=1 $(PY) -m pytest

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

docs: setup
	$(PY) config.py --update-docs
	$(PY) training_metrics.py --update-docs
