"""A plain HTTP pipeline stage with a fixed capacity, for backpressure tests and benchmarks.

A stage serves at most `parallelism` requests at once; the others wait in its own
queue, unbounded and first come first served, as a real service's accept backlog and
worker queue would hold them. Each request holds a worker for a service time with mean
`service_ms`, drawn (seeded) from one of the simulator's distributions (fixed,
exponential, log-normal, bimodal: sitsmesh.pressure.loadprofile.service_time), so the
stage's capacity is `parallelism / mean service time`. It answers 200 with a small body.

A stage may call next hops over HTTP (the next Envoy listener), after its own work
(default) or before it. Hops are called in the order given; each is called `fanout`
times in parallel, and any call that fails or answers non-2xx makes the stage answer
502. The worker is held only for the stage's own work, never while it waits on a hop,
so a slow hop downstream does not eat this stage's capacity. `x-request-id` and every
`x-sits-*` header go on to the next hop, so Envoy's access logs of every hop carry the
request id and the identity Check attached at the entry.

It is one asyncio loop in one thread per stage (no thread per request), HTTP/1.1
with keep-alive on both sides, because Envoy's upstream pool reuses connections.

    with stage_service(parallelism=1, service_ms=20, forward_to=["http://127.0.0.1:8001"],
                       fanout=2) as svc:
        ... svc.port, svc.stats().served
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import urllib.parse
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from sitsmesh.pressure.loadprofile import SERVICE_KINDS, service_time

DISTRIBUTIONS = SERVICE_KINDS
ORDERS = ("after", "before")
MAX_HEAD = 64 * 1024
MAX_BODY = 16 * 1024 * 1024
MAX_IDLE_PER_HOP = 64
PROPAGATED_PREFIX = "x-sits-"
REASONS = {200: "OK", 400: "Bad Request", 413: "Payload Too Large", 502: "Bad Gateway"}


class ServiceTime:
    """Service times in seconds with mean `mean_ms`, of one of DISTRIBUTIONS: the
    simulator's, so the bench's stages and the offline model draw alike."""

    __slots__ = ("_rng", "distribution", "mean_s")

    def __init__(self, mean_ms: float, distribution: str = "fixed", seed: int = 0) -> None:
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {', '.join(DISTRIBUTIONS)}")
        if mean_ms < 0:
            raise ValueError("service_ms must be >= 0")
        self.mean_s = mean_ms / 1000
        self._rng = random.Random(seed)  # noqa: S311 - a load model, not a secret
        self.distribution = distribution

    def next(self) -> float:
        if self.mean_s == 0:
            return 0.0
        return service_time(self._rng, self.distribution, self.mean_s)


@dataclass(frozen=True, slots=True)
class Hop:
    """A next hop: `url` is http://host:port[/path]; without a path the request's own path
    goes on. `fanout` calls go out in parallel per request."""

    url: str
    fanout: int = 1


@dataclass(frozen=True, slots=True)
class StageStats:
    served: int          # requests whose own work finished
    answered: int        # replies sent, any status
    failed: int          # replies 502 because a hop failed
    in_flight: int       # requests inside the stage now: queued, served or waiting on hops
    in_flight_max: int
    busy_max: int        # most workers busy at once (never above parallelism)
    calls: int           # calls made to next hops
    call_failures: int


class HttpError(Exception):
    """A malformed or oversized message; the connection is closed after it."""


@dataclass(slots=True)
class _Message:
    first_line: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str:
        for key, value in self.headers:
            if key == name:
                return value
        return ""


async def _read_message(reader: asyncio.StreamReader, *, response: bool = False) -> _Message:
    """One HTTP/1.1 message: head, then a content-length or chunked body (a response
    without either runs to EOF). Raises IncompleteReadError at a clean EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError as exc:
        raise HttpError("header block too large") from exc
    lines = head[:-4].decode("latin-1").split("\r\n")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise HttpError(f"bad header line {line[:40]!r}")
        headers.append((name.strip().lower(), value.strip()))
    message = _Message(lines[0], headers, b"")
    if message.header("transfer-encoding").lower().endswith("chunked"):
        message.body = await _read_chunked(reader)
    elif length := message.header("content-length"):
        if not length.isdigit() or int(length) > MAX_BODY:
            raise HttpError(f"bad content-length {length[:20]!r}")
        message.body = await reader.readexactly(int(length))
    elif response:
        message.body = await reader.read(MAX_BODY)
    return message


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        size_line = (await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError as exc:
            raise HttpError("bad chunk size") from exc
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                pass
            return b"".join(parts)
        total += size
        if total > MAX_BODY:
            raise HttpError("body too large")
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


class _HopClient:
    """Keep-alive connections to one next hop, reused one request at a time."""

    def __init__(self, hop: Hop, timeout_s: float) -> None:
        parsed = urllib.parse.urlsplit(hop.url)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(f"forward_to: {hop.url!r} is not http://host:port[/path]")
        if hop.fanout < 1:
            raise ValueError(f"forward_to: fanout of {hop.url} must be >= 1")
        self.hop = hop
        self.host, self.port = parsed.hostname, parsed.port
        self.path = parsed.path if parsed.path not in ("", "/") else ""
        self.timeout_s = timeout_s
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def call(self, method: str, path: str, headers: Sequence[tuple[str, str]],
                   body: bytes) -> int:
        """The status of one call; raises OSError, TimeoutError or HttpError."""
        head = [f"{method} {self.path or path} HTTP/1.1", f"host: {self.host}:{self.port}",
                f"content-length: {len(body)}", *(f"{k}: {v}" for k, v in headers)]
        payload = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        async with asyncio.timeout(self.timeout_s):
            while self._idle:
                # A pooled connection the hop closed while idle fails before any reply
                # byte; only then is a retry on a fresh connection safe.
                reader, writer = self._idle.pop()
                with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                    return await self._exchange(reader, writer, payload)
            reader, writer = await asyncio.open_connection(self.host, self.port)
            try:
                return await self._exchange(reader, writer, payload)
            except asyncio.IncompleteReadError as exc:
                raise HttpError("next hop closed the connection without a reply") from exc

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        payload: bytes) -> int:
        keep = False
        try:
            writer.write(payload)
            await writer.drain()
            reply = await _read_message(reader, response=True)
            parts = reply.first_line.split(" ", 2)
            if len(parts) < 2 or not parts[1].isdigit():
                raise HttpError(f"bad status line {reply.first_line[:40]!r}")
            keep = (reply.header("connection").lower() != "close"
                    and bool(reply.header("content-length")
                             or reply.header("transfer-encoding")))
            return int(parts[1])
        finally:
            if keep and len(self._idle) < MAX_IDLE_PER_HOP:
                self._idle.append((reader, writer))
            else:
                writer.transport.abort()

    def close(self) -> None:
        for _, writer in self._idle:
            writer.transport.abort()
        self._idle.clear()


