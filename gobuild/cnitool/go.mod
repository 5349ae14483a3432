// Builds cnitool from the published github.com/containernetworking/cni module,
// at the release that has STATUS and GC (`make cnitool`). Nothing of its source
// is kept here: go.sum pins what the module proxy serves.
module rdma-cni.io/gobuild/cnitool

go 1.26.0

require github.com/containernetworking/cni v1.3.0 // indirect

tool github.com/containernetworking/cni/cnitool
