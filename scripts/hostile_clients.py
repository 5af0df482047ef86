"""The frontend under hostile clients, measured at full size against a real
``flare run`` (the embedded default model on CPU, a free loopback port).

    python scripts/hostile_clients.py                      # everything, full size
    python scripts/hostile_clients.py --connections 2000   # a smaller idle flood
    python scripts/hostile_clients.py --server-arg=--preprocess-workers=0

What it does (docs/serving.md, "Hostile clients and limits"; issue 23):

1. Starts the server, warms it up, and takes the frontend's RSS (its own process
   plus its preprocessing workers) as ``rss_start_mb``.
2. Starts a monitor process that, for the whole run, asks ``/health`` every 20 ms
   on a keep-alive connection (the event loop's responsiveness), every 250 ms on a
   fresh connection (can a new client get in), and keeps two streaming
   completions open, timing every chunk.  A quiet period (15 s) gives the
   streams' normal largest gap; an attack's gap excess is its largest gap less
   that one.
3. Sends each attack once, at full size, from this process (bodies built
   beforehand): a 30 MB ``/tokenize``, a chat of a million empty messages, a JSON
   body with two million keys, a prompt of seven million token ids, a
   ``/detokenize`` of three million ids, a body over the size limit, and an
   upload cut off midway.  For each: the answer, the slowest keep-alive
   ``/health`` and the largest stream gap beyond the normal one, over the time it
   was handled.
4. Waits for the frontend's RSS to settle: ``rss_after_mb``, ``rss_return_pct``.
5. Idle flood: ``--connections`` connections (several processes) that each send
   ``GET /hea`` and stop, held past the header timeout; the slowest fresh-
   connection ``/health`` while they were held (and while they were being opened),
   and the lines the server's log grew by.

It prints a table, then, as its last line, one JSON object with the figures.
All traffic goes to 127.0.0.1; every attack is sent once; the flood is bounded
by ``--connections``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:
    from runtime.loadgen.launcher import ServerProcess

HOST = "127.0.0.1"
START_S = 240.0
SERVER_FLAGS = ["--max-concurrency", "4", "--device", "cpu"]
QUIET_S = 15.0  # the quiet period before the attacks: the streams' normal gap, /health's
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "light", "sand"]


# ------------------------------------------------------------------ processes


def frontend_rss(pid: int) -> tuple[int, dict[str, int]]:
    """The frontend's RSS: its own process plus its preprocessing workers."""
    import psutil

    proc = psutil.Process(pid)
    parts = {"frontend": proc.memory_info().rss}
    for child in proc.children():
        with contextlib.suppress(psutil.Error):
            if "runtime.frontend.preprocess" in " ".join(child.cmdline()):
                parts[f"worker {child.pid}"] = child.memory_info().rss
    return sum(parts.values()), parts


