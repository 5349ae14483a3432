#!/bin/bash
# Build (or reuse) everything the QEMU end-to-end tier needs, under CACHE_DIR:
#   root/          Debian trixie minbase: QEMU 10 (for -device igb), the guest kernel
#                  and the guest userland, shared with the guest read-only over 9p
#   root.done      marker written only after a successful debootstrap
#   initrd.img     busybox initramfs that mounts root/ over 9p and runs the scenario
#   cnirun         static Go CNI runtime built from tests/e2e/cnirun with libcni
#
# Safe to run repeatedly and concurrently: the slow root build is skipped once its
# marker exists, and a lock serialises concurrent runs on the same cache.
#
# Environment:
#   RDMA_CNI_E2E_MIRROR   Debian mirror for debootstrap (default: from apt's sources)
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 CACHE_DIR" >&2
    exit 2
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$1"
cache=$(cd "$1" && pwd)
root="$cache/root"
suite=trixie
# openssl: the API stand-in serves TLS in the guest; procps: pgrep/pkill in scenarios.
# containerd (1.7, with NRI) and runc: the NRI scenarios run pods through the CRI;
# python3-grpcio: their CRI client (messages encoded by hand, no generated code);
# libre2-11 named because debootstrap cannot resolve the virtual package grpcio needs.
packages=qemu-system-x86,qemu-system-common,linux-image-amd64,python3,iproute2,rdma-core,kmod,containernetworking-plugins,openssl,procps,containerd,runc,python3-grpcio,libre2-11

if [[ $EUID -ne 0 ]]; then
    echo "prepare.sh: debootstrap and chroot need root" >&2
    exit 1
fi

# Two pytest sessions may start at once; only one may build the cache.
exec 9>"$cache/.lock"
flock 9

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# The machine may only reach Debian through the mirror apt is configured with.
mirror() {
    if [[ -n "${RDMA_CNI_E2E_MIRROR:-}" ]]; then
        echo "$RDMA_CNI_E2E_MIRROR"
        return
    fi
    local found
    found=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources \
                2>/dev/null | grep -v '^[[:space:]]*#' | grep -oE 'https?://[^ ]+/debian/?( |$)' \
                | head -n1 | tr -d ' ' || true)
    echo "${found:-http://deb.debian.org/debian}"
}

# Unmount everything at or below DIR, deepest first. debootstrap mounts /proc and
# /sys in its target and ignores failures to unmount them at exit (seen under load);
# a leftover mount would be exported to the guest and, worse, make `rm -rf` of the
# tree walk into the host's /proc or /sys.
unmount_under() {
    local dir=$1 mnt
    awk -v d="$dir" '$5 == d || index($5, d "/") == 1 { print $5 }' /proc/self/mountinfo \
        | sort -r | while read -r mnt; do
            echo "prepare: unmounting leftover $mnt" >&2
            umount "$mnt" 2>/dev/null || umount -l "$mnt"
        done
}

