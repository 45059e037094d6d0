"""Miss-reason attribution on the RAM prefix cache (no model): each reason produced on purpose."""

from __future__ import annotations

from collections.abc import Sequence

from kv_cache.hashing import CACHE_FORMAT_VERSION, ImageSpan, chain_hashes, root_hash
from kv_cache.miss_reasons import MissAttributor, MissReason, MissReport
from kv_cache.prefix_cache import PrefixCache
from tests.kv_cache.factories import ROOT, make_cache, store, toks
from vision_cache.hashing import ImageHash

B = 4
KEY = b"content-key-for-tests-0123456789"
BOB_ROOT = root_hash(CACHE_FORMAT_VERSION, "test-model", b"bob-salt")
COLD, EVICTED, EXPIRED, DIVERGED, ISOLATED = (
    MissReason.COLD, MissReason.EVICTED, MissReason.EXPIRED, MissReason.DIVERGED,
    MissReason.ISOLATED)


def attribute(
    att: MissAttributor,
    cache: PrefixCache,
    tokens: list[int],
    *,
    spans: Sequence[ImageSpan] = (),
    content: Sequence[ImageSpan] | None = None,
    namespace: str = "alice",
    root: bytes = ROOT,
) -> MissReport:
    """Look the prompt up, attribute its misses, then store it (as the engine would)."""
    hit = cache.lookup(root, tokens, spans)
    report = att.attribute(root=root, tokens=tokens, spans=spans,
                           content_spans=spans if content is None else content,
                           matched_blocks=len(hit.blocks), stored=cache.pool, namespace=namespace)
    store(cache, tokens, spans=spans, root=root)
    return report


def test_cold_then_hit() -> None:
    cache, att = make_cache(B), MissAttributor(B, key=KEY)
    # 13 tokens: blocks ending at or before token 12 are reusable -> 3 blocks.
    assert attribute(att, cache, toks("A B C D E F G H I J K L M")) == MissReport(0, (COLD,) * 3)
    assert attribute(att, cache, toks("A B C D E F G H I J K L M")) == MissReport(3, ())
    assert att.counts(None).by_reason[COLD] == 3
    assert att.counts(None).hit_blocks == 3


def test_token_divergence_is_diverged_at_the_first_missed_block_only() -> None:
    cache, att = make_cache(B), MissAttributor(B, key=KEY)
    attribute(att, cache, toks("A B C D E F G H I"))
    # Block 1 differs at its third token; block 2 was never stored.
    report = attribute(att, cache, toks("A B C D E F X H I J K L M"))
    assert report == MissReport(1, (DIVERGED, COLD))


def test_image_divergence_same_tokens_other_image() -> None:
    cache, att = make_cache(B), MissAttributor(B, key=KEY)
    tokens = toks("A B C D Z Z Z Z Q R S")
    first = [ImageSpan(ImageHash(b"\x01" * 16), 4, 8)]
    other = [ImageSpan(ImageHash(b"\x02" * 16), 4, 8)]
    attribute(att, cache, tokens, spans=first)
    assert attribute(att, cache, tokens, spans=other) == MissReport(1, (DIVERGED,))


def test_a_stored_sequence_that_ended_inside_the_block_is_cold_not_diverged() -> None:
    cache, att = make_cache(B), MissAttributor(B, key=KEY)
    attribute(att, cache, toks("A B C D E F"))  # block 0 and the partial "E F"
    assert attribute(att, cache, toks("A B C D E F G H I")) == MissReport(1, (COLD,))


def test_evicted_blocks_are_ghosts() -> None:
    cache, att = make_cache(B, budget=30), MissAttributor(B, key=KEY)
    cache.watch_evictions(att.record_evicted)
    attribute(att, cache, toks("A B C D E F G H I"))  # x0 x1 + partial: 30 bytes
    attribute(att, cache, toks("M N O P Q R S T U"))  # evicts all of the first chain
    assert attribute(att, cache, toks("A B C D E F G H I")) == MissReport(0, (EVICTED, EVICTED))


def test_contents_sent_before_but_no_longer_remembered_as_ghosts_count_as_evicted() -> None:
    cache = make_cache(B, budget=30)
    att = MissAttributor(B, key=KEY, ghost_capacity=1)
    cache.watch_evictions(att.record_evicted)
    attribute(att, cache, toks("A B C D E F G H I"))
    attribute(att, cache, toks("M N O P Q R S T U"))
    assert len(att.ghosts) == 1
    assert attribute(att, cache, toks("A B C D E F G H I")).reasons == (EVICTED, EVICTED)


def test_expired_blocks() -> None:
    cache, att = make_cache(B), MissAttributor(B, key=KEY)
    tokens = toks("A B C D E F G H I")
    attribute(att, cache, tokens)
    # What the TTL sweeper does: drop the chain and say why.
    for digest in chain_hashes(ROOT, tokens, (), B):
        cache.discard(cache.pool.get(digest))
        att.record_expired(digest)
    assert attribute(att, cache, tokens) == MissReport(0, (EXPIRED, EXPIRED))


def test_isolated_is_counted_globally_and_hidden_from_the_tenant() -> None:
    cache, att = make_cache(B), MissAttributor(B, key=KEY)
    tokens = toks("A B C D E F G H I")
    attribute(att, cache, tokens, namespace="alice")
    report = attribute(att, cache, tokens, namespace="bob", root=BOB_ROOT)
    assert report == MissReport(0, (ISOLATED, ISOLATED))
    assert att.counts(None).as_dict(tenant_view=False) == {
        "cold": 2, "evicted": 0, "expired": 0, "diverged": 0, "isolated": 2}
    assert att.counts("bob").as_dict(tenant_view=True) == {
        "cold": 2, "evicted": 0, "expired": 0, "diverged": 0}


def test_isolation_compares_image_pixels_not_salted_hashes() -> None:
    cache, att = make_cache(B), MissAttributor(B, key=KEY)
    tokens = toks("A B C D Z Z Z Z Q R S")
    pixels = [ImageSpan(ImageHash(b"\x07" * 16), 4, 8)]  # the unsalted digest of the picture
    other_pixels = [ImageSpan(ImageHash(b"\x08" * 16), 4, 8)]
    alice = [ImageSpan(ImageHash(b"\xa1" * 16), 4, 8)]  # salted per tenant
    bob = [ImageSpan(ImageHash(b"\xb0" * 16), 4, 8)]
    attribute(att, cache, tokens, spans=alice, content=pixels)
    # The same picture under bob's salt: isolated. Another picture: cold after the text block.
    same = attribute(att, cache, tokens, spans=bob, content=pixels, namespace="bob", root=BOB_ROOT)
    assert same.reasons == (ISOLATED, ISOLATED)
    carol_root = root_hash(CACHE_FORMAT_VERSION, "test-model", b"carol-salt")
    carol = [ImageSpan(ImageHash(b"\xc0" * 16), 4, 8)]
    other = attribute(att, cache, tokens, spans=carol, content=other_pixels, namespace="carol",
                      root=carol_root)
    assert other.reasons == (ISOLATED, COLD)

def test_prompts_shorter_than_a_block_have_nothing_to_attribute() -> None:
    cache, att = make_cache(B), MissAttributor(B, key=KEY)
    assert attribute(att, cache, toks("A B C D")) == MissReport(0, ())
