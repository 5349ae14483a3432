# shellcheck shell=bash
# Smoke scenario: proves the guest gives us what the plugin's real-kernel tests need.
# It records facts in $E2E_OUT; test_smoke.py asserts on them. Steps whose failure
# is itself the fact under test are run with their status recorded, not fatal.
source "$E2E_SHARE/guest_setup.sh"

e2e_setup 4
pf=$E2E_PF
printf '%s\n' "${E2E_VF_PCI[@]}" >"$E2E_OUT/vf-pci.txt"
printf '%s\n' "${E2E_VF_NETDEVS[@]}" >"$E2E_OUT/vf-netdevs.txt"
cat "/sys/bus/pci/devices/$E2E_PF_PCI/sriov_totalvfs" >"$E2E_OUT/sriov-totalvfs.txt"

# VF rate limits, as the igb driver answers them.
ip link set "$pf" vf 0 max_tx_rate 100
if ip link set "$pf" vf 0 min_tx_rate 10 max_tx_rate 100 2>"$E2E_OUT/min-rate.err"; then
    echo 0 >"$E2E_OUT/min-rate.rc"
else
    echo $? >"$E2E_OUT/min-rate.rc"
fi
e2e_dump after-rate

# Soft-RoCE on VFs 2 and 3 (VF 1 goes to a pod below, which would destroy an rxe on it).
echo "$E2E_RXE" >"$E2E_OUT/rxe-loaded.txt"
if [[ $E2E_RXE == 1 ]]; then
    e2e_add_rxe rxe0 "${E2E_VF_NETDEVS[2]}"
    e2e_add_rxe rxe1 "${E2E_VF_NETDEVS[3]}"
    cat /sys/class/infiniband/rxe0/parent >"$E2E_OUT/rxe0-parent.txt"
fi
e2e_dump after-rxe

# The libcni runtime moving a real VF (by PCI address) into a pod netns.
cat >"$E2E_OUT/hostdev.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "smoke-hostdev",
  "plugins": [
    {
      "type": "host-device",
      "pciBusID": "${E2E_VF_PCI[1]}",
      "ipam": {"type": "host-local", "subnet": "10.56.0.0/24"}
    }
  ]
}
EOF

# hostdev VERB POD [cnirun flags...]: one attachment of VF 1 as net1 in netns POD.
hostdev() {
    local verb=$1 pod=$2
    shift 2
    cnirun "$verb" -conflist "$E2E_OUT/hostdev.conflist" -netns "/run/netns/$pod" \
        -id "ctr-$pod" -ifname net1 -bin-dir /usr/lib/cni \
        -args "IgnoreUnknown=true;K8S_POD_NAMESPACE=default;K8S_POD_NAME=$pod;K8S_POD_UID=uid-$pod" "$@"
}

ip netns add pod1
hostdev add pod1 >"$E2E_OUT/add.json"
ip -n pod1 -j addr show net1 >"$E2E_OUT/pod1-net1.json"
e2e_pci_netdev "${E2E_VF_PCI[1]}" >"$E2E_OUT/vf1-host-netdev-during.txt"
hostdev check pod1
hostdev del pod1
e2e_pci_netdev "${E2E_VF_PCI[1]}" >"$E2E_OUT/vf1-host-netdev-after-del.txt"
e2e_dump after-del

# Failures come back as CNI error JSON with exit status 1.
if hostdev add pod1 -id ctr-bad -bin-dir /nonexistent >"$E2E_OUT/error.json"; then
    echo 0 >"$E2E_OUT/error.rc"
else
    echo $? >"$E2E_OUT/error.rc"
fi

# A VF netdev whose netns is deleted returns to the host under its pod-side name.
ip netns add pod2
hostdev add pod2 >/dev/null
ip netns del pod2
e2e_wait_for 30 _e2e_have_netdev "${E2E_VF_PCI[1]}"
e2e_pci_netdev "${E2E_VF_PCI[1]}" >"$E2E_OUT/vf1-after-netns-del.txt"
e2e_dump end
e2e_log "smoke scenario done"
