"""The offered load and the client: a step profile in multiples of the bottleneck's capacity,
seeded Poisson arrivals, and an open-loop asyncio client (one connection per request).

The client is truly open loop: each request starts at its due time whatever is
outstanding, and the lag behind the due time is kept, so a client that fell behind
shows in the notes instead of silently easing the load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

HIGH, LOW = 9, 0
# Bounds on any one run, whatever the flags say: the schedule never holds more requests
# than this, and a run never lasts longer than its profile plus the client timeout.
MAX_REQUESTS = 20_000


@dataclass(frozen=True)
class Segment:
    name: str
    seconds: float
    start_x: float  # offered load, in multiples of capacity, at the start ...
    end_x: float    # ... and at the end (linear in between)


# The profile: half the capacity (a stage that must not shed), twice (overload),
# half again (recovery). Short enough for one scenario x 4 variants in ~2 minutes.
PROFILE = (Segment("calm", 6, 0.5, 0.5), Segment("2x", 8, 2.0, 2.0),
           Segment("recovery", 8, 0.5, 0.5))


def phase(name: str) -> tuple[float, float]:
    t = 0.0
    for seg in PROFILE:
        if seg.name == name:
            return t, t + seg.seconds
        t += seg.seconds
    raise KeyError(name)


def total_s() -> float:
    return sum(seg.seconds for seg in PROFILE)


def multiplier(t: float) -> float:
    start = 0.0
    for seg in PROFILE:
        if t < start + seg.seconds:
            return seg.start_x + (seg.end_x - seg.start_x) * (t - start) / seg.seconds
        start += seg.seconds
    return PROFILE[-1].end_x


def describe_profile() -> str:
    return ", ".join(f"{seg.name} {seg.seconds:g} s "
                     + (f"{seg.start_x:g}x" if seg.start_x == seg.end_x
                        else f"{seg.start_x:g}x->{seg.end_x:g}x") for seg in PROFILE)


def schedule(capacity: float, high_share: float, seed: int) -> list[tuple[float, int]]:
    """(due second, priority) of every request: a Poisson process at the profile's rate
    (thinning of one at the peak rate), priorities spread evenly by a golden-ratio
    sequence so the high share is exact whatever the seed."""
    rng = random.Random(seed)
    peak = max(max(seg.start_x, seg.end_x) for seg in PROFILE) * capacity
    out: list[tuple[float, int]] = []
    golden = (math.sqrt(5) - 1) / 2
    t, end = 0.0, total_s()
    while len(out) < MAX_REQUESTS:
        t += rng.expovariate(peak)
        if t >= end:
            break
        if rng.random() * peak < multiplier(t) * capacity:
            i = len(out)
            out.append((t, HIGH if (i * golden) % 1.0 < high_share else LOW))
    return out


@dataclass(frozen=True)
class RequestSpec:
    """What a scenario's client sends: the path, the body and headers beside the key."""

    method: str
    path: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()

    def payload(self, port: int, key: str, priority: int) -> bytes:
        lines = [f"{self.method} {self.path} HTTP/1.1", f"host: 127.0.0.1:{port}",
                 f"x-api-key: {key}", f"x-priority: {priority}",
                 *(f"{k}: {v}" for k, v in self.headers),
                 f"content-length: {len(self.body)}", "connection: close"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + self.body


def kserve_spec(model: str) -> RequestSpec:
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32",
                                   "data": [1, 2, 3, 4]}]}).encode()
    return RequestSpec("POST", f"/v2/models/{model}/infer", body,
                       (("content-type", "application/json"),))


def hinted_spec(pipeline: str) -> RequestSpec:
    """A plain request that names its pipeline, as a non-model entry point would."""
    return RequestSpec("POST", "/pipeline", b'{"x": [1, 2, 3, 4]}',
                       (("content-type", "application/json"),
                        ("x-sits-pipeline-hint", pipeline)))


@dataclass(frozen=True, slots=True)
class Result:
    sent: float       # due time, seconds from the run's start
    lag: float        # how late the client actually started it
    priority: int
    status: int       # HTTP status; 0 = the caller gave up (timeout), -1 = connection error
    seconds: float
    code: str         # sitsmesh's JSON code, the start of another body, or "timeout"


def parse_reply(raw: bytes) -> tuple[int, str]:
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return -1, "unparsable reply"
    if status == 200:
        return status, ""
    text = body.decode(errors="replace").strip()
    if text.startswith("{"):
        with contextlib.suppress(ValueError, AttributeError):
            return status, str(json.loads(text).get("code", ""))
    return status, text[:40]


async def call(port: int, payload: bytes, timeout: float) -> tuple[int, str, float]:
    began = time.monotonic()
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(payload)
            await writer.drain()
            raw = await reader.read()  # connection: close, so until EOF
        status, code = parse_reply(raw)
    except TimeoutError:
        status, code = 0, "timeout"
    except OSError as exc:
        status, code = -1, type(exc).__name__
    finally:
        if writer is not None:
            writer.transport.abort()
    return status, code, time.monotonic() - began


async def open_loop(port: int, key: str, spec: RequestSpec, plan: Sequence[tuple[float, int]],
                    timeout: float, t0_box: list[float]) -> list[Result]:
    payloads = {p: spec.payload(port, key, p) for p in (HIGH, LOW)}
    t0 = time.monotonic() + 0.2
    t0_box.append(t0)

    async def one(due: float, priority: int) -> Result:
        lag = time.monotonic() - (t0 + due)
        status, code, seconds = await call(port, payloads[priority], timeout)
        return Result(due, lag, priority, status, seconds, code)

    tasks = []
    for due, priority in plan[:MAX_REQUESTS]:
        delay = t0 + due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(due, priority)))
    return sorted(await asyncio.gather(*tasks), key=lambda r: r.sent)


async def closed_loop(port: int, key: str, spec: RequestSpec, workers: int, warm_s: float,
                      seconds: float, timeout: float) -> tuple[int, list[float], int]:
    """Completions inside [warm, warm + seconds], their latencies, and failures."""
    payload = spec.payload(port, key, LOW)
    start = time.monotonic()
    begin, end = start + warm_s, start + warm_s + seconds
    done: list[float] = []
    failed = 0

    async def worker() -> None:
        nonlocal failed
        while time.monotonic() < end:
            status, _, latency = await call(port, payload, timeout)
            now = time.monotonic()
            if status != 200:
                failed += 1
            elif begin <= now <= end:
                done.append(latency)

    await asyncio.gather(*(worker() for _ in range(workers)))
    return len(done), done, failed
