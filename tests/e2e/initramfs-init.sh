#!/bin/busybox sh
# /init of the e2e initramfs (busybox ash, PID 1 in the guest).
#
# The guest has no disk: its root is the host's debootstrapped trixie tree, exported
# read-only over 9p (mount_tag=root). An overlay with a tmpfs upper layer makes it
# writable inside the guest (CNI state, /etc/cni, netns mounts) while the cached
# tree on the host stays pristine. The per-boot share (mount_tag=share) appears at
# /mnt/share; the scenario there runs chrooted, and its exit status is written back
# to the share before the guest powers itself off.
#
# No `set -euo pipefail` here, unlike the other scripts: if PID 1 exits, the kernel
# panics and the reason is lost. Every step is checked and reported instead.

/bin/busybox --install -s /bin
export PATH=/bin

say() { echo "e2e-init: $*" >/dev/console; }

halt() {
    sync
    # -f: there is no init system to ask; talk to the kernel directly.
    poweroff -f
    # poweroff may be refused very early; sysrq is the last resort.
    echo o >/proc/sysrq-trigger
    sleep 10
}

fail() {
    say "FATAL: $*"
    halt
}

mount -t proc proc /proc || fail "mount /proc"
mount -t sysfs sysfs /sys || fail "mount /sys"
mount -t devtmpfs devtmpfs /dev || fail "mount /dev"

say "up at $(cut -d' ' -f1 /proc/uptime) s"

for m in $(cat /modules/order); do
    insmod "/modules/$m" || fail "insmod $m"
done

mkdir -p /lower /rw
# cache=loose is safe for the root: the host does not change it while a guest runs,
# and it saves a 9p round trip per lookup, which is most of TCG start-up time.
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 root /lower \
    || fail "mount 9p root"
mount -t tmpfs -o mode=0755 tmpfs /rw || fail "mount tmpfs for overlay"
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot \
    || fail "mount overlay root"

mkdir -p /newroot/mnt/share
# No caching for the share: the host reads results right after power-off.
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 share /newroot/mnt/share \
    || fail "mount 9p share"

mount -t proc proc /newroot/proc || fail "mount guest /proc"
mount -t sysfs sysfs /newroot/sys || fail "mount guest /sys"
mount -t devtmpfs devtmpfs /newroot/dev || fail "mount guest /dev"
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts devpts /newroot/dev/pts || fail "mount guest /dev/pts"
# /dev/shm: Python's multiprocessing and some tools expect it.
mount -t tmpfs tmpfs /newroot/dev/shm || fail "mount guest /dev/shm"
# Clean /tmp and /run on their own tmpfs, as on a booted system.
mount -t tmpfs tmpfs /newroot/tmp || fail "mount guest /tmp"
mount -t tmpfs -o mode=0755 tmpfs /newroot/run || fail "mount guest /run"

# The kernel loads modules on demand (crypto for rdma_rxe, rtnl-link-* for `ip link
# add`) by running its modprobe helper in PID 1's root, i.e. this initramfs, which
# has no modules tree. Forward those requests to the real root's kmod.
mkdir -p /sbin
printf '#!/bin/sh\nexec chroot /newroot /sbin/modprobe "$@"\n' >/sbin/modprobe
chmod 755 /sbin/modprobe
echo /sbin/modprobe >/proc/sys/kernel/modprobe || say "warning: cannot set the modprobe helper"

ip link set lo up || say "warning: could not bring lo up"
hostname e2e-guest

share=/newroot/mnt/share
if [ ! -f "$share/scenario.sh" ]; then
    fail "no scenario.sh in the share"
fi

start=$(cut -d' ' -f1 /proc/uptime)
say "scenario start at $start s"
# tee keeps a copy without kernel messages; ash's pipefail carries the scenario's
# status through it.
set -o pipefail
chroot /newroot /usr/bin/env -i \
    HOME=/root TERM=dumb LANG=C.UTF-8 E2E_SHARE=/mnt/share \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/bash /mnt/share/scenario.sh </dev/null 2>&1 | tee "$share/scenario.log" >/dev/console
rc=$?
set +o pipefail
end=$(cut -d' ' -f1 /proc/uptime)
say "scenario exit $rc at $end s"
printf 'scenario_start=%s\nscenario_end=%s\n' "$start" "$end" >"$share/guest-times"
# Written last: its presence means the scenario really finished.
echo "$rc" >"$share/exit-code"
umount "$share" 2>/dev/null || true
halt
