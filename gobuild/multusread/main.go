// Command multusread prints what Multus's own code makes of pod network annotations.
//
// It is the Go half of rdma-cni's differential test of the extender's reader
// (rdma_cni/shared/multusnet.py): each line of standard input is one JSON
// case, each line of standard output the answer for it, in order.
//
// Input, one object a line ("networks" and "default_network" absent when the
// annotation is not set):
//
//	{"namespace": "team-a", "networks": "...", "default_network": "...", "multus_namespace": "kube-system"}
//
// Output: {"networks": <answer>, "default_network": <answer or null when absent>}
// where an answer is {"ok": true, "selections": [{"namespace", "name", "interface", "cni_args"}]}
// or {"ok": false, "error": "..."} (Multus fails the pod's sandbox: nothing is attached).
//
// The networks annotation goes through k8sclient.GetPodNetwork, the exported
// function Multus's ADD calls (through TryLoadPodDelegates) for the pod. The
// default network is read as tryLoadK8sPodDefaultNetwork reads it; that
// function is unexported and wants an API client, so its three steps are
// repeated here: parsePodNetworkAnnotation with Multus's namespace (reached
// through GetPodNetwork on a pod in that namespace), then its "more than one"
// refusal, then networks[0], which panics on an empty list.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"gopkg.in/k8snetworkplumbingwg/multus-cni.v4/pkg/k8sclient"
	"gopkg.in/k8snetworkplumbingwg/multus-cni.v4/pkg/logging"
	"gopkg.in/k8snetworkplumbingwg/multus-cni.v4/pkg/types"
)

const (
	networksAnnot = "k8s.v1.cni.cncf.io/networks"
)

type request struct {
	Namespace       string  `json:"namespace"`
	Networks        *string `json:"networks"`
	DefaultNetwork  *string `json:"default_network"`
	MultusNamespace string  `json:"multus_namespace"`
}

type selection struct {
	Namespace string                  `json:"namespace"`
	Name      string                  `json:"name"`
	Interface string                  `json:"interface"`
	CNIArgs   *map[string]interface{} `json:"cni_args"`
}

type answer struct {
	OK         bool        `json:"ok"`
	Error      string      `json:"error,omitempty"`
	Selections []selection `json:"selections"`
}

type reply struct {
	Networks       *answer `json:"networks"`
	DefaultNetwork *answer `json:"default_network"`
}

func selectionsOf(networks []*types.NetworkSelectionElement) []selection {
	out := []selection{}
	for _, n := range networks {
		out = append(out, selection{n.Namespace, n.Name, n.InterfaceRequest, n.CNIArgs})
	}
	return out
}

// podNetworks is GetPodNetwork on a pod of the given namespace with the given annotation;
// a panic in Multus's code is an answer too (the ADD fails the same way).
func podNetworks(namespace string, value *string) (a *answer) {
	defer func() {
		if r := recover(); r != nil {
			a = &answer{Error: fmt.Sprintf("panic: %v", r)}
		}
	}()
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: namespace, Annotations: map[string]string{}}}
	if value != nil {
		pod.Annotations[networksAnnot] = *value
	}
	networks, err := k8sclient.GetPodNetwork(pod)
	if err != nil {
		if _, none := err.(*k8sclient.NoK8sNetworkError); none {
			// The annotation is absent or empty: Multus attaches no extra network.
			return &answer{OK: true, Selections: []selection{}}
		}
		return &answer{Error: err.Error()}
	}
	return &answer{OK: true, Selections: selectionsOf(networks)}
}

func defaultNetwork(multusNamespace string, value string) (a *answer) {
	defer func() {
		if r := recover(); r != nil {
			a = &answer{Error: fmt.Sprintf("panic: %v", r)}
		}
	}()
	if value == "" {
		// parsePodNetworkAnnotation refuses an empty text; GetPodNetwork says "none" before it.
		return &answer{Error: "parsePodNetworkAnnotation: pod annotation does not have \"network\" as key"}
	}
	got := podNetworks(multusNamespace, &value)
	if !got.OK {
		return got
	}
	if len(got.Selections) > 1 {
		return &answer{Error: "more than one default network is specified"}
	}
	// tryLoadK8sPodDefaultNetwork indexes networks[0]: an empty list panics there.
	_ = got.Selections[0]
	return got
}

func main() {
	logging.SetLogLevel("panic")
	logging.SetLogStderr(false)
	in := bufio.NewReaderSize(os.Stdin, 1<<20)
	out := bufio.NewWriter(os.Stdout)
	defer out.Flush()
	for {
		line, err := in.ReadBytes('\n')
		if len(line) > 0 {
			var req request
			if jerr := json.Unmarshal(line, &req); jerr != nil {
				fmt.Fprintf(os.Stderr, "multusread: bad input line: %v\n", jerr)
				os.Exit(2)
			}
			r := reply{Networks: podNetworks(req.Namespace, req.Networks)}
			if req.DefaultNetwork != nil {
				r.DefaultNetwork = defaultNetwork(req.MultusNamespace, *req.DefaultNetwork)
			}
			b, merr := json.Marshal(r)
			if merr != nil {
				fmt.Fprintf(os.Stderr, "multusread: %v\n", merr)
				os.Exit(2)
			}
			out.Write(b)
			out.WriteByte('\n')
		}
		if err == io.EOF {
			return
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "multusread: %v\n", err)
			os.Exit(2)
		}
	}
}
