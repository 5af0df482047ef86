"""Shared test helpers (not tests): tiny checkpoints, a ``flare run`` server, process checks."""
