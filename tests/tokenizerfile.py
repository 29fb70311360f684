"""A real Hugging Face tokenizer.json for tests: word-level, trained on a few words."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers


def write_tokenizer(path: Path) -> Path:
    """One token per whitespace-separated word it knows ([UNK] for the others)."""
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(["hello world how are you today"],
                                  trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tokenizer.save(str(path))
    return path
