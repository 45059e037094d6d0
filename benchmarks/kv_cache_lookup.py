"""Benchmark: block hashing throughput and hash+lookup time of a long prompt in a big pool.

Not a test. Builds a prefix cache holding ``--pool-blocks`` blocks (the prompt's own chain plus
unrelated chains), then times, side by side in one run:

* ``chain_hashes`` over the prompt (tokens/s),
* ``lookup`` of the prompt when fully cached, when only the first half is cached, and on a miss
  at block 0, with the prompt as a Python list and as a numpy array.

Goal (issue 3): hash + lookup of a 32K-token prompt <= 2 ms.

    python benchmarks/kv_cache_lookup.py [--prompt-tokens 32768] [--pool-blocks 100000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kv_cache.hashing import CACHE_FORMAT_VERSION, ImageSpan, chain_hashes, root_hash
from kv_cache.prefix_cache import PrefixCache
from kv_cache.tiers.ram import RamTier
from vision_cache.hashing import ImageHash


@dataclass(frozen=True, slots=True)
class SizedPayload:
    """Stand-in payload size: the cache only reads ``nbytes``."""

    nbytes: int


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall times of ``repeats`` calls, in milliseconds."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def summary(times: list[float]) -> str:
    ordered = sorted(times)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    median = statistics.median(ordered)
    return f"median {median:7.3f} ms   p90 {p90:7.3f} ms   min {ordered[0]:7.3f} ms"


def build_cache(
    root: bytes, prompt: list[int], spans: list[ImageSpan], pool_blocks: int, block_size: int
) -> PrefixCache:
    cache = PrefixCache(block_size, RamTier(2**62))
    prompt_blocks = len(prompt) // block_size
    cache.store(root, prompt, spans, [SizedPayload(1)] * prompt_blocks)
    rng = random.Random(1)
    chain_blocks = 256
    remaining = pool_blocks - prompt_blocks
    while remaining > 0:
        count = min(chain_blocks, remaining)
        # Unrelated chains: they fill the hash map and give the root many children to scan.
        tokens = [rng.randrange(150_000) for _ in range(count * block_size)]
        cache.store(root, tokens, [], [SizedPayload(1)] * count)
        remaining -= count
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=32_768)
    parser.add_argument("--pool-blocks", type=int, default=100_000)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    size = args.block_size

    root = root_hash(CACHE_FORMAT_VERSION, "bench-model", b"bench-salt")
    rng = random.Random(0)
    prompt = [rng.randrange(150_000) for _ in range(args.prompt_tokens)]
    # Four images of 256 placeholder tokens, as a multi-image chat would have.
    starts = range(1000, args.prompt_tokens - 256, args.prompt_tokens // 4)
    spans = [
        ImageSpan(ImageHash(bytes([index + 1]) * 16), start, start + 256)
        for index, start in enumerate(starts)
    ]
    prompt_array = np.array(prompt, dtype=np.int32)

    start = time.perf_counter()
    cache = build_cache(root, prompt, spans, args.pool_blocks, size)
    build_s = time.perf_counter() - start
    print(f"pool: {len(cache)} blocks of {size} tokens (built in {build_s:.1f} s)")
    print(f"prompt: {len(prompt)} tokens, {len(spans)} image spans")

    hashing = timed(lambda: chain_hashes(root, prompt_array, spans, size), args.repeats)
    hashing_list = timed(lambda: chain_hashes(root, prompt, spans, size), args.repeats)
    print()
    for name, times in (("numpy", hashing), ("list", hashing_list)):
        rate = len(prompt) / (statistics.median(times) / 1e3) / 1e6
        label = f"chain_hashes ({name} input)"
        print(f"{label:<33} {summary(times)}   {rate:6.1f} M tokens/s")

    half = prompt[: len(prompt) // 2] + [rng.randrange(150_000) for _ in range(len(prompt) // 2)]
    miss = [prompt[0] + 1] + prompt[1:]
    cases = {
        "lookup full hit (list)": (prompt, spans),
        "lookup full hit (numpy)": (prompt_array, spans),
        "lookup half hit (list)": (half, spans[:2]),
        "lookup miss at block 0 (list)": (miss, spans),
    }
    print()
    for name, (tokens, request_spans) in cases.items():
        hit = cache.lookup(root, tokens, request_spans)
        times = timed(lambda t=tokens, s=request_spans: cache.lookup(root, t, s), args.repeats)
        print(f"{name:<33} {summary(times)}   hit {hit.hit_tokens} tokens")
    ratio = statistics.median(
        timed(lambda: cache.lookup(root, prompt, spans), args.repeats)
    ) / statistics.median(hashing_list)
    print(f"\nfull-hit lookup / hashing alone (same input): {ratio:.2f}x")


if __name__ == "__main__":
    main()
