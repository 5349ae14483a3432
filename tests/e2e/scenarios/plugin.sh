# shellcheck shell=bash
# One boot for the eight plugin scenarios of test_plugin.py (a boot plus e2e_setup costs
# ~20 s of both host cores, and every plugin run several seconds under TCG, so they
# share one boot and as few runs as they can). Order matters:
#
#   1. exclusive RDMA mode first: the kernel switches modes only while no netns other
#      than the initial one exists, so nothing may have created a pod netns yet
#      (s5_rdma_exclusive, then the exclusive inventory of s6_inventory);
#   2. back to shared mode (the default) once those namespaces are really gone, and
#      the rxe devices removed: in shared mode moving a VF netdev destroys an rxe on
#      it, which would make "the node is restored" meaningless;
#   3. the baseline dump (dump-baseline/) every shared-mode scenario must return to,
#      then those scenarios, each starting from four free VFs under their original
#      names.
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
source "$scenarios/s7_decoy.sh"
source "$scenarios/s8_stale.sh"

rc_install
rc_start_api
e2e_setup 4
rc_node_facts
rc_wait_api

# Soft-RoCE on every VF for the exclusive-mode scenarios.
if [[ $E2E_RXE == 1 ]]; then
    for i in "${!E2E_VF_NETDEVS[@]}"; do
        e2e_add_rxe "rxe$i" "${E2E_VF_NETDEVS[$i]}"
    done
fi

rc_run s5_rdma_exclusive scenario_rdma_exclusive
rc_run s6_inventory scenario_inventory_exclusive

# Teardown of the exclusive scenario's namespaces is asynchronous, so retry.
if ! e2e_wait_for 60 rc_rdma_mode shared; then
    e2e_log "WARNING: could not return to shared RDMA netns mode"
fi
for dev in /sys/class/infiniband/*; do
    if [[ -e $dev ]]; then
        # Not fatal: the scenarios after this assert on the RDMA devices they find.
        rdma link delete "${dev##*/}" || e2e_log "WARNING: cannot delete ${dev##*/}"
    fi
done
rc_dump "$E2E_OUT" baseline

rc_run s1_rates scenario_rates
rc_run s2_min_rate scenario_min_rate
rc_run s3_netns_gone scenario_netns_gone
rc_run s4_parallel scenario_parallel
rc_run s5_rdma_shared scenario_rdma_shared
rc_run s7_decoy scenario_decoy
rc_run s8_stale scenario_stale

rc_stop_api
e2e_log "plugin scenarios done"
