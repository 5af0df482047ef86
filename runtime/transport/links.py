"""Wire definitions of the links between the HTTP frontend and the coordinator process.

Both sides import them from here, so the frontend depends on the transport and
never on the coordinator:

* :class:`ApiEndpoints`: where the frontend's two API sockets listen (the
  request and output link, :mod:`runtime.coordinator.engine.bridge` on the
  coordinator's side, :mod:`runtime.frontend.client` on the frontend's);
* :data:`LINK_VERSION`: the version every debug-link message carries
  (:mod:`runtime.coordinator.engine.debug`, :mod:`runtime.frontend.debug`).
"""

from __future__ import annotations

from dataclasses import dataclass

LINK_VERSION = 1


@dataclass(frozen=True)
class ApiEndpoints:
    """Where the frontend listens: ``requests`` (it pushes), ``outputs`` (it pulls)."""

    requests: str
    outputs: str

    def __post_init__(self) -> None:
        for name in ("requests", "outputs"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.startswith(("ipc://", "tcp://")):
                raise ValueError(f"{name} endpoint must be ipc:// or tcp://, got {value!r}")
