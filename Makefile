# Two commands for a newcomer:  `make demo` (main job)  and  `make test` (the suite).
# Both create .venv on first use. torch is pinned first so nothing pulls a CUDA build.
# `make test` also tests megatron-core 0.19 on Python 3.12 in .venv312 (tested matrix:
# nemo_nutp/compat/tested.py); torch 2.13.0 for 3.12 is the PyPI CUDA build (~3 GB, runs on CPU).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH ?= torch==2.13.0
# python3.12 on PATH, else pyenv's (its shim answers "command not found" unless selected).
PY312 ?= $(shell python3.12 -c "" >/dev/null 2>&1 && command -v python3.12 || \
	ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12 2>/dev/null | tail -n 1)
VENV312 ?= .venv312
STAMP312 := $(VENV312)/.installed
# On megatron-core 0.19: what touches megatron-core's version-dependent code — parity (fixed
# layouts; the hypothesis-drawn layouts run on 0.16 only), checkpoint round trips, the pipeline,
# the distributed optimizer, one end-to-end nutp-train run, the image checks. Pure config and
# train-loop behaviour (tests/config/test_configs.py, the rest of tests/train) are version-free
# and run on 3.11 only, to keep CI inside its time.
TESTS_312 ?= tests/train/test_parity.py tests/train/test_checks.py \
	tests/train/test_train.py::test_nutp_layout_matches_single_replica \
	tests/model/test_attention.py tests/model/test_init.py tests/model/test_specs.py \
	tests/compat/test_cpu_compat.py tests/checkpoint/test_roundtrip.py \
	tests/checkpoint/test_zero_roundtrip.py tests/pipeline/test_pipeline_parity.py \
	tests/sync/test_zero.py tests/launch/test_docker.py tests/pipeline/test_vpp.py \
	tests/model/test_moe_reference.py tests/model/test_moe_replica.py tests/train/test_moe_parity.py \
	tests/pipeline/test_moe_pipeline.py \
	tests/sync/test_moe_zero.py \
	tests/train/test_mtp_parity.py \
	tests/checkpoint/test_moe_checkpoint.py \
	tests/train/test_moe_routing.py tests/train/test_moe_shared_size.py \
	tests/model/test_mla_replica.py tests/train/test_mla_parity.py tests/train/test_deepseek_v3.py \
	tests/model/test_moe_memory_measured.py \
	tests/relayout/test_moe_live.py

# Megatron-Bridge (Python 3.12 only): Bridge --no-deps plus the pinned list of what its imports
# need (requirements-bridge.txt); its full dependency set does not build here.
BRIDGE ?= megatron-bridge==0.6.2
STAMPBRIDGE := $(VENV312)/.bridge-installed
TESTS_BRIDGE ?= tests/integrations/test_bridge_shim.py tests/integrations/test_bridge_data.py \
	tests/integrations/test_bridge_fields.py \
	tests/integrations/test_bridge_train.py tests/integrations/test_bridge_resume.py \
	tests/integrations/test_bridge_zero.py tests/integrations/test_bridge_pipeline.py \
	tests/integrations/test_bridge_uniform.py tests/integrations/test_bridge_eval.py \
	tests/integrations/test_bridge_readme.py tests/integrations/test_bridge_recovery.py \
	tests/integrations/test_bridge_live.py tests/integrations/test_bridge_stragglers.py \
	tests/integrations/test_recipe_coverage.py tests/integrations/test_gemma_hf_parity.py \
	tests/integrations/test_recipe_standins.py \
	tests/model/test_gemma_reference.py tests/launch/test_bridge_slurm.py \
	tests/integrations/test_bridge_links.py tests/integrations/test_bridge_spares.py \
	tests/integrations/test_bridge_moe.py tests/integrations/test_bridge_moe_zero.py \
	tests/integrations/test_bridge_moe_checkpoint.py \
	tests/integrations/test_bridge_moe_plan.py \
	tests/integrations/test_bridge_mtp.py \
	tests/integrations/test_bridge_moe_pipeline.py \
	tests/integrations/test_bridge_moe_routing.py \
	tests/integrations/test_bridge_moe_live.py \
	tests/integrations/test_bridge_mla.py

# The real Slurm the tests start (tests/helpers/slurm_cluster.py: munged, slurmctld, 3 slurmd on
# loopback; tests/launch runs the scripts `nutp sbatch` renders on it): Debian's Slurm 22.05 and
# munge, apt-installed (root) when not there yet; gcc builds the container-flags SPANK plugin.
SLURM_PKGS ?= slurmctld slurmd slurm-client munge libslurm-dev

.PHONY: demo config-docs test test-311 test-312 test-bridge lint venv bench sim clean \
	gpu-check-prepare gpu-check slurm

$(STAMP): setup.py
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

