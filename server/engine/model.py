"""Model loading and the model fingerprint that keys every cache."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

# Bumped whenever the meaning of stored KV changes (prompt building, payload layout).
ENGINE_STATE_VERSION = 1
_FINGERPRINT_FILES = (
    "config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: Any
    processor: Any
    tokenizer: Any
    model_type: str
    model_id: str
    fingerprint: str
    context_length: int
    eos_ids: frozenset[int]


def model_fingerprint(path: Path, *, block_size: int, kv_dtype: str) -> str:
    """Digest of everything that changes what a cached block means.

    Covers the config, processor and tokenizer files, the chat template, every weight file's
    bytes, the block size and the KV dtype. Weights are hashed in full: xxh3 runs at several
    GB/s, and a fingerprint that missed a fine-tune would serve the old model's KV.
    """
    h = xxhash.xxh3_128()
    h.update(f"engine-state-v{ENGINE_STATE_VERSION}|block={block_size}|kv={kv_dtype}".encode())
    for name in _FINGERPRINT_FILES:
        p = path / name
        if p.is_file():
            h.update(name.encode() + b"\0")
            h.update(p.read_bytes())
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    for w in weights:
        h.update(w.name.encode() + b"\0")
        with w.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def _eos_ids(config: dict[str, Any], tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (config, config.get("text_config") or {}):
        value = source.get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    # End-of-turn markers of the chat templates we serve.
    for marker in ("<|im_end|>", "<end_of_turn>", "<|endoftext|>", "<eos>"):
        if marker in vocab:
            ids.add(int(vocab[marker]))
    return frozenset(ids)


def load_model(path: Path, *, block_size: int, model_id: str | None = None) -> LoadedModel:
    """Load an mlx-vlm model directory (weights, processor, tokenizer) and fingerprint it."""
    from mlx_vlm import load

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    config = json.loads((path / "config.json").read_text())
    model, processor = load(str(path))
    tokenizer = processor.tokenizer if hasattr(processor, "tokenizer") else processor
    text_cfg = config.get("text_config") or config
    context = int(
        text_cfg.get("max_position_embeddings") or config.get("max_position_embeddings") or 4096
    )
    dtype = str(model.language_model.model.embed_tokens.weight.dtype)
    return LoadedModel(
        model=model,
        processor=processor,
        tokenizer=tokenizer,
        model_type=str(config["model_type"]),
        model_id=model_id or path.name,
        fingerprint=model_fingerprint(path, block_size=block_size, kv_dtype=dtype),
        context_length=context,
        eos_ids=_eos_ids(config, tokenizer),
    )

