"""Peer trainers on the same workload, run as scripts in their own environments."""
