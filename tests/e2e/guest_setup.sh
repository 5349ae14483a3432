# shellcheck shell=bash
# Helpers for scenarios running inside the e2e guest. Source it first thing:
#
#   source "$E2E_SHARE/guest_setup.sh"
#   e2e_setup            # igb PF + 4 VFs, soft-RoCE module if available
#   e2e_add_rxe rxe0 "${E2E_VF_NETDEVS[0]}"
#   e2e_dump after-add
#
# Sourcing turns on `set -euo pipefail` for the scenario: a failed step must fail
# the test rather than let later asserts run against a half-set-up guest.
#
# Variables set after e2e_setup:
#   E2E_PF             PF netdev name (kernel-assigned, no udev in the guest)
#   E2E_PF_PCI         0000:01:00.0
#   E2E_VF_PCI[i]      PCI address of VF i (0000:01:10.0, .2, .4, .6 with igb)
#   E2E_VF_NETDEVS[i]  netdev name of VF i at setup time
#   E2E_RXE            1 if rdma_rxe loaded, 0 otherwise
# Always set: E2E_SHARE (/mnt/share), E2E_IN (files given to boot()), E2E_OUT
# (where results for the host go).

set -euo pipefail

E2E_SHARE=${E2E_SHARE:-/mnt/share}
E2E_IN="$E2E_SHARE/in"
E2E_OUT="$E2E_SHARE/out"
E2E_PF_PCI=0000:01:00.0
E2E_PF=""
E2E_VF_PCI=()
E2E_VF_NETDEVS=()
E2E_RXE=0
mkdir -p "$E2E_OUT"
# cnirun and anything else the host puts in bin/ must be callable by name.
export PATH="$E2E_SHARE/bin:$PATH"

# e2e_log MSG...: a timestamped line (guest uptime) in the scenario log.
e2e_log() {
    echo "[$(cut -d' ' -f1 /proc/uptime)] $*"
}

# e2e_wait_for SECONDS CMD...: retry CMD every 0.2 s until it succeeds.
# Device probing under TCG is slow and asynchronous; polling beats fixed sleeps.
e2e_wait_for() {
    local limit=$1
    shift
    local deadline=$((SECONDS + limit))
    until "$@"; do
        if ((SECONDS >= deadline)); then
            e2e_log "timed out after ${limit}s waiting for: $*"
            return 1
        fi
        sleep 0.2
    done
}

# e2e_pci_netdev PCI: print the netdev name of a PCI function (empty if it has none,
# e.g. while it sits in another netns).
e2e_pci_netdev() {
    local dir="/sys/bus/pci/devices/$1/net"
    if [[ -d $dir ]]; then
        ls "$dir" | head -n1
    fi
}

_e2e_have_netdev() {
    [[ -n "$(e2e_pci_netdev "$1")" ]]
}

# e2e_setup_sriov [NUMVFS]: load igb/igbvf, bring the PF up and create NUMVFS VFs
# (default 4), waiting until every VF has its netdev.
e2e_setup_sriov() {
    local numvfs=${1:-4}
    local pfdev="/sys/bus/pci/devices/$E2E_PF_PCI"
    modprobe igb
    modprobe igbvf
    e2e_wait_for 30 _e2e_have_netdev "$E2E_PF_PCI"
    E2E_PF=$(e2e_pci_netdev "$E2E_PF_PCI")
    # The PF must be up for VF rate limits to be accepted.
    ip link set "$E2E_PF" up
    echo "$numvfs" >"$pfdev/sriov_numvfs"
    E2E_VF_PCI=()
    E2E_VF_NETDEVS=()
    local i vf
    for ((i = 0; i < numvfs; i++)); do
        vf=$(basename "$(readlink -f "$pfdev/virtfn$i")")
        e2e_wait_for 30 _e2e_have_netdev "$vf"
        E2E_VF_PCI+=("$vf")
        E2E_VF_NETDEVS+=("$(e2e_pci_netdev "$vf")")
    done
    e2e_log "PF $E2E_PF ($E2E_PF_PCI), VFs: ${E2E_VF_PCI[*]} -> ${E2E_VF_NETDEVS[*]}"
}

# e2e_load_rxe: load soft-RoCE. Does not fail: scenarios that need it check E2E_RXE.
e2e_load_rxe() {
    # `rdma link add ... type rxe` needs a crc32 crypto driver. The kernel requests it
    # on demand, which only works because the initramfs forwards its modprobe helper
    # into this root; loading it up front keeps rxe working even without that.
    if modprobe crc32_generic && modprobe rdma_rxe; then
        E2E_RXE=1
        e2e_log "rdma_rxe loaded"
    else
        E2E_RXE=0
        e2e_log "WARNING: rdma_rxe unavailable; RDMA steps will be skipped"
    fi
}

# e2e_add_rxe NAME NETDEV: create a soft-RoCE device on top of NETDEV.
e2e_add_rxe() {
    rdma link add "$1" type rxe netdev "$2"
}

# e2e_setup [NUMVFS]: everything a typical scenario needs.
e2e_setup() {
    e2e_setup_sriov "${1:-4}"
    e2e_load_rxe
}

# _e2e_capture FILE CMD...: run CMD into FILE; a failure is recorded in FILE.err
# rather than aborting, since a dump is diagnostic and partial data beats none.
_e2e_capture() {
    local file=$1
    shift
    if ! "$@" >"$file" 2>"$file.err"; then
        echo "exit status $? from: $*" >>"$file.err"
    fi
    if [[ ! -s "$file.err" ]]; then
        rm -f "$file.err"
    fi
}

# e2e_dump LABEL: save the kernel's view of links, VFs and RDMA devices under
# $E2E_OUT/dump-LABEL/ for the host-side test to assert on.
e2e_dump() {
    local dir="$E2E_OUT/dump-$1"
    mkdir -p "$dir"
    _e2e_capture "$dir/links.json" ip -d -j link
    if [[ -n $E2E_PF ]]; then
        # The PF's own record carries vfinfo_list: per-VF MAC, rates, trust, spoofchk.
        _e2e_capture "$dir/pf.json" ip -j link show "$E2E_PF"
    fi
    _e2e_capture "$dir/rdma-dev.json" rdma -j dev
    _e2e_capture "$dir/rdma-link.json" rdma -j link
    _e2e_capture "$dir/rdma-system.txt" rdma system
    _e2e_capture "$dir/netns.txt" ip netns list
}
