// Command etcd is etcd's own server main, built at the version k8s.io/kubernetes requires.
// It is a separate binary so etcd's init-time registrations never meet the apiserver's.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
