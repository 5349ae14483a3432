#!/bin/sh
# The old-root tier's Debian 11 (bullseye, glibc 2.31) root, made once and kept
# outside the tree. Prints its path. Root only (debootstrap, from make deps).
#
#   scripts/oldroot.sh            # the cached root, made when missing
#
# Made in a temporary directory beside the cache and renamed into place, so an
# interrupted run never leaves a half-made root that looks finished.
set -eu
CACHE=${RDMA_CNI_OLDROOT_CACHE:-/var/cache/rdma-cni-build}
ROOT=$CACHE/bullseye-root-v1
MIRROR=${RDMA_CNI_DEBIAN_MIRROR:-http://deb.debian.org/debian}
if [ ! -e "$ROOT/.complete" ]; then
    mkdir -p "$CACHE"
    tmp=$(mktemp -d "$CACHE/.bullseye-root-XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    debootstrap --variant=minbase bullseye "$tmp" "$MIRROR" >&2
    touch "$tmp/.complete"
    rm -rf "$ROOT"
    mv "$tmp" "$ROOT"
    trap - EXIT
fi
echo "$ROOT"
