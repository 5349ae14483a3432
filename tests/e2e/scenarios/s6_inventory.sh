# shellcheck shell=bash
# Scenario 6: `rdma-cni inventory` next to the kernel's own view of the same moment.
# Here the idle node in exclusive mode with rxe on every VF, without --config
# (inventory-exclusive.json with dump-exclusive/). The allocated state (shared mode,
# a pod holding a rate-capped VF, --config so the records are read) is taken inside
# scenario_rdma_shared, which has that pod anyway: s5_rdma_shared/inventory.json.
# Needs plugin_lib.sh.

scenario_inventory_exclusive() {
    local dir="$E2E_OUT/s6_inventory"
    rc_dump "$dir" exclusive
    rc_inventory "$dir/inventory-exclusive.json"
}
