# Two commands for a newcomer:  `make demo` (main job)  and  `make test` (the suite).
# Both create .venv on first use. torch is pinned first so nothing pulls a CUDA build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH ?= torch==2.13.0

.PHONY: demo test lint venv bench sim clean

$(STAMP): setup.py
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/nutp-train

plan-demo: $(STAMP)
	$(BIN)/nutp plan cluster=node_pair parallel.tp_base=8 failures=one_gpu model=llama3_8b train.global_batch_size=64 train.micro_batch_size=1 --json runs/plan_demo.json

lint: $(STAMP)
	$(BIN)/ruff check nemo_nutp tests benchmarks
	$(BIN)/mypy nemo_nutp

test: lint
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/plan_scale.py

sim: $(STAMP)
	$(BIN)/nutp simulate sim=paper_32k
	$(BIN)/nutp simulate sim=paper_32k sim.cost.shard_balance=balanced sim.name=paper_32k_balanced sim.output_dir=runs/sim/paper_32k_balanced
	$(BIN)/nutp simulate sim=nvl72_gb200
	$(BIN)/nutp simulate sim=scale_131k
	$(BIN)/python benchmarks/sim_scale.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache .hypothesis
