"""What `models swap` and `models tune` share: the swap's flags and options, its progress
bar and its summary table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, TextIO

from sitsmesh.admin.enums import label, word
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.cli.common import UsageError, table

SWAP_TIMEOUT_S = 1800.0  # a whole swap: loads, drain and all
BAR_WIDTH = 30


def swap_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a swap's options, for `models swap` and `models tune`."""
    p.add_argument("--warmup-count", type=int, default=0, help="warmup runs per instance")
    p.add_argument("--warmup-data", choices=("zero", "random"), default="")
    p.add_argument("--sample", metavar="FILE.json",
                   help='probe values: {"INPUT0": [1, 2, 3, 4]} (flattened)')
    p.add_argument("--probes", type=int, default=0, help="verify probes (default 20)")
    p.add_argument("--max-latency-ratio", type=float, default=0.0)
    p.add_argument("--drain-timeout", type=float, default=0.0, help="seconds (default 30)")
    p.add_argument("--load-timeout", type=float, default=0.0, help="seconds (default 300)")


def swap_options(args: argparse.Namespace) -> Any:
    options = admin_pb2.SwapOptions(
        warmup_count=max(0, args.warmup_count),
        warmup_data=label(admin_pb2.WarmupData, args.warmup_data),
        verify_probes=max(0, args.probes), max_latency_ratio=args.max_latency_ratio,
        drain_timeout_s=args.drain_timeout, load_timeout_s=args.load_timeout)
    if args.sample:
        try:
            sample = json.loads(Path(args.sample).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise UsageError(f"{args.sample}: cannot read sample: {exc}") from None
        if not isinstance(sample, dict) or not all(
                isinstance(v, list) and all(isinstance(x, int | float) for x in v)
                for v in sample.values()):
            raise UsageError(f"{args.sample}: expected {{input name: [numbers]}}")
        for name, values in sample.items():
            options.sample[name].values.extend(float(x) for x in values)
    return options


class Progress:
    """A bar redrawn in place on a terminal; one line per event otherwise."""

    def __init__(self, out: TextIO, *, live: bool) -> None:
        self._out = out
        self._live = live

    def show(self, event: Any) -> None:
        filled = round(event.progress * BAR_WIDTH)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        phase = word(admin_pb2.SwapPhase, event.phase)
        state = word(admin_pb2.StepState, event.state)
        text = f"[{bar}] {event.progress:4.0%} {phase:<9} {state:<8} {event.message}"
        if self._live:
            self._out.write("\r\x1b[2K" + text[:160])
        else:
            self._out.write(text + "\n")
        self._out.flush()

    def close(self) -> None:
        if self._live:
            self._out.write("\n")
            self._out.flush()


def _seconds(step: Any) -> str:
    if not step.HasField("ended_at"):
        return "-"
    started = step.started_at.ToNanoseconds()
    return f"{(step.ended_at.ToNanoseconds() - started) / 1e9:.2f}"


def swap_summary(record: Any) -> str:
    source = f"v{record.from_version}" if record.HasField("from_version") else "?"
    lines = [f"swap {record.id}: {record.model} {source} -> v{record.to_version} on "
             f"{record.endpoint}: {word(admin_pb2.SwapState, record.state).upper()}"]
    if record.error:
        lines.append(f"error: {record.error}")
    rows = [("PHASE", "RESULT", "SECONDS", "MESSAGE")]
    rows += [(word(admin_pb2.SwapPhase, s.phase), word(admin_pb2.StepState, s.state),
              _seconds(s), s.message) for s in record.steps]
    return "\n".join([*lines, table(rows)])
