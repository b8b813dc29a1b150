# hvd_resilient: `make install`, `make test`, `make demo`. See README.md.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test test-fast lint demo bench chaos image clean

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh
	touch $(STAMP)

install: $(STAMP)

# The one test command (README and .ci/run call exactly this).
test: $(STAMP)
	$(PY) -m ruff check hvd_resilient discovery tests examples bench
	$(PY) -m pytest -q -m "not chaos or ci_chaos" $(PYTEST_ARGS)

# Every multi-host scenario (root, network namespaces, sshd; about 6 minutes).
chaos: $(STAMP)
	$(PY) -m pytest -q -m chaos tests/chaos $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not chaos" $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check hvd_resilient discovery tests examples bench
	shellcheck -x scripts/install.sh .ci/run examples/slurm/train.sbatch docker/*.sh docker/chaos/*.sh

# Needs a Docker engine (none on the project's CI machines): see docs/containers.md.
image:
	docker build -f docker/Dockerfile -t hvd-resilient:cpu .

demo: $(STAMP)
	$(VENV)/bin/hvd-resilient demo

bench: $(STAMP)
	$(PY) bench/checkpoint_bench.py

clean:
	rm -rf runs .pytest_cache .ruff_cache
