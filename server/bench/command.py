"""``vlmcache bench``: arguments, the replay loop, and the outputs (table, JSON, PNG).

```
vlmcache bench --url http://127.0.0.1:8000 [--url http://127.0.0.1:8001 --label mlx-vlm ...]
               [--api-key KEY] [--conversations one_image_10_turns ...] [--turns N]
               [--model NAME] [--modes cache no-cache] [--repeats R] [--out DIR]
```
Every target is replayed in turn (never two at once), each conversation in each mode, each
replay with its own nonce (``server.bench.replay``). Before a target's first replay one
unrelated request warms it up, so one-off start-up costs do not land on turn 1.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx

from fixtures.conversation import Conversation, load_conversation
from server.bench.ceiling import Ceiling, CeilingCalculator, CeilingHistory, fixture_of
from server.bench.client import Endpoint, served_model, stream_chat
from server.bench.plot import plot_ttft
from server.bench.replay import Mode, TurnRequest, nonce_for, plan_replay
from server.bench.report import Progress, TurnResult, format_tables, write_json

DEFAULT_CONVERSATIONS = ("one_image_10_turns",)


@dataclass(frozen=True, slots=True)
class Target:
    """A server to benchmark: its label in tables and plots, and how to reach it."""

    label: str
    endpoint: Endpoint
    model: str | None = None


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """How to replay.

    Attributes:
        conversations: Fixture names (or paths to conversation JSON files).
        modes: Which of ``cache`` / ``no-cache`` to run.
        turns: Most turns per session (None = all).
        repeats: Replays per (target, conversation, mode); tables show medians.
        max_tokens: Completion length of every request.
        ceiling_model: Model directory for ceilings; None = a fixture named by the served model,
            if any.
        ceilings: Compute ceilings at all.
        verbatim: Send the fixtures unchanged (``cache`` mode only; no nonce).
        warmup: Send one unrelated request to each target before its first replay.
        run_id: Seeds every nonce (a new one per run by default).
    """

    conversations: tuple[str, ...] = DEFAULT_CONVERSATIONS
    modes: tuple[Mode, ...] = (Mode.CACHE, Mode.NO_CACHE)
    turns: int | None = None
    repeats: int = 1
    max_tokens: int = 16
    ceiling_model: Path | None = None
    ceilings: bool = True
    verbatim: bool = False
    warmup: bool = True
    run_id: str = ""


def run_bench(
    targets: Sequence[Target],
    options: BenchOptions,
    *,
    progress: Progress | None = None,
    on_result: Callable[[TurnResult], None] | None = None,
) -> list[TurnResult]:
    """Replay every conversation against every target; returns one result per request."""
    run_id = options.run_id or nonce_for("run", time.time_ns())
    conversations = [load_conversation(name) for name in options.conversations]
    calculators: dict[Path, CeilingCalculator] = {}
    results: list[TurnResult] = []
    with httpx.Client() as client:
        for target in targets:
            model = target.model or served_model(client, target.endpoint)
            calculator = _calculator(model, options, calculators)
            history = calculator.history() if calculator is not None else None
            if options.warmup:
                _warm_up(client, target.endpoint, model, conversations[0], run_id, history)
            for conversation in conversations:
                for mode in options.modes:
                    for repeat in range(options.repeats):
                        nonce = nonce_for(run_id, target.label, conversation.name, mode, repeat)
                        requests = plan_replay(conversation, mode, replay_nonce=nonce,
                                               turns=options.turns,
                                               verbatim=options.verbatim and mode is Mode.CACHE)
                        for request in requests:
                            ceiling = history.add(request) if history is not None else None
                            result = _measure(client, target, model, conversation, mode, repeat,
                                              request, ceiling, options.max_tokens)
                            results.append(result)
                            if on_result is not None:
                                on_result(result)
                            if progress is not None:
                                progress.advance(f"{target.label} {mode} {conversation.name} "
                                                 f"turn {request.step + 1}")
    return results


def count_requests(options: BenchOptions, targets: int) -> int:
    """Requests a run will send (for the progress bar)."""
    per_target = 0
    for name in options.conversations:
        conversation = load_conversation(name)
        per_replay = sum(len(s.turns) if options.turns is None else min(options.turns, len(s.turns))
                         for s in conversation.sessions)
        per_target += per_replay * len(options.modes) * options.repeats
    return per_target * targets


def _calculator(model: str, options: BenchOptions,
                cache: dict[Path, CeilingCalculator]) -> CeilingCalculator | None:
    if not options.ceilings:
        return None
    path = options.ceiling_model
    if path is None:
        fixture = fixture_of(model)
        if fixture is None:
            return None  # an unknown model: ceilings are reported as n/a
        from fixtures.build import ensure_fixture

        path = ensure_fixture(*fixture)
    if path not in cache:
        cache[path] = CeilingCalculator(path)
    return cache[path]


def _warm_up(client: httpx.Client, endpoint: Endpoint, model: str, conversation: Conversation,
             run_id: str, history: CeilingHistory | None) -> None:
    request = plan_replay(conversation, Mode.NO_CACHE, replay_nonce=nonce_for(run_id, "warmup"),
                          turns=1)[0]
    if history is not None:
        history.add(request)
    stream_chat(client, endpoint, model=model, messages=request.openai_messages(), max_tokens=2)


def _measure(client: httpx.Client, target: Target, model: str, conversation: Conversation,
             mode: Mode, repeat: int, request: TurnRequest, ceiling: Ceiling | None,
             max_tokens: int) -> TurnResult:
    messages = request.openai_messages()  # encoded before the clock starts
    timing = stream_chat(client, target.endpoint, model=model, messages=messages,
                         max_tokens=max_tokens, session_id=request.session_id)
    return TurnResult(
        target=target.label,
        mode=str(mode),
        conversation=conversation.name,
        repeat=repeat,
        session_id=request.session_id,
        turn=request.turn,
        step=request.step,
        prompt_tokens=timing.prompt_tokens,
        cached_tokens=timing.cached_tokens,
        ceiling_tokens=None if ceiling is None else ceiling.reusable_tokens,
        local_prompt_tokens=None if ceiling is None else ceiling.prompt_tokens,
        ttft_s=timing.ttft_s,
        total_s=timing.total_s,
        completion_tokens=timing.completion_tokens,
        first_token_source=timing.first_token_source,
    )


# -- command line ---------------------------------------------------------------------------


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``vlmcache bench`` flags."""
    parser.add_argument("--url", action="append", required=True, metavar="URL",
                        help="base URL of an OpenAI-compatible server (repeat to compare servers)")
    parser.add_argument("--label", action="append", default=None, metavar="NAME",
                        help="name of each --url in tables and plots (default host:port)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="bearer key sent to every server")
    parser.add_argument("--model", action="append", default=None, metavar="NAME",
                        help="model name per --url (default: the first of its /v1/models)")
    parser.add_argument("--conversations", nargs="+", default=list(DEFAULT_CONVERSATIONS),
                        metavar="NAME", help="conversation fixtures (names or JSON paths; "
                        f"default {' '.join(DEFAULT_CONVERSATIONS)})")
    parser.add_argument("--turns", type=int, default=None, metavar="N",
                        help="replay at most N turns of each session")
    parser.add_argument("--modes", nargs="+", choices=[m.value for m in Mode],
                        default=[m.value for m in Mode],
                        help="cache: turns may reuse earlier turns; no-cache: a nonce on every "
                             "request defeats every cache (the baseline)")
    parser.add_argument("--repeats", type=int, default=1, metavar="R",
                        help="replays per conversation and mode (medians are reported)")
    parser.add_argument("--max-tokens", type=int, default=16, metavar="N",
                        help="completion length of every request (default 16)")
    parser.add_argument("--ceiling-model", type=Path, default=None, metavar="DIR",
                        help="model directory whose prompt builder computes the reusable-token "
                             "ceilings (default: the fixture the served model name names)")
    parser.add_argument("--no-ceiling", action="store_true", help="do not compute ceilings")
    parser.add_argument("--verbatim", action="store_true",
                        help="send the fixtures unchanged (no per-replay nonce)")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the warm-up request before each server's first replay")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), metavar="DIR",
                        help="where bench.json and ttft_<conversation>.png go "
                             "(default benchmarks/results)")
    parser.add_argument("--run-id", default="", help=argparse.SUPPRESS)