def request(port: int, method: str, path: str, body: bytes | None = None, timeout=600.0):
    """(status, body bytes) over a fresh connection."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        headers = {"content-type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def start_server(extra: list[str]) -> ServerProcess:
    """``flare run SERVER_FLAGS extra`` (runtime.loadgen.launcher), stopped with SIGINT."""
    from runtime.loadgen.launcher import ServerProcess, ServerStartError

    try:
        return ServerProcess(
            [*SERVER_FLAGS, *extra],
            start_timeout_s=START_S,
            stop_timeout_s=60.0,
            stop_signal=signal.SIGINT,
            own_group=False,
            tmp_prefix="flare-hostile-",
        )
    except ServerStartError as exc:
        if exc.code is None:
            raise SystemExit("flare run did not become healthy") from None
        raise SystemExit(f"flare run exited: {exc.output[-3000:]}") from None


def log_lines(server: ServerProcess) -> int:
    with open(Path(server.tmp) / "server.log", "rb") as f:
        return f.read().count(b"\n")


def fds(server: ServerProcess) -> int:
    try:
        return len(os.listdir(f"/proc/{server.proc.pid}/fd"))
    except OSError:
        return -1


# ------------------------------------------------------------------ the monitor process


def monitor_main(port: int, out_path: str) -> int:
    """Probes and streams until stdin closes; one sample per line in ``out_path``."""
    out = open(out_path, "w", buffering=1)  # noqa: SIM115 - the process's life
    lock = threading.Lock()
    stop = threading.Event()

    def emit(*fields) -> None:
        with lock:
            out.write(" ".join(str(f) for f in fields) + "\n")

    def keepalive_probe() -> None:
        conn = None
        while not stop.is_set():
            start = time.monotonic()
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(HOST, port, timeout=30)
                conn.request("GET", "/health")
                response = conn.getresponse()
                response.read()
                emit("h", f"{start:.6f}", f"{time.monotonic() - start:.6f}", response.status)
            except (OSError, http.client.HTTPException):
                emit("h", f"{start:.6f}", f"{time.monotonic() - start:.6f}", 0)
                with contextlib.suppress(Exception):
                    conn.close()
                conn = None
            stop.wait(0.02)

    def fresh_probe() -> None:
        while not stop.is_set():
            start = time.monotonic()
            status = 0
            with contextlib.suppress(OSError, http.client.HTTPException):
                status = request(port, "GET", "/health", timeout=10)[0]
            emit("f", f"{start:.6f}", f"{time.monotonic() - start:.6f}", status)
            stop.wait(0.25)

    def stream(sid: int) -> None:
        prompt = " ".join(WORDS[(i * 7 + sid) % len(WORDS)] for i in range(40))
        body = json.dumps(
            {
                "prompt": prompt,
                "max_tokens": 3000,
                "stream": True,
                "ignore_eos": True,
                "temperature": 0,
            }
        )
        while not stop.is_set():
            emit("r", sid, f"{time.monotonic():.6f}")  # a (re)start: no gap across it
            try:
                conn = http.client.HTTPConnection(HOST, port, timeout=60)
                conn.request(
                    "POST",
                    "/v1/completions",
                    body=body,
                    headers={"content-type": "application/json"},
                )
                response = conn.getresponse()
                while not stop.is_set():
                    line = response.fp.readline()
                    if not line or line.strip() == b"data: [DONE]":
                        break
                    if line.startswith(b"data: ") and b'"text":"' in line:
                        emit("s", sid, f"{time.monotonic():.6f}")
                conn.close()
            except (OSError, http.client.HTTPException):
                stop.wait(0.2)

    threads = [
        threading.Thread(target=keepalive_probe, daemon=True),
        threading.Thread(target=fresh_probe, daemon=True),
        *(threading.Thread(target=stream, args=(i,), daemon=True) for i in range(2)),
    ]
    for t in threads:
        t.start()
    sys.stdin.read()  # until the parent closes it
    stop.set()
    return 0


class Samples:
    """The monitor's samples: probes (kind, start, latency, status) and stream chunks."""

    def __init__(self, path: str) -> None:
        self.probes: dict[str, list[tuple[float, float, int]]] = {"h": [], "f": []}
        self.chunks: dict[int, list[tuple[float, bool]]] = {}  # (time, is a restart)
        for line in Path(path).read_text().splitlines():
            kind, *rest = line.split()
            if kind in ("h", "f"):
                self.probes[kind].append((float(rest[0]), float(rest[1]), int(rest[2])))
            elif kind in ("s", "r"):
                self.chunks.setdefault(int(rest[0]), []).append((float(rest[1]), kind == "r"))

    def probe_max(self, kind: str, lo: float, hi: float) -> float:
        """The slowest probe in flight during [lo, hi] (seconds; 0 when none)."""
        return max(
            (lat for start, lat, _ in self.probes[kind] if start < hi and start + lat > lo),
            default=0.0,
        )

    def probe_failures(self, kind: str, lo: float, hi: float) -> int:
        return sum(
            1
            for start, lat, status in self.probes[kind]
            if start < hi and start + lat > lo and status != 200
        )

    def gap_max(self, lo: float, hi: float) -> float:
        """The largest gap between two chunks of one stream that overlaps [lo, hi]."""
        worst = 0.0
        for chunks in self.chunks.values():
            for (a, _), (b, restart) in itertools.pairwise(chunks):
                if not restart and b > lo and a < hi:
                    worst = max(worst, b - a)
        return worst


