#!/usr/bin/env bash
# Builds the real Kubernetes components the cluster tier runs (etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler, kubectl) from the
# pinned modules in gobuild/etcd and gobuild/kube, with Go 1.26, into
# $RDMA_CNI_BUILD_CACHE/<name>-<version>/<name> (default /var/cache/rdma-cni-build).
# A component already there is not rebuilt: a warm cache makes this a no-op.
# Prints one line per component: name, version, path. With --list it builds
# nothing and prints the same lines (the cluster tier finds its binaries so).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
cache=${RDMA_CNI_BUILD_CACHE:-/var/cache/rdma-cni-build}
# Go 1.26 by its full path: Debian's Go 1.19 (/usr/bin/go) builds the e2e
# runner and must not be shadowed, nor shadow this one.
go=${GO:-/usr/local/go/bin/go}
if [ "${1:-}" != --list ] && ! [ -x "$go" ]; then
	echo "build_components: no Go at $go (Go 1.26 is expected at /usr/local/go/bin/go; GO= names another)" >&2
	exit 1
fi

# The version a module pins, read from our go.mod (one place to change it).
pinned() {  # <go.mod> <module path>
	awk -v m="$2" '$1 == m && $2 ~ /^v/ { print $2; exit } $1 == "require" && $2 == m { print $3; exit }' "$1"
}
kube_version=$(pinned gobuild/kube/go.mod k8s.io/kubernetes)
etcd_version=$(pinned gobuild/etcd/go.mod go.etcd.io/etcd/server/v3)
if [ -z "$kube_version" ] || [ -z "$etcd_version" ]; then
	echo "build_components: cannot read the pinned versions from gobuild/*/go.mod" >&2
	exit 1
fi

kube_names=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
out() { echo "$cache/$1-$2/$1"; }

# The version the binaries report (kubectl version, /version, the skew checks)
# is set by ldflags in upstream's own build; without it they say v0.0.0-master.
kube_ldflags() {
	local major=${kube_version#v} minor
	minor=${major#*.}
	minor=${minor%%.*}
	major=${major%%.*}
	local x
	for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
		x+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
		x+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
	done
	echo "-s -w$x"
}

# Builds into a scratch folder and moves each binary into place only when the
# whole build succeeded, so an interrupted build never looks warm.
build_kube() {
	local missing=() name
	for name in "${kube_names[@]}"; do
		[ -x "$(out "$name" "$kube_version")" ] || missing+=("$name")
	done
	[ ${#missing[@]} -eq 0 ] && return 0
	local tmp pkgs=()
	tmp=$(mktemp -d "$cache/.kube-build.XXXXXX")
	for name in "${missing[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$name"); done
	# One go build for all four shares every common package's compilation.
	# (errexit does not reach inside a function called with ||: each step checks.)
	if ! (cd gobuild/kube && CGO_ENABLED=0 "$go" build -trimpath -ldflags="$(kube_ldflags)" -o "$tmp/" "${pkgs[@]}"); then
		rm -rf "$tmp"
		return 1
	fi
	for name in "${missing[@]}"; do
		mkdir -p "$cache/$name-$kube_version" && mv "$tmp/$name" "$(out "$name" "$kube_version")" || return 1
	done
	rmdir "$tmp"
}

build_etcd() {
	[ -x "$(out etcd "$etcd_version")" ] && return 0
	local tmp
	tmp=$(mktemp -d "$cache/.etcd-build.XXXXXX")
	if ! (cd gobuild/etcd && CGO_ENABLED=0 "$go" build -trimpath -ldflags='-s -w' -o "$tmp/etcd" go.etcd.io/etcd/server/v3); then
		rm -rf "$tmp"
		return 1
	fi
	mkdir -p "$cache/etcd-$etcd_version"
	mv "$tmp/etcd" "$(out etcd "$etcd_version")"
	rmdir "$tmp"
}

list() {
	echo "etcd $etcd_version $(out etcd "$etcd_version")"
	for name in "${kube_names[@]}"; do
		echo "$name $kube_version $(out "$name" "$kube_version")"
	done
}
if [ "${1:-}" = --list ]; then
	list
	exit 0
fi

mkdir -p "$cache"
# etcd is small beside Kubernetes: built alongside it, the two share the cores
# (linking kube-apiserver peaks near 2 GiB; the machine has 24).
build_etcd &
etcd_pid=$!
kube_status=0
build_kube || kube_status=$?
etcd_status=0
wait "$etcd_pid" || etcd_status=$?
if [ "$kube_status" -ne 0 ] || [ "$etcd_status" -ne 0 ]; then
	echo "build_components: build failed (kubernetes: $kube_status, etcd: $etcd_status)" >&2
	exit 1
fi

list