def targets_from_args(args: argparse.Namespace) -> list[Target]:
    labels = args.label or []
    models = args.model or []
    for name, values in (("--label", labels), ("--model", models)):
        if values and len(values) != len(args.url):
            raise SystemExit(f"give {name} once per --url ({len(args.url)}), got {len(values)}")
    targets = []
    for index, url in enumerate(args.url):
        parsed = urlparse(url)
        label = labels[index] if labels else (parsed.netloc or url)
        targets.append(Target(label, Endpoint(url, args.api_key),
                              models[index] if models else None))
    return targets


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    return BenchOptions(
        conversations=tuple(args.conversations),
        modes=tuple(Mode(m) for m in dict.fromkeys(args.modes)),
        turns=args.turns,
        repeats=args.repeats,
        max_tokens=args.max_tokens,
        ceiling_model=args.ceiling_model,
        ceilings=not args.no_ceiling,
        verbatim=args.verbatim,
        warmup=not args.no_warmup,
        run_id=args.run_id,
    )


def run_command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run the bench as the CLI does: progress on stderr, tables on stdout, files in --out."""
    targets = targets_from_args(args)
    options = options_from_args(args)
    progress = Progress(count_requests(options, len(targets)))
    try:
        results = run_bench(targets, options, progress=progress)
    finally:
        progress.close()
    print(format_tables(results))
    out: Path = args.out
    json_path = out / "bench.json"
    write_json(json_path, results, {
        "command": ["vlmcache", *argv],
        "targets": [{"label": t.label, "url": t.endpoint.base, "model": t.model} for t in targets],
        "max_tokens": options.max_tokens,
        "repeats": options.repeats,
    })
    print(f"\nresults: {json_path}")
    for name in dict.fromkeys(r.conversation for r in results):
        print(f"plot:    {plot_ttft(results, name, out / f'ttft_{name}.png')}")
    return 0