# ------------------------------------------------------------------ the flood processes


def flood_main(port: int, count: int) -> int:
    """Open ``count`` connections, send ``GET /hea`` on each, report, hold until stdin
    closes, then report how many the server closed (and with what)."""
    # The lowest CPU priority: on this one machine the flood's own CPU time (and its
    # kernel's share of the connection setup) should not starve the server it measures,
    # as an attacker elsewhere would not.
    with contextlib.suppress(OSError):
        os.nice(19)
    sel = selectors.DefaultSelector()
    socks = []
    for _ in range(count):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((HOST, port))
        sel.register(s, selectors.EVENT_WRITE)
        socks.append(s)
    connected = failed = 0
    deadline = time.monotonic() + 90
    pending = len(socks)
    while pending and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=1.0):
            s = key.fileobj
            sel.unregister(s)
            pending -= 1
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                try:
                    s.send(b"GET /hea")
                    connected += 1
                except OSError:
                    failed += 1
            else:
                failed += 1
    print(f"ready {connected} {failed + pending}", flush=True)
    sys.stdin.read()
    answers: dict[str, int] = {}
    for s in socks:
        try:
            data = s.recv(64)
            what = data[:12].decode(errors="replace").strip() or "closed"
        except BlockingIOError:
            what = "open"
        except OSError:
            what = "reset"
        answers[what] = answers.get(what, 0) + 1
        s.close()
    print("answers " + json.dumps(answers), flush=True)
    return 0


# ------------------------------------------------------------------ attacks


