# shellcheck shell=bash
# Scenario 6: `rdma-cni inventory` next to the kernel's own view, in three states:
#   exclusive  RDMA exclusive mode, rxe on every VF, nothing allocated (no --config)
#   shared     shared mode, rxe on every VF, nothing allocated (no --config, and --config)
#   allocated  shared mode, pod default/inv holding two VFs with rates (--config, so
#              the inventory sees the records in stateDir)
# Results in $E2E_OUT/s6_inventory/LABEL/ (run as `rc_run s6_inventory/LABEL ...`).
# Needs plugin_lib.sh.

scenario_inventory_idle() {
    local dir="$E2E_OUT/s6_inventory/$1"
    rc_network s6_inventory
    rc_dump "$dir"
    rc_inventory "$dir/inventory.json"
    rc_inventory "$dir/inventory-config.json" s6_inventory
}

scenario_inventory_allocated() {
    local dir="$E2E_OUT/s6_inventory/allocated"
    rc_network s6_inventory-allocated
    ip netns add inv
    rc_cni add s6_inventory-allocated inv "$dir/cni" add
    rc_dump "$dir" inv
    rc_inventory "$dir/inventory-config.json" s6_inventory-allocated
    rc_cni del s6_inventory-allocated inv "$dir/cni" del
    rc_del_netns inv
}
