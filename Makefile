# shardkeeper: the two commands are `make demo` (set up + run the pipeline end to end) and
# `make test` (set up + run the test suite). Both create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU wheel of torch is the default; on GPU nodes set e.g. TORCH_SPEC="torch==2.13.0" with the CUDA
# index of your cluster. Installing torch first keeps pip from resolving a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# The venv's tools (ninja for DeepSpeed's JIT op, torchrun, shardkeeper) come first on PATH.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: install lock system-deps lint test test-fast demo bench plots gpu-check docs clean

# DeepSpeed compiles from source against the installed torch: DS_BUILD_OPS=0 defers its ops to JIT
# at first use, and --no-build-isolation keeps pip from fetching another torch to build it with.
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)" "setuptools>=68" wheel
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation -c constraints.txt -e ".[dev,deepspeed]"
	touch $@

# Re-resolve the newest allowed versions and record them (then run the tests before committing).
lock:
	rm -rf .lockenv && python3 -m venv .lockenv
	.lockenv/bin/pip install -q "$(TORCH_SPEC)" "setuptools>=68" wheel
	DS_BUILD_OPS=0 .lockenv/bin/pip install -q --no-build-isolation -e ".[dev,deepspeed]"
	{ sed -n '1,3p' constraints.txt; .lockenv/bin/pip freeze --exclude-editable | grep -v -e '^torch==' -e '^-e' -e '^shardkeeper'; } > constraints.new
	mv constraints.new constraints.txt && rm -rf .lockenv

install: $(VENV)/.installed

# System packages some tests start for real (Debian packages; skipped when not root): headless Chromium for
# the browser test of the Prefect UI, and Slurm + munge for the Slurm launcher's tests (daemons on loopback).
SYSTEM_PACKAGES := chromium slurm-wlm slurmctld slurmd slurm-client munge
system-deps:
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v slurmctld >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SYSTEM_PACKAGES) >/dev/null) \
	      || echo "$(SYSTEM_PACKAGES) could not be installed: the browser and Slurm tests will be skipped"; \
	  else echo "chromium/slurm not found and not root: the browser and Slurm tests will be skipped"; fi; \
	fi

# Ruff (lint + format, 120 columns) and mypy on the schemas, the public API and the checkpoint interfaces
# (pyproject.toml lists them); make test runs it first and fails on any finding.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Two workers, one test file each at a time (--dist loadfile keeps a module's shared launches and servers on one
# worker; every worker starts its own Prefect server). TEST_WORKERS=0 runs the suite in this one process.
TEST_WORKERS ?= 2
test: install system-deps lint
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(PY) -m pytest --durations=10 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The inner loop: unit and in-process tests, no torchrun launch, server, browser or GPU (tests/conftest.py marks
# the modules that launch as slow); under 5 minutes on 2 cores.
test-fast: install lint
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(PY) -m pytest --durations=10 -m "not slow and not browser and not gpu and not live_hub" $(PYTEST_ARGS)

demo: install
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(PY) -m infra.demo

# Each script prints its table and keeps it in bench/results/ (date, machine, versions, commit, command);
# readme_tables.py then copies every table into README.md. Heavy: ~3.5 h on 2 cores (bench/benchlib.py MAKE_BENCH_TIME,
# the figure the README and the docs state); run on an otherwise idle machine.
bench: install
	$(PY) -m pip install -q "accelerate>=1.10"  # the bench extra: export_bench's baseline is Accelerate's own merge
	$(PY) bench/resume_bench.py
	$(PY) bench/deepspeed_resume_bench.py
	$(PY) bench/checkpoint_bench.py --part save --reps 5
	$(PY) bench/checkpoint_bench.py --part stall --reps 4
	$(PY) bench/checkpoint_bench.py --part load --reps 3
	$(PY) bench/goodput_bench.py --backend fsdp2 --backend deepspeed --warm 2
	$(PY) bench/recovery_bench.py
	$(PY) bench/recovery_bench.py --kill --reps 4
	$(PY) bench/memtier_bench.py
	$(PY) bench/replicate_profile.py
	$(PY) bench/persist_bench.py
	$(PY) bench/memtier_edges.py
	$(PY) bench/peers_memtier.py --rounds 3  # beside DLRover and torch async_save, ~10 min (+ DLRover's install)
	$(PY) bench/startup_kill_bench.py --reps 3
	$(PY) bench/failure_attribution.py
	$(PY) bench/composition.py  # kinds x origins x continuations, the 25-cell covering set, ~15 min
	$(PY) bench/export_bench.py
	$(PY) bench/deepspeed_bench.py
	$(PY) bench/import_bench.py
	$(PY) bench/pretrained_bench.py --size 1b --load-only --no-scratch --reps 2
	$(PY) bench/pretrained_bench.py --size 500m --reps 2
	$(PY) bench/scaling_bench.py
	$(PY) bench/prefect_overhead.py --reps 3 --train
	$(PY) bench/prefect_overhead.py --automation --via serve --reps 3 --poll-s 10,1
	$(PY) bench/prefect_overhead.py --automation --via worker --reps 3 --poll-s 10,1
	$(PY) bench/dashboard_bench.py --reps 3
	$(PY) bench/scale_bench.py
	$(PY) bench/s3_bench.py --reps 5
	$(PY) bench/data_bench.py --reps 5
	$(PY) bench/fuzz.py --examples 300  # mutated checkpoints through every reader, ~15 min on 2 cores
	$(PY) bench/torture.py --kills 200 --per-chain 8 --final 60 --publish  # ~1.5 h on 2 idle cores
	$(PY) bench/readme_tables.py

# Redraw every plot beside the tables (bench/results/*.png) from the published tables, measuring nothing.
PLOTTED := resume_bench deepspeed_resume_bench goodput_bench checkpoint_bench scaling_bench import_bench export_bench \
	deepspeed_bench dashboard_bench scale_bench peers_memtier
plots: install
	for b in $(PLOTTED); do $(PY) bench/$$b.py --plot-only || exit 1; done

# GPU figures from one command, on a machine with CUDA GPUs (<= 10 min): the GPU-marked tests, goodput (FSDP2 and
# DeepSpeed), the in-memory tier's crash-restart, recovery time (>= 2 GPUs) and a pretrained ~1B fine-tune segment;
# the tables go to bench/results/ (each names the GPU and the date) and into the README and docs. Its own venv:
# --system-site-packages reuses a CUDA torch the machine already has; else GPU_TORCH_SPEC is installed (pip's
# default index serves CUDA builds of torch for Linux x86-64).
GPU_VENV ?= .venv-gpu
GPU_TORCH_SPEC ?= torch==2.13.0
$(GPU_VENV)/.installed: pyproject.toml constraints.txt
	test -x $(GPU_VENV)/bin/python || python3 -m venv --system-site-packages $(GPU_VENV)
	$(GPU_VENV)/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null \
	  || $(GPU_VENV)/bin/python -m pip install -q "$(GPU_TORCH_SPEC)" "setuptools>=68" wheel
	DS_BUILD_OPS=0 $(GPU_VENV)/bin/python -m pip install -q --no-build-isolation -c constraints.txt -e ".[dev,deepspeed]"
	touch $@

gpu-check: $(GPU_VENV)/.installed
	PATH=$(CURDIR)/$(GPU_VENV)/bin:$$PATH $(GPU_VENV)/bin/python bench/gpu_check.py

# The documentation site (Material for MkDocs + mkdocstrings) into site/: the reference pages are generated from
# the code at build time (docs/hooks/gen_reference.py), the benchmark tables included from bench/results/.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) $(GPU_VENV) .prefect runs bench/out site
