#!/usr/bin/env bash
# Generates the node agent's kubelet DRA messages (rdma_cni/agent/dra/*_pb2.py) at build time from
# the .proto files of k8s.io/kubelet, at the version gobuild/kube pins for the cluster's components:
#   pkg/apis/dra/v1/api.proto                 -> rdma_cni/agent/dra/dra_v1_pb2.py
#   pkg/apis/pluginregistration/v1/api.proto  -> rdma_cni/agent/dra/registration_v1_pb2.py
# The module is fetched into Go's module cache by `go mod download` (nothing when it is there
# already) and its hash checked against gobuild/kube/go.sum; the .proto files are copied into
# build/proto/ under the names above only so that protoc names the generated modules and their
# descriptors apart (both upstream files are called api.proto). Nothing of them is kept in the tree
# (build/ and *_pb2.py are ignored). Usage: scripts/kubelet_protos.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-.venv/bin/python}
go=${GO:-/usr/local/go/bin/go}
module=k8s.io/kubelet
# The replace line pins every k8s.io staging module: "k8s.io/kubelet => k8s.io/kubelet v0.37.2".
version=$(awk -v m="$module" '$1 == m && $2 == "=>" { print $4; exit }' gobuild/kube/go.mod)
if [ -z "$version" ]; then
	echo "kubelet_protos: gobuild/kube/go.mod pins no $module" >&2
	exit 1
fi
if ! [ -x "$go" ]; then
	echo "kubelet_protos: no Go at $go (Go 1.26 is expected at /usr/local/go/bin/go; GO= names another)" >&2
	exit 1
fi
info=$(cd gobuild/kube && GOTOOLCHAIN=local GOFLAGS=-mod=readonly "$go" mod download -json "$module@$version")
read -r dir sum < <("$python" -c 'import json, sys; d = json.loads(sys.stdin.read()); print(d["Dir"], d["Sum"])' <<<"$info")
want=$(awk -v m="$module" -v v="$version" '$1 == m && $2 == v { print $3; exit }' gobuild/kube/go.sum)
if [ "$sum" != "$want" ]; then
	echo "kubelet_protos: $module@$version has hash $sum, gobuild/kube/go.sum says ${want:-nothing}" >&2
	exit 1
fi
stage=build/proto/rdma_cni/agent/dra
mkdir -p "$stage"
cp "$dir/pkg/apis/dra/v1/api.proto" "$stage/dra_v1.proto"
cp "$dir/pkg/apis/pluginregistration/v1/api.proto" "$stage/registration_v1.proto"
chmod u+w "$stage"/*.proto
"$python" -m grpc_tools.protoc -Ibuild/proto --python_out=. "$stage/dra_v1.proto" "$stage/registration_v1.proto"
