// Command kube is one multi-call binary for kube-apiserver, kube-controller-manager,
// kube-scheduler and kubectl: linking k8s.io/kubernetes once saves minutes of link time and
// ~300 MB of disk compared with four binaries. It dispatches on the name it was invoked by
// (hack/controlplane.sh creates symlinks) or, failing that, on its first argument.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	_ "time/tzdata" // CronJob time zones

	"github.com/spf13/cobra"
	_ "k8s.io/client-go/plugin/pkg/client/auth" // kubectl auth plugins (oidc, exec)
	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	_ "k8s.io/component-base/logs/json/register"          // JSON log format
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics
	_ "k8s.io/component-base/metrics/prometheus/version"  // version metric
	kubectlcmd "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

// servers maps an invocation name to its cobra command; kubectl is handled separately because
// it reads os.Args itself (plugins, .kuberc).
var servers = map[string]func() *cobra.Command{
	"kube-apiserver":          func() *cobra.Command { return apiserver.NewAPIServerCommand() },
	"kube-controller-manager": controllermanager.NewControllerManagerCommand,
	"kube-scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
}

func main() {
	name := filepath.Base(os.Args[0])
	if _, ok := servers[name]; !ok && name != "kubectl" {
		if len(os.Args) < 2 {
			usage()
		}
		os.Args = os.Args[1:] // "kube kube-apiserver --flags" == "kube-apiserver --flags"
		name = os.Args[0]
	}
	if name == "kubectl" {
		logs.GlogSetter(kubectlcmd.GetLogVerbosity(os.Args)) // nolint:errcheck
		if err := cli.RunNoErrOutput(kubectlcmd.NewDefaultKubectlCommand()); err != nil {
			kubectlutil.CheckErr(err)
		}
		return
	}
	newCommand, ok := servers[name]
	if !ok {
		usage()
	}
	os.Exit(cli.Run(newCommand()))
}

func usage() {
	names := []string{"kubectl"}
	for n := range servers {
		names = append(names, n)
	}
	sort.Strings(names)
	fmt.Fprintf(os.Stderr, "usage: kube {%s} [flags]\n", strings.Join(names, "|"))
	os.Exit(2)
}
