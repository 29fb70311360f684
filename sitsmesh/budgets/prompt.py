"""A request's prompt in the model's own tokens, where sitsmesh has the model's tokenizer:
a Hugging Face `tokenizer.json` per model glob (setting `budget_tokenizers`, loaded once
at start). Without one the estimate falls back to the body's size.

The `tokenizers` library (Hugging Face's Rust tokenizers, what vLLM and TGI load) rather
than counting by hand: a model's token count is its tokenizer's, nothing else gives it.
tiktoken's encodings are fetched from the internet on first use, so files an operator
ships are the reliable source.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sitsmesh import globs
from sitsmesh.errors import ConfigError

# Chat templates wrap each message in a few tokens of their own (role, separators).
PER_MESSAGE = 4
MAX_CACHED_MODELS = 1024


class PromptCounter:
    """`tokens(model, doc)`: the prompt tokens of a parsed request body, or None where no
    tokenizer is configured for the model or the body has no prompt text."""

    __slots__ = ("_by_model", "_rules")

    def __init__(self, files: Mapping[str, str | Path]) -> None:
        from tokenizers import Tokenizer  # loaded only where a tokenizer is configured

        self._rules: list[tuple[globs.Globs, Any]] = []
        for pattern, file in files.items():
            try:
                globs.check([pattern], "budget_tokenizers")
                tokenizer = Tokenizer.from_file(str(file))
            except globs.GlobError as exc:
                raise ConfigError(str(exc)) from None
            except Exception as exc:  # the library raises its own Exception types
                raise ConfigError(f"budget_tokenizers: {pattern}={file}: cannot load a "
                                  f"tokenizer.json: {str(exc)[:200]}") from None
            self._rules.append((globs.Globs(([pattern],)), tokenizer))
        self._by_model: dict[str, Any] = {}

    def __bool__(self) -> bool:
        return bool(self._rules)

    def tokenizer(self, model: str) -> Any:
        """The first configured tokenizer whose glob matches, or None."""
        if model in self._by_model:
            return self._by_model[model]
        found = next((t for g, t in self._rules if g.matches(model)), None)
        if len(self._by_model) >= MAX_CACHED_MODELS:
            self._by_model.clear()
        self._by_model[model] = found
        return found

    def tokens(self, model: str, doc: Mapping[str, Any]) -> int | None:
        tokenizer = self.tokenizer(model) if self._rules else None
        if tokenizer is None:
            return None
        texts, messages = prompt_texts(doc)
        if not texts:
            return None
        encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
        return sum(len(e.ids) for e in encoded) + PER_MESSAGE * messages


def prompt_texts(doc: Mapping[str, Any]) -> tuple[list[str], int]:
    """The prompt's texts (chat messages' content and text parts, a completion's
    `prompt`, `input`), and how many chat messages there are."""
    texts: list[str] = []
    messages = doc.get("messages")
    count = 0
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            count += 1
            content = message.get("content")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts.extend(part["text"] for part in content
                             if isinstance(part, dict) and isinstance(part.get("text"), str))
    for key in ("prompt", "input"):
        value = doc.get(key)
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, list):
            texts.extend(v for v in value if isinstance(v, str))
    return texts, count
