# hvd_resilient: `make install`, `make test`, `make demo`. See README.md.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test test-extended test-fast lint demo bench chaos image clean docker-test \
	scenarios scenarios-all

$(STAMP): pyproject.toml scripts/install.sh scripts/patch_horovod.py
	bash scripts/install.sh
	touch $(STAMP)

install: $(STAMP)

# The one test command (README and .ci/run call exactly this). --durations: CI's log names the
# 30 slowest tests, where CI time is won back.
test: $(STAMP)
	$(PY) -m ruff check hvd_resilient discovery tests examples bench scripts
	$(PY) -m mypy
	$(PY) -m pytest -q --durations=30 -m "(not chaos or ci_chaos) and not docker and not horovod_scenarios and not extended" $(PYTEST_ARGS)

# The second variants of guarantees make test proves already (another store, data kind or
# launcher: about 5 minutes); not in CI, for its time.
test-extended: $(STAMP)
	$(PY) -m pytest -q -m "extended and not chaos and not docker" $(PYTEST_ARGS)

# Horovod's own elastic scenarios (test/integration/elastic_common.py) under hvd-resilient run:
# the --no-slot-hosts tier, where Horovod's expected sizes apply unchanged (CI runs it; about
# 5-9 minutes); `make scenarios-all` adds the slot-host tier (about 18 minutes in all).
scenarios: $(STAMP)
	$(PY) -m pytest -q -m horovod_scenarios -k no-slot-hosts tests/integration/test_horovod_scenarios.py $(PYTEST_ARGS)

scenarios-all: $(STAMP)
	$(PY) -m pytest -q -m horovod_scenarios tests/integration/test_horovod_scenarios.py $(PYTEST_ARGS)

# Every multi-host scenario (root, network namespaces, sshd; about 18 minutes here).
chaos: $(STAMP)
	$(PY) -m pytest -q -m chaos tests/chaos $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not chaos and not docker" $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check hvd_resilient discovery tests examples bench scripts
	shellcheck -x scripts/install.sh .ci/run examples/slurm/train.sbatch docker/*.sh docker/chaos/*.sh

# The Docker tier (root): installs docker.io, docker-compose and debootstrap if missing, starts
# an engine if none runs, builds the image, runs tests/docker (compose job + every chaos
# script), removes all it made. docs/containers.md; times there.
docker-test: $(STAMP)
	bash scripts/docker_test.sh $(PYTEST_ARGS)

# Needs a Docker engine (none on the project's CI machines): see docs/containers.md.
image:
	docker build -f docker/Dockerfile -t hvd-resilient:cpu .

# About two minutes: a fault, a host added and removed, then the report (launch/demo.py);
# `make demo DEMO_ARGS=--interactive` runs without the script (edit the hosts file yourself).
DEMO_ARGS ?=
demo: $(STAMP)
	$(VENV)/bin/hvd-resilient demo $(DEMO_ARGS)

bench: $(STAMP)
	$(PY) bench/checkpoint_bench.py

clean:
	rm -rf runs .pytest_cache .ruff_cache .mypy_cache
