"""Rank workers: one process per device holding a tensor-parallel shard, capturing
and replaying prepared programs (built with the ranks/transport issue)."""
