"""The data-plane port: update bodies written by the kernel straight into the staging area.

`PUT /v1/weights/updates/{id}/body` on the main port arrives as bytes chunks that uvicorn copies
several times (~0.3-0.6 GB/s on two loaded cores, measured in docs/BENCHMARKS.md). The same route on
this port is served by an `asyncio.BufferedProtocol` whose `get_buffer` hands out the current
frame's staging slot, so the socket `recv_into`s payloads where they stay. Same auth and the same
answers as the main port (`UpdateStatus`, or `{"detail"}` with a 4xx). An HTTP/1.1 subset: one
request per connection, a Content-Length or chunked body, the answer once the body ended, then
close. The port is announced as `data_port` in every `UpdateStatus`.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import re

from .protocol import WEIGHT_VERSION_HEADER
from .transactions import BodyReceiver, UpdateError, UpdateManager

MAX_HEAD_BYTES = 64 * 1024
_PATH = re.compile(r"/v1/weights/updates/([0-9a-zA-Z_-]+)/body")
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            409: "Conflict", 411: "Length Required", 413: "Content Too Large", 422: "Unprocessable Content",
            500: "Internal Server Error"}


class DataPlane:
    """The listening socket; `start` binds (port 0: a free one) and returns the port."""

    def __init__(self, updates: UpdateManager, *, token: str | None):
        self.updates, self.token = updates, token
        self.server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _BodyConnection(self), host, port)
        return self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


class _BodyConnection(asyncio.BufferedProtocol):
    """One request. States: head -> body (length | chunk size line | chunk data | chunk end |
    trailer) -> answered. After an error the rest of the body is read and dropped, then answered."""

    def __init__(self, plane: DataPlane):
        self.plane = plane
        self.scratch = memoryview(bytearray(1 << 16))
        self.head = bytearray()
        self.state = "head"
        self.chunked = False
        self.remaining = 0              # body bytes left (length) or bytes left of the current chunk
        self.line = bytearray()         # chunk size line / trailer line being read
        self.rx: BodyReceiver | None = None
        self.error: UpdateError | None = None
        self.direct = False
        self.transport: asyncio.Transport | None = None

    # ------------------------------------------------------------------ asyncio.BufferedProtocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        self.direct = self.state in ("length", "data") and self.rx is not None and self.error is None
        if self.direct:
            return self.rx.get_buffer()[:self.remaining]
        return self.scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self.direct:
            self.remaining -= nbytes
            self._guard(self.rx.advance, nbytes)
            self._after_data()
        else:
            self._consume(self.scratch[:nbytes])

    def connection_lost(self, exc) -> None:
        self._release()

    # ------------------------------------------------------------------ parsing
    def _consume(self, view: memoryview) -> None:
        pos = 0
        while pos < len(view) and self.state != "answered":
            if self.state == "head":
                self.head += view[pos:]
                end = self.head.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.head) > MAX_HEAD_BYTES:
                        return self._answer(UpdateError("request head too large", status=413))
                    return
                pos = len(view) - (len(self.head) - end - 4)     # the body starts after the blank line
                self._start(bytes(self.head[:end]))
            elif self.state in ("length", "data"):
                n = min(self.remaining, len(view) - pos)
                self.remaining -= n
                if self.rx is not None and self.error is None:
                    self._guard(self.rx.feed, view[pos:pos + n])
                pos += n
                self._after_data()
            else:                                            # size line, chunk end or trailer: one line
                nl = bytes(view[pos:]).find(b"\n")
                if nl < 0:
                    self.line += view[pos:]
                    if len(self.line) > 1024:
                        return self._answer(UpdateError("malformed chunked body", status=400))
                    return
                self.line += view[pos:pos + nl + 1]
                pos += nl + 1
                line, self.line = bytes(self.line).strip(), bytearray()
                self._line(line)

    def _line(self, line: bytes) -> None:
        if self.state == "size":
            try:
                self.remaining = int(line.split(b";")[0], 16)
            except ValueError:
                return self._answer(UpdateError(f"malformed chunk size {line[:20]!r}", status=400))
            self.state = "data" if self.remaining else "trailer"
        elif self.state == "chunk_end":
            if line:
                return self._answer(UpdateError("malformed chunked body", status=400))
            self.state = "size"
        elif not line:                                       # trailer: the empty line ends the body
            self._body_end()

    def _after_data(self) -> None:
        if self.remaining == 0:
            if self.chunked:
                self.state = "chunk_end"
            else:
                self._body_end()

    def _start(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, _ = lines[0].split(" ", 2)
        except ValueError:
            return self._answer(UpdateError("malformed request line", status=400))
        headers = {}
        for ln in lines[1:]:
            if ":" in ln:
                k, v = ln.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        m = _PATH.fullmatch(target.split("?")[0])
        if m is None:
            return self._answer(UpdateError(f"the data-plane port serves only PUT /v1/weights/updates/ID/body, "
                                            f"not {target}", status=404))
        if method != "PUT":
            return self._answer(UpdateError(f"method {method} not allowed", status=405))
        token = self.plane.token
        if token is not None and not hmac.compare_digest(headers.get("authorization", "").encode(),
                                                         f"Bearer {token}".encode()):
            return self._answer(UpdateError("missing or wrong bearer token", status=401))
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if not self.chunked and "content-length" not in headers:
            return self._answer(UpdateError("a body needs Content-Length or chunked encoding", status=411))
        try:
            self.rx = self.plane.updates.receiver(m.group(1))
        except UpdateError as e:
            return self._answer(e)
        if headers.get("expect", "").lower() == "100-continue":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self.chunked:
            self.state = "size"
        else:
            self.state, self.remaining = "length", int(headers["content-length"])
            self._after_data()

    def _guard(self, fn, arg) -> None:
        try:
            fn(arg)
        except UpdateError as e:
            self.error = e                                   # drop the rest of the body, then answer
        except Exception as e:  # noqa: BLE001 - answered as a 500 naming it, never a hung client
            self.error = UpdateError(f"{type(e).__name__}: {e}", status=500)

    def _body_end(self) -> None:
        if self.error is None:
            self._guard(lambda _: self.rx.finish(), None)
        self._answer(self.error)

    # ------------------------------------------------------------------ answer
    def _release(self) -> None:
        if self.rx is not None:
            self.plane.updates.body_done(self.rx)
            self.rx = None

    def _answer(self, error: UpdateError | None) -> None:
        updates = self.plane.updates
        if error is None:
            status, body = 200, updates.status(self.rx.update).model_dump_json().encode()
        else:
            status, body = error.status, json.dumps({"detail": str(error)}).encode()
        self._release()
        self.state = "answered"
        head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{WEIGHT_VERSION_HEADER}: {updates.version}\r\n"
                f"Connection: close\r\n\r\n")
        self.transport.write(head.encode() + body)
        self.transport.close()
