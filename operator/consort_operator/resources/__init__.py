"""Pure builders: spec -> the Kubernetes objects the operator owns (no I/O)."""
