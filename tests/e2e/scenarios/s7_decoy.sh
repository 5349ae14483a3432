# shellcheck shell=bash
# Scenario 7: the pod swaps its VF for a decoy. After ADD, the pod (holding
# CAP_NET_ADMIN in its namespace) renames the real VF to hidden0 and creates a veth
# named net1 carrying the VF's alias rdma-cni:<pci>. CHECK must report the swap and
# DEL must bring the real VF (identified by its parent device) home, leaving the
# decoy in the pod. Pod default/decoy, network s7_decoy. Needs plugin_lib.sh.

scenario_decoy() {
    local dir="$E2E_OUT/s7_decoy" pci
    rc_network s7_decoy
    ip netns add decoy
    rc_cni add s7_decoy decoy "$dir" add
    rc_dump "$dir" after-add decoy
    pci=$(ip -n decoy -d -j link show net1 | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["parentdev"])')
    ip -n decoy link set net1 down
    ip -n decoy link set net1 name hidden0
    ip -n decoy link add net1 type veth peer name decoyp
    ip -n decoy link set net1 alias "rdma-cni:$pci"
    ip -n decoy link set net1 up
    rc_dump "$dir" swapped decoy
    rc_cni check s7_decoy decoy "$dir" check
    rc_cni del s7_decoy decoy "$dir" del
    rc_dump "$dir" after-del decoy
    ip netns del decoy
}
