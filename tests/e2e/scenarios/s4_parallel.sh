# shellcheck shell=bash
# Scenario 4: five pods with one interface each ADD at the same time on a node with
# four VFs; then all five DEL at the same time (the refused pod's DEL included, as a
# runtime sends it after a failed ADD).
# Pods default/par0..par4, network s4_parallel. Needs plugin_lib.sh.

scenario_parallel() {
    local dir="$E2E_OUT/s4_parallel" pod pid pids=()
    local pods=(par0 par1 par2 par3 par4)
    rc_network s4_parallel
    for pod in "${pods[@]}"; do
        ip netns add "$pod"
    done
    for pod in "${pods[@]}"; do
        rc_cni add s4_parallel "$pod" "$dir/$pod" add &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do
        wait "$pid"
    done
    rc_dump "$dir" after-add "${pods[@]}"
    pids=()
    for pod in "${pods[@]}"; do
        rc_cni del s4_parallel "$pod" "$dir/$pod" del &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do
        wait "$pid"
    done
    rc_dump "$dir" after-del "${pods[@]}"
    rc_del_netns "${pods[@]}"
}
