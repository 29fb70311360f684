"""What an OpenAI-compatible request is about to cost, read from its body at Check: the
estimate a token budget reserves before the engine has produced anything.

Input tokens: the model's own tokenizer's count of the prompt where one is configured
(sitsmesh/budgets/prompt.py), else the body's size over the budget's `chars_per_token`
(JSON's quotes and keys make it an over-estimate, which settling corrects). Output
tokens: the request's `max_completion_tokens` or `max_tokens` (what the engine may
produce at most), else the budget's `default_max_tokens`. An estimate that is too high
holds tokens until the stream ends; one too low lets a stream overshoot by the
difference, so output is taken at its ceiling.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from sitsmesh.budgets.model import MAX_OUTPUT_TOKENS, TokenBudget
from sitsmesh.budgets.prompt import PromptCounter

# The routes whose requests spend tokens (Check's "openai" and "stream" classes cover
# embeddings too: an embedding's output is a vector, so its estimate is its input).
CHAT_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
OUTPUT_KEYS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


@dataclass(frozen=True, slots=True)
class Estimate:
    prompt: int
    completion: int
    cost: int


class BadRequest(ValueError):
    """The body cannot be estimated; the message says why (400)."""


def estimate(path: str, body: bytes, budget: TokenBudget, model: str = "",
             counter: PromptCounter | None = None) -> Estimate:
    """The estimate of a request the budget governs; BadRequest where the body is not a
    JSON object or asks for an absurd output. `counter`: the models' own tokenizers,
    which count the prompt where one is configured for `model`."""
    try:
        doc: Any = json.loads(body) if body else None
    except (ValueError, RecursionError):
        raise BadRequest("the body is not JSON: a token budget needs it to estimate the "
                         "request") from None
    if not isinstance(doc, dict):
        raise BadRequest("the body is not a JSON object: a token budget needs it to "
                         "estimate the request")
    counted = counter.tokens(model, doc) if counter is not None else None
    prompt = counted if counted is not None else math.ceil(len(body) / budget.chars_per_token)
    completion = 0
    if path.partition("?")[0].rstrip("/").lower().endswith(CHAT_PATHS):
        completion = budget.default_max_tokens
        for key in OUTPUT_KEYS:
            value = doc.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or \
                    not 1 <= value <= MAX_OUTPUT_TOKENS:
                raise BadRequest(f"{key} must be an integer from 1 to {MAX_OUTPUT_TOKENS}, "
                                 f"got {str(value)[:40]}")
            completion = value
            break
    return Estimate(prompt, completion, budget.weights.cost(prompt, completion))
