# shellcheck shell=bash
# Scenario 3: the pod's netns is deleted before DEL. The kernel returns the VFs to the
# host still carrying their pod-side names (net1, net1-1); DEL must find them by PCI
# address or alias and restore their names and rates.
# Pod default/gone, network s3_netns_gone. Needs plugin_lib.sh.

scenario_netns_gone() {
    local dir="$E2E_OUT/s3_netns_gone"
    rc_network s3_netns_gone
    ip netns add gone
    rc_cni add s3_netns_gone gone "$dir" add
    rc_dump "$dir" after-add gone
    ip netns del gone
    # Namespace teardown is asynchronous: wait until every VF is back in the host.
    rc_wait_vf_netdevs "${E2E_VF_PCI[@]}"
    rc_dump "$dir" netns-deleted
    # -netns still names the deleted namespace, as kubelet does after a pod died.
    rc_cni del s3_netns_gone gone "$dir" del
    rc_dump "$dir" after-del
}
