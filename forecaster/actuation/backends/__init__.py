"""Backends that carry out actions: dry-run, node agents, Kubernetes."""
