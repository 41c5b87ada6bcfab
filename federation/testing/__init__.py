"""Helpers for end-to-end tests and benchmarks: a real etcd, a pausable TCP proxy, HA probes."""
