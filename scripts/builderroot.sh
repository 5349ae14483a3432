#!/bin/sh
# A stand-in, made without a registry, for conf/Containerfile's default BUILDER image
# (docker.io/library/golang:1.26-bookworm: Debian 12 with Go at /usr/local/go), kept outside
# the tree and keyed by the Go it carries. Prints its path. Root only (debootstrap, from make deps).
#
#   scripts/builderroot.sh        # the cached root, made when missing
#
# Debian 12's minimal root with the packages the Containerfile's build stage installs (so its
# apt-get has nothing left to fetch), this machine's Go 1.26 at /usr/local/go as the golang image
# has it, and this machine's extra certificate authorities (an egress proxy's, say) in its trust
# store, as an organisation's builder image would carry its own. Made in a temporary directory
# beside the cache and renamed into place, so an interrupted run never leaves a half-made root.
set -eu
CACHE=${RDMA_CNI_BUILDER_CACHE:-/var/cache/rdma-cni-build}
GO=${GO:-/usr/local/go/bin/go}
MIRROR=${RDMA_CNI_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=ca-certificates,gcc,libc6-dev,make,python3,python3-venv,python3-dev,binutils
goversion=$("$GO" env GOVERSION)
ROOT=$CACHE/bookworm-builder-$goversion-v1
if [ ! -e "$ROOT/.complete" ]; then
    mkdir -p "$CACHE"
    tmp=$(mktemp -d "$CACHE/.bookworm-builder-XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    debootstrap --variant=minbase --include="$PACKAGES" bookworm "$tmp" "$MIRROR" >&2
    if [ -d /usr/local/share/ca-certificates ]; then
        cp -a /usr/local/share/ca-certificates/. "$tmp/usr/local/share/ca-certificates/"
        chroot "$tmp" update-ca-certificates >&2
    fi
    cp -a "$(dirname "$(dirname "$GO")")" "$tmp/usr/local/go"
    rm -rf "$tmp/var/cache/apt/archives/"*.deb "$tmp/var/lib/apt/lists/"*
    touch "$tmp/.complete"
    rm -rf "$ROOT"
    mv "$tmp" "$ROOT"
    trap - EXIT
fi
echo "$ROOT"
