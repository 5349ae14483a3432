# shellcheck shell=bash
# Scenario 5: RDMA isolation with soft-RoCE (rxe) devices on the VFs.
#
# scenario_rdma_exclusive runs first in the boot, with rxe0..rxe3 already on the four
# VFs: `rdma system set netns exclusive` is refused (EBUSY) while any other netns
# exists, which it records on the way. In exclusive mode the kernel cannot move rxe
# (no disassociate_ucontext: EOPNOTSUPP), so ADD with rdmaIsolation required, and with
# auto (which moves in exclusive mode), must fail with code 105 and roll back.
# Pods default/rxe-required and default/rxe-auto.
#
# scenario_rdma_shared runs in shared mode (the default) on a node without RDMA
# devices: it puts rxe0 and rxe1 on the first two VFs; auto leaves the device shared,
# and the kernel destroys an rxe device whose netdev leaves the host. While the pod
# holds its VF it also takes scenario 6's allocated inventory (inventory.json, next to
# dump-after-add). Pod default/rxe-shared.
# Needs plugin_lib.sh.

scenario_rdma_exclusive() {
    local dir="$E2E_OUT/s5_rdma_exclusive" mode pod rc=0
    rdma system >"$dir/mode-initial.txt"
    # The kernel's rule, shown once: no switch while another netns exists.
    ip netns add probe
    rdma system set netns exclusive 2>"$dir/ebusy.err" || rc=$?
    echo "$rc" >"$dir/ebusy.rc"
    rc_del_netns probe
    e2e_wait_for 60 rc_rdma_mode exclusive
    rc_dump "$dir" before
    for mode in required auto; do
        pod="rxe-$mode"
        rc_network "s5_rdma_exclusive-$mode" "$mode"
        ip netns add "$pod"
        rc_cni add "s5_rdma_exclusive-$mode" "$pod" "$dir/$mode" add
        rc_dump "$dir" "after-add-$mode" "$pod"
        rc_del_netns "$pod"
    done
}

scenario_rdma_shared() {
    local dir="$E2E_OUT/s5_rdma_shared" dev
    rc_network s5_rdma_shared auto
    # Two rxe devices: the one on the VF the pod gets, and a bystander that must survive.
    e2e_add_rxe rxe0 "$(e2e_pci_netdev "${E2E_VF_PCI[0]}")"
    e2e_add_rxe rxe1 "$(e2e_pci_netdev "${E2E_VF_PCI[1]}")"
    rc_dump "$dir" before
    ip netns add rxe-shared
    rc_cni add s5_rdma_shared rxe-shared "$dir" add
    rc_dump "$dir" after-add rxe-shared
    # Scenario 6: the inventory at the same moment, with the records (--config).
    rc_inventory "$dir/inventory.json" s5_rdma_shared
    rc_cni del s5_rdma_shared rxe-shared "$dir" del
    rc_dump "$dir" after-del rxe-shared
    rc_del_netns rxe-shared
    # Leave no RDMA device behind for whatever runs next.
    for dev in /sys/class/infiniband/*; do
        if [[ -e $dev ]]; then
            rdma link delete "${dev##*/}"
        fi
    done
}
