"""Time to first SSE event, over one keep-alive connection, one request at a time.

wrk only sees whole responses, so this small blocking client measures when the
first `data:` line arrives and when the response ends. Its own cost is the same for
every target, so differences between targets are what the proxy adds.

    python bench/ttfb.py --port N --path /v1/chat/completions?s=sse --body FILE --key K --n 300
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from pathlib import Path

__all__ = ["measure"]


def _request(port: int, path: str, body: bytes, key: str, i: int) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nX-Run-Id: ttfb-{i // 20}\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


def _complete(buf: bytes) -> bool:
    head, sep, rest = buf.partition(b"\r\n\r\n")
    if not sep:
        return False
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        return rest.endswith(b"0\r\n\r\n")
    for line in lower.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(rest) >= int(line.split(b":")[1])
    return False


def _one(sock: socket.socket, req: bytes) -> tuple[float, float, bytes]:
    t0 = time.perf_counter()
    sock.sendall(req)
    buf, first = b"", 0.0
    while True:
        data = sock.recv(262144)
        if not data:
            raise ConnectionError("server closed the connection")
        buf += data
        if not first and b"data:" in buf:
            first = time.perf_counter() - t0
        if _complete(buf):
            return first or time.perf_counter() - t0, time.perf_counter() - t0, buf


def measure(port: int, path: str, body: bytes, key: str, n: int, warmup: int = 30) -> dict[str, float]:
    firsts, totals = [], []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(warmup + n):
            first, total, buf = _one(sock, _request(port, path, body, key, i))
            if not buf.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"unexpected answer: {buf[:300]!r}")
            if i >= warmup:
                firsts.append(first * 1e6)
                totals.append(total * 1e6)
    q = statistics.quantiles
    return {"first_p50_us": statistics.median(firsts), "first_p99_us": q(firsts, n=100)[98],
            "total_p50_us": statistics.median(totals), "total_p99_us": q(totals, n=100)[98], "n": n}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--body", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--n", type=int, default=300)
    a = p.parse_args()
    print(json.dumps(measure(a.port, a.path, Path(a.body).read_bytes(), a.key, a.n)))


if __name__ == "__main__":
    main()
