// Command kube-node is one multi-call binary for the real node's kubelet and kube-proxy, built
// from the same pinned k8s.io/kubernetes as the control plane (hack/kube/go.mod). It is a separate
// binary from `kube` (and lives outside cmd/, whose main.go files key the control plane's build
// stamp) so that clusters with kwok nodes only never pay for the kubelet's build.
// It dispatches on the name it was invoked by (hack/controlplane.sh creates symlinks) or, failing
// that, on its first argument.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"          // JSON log format
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics
	_ "k8s.io/component-base/metrics/prometheus/version"  // version metric
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

var commands = map[string]func() *cobra.Command{
	"kubelet":    func() *cobra.Command { return kubelet.NewKubeletCommand(context.Background()) },
	"kube-proxy": proxy.NewProxyCommand,
}

func main() {
	name := filepath.Base(os.Args[0])
	if _, ok := commands[name]; !ok {
		if len(os.Args) < 2 {
			usage()
		}
		os.Args = os.Args[1:] // "kube-node kubelet --flags" == "kubelet --flags"
		name = os.Args[0]
	}
	newCommand, ok := commands[name]
	if !ok {
		usage()
	}
	os.Exit(cli.Run(newCommand()))
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: kube-node {kubelet|kube-proxy} [flags]")
	os.Exit(2)
}
