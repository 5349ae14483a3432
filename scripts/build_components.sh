#!/usr/bin/env bash
# Builds the real Kubernetes components the cluster tier runs (etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler, kubectl) from the
# pinned modules in gobuild/etcd and gobuild/kube, with Go 1.26, into
# $RDMA_CNI_BUILD_CACHE/<name>-<version>/<name> (default /var/cache/rdma-cni-build).
# With --node it builds the node tier's instead: kubelet (gobuild/kube, the same
# Kubernetes), containerd 2.x with its runc shim and ctr (gobuild/containerd),
# Multus' thick and thin plugins (gobuild/multus) and crictl (gobuild/crictl).
# A component already there is not rebuilt: a warm cache makes this a no-op.
# Prints one line per component: name, version, path. With --list it builds
# nothing and prints the same lines (the cluster and node tiers find their
# binaries so): `--list` the control plane's, `--list --node` the node's.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
cache=${RDMA_CNI_BUILD_CACHE:-/var/cache/rdma-cni-build}
# Go 1.26 by its full path: Debian's Go 1.19 (/usr/bin/go) builds the e2e
# runner and must not be shadowed, nor shadow this one.
go=${GO:-/usr/local/go/bin/go}
list_only=false node=false
for arg in "$@"; do
	case $arg in
	--list) list_only=true ;;
	--node) node=true ;;
	*) echo "build_components: unknown option $arg (--list, --node)" >&2; exit 2 ;;
	esac
done
if ! $list_only && ! [ -x "$go" ]; then
	echo "build_components: no Go at $go (Go 1.26 is expected at /usr/local/go/bin/go; GO= names another)" >&2
	exit 1
fi

# The version a module pins, read from our go.mod (one place to change it).
pinned() {  # <go.mod> <module path>
	awk -v m="$2" '$1 == m && $2 ~ /^v/ { print $2; exit } $1 == "require" && $2 == m { print $3; exit }' "$1" 2>/dev/null || true
}
kube_version=$(pinned gobuild/kube/go.mod k8s.io/kubernetes)
etcd_version=$(pinned gobuild/etcd/go.mod go.etcd.io/etcd/server/v3)
if $node; then
	containerd_version=$(pinned gobuild/containerd/go.mod github.com/containerd/containerd/v2)
	multus_version=$(pinned gobuild/multus/go.mod gopkg.in/k8snetworkplumbingwg/multus-cni.v4)
	crictl_version=$(pinned gobuild/crictl/go.mod sigs.k8s.io/cri-tools)
fi
if [ -z "$kube_version" ] || [ -z "$etcd_version" ] || { $node &&
	{ [ -z "$containerd_version" ] || [ -z "$multus_version" ] || [ -z "$crictl_version" ]; }; }; then
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

