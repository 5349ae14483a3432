# shellcheck shell=bash
# A real reboot (test_reboot.py boots the guest twice on one share): the plugin's state
# directory and host-local's leases live on the share, under persist/, as
# /var/lib survives a node's reboot; everything else (/run, the lock, the pod's netns,
# the VFs and the kernel's boot id) is new at every boot.
#   phase 1: ADD pod default/reboot, then the guest powers off with the pod still there;
#   phase 2: the VFs created again, then the first verb of the boot, a STATUS, run as a
#            runtime runs the plugin; the record of the earlier boot must be released.
# Results under out/reboot/: boot_id, the phase's cnirun or STATUS outputs, dumps.
source "$E2E_SHARE/guest_setup.sh"
scenarios="$E2E_IN/scenarios"
source "$scenarios/plugin_lib.sh"

RC_STATE="$E2E_SHARE/persist/state"
RC_IPAM="$E2E_SHARE/persist/ipam"
phase=$(cat "$E2E_IN/phase")
dir="$E2E_OUT/reboot"
mkdir -p "$dir" "$E2E_SHARE/persist"
cat /proc/sys/kernel/random/boot_id >"$dir/boot_id"

rc_install
rc_start_api
e2e_setup 4
rc_node_facts
rc_wait_api
rc_network reboot

if [[ $phase == 1 ]]; then
    ip netns add reboot
    rc_cni add reboot reboot "$dir" add
    rc_dump "$dir" after-add reboot
else
    rc_dump "$dir" before-status
    # STATUS needs CNI 1.1.0: the network's single config, in that version.
    plugin=$(rc_plugin_json reboot auto)
    printf '{"cniVersion": "1.1.0", "name": "reboot", %s\n' "${plugin#\{}" >"$dir/status-conf.json"
    rc=0
    CNI_COMMAND=STATUS CNI_PATH="$RC_BIN" "$RC_BIN/rdma-cni" <"$dir/status-conf.json" \
        >"$dir/status.json" 2>"$dir/status.err" || rc=$?
    echo "$rc" >"$dir/status.rc"
    cp "$RC_LOGS/reboot.log" "$dir/plugin-reboot.log" 2>/dev/null || true
    rc_dump "$dir" after-status
    cp "$RC_STATE/boot-checked" "$dir/boot-checked" 2>/dev/null || true
fi
rc_stop_api