$(STAMP312): setup.py
	@test -n "$(PY312)" || { echo "make test: no Python 3.12 found (python3.12 on PATH or \
	$${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*): the megatron-core 0.19 half of the suite \
	needs it; set PY312=/path/to/python3.12" >&2; exit 1; }
	test -d $(VENV312) || $(PY312) -m venv $(VENV312)
	$(VENV312)/bin/pip install -q --upgrade pip
	$(VENV312)/bin/pip install -q "$(TORCH)"
	$(VENV312)/bin/pip install -q -e ".[test]"
	touch $(STAMP312)

$(STAMPBRIDGE): $(STAMP312) requirements-bridge.txt
	$(VENV312)/bin/pip install -q --no-deps "$(BRIDGE)"
	$(VENV312)/bin/pip install -q -r requirements-bridge.txt
	touch $(STAMPBRIDGE)

venv: $(STAMP)

slurm:
	@if command -v slurmctld >/dev/null && test -f /usr/include/slurm/spank.h; then \
	  echo "slurm: $$(slurmctld -V) installed"; \
	else \
	  test "$$(id -u)" = 0 || { echo "make test: the Slurm test cluster needs root (apt-get \
	install $(SLURM_PKGS), munged and slurmd run as root)" >&2; exit 1; }; \
	  command -v apt-get >/dev/null || { echo "make test: apt-get not found; install \
	$(SLURM_PKGS) (Slurm 22.05 + munge) for the Slurm test cluster" >&2; exit 1; }; \
	  echo "slurm: apt-get install $(SLURM_PKGS)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q --no-install-recommends $(SLURM_PKGS) >/dev/null || \
	  { apt-get update -q >/dev/null && \
	    apt-get install -y -q --no-install-recommends $(SLURM_PKGS) >/dev/null; } || \
	  { echo "make test: apt-get install $(SLURM_PKGS) failed" >&2; exit 1; }; \
	  echo "slurm: $$(slurmctld -V) installed"; \
	fi
	@command -v gcc >/dev/null || { echo "make test: gcc not found (the Slurm test cluster \
	builds a SPANK plugin with it)" >&2; exit 1; }

demo: $(STAMP)
	$(BIN)/nutp-train

plan-demo: $(STAMP)
	$(BIN)/nutp plan cluster=node_pair parallel.tp_base=8 health=one_gpu model=llama3_8b train.global_batch_size=64 train.micro_batch_size=1 --json runs/plan_demo.json

# docs/config.md from the schema's field docstrings (tests/docs/test_config_docs.py: not stale)
config-docs: $(STAMP)
	$(BIN)/python -m nemo_nutp.config.docs > docs/config.md

lint: $(STAMP)
	$(BIN)/ruff check nemo_nutp tests benchmarks
	$(BIN)/mypy nemo_nutp

test: lint test-311 test-312 test-bridge

test-311: $(STAMP) slurm
	$(BIN)/python -m pytest -q --durations=20

test-312: $(STAMP312)
	$(VENV312)/bin/python -m pytest -q --durations=20 $(TESTS_312)

test-bridge: $(STAMPBRIDGE) slurm
	$(VENV312)/bin/python -m pytest -q --durations=20 $(TESTS_BRIDGE)

# recipe_coverage.py needs Megatron-Bridge: the Python 3.12 environment.
bench: $(STAMP) $(STAMPBRIDGE)
	$(BIN)/python benchmarks/plan_scale.py
	$(BIN)/python benchmarks/norm_kernels.py
	NUTP_BENCH=1 $(BIN)/python -m pytest -q -m bench tests
	NUTP_BENCH=1 $(VENV312)/bin/python -m pytest -q -m bench tests/integrations
	$(VENV312)/bin/python benchmarks/recipe_coverage.py --train

sim: $(STAMP)
	$(BIN)/nutp simulate sim=paper_32k
	$(BIN)/nutp simulate sim=paper_32k sim.cost.shard_balance=balanced sim.name=paper_32k_balanced sim.output_dir=runs/sim/paper_32k_balanced
	$(BIN)/nutp simulate sim=nvl72_gb200
	$(BIN)/nutp simulate sim=scale_131k
	$(BIN)/python benchmarks/sim_scale.py
	$(BIN)/python benchmarks/transition_cost.py
	$(BIN)/nutp simulate sim=paper_32k sim.transitions.measured=runs/bench/transitions.json sim.name=paper_32k_measured sim.output_dir=runs/sim/paper_32k_measured --no-sweep

# GPU checks (never needed by CI; docs/verified.md). On a CPU machine with
# network: gather the wheels (< 64 MiB, .gpu-check/, ignored). On the GPU machine (Python 3.12
# with its own torch, no network): install them beside that torch, run the gpu-marked tests
# (< 8 min; tests/gpu/test_nccl.py's NCCL runs need 2, 3 or 5 GPUs and skip below), write
# runs/gpu_check/gpu_check.json + .log ($$GPU_CHECK_OUT); skips without CUDA.
gpu-check-prepare: $(STAMP312)
	$(PY) tests/gpu/check.py prepare --python $(VENV312)/bin/python

gpu-check:
	python3 tests/gpu/check.py run

clean:
	rm -rf $(VENV) $(VENV312) runs .pytest_cache .mypy_cache .ruff_cache .hypothesis
