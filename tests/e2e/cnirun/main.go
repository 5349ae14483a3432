// Command cnirun drives CNI plugins through libcni, the library container runtimes
// (containerd, CRI-O, Multus) use, so that the end-to-end tests exercise a plugin
// exactly as a runtime would: config list handling, prevResult injection, CNI_ARGS,
// capability filtering and libcni's on-disk result cache (needed by CHECK and DEL).
//
// Usage:
//
//	cnirun add|check|del -conflist FILE -netns PATH -id CONTAINERID -ifname IFNAME \
//	    -bin-dir DIR[:DIR...] -cache-dir DIR -args 'K=V;K=V' [-runtime-config JSON]
//
// On success ADD prints the result JSON on stdout; CHECK and DEL print nothing.
// On failure the error is printed on stdout as {"code":..,"msg":..,"details":..} and
// the exit status is 1. Plugin errors keep the plugin's code; errors raised by libcni
// itself (plugin not found, bad container ID, missing cache) have code 0. The full
// error chain goes to stderr.
//
// STATUS and GC are not offered: libcni 1.1.2 (the version Debian 12 ships) has no
// GetStatusNetworkList or GCNetworkList.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
)

// options holds the parsed command line.
type options struct {
	command       string
	conflist      string
	netns         string
	containerID   string
	ifname        string
	binDirs       string
	cacheDir      string
	args          string
	runtimeConfig string
	timeout       time.Duration
}

// errorReport is what a failure looks like on stdout: the shape of a CNI error.
type errorReport struct {
	Code    uint   `json:"code"`
	Msg     string `json:"msg"`
	Details string `json:"details"`
}

func usage(fs *flag.FlagSet) {
	fmt.Fprintf(os.Stderr, "usage: %s add|check|del [flags]\n", os.Args[0])
	fs.PrintDefaults()
}

// parseOptions reads the verb and flags; the verb comes first as in `ip` or `git`.
func parseOptions(argv []string) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("cnirun", flag.ContinueOnError)
	fs.StringVar(&o.conflist, "conflist", "", "network configuration list file (.conflist)")
	fs.StringVar(&o.netns, "netns", "", "network namespace path (may be empty for del)")
	fs.StringVar(&o.containerID, "id", "", "container ID")
	fs.StringVar(&o.ifname, "ifname", "eth0", "interface name inside the container")
	fs.StringVar(&o.binDirs, "bin-dir", "/usr/lib/cni", "plugin directories, colon separated (CNI_PATH)")
	fs.StringVar(&o.cacheDir, "cache-dir", libcni.CacheDir, "libcni result cache directory")
	fs.StringVar(&o.args, "args", "", "CNI_ARGS as 'K=V;K=V'")
	fs.StringVar(&o.runtimeConfig, "runtime-config", "", "capability arguments as a JSON object")
	fs.DurationVar(&o.timeout, "timeout", 2*time.Minute, "give up on the whole operation after this long")
	fs.Usage = func() { usage(fs) }

	if len(argv) < 1 {
		usage(fs)
		return nil, errors.New("missing command")
	}
	o.command = argv[0]
	if err := fs.Parse(argv[1:]); err != nil {
		return nil, err
	}
	if fs.NArg() != 0 {
		return nil, fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	switch o.command {
	case "add", "check", "del":
	case "status", "gc":
		return nil, fmt.Errorf("%s is not available: libcni 1.1.2 has no %s API", o.command, strings.ToUpper(o.command))
	default:
		return nil, fmt.Errorf("unknown command %q", o.command)
	}
	if o.conflist == "" || o.containerID == "" {
		return nil, errors.New("-conflist and -id are required")
	}
	// DEL must work after the namespace is gone, so only ADD and CHECK insist on it.
	if o.netns == "" && o.command != "del" {
		return nil, errors.New("-netns is required for add and check")
	}
	return o, nil
}

// parseArgs turns 'K=V;K=V' into the pairs libcni puts into CNI_ARGS.
func parseArgs(s string) ([][2]string, error) {
	var pairs [][2]string
	for _, item := range strings.Split(s, ";") {
		if item == "" {
			continue
		}
		k, v, ok := strings.Cut(item, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("bad -args item %q: want K=V", item)
		}
		pairs = append(pairs, [2]string{k, v})
	}
	return pairs, nil
}

// runtimeConf builds what a container runtime would pass for one attachment.
func runtimeConf(o *options) (*libcni.RuntimeConf, error) {
	args, err := parseArgs(o.args)
	if err != nil {
		return nil, err
	}
	rt := &libcni.RuntimeConf{
		ContainerID: o.containerID,
		NetNS:       o.netns,
		IfName:      o.ifname,
		Args:        args,
	}
	if o.runtimeConfig != "" {
		if err := json.Unmarshal([]byte(o.runtimeConfig), &rt.CapabilityArgs); err != nil {
			return nil, fmt.Errorf("bad -runtime-config: %w", err)
		}
	}
	return rt, nil
}

// run performs the verb and returns the result to print (ADD only).
func run(o *options) (types.Result, error) {
	list, err := libcni.ConfListFromFile(o.conflist)
	if err != nil {
		return nil, err
	}
	rt, err := runtimeConf(o)
	if err != nil {
		return nil, err
	}
	// A nil exec makes libcni use its default, which forwards plugin stderr to ours.
	cni := libcni.NewCNIConfigWithCacheDir(strings.Split(o.binDirs, ":"), o.cacheDir, nil)
	ctx, cancel := context.WithTimeout(context.Background(), o.timeout)
	defer cancel()

	switch o.command {
	case "add":
		return cni.AddNetworkList(ctx, list, rt)
	case "check":
		return nil, cni.CheckNetworkList(ctx, list, rt)
	default:
		return nil, cni.DelNetworkList(ctx, list, rt)
	}
}

// report converts any error into the CNI error shape, keeping a plugin's own code.
func report(err error) errorReport {
	var cniErr *types.Error
	if errors.As(err, &cniErr) {
		return errorReport{Code: cniErr.Code, Msg: cniErr.Msg, Details: cniErr.Details}
	}
	return errorReport{Code: 0, Msg: err.Error()}
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "cnirun: %v\n", err)
	out, _ := json.Marshal(report(err))
	fmt.Println(string(out))
	os.Exit(1)
}

func main() {
	o, err := parseOptions(os.Args[1:])
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(2)
		}
		fail(err)
	}
	result, err := run(o)
	if err != nil {
		fail(err)
	}
	if result != nil {
		if err := result.PrintTo(os.Stdout); err != nil {
			fail(err)
		}
		// PrintTo leaves the line open; shells and log readers expect it closed.
		fmt.Println()
	}
}
