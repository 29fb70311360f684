"""Token budgets' request-time logic (sitsmesh/budgets/estimate.py and gate.py) over the
in-memory ledger: the estimate a request reserves, the 429 and its OpenAI headers, the
settle with what was produced, the ledger's outage settings."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import pytest

from sitsmesh.authz.check import Allowed, CheckInput, Denied
from sitsmesh.budgets.estimate import BadRequest, estimate
from sitsmesh.budgets.gate import BudgetGate, Reserved, reset_text
from sitsmesh.budgets.memory import MemoryLedger
from sitsmesh.budgets.model import Counter, TokenBudget, budget_from
from sitsmesh.tokens.formats import Usage
from sitsmesh.tokens.stream import TokenReport
from sitsmesh.tokens.timing import End, StreamSummary

NOW = 1_796_000_000.0
BUDGET = budget_from("acme", {"limits": [{"tokens": 1000, "per": "day"},
                                         {"tokens": 100, "per": "minute", "each": "api_key",
                                          "models": ["small-*"]}],
                              "default_max_tokens": 50, "chars_per_token": 4})
ALLOWED = Allowed("acme", 0, "llm", "stream", (), (), key_id="k1")


def _body(**doc: object) -> bytes:
    return json.dumps({"model": "llm", "messages": [{"role": "user", "content": "hi"}],
                       **doc}).encode()


def _request(body: bytes, request_id: str = "r1") -> CheckInput:
    return CheckInput({}, "/v1/chat/completions", body, request_id=request_id)


def _gate(ledger: MemoryLedger | None = None, budgets: dict[str, TokenBudget] | None = None,
          **kwargs: object) -> BudgetGate:
    chosen = {"acme": BUDGET} if budgets is None else budgets
    return BudgetGate(ledger if ledger is not None else MemoryLedger(), lambda: chosen,
                      clock=lambda: NOW, **kwargs)  # type: ignore[arg-type]


def _report(tokens: int, usage: Usage | None = None, estimate_in: int = 20,
            request_id: str = "r1") -> TokenReport:
    summary = StreamSummary(0.1, 0.01, 0.01, tokens, 50.0, (), 0, End.COMPLETE)
    return TokenReport(request_id, "/v1/chat/completions", "openai", summary, usage, 0,
                       tenant="acme", input_estimate=estimate_in, model="llm")


def test_the_estimate_takes_the_body_s_size_and_the_output_ceiling() -> None:
    body = _body(max_tokens=30)
    guess = estimate("/v1/chat/completions", body, BUDGET)
    assert guess.prompt == -(-len(body) // 4) and guess.completion == 30
    assert guess.cost == guess.prompt + 30
    assert estimate("/v1/chat/completions", _body(), BUDGET).completion == 50  # default
    assert estimate("/v1/chat/completions", _body(max_completion_tokens=7,
                                                  max_tokens=30), BUDGET).completion == 7
    assert estimate("/v1/embeddings", _body(), BUDGET).completion == 0


@pytest.mark.parametrize(("body", "message"), [
    (b"{", "not JSON"), (b"[]", "not a JSON object"),
    (_body(max_tokens=0), "max_tokens must be an integer from 1 to 1000000"),
    (_body(max_tokens=2_000_000), "max_tokens must be an integer"),
    (_body(max_tokens=1.5), "max_tokens must be an integer"),
    (_body(max_completion_tokens=True), "max_completion_tokens must be an integer"),
])
def test_a_body_that_cannot_be_estimated_says_why(body: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        estimate("/v1/chat/completions", body, BUDGET)


def test_reserve_until_spent_then_429_with_openai_headers() -> None:
    gate = _gate()
    cost = estimate("/v1/chat/completions", _body(max_tokens=200), BUDGET).cost

    async def run() -> list[Reserved | Denied | None]:
        return [await gate.reserve(BUDGET, ALLOWED, _request(_body(max_tokens=200), f"r{i}"))
                for i in range(10)]

    answers = asyncio.run(run())
    reserved = [a for a in answers if isinstance(a, Reserved)]
    assert len(reserved) == 1000 // cost
    refused = answers[len(reserved)]
    assert isinstance(refused, Denied) and refused.status == 429
    assert refused.code == "token_budget_exceeded"
    assert refused.budget == "1000 tokens per day for tenant acme"
    headers = dict(refused.headers)
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert int(headers["x-ratelimit-remaining-tokens"]) == 1000 - len(reserved) * cost
    assert refused.retry_after_s > 0
    assert reserved[0].headers == (("x-sits-token-estimate",
                                    str(reserved[0].estimate.prompt)),)


def test_a_limit_counts_only_its_models_and_its_key() -> None:
    small = Allowed("acme", 0, "small-1", "stream", (), (), key_id="k1")
    counters: Sequence[Counter] = BUDGET.counters("k1", "small-1")
    assert [c.index for c in counters] == [0, 1]
    assert [c.index for c in BUDGET.counters("k1", "llm")] == [0]
    gate = _gate()

    async def run() -> Reserved | Denied | None:
        return await gate.reserve(BUDGET, small, _request(_body(max_tokens=90)))

    refused = asyncio.run(run())  # ~30 input + 90 output is over the key's 100 a minute
    assert isinstance(refused, Denied)
    assert refused.budget == "100 tokens per minute for API key k1"


def test_settling_charges_what_was_produced_in_place_of_the_estimate() -> None:
    ledger = MemoryLedger()
    gate = _gate(ledger)

    async def run() -> tuple[int | None, list[int], int | None]:
        reserved = await gate.reserve(BUDGET, ALLOWED, _request(_body(max_tokens=200)))
        assert isinstance(reserved, Reserved)
        was = await gate.settle(_report(12, estimate_in=reserved.estimate.prompt))
        used = await ledger.usage(BUDGET.counters("k1", "llm"), NOW)
        again = await gate.settle(_report(12))
        return was, used, again

    was, used, again = asyncio.run(run())
    assert was is not None and was > 200
    prompt = estimate("/v1/chat/completions", _body(max_tokens=200), BUDGET).prompt
    assert used == [prompt + 12]
    assert again is None  # a second hop's report of the same request changes nothing


def test_usage_prices_the_prompt_and_its_cached_part() -> None:
    weighed = budget_from("acme", {"limits": [{"tokens": 10_000, "per": "day"}],
                                   "weights": {"input": 1, "output": 2,
                                               "cached_input": 0.5}})
    ledger = MemoryLedger()
    gate = _gate(ledger, {"acme": weighed})

    async def run() -> list[int]:
        assert isinstance(await gate.reserve(weighed, ALLOWED, _request(_body())), Reserved)
        await gate.settle(_report(10, Usage(100, 10, 40)))
        return await ledger.usage(weighed.counters("k1", "llm"), NOW)

    assert asyncio.run(run()) == [60 + 20 + 20]  # 60 input, 40 cached x 0.5, 10 out x 2


class _Away(MemoryLedger):
    async def reserve(self, *args: object, **kwargs: object) -> object:  # type: ignore[override]
        raise ConnectionError("redis is away")


@pytest.mark.parametrize(("fail_open", "expected"), [(True, None), (False, 503)])
def test_a_ledger_that_is_away_follows_the_outage_setting(fail_open: bool,
                                                          expected: int | None) -> None:
    gate = _gate(_Away(), fail_open=fail_open)
    answer = asyncio.run(gate.reserve(BUDGET, ALLOWED, _request(_body())))
    if expected is None:
        assert answer is None
    else:
        assert isinstance(answer, Denied) and answer.status == expected


def test_only_llm_requests_of_budgeted_tenants_are_governed() -> None:
    gate = _gate()
    assert gate.governs(ALLOWED) is BUDGET
    assert gate.governs(Allowed("acme", 0, "llm", "infer", (), ())) is None
    assert gate.governs(Allowed("other", 0, "llm", "stream", (), ())) is None
    # Where a budget is required, a tenant without one is refused its LLM calls only.
    required = _gate(require=True)
    refused = required.governs(Allowed("other", 0, "llm", "stream", (), ()))
    assert isinstance(refused, Denied) and (refused.status, refused.code) == (
        403, "token_budget_missing")
    assert "tenant other has no token budget" in refused.message
    assert required.governs(Allowed("other", 0, "llm", "infer", (), ())) is None


@pytest.mark.parametrize(("seconds", "text"), [(0.25, "250ms"), (1.2, "1s"), (59.6, "1m0s"),
                                               (360, "6m0s"), (3725, "62m5s")])
def test_reset_reads_as_openai_writes_it(seconds: float, text: str) -> None:
    assert reset_text(seconds) == text


def test_a_usage_below_the_events_seen_is_not_believed() -> None:
    """Each content event carries a token at least: a usage reporting fewer is charged as
    counted, and the difference counted; a usage above the events (several tokens an
    event) is the truth."""
    from prometheus_client import CollectorRegistry

    from sitsmesh.budgets.metrics import BudgetMetrics

    registry = CollectorRegistry()
    ledger = MemoryLedger()
    settled: list[tuple[int, int]] = []
    gate = BudgetGate(ledger, lambda: {"acme": BUDGET}, clock=lambda: NOW,
                      metrics=BudgetMetrics(registry),
                      on_settled=lambda report, reserved, charged: settled.append(
                          (reserved, charged)))

    def report(request_id: str, usage_out: int, counted: int) -> TokenReport:
        summary = StreamSummary(0.1, 0.01, 0.01, usage_out, 50.0, (), 0, End.COMPLETE,
                                counted=counted)
        return TokenReport(request_id, "/v1/chat/completions", "openai", summary,
                           Usage(10, usage_out), 0, tenant="acme", model="llm")

    async def run() -> None:
        for request_id, usage_out, counted in (("low", 5, 12), ("high", 30, 12)):
            assert isinstance(await gate.reserve(BUDGET, ALLOWED,
                                                 _request(_body(), request_id)), Reserved)
            await gate.settle(report(request_id, usage_out, counted))

    asyncio.run(run())
    assert [charged for _, charged in settled] == [10 + 12, 10 + 30]
    assert registry.get_sample_value("sitsmesh_token_budget_usage_short_tokens_total") == 7
    assert registry.get_sample_value("sitsmesh_token_budget_tokens_total",
                                     {"tenant": "acme", "model": "llm", "kind": "output"}) == 42


def test_the_decision_log_carries_the_reservation_and_the_charge() -> None:
    from sitsmesh.telemetry.decisionlog import DecisionLog

    log = DecisionLog("all")
    log.authz(_request(_body()), Allowed("acme", 0, "llm", "stream", (), (),
                                         reserved_tokens=67), 0.001)
    log.authz(_request(_body()), Denied(429, "token_budget_exceeded", "spent",
                                        tenant="acme", budget="1000 tokens per day"), 0.001)
    log.settlement("r1", "acme", "llm", 67, 33)
    allowed, denied, settled = log._buffer
    assert allowed["reserved_tokens"] == 67
    assert denied["budget"] == "1000 tokens per day"
    assert settled == {"kind": "token_budget", "request_id": "r1", "tenant": "acme",
                       "model": "llm", "reserved_tokens": 67, "charged_tokens": 33}
