"""Steady streaming load on one tenant's token budget, and what it was charged per
window: shared by bench/token_budgets.py and the window test, so the two cannot count
differently.

Clients are raw asyncio HTTP/1.1 (one connection per request, light on a 2-core
machine): each loops streaming a chat completion through Envoy; on 429 it waits the
Retry-After, capped so the load stays steady. Charged tokens are summed client-side,
the way sitsmesh settles these streams: Envoy's token-timing filter asks the stage for
usage (and takes the usage event out of the client's stream), so each is charged the
stage's reported prompt (TokenStage's PROMPT_TOKENS) plus the content tokens the client
received, attributed to the fixed, epoch-aligned window the request started in (the
window its reservation was made in, which settling corrects).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sitsmesh.dev import harness
from sitsmesh.dev.tokenstage import PROMPT_TOKENS

TOKEN_MARK = b'"content": " t'
RETRY_CAP_S = 1.0


def budget_yaml(tenant: str, tokens: int, per: str = "minute") -> str:
    return ("apiVersion: sitsmesh.io/v1alpha1\nkind: TokenBudget\n"
            f"metadata: {{name: {tenant}}}\n"
            f"spec:\n  limits:\n    - {{tokens: {tokens}, per: {per}}}\n")


def chat_body(max_tokens: int) -> bytes:
    return json.dumps({"model": "stage", "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()


def setup_tenant(node: harness.Sitsmesh, workdir: Path, tenant: str,
                 budget: str | None) -> str:
    """A tenant allowed the model `stage`, an API key of it (returned), and its budget
    applied when one is given."""
    created = node.cli("tenants", "create", tenant, "--models", "stage")
    if created.returncode != 0:
        raise RuntimeError(created.stderr)
    made = node.cli("apikeys", "create", "--tenant", tenant, "--output", "json")
    if made.returncode != 0:
        raise RuntimeError(made.stderr)
    if budget is not None:
        path = workdir / f"budget-{tenant}.yaml"
        path.write_text(budget)
        applied = node.cli("apply", "-f", str(path))
        if applied.returncode != 0:
            raise RuntimeError(applied.stdout + applied.stderr)
    key: str = json.loads(made.stdout)["key"]
    return key


@dataclass(frozen=True, slots=True)
class Outcome:
    started: float  # wall clock (time.time), as sitsmesh's windows are
    status: int
    body_bytes: int
    tokens: int  # content tokens received
    retry_after: float = 0.0
    error: str = ""


async def stream_once(port: int, key: str, body: bytes, itl_ms: float,
                      timeout: float = 30.0) -> Outcome:
    """One streaming request through Envoy on `port`, read to its end."""
    started = time.time()
    try:
        return await asyncio.wait_for(_stream(port, key, body, itl_ms, started), timeout)
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
            ValueError, TimeoutError) as exc:
        return Outcome(started, 0, len(body), 0, error=f"{type(exc).__name__}: {exc}")


async def _stream(port: int, key: str, body: bytes, itl_ms: float,
                  started: float) -> Outcome:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
                      f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                      f"x-api-key: {key}\r\nx-stage-itl-ms: {itl_ms}\r\n"
                      "connection: close\r\n\r\n").encode() + body)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status = int(head.split(" ", 2)[1])
        headers = dict((name.strip().lower(), value.strip()) for name, _, value in
                       (line.partition(":") for line in head.split("\r\n")[1:] if line))
        payload = await reader.read()  # connection: close, so EOF ends the response
        if status != 200:
            retry = float(headers.get("retry-after") or 0)
            return Outcome(started, status, len(body), 0, retry_after=retry)
        done = b"data: [DONE]" in payload
        return Outcome(started, status, len(body), payload.count(TOKEN_MARK),
                       error="" if done else "stream ended without [DONE]")
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _client(port: int, key: str, body: bytes, itl_ms: float, deadline: float,
                  max_requests: int, out: list[Outcome]) -> None:
    for _ in range(max_requests):  # bounded in count as well as in time
        if time.time() >= deadline:
            return
        outcome = await stream_once(port, key, body, itl_ms)
        out.append(outcome)
        if outcome.status == 429:
            await asyncio.sleep(min(max(outcome.retry_after, 0.05), RETRY_CAP_S))
        elif outcome.error or outcome.status != 200:
            await asyncio.sleep(0.1)


async def load(port: int, key: str, *, clients: int, start: float, end: float,
               max_tokens: int, itl_ms: float) -> list[Outcome]:
    """`clients` loops from wall time `start` until `end` (no request starts after it;
    those in flight are read to their end)."""
    await asyncio.sleep(max(0.0, start - time.time()))
    body = chat_body(max_tokens)
    # A request takes at least its tokens' time or a 429 round trip; the cap is far
    # above what the time allows and only bounds a runaway loop.
    cap = int((end - start) * 1000) + 10
    out: list[Outcome] = []
    await asyncio.gather(*(_client(port, key, body, itl_ms, end, cap, out)
                           for _ in range(clients)))
    return out


def charged(outcome: Outcome) -> int:
    """What sitsmesh charges a finished stream (its usage's prompt, the tokens
    produced); a refusal, nothing."""
    if outcome.status != 200:
        return 0
    return PROMPT_TOKENS + outcome.tokens


def reserved(outcome: Outcome, max_tokens: int, chars_per_token: int = 4) -> int:
    """What Check reserves for a request: its body's size in tokens and max_tokens."""
    return math.ceil(outcome.body_bytes / chars_per_token) + max_tokens


def per_window(outcomes: Iterable[Outcome], window_s: int = 60) -> dict[int, int]:
    """Tokens charged per window start, each stream in the window it started in."""
    windows: dict[int, int] = {}
    for o in outcomes:
        start = int(o.started // window_s) * window_s
        windows[start] = windows.get(start, 0) + charged(o)
    return windows


def covered(start: float, end: float, window_s: int = 60) -> list[int]:
    """Window starts the load ran through from beginning to end."""
    first = math.ceil(start / window_s) * window_s
    return list(range(first, int(end) - window_s + 1, window_s))
