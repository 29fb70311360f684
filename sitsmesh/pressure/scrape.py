"""Scrape Triton's /metrics on a short interval into the stage signals of its models.

Per model: the pending-request gauge (summed over versions) and the counters
the controller turns into rates (success, failure, queue time). A scrape that
fails leaves the last sample in place; it ages, and the controller treats a
stale sample as a saturated stage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

from sitsmesh import logs
from sitsmesh.pressure.signals import TritonSample
from sitsmesh.triton import metrics

_log = logs.get("sitsmesh.pressure.scrape")
TIMEOUT_S = 1.0


def samples_from(text: str, at: float) -> dict[str, TritonSample]:
    """Per model, one sample from a /metrics page (versions summed)."""
    sums: dict[str, dict[str, float]] = {}
    for (model, _), values in metrics.by_version(text).items():
        total = sums.setdefault(model, {})
        for field, value in values.items():
            total[field] = total.get(field, 0.0) + value
    return {model: TritonSample(at, int(v.get("pending", 0)), v.get("success", 0.0),
                                v.get("failure", 0.0), v.get("queue_us", 0.0),
                                v.get("request_us", 0.0))
            for model, v in sums.items()}


async def scrape_forever(urls: Iterable[str], deliver: Callable[[str, TritonSample], None],
                         interval_s: float, clock: Callable[[], float] = time.monotonic
                         ) -> None:
    targets = list(urls)
    failing: set[str] = set()
    while True:
        for url in targets:
            try:
                text = await asyncio.to_thread(metrics.fetch, url, TIMEOUT_S)
            except (OSError, ValueError) as exc:
                if url not in failing:
                    _log.warning("Triton metrics scrape failing; its stages go stale",
                                 url=url, error=str(exc))
                    failing.add(url)
                continue
            if url in failing:
                _log.info("Triton metrics scrape recovered", url=url)
                failing.discard(url)
            for model, sample in samples_from(text, clock()).items():
                deliver(model, sample)
        await asyncio.sleep(interval_s)
