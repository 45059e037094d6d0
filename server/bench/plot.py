"""TTFT per turn as a PNG: one line per (server, mode) of one conversation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from server.bench.report import TurnResult, series

_STYLE = {"cache": "-", "no-cache": "--"}


def plot_ttft(results: Sequence[TurnResult], conversation: str, path: Path, *,
              title: str | None = None) -> Path:
    """Draw TTFT (log scale) against turn number for every series of ``conversation``.

    Raises:
        ValueError: No result belongs to ``conversation``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    grouped = {key: rows for key, rows in series(results).items() if key[2] == conversation}
    if not grouped:
        raise ValueError(f"no results for conversation {conversation!r}")
    fig, ax = plt.subplots(figsize=(7.0, 4.2), dpi=110)
    markers = "osD^v<>"
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    targets = list(dict.fromkeys(t for t, _, _ in grouped))
    for (target, mode, _), rows in grouped.items():
        k = targets.index(target)
        ax.plot(
            [r.step + 1 for r in rows], [r.ttft_s for r in rows],
            linestyle=_STYLE.get(mode, ":"), marker=markers[k % len(markers)],
            color=colors[k % len(colors)], markersize=4,
            label=f"{target}, {'with' if mode == 'cache' else 'without'} cache",
        )
    ax.set_yscale("log")
    # Plain seconds on the log axis (0.05, 0.1, 0.2 ...) rather than powers of ten.
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (s, log scale)")
    ax.set_xticks(sorted({r.step + 1 for rows in grouped.values() for r in rows}))
    ax.set_title(title or f"TTFT per turn: {conversation}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
