"""Constant background traffic on a Triton model, bounded in count and time.

Unversioned requests, one at a time from a thread, as a caller who knows
nothing of swaps would send them. Every outcome is kept, so a test can count
failures and see which version answered when.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from sitsmesh.dev import demo_model


@dataclass(frozen=True, slots=True)
class Outcome:
    at: float
    version: int        # 0 when the request failed
    seconds: float
    error: str = ""


@dataclass
class BackgroundLoad:
    url: str
    model: str
    interval_s: float = 0.005
    max_requests: int = 50_000
    max_seconds: float = 180.0
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="triton-load", daemon=True)

    def __enter__(self) -> BackgroundLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        client = triton_grpc.InferenceServerClient(self.url)
        data = np.arange(demo_model.WIDTH, dtype=np.float32)
        deadline = time.monotonic() + self.max_seconds
        try:
            while (not self._stop.is_set() and len(self.outcomes) < self.max_requests
                   and time.monotonic() < deadline):
                tensor = triton_grpc.InferInput(demo_model.INPUT, [demo_model.WIDTH], "FP32")
                tensor.set_data_from_numpy(data)
                started = time.perf_counter()
                try:
                    result = client.infer(self.model, [tensor], client_timeout=10)
                except InferenceServerException as exc:
                    self.outcomes.append(Outcome(time.time(), 0, time.perf_counter() - started,
                                                 str(exc)[:200]))
                else:
                    version = int(result.get_response().model_version)
                    self.outcomes.append(Outcome(time.time(), version,
                                                 time.perf_counter() - started))
                self._stop.wait(self.interval_s)
        finally:
            client.close()

    def wait_for(self, count: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while len(self.outcomes) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"background load made {len(self.outcomes)} of {count} "
                                   "requests")
            time.sleep(0.01)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error]

    def on(self, version: int) -> list[Outcome]:
        return [o for o in self.outcomes if o.version == version]

    def p50_ms(self, version: int) -> float:
        return statistics.median(o.seconds for o in self.on(version)) * 1000


@dataclass
class OpenLoop:
    """Poisson arrivals of one-item requests (a batching model's [1, WIDTH] input) at
    `rate` for `seconds`, open loop: a slow server does not slow the arrivals, as real
    callers do not wait for each other. Bounded by `seconds`; every outcome is kept
    (latency in s, or the error)."""

    url: str
    model: str
    rate: float
    seconds: float
    seed: int = 7
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.sent = 0

    def _run(self) -> None:
        client = triton_grpc.InferenceServerClient(self.url)
        data = triton_grpc.InferInput(demo_model.INPUT, [1, demo_model.WIDTH], "FP32")
        data.set_data_from_numpy(np.ones((1, demo_model.WIDTH), np.float32))
        rng = np.random.default_rng(self.seed)
        began = time.perf_counter()
        at = began
        while at - began < self.seconds:
            at += float(rng.exponential(1 / self.rate))
            wait = at - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            sent = time.perf_counter()

            def done(result: Any, error: Any, sent: float = sent) -> None:
                with self._lock:
                    if error is not None:
                        self.errors.append(str(error))
                    else:
                        self.latencies.append(time.perf_counter() - sent)

            client.async_infer(self.model, [data], done, client_timeout=20)
            self.sent += 1
        deadline = time.monotonic() + 30
        while (len(self.latencies) + len(self.errors) < self.sent
               and time.monotonic() < deadline):
            time.sleep(0.05)
        client.close()

    def __enter__(self) -> OpenLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(self.seconds + 40)

    def p99_ms(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[int(len(ordered) * 0.99)] * 1000 if ordered else float("inf")
