"""One server lifetime, as a separate process, for the restart test.

Builds a ModelRunner on a tiny fixture over ``--cache-dir``, serves the turns of the fixture
conversation that ``--state`` has no reply for yet (up to ``--turns``), optionally answers the
last one cold as well, closes the runner (flushing the SSD tier) and exits. Everything a test
needs goes to ``--state`` as JSON: the replies so far and what each turn of this process did.

    python -m tests.ssd.conversation_process --family qwen2_vl --cache-dir D --turns 4 --state S
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fixtures.conversation import load_conversation
from server.engine.prompt import ReplyLedger
from tests.engine.conftest import run, session_messages, tenant
from tests.ssd.factories import make_runner


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", required=True)
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--turns", type=int, required=True)
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--cold", action="store_true", help="also answer the last turn cold")
    args = parser.parse_args(argv)

    state: dict[str, Any] = json.loads(args.state.read_text()) if args.state.exists() else {}
    replies: list[str] = state.get("replies", [])
    session = load_conversation("one_image_10_turns").sessions[0]
    t = tenant()
    # A fresh process: empty RAM, and a reply ledger that knows none of the earlier replies.
    runner = make_runner(args.family, args.cache_dir, ledger=ReplyLedger())
    process: dict[str, Any] = {"resident_blocks_at_start": len(runner.prefix_cache), "turns": []}
    messages = []
    for turn in range(len(replies), args.turns):
        messages = session_messages(t, session, turn, replies)
        result = run(runner, t, messages, max_tokens=10)
        process["turns"].append({
            "turn": turn,
            "prompt_tokens": result.usage.prompt_tokens,
            "cached_tokens": result.usage.cached_tokens,
            "encoder_runs": result.trace.encoder_runs,
            "tokens": result.tokens,
        })
        replies.append(result.text)
    if args.cold and messages:
        cold = run(make_runner(args.family, None, ledger=ReplyLedger()), t, messages, max_tokens=10)
        process["cold_tokens"] = cold.tokens
    process["ssd"] = runner.cache_stats(None)["ssd"]
    runner.close()
    state["replies"] = replies
    state.setdefault("processes", []).append(process)
    args.state.write_text(json.dumps(state))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
