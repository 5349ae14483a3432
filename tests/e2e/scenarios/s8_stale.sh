# shellcheck shell=bash
# Scenario 8: a VF came home without its record (the record was lost, so nothing
# restored its PF-side settings) still on another network's VLAN and trusted. Every
# VF is set so through the PF, as such leftovers look; a network that sets neither
# must give its pod the kernel's defaults (VLAN 0, trust off), and DEL puts back what
# ADD found. Then the VFs are reset by hand for the node's baseline. Pod
# default/stale, network s8_stale. Needs plugin_lib.sh.

scenario_stale() {
    local dir="$E2E_OUT/s8_stale" i
    rc_network s8_stale
    for i in "${!E2E_VF_PCI[@]}"; do
        ip link set "$E2E_PF" vf "$i" vlan 42 trust on
    done
    ip netns add stale
    rc_cni add s8_stale stale "$dir" add
    rc_dump "$dir" after-add stale
    rc_cni del s8_stale stale "$dir" del
    rc_dump "$dir" after-del stale
    for i in "${!E2E_VF_PCI[@]}"; do
        ip link set "$E2E_PF" vf "$i" vlan 0 trust off
    done
    rc_dump "$dir" reset stale
    ip netns del stale
}
