# Everything a fresh clone needs: `make test` and `make demo` create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The vLLM engine's own venv (requirements-vllm.txt says why); used through a subprocess.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_REMOVED := torchvision torchaudio torchcodec triton
# The launchers live in include/eagle3_devtools/, outside the eagle3-data wheel: run them from the checkout.
# exec: the launcher replaces the recipe's shell, so a SIGTERM to make (which make passes to its
# child) reaches the launcher and stops every service, instead of killing only the shell.
DEVTOOLS := exec env PYTHONPATH=include $(PY) -m eagle3_devtools

.PHONY: install vllm-venv speculators-venv system-packages lint test demo airflow cluster bench clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

# Debian packages for `make cluster` and tests/cluster (Postgres, Redis) and the browser test
# (Chromium): installed with apt-get when missing (as root, else through sudo).
SYSTEM_PACKAGES := postgresql redis-server chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
system-packages:
	@if ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 && command -v redis-server >/dev/null && command -v chromium >/dev/null; then :; \
	else echo "installing $(SYSTEM_PACKAGES) with apt-get"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(SYSTEM_PACKAGES); fi

# pip check must list nothing but the four removed packages as missing.
$(VLLM_STAMP): requirements-vllm.txt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet -r requirements-vllm.txt
	$(VLLM_PY) -m pip uninstall --quiet -y $(VLLM_REMOVED)
	! $(VLLM_PY) -m pip check 2>/dev/null | grep -v -E "requires (torchvision|torchaudio|torchcodec|triton), which is not installed"
	$(VLLM_PY) -c "import vllm, vllm.entrypoints.openai.api_server"
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# vLLM speculators (the trainer of vLLM's speculator format) in its own venv: tests/trainers run its
# own dataset reader over our exports (requirements-speculators.txt says why --no-deps). The tests
# and the benchmark smoke run their speculators scripts (readers, oracles, the probe) in processes
# forked from one warm interpreter per pytest process (tests/speculators_fork.py: ~6 CPU s of
# imports a process saved).
SPEC_VENV := .venv-speculators
SPEC_PY := $(SPEC_VENV)/bin/python
SPEC_STAMP := $(SPEC_VENV)/.installed
$(SPEC_STAMP): requirements-speculators.txt
	test -x $(SPEC_PY) || $(PYTHON) -m venv $(SPEC_VENV)
	$(SPEC_PY) -m pip install --quiet -r requirements-speculators.txt
	$(SPEC_PY) -m pip install --quiet --no-deps speculators==0.9.0 hs-connectors==0.9.0 specforge==0.2.0
	$(SPEC_PY) -c "import speculators.train.data, hs_connectors.transfer, specforge.data.preprocessing"
	touch $(SPEC_STAMP)

speculators-venv: $(SPEC_STAMP)

# Three pytest processes side by side, so that the two cores stay busy: the cluster tier (one
# Celery cluster, mostly waiting on Airflow's task scheduling), then the integration tier, in one;
# the dag.test() tier and every benchmark at its smoke size (tests/benchmarks:
# benchmarks/run_all.py --smoke's commands, each must run and print its RATIO line; niced, two
# at a time in the background from the session's start: tests/benchmarks/conftest.py) in another;
# everything else (the engine tier with the session's vLLM engines, the unit and trainers' tiers)
# in the third (docs/dag.md, "What it costs"). The two side processes' output is printed after
# the main one's; any failing fails the target.
# Every run starts as a new machine for what the project caches (EAGLE3_DATA_CACHE: verified
# codecs, journals, dev: builds; vLLM's cache): an empty folder under test-artifacts/, shared by
# every process and every server they start (README, "A first start").
# The cluster's waits leave a core idle that the other two fill; the tiers are placed so that the
# three processes end close together (`make test`'s row in benchmarks/RESULTS.md).
# tests/dags/test_task_timeout.py runs in the main tier: it mostly waits for its task's
# execution_timeout (~45 s wall for ~11 CPU s), which the main tier's engines fill, and the dags +
# benchmarks process ended last by about that much with it (`make test`'s row in
# benchmarks/RESULTS.md). tests/integration/test_lease.py runs in the dags + benchmarks
# process (the cluster one skips what that one runs): ~54 s wall for ~31 CPU s, much of it waiting
# for leases to expire, and the cluster + integration process ended last by 1-2 min without it
# (`make test`'s row in benchmarks/RESULTS.md); so does
# tests/integration/test_storage_seaweedfs.py (~31 s wall for ~6 CPU s, SeaweedFS starting and
# stopping: the cluster + integration process still ended 28-61 s last, "The LM head's passes and
# the start-up poll").
CLUSTER_TESTS := tests/cluster tests/integration
SIDE_TESTS := tests/dags/test_cli_reuse.py tests/dags/test_dag_import.py tests/dags/test_e2e.py tests/dags/test_hooks.py \
	tests/integration/test_lease.py tests/integration/test_storage_seaweedfs.py tests/benchmarks
