"""The suite's redis-server fixture survives the race it is exposed to: a port picked free
may be taken by another process before redis-server binds it (a CI run failed on it)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.fixtures.redis import BINARY, SKIP_REASON, RedisServer, _ping


@pytest.mark.skipif(BINARY is None, reason=SKIP_REASON)
def test_a_server_whose_port_was_taken_meanwhile_starts_on_another(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    taken = server.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        server.start()
        try:
            assert server.port != taken and _ping(server.port)
            server.stop()
            server.start()  # a restart keeps its port: tests reconnect to the same URL
            assert _ping(server.port)
        finally:
            server.stop()
