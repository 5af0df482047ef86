"""The command line: ``flare`` (``runtime.cli:main``, also ``python -m runtime.cli``)
and the argv of ``python -m runtime.ranks`` and ``python -m runtime.coordinator``.

* ``app``: ``flare``'s parser and its dispatch to the commands;
* ``commands/``: ``run`` (``serve``), ``bench``, ``trace``, ``replay``, ``ranks``,
  ``keys``;
* ``flags/``: the flag families of ``flare run`` (serving, generation, model,
  memory, scheduling, speculation, deployment, security, debugging), each with
  the settings it builds;
* ``converters``: every argument converter and its constants;
* ``rank_process`` / ``coordinator_process``: the argv of the rank and
  coordinator processes, handed to their bodies (runtime/ranks/process.py,
  runtime/coordinator/engine/main.py).

Every flag and model-directory problem fails before any process starts, in one
stderr line naming the flag or file.  Library code imports nothing from here.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``flare``: parse ``argv`` (default: ``sys.argv[1:]``) and run the command."""
    from runtime.cli.app import main as flare

    return flare(argv)
