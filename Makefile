# The two set-up commands of the README, for a fresh machine with python3 (3.10+):
#   make run    install picollama, fetch the default model, run it
#   make test   install the test dependencies, fetch the real models, run the whole suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test install install-test models lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet -e .

install-test: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'

models: install
	$(BIN)/picollama-models pull --all

run: install
	$(BIN)/picollama-models pull
	$(BIN)/picollama-cli -cnv -n 96 -p "Write a short poem about the sea." < /dev/null

test: install-test models
	$(BIN)/python -m pytest -q

lint: install-test
	$(BIN)/pip install --quiet ruff
	$(BIN)/ruff check picollama tests
	$(BIN)/ruff format --check picollama tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
