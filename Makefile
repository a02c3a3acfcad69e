# Consort: `make test` installs everything missing (idempotent, cached) and runs every test.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
CACHE ?= $(HOME)/.cache/consort

.PHONY: venv controlplane test test-fast cluster cluster-down up crds lint clean

venv:
	@scripts/bootstrap.sh

# Go-built kube-apiserver/controller-manager/scheduler, etcd, kwok, helm under $(CACHE)/bin (cached).
controlplane:
	@hack/controlplane.sh build

test: venv controlplane
	$(PY) -m pytest tests

# Everything except the real-control-plane tests.
test-fast: venv
	$(PY) -m pytest tests -m "not e2e"

cluster: venv controlplane
	@hack/controlplane.sh up

cluster-down:
	@hack/controlplane.sh down

up: venv
	$(VENV)/bin/consort up -f examples/local

crds: venv
	$(VENV)/bin/consort crds --out-dir crds
	$(VENV)/bin/consort crds --out-dir charts/consort/crds
	$(VENV)/bin/consort crds --reference > docs/crd-reference.md

clean:
	rm -rf $(VENV) .pytest_cache