# The node's: one go build per module for the packages whose binary is
# missing, each binary moved into place only when that build succeeded.
# <module dir> <version> <ldflags> <name=package>...
build_module() {
	local dir=$1 version=$2 ldflags=$3 missing=() pkgs=() spec name pkg
	shift 3
	for spec in "$@"; do
		name=${spec%%=*}
		[ -x "$(out "$name" "$version")" ] || missing+=("$spec")
	done
	[ ${#missing[@]} -eq 0 ] && return 0
	local tmp
	tmp=$(mktemp -d "$cache/.node-$(basename "$dir")-build.XXXXXX")
	for spec in "${missing[@]}"; do pkgs+=("${spec#*=}"); done
	# Static, as each project's own release builds them: CGO_ENABLED=0 also
	# leaves out containerd's btrfs snapshotter (its files need cgo).
	if ! (cd "$dir" && CGO_ENABLED=0 "$go" build -trimpath -ldflags="$ldflags" -o "$tmp/" "${pkgs[@]}"); then
		rm -rf "$tmp"
		return 1
	fi
	for spec in "${missing[@]}"; do
		name=${spec%%=*}
		pkg=${spec#*=}
		mkdir -p "$cache/$name-$version" && mv "$tmp/$(basename "$pkg")" "$(out "$name" "$version")" || return 1
	done
	rm -rf "$tmp"
}

containerd_pkg=github.com/containerd/containerd/v2
multus_pkg=gopkg.in/k8snetworkplumbingwg/multus-cni.v4
# What each binary is called where its project installs it (multus' image has
# passthru-cni as bin/passthru, which install_multus copies to the node).
kubelet_specs=(kubelet=k8s.io/kubernetes/cmd/kubelet)
containerd_specs=(containerd=$containerd_pkg/cmd/containerd
	containerd-shim-runc-v2=$containerd_pkg/cmd/containerd-shim-runc-v2 ctr=$containerd_pkg/cmd/ctr)
multus_specs=(multus-daemon=$multus_pkg/cmd/multus-daemon multus-shim=$multus_pkg/cmd/multus-shim
	multus=$multus_pkg/cmd/multus install_multus=$multus_pkg/cmd/install_multus
	thin_entrypoint=$multus_pkg/cmd/thin_entrypoint passthru=$multus_pkg/cmd/passthru-cni)
crictl_specs=(crictl=sigs.k8s.io/cri-tools/cmd/crictl)

# The sandbox ("pause") image's binary, as Kubernetes builds it (build/pause/Makefile: static,
# -Os), from the C source in the pinned Kubernetes module. Its version is the TAG that Makefile
# names (checked at build time, so --list needs neither Go nor the module).
pause_version=v3.10.2
build_pause() {
	[ -x "$(out pause "$pause_version")" ] && return 0
	local dir tmp tag
	dir=$(cd gobuild/kube && "$go" mod download -json k8s.io/kubernetes | awk -F'"' '$2 == "Dir" { print $4 }')
	[ -n "$dir" ] || return 1
	tag=v$(awk '$1 == "TAG" && $2 == "?=" { print $3; exit }' "$dir/build/pause/Makefile")
	if [ "$tag" != "$pause_version" ]; then
		echo "build_components: Kubernetes $kube_version builds pause $tag, not $pause_version: update pause_version" >&2
		return 1
	fi
	tmp=$(mktemp -d "$cache/.node-pause-build.XXXXXX")
	if ! "${CC:-cc}" -Os -Wall -Werror -static -DVERSION="$pause_version" -o "$tmp/pause" "$dir/build/pause/linux/pause.c"; then
		rm -rf "$tmp"
		return 1
	fi
	mkdir -p "$cache/pause-$pause_version" && mv "$tmp/pause" "$(out pause "$pause_version")" && rmdir "$tmp"
}

build_node() {
	# The version each reports, set where the projects' own builds set it.
	build_module gobuild/containerd "$containerd_version" \
		"-s -w -X $containerd_pkg/version.Version=$containerd_version -X $containerd_pkg/version.Package=$containerd_pkg" \
		"${containerd_specs[@]}" || return 1
	build_module gobuild/multus "$multus_version" "-s -w -X $multus_pkg/pkg/multus.version=$multus_version" \
		"${multus_specs[@]}" || return 1
	build_module gobuild/crictl "$crictl_version" "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=$crictl_version" \
		"${crictl_specs[@]}" || return 1
	# Last: the rest of it compiles only if `make components` has not already.
	build_module gobuild/kube "$kube_version" "$(kube_ldflags)" "${kubelet_specs[@]}" || return 1
	build_pause
}

list_specs() {  # <version> <name=package>...
	local version=$1 spec
	shift
	for spec in "$@"; do echo "${spec%%=*} $version $(out "${spec%%=*}" "$version")"; done
}

list() {
	if $node; then
		list_specs "$kube_version" "${kubelet_specs[@]}"
		list_specs "$containerd_version" "${containerd_specs[@]}"
		list_specs "$multus_version" "${multus_specs[@]}"
		list_specs "$crictl_version" "${crictl_specs[@]}"
		echo "pause $pause_version $(out pause "$pause_version")"
		return
	fi
	echo "etcd $etcd_version $(out etcd "$etcd_version")"
	for name in "${kube_names[@]}"; do
		echo "$name $kube_version $(out "$name" "$kube_version")"
	done
}
if $list_only; then
	list
	exit 0
fi

mkdir -p "$cache"
if $node; then
	if ! build_node; then
		echo "build_components: the node's build failed" >&2
		exit 1
	fi
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
