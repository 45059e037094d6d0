"""vlmcache vs mlx-vlm's own server (APC on), same fixture model, same conversation, same client.

For each family (``bench`` preset fixtures: qwen2_vl, gemma3, qwen3_5) this starts, on
127.0.0.1 only:

- ``vlmcache serve --fixture F --fixture-preset bench`` (RAM + SSD tiers, defaults), and
- ``python -m mlx_vlm.server --model <the same fixture directory>`` with ``APC_ENABLED=1
  APC_DISK_ENABLED=0`` (its automatic prefix cache, RAM only),

both with OpenBLAS preloaded, then replays the conversations against each in turn with
``vlmcache bench``'s replay (streaming, greedy, ``cache`` and ``no-cache`` modes: see
``server/bench/replay.py``), stops both servers and reports per turn the TTFT of each and the
ratio mlx-vlm / vlmcache. Servers are stopped on every exit path (SIGTERM, then SIGKILL).

Run: ``LD_PRELOAD=$(.venv/bin/python -m server.blas) HF_HUB_OFFLINE=1 .venv/bin/python
benchmarks/compare_mlx_vlm.py [--families qwen2_vl gemma3 qwen3_5] [--repeats 1]
[--out benchmarks/results/compare] [--readme-plot benchmarks/plots/ttft_one_image_10_turns.png]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from fixtures.build import ensure_fixture
from server import blas
from server.bench.client import Endpoint
from server.bench.command import BenchOptions, Target, count_requests, run_bench
from server.bench.plot import plot_ttft
from server.bench.replay import Mode
from server.bench.report import Progress, TurnResult, format_tables, series, write_json

REPO = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 600.0
VLMCACHE, MLX_VLM = "vlmcache", "mlx-vlm"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    openblas = blas.find_openblas()
    if openblas is not None:
        env["LD_PRELOAD"] = str(openblas)
    return env


@contextmanager
def started(name: str, argv: Sequence[str], env: dict[str, str], health_url: str,
            log_path: Path) -> Iterator[None]:
    """Run a server process until the block ends; wait for its health URL to answer 200."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=env,
                                   cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}; log: {log_path}")
            try:
                if httpx.get(health_url, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{name} did not start in {STARTUP_TIMEOUT_S:.0f} s; log: {log_path}")
            time.sleep(0.5)
        yield
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, SIGKILL it after 30 s."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)


def compare_family(family: str, options: BenchOptions, out: Path) -> list[TurnResult]:
    model_dir = ensure_fixture(family, "bench")
    env = server_env()
    ours, theirs = free_port(), free_port()
    state = Path(tempfile.mkdtemp(prefix=f"vlmcache-compare-{family}-"))
    served = f"{family}-bench"
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, state, True)
        stack.enter_context(started(
            VLMCACHE,
            [sys.executable, "-m", "server.cli", "serve", "--fixture", family,
             "--fixture-preset", "bench", "--host", "127.0.0.1", "--port", str(ours),
             "--cache-dir", str(state), "--model-name", served],
            env, f"http://127.0.0.1:{ours}/health", out / f"{family}-vlmcache.log"))
        stack.enter_context(started(
            MLX_VLM,
            [sys.executable, "-m", "mlx_vlm.server", "--model", str(model_dir), "--host",
             "127.0.0.1", "--port", str(theirs)],
            {**env, "APC_ENABLED": "1", "APC_DISK_ENABLED": "0"},
            f"http://127.0.0.1:{theirs}/health", out / f"{family}-mlx-vlm.log"))
        targets = [
            Target(VLMCACHE, Endpoint(f"http://127.0.0.1:{ours}"), served),
            Target(MLX_VLM, Endpoint(f"http://127.0.0.1:{theirs}"), str(model_dir)),
        ]
        progress = Progress(count_requests(options, len(targets)))
        try:
            return run_bench(targets, options, progress=progress)
        finally:
            progress.close()


def ratio_rows(family: str, results: Sequence[TurnResult]) -> list[dict[str, object]]:
    """Per conversation, mode and turn: both servers' TTFT and mlx-vlm / vlmcache."""
    grouped = series(results)
    rows = []
    for (target, mode, conversation), steps in grouped.items():
        if target != VLMCACHE or (MLX_VLM, mode, conversation) not in grouped:
            continue
        for ours, theirs in zip(steps, grouped[(MLX_VLM, mode, conversation)]):
            rows.append({
                "family": family, "conversation": conversation, "mode": mode,
                "turn": ours.step + 1, "prompt_tokens": ours.prompt_tokens,
                "vlmcache_cached": ours.cached_tokens, "mlx_vlm_cached": theirs.cached_tokens,
                "ceiling": ours.ceiling_tokens,
                "vlmcache_ttft_s": ours.ttft_s, "mlx_vlm_ttft_s": theirs.ttft_s,
                "mlx_vlm_over_vlmcache": theirs.ttft_s / ours.ttft_s,
            })
    return rows


def markdown(rows: Sequence[dict[str, object]]) -> str:
    lines = ["| family | mode | turn | prompt | cached (vlmcache / mlx-vlm) | ceiling | "
             "TTFT vlmcache s | TTFT mlx-vlm s | mlx-vlm / vlmcache |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['mode']} | {r['turn']} | {r['prompt_tokens']} | "
            f"{r['vlmcache_cached']} / {r['mlx_vlm_cached']} | {r['ceiling']} | "
            f"{r['vlmcache_ttft_s']:.3f} | {r['mlx_vlm_ttft_s']:.3f} | "
            f"{r['mlx_vlm_over_vlmcache']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["qwen2_vl", "gemma3", "qwen3_5"])
    parser.add_argument("--conversations", nargs="+", default=["one_image_10_turns"])
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--modes", nargs="+", default=[m.value for m in Mode],
                        choices=[m.value for m in Mode])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "compare")
    parser.add_argument("--readme-plot", type=Path, default=None,
                        help="also save the first family's plot of the first conversation here")
    args = parser.parse_args(argv)
    options = BenchOptions(conversations=tuple(args.conversations),
                           modes=tuple(Mode(m) for m in args.modes), turns=args.turns,
                           repeats=args.repeats, max_tokens=args.max_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    all_rows: list[dict[str, object]] = []
    for index, family in enumerate(args.families):
        print(f"== {family} ==", flush=True)
        results = compare_family(family, options, args.out)
        print(format_tables(results), flush=True)
        write_json(args.out / f"{family}.json", results,
                   {"command": [sys.executable, *sys.argv], "family": family,
                    "max_tokens": options.max_tokens, "repeats": options.repeats})
        for conversation in options.conversations:
            plot = plot_ttft(results, conversation, args.out / f"ttft_{family}_{conversation}.png",
                             title=f"TTFT per turn: {conversation}, {family} (bench preset)")
            print(f"plot: {plot}")
            if index == 0 and conversation == options.conversations[0] and args.readme_plot:
                shutil.copyfile(plot, args.readme_plot)
                print(f"plot: {args.readme_plot}")
        all_rows += ratio_rows(family, results)
    (args.out / "ratios.json").write_text(json.dumps(all_rows, indent=2) + "\n")
    print(markdown(all_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
