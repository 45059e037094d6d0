"""Warm == cold, and the reuse the cache promises, on all three cache families."""

from __future__ import annotations

import numpy as np

from fixtures.conversation import load_conversation
from tests.engine.conftest import (
    BLOCK,
    CHUNK,
    image_part,
    loaded,
    make_runner,
    msg,
    picture,
    run,
    session_messages,
    tenant,
)


def lcp(a: np.ndarray | list[int], b: np.ndarray | list[int]) -> int:
    n = min(len(a), len(b))
    a, b = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.nonzero(a != b)[0]
    return int(diff[0]) if len(diff) else n


def test_next_turn_carrying_own_reply_warm_equals_cold(family: str) -> None:
    conv = load_conversation("one_image_10_turns")
    session = conv.sessions[0]
    t = tenant()
    warm = make_runner(family)
    replies: list[str] = []
    previous = None  # (prompt ids, generated ids) of the turn before
    for turn in range(4):
        messages = session_messages(t, session, turn, replies)
        result = run(warm, t, messages, max_tokens=10)
        prompt_ids = result.trace.prompt_ids
        assert prompt_ids is not None
        if previous is None:
            assert result.usage.cached_tokens == 0
        else:
            # Reusable: turn N's prompt + reply, up to where the re-rendered reply differs.
            fed_before = np.concatenate([previous[0], np.asarray(previous[1], dtype=np.int32)])
            reusable = lcp(prompt_ids, fed_before)
            assert reusable - 1 <= result.usage.cached_tokens <= reusable
            assert result.usage.cached_tokens > len(previous[0])  # the reply itself hit
            # Every image sits inside the reused prefix: no vision work at all.
            assert result.trace.encoder_runs == 0
            cold = run(make_runner(family, ledger=warm.ledger), t, messages, max_tokens=10)
            assert cold.usage.cached_tokens == 0
            assert cold.usage.prompt_tokens == result.usage.prompt_tokens
            assert result.tokens == cold.tokens
        previous = (prompt_ids, result.trace.generated)
        replies.append(result.text)


