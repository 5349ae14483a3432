# shellcheck shell=bash
# Scenario 1: a pod asks for two interfaces with max_tx_rate 100 and 200 Mbit/s.
# ADD, CHECK and DEL through libcni. Compared with the boot's baseline dump.
# Pod default/rates, network s1_rates. Needs plugin_lib.sh.

scenario_rates() {
    local dir="$E2E_OUT/s1_rates"
    rc_network s1_rates
    ip netns add rates
    rc_cni add s1_rates rates "$dir" add
    rc_dump "$dir" after-add rates
    # CHECK gets libcni's cached ADD result as prevResult, as from a runtime.
    rc_cni check s1_rates rates "$dir" check
    rc_cni del s1_rates rates "$dir" del
    rc_dump "$dir" after-del rates
    rc_del_netns rates
}
