# rdma-cni developer entry points. Root is needed for demo, test and e2e
# (network namespaces, veth devices); `make deps` installs the Debian packages.
PYTHON ?= python3
CC     ?= cc
VENV   := .venv
BIN    := $(VENV)/bin
BINARY := dist/rdma-cni
SRC    := $(shell find rdma_cni -name '*.py') build.spec setup.cfg

.PHONY: all deps venv build demo test unit integration faults e2e bench lint clean

all: build

deps:  ## Debian packages the tests and the e2e tier use (run as root)
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		iproute2 containernetworking-plugins openssl python3-venv gcc libc6-dev \
		debootstrap busybox-static cpio xz-utils zstd golang-go golang-github-appc-cni-dev >/dev/null

venv: $(VENV)/.stamp
$(VENV)/.stamp: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,build]'
	touch $@

build: $(BINARY)
$(BINARY): $(VENV)/.stamp $(SRC) launcher/launcher.c launcher/warm.c launcher/warm.h scripts/pack_launcher.py
	$(BIN)/pyinstaller --noconfirm --clean --log-level WARN build.spec
	mkdir -p build
	$(CC) -O2 -Wall -Wextra -Werror -static -o build/launcher launcher/launcher.c launcher/warm.c
	$(BIN)/python scripts/pack_launcher.py --launcher build/launcher --tree dist/rdma-cni-dir --output $(BINARY)

demo: build  ## a simulated node, then VERSION, STATUS, inventory, ADD, CHECK, DEL through dist/rdma-cni
	$(BIN)/python scripts/demo.py --binary $(BINARY)

# The README's test command: unit and integration tiers, the integration tier
# driving the built binary.
test: build
	RDMA_CNI_BINARY=$(CURDIR)/$(BINARY) $(BIN)/pytest -q -p no:cacheprovider tests/unit tests/integration

unit: venv
	$(BIN)/pytest -q tests/unit

integration: build
	RDMA_CNI_BINARY=$(CURDIR)/$(BINARY) $(BIN)/pytest -q tests/integration

# The fault tier: seeded fuzzing, kill -9, broken IPAM, spoiled records, hostile
# pods; RDMA_CNI_FAULT_SEED replays a run, RDMA_CNI_FAULT_SCALE sizes it.
faults: build
	RDMA_CNI_BINARY=$(CURDIR)/$(BINARY) $(BIN)/pytest -q -p no:cacheprovider tests/faults

e2e: build  ## QEMU guest with an emulated SR-IOV NIC (igb), driven by a libcni runtime
	$(BIN)/pytest -q -p no:cacheprovider -m e2e tests/e2e

bench: build
	$(BIN)/python benchmarks/startup_bench.py --binary $(BINARY)
	$(BIN)/python benchmarks/datapath_bench.py --binary $(BINARY)
	$(BIN)/python benchmarks/placement_bench.py

lint: venv
	$(BIN)/ruff check rdma_cni tests benchmarks scripts
	$(BIN)/ruff format --check rdma_cni tests benchmarks scripts

clean:
	rm -rf build dist .demo
