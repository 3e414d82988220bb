# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export TFDS_DATA_DIR ?= $(abspath ../shared/data/tensorflow_datasets)
export HYPOTHESIS_PROFILE ?= ci

.PHONY: demo test test-tpu lint bench clean

# Re-install only when pyproject.toml changed since the last install.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/minishard train

lint: $(STAMP)
	$(VENV)/bin/ruff check minishard tests benchmarks examples
	$(VENV)/bin/mypy minishard

# Two workers (pytest-xdist), one per core: each test's tmp_path, free port and compilation cache
# are its own. `--dist worksteal`: a worker that runs out of tests takes some queued for the other
# (measured, each worker's summed test time: 644 s and 612 s without it, 673.2 s and 673.0 s with
# it, on a run 7% slower throughout; docs/benchmarks.md).
# The quick loop skips the tests marked slow: $(VENV)/bin/pytest -n 2 -m "not slow"
test: lint
	$(VENV)/bin/pytest -n 2 --dist worksteal --durations=30

bench: $(STAMP)
	$(PY) benchmarks/run.py --json runs/bench.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis

# On a machine with a TPU chip (docs/tpu.md): the tests marked `tpu`, in one process (one program at a
# time may hold the chip), with the machine's own JAX; elsewhere they skip in one line each.
test-tpu:
	python3 -m pytest -p no:xdist -p no:cacheprovider -m tpu tests
