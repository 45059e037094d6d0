"""Bench results: records, a stderr progress bar, the printed tables, the JSON file."""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

RESULTS_VERSION = 1


@dataclass(frozen=True, slots=True)
class TurnResult:
    """One request of one replay.

    Attributes:
        target: Label of the benchmarked server.
        mode: ``cache`` or ``no-cache``.
        conversation: Fixture name.
        repeat: Replay number (0-based).
        session_id: Fixture session.
        turn: Turn within the session (0-based).
        step: Request within the replay (0-based, across sessions).
        prompt_tokens: The server's prompt length.
        cached_tokens: The server's ``cached_tokens`` (None if it reports none).
        ceiling_tokens: Reusable-token ceiling by our prompt builder (None if unavailable).
        local_prompt_tokens: The prompt length by our prompt builder (None if unavailable).
        ttft_s: Time to the first content token.
        total_s: Time to the end of the stream.
        completion_tokens: Tokens generated.
        first_token_source: ``content`` or ``finish`` (see ``server.bench.client``).
    """

    target: str
    mode: str
    conversation: str
    repeat: int
    session_id: str
    turn: int
    step: int
    prompt_tokens: int
    cached_tokens: int | None
    ceiling_tokens: int | None
    local_prompt_tokens: int | None
    ttft_s: float
    total_s: float
    completion_tokens: int
    first_token_source: str


@dataclass(frozen=True, slots=True)
class StepSummary:
    """Medians over repeats of one step of one (target, mode, conversation) (token counts of
    repeats differ by a token or two: each replay has its own nonce)."""

    step: int
    turn: int
    prompt_tokens: int
    cached_tokens: int | None
    ceiling_tokens: int | None
    ttft_s: float
    total_s: float


Series = tuple[str, str, str]  # (target, mode, conversation)


def series(results: Iterable[TurnResult]) -> dict[Series, list[StepSummary]]:
    """Results grouped by (target, mode, conversation), summarised per step, in first-seen order."""
    grouped: dict[Series, dict[int, list[TurnResult]]] = {}
    for r in results:
        grouped.setdefault((r.target, r.mode, r.conversation), {}).setdefault(r.step, []).append(r)
    out: dict[Series, list[StepSummary]] = {}
    for key, steps in grouped.items():
        rows = []
        for step in sorted(steps):
            rs = steps[step]
            first = rs[0]
            cached = [r.cached_tokens for r in rs if r.cached_tokens is not None]
            ceilings = [r.ceiling_tokens for r in rs if r.ceiling_tokens is not None]
            rows.append(StepSummary(
                step=step,
                turn=first.turn,
                prompt_tokens=int(statistics.median(r.prompt_tokens for r in rs)),
                cached_tokens=int(statistics.median(cached)) if cached else None,
                ceiling_tokens=int(statistics.median(ceilings)) if ceilings else None,
                ttft_s=statistics.median(r.ttft_s for r in rs),
                total_s=statistics.median(r.total_s for r in rs),
            ))
        out[key] = rows
    return out


def last_over_first(rows: Sequence[StepSummary]) -> float:
    """TTFT of the last step over that of the first."""
    return rows[-1].ttft_s / rows[0].ttft_s


class Progress:
    """A one-line progress bar on a terminal stream (stderr), redrawn in place."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        self._total = max(total, 1)
        self._done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._width = width

    def advance(self, label: str) -> None:
        self._done += 1
        filled = self._width * self._done // self._total
        bar = "#" * filled + "-" * (self._width - filled)
        self._stream.write(f"\r[{bar}] {self._done}/{self._total} {label[:60]:<60}")
        self._stream.flush()

    def close(self) -> None:
        self._stream.write("\n")
        self._stream.flush()


def _num(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def format_tables(results: Sequence[TurnResult]) -> str:
    """The per-turn table of every series, its TTFT last/first ratio, and cross-target ratios."""
    lines: list[str] = []
    grouped = series(results)
    header = (f"{'target':<14} {'mode':<9} {'conversation':<22} {'turn':>4} {'prompt':>7} "
              f"{'cached':>7} {'ceiling':>7} {'ttft_s':>8} {'total_s':>8}")
    lines += [header, "-" * len(header)]
    for (target, mode, conversation), rows in grouped.items():
        for row in rows:
            lines.append(
                f"{target:<14} {mode:<9} {conversation:<22} {row.step + 1:>4} "
                f"{row.prompt_tokens:>7} {_num(row.cached_tokens):>7} "
                f"{_num(row.ceiling_tokens):>7} {row.ttft_s:>8.3f} {row.total_s:>8.3f}")
    lines.append("")
    for (target, mode, conversation), rows in grouped.items():
        if len(rows) > 1:
            lines.append(
                f"{target} {mode} {conversation}: TTFT turn {rows[-1].step + 1} / turn 1 = "
                f"{last_over_first(rows):.3f} ({rows[-1].ttft_s:.3f} s / {rows[0].ttft_s:.3f} s)")
    targets = list(dict.fromkeys(t for t, _, _ in grouped))
    if len(targets) > 1:
        base = targets[0]
        for (target, mode, conversation), rows in grouped.items():
            ref = grouped.get((base, mode, conversation))
            if target == base or ref is None:
                continue
            ratios = " ".join(f"{r.ttft_s / b.ttft_s:.2f}" for r, b in zip(rows, ref))
            lines.append(f"TTFT {target}/{base} {mode} {conversation} per turn: {ratios}")
    return "\n".join(lines)


def write_json(path: Path, results: Sequence[TurnResult], meta: dict[str, Any]) -> None:
    """Save every result with the run's metadata and per-series summaries."""
    grouped = series(results)
    payload = {
        "version": RESULTS_VERSION,
        **meta,
        "summaries": [
            {
                "target": target, "mode": mode, "conversation": conversation,
                "ttft_last_over_first": last_over_first(rows) if len(rows) > 1 else None,
                "steps": [asdict(row) for row in rows],
            }
            for (target, mode, conversation), rows in grouped.items()
        ],
        "results": [asdict(r) for r in results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def read_json(path: Path) -> list[TurnResult]:
    """The results of a saved run."""
    payload = json.loads(path.read_text())
    return [TurnResult(**r) for r in payload["results"]]
