"""A real OpenAI-compatible LLM engine for the token-stream tests: llama-cpp-python's
server on CPU, serving a tiny llama model that the tests write themselves.

No weights can be downloaded here, so `write_tiny_llama` writes a llama-architecture
GGUF of about 600 KB with random weights (2 layers, 64 wide, a 512-token SentencePiece
vocabulary). It generates nonsense, but through llama.cpp's real tokenizer, sampler,
KV cache and server, as fast as the tests need: the model loads and streams tens of
tokens in well under a second. Its output head scores the control and byte tokens 0 and
the word pieces at random, so greedy decoding (temperature 0) writes printable text and
never ends a stream before `max_tokens`.
"""

from __future__ import annotations

import contextlib
import signal
import string
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

from sitsmesh.dev.harness import free_port, spawn, wait_until

LAYERS, WIDTH, HEADS, FFN, VOCAB, CONTEXT = 2, 64, 4, 128, 512, 2048
SPECIALS = ("<unk>", "<s>", "</s>")
# A plain prompt format, so /v1/chat/completions renders it as a real model's would.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{% endfor %}<|assistant|>")


def _vocab() -> tuple[list[str], list[float], list[int]]:
    """SentencePiece pieces: the specials, the 256 byte fallbacks, then word pieces."""
    tokens = list(SPECIALS)
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    pieces = ["▁", *string.ascii_letters, *string.digits, *".,!?'-:;<>|"]
    pieces += [f"▁{c}" for c in string.ascii_letters]
    for a in "etaoinshrdlu":
        for b in "etaoinshrdlucm":
            pieces += [a + b, f"▁{a}{b}"]
    pieces = pieces[:VOCAB - len(tokens)]
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    # SentencePiece merges the highest-scoring piece first: prefer the longer pieces.
    scores = [0.0] * (len(SPECIALS) + 256)
    scores += [len(p) - i / len(pieces) for i, p in enumerate(pieces)]
    assert len(tokens) == VOCAB, len(tokens)
    return tokens, scores, [int(t) for t in types]


def write_tiny_llama(path: Path, seed: int = 0) -> Path:
    """Write a tiny llama GGUF with random F32 weights from a seeded RNG to `path`."""
    rng = np.random.default_rng(seed)
    tokens, scores, types = _vocab()
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("sitsmesh-tiny-llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(WIDTH)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(WIDTH // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def weight(*shape: int, scale: float = 0.5) -> npt.NDArray[np.float32]:
        # numpy's shape is GGUF's reversed: (out, in) for a matrix.
        out: npt.NDArray[np.float32] = (
            rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)
        return out

    ones = np.ones(WIDTH, dtype=np.float32)
    writer.add_tensor("token_embd.weight", weight(VOCAB, WIDTH, scale=8.0))
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(WIDTH, WIDTH))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(FFN, WIDTH))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(FFN, WIDTH))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(WIDTH, FFN))
    writer.add_tensor("output_norm.weight", ones)
    output = weight(VOCAB, WIDTH, scale=8.0)
    output[: len(SPECIALS) + 256] = 0.0  # never the specials or the byte fallbacks
    writer.add_tensor("output.weight", output)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 (http://127.0.0.1)
            return int(resp.status) == 200
    except OSError:
        return False


@contextlib.contextmanager
def llama_server(model: Path, port: int | None = None, *, log: Path | None = None,
                 timeout: float = 60) -> Iterator[str]:
    """`python -m llama_cpp.server` on 127.0.0.1 serving `model`; yields its base URL
    (`http://127.0.0.1:PORT`, the OpenAI API under /v1) once /v1/models answers, and
    kills it at exit. Its output goes to `log` (default: beside the model)."""
    port = port or free_port()
    log = log or model.with_suffix(".log")
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "512"]
    server = spawn(argv, log)
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if server.proc.poll() is not None:
            raise RuntimeError(f"llama_cpp.server exited {server.proc.returncode}:\n"
                               f"{server.output()[-4000:]}")
        return _answers(f"{base}/v1/models")

    try:
        wait_until(ready, timeout, f"llama_cpp.server on {base}", interval=0.1)
        yield base
    finally:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.proc.wait(5)
        server.kill()
