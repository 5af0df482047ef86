"""The coordinator's gate: :class:`Gatekeeper`, its ZAP handler and the monitor
of its CURVE server sockets.

Which clients may connect is the ZAP handler's decision: it admits only the
deployment's client public keys (:class:`~runtime.transport.security.ServerKeys`),
logs every refusal with its reason and counts it (``denied``, exported as
``transport_auth_denied_total``).  Peers that fail earlier, in the CURVE
handshake itself (no keys at all, the wrong server key), never reach the ZAP
handler; a socket monitor on every server socket counts them too.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from runtime.transport.security import ServerKeys

logger = logging.getLogger("runtime.transport")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DENIAL_LOG_INTERVAL_S = 1.0  # repeats of one reason within this are counted, logged once

_HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
_PROTOCOL_REASONS: dict[int, str] = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "a peer without CURVE keys (mechanism mismatch)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: (
        "a CURVE handshake that failed to decrypt (the wrong server key, or a forged handshake)"
    ),
}


class Gatekeeper:
    """The ZAP handler of one coordinator context, and the monitor of its server sockets.

    One thread answers ZAP requests (admitting only ``keys.clients``) and reads
    the monitor events of the sockets passed to :meth:`watch`.  Every refusal
    is counted in :attr:`denied` and logged with its reason (repeats of one
    reason within a second are counted and summarized in the next line, so a
    peer that reconnects ten times a second cannot flood the log).
    """

    def __init__(self, context: zmq.Context, keys: ServerKeys, name: str = "coordinator") -> None:
        self.name = name
        self._keys = keys
        self._allowed = {key.encode("ascii"): i for i, key in enumerate(keys.clients)}
        self._context = context
        self._lock = threading.Lock()
        self._denied = 0
        self.recent: deque[str] = deque(maxlen=32)  # the last reasons, for diagnosis
        self._last_logged: dict[str, tuple[float, int]] = {}
        self._new: queue.SimpleQueue[tuple[zmq.Socket, str]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._zap = context.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        try:
            self._zap.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._zap.close(linger=0)
            raise zmq.ZMQError(
                exc.errno, f"a ZAP handler already serves this ZeroMQ context ({exc})"
            ) from exc
        self._monitors = 0
        self._thread = threading.Thread(target=self._run, name="flare-zap", daemon=True)
        self._thread.start()

    @property
    def denied(self) -> int:
        """Peers refused so far (ZAP denials and failed CURVE handshakes)."""
        with self._lock:
            return self._denied

    def watch(self, sock: zmq.Socket, endpoint: str) -> None:
        """Count the failed handshakes on ``sock`` (call before it binds)."""
        self._monitors += 1
        address = f"inproc://flare-zap-monitor-{id(self)}-{self._monitors}"
        sock.monitor(address, _HANDSHAKE_EVENTS)
        pair = self._context.socket(zmq.PAIR)
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(address)
        self._new.put((pair, endpoint))  # the thread owns it from now on

    def deny(self, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._denied += 1
            self.recent.append(reason)
            last, suppressed = self._last_logged.get(reason, (-1e9, 0))
            if now - last < DENIAL_LOG_INTERVAL_S:
                self._last_logged[reason] = (last, suppressed + 1)
                return
            self._last_logged[reason] = (now, 0)
        more = f" ({suppressed} more like it since the last report)" if suppressed else ""
        logger.warning("%s: refused a peer: %s%s", self.name, reason, more)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        monitors: dict[zmq.Socket, str] = {}
        try:
            while not self._stop.is_set():
                while True:
                    try:
                        pair, endpoint = self._new.get_nowait()
                    except queue.Empty:
                        break
                    monitors[pair] = endpoint
                    poller.register(pair, zmq.POLLIN)
                for sock, _ in poller.poll(100):
                    if sock is self._zap:
                        self._answer(self._zap.recv_multipart())
                    else:
                        self._event(sock.recv_multipart(), monitors[sock])
        except zmq.ZMQError as exc:  # the context went away under us
            if exc.errno != zmq.ETERM:
                logger.exception("%s: the ZAP handler failed", self.name)
        finally:
            for sock in (*monitors, self._zap):
                sock.close(linger=0)
            while True:
                try:
                    self._new.get_nowait()[0].close(linger=0)
                except queue.Empty:
                    break

    def _answer(self, request: list[bytes]) -> None:
        """Answer one ZAP request (RFC 27)."""
        if len(request) < 6:  # libzmq never sends one; a REP socket must answer anyway
            self.deny(f"malformed ZAP request of {len(request)} frames")
            request_id = request[1] if len(request) > 1 else b""
            self._zap.send_multipart([b"1.0", request_id, b"500", b"malformed", b"", b""])
            return
        version, request_id, _domain, address, _identity, mechanism = request[:6]
        credentials = request[6:]
        status, text, user = b"400", b"", b""
        peer = address.decode("ascii", "replace") or "?"
        if version != b"1.0":
            reason = f"ZAP version {version!r}"
        elif mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            reason = f"mechanism {mechanism.decode('ascii', 'replace')} from {peer}, CURVE required"
        else:
            key = z85.encode(credentials[0])
            index = self._allowed.get(key)
            if index is not None:
                status, text, user = b"200", b"OK", f"client-{index}".encode()
                reason = ""
            else:
                reason = (
                    f"client key {key[:8].decode()}... from {peer} is not one of the "
                    f"{len(self._allowed)} this deployment admits"
                )
        if status != b"200":
            text = reason.encode("utf-8")[:255]
            self.deny(reason)
        self._zap.send_multipart([b"1.0", request_id, status, text, user, b""])

    def _event(self, message: list[bytes], endpoint: str) -> None:
        try:
            event = parse_monitor_message(message)
        except (ValueError, TypeError, IndexError):
            return
        kind, value = event["event"], event["value"]
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            what = _PROTOCOL_REASONS.get(value, f"ZMTP protocol error {value:#x}")
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # A keyless peer that notices the mismatch first closes: this, not
            # the mismatch, is then what the server sees.
            what = (
                "a handshake that did not complete (a peer without CURVE keys, or one that "
                "closed or spoke no ZMTP)"
            )
        else:
            return
        raw = event.get("endpoint", b"")
        where = raw.decode("ascii", "replace") if isinstance(raw, bytes) else endpoint
        self.deny(f"{what} on {where or endpoint}")

    def close(self) -> None:
        """Stop the thread and close its sockets (before the context terminates)."""
        self._stop.set()
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            logger.warning("%s: the ZAP handler did not stop within 5 s", self.name)
