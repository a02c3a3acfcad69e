"""How a streamed relay ends: the client leaving is a disconnect, the engine failing is an upstream error."""
from __future__ import annotations

from types import SimpleNamespace

import aiohttp

from consort_router.proxy import relay_stream


class Upstream:
    def __init__(self, chunks: list[bytes], fail: Exception | None = None):
        self.closed = self.released = False

        async def iter_any():
            for chunk in chunks:
                yield chunk
            if fail is not None:
                raise fail

        self.response = SimpleNamespace(content=SimpleNamespace(iter_any=iter_any),
                                        close=lambda: setattr(self, "closed", True),
                                        release=lambda: setattr(self, "released", True))


class Client:
    """The client side of the relay: accepts `accept` writes, then behaves as a closed transport."""

    def __init__(self, accept: int):
        self.accept = accept
        self.written: list[bytes] = []

    async def prepare(self, request):
        pass

    async def write(self, data: bytes):
        if len(self.written) >= self.accept:
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        self.written.append(data)

    async def write_eof(self):
        pass


async def test_a_write_to_a_closed_client_is_a_disconnect_and_closes_the_upstream():
    up = Upstream([b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"])
    result = await relay_stream(up, Client(accept=1), None, capture=False)
    assert result.error == "client_disconnected" and not result.completed
    assert up.closed and not up.released   # closed, so the engine sees the disconnect and frees the sequence


async def test_the_engine_failing_mid_stream_is_an_upstream_error_with_a_terminal_event():
    up = Upstream([b"data: 1\n\n"], fail=aiohttp.ClientPayloadError("engine went away"))
    client = Client(accept=10)
    result = await relay_stream(up, client, None, capture=False)
    assert result.error == "upstream_failed" and up.closed
    assert b"upstream_failed" in client.written[-1]
