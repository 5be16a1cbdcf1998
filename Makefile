# Two entry points: `make demo` (set up + generate with the default model) and
# `make test` (set up + run the whole suite). Both create .venv if missing.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test setup clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/afd generate --prompt "ROMEO:" --max-tokens 200 --temperature 0.8 --seed 0

test: $(STAMP)
	$(BIN)/python -m afd.testing.run_suite

clean:
	rm -rf $(VENV)
