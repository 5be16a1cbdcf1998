# Two entry points: `make demo` (set up + generate with the default model) and
# `make test` (set up + run the whole suite). Both create .venv if missing.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test setup clean

# torch first, pinned: the CPU wheel on local disk (any other spec pulls a CUDA build)
$(STAMP): pyproject.toml $(wildcard afd/kernels/csrc/*)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	$(BIN)/python -m afd.kernels
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/afd generate --prompt "ROMEO:" --max-tokens 200 --temperature 0.8 --seed 0

# The whole suite. Tests marked cuda/npu are deselected where the device is absent;
# the summary line "NOT RUN (deselected by marker)" says how many and why.
test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
