"""Cold vs warm time to first token of the engine, per cache family (issue 4).

For each family on the ``bench`` fixture (~20M params): a ~2000-token prefix with an image is
computed once; then a request with the same prefix and ~50 new tokens is timed on a fresh
engine (cold) and on the engine holding the prefix (warm), side by side in one run. Also: the
same image re-sent behind new text (its KV cannot be reused, its features can) with and without
the vision-feature cache.

Run: ``scripts/bootstrap && LD_PRELOAD=$(.venv/bin/python -m server.blas) HF_HUB_OFFLINE=1
.venv/bin/python benchmarks/engine_reuse.py [--families qwen2_vl gemma3 qwen3_5] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from fixtures.build import ensure_fixture
from server.engine.model import load_model
from server.engine.runner import ModelRunner
from server.engine.settings import EngineSettings
from server.engine.types import (
    ChatMessage,
    ImagePart,
    TextPart,
)
from tenancy.tenants import make_tenant
from vision_cache.hashing import image_hash

from bench_inputs import picture, text_of, time_to_first_token  # noqa: E402  (sibling module of this script)

def ttft(runner: ModelRunner, tenant, messages: list[ChatMessage]) -> tuple[float, int, int]:
    elapsed = time_to_first_token(runner, tenant, messages)
    trace = runner.last_trace
    return elapsed, trace.prompt_tokens, trace.cached_tokens


def bench_family(family: str, repeats: int, prefix_words: int) -> dict:
    path = ensure_fixture(family, "bench")
    loaded = load_model(path, block_size=64)
    # RAM tier only: this benchmark measures reuse from RAM (benchmarks/ssd_restore.py does SSD).
    settings = EngineSettings(
        model_path=path, cache_dir=Path("/tmp/vlmcache-bench"), block_size=64, prefill_chunk=512,
        ssd_enabled=False,
    )
    tenant = make_tenant(b"bench-secret-0123456789abcdef012", "bench")
    img = picture(1)
    part = ImagePart(img, image_hash(tenant.salt, img))
    system = ChatMessage("system", (TextPart(text_of(prefix_words, 0)),))

    def request(seed: int) -> list[ChatMessage]:
        return [system, ChatMessage("user", (part, TextPart(text_of(38, seed))))]

    cold, warm, prompt_len, cached = [], [], 0, 0
    for r in range(repeats):
        fresh = ModelRunner(loaded, settings)
        c, prompt_len, _ = ttft(fresh, tenant, request(100 + r))
        cold.append(c)
        holder = ModelRunner(loaded, settings)
        ttft(holder, tenant, request(200 + r))  # computes and stores the shared prefix
        w, _, cached = ttft(holder, tenant, request(100 + r))
        warm.append(w)

    # Same image behind new text: KV of the image is not reusable, its features are.
    enc_cold, enc_warm = [], []
    for r in range(repeats):
        runner = ModelRunner(loaded, settings)
        moved = lambda s: [ChatMessage("user", (TextPart(text_of(20, s)), part, TextPart("what is it?")))]
        a, _, _ = ttft(runner, tenant, moved(300 + r))  # encodes
        enc_cold.append(a)
        b, _, _ = ttft(runner, tenant, moved(400 + r))  # features from the vision cache
        assert runner.last_trace.encoder_runs == 0
        enc_warm.append(b)
    med = statistics.median
    return {
        "family": family,
        "prompt_tokens": prompt_len,
        "cached_tokens": cached,
        "cold_ttft_s": med(cold),
        "warm_ttft_s": med(warm),
        "warm_over_cold": med(warm) / med(cold),
        "image_resent_ttft_no_feature_cache_s": med(enc_cold),
        "image_resent_ttft_feature_hit_s": med(enc_warm),
        "encoder_time_saved_s": med(enc_cold) - med(enc_warm),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=["qwen2_vl", "gemma3", "qwen3_5"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefix-words", type=int, default=1500, help="system text words (~2000 tokens with the bench tokenizer)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rows = [bench_family(f, args.repeats, args.prefix_words) for f in args.families]
    print(f"{'family':10} {'prompt':>7} {'cached':>7} {'cold s':>8} {'warm s':>8} {'warm/cold':>9} {'img no-fc s':>11} {'img fc s':>9}")
    for r in rows:
        print(
            f"{r['family']:10} {r['prompt_tokens']:7d} {r['cached_tokens']:7d} {r['cold_ttft_s']:8.3f} "
            f"{r['warm_ttft_s']:8.3f} {r['warm_over_cold']:9.3f} {r['image_resent_ttft_no_feature_cache_s']:11.3f} "
            f"{r['image_resent_ttft_feature_hit_s']:9.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
