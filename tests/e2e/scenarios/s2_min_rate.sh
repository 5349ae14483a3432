# shellcheck shell=bash
# Scenario 2: a pod asks for min_tx_rate, which igb refuses with EINVAL. The request
# has two interfaces and the refused one is the second, so the rollback must undo a
# VF that was already fully attached (rate, move, IPAM lease, addresses).
# Pod default/minrate, network s2_min_rate. Needs plugin_lib.sh.

scenario_min_rate() {
    local dir="$E2E_OUT/s2_min_rate"
    rc_network s2_min_rate
    rc_dump "$dir/before"
    ip netns add minrate
    rc_cni add s2_min_rate minrate "$dir" add
    # The node right after the failed ADD: the plugin's own rollback, nothing else.
    rc_dump "$dir/after-add" minrate
    # A runtime DELs after a failed ADD; that must succeed and change nothing.
    rc_cni del s2_min_rate minrate "$dir" del
    rc_dump "$dir/after-del" minrate
    rc_del_netns minrate
}
