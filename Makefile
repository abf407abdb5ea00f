# pagedserve: `make serve` runs the server, `make test` runs every test; both set everything up first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
MODEL ?= smollm2-135m-instruct
# The config of `serve` and `soak`, and flags appended to the command of `serve`, `soak` and `bench-offline` (a flag
# given twice takes the last value): `make serve CONFIG=configs/smollm2-tp3.yaml ARGS="--port 9000"`,
# `make soak ARGS="--duration-s 30"`.
CONFIG = configs/default.yaml
ARGS =
# pytest-xdist workers of `make test`'s first pass, each a pytest session with its own local Ray; 0 runs it in one
# process. `--dist loadfile` keeps each file on one worker, so its module fixtures start once and its tests run in
# order. The tests marked `alone` assert wall-clock bounds that a second worker on two cores would race: they run
# after, in one process.
PYTEST_WORKERS ?= 2

.PHONY: setup serve test test-fast lint bench-offline soak clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch first and pinned: an unpinned torch pulled in by a dependency is a multi-GB CUDA build.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

setup: $(VENV)/.installed
	$(BIN)/pagedserve fetch-model $(MODEL)
	$(BIN)/python -m cuda_ext.cpu_ops

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Both passes run whatever the first gives; the target fails if either did.
test: setup lint
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m "not alone"; spread=$$?; \
	$(BIN)/python -m pytest -q -m alone; alone=$$?; \
	[ $$spread -eq 0 ] && [ $$alone -eq 0 ]

# The tests that deploy no Serve app, start no process and run no SmolLM2 end to end.
test-fast: setup lint
	$(BIN)/python -m pytest -q -m "not serve and not subprocess and not slow"

serve: setup
	$(BIN)/pagedserve serve --config $(CONFIG) $(ARGS)

bench-offline: setup
	$(BIN)/pagedserve bench-offline $(ARGS)

# Three minutes past capacity with random disconnects; fails on leaked KV blocks, request state or memory.
soak: setup
	$(BIN)/pagedserve soak --config $(CONFIG) --duration-s 180 $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
