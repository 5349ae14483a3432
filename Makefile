# rdma-cni developer entry points. Root is needed for demo, test and e2e
# (network namespaces, veth devices); `make deps` installs the Debian packages.
PYTHON ?= python3
CC     ?= cc
VENV   := .venv
BIN    := $(VENV)/bin
BINARY := dist/rdma-cni
# The host side of the thick design: static, runs on any glibc (docs/deploy.md).
SHIM   := dist/rdma-cni-shim
# The agent's NRI and ttrpc messages: compiled from the package's own .proto
# files by grpcio-tools (a test and build dependency) into *_pb2.py next to them,
# which are not committed (.gitignore) and never linted. Everything that imports
# the package or packs it depends on them: venv (and so unit, lint), build.
PROTOS    := $(wildcard rdma_cni/agent/nri/*.proto)
# kubelet's DRA plugin service (v1) and its plugin registration, for the agent's DRA plugin: made by
# scripts/kubelet_protos.sh from the .proto files of k8s.io/kubelet at the version gobuild/kube pins
# (Go's module cache; `go mod download`, hash checked against gobuild/kube/go.sum). No copy of them
# is kept in the tree.
KUBELET_GENERATED := rdma_cni/agent/dra/dra_v1_pb2.py rdma_cni/agent/dra/registration_v1_pb2.py
GENERATED := $(PROTOS:.proto=_pb2.py) $(KUBELET_GENERATED)
SRC    := $(shell find rdma_cni -name '*.py' ! -name '*_pb2.py') $(GENERATED) build.spec setup.cfg

# What `make demo` (and a build) needs on the machine; deps installs these and
# what the test tiers add: the e2e tier's guest tools, the runtime tier's runtimes.
DEMO_PACKAGES    := python3 python3-venv iproute2 containernetworking-plugins gcc libc6-dev
RUNTIME_PACKAGES := podman runc conmon containerd
DEB_PACKAGES     := $(DEMO_PACKAGES) $(RUNTIME_PACKAGES) openssl strace \
	debootstrap busybox-static cpio xz-utils zstd golang-go golang-github-appc-cni-dev

.PHONY: all deps deps-check venv proto build cnitool demo test unit integration e2e runtime faults oldroot components node-components cluster node bench lint clean

all: build

deps:  ## Debian packages the demo, the tests, the runtime and e2e tiers use (run as root)
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
		--no-install-recommends $(DEB_PACKAGES) >/dev/null

# Runs `make deps` when a package the demo needs is not installed (a fresh
# machine): the README's first command does the whole set-up by itself.
deps-check:
	@missing=$$(for p in $(DEMO_PACKAGES); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q '^install ok installed$$' || echo $$p; \
	done); \
	if [ -n "$$missing" ]; then \
		echo "deps-check: not installed: $$(echo $$missing): running make deps"; \
		$(MAKE) --no-print-directory deps; \
	fi

venv: $(VENV)/.stamp $(GENERATED)
$(VENV)/.stamp: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,build]'
	touch $@

# -I. names each module by its place in the package (rdma_cni.agent.nri.nri_api_pb2).
proto: $(GENERATED)
$(PROTOS:.proto=_pb2.py): %_pb2.py: %.proto $(VENV)/.stamp
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. $<
$(KUBELET_GENERATED) &: scripts/kubelet_protos.sh gobuild/kube/go.mod gobuild/kube/go.sum $(VENV)/.stamp
	bash scripts/kubelet_protos.sh $(BIN)/python

build: $(BINARY) $(SHIM)
# Static and without glibc's name service (no getpw*, getaddrinfo): no PT_INTERP,
# no DT_NEEDED, nothing of the host's libc loaded (tests/oldroot checks).
$(SHIM): launcher/shim.c launcher/shim.h
	mkdir -p dist
	$(CC) -O2 -Wall -Wextra -Werror -static -o $@ launcher/shim.c
$(BINARY): $(VENV)/.stamp $(SRC) launcher/launcher.c launcher/warm.c launcher/warm.h launcher/guard.c launcher/guard.h scripts/pack_launcher.py
	PYINSTALLER_CONFIG_DIR=$(CURDIR)/build/pyinstaller-cache $(BIN)/pyinstaller --noconfirm --clean --log-level WARN build.spec
	mkdir -p build
	$(CC) -O2 -Wall -Wextra -Werror -static -o build/launcher launcher/launcher.c launcher/warm.c launcher/guard.c
	$(BIN)/python scripts/pack_launcher.py --launcher build/launcher --tree dist/rdma-cni-dir --output $(BINARY)

# Go programs the tests run, built with Go 1.26 (by its full path: Debian's Go 1.19,
# /usr/bin/go, builds tests/e2e/cnirun) from the project's own go.mod/go.sum under
# gobuild/, into a cache outside the tree keyed by version: a warm cache is a no-op.
GO1_26      := /usr/local/go/bin/go
BUILD_CACHE := /var/cache/rdma-cni-build
CNITOOL_VERSION := v1.3.0
CNITOOL     := $(BUILD_CACHE)/cnitool-$(CNITOOL_VERSION)/cnitool

cnitool: $(CNITOOL)  ## cnitool (containernetworking/cni) for the docs and the integration tier
$(CNITOOL):
	mkdir -p $(@D)
	cd gobuild/cnitool && CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=readonly \
		$(GO1_26) build -trimpath -ldflags='-s -w' -o $@.tmp github.com/containernetworking/cni/cnitool
	mv $@.tmp $@

# deps-check first, then build (a sub-make, so that -j cannot build before the
# packages are there).
demo: deps-check  ## a simulated node, then VERSION, STATUS, inventory, ADD, CHECK, DEL through dist/rdma-cni
	$(MAKE) --no-print-directory build
	$(BIN)/python scripts/demo.py --binary $(BINARY)

# The README's test command: unit and integration tiers, the integration tier
# driving the built binary.
test: build cnitool
	RDMA_CNI_BINARY=$(CURDIR)/$(BINARY) $(BIN)/pytest -q -p no:cacheprovider tests/unit tests/integration

unit: venv
	$(BIN)/pytest -q tests/unit

integration: build cnitool
	RDMA_CNI_BINARY=$(CURDIR)/$(BINARY) $(BIN)/pytest -q tests/integration

# Real container runtimes (root; packages from make deps): containerd over CRI
# and podman with its CNI backend on the simulated node, through the installed shim and
# rdma-cni cni-server (as shipped) and with the fat dist/rdma-cni.
runtime: build
	RDMA_CNI_BINARY=$(CURDIR)/$(BINARY) $(BIN)/pytest -q -p no:cacheprovider tests/runtime

# The fault tier: seeded fuzzing, kill -9, broken IPAM, spoiled records, hostile
# pods; RDMA_CNI_FAULT_SEED replays a run, RDMA_CNI_FAULT_SCALE sizes it.
faults: build
	RDMA_CNI_BINARY=$(CURDIR)/$(BINARY) $(BIN)/pytest -q -p no:cacheprovider tests/faults

# The host side in a Debian 11 root (glibc 2.31, debootstrapped once into
# /var/cache/rdma-cni-build/bullseye-root-v1 by scripts/oldroot.sh): the shim
# installed there as the installer would, verbs run from inside it against the
# CNI server on the simulated node; the glibc floor of what the host loads.
oldroot: build
	RDMA_CNI_BINARY=$(CURDIR)/$(BINARY) $(BIN)/pytest -q -p no:cacheprovider tests/oldroot

e2e: build  ## QEMU guest with an emulated SR-IOV NIC (igb), driven by a libcni runtime
	$(BIN)/pytest -q -p no:cacheprovider -m e2e tests/e2e

# The real Kubernetes components, built with Go 1.26 from the modules pinned in
# gobuild/ into /var/cache/rdma-cni-build/<name>-<version>/ (a no-op when built).
components:  ## etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl
	bash scripts/build_components.sh

# The cluster tier: that control plane on 127.0.0.1, conf/ applied to it,
# rdma-scheduler from conf/ with the built extender.
cluster: build components
	RDMA_CNI_BINARY=$(CURDIR)/$(BINARY) $(BIN)/pytest -q -p no:cacheprovider tests/cluster

# The node's real parts, built the same way into the same cache: kubelet (the
# control plane's Kubernetes), containerd 2.x with its runc shim and ctr, Multus'
# thick and thin plugins, crictl, and Kubernetes' pause (a no-op when built).
node-components:  ## kubelet, containerd 2.x, Multus, crictl, pause; the image builder's stand-in root
	bash scripts/build_components.sh --node
	scripts/builderroot.sh >/dev/null

# The node tier: kubelet and containerd 2.x on the simulated node, registered with
# the control plane; Multus from its own manifest, conf/base/node/daemonset.yaml as shipped.
node: build components node-components
	RDMA_CNI_BINARY=$(CURDIR)/$(BINARY) $(BIN)/pytest -q -p no:cacheprovider tests/node

bench: build
	$(BIN)/python benchmarks/startup_bench.py --binary $(BINARY)
	$(BIN)/python benchmarks/datapath_bench.py --binary $(BINARY)
	$(BIN)/python benchmarks/scale_bench.py --binary $(BINARY)
	$(BIN)/python benchmarks/placement_bench.py
	$(BIN)/python benchmarks/extender_bench.py --binary $(BINARY)

lint: venv
	$(BIN)/ruff check rdma_cni tests benchmarks scripts
	$(BIN)/ruff format --check rdma_cni tests benchmarks scripts

clean:
	rm -rf build dist .demo $(GENERATED)
