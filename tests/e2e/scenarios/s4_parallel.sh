# shellcheck shell=bash
# Scenario 4: five pods with one interface each ADD at the same time on a node with
# four VFs; then all five DEL at the same time.
# Pods default/par0..par4, network s4_parallel. Needs plugin_lib.sh.

scenario_parallel() {
    local dir="$E2E_OUT/s4_parallel" i pids=()
    local pods=(par0 par1 par2 par3 par4)
    rc_network s4_parallel
    rc_dump "$dir/before"
    for i in "${pods[@]}"; do
        ip netns add "$i"
    done
    for i in "${pods[@]}"; do
        rc_cni add s4_parallel "$i" "$dir/$i" add &
        pids+=($!)
    done
    for i in "${pids[@]}"; do
        wait "$i"
    done
    rc_dump "$dir/after-add" "${pods[@]}"
    pids=()
    for i in "${pods[@]}"; do
        rc_cni del s4_parallel "$i" "$dir/$i" del &
        pids+=($!)
    done
    for i in "${pids[@]}"; do
        wait "$i"
    done
    rc_dump "$dir/after-del" "${pods[@]}"
    rc_del_netns "${pods[@]}"
}
