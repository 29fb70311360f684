"""Scrape Triton's /metrics on a short interval into the stage signals of its models.

Per model: the pending-request gauge (summed over versions) and the counters
the controller turns into rates (success, failure, queue time). A scrape that
fails leaves the last sample in place; it ages, and the controller treats a
stale sample as a saturated stage.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable

from prometheus_client.parser import text_string_to_metric_families

from sitsmesh import logs
from sitsmesh.pressure.signals import TritonSample

_log = logs.get("sitsmesh.pressure.scrape")
TIMEOUT_S = 1.0
_FAMILIES = {"nv_inference_pending_request_count": "pending",
             "nv_inference_request_success": "success",
             "nv_inference_request_failure": "failure",
             "nv_inference_queue_duration_us": "queue_us",
             "nv_inference_request_duration_us": "request_us"}


def samples_from(text: str, at: float) -> dict[str, TritonSample]:
    """Per model, one sample from a /metrics page (versions summed)."""
    sums: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        # The parser drops a counter's _total suffix from the family name.
        field = _FAMILIES.get(family.name) or _FAMILIES.get(family.name + "_total")
        if field is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            model = sample.labels.get("model")
            if model:
                values = sums.setdefault(model, {})
                values[field] = values.get(field, 0.0) + sample.value
    return {model: TritonSample(at, int(v.get("pending", 0)), v.get("success", 0.0),
                                v.get("failure", 0.0), v.get("queue_us", 0.0),
                                v.get("request_us", 0.0))
            for model, v in sums.items()}


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as reply:  # noqa: S310 (config URL)
        return str(reply.read().decode())


async def scrape_forever(urls: Iterable[str], deliver: Callable[[str, TritonSample], None],
                         interval_s: float, clock: Callable[[], float] = time.monotonic
                         ) -> None:
    targets = list(urls)
    failing: set[str] = set()
    while True:
        for url in targets:
            try:
                text = await asyncio.to_thread(_fetch, url)
            except (OSError, urllib.error.URLError, ValueError) as exc:
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