def test_document_pages_reuse_text_before_image_only(family: str) -> None:
    t = tenant()
    question = "Read this page and list every heading you can find on it, in order."
    system = msg("system", "You are a careful document reader. " * 6)
    warm = make_runner(family)
    page_a, page_b = image_part(t, picture(1)), image_part(t, picture(2))
    first = run(warm, t, [system, msg("user", page_a, question)])
    assert first.trace.encoder_runs == 1
    second = run(warm, t, [system, msg("user", page_b, question)])
    cold = run(make_runner(family), t, [system, msg("user", page_b, question)])
    assert second.tokens == cold.tokens
    assert second.trace.encoder_runs == 1  # page B is new: encoded, never page A's features
    trace = second.trace
    assert trace.prompt_ids is not None
    start = _image_start(family, t, [system, msg("user", page_b, question)])
    # Blocks before the image are reused, the image's are not.
    assert second.usage.cached_tokens <= start
    recurrent = family == "qwen3_5"
    floor = (start // CHUNK * CHUNK) if recurrent else (start // BLOCK * BLOCK)
    assert second.usage.cached_tokens >= floor
    assert second.usage.cached_tokens > 0


def _image_start(family: str, t, messages) -> int:
    runner = make_runner(family)
    built = runner.prompt_builder.build(messages, t.namespace)
    return built.images[0].span.start


def test_same_image_new_position_reuses_features_not_kv(family: str) -> None:
    t = tenant()
    warm = make_runner(family)
    img = image_part(t, picture(7))
    run(warm, t, [msg("user", img, "What is in this image?")])
    moved = [msg("user", "Here is a picture I took yesterday at the market, look closely:", img)]
    second = run(warm, t, moved)
    assert second.trace.encoder_runs == 0
    assert second.trace.vision_hits == 1
    start = _image_start(family, t, moved)
    assert second.usage.cached_tokens <= start
    cold = run(make_runner(family), t, moved)
    assert second.tokens == cold.tokens


def test_sliding_window_prefix_longer_than_window() -> None:
    t = tenant()
    window = loaded("gemma3").model.language_model.model.config.sliding_window
    long_system = msg("system", "Answer briefly and precisely about the picture. " * 12)
    img = image_part(t, picture(3))
    m1 = [long_system, msg("user", img, "Describe it.")]
    warm = make_runner("gemma3")
    first = run(warm, t, m1, max_tokens=40)  # decode crosses the window several times
    assert first.usage.prompt_tokens > 3 * window
    m2 = m1 + [msg("assistant", first.text), msg("user", "Now count the shapes.")]
    second = run(warm, t, m2)
    fed_before = np.concatenate([first.trace.prompt_ids, np.asarray(first.trace.generated, np.int32)])
    reusable = lcp(second.trace.prompt_ids, fed_before)
    assert reusable == len(fed_before)  # the whole reply, across several window wraps
    assert reusable - 1 <= second.usage.cached_tokens <= reusable
    cold = run(make_runner("gemma3", ledger=warm.ledger), t, m2)
    assert second.tokens == cold.tokens


def test_hybrid_divergent_suffix_lands_on_checkpoint() -> None:
    t = tenant()
    system = msg("system", "You are a terse assistant that answers in one line. " * 8)
    img = image_part(t, picture(4))
    m1 = [system, msg("user", img, "What colour dominates the picture?")]
    warm = make_runner("qwen3_5")
    first = run(warm, t, m1)
    n1 = first.usage.prompt_tokens
    built = warm.prompt_builder.build(m1, t.namespace)
    # Where the first request left recurrent checkpoints: chunk ends, the last block
    # boundary, message text starts, image ends, and n - 1.
    checkpoints = {k * CHUNK for k in range(1, n1 // CHUNK + 1)} | {n1 // BLOCK * BLOCK, n1 - 1}
    checkpoints |= set(built.text_starts) | {im.span.end for im in built.images}
    m2 = [system, msg("user", img, "Which shape is largest in the picture, and where is it?")]
    second = run(warm, t, m2)
    cached = second.usage.cached_tokens
    shared = lcp(first.trace.prompt_ids, second.trace.prompt_ids)
    assert cached == max(c for c in checkpoints if c <= shared)
    # The divergence is in the user's text right after the image: all before it is reused.
    assert cached == built.text_starts[-1] > built.images[0].span.end
    cold = run(make_runner("qwen3_5"), t, m2)
    assert second.tokens == cold.tokens


def test_hybrid_shared_system_prompt_reused_up_to_its_end() -> None:
    t = tenant()
    system = msg("system", "Policy: be exact, cite the picture, never guess colours. " * 9)
    warm = make_runner("qwen3_5")
    run(warm, t, [system, msg("user", "First question about the policy?")], session="A")
    m2 = [system, msg("user", "Another, unrelated question from another session.")]
    second = run(warm, t, m2, session="B")
    built = warm.prompt_builder.build(m2, t.namespace)
    assert second.usage.cached_tokens == built.text_starts[1]  # the whole system turn
    cold = run(make_runner("qwen3_5"), t, m2, session="B")
    assert second.tokens == cold.tokens


def test_common_prefix_blocks_are_shared_not_copied(family: str) -> None:
    t = tenant()
    runner = make_runner(family)
    system = msg("system", "Shared policy text for every session of this tenant. " * 10)
    run(runner, t, [system, msg("user", "First session question?")], session="A")
    blocks_after_a = len(runner.prefix_cache)
    run(runner, t, [system, msg("user", "A different question from B?")], session="B")
    prompt_b = runner.last_trace.prompt_ids
    hashes_shared = [
        b for b in runner.prefix_cache.pool if b.owners >= {"A", "B"} and not b.is_partial
    ]
    # Every full block both prompts share is stored once and owned by both sessions.
    assert len(hashes_shared) >= runner.last_trace.cached_tokens // BLOCK
    assert len(hashes_shared) > 0
    assert len(runner.prefix_cache) < 2 * blocks_after_a
    assert prompt_b is not None


def test_different_tenants_never_share_state(family: str) -> None:
    runner = make_runner(family)
    alice, bob = tenant("alice"), tenant("bob")
    img = picture(9)
    m_alice = [msg("user", image_part(alice, img), "Describe the image in detail.")]
    m_bob = [msg("user", image_part(bob, img), "Describe the image in detail.")]
    run(runner, alice, m_alice)
    again = run(runner, alice, m_alice)
    assert again.usage.cached_tokens > 0
    other = run(runner, bob, m_bob)
    assert other.usage.cached_tokens == 0
    assert other.trace.encoder_runs == 1  # salted image hash: no vision hit across tenants
