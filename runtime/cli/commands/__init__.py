"""The ``flare`` commands: run (serve), bench, trace, replay, ranks, keys."""
