"""Open-loop load at a constant rate, the way KEDA's pollers send it: request i goes out at ``t0 + i / rate``.

Used by bench/api.py (run as its own process, on uvloop). Unlike a closed
loop (``wrk``), a slow answer does not slow the sender down: a request that
finds every connection busy waits for one, and its latency counts from the
time it was due, not from when it got a connection (no coordinated omission).
Each request asks a random model's recommendation over one of ``connections``
keep-alive HTTP/1.1 connections (one request in flight per connection).

Usage:
    python bench/open_loop.py --port 8080 --token pw_... --models 100000 --rate 3333 --seconds 15

Prints one JSON object: target and achieved requests/s, p50 / p99 / max latency
(ms), errors (non-200 answers, and requests still unanswered 5 s after the end).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import time

import numpy as np


class Connection(asyncio.Protocol):
    """One keep-alive connection; parses just enough HTTP/1.1 (status, Content-Length) to frame each answer."""

    def __init__(self, on_answer) -> None:
        self.on_answer = on_answer
        self.transport = None
        self.buffer = bytearray()
        self.due = 0.0
        self.ready = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.ready.set_result(None)

    def send(self, request: bytes, due: float) -> None:
        self.due = due
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buffer[:end]).lower()
        at = head.find(b"content-length:")
        length = int(head[at + 15:head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0 else None]) if at >= 0 else 0
        if len(self.buffer) < end + 4 + length:
            return
        status = int(head[9:12])
        del self.buffer[:end + 4 + length]
        self.on_answer(self, status)

    def connection_lost(self, exc) -> None:
        self.transport = None


async def run(host: str, port: int, token: str, models: int, rate: float, seconds: float, warmup_s: float,
              connections: int, seed: int) -> dict:
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    header = f"Host: {host}:{port}\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
    latencies: list[float] = []
    errors = 0
    idle: collections.deque[Connection] = collections.deque()
    waiting: collections.deque[float] = collections.deque()
    t0 = loop.time() + 0.5
    measure_from, stop_at = t0 + warmup_s, t0 + warmup_s + seconds
    outstanding = 0

    def request() -> bytes:
        return b"GET /v1/models/model-%06d/recommendation HTTP/1.1\r\n" % rng.randrange(models) + header

    def on_answer(conn: Connection, status: int) -> None:
        nonlocal errors, outstanding
        outstanding -= 1
        if measure_from <= conn.due < stop_at:
            if status == 200:
                latencies.append(loop.time() - conn.due)
            else:
                errors += 1
        if waiting:
            conn.send(request(), waiting.popleft())
        else:
            idle.append(conn)

    pool = []
    for _ in range(connections):
        _, conn = await loop.create_connection(lambda: Connection(on_answer), host, port)
        await conn.ready
        pool.append(conn)
        idle.append(conn)
    sent = 0
    while True:
        now = loop.time()
        due_count = int((min(now, stop_at) - t0) * rate) + 1 if now >= t0 else 0
        while sent < due_count:
            due = t0 + sent / rate
            outstanding += 1
            if idle:
                idle.popleft().send(request(), due)
            else:
                waiting.append(due)
            sent += 1
        if now >= stop_at:
            break
        await asyncio.sleep(max(0.0, t0 + sent / rate - loop.time()))
    give_up = loop.time() + 5.0
    while outstanding and loop.time() < give_up:
        await asyncio.sleep(0.01)
    measured_sent = sum(1 for i in range(sent) if measure_from <= t0 + i / rate < stop_at)
    errors = measured_sent - len(latencies)  # non-200 answers plus those unanswered 5 s after the end
    for conn in pool:
        if conn.transport is not None:
            conn.transport.close()
    ms = np.array(latencies) * 1000.0 if latencies else np.array([np.nan])
    return {"target_rps": rate, "rps": round(len(latencies) / seconds, 1), "requests": len(latencies),
            "errors": int(errors), "connections": connections, "seconds": seconds,
            "p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2),
            "max_ms": round(float(ms.max()), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--models", type=int, required=True, help="Models model-000000 .. model-(N-1).")
    parser.add_argument("--rate", type=float, required=True, help="Requests per second, constant.")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--connections", type=int, default=100)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
        runner = asyncio.run
    started = time.perf_counter()
    figures = runner(run(args.host, args.port, args.token, args.models, args.rate, args.seconds, args.warmup_s,
                         args.connections, args.seed))
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
