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
