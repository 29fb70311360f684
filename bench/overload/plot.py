"""One PNG per scenario: goodput and admitted p99 per second sent, one column per
access-log flush setting, one line per variant, the offered load dashed."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from analysis import Second
from load import PROFILE, multiplier, total_s

COLORS = {"none": "tab:gray", "adaptive": "tab:orange", "seed": "tab:purple",
          "sitsmesh": "tab:blue"}
LABELS = {"none": "no control", "adaptive": "adaptive_concurrency", "seed": "seed",
          "sitsmesh": "sitsmesh"}


def plot(title: str, columns: Mapping[str, Mapping[str, Sequence[Second]]], capacity: float,
         sla_ms: float, out: Path) -> None:
    """`columns`: access-log flush -> variant key -> its seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = max(1, len(columns))
    fig, axes = plt.subplots(2, ncols, figsize=(6.5 * ncols, 6.5), sharex=True,
                             squeeze=False)
    xs = [s + 0.5 for s in range(math.ceil(total_s()))]
    top_y = 2.3 * capacity
    for col, (flush, variants) in enumerate(columns.items()):
        top, bottom = axes[0][col], axes[1][col]
        top.plot(xs, [multiplier(x) * capacity for x in xs], "k--", lw=1.2, label="offered")
        top.axhline(capacity, color="k", lw=0.6, alpha=0.4)
        for key, secs in variants.items():
            # A variant on N replicas ("sitsmesh-x2"): its variant's colour, dotted.
            base, _, count = key.partition("-x")
            color = COLORS.get(base, "k")
            label = LABELS.get(base, base) + (f" x{count}" if count else "")
            style = ":" if count else "-"
            top.plot(xs, [s.goodput for s in secs], color=color, lw=1.8, marker=".",
                     ls=style, label=label)
            known = [(x, s.p99_ms) for x, s in zip(xs, secs, strict=True)
                     if s.p99_ms is not None]
            bottom.plot([x for x, _ in known], [v for _, v in known], color=color, lw=1.8,
                        marker=".", ls=style, label=label)
        bottom.axhline(sla_ms, color="r", ls="--", lw=1, label=f"SLA {sla_ms:g} ms")
        t = 0.0
        for seg in PROFILE:
            top.text(t + seg.seconds / 2, 0.96 * top_y, seg.name, ha="center", fontsize=8,
                     color="0.35")
            t += seg.seconds
            if seg is not PROFILE[-1]:
                for ax in (top, bottom):
                    ax.axvline(t, color="k", lw=0.5, alpha=0.25)
        top.set_title(f"access-log flush {flush}: goodput (200 within {sla_ms:g} ms)",
                      fontsize=10)
        top.set_ylim(0, top_y)
        bottom.set_title("admitted p99 (answered 200)", fontsize=10)
        bottom.set_yscale("log")
        bottom.set_xlabel("seconds since the variant started (by send time)")
        if col == 0:
            top.set_ylabel("requests/s")
            bottom.set_ylabel("ms (log)")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    sla_handles, sla_labels = axes[1][0].get_legend_handles_labels()
    fig.suptitle(f"{title}; capacity {capacity:.0f} rps", fontsize=11)
    fig.legend(handles + sla_handles[-1:], labels + sla_labels[-1:], loc="upper center",
               bbox_to_anchor=(0.5, 0.95), ncol=6, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(out, dpi=90)
    plt.close(fig)
