# shellcheck shell=bash
# One boot for the NRI scenarios of test_nri.py: containerd 1.7 (trixie's, NRI
# enabled) with rdma-cni as its CRI network, the node agent's NRI plugin, and pods
# run through the CRI by scenarios/nri_cri.py (which also restarts, freezes and
# stops the agent, and restarts containerd under it). Soft-RoCE (rxe) on each pod's VF, made inside the pod's
# namespace in shared mode, is the real RDMA device the agent must find.
#
# Results under $E2E_OUT/nri/: results.json (the driver's facts), capture.jsonl
# (every byte between the agent and containerd's nri.sock on the first agent
# connection, through the recording relay), agent.log, containerd.log, the
# plugin's log and dump-after/ (the kernel's view at the end).
source "$E2E_SHARE/guest_setup.sh"
scenarios="$E2E_IN/scenarios"
source "$scenarios/plugin_lib.sh"

NRI_OUT="$E2E_OUT/nri"
NRI_SOCKET=/var/run/nri/nri.sock
NRI_RECORD_SOCKET=/run/nri-record.sock
CRI_SOCKET=/run/containerd/containerd.sock
mkdir -p "$NRI_OUT"

rc_install
rc_start_api
e2e_setup 2
# rdma_cm's character device (/dev/infiniband/rdma_cm) comes with rdma_ucm.
modprobe rdma_ucm || e2e_log "WARNING: no rdma_ucm"
rc_node_facts

# runc needs the cgroup v2 hierarchy (device rules are eBPF programs there); the
# guest's /init mounts none. containerd's overlayfs snapshots cannot live on the
# guest's overlay root: tmpfs under them.
mount -t cgroup2 none /sys/fs/cgroup
mkdir -p /var/lib/containerd /etc/containerd /run/containerd
mount -t tmpfs tmpfs /var/lib/containerd

rc_network nri
# containerd runs the loopback plugin for every pod before the CRI network.
ln -sf /usr/lib/cni/loopback "$RC_BIN/loopback"
# containerd loads the first configuration of the directory: only the conflist.
rm -f "$RC_CONF/nri.json"

cat >/etc/containerd/config.toml <<TOML
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing",
]

[grpc]
  address = "$CRI_SOCKET"

# NRI is off by default in containerd 1.7; its timeouts are left at their defaults.
[plugins."io.containerd.nri.v1.nri"]
  disable = false
  disable_connections = false
  socket_path = "$NRI_SOCKET"
  plugin_path = "/opt/nri/plugins"
  plugin_config_path = "/etc/nri/conf.d"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "docker.io/library/rdma-cni-busybox:e2e"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$RC_BIN"
    conf_dir = "$RC_CONF"
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
TOML

containerd --config /etc/containerd/config.toml >"$NRI_OUT/containerd.log" 2>&1 &
# nri_cri.py restarts containerd (same command line) and writes the new pid here.
CONTAINERD_PIDFILE=/run/containerd-e2e.pid
echo $! >"$CONTAINERD_PIDFILE"
e2e_wait_for 60 test -S "$CRI_SOCKET"
e2e_wait_for 30 test -S "$NRI_SOCKET"
e2e_log "containerd up: $(containerd --version)"
ctr -n k8s.io images import "$E2E_IN/busybox.tar" >"$NRI_OUT/ctr-import.txt" 2>&1

python3 "$scenarios/nri_record.py" --listen "$NRI_RECORD_SOCKET" --upstream "$NRI_SOCKET" \
    --out "$NRI_OUT/capture.jsonl" >"$NRI_OUT/record.out" 2>"$NRI_OUT/record.err" &
RECORD_PID=$!
e2e_wait_for 30 test -S "$NRI_RECORD_SOCKET"

rc_wait_api
api_port=$(sed -n 's/^ready https:\/\/[^:]*:\([0-9]*\).*/\1/p' "$E2E_OUT/apiserver.out")
mkdir -p /run/agent/sa
cp "$RC_API/token" /run/agent/sa/token
cp "$RC_API/ca.crt" /run/agent/sa/ca.crt

python3 "$scenarios/nri_cri.py" --out "$NRI_OUT" --cri-socket "$CRI_SOCKET" --nri-socket "$NRI_SOCKET" \
    --record-socket "$NRI_RECORD_SOCKET" --plugin "$RC_BIN/rdma-cni" --state-dir "$RC_STATE" \
    --network-config "$RC_CONF/nri.conflist" --api-kubeconfig "$RC_API/kubeconfig" --api-port "$api_port" \
    --sa-dir /run/agent/sa --containerd-log "$NRI_OUT/containerd.log" \
    --containerd-config /etc/containerd/config.toml --containerd-pidfile "$CONTAINERD_PIDFILE" 2>&1 | tee "$NRI_OUT/driver.log"

rc_dump "$NRI_OUT" after
cp "$RC_LOGS"/nri.log "$NRI_OUT/plugin.log" 2>/dev/null || true
kill "$RECORD_PID" "$(cat "$CONTAINERD_PIDFILE")" 2>/dev/null || true
rc_stop_api
e2e_log "nri scenarios done"