CLUSTER_LOG := test-artifacts/cluster-integration.log
SIDE_LOG := test-artifacts/dags-benchmarks.log
TEST_CACHE := $(CURDIR)/test-artifacts/cache
# The linter and its formatter, configured in pyproject.toml ([tool.ruff]), over the whole tree;
# then the type checker ([tool.mypy]: strict on include/eagle3_data, gradual elsewhere), its
# cache under test-artifacts/mypy-cache (kept across runs: ~2 s warm; ~75 CPU s cold).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m mypy

test: export EAGLE3_DATA_CACHE = $(TEST_CACHE)
test: export VLLM_CACHE_ROOT = $(TEST_CACHE)/vllm
# One compute thread per process (benchmarks/run_all.py's SMOKE_ENV, for the same reason): the two
# tiers keep both cores busy, and torch's OpenMP pool of two threads spins while it waits for the
# one the other tier has descheduled (tests/unit/test_hidden_states.py beside a one-core load:
# 96.8 CPU s with the default pool, 18.5 with one thread). Inherited by every process the tests
# start, vLLM's engines too: in one process (below) they bind no OpenMP threads of their own.
# vLLM's engine core and its one worker in one process (vLLM then takes the "uni" executor): with
# the worker in a process of its own the core spins on the shared-memory queue (sched_yield) for
# as long as the worker computes, a second core's worth of CPU for the same wall
# (benchmarks/vllm_extract.py, one-process layout). For every engine the tests start:
# the servers (eagle3_devtools.vllm_serve sets it too) and the extraction workers.
test: export VLLM_ENABLE_V1_MULTIPROCESSING = 0
test: export OMP_NUM_THREADS = 1
test: export MKL_NUM_THREADS = 1
test: export OPENBLAS_NUM_THREADS = 1
test: lint $(STAMP) $(VLLM_STAMP) $(SPEC_STAMP) system-packages
	@rm -rf $(TEST_CACHE) && mkdir -p $(TEST_CACHE) $(dir $(SIDE_LOG))
	@$(PY) -m pytest -q $(CLUSTER_TESTS) $(addprefix --ignore=,$(SIDE_TESTS)) > $(CLUSTER_LOG) 2>&1 & cluster=$$!; \
	$(PY) -m pytest -q $(SIDE_TESTS) > $(SIDE_LOG) 2>&1 & side=$$!; \
	trap 'kill $$cluster $$side 2>/dev/null' INT TERM; \
	echo "$(CLUSTER_TESTS) and $(SIDE_TESTS) run beside the rest (logs: $(CLUSTER_LOG), $(SIDE_LOG))"; \
	$(PY) -m pytest -q tests $(addprefix --ignore=,$(CLUSTER_TESTS) $(SIDE_TESTS)); main=$$?; \
	wait $$cluster; beside_cluster=$$?; wait $$side; beside=$$?; \
	echo "== $(CLUSTER_TESTS) (exit $$beside_cluster) =="; cat $(CLUSTER_LOG); \
	echo "== $(SIDE_TESTS) (exit $$beside) =="; cat $(SIDE_LOG); \
	test $$main = 0 && test $$beside_cluster = 0 && test $$beside = 0

# ENGINE=vllm: a real vLLM engine (.venv-vllm) for local generation and hidden-state extraction.
# MODEL=qwen3: the Qwen3 family's config (defaults/qwen3.yaml) and dev target instead of Kimi-K2.5's.
ENGINE ?= dev
MODEL ?= kimi
demo: $(STAMP) $(if $(filter vllm,$(ENGINE)),$(VLLM_STAMP))
	$(DEVTOOLS).demo --engine $(ENGINE) --model $(MODEL)

airflow: $(STAMP)
	$(DEVTOOLS).local_airflow

# CeleryExecutor on Postgres + Redis, two workers (queues default, gpu): docker-compose.yaml's shape, loopback only.
cluster: $(STAMP) system-packages
	$(DEVTOOLS).cluster

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .cache
