# shellcheck shell=bash
# Guest-side helpers for the rdma-cni scenarios (test_plugin.py, driven by plugin.sh).
# Source after guest_setup.sh. The host passes in (under $E2E_IN):
#   rdma-cni        the plugin (dist/rdma-cni)
#   apiserver.py    tests/support/apiserver.py, the HTTPS Kubernetes API stand-in
#   pods.json       the pods it serves, with their rdma_interfaces_required annotations
#   scenarios/      this directory
#
# Scenarios only collect facts: CNI results, exit codes and the kernel's own view
# (`ip -d -j link` with the PF's vfinfo_list, `rdma -j dev/link`, `ip netns`) around
# each step. test_plugin.py asserts on them, so a wrong answer from the plugin
# fails one test with the evidence at hand instead of aborting the whole boot.

# Where the plugin and its state live in the guest (all on the guest's tmpfs overlay).
RC_BIN=/opt/cni/bin
RC_CONF=/etc/cni/net.d
RC_STATE=/var/lib/rdma-cni-e2e
RC_IPAM=/var/lib/rdma-cni-e2e-ipam
RC_LOCK=/run/rdma-cni-e2e/rdma-cni.lock
RC_LOGS=/var/log/rdma-cni-e2e
RC_API=/run/rdma-cni-e2e-api
RC_SUBNET=10.77.0.0/24
# Filled by rc_node_facts and rc_start_api.
RC_CAPACITY=0
RC_API_PID=""

# rc_install: put the plugin next to host-local in the CNI bin dir and warm it up.
rc_install() {
    mkdir -p "$RC_BIN" "$RC_CONF" "$RC_LOGS"
    install -m 0755 "$E2E_IN/rdma-cni" "$RC_BIN/rdma-cni"
    # The plugin delegates IPAM through CNI_PATH, so host-local must sit in the same
    # bin dir that cnirun passes; a symlink keeps trixie's own binary.
    ln -sf /usr/lib/cni/host-local "$RC_BIN/host-local"
    # The first start unpacks the bundled interpreter into the launcher's cache;
    # doing it now, in the background, overlaps it with the slow device setup.
    "$RC_BIN/rdma-cni" --version >/dev/null 2>&1 &
}

# rc_start_api: start the API stand-in with the guest's python3, in the background:
# generating its keys with openssl takes ~10 s under TCG, so it overlaps e2e_setup.
# rc_wait_api waits for it.
rc_start_api() {
    mkdir -p "$RC_API"
    local nodes=()
    # Nodes only where a scenario publishes node state (the NRI scenarios' agent).
    if [[ -f $E2E_IN/nodes.json ]]; then
        nodes=(--nodes "$E2E_IN/nodes.json")
    fi
    python3 "$E2E_IN/apiserver.py" --dir "$RC_API" --port 0 --pods "$E2E_IN/pods.json" "${nodes[@]}" \
        >"$E2E_OUT/apiserver.out" 2>"$E2E_OUT/apiserver.err" &
    RC_API_PID=$!
}

rc_wait_api() {
    e2e_wait_for 120 grep -q '^ready ' "$E2E_OUT/apiserver.out"
    e2e_log "API stand-in: $(cat "$E2E_OUT/apiserver.out")"
}

# rc_node_facts: after e2e_setup, pick the PF capacity and record the node's starting
# point ($E2E_OUT/node.env, vf-pci.txt, vf-netdevs.txt).
rc_node_facts() {
    # The emulated 82576 reports its link speed; fall back to its nominal 1 Gbit/s
    # should a future QEMU report none (-1), since min_tx_rate needs a capacity.
    local speed
    speed=$(cat "/sys/class/net/$E2E_PF/speed" 2>/dev/null || echo -1)
    if [[ $speed =~ ^[0-9]+$ ]] && ((speed > 0)); then
        RC_CAPACITY=$speed
    else
        RC_CAPACITY=1000
    fi
    printf '%s\n' "${E2E_VF_PCI[@]}" >"$E2E_OUT/vf-pci.txt"
    printf '%s\n' "${E2E_VF_NETDEVS[@]}" >"$E2E_OUT/vf-netdevs.txt"
    {
        echo "pf=$E2E_PF"
        echo "pf_speed=$speed"
        echo "capacity=$RC_CAPACITY"
        echo "rxe=$E2E_RXE"
        echo "kernel=$(uname -r)"
    } >"$E2E_OUT/node.env"
}