class StageService:
    """The stage; start() binds 127.0.0.1 on a free port and serves from its own thread."""

    def __init__(self, *, name: str = "stage", parallelism: int = 1, service_ms: float = 20.0,
                 distribution: str = "fixed", seed: int = 0,
                 forward_to: Sequence[str | Hop] = (), fanout: int = 1,
                 order: str = "after", forward_timeout_s: float = 30.0,
                 port: int = 0, keep_headers: int = 64) -> None:
        if parallelism < 1:
            raise ValueError("parallelism must be >= 1")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}")
        self.name = name
        self.parallelism = parallelism
        self.service_time = ServiceTime(service_ms, distribution, seed)
        self.order = order
        self.hops = [_HopClient(h if isinstance(h, Hop) else Hop(h, fanout), forward_timeout_s)
                     for h in forward_to]
        self.port = port
        # The last requests' headers, for tests to see what reached this stage.
        self.recent_headers: deque[dict[str, str]] = deque(maxlen=keep_headers)
        self._served = self._answered = self._failed = self._calls = self._call_failures = 0
        self._in_flight = self._in_flight_max = self._busy = self._busy_max = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._workers: asyncio.Semaphore | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def capacity_rps(self) -> float:
        """parallelism / mean service time: what the stage completes per second, saturated."""
        mean_s = self.service_time.mean_s
        return float("inf") if mean_s == 0 else self.parallelism / mean_s

    def stats(self) -> StageStats:
        # Read on the stage's own loop, between its steps: a reply the caller already has
        # is then always counted (the count and the write share one step).
        loop = self._loop
        if loop is None or not loop.is_running():
            return self._stats()

        async def read() -> StageStats:
            return self._stats()

        return asyncio.run_coroutine_threadsafe(read(), loop).result(10)

    def _stats(self) -> StageStats:
        return StageStats(self._served, self._answered, self._failed, self._in_flight,
                          self._in_flight_max, self._busy_max, self._calls,
                          self._call_failures)

    def start(self) -> StageService:
        if self._thread is not None:
            raise RuntimeError(f"stage {self.name} already started")
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name=f"stage-{self.name}",
                                        daemon=True)
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._listen(), loop)
        try:
            future.result(10)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._close(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> StageService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _listen(self) -> None:
        self._workers = asyncio.Semaphore(self.parallelism)
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", self.port,
                                                  limit=MAX_HEAD, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        for hop in self.hops:
            hop.close()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while True:
                try:
                    request = await _read_message(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                except HttpError:
                    writer.write(_reply(400, b"bad request\n", close=True))
                    return
                parts = request.first_line.split(" ")
                if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                    writer.write(_reply(400, b"bad request line\n", close=True))
                    return
                close = (parts[2] == "HTTP/1.0"
                         or request.header("connection").lower() == "close")
                status, body = await self._handle(parts[0], parts[1], request)
                writer.write(_reply(status, body, close=close))
                # Counted once handed to the transport: the client may read the reply
                # (and ask for stats) before drain() gives this task the loop back.
                self._answered += 1
                await writer.drain()
                if close:
                    return
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._connections.discard(task)
            writer.transport.abort()

    async def _handle(self, method: str, path: str, request: _Message) -> tuple[int, bytes]:
        self.recent_headers.append(dict(request.headers))
        self._in_flight += 1
        self._in_flight_max = max(self._in_flight_max, self._in_flight)
        try:
            if self.order == "before" and not await self._forward(method, path, request):
                return self._fail()
            await self._work()
            if self.order == "after" and not await self._forward(method, path, request):
                return self._fail()
            return 200, f"{self.name} ok\n".encode()
        finally:
            self._in_flight -= 1

    def _fail(self) -> tuple[int, bytes]:
        self._failed += 1
        return 502, f"{self.name}: a next hop failed\n".encode()

    async def _work(self) -> None:
        assert self._workers is not None
        async with self._workers:
            self._busy += 1
            self._busy_max = max(self._busy_max, self._busy)
            try:
                await asyncio.sleep(self.service_time.next())
            finally:
                self._busy -= 1
        self._served += 1

    async def _forward(self, method: str, path: str, request: _Message) -> bool:
        """Every hop in turn, each `fanout` times at once; False if any call failed."""
        headers = [(k, v) for k, v in request.headers
                   if k == "x-request-id" or k.startswith(PROPAGATED_PREFIX)]
        for hop in self.hops:
            calls = [self._call(hop, method, path, headers, request.body)
                     for _ in range(hop.hop.fanout)]
            if not all(await asyncio.gather(*calls)):
                return False
        return True

    async def _call(self, hop: _HopClient, method: str, path: str,
                    headers: Sequence[tuple[str, str]], body: bytes) -> bool:
        self._calls += 1
        try:
            ok = 200 <= await hop.call(method, path, headers, body) < 300
        except (OSError, TimeoutError, HttpError, asyncio.IncompleteReadError):
            ok = False
        if not ok:
            self._call_failures += 1
        return ok


def _reply(status: int, body: bytes, *, close: bool) -> bytes:
    head = (f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\n"
            f"content-type: text/plain\r\ncontent-length: {len(body)}\r\n"
            + ("connection: close\r\n" if close else "") + "\r\n")
    return head.encode("latin-1") + body


# `with stage_service(...) as svc:` starts the stage on entry and stops it on exit.
stage_service = StageService