build_root() {
    # The marker records the package list so that adding a package rebuilds the root.
    local want="$suite $packages"
    if [[ -f "$cache/root.done" && "$(cat "$cache/root.done")" == "$want" ]]; then
        echo "prepare: root up to date ($root)"
        return
    fi
    local start url
    start=$(now)
    url=$(mirror)
    echo "prepare: debootstrap $suite from $url into $root (about a minute)"
    rm -f "$cache/root.done"
    # A half-built tree from an interrupted run cannot be trusted; start over.
    unmount_under "$root"
    unmount_under "$root.new"
    rm -rf --one-file-system "$root" "$root.new"
    debootstrap --variant=minbase --include="$packages" "$suite" "$root.new" "$url" \
        >"$cache/debootstrap.log" 2>&1 || {
        tail -n 30 "$cache/debootstrap.log" >&2
        echo "prepare: debootstrap failed, full log in $cache/debootstrap.log" >&2
        exit 1
    }
    unmount_under "$root.new"
    # Nothing in the guest needs these, and they only grow the tree QEMU exports.
    rm -rf "$root.new"/var/cache/apt/archives/*.deb
    mv "$root.new" "$root"
    echo "$want" >"$cache/root.done"
    echo "prepare: debootstrap took $(elapsed "$start") s"
}

# Print the modules needed for the given ones (dependencies first), as paths
# relative to the kernel's module directory, using modules.dep like modprobe does.
module_closure() {
    local moddir=$1
    shift
    awk -v want="$*" '
        function base(p,   n) { n = split(p, parts, "/"); sub(/\.ko(\.xz|\.zst|\.gz)?$/, "", parts[n]); return parts[n] }
        BEGIN { n = split(want, w, " "); for (i = 1; i <= n; i++) wanted[w[i]] = 1 }
        {
            sub(/:$/, "", $1); path[base($1)] = $1
            deps[base($1)] = ""
            for (i = 2; i <= NF; i++) deps[base($1)] = deps[base($1)] " " base($i)
        }
        function visit(m,   d, k, i) {
            if (m in seen) return
            seen[m] = 1
            if (!(m in path)) return
            k = split(deps[m], d, " ")
            # modules.dep lists the full closure; load the deepest ones first.
            for (i = k; i >= 1; i--) visit(d[i])
            print path[m]
        }
        END { for (i = 1; i <= n; i++) visit(w[i]) }
    ' "$moddir/modules.dep"
}

build_initrd() {
    local start kver moddir work="$cache/initrd.work"
    start=$(now)
    kver=$(basename "$(ls -d "$root"/lib/modules/* | sort -V | tail -n1)")
    moddir="$root/lib/modules/$kver"
    # A fixed work directory, cleared first, so an aborted run leaves nothing behind
    # that a later run would not clean up.
    rm -rf "$work"
    mkdir -p "$work"/{bin,proc,sys,dev,newroot,modules}
    # The initramfs has no libc: only a static busybox (package busybox-static) works.
    # ldd fails on static executables.
    if ldd /bin/busybox >/dev/null 2>&1; then
        echo "prepare: /bin/busybox is not static; install busybox-static" >&2
        exit 1
    fi
    cp /bin/busybox "$work/bin/busybox"
    local load=()
    local rel name
    while read -r rel; do
        name=$(basename "$rel")
        name=${name%.xz}
        name=${name%.zst}
        # busybox insmod cannot decompress, so store plain .ko files.
        case "$rel" in
            *.xz) xz -dc "$moddir/$rel" >"$work/modules/$name" ;;
            *.zst) zstd -qdc "$moddir/$rel" >"$work/modules/$name" ;;
            *) cp "$moddir/$rel" "$work/modules/$name" ;;
        esac
        load+=("$name")
    # virtio_pci is built into Debian's kernel; overlay makes the 9p root writable.
    done < <(module_closure "$moddir" 9p 9pnet_virtio overlay)
    printf '%s\n' "${load[@]}" >"$work/modules/order"
    cp "$here/initramfs-init.sh" "$work/init"
    chmod 755 "$work/init"
    (cd "$work" && find . -print0 | cpio --null -o -H newc --quiet) | gzip -1 >"$cache/initrd.img.new"
    mv "$cache/initrd.img.new" "$cache/initrd.img"
    rm -rf "$work"
    echo "$kver" >"$cache/kernel-version"
    echo "prepare: initramfs ($kver: ${load[*]}) took $(elapsed "$start") s"
}

build_cnirun() {
    local start
    start=$(now)
    # Debian ships libcni as GOPATH sources, not as a module; build in GOPATH mode
    # with no network so the build is reproducible on the offline CI machine.
    (
        cd "$here/cnirun"
        GO111MODULE=off GOPROXY=off GOFLAGS= GOPATH=/usr/share/gocode \
            GOCACHE="$cache/go-build" CGO_ENABLED=0 \
            go build -trimpath -ldflags='-s -w' -o "$cache/cnirun.new" .
    )
    mv "$cache/cnirun.new" "$cache/cnirun"
    echo "prepare: cnirun build took $(elapsed "$start") s"
}

build_root
build_initrd
build_cnirun