# rc_stop_api: stop the stand-in started by rc_start_api (by its pid, nothing else).
rc_stop_api() {
    if [[ -n $RC_API_PID ]]; then
        kill "$RC_API_PID" 2>/dev/null || true
        wait "$RC_API_PID" 2>/dev/null || true
        RC_API_PID=""
    fi
}

# rc_plugin_json NAME ISOLATION: the rdma-cni plugin entry for network NAME, on one
# line. Each scenario gets its own network (and so its own log file and IPAM range
# directory) while all share the state dir and the lock, as on a real node.
rc_plugin_json() {
    local name=$1 isolation=$2
    cat <<EOF
{"type": "rdma-cni", "kubeconfig": "$RC_API/kubeconfig", "pfs": ["$E2E_PF"],
 "capacityMbps": {"$E2E_PF": $RC_CAPACITY}, "rdmaIsolation": "$isolation",
 "stateDir": "$RC_STATE", "lockFile": "$RC_LOCK", "logFile": "$RC_LOGS/$name.log", "logLevel": "debug",
 "ipam": {"type": "host-local", "ranges": [[{"subnet": "$RC_SUBNET"}]], "dataDir": "$RC_IPAM"}}
EOF
}

# rc_network NAME [ISOLATION]: write $RC_CONF/NAME.conflist (for cnirun) and
# $RC_CONF/NAME.json (the same plugin as a single network config, for
# `rdma-cni inventory --config`). ISOLATION defaults to auto.
rc_network() {
    local name=$1 isolation=${2:-auto} plugin
    plugin=$(rc_plugin_json "$name" "$isolation")
    cat >"$RC_CONF/$name.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "$name", "plugins": [$plugin]}
EOF
    # A single config carries cniVersion and name itself: splice them into the entry.
    printf '{"cniVersion": "1.0.0", "name": "%s", %s\n' "$name" "${plugin#\{}" >"$RC_CONF/$name.json"
}

# rc_cni VERB NETWORK POD OUTDIR LABEL: one cnirun VERB for pod default/POD
# (container ctr-POD, netns /run/netns/POD, CNI_IFNAME net1). The output goes to
# OUTDIR/LABEL.json, stderr to LABEL.err, the exit status to LABEL.rc. Never fails:
# a refused ADD is a fact to assert on, not a scenario error. The timeout is well
# above libcni's default because five concurrent plugin starts under TCG take ~45 s.
rc_cni() {
    local verb=$1 network=$2 pod=$3 dir=$4 label=$5 rc=0 uid
    # A UID as Kubernetes makes one (the plugin refuses others): 32 hex digits, as a static pod's.
    uid=$(printf '%s' "$pod" | md5sum | cut -c1-32)
    mkdir -p "$dir"
    cnirun "$verb" -conflist "$RC_CONF/$network.conflist" -netns "/run/netns/$pod" \
        -id "ctr-$pod" -ifname net1 -bin-dir "$RC_BIN" -timeout 5m \
        -args "IgnoreUnknown=true;K8S_POD_NAMESPACE=default;K8S_POD_NAME=$pod;K8S_POD_UID=$uid" \
        >"$dir/$label.json" 2>"$dir/$label.err" || rc=$?
    echo "$rc" >"$dir/$label.rc"
    e2e_log "cnirun $verb $network $pod -> $rc"
}

