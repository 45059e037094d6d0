"""A server stand-in that serves image conversations on a tiny RAM budget until killed (for the
engine-level crash test): every request evicts blocks to the SSD tier, so a SIGKILL lands in
the middle of spills.

    python -m tests.ssd.engine_spill_process --family qwen2_vl --cache-dir D
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fixtures.conversation import load_conversation
from server.engine.prompt import ReplyLedger
from tests.engine.conftest import image_part, msg, picture, run, session_messages, tenant
from tests.ssd.factories import make_runner

RAM_BUDGET = 8 * 8192  # a few blocks of the tiny fixtures


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--family", required=True)
    parser.add_argument("--cache-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    session = load_conversation("one_image_10_turns").sessions[0]
    t = tenant()
    runner = make_runner(args.family, args.cache_dir, ram_budget_bytes=RAM_BUDGET, ledger=ReplyLedger(), queue_size=8)
    print("ready", flush=True)
    round_ = 0
    while True:
        replies: list[str] = []
        for turn in range(3):
            replies.append(run(runner, t, session_messages(t, session, turn, replies), max_tokens=10).text)
        img = image_part(t, picture(100 + round_ % 5))
        run(runner, t, [msg("user", img, f"Round {round_}: describe the picture in detail.")], session=f"r{round_}")
        round_ += 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
