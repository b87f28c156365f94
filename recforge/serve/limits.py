"""Transport limits in front of the app: byte limits for every transfer encoding, read timeouts on
headers and bodies, and a status count of every response (the framework's own 4xx/5xx too).

- ``RequestLimits`` (ASGI middleware) reads each request body before the app sees it: at most
  ``max_body_bytes`` whether or not ``Content-Length`` is given (chunked bodies are counted as
  they arrive; 413 as soon as the limit is passed), within ``body_timeout_s`` (408), then hands
  the app the buffered body. After the body, ``receive`` still reports the client's disconnect,
  which the rank handler uses to drop work nobody waits for.
- Load shedding before any parsing: ``shed(path)`` is asked first, and a request it refuses gets
  503 with ``Retry-After`` without its body being read, so refusing costs almost nothing when
  the server is past saturation. ``LoopLag`` measures how late the event loop runs its
  callbacks (a busy loop cannot even read the requests it would refuse).
- ``http_protocol(header_timeout_s)``: uvicorn's protocol with a deadline on request headers
  (slowloris: a connection that does not finish its headers in time is closed). uvicorn itself
  only times out idle keep-alive connections.
"""

from __future__ import annotations

import math

import asyncio
import json
import time
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

Status = Callable[[str, int], None]  # (path, status) of every response
Shed = Callable[[str], "tuple[float, str] | None"]  # path -> (retry after s, why) to refuse the request now


class RequestLimits:
    """ASGI middleware: see the module docstring. ``on_status(path, status)`` sees every response."""

    def __init__(self, app, max_body_bytes: int, body_timeout_s: float, on_status: Status | None = None,
                 shed: Shed | None = None) -> None:  # fmt: skip
        self.app, self.max_body_bytes, self.body_timeout_s = app, max_body_bytes, body_timeout_s
        self.on_status, self.shed = on_status, shed

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        scope.setdefault("state", {})["arrival"] = time.monotonic()  # deadlines count from here

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start" and self.on_status is not None:
                self.on_status(path, message["status"])
            await send(message)

        refused = self.shed(path) if self.shed is not None else None
        if refused is not None:
            retry_after, why = refused
            await _reply(counted_send, 503, why, [(b"retry-after", str(int(retry_after)).encode())])
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await _reply(counted_send, 413, f"request body of {declared.decode(errors='replace')} bytes exceeds the "
                         f"limit of {self.max_body_bytes}")  # fmt: skip
            return
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.body_timeout_s)
        except TimeoutError:
            await _reply(counted_send, 408, f"the request body did not arrive within {self.body_timeout_s:g} s")
            return
        except _TooLarge:
            await _reply(counted_send, 413, f"request body exceeds the limit of {self.max_body_bytes} bytes")
            return
        except _Disconnected:
            return
        replayed = False

        async def buffered_receive():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: waits for the disconnect

        await self.app(scope, buffered_receive, counted_send)

    async def _read_body(self, receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


async def _reply(send, status: int, detail: str, extra: list | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close"),
               *(extra or [])]  # fmt: skip
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class LoopLag:
    """How late the event loop wakes up (seconds; a peak that decays), sampled every ``interval_s``."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s, self.lag_s = interval_s, 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(self.interval_s)
            late = time.monotonic() - t0 - self.interval_s
            self.lag_s = max(late, 0.8 * self.lag_s)


def http_protocol(header_timeout_s: float, base: type = HttpToolsProtocol) -> type:
    """uvicorn's HTTP protocol (httptools by default; ``base`` may be uvicorn's ``H11Protocol``) whose
    connections must deliver each request's headers within ``header_timeout_s`` of their first byte (or of
    the connection's start); else they are closed."""

    class HeaderTimeoutProtocol(base):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and self._header_timer is None:  # the first bytes of a new request on a kept-alive connection
                self._arm()
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before:  # the headers were parsed: the request is the app's now
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.cycle is None or self.cycle.response_complete:
                self.transport.close()

    return HeaderTimeoutProtocol


__all__ = ["LoopLag", "RequestLimits", "http_protocol"]


def overload_refusal(queued_s: float, lag_s: float, max_queue_ms: float, max_loop_lag_ms: float) -> tuple[float, str] | None:
    """(Retry-After seconds, message) when a request must be refused before it is read: ``queued_s`` of work is
    already queued past ``max_queue_ms``, or the event loop runs ``lag_s`` late, past ``max_loop_lag_ms``."""
    if queued_s * 1e3 > max_queue_ms:
        return max(1.0, math.ceil(queued_s - max_queue_ms / 1e3)), (
            f"overloaded: about {queued_s * 1e3:.0f} ms of work is queued (max_queue_ms {max_queue_ms:g}); retry later")
    if lag_s * 1e3 > max_loop_lag_ms:
        return 1.0, f"overloaded: the server is {lag_s * 1e3:.0f} ms behind reading requests; retry later"
    return None
