# shellcheck shell=bash
# One boot for the six plugin scenarios of test_plugin.py (a boot plus e2e_setup costs
# ~20 s of both host cores, so they share one). Order matters:
#
#   1. exclusive RDMA mode first: the kernel switches modes only while no netns other
#      than the initial one exists, so nothing may have created a pod netns yet
#      (s5_rdma_exclusive, then the exclusive inventory);
#   2. back to shared mode (the default) for everything else, once the exclusive
#      scenario's namespaces are really gone;
#   3. the shared-mode scenarios, each starting from and returning to a node with
#      four free VFs under their original names; rxe devices are removed before
#      them because moving a VF netdev destroys an rxe on it in shared mode.
#
# Every scenario runs under rc_run: its results land in $E2E_OUT/<name>/ with a status
# file, and a broken scenario does not stop the ones after it.
source "$E2E_SHARE/guest_setup.sh"
scenarios="$E2E_IN/scenarios"
source "$scenarios/plugin_lib.sh"
source "$scenarios/s1_rates.sh"
source "$scenarios/s2_min_rate.sh"
source "$scenarios/s3_netns_gone.sh"
source "$scenarios/s4_parallel.sh"
source "$scenarios/s5_rdma.sh"
source "$scenarios/s6_inventory.sh"

e2e_setup 4
rc_setup

# Soft-RoCE on every VF for the exclusive-mode and idle-inventory scenarios.
if [[ $E2E_RXE == 1 ]]; then
    for i in "${!E2E_VF_NETDEVS[@]}"; do
        e2e_add_rxe "rxe$i" "${E2E_VF_NETDEVS[$i]}"
    done
fi

rc_run s5_rdma_exclusive scenario_rdma_exclusive
rc_run s6_inventory/exclusive scenario_inventory_idle exclusive

# The exclusive scenario deleted its namespaces; teardown is asynchronous, so retry.
if ! e2e_wait_for 60 rc_rdma_mode shared; then
    e2e_log "WARNING: could not return to shared RDMA netns mode"
fi
rdma system >"$E2E_OUT/mode-shared-phase.txt"

rc_run s6_inventory/shared scenario_inventory_idle shared
for dev in /sys/class/infiniband/*; do
    if [[ -e $dev ]]; then
        # Not fatal: the scenarios after this assert on the RDMA devices they find.
        rdma link delete "$(basename "$dev")" || e2e_log "WARNING: cannot delete $(basename "$dev")"
    fi
done

rc_run s1_rates scenario_rates
rc_run s6_inventory/allocated scenario_inventory_allocated
rc_run s2_min_rate scenario_min_rate
rc_run s3_netns_gone scenario_netns_gone
rc_run s4_parallel scenario_parallel
rc_run s5_rdma_shared scenario_rdma_shared

rc_stop_api
e2e_dump end
e2e_log "plugin scenarios done"
