# shellcheck shell=bash
# Scenario 2: a pod asks for min_tx_rate, which igb refuses with EINVAL. The request
# has two interfaces and the refused one is the second, so the rollback must undo a
# VF that was already fully attached (rate, move, IPAM lease, addresses). The dump
# right after the failed ADD shows the plugin's own rollback (no DEL has run).
# Pod default/minrate, network s2_min_rate. Needs plugin_lib.sh.

scenario_min_rate() {
    local dir="$E2E_OUT/s2_min_rate"
    rc_network s2_min_rate
    ip netns add minrate
    rc_cni add s2_min_rate minrate "$dir" add
    rc_dump "$dir" after-add minrate
    rc_del_netns minrate
}