def attack_bodies() -> list[tuple[str, str, bytes]]:
    """(name, path, body) of each full-size attack, serialized now."""
    text = (" ".join(WORDS) + " ") * (30_000_000 // len(" ".join(WORDS) + " "))
    keys = "{" + ",".join(f'"k{i}":0' for i in range(2_000_000)) + "}"
    return [
        ("tokenize_30mb", "/tokenize", json.dumps({"prompt": text}).encode()),
        (
            "chat_1m_empty_messages",
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": ""}] * 1_000_000}).encode(),
        ),
        ("json_2m_keys", "/v1/completions", keys.encode()),
        (
            "prompt_7m_token_ids",
            "/v1/completions",
            json.dumps({"prompt": [5] * 7_000_000, "max_tokens": 1}).encode(),
        ),
        ("detokenize_3m_ids", "/detokenize", json.dumps({"tokens": [5] * 3_000_000}).encode()),
        ("body_over_limit_40mb", "/v1/completions", b'{"prompt": "' + b"a" * (40 << 20) + b'"}'),
    ]


def short_answer(status: int, body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return f"{len(body)} bytes"
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message"))[:90]
    if isinstance(data, dict) and "count" in data:
        return f"count {data['count']}"
    return f"{len(body)} bytes"


def cut_upload(port: int) -> None:
    """Announce a 20 MB body, send 8 MB of it, and leave."""
    s = socket.create_connection((HOST, port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 20000000\r\n\r\n" + b'{"prompt": "' + b"a" * (8 << 20)
    )
    s.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--connections",
        type=int,
        default=20000,
        metavar="N",
        help="idle connections of the flood (default 20000; 0: no flood)",
    )
    parser.add_argument(
        "--flood-processes",
        type=int,
        default=4,
        metavar="N",
        help="processes that open them (default 4)",
    )
    parser.add_argument(
        "--hold",
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="how long the flood is held (default 15: past the 10 s header timeout)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more flag for flare run (repeatable)",
    )
    parser.add_argument(
        "--skip-attacks", action="store_true", help="only the idle flood (and the memory)"
    )
    parser.add_argument("--keep-samples", metavar="FILE", help="copy the monitor's samples here")
    parser.add_argument("--monitor", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--flood", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.monitor:
        return monitor_main(int(args.monitor[0]), args.monitor[1])
    if args.flood:
        return flood_main(*args.flood)

    print("building the attack bodies...", file=sys.stderr)
    attacks = [] if args.skip_attacks else attack_bodies()
    print("starting flare run...", file=sys.stderr)
    server = start_server(args.server_arg)
    samples_path = os.path.join(server.tmp, "monitor.txt")
    monitor = None
    results: dict[str, dict] = {}
    try:
        port = server.port
        # Warm-up: every route once, and a worker job.
        request(port, "POST", "/tokenize", json.dumps({"prompt": "hello"}).encode())
        request(port, "POST", "/tokenize", json.dumps({"prompt": "alpha " * 20000}).encode())
        request(
            port,
            "POST",
            "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode(),
        )
        time.sleep(2.0)
        rss_start, start_parts = frontend_rss(server.proc.pid)
        monitor = subprocess.Popen(
            [sys.executable, __file__, "--monitor", str(port), samples_path],
            stdin=subprocess.PIPE,
        )
        time.sleep(QUIET_S + 2.0)
        baseline = (time.monotonic() - QUIET_S, time.monotonic())
        windows: dict[str, tuple[float, float]] = {}
        for name, path, body in [] if args.skip_attacks else attacks:
            print(f"attack {name} ({len(body) / 1e6:.1f} MB)...", file=sys.stderr)
            t0 = time.monotonic()
            try:
                status, answer = request(port, "POST", path, body)
                text = short_answer(status, answer)
            except (OSError, http.client.HTTPException) as exc:
                status, text = 0, f"{type(exc).__name__}: {exc}"[:90]
            t1 = time.monotonic()
            windows[name] = (t0, t1 + 0.5)
            results[name] = {"status": status, "answer": text, "seconds": round(t1 - t0, 2)}
            time.sleep(1.5)
        print("attack mid_upload_disconnect...", file=sys.stderr)
        if args.skip_attacks:
            print("(attacks skipped)", file=sys.stderr)
        lines_before = log_lines(server)
        t0 = time.monotonic()
        cut_upload(port)
        time.sleep(1.5)
        windows["mid_upload_disconnect"] = (t0, time.monotonic())
        results["mid_upload_disconnect"] = {
            "status": None,
            "answer": f"{log_lines(server) - lines_before} log line(s)",
            "seconds": 0.0,
            "log_lines": log_lines(server) - lines_before,
        }
        # The frontend's memory, once settled.
        deadline = time.monotonic() + 30
        while True:
            rss_after, after_parts = frontend_rss(server.proc.pid)
            if rss_after <= rss_start * 1.05 or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        flood = run_flood(server, args) if args.connections > 0 else None
    finally:
        if monitor is not None:
            monitor.stdin.close()
            monitor.wait(timeout=30)
        samples = Samples(samples_path) if os.path.exists(samples_path) else None
        if args.keep_samples and samples is not None:
            shutil.copy(samples_path, args.keep_samples)
        server.stop()

    normal_gap = samples.gap_max(*baseline)
    table = []
    for name, (lo, hi) in windows.items():
        result = results[name]
        result["health_max_ms"] = round(samples.probe_max("h", lo, hi) * 1e3, 1)
        result["health_failures"] = samples.probe_failures("h", lo, hi)
        excess = max(0.0, samples.gap_max(lo, hi) - normal_gap)
        result["stream_gap_excess_ms"] = round(excess * 1e3, 1)
        table.append(name)
    figures = {
        "health_max_ms": max(results[n]["health_max_ms"] for n in table),
        "stream_gap_excess_max_ms": max(results[n]["stream_gap_excess_ms"] for n in table),
        "normal_stream_gap_ms": round(normal_gap * 1e3, 1),
        "baseline_health_max_ms": round(samples.probe_max("h", *baseline) * 1e3, 1),
        "rss_start_mb": round(rss_start / 1e6, 1),
        "rss_after_mb": round(rss_after / 1e6, 1),
        "rss_return_pct": round(100.0 * (rss_after - rss_start) / rss_start, 1),
        "rss_start_parts_mb": {k: round(v / 1e6, 1) for k, v in start_parts.items()},
        "rss_after_parts_mb": {k: round(v / 1e6, 1) for k, v in after_parts.items()},
    }
    if flood is not None:
        lo, ready, hi = flood["times"]
        figures |= {
            "idle_flood_connections": flood["connections"],
            "idle_flood_connected": flood["connected"],
            "idle_flood_health_max_ms": round(samples.probe_max("f", ready, hi) * 1e3, 1),
            "idle_flood_health_failures": samples.probe_failures("f", ready, hi),
            "idle_flood_health_max_ms_while_opening": round(
                samples.probe_max("f", lo, ready) * 1e3, 1
            ),
            "idle_flood_keepalive_health_max_ms": round(samples.probe_max("h", lo, hi) * 1e3, 1),
            "idle_flood_log_lines": flood["log_lines"],
            "idle_flood_server_fds_max": flood["fds_max"],
            "idle_flood_answers": flood["answers"],
        }
    figures["attacks"] = results

    print()
    print(f"{'attack':<24} {'status':>6} {'secs':>6} {'health max':>11} {'gap excess':>11}  answer")
    for name in table:
        r = results[name]
        print(
            f"{name:<24} {r['status'] or '-':>6} {r['seconds']:>6.2f} "
            f"{r['health_max_ms']:>8.1f} ms {r['stream_gap_excess_ms']:>8.1f} ms  {r['answer']}"
        )
    print(
        f"normal stream gap {figures['normal_stream_gap_ms']} ms; /health before the attacks "
        f"at most {figures['baseline_health_max_ms']} ms"
    )
    print(
        f"frontend RSS (with its workers): {figures['rss_start_mb']} MB at start, "
        f"{figures['rss_after_mb']} MB after ({figures['rss_return_pct']:+.1f}%)"
    )
    if flood is not None:
        print(
            f"idle flood: {flood['connected']} of {flood['connections']} connections open; "
            f"fresh /health at most {figures['idle_flood_health_max_ms']} ms while held "
            f"({figures['idle_flood_health_failures']} failed), "
            f"{figures['idle_flood_health_max_ms_while_opening']} ms while opening; "
            f"keep-alive /health at most {figures['idle_flood_keepalive_health_max_ms']} ms; "
            f"log +{flood['log_lines']} lines; server fds at most {flood['fds_max']}; "
            f"the flood's connections ended as {flood['answers']}"
        )
    print(json.dumps(figures))
    return 0


def run_flood(server: ServerProcess, args: argparse.Namespace) -> dict:
    """Open the idle connections from several processes, hold them, close them."""
    print(f"idle flood of {args.connections} connections...", file=sys.stderr)
    lines_before = log_lines(server)
    procs = []
    per = -(-args.connections // args.flood_processes)
    left = args.connections
    started = time.monotonic()
    for _ in range(args.flood_processes):
        n = min(per, left)
        left -= n
        if n > 0:
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--flood", str(server.port), str(n)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
    connected = 0
    fds_max = 0
    for proc in procs:
        fields = proc.stdout.readline().split()
        connected += int(fields[1]) if len(fields) == 3 else 0
        fds_max = max(fds_max, fds(server))
    ready = time.monotonic()
    while time.monotonic() < ready + args.hold:
        fds_max = max(fds_max, fds(server))
        time.sleep(0.5)
    held = time.monotonic()
    print(f"flood: opened {started:.3f} ready {ready:.3f} held until {held:.3f}", file=sys.stderr)
    answers: dict[str, int] = {}
    for proc in procs:
        proc.stdin.close()
    for proc in procs:
        line = proc.stdout.readline()
        if line.startswith("answers "):
            for key, value in json.loads(line[8:]).items():
                answers[key] = answers.get(key, 0) + value
        proc.wait(timeout=60)
    time.sleep(2.0)
    return {
        "connections": args.connections,
        "connected": connected,
        "times": (started, ready, held),
        "log_lines": log_lines(server) - lines_before,
        "fds_max": fds_max,
        "answers": answers,
    }


if __name__ == "__main__":
    sys.exit(main())
