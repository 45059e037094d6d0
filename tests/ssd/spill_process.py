"""A process that spills blocks to an SSD tier as fast as it can, forever (for the crash test).

It opens the tier (which reconciles what a killed predecessor left), reports the reconcile on
stdout as one JSON line, then writes block after block until it is killed. Block ``seed`` holds
``crash_payload(seed)`` and tokens ``crash_tokens(seed)``, so a checker can tell exactly what
every file must contain.

    python -m tests.ssd.spill_process --cache-dir D --first-seed N
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import mlx.core as mx

from kv_cache.block import Block
from kv_cache.families.base import LayerSlice
from kv_cache.hashing import hash_block
from kv_cache.payload import BlockPayload
from tests.ssd.factories import NAMESPACE, ROOT, open_tier

POSITIONS = 2048  # 2 x 128 KiB per block: a write takes long enough to be cut
CHAIN = 8  # blocks per chain, so files have parents on disk as in real use
BUDGET = 24 * 2**20  # small: capacity deletions happen while crashing too


def crash_tokens(seed: int) -> list[int]:
    return [seed * 8 + k for k in range(8)]


def crash_payload(seed: int) -> BlockPayload:
    k1, k2 = mx.random.split(mx.random.key(seed))
    keys = mx.random.normal((1, 2, POSITIONS, 8), key=k1)
    values = mx.random.normal((1, 2, POSITIONS, 8), key=k2)
    mx.eval(keys, values)
    return BlockPayload.build((LayerSlice(keys, values), None), None)


def crash_block(seed: int, parent: bytes) -> Block:
    tokens = crash_tokens(seed)
    p = crash_payload(seed)
    b = Block(hash_block(parent, tokens, ()), parent, tuple(tokens), (), p, p.nbytes, False, namespace=NAMESPACE)
    b.owners.add(f"session-{seed // CHAIN}")
    return b


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--first-seed", type=int, required=True)
    args = parser.parse_args(argv)
    tier = open_tier(args.cache_dir, budget_bytes=BUDGET, queue_size=4)
    print(json.dumps(dataclasses.asdict(tier.reconcile_report)), flush=True)
    seed = args.first_seed
    parent = ROOT
    while True:
        if seed % CHAIN == 0:
            parent = ROOT
        block = crash_block(seed, parent)
        tier.spill(block, wait=True)
        parent = block.block_hash
        seed += 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
