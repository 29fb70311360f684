"""A prompt counted in the model's own tokens (sitsmesh/budgets/prompt.py), with a real
Hugging Face tokenizer.json the test trains and writes: chat messages, text parts,
completion prompts; models without a tokenizer fall back to the body's size; a file
that is not a tokenizer is refused at start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sitsmesh.budgets.estimate import estimate
from sitsmesh.budgets.model import budget_from
from sitsmesh.budgets.prompt import PER_MESSAGE, PromptCounter, prompt_texts
from sitsmesh.errors import ConfigError
from tests.tokenizerfile import write_tokenizer

BUDGET = budget_from("acme", {"limits": [{"tokens": 10_000, "per": "day"}]})


def test_the_prompt_is_counted_in_the_model_s_tokens(tmp_path: Path) -> None:
    counter = PromptCounter({"llama-*": write_tokenizer(tmp_path / "tok.json")})
    chat = {"messages": [{"role": "system", "content": "hello world"},
                         {"role": "user", "content": [{"type": "text", "text": "how are you"},
                                                      {"type": "image_url"}]}]}
    assert counter.tokens("llama-3", chat) == 5 + 2 * PER_MESSAGE
    assert counter.tokens("llama-3", {"prompt": ["hello", "world today"]}) == 3
    assert counter.tokens("gpt-x", chat) is None  # no tokenizer for it
    assert counter.tokens("llama-3", {"messages": "not a list"}) is None
    body = json.dumps({"model": "llama-3", **chat, "max_tokens": 10}).encode()
    counted = estimate("/v1/chat/completions", body, BUDGET, "llama-3", counter)
    assert (counted.prompt, counted.completion) == (13, 10)
    sized = estimate("/v1/chat/completions", body, BUDGET, "gpt-x", counter)
    assert sized.prompt == -(-len(body) // 4)


def test_prompt_texts_reads_every_kind_of_prompt() -> None:
    assert prompt_texts({"input": "a b"}) == (["a b"], 0)
    assert prompt_texts({"messages": [{"content": "x"}, "junk", {"content": 3}]}) == (
        ["x"], 2)


@pytest.mark.parametrize(("files", "message"), [
    ({"llama-*": "/nonexistent/tok.json"}, "cannot load a tokenizer.json"),
    ({"[": "x"}, "budget_tokenizers"),
])
def test_a_bad_tokenizer_setting_is_refused_at_start(files: dict[str, str], message: str,
                                                     tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        PromptCounter(files)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="cannot load"):
        PromptCounter({"*": tmp_path / "bad.json"})
