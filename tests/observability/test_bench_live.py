"""``vlmcache bench`` against a live tiny server: cached tokens, ceilings, JSON and plot."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from fixtures.conversation import load_conversation
from server.bench.client import Endpoint
from server.bench.command import BenchOptions, Target, run_bench
from server.bench.replay import Mode, plan_replay
from server.bench.report import read_json, write_json
from server.cli import build_parser
from tests.server.conftest import LiveServer, make_config, running_server

TURNS = 3


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    config = make_config(tiny_model_path, tmp_path_factory.mktemp("state"), block_size=16,
                         prefill_chunk=32, ssd_enabled=False)
    with running_server(config) as live:
        yield live


def test_replay_modes_differ_only_where_they_must() -> None:
    conversation = load_conversation("one_image_10_turns")
    cached = plan_replay(conversation, Mode.CACHE, replay_nonce="r1", turns=3)
    fresh = plan_replay(conversation, Mode.NO_CACHE, replay_nonce="r1", turns=3)
    again = plan_replay(conversation, Mode.CACHE, replay_nonce="r2", turns=3)
    system = [r.messages[0].parts[0] for r in cached]
    assert system[0].startswith("r1 ") and len(set(system)) == 1
    assert len({r.messages[0].parts[0] for r in fresh}) == 3
    assert again[0].messages[0].parts[0].startswith("r2 ")
    # The same image object is sent on every turn of a cache replay, a new one per no-cache request.
    images = [r.messages[1].parts[0] for r in cached]
    assert images[0].png == images[2].png
    assert len({r.messages[1].parts[0].png for r in fresh}) == 3
    assert [m.role for m in cached[2].messages] == ["system", "user", "assistant", "user",
                                                   "assistant", "user"]
    assert cached[2].messages[2].parts == (conversation.sessions[0].turns[0].assistant,)


def test_bench_replays_and_reports(server: LiveServer, tmp_path: Path) -> None:
    options = BenchOptions(turns=TURNS, max_tokens=4, run_id="test-run")
    results = run_bench([Target("tiny", Endpoint(server.base_url))], options)
    assert [(r.mode, r.step) for r in results] == [
        ("cache", 0), ("cache", 1), ("cache", 2), ("no-cache", 0), ("no-cache", 1), ("no-cache", 2)]
    for r in results:
        # Our prompt builder counts exactly the server's prompt tokens.
        assert r.local_prompt_tokens == r.prompt_tokens
        assert r.ceiling_tokens is not None and r.cached_tokens is not None
        assert r.cached_tokens <= r.ceiling_tokens < r.prompt_tokens
        assert 0 < r.ttft_s <= r.total_s
    cache = [r for r in results if r.mode == "cache"]
    fresh = [r for r in results if r.mode == "no-cache"]
    # Turn 1 can share only the role header with the warm-up request.
    assert cache[0].cached_tokens == cache[0].ceiling_tokens < 16
    assert all(r.cached_tokens > 0 for r in cache[1:])
    # A new nonce on every request: nothing beyond the role header can be reused.
    assert all(r.ceiling_tokens < 16 and r.cached_tokens < 16 for r in fresh)

    path = tmp_path / "bench.json"
    write_json(path, results, {"command": ["test"]})
    assert read_json(path) == results
    saved = json.loads(path.read_text())
    assert [s["mode"] for s in saved["summaries"]] == ["cache", "no-cache"]
    assert saved["summaries"][0]["ttft_last_over_first"] == pytest.approx(
        cache[-1].ttft_s / cache[0].ttft_s)


def test_bench_command_writes_table_json_and_plot(
    server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--url", server.base_url, "--label", "tiny", "--turns", "2", "--modes",
            "cache", "--max-tokens", "2", "--no-ceiling", "--out", str(tmp_path)]
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    out = capsys.readouterr()
    assert "tiny cache one_image_10_turns: TTFT turn 2 / turn 1 = " in out.out
    assert "[##############################] 2/2" in out.err
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert [r["ceiling_tokens"] for r in saved["results"]] == [None, None]
    assert (tmp_path / "ttft_one_image_10_turns.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_of_several_sessions_numbers_steps_across_them() -> None:
    conversation = load_conversation("shared_system_prompt")
    requests = plan_replay(conversation, Mode.CACHE, replay_nonce="n", turns=2)
    assert [(r.session_id, r.turn, r.step) for r in requests] == [
        (f"{s.session_id}-n", t, 2 * k + t)
        for k, s in enumerate(conversation.sessions) for t in range(2)]
    verbatim = plan_replay(conversation, Mode.CACHE, replay_nonce="n", verbatim=True)
    assert verbatim[0].messages[0].parts == (conversation.sessions[0].system_text(),)
    with pytest.raises(ValueError, match="verbatim replays cannot be no-cache"):
        plan_replay(conversation, Mode.NO_CACHE, replay_nonce="n", verbatim=True)
