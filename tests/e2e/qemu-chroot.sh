#!/bin/bash
# qemu-chroot.sh ROOT SHARE INITRD QEMU-ARGS...
#
# Run trixie's qemu-system-x86_64 (the host's Debian 12 QEMU has no igb device)
# inside the cached trixie tree ROOT. Inside the chroot the per-boot SHARE appears as
# /mnt/share and INITRD as /mnt/boot/initrd.img; QEMU-ARGS use those paths.
#
# The mounts that make them visible live in a private mount namespace, so they vanish
# with QEMU and never leak into the host or into the cached tree, and several guests
# can run at once from the same ROOT. Everything is exec'd, so the caller's PID is
# QEMU's PID and killing it stops the guest.
set -euo pipefail

if [[ -z "${E2E_QEMU_NS:-}" ]]; then
    E2E_QEMU_NS=1 exec unshare --mount --propagation private "$0" "$@"
fi

root=$1
share=$2
initrd=$3
shift 3

# /mnt is empty in minbase; a tmpfs there keeps the cached tree unmodified.
mount -t tmpfs -o size=64m,mode=0755 e2e-mnt "$root/mnt"
mkdir "$root/mnt/share" "$root/mnt/boot"
mount --bind "$share" "$root/mnt/share"
cp "$initrd" "$root/mnt/boot/initrd.img"
# glib and QEMU look things up under /proc/self.
mount -t proc proc "$root/proc"
exec chroot "$root" qemu-system-x86_64 "$@"