# rc_dump DIR LABEL [NETNS...]: the kernel's view and the plugin's state into
# DIR/dump-LABEL/:
#   links.json          ip -d -j link (the PF's entry carries vfinfo_list)
#   rdma-dev.json       rdma -j dev
#   rdma-link.json      rdma -j link
#   rdma-system.txt     rdma system (the netns mode)
#   netns.txt           ip netns list
#   rxe-parents.txt     "<rdma device> <netdev>" from /sys/class/infiniband/*/parent
#   records/            copies of the plugin's allocation records
#   leases.txt          every file under host-local's dataDir, relative to it
#   netns-NETNS.json    ip -n NETNS -d -j addr (links with details and addresses)
# Leaner than e2e_dump (every process start costs ~0.1-0.2 s under TCG, and a run
# takes ~17 dumps): builtins wherever a command is not needed.
rc_dump() {
    local dir="$1/dump-$2" ns dev parent file
    shift 2
    mkdir -p "$dir/records"
    ip -d -j link >"$dir/links.json"
    rdma -j dev >"$dir/rdma-dev.json"
    rdma -j link >"$dir/rdma-link.json"
    rdma system >"$dir/rdma-system.txt"
    ip netns list >"$dir/netns.txt"
    for dev in /sys/class/infiniband/*; do
        [[ -e $dev ]] || continue
        parent=""
        read -r parent <"$dev/parent" || true
        echo "${dev##*/} $parent"
    done >"$dir/rxe-parents.txt"
    # What the host's sysfs lists under each VF's PCI device (its netdev only while it is home):
    # the plugin proves a VF home by this alone under the node lock.
    for dev in /sys/bus/pci/devices/*; do
        [[ -e $dev/physfn ]] || continue
        echo "${dev##*/} $(ls "$dev/net" 2>/dev/null | tr '\n' ' ')"
    done >"$dir/vf-sysfs-net.txt"
    if compgen -G "$RC_STATE/attachments/*.json" >/dev/null; then
        cp "$RC_STATE"/attachments/*.json "$dir/records/"
    fi
    for file in "$RC_IPAM"/* "$RC_IPAM"/*/*; do
        if [[ -f $file ]]; then
            echo "${file#"$RC_IPAM"/}"
        fi
    done >"$dir/leases.txt"
    for ns in "$@"; do
        ip -n "$ns" -d -j addr >"$dir/netns-$ns.json"
    done
}

# rc_inventory OUTFILE [NETWORK]: `rdma-cni inventory`, with NETWORK's config when given.
rc_inventory() {
    local out=$1 network=${2:-} rc=0
    if [[ -n $network ]]; then
        "$RC_BIN/rdma-cni" inventory --config "$RC_CONF/$network.json" >"$out" 2>"$out.err" || rc=$?
    else
        "$RC_BIN/rdma-cni" inventory >"$out" 2>"$out.err" || rc=$?
    fi
    echo "$rc" >"$out.rc"
}

# rc_wait_vf_netdevs PCI...: wait until every PCI function has a netdev in the host
# (a VF returns asynchronously when its pod's netns is destroyed).
rc_wait_vf_netdevs() {
    local pci
    for pci in "$@"; do
        e2e_wait_for 30 _e2e_have_netdev "$pci"
    done
}

# rc_rdma_mode MODE: switch the RDMA netns mode, quietly (for e2e_wait_for: the
# kernel answers EBUSY until every other netns is really gone, which is asynchronous).
rc_rdma_mode() {
    rdma system set netns "$1" 2>/dev/null
}

# rc_del_netns NS...: delete pod namespaces if present.
rc_del_netns() {
    local ns
    for ns in "$@"; do
        if [[ -e /run/netns/$ns ]]; then
            ip netns del "$ns"
        fi
    done
}

# rc_run NAME FUNCTION [ARGS...]: run one scenario in a subshell with errexit, its
# output in $E2E_OUT/NAME/trace.log and its exit status in $E2E_OUT/NAME/status.
# A broken scenario must not stop the others: each test reads its own status.
rc_run() {
    local name=$1 dir="$E2E_OUT/$1" rc=0 start=$SECONDS
    shift
    mkdir -p "$dir"
    e2e_log "scenario $name: start"
    # errexit is ignored inside `if`/`||` contexts, so toggle it around a plain call.
    set +e
    (
        set -euo pipefail
        "$@"
    ) >"$dir/trace.log" 2>&1
    rc=$?
    set -e
    # The plugin's own logs for this scenario's networks (named NAME or NAME-*, with
    # any '/' in NAME as '-').
    local log
    for log in "$RC_LOGS/${name//\//-}.log" "$RC_LOGS/${name//\//-}"-*.log; do
        if [[ -f $log ]]; then
            cp "$log" "$dir/plugin-$(basename "$log")"
        fi
    done
    echo "$rc" >"$dir/status"
    echo "$((SECONDS - start))" >"$dir/seconds"
    e2e_log "scenario $name: exit $rc after $((SECONDS - start)) s"
    if ((rc != 0)); then
        sed 's/^/    /' "$dir/trace.log" | tail -n 40
    fi
}
