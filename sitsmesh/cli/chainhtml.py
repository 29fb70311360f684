"""`sitsmesh chain show --output html`: one self-contained page (inline CSS and SVG, no
script, no external resource) with the waterfall of the slowest chains, each stage's
latency histogram and the summary table.

Every string in the page came from the server, and request ids from whoever sent the
request: each one goes through `_text` (html.escape), numbers through float().
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

WATERFALL_W = 760      # px of the time axis
LANE_H = 16            # px per stage inside a waterfall row
HIST_W, HIST_H = 360, 140
MAX_BINS = 28          # display bins per histogram: powers of two of 0.01 ms
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac")
CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:24px 0 8px}
table{border-collapse:collapse}th,td{padding:3px 10px;border-bottom:1px solid #ddd}
th{text-align:left;background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums}
tr.bottleneck td{background:#fff3cd;font-weight:600}
.summary{color:#444;margin:0 0 12px}.mono{font-family:ui-monospace,monospace;font-size:12px}
.chain{margin:0 0 10px;padding:6px 8px;border:1px solid #e4e4e4;border-radius:4px}
.chain .ids{margin:0 0 4px}.hists{display:flex;flex-wrap:wrap;gap:16px}
.hist{border:1px solid #e4e4e4;border-radius:4px;padding:6px}
svg text{font:11px system-ui,sans-serif;fill:#222}.empty{color:#777}
svg.axis{margin-left:9px}.tokens{color:#444;margin:0 0 12px}
"""
FIRST_MARK = "#222"    # the first-token tick on a streaming stage's bar
STALL = "#d62728"      # a stall on a streaming stage's bar


def _text(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any) -> float:
    number = float(value)
    return number if math.isfinite(number) else 0.0


def _ms(value: Any) -> str:
    return f"{_num(value):.1f}"


def render(doc: Mapping[str, Any]) -> str:
    """The page for one `chain show` document (the same data `-o json` prints)."""
    stages: Sequence[Mapping[str, Any]] = doc.get("stages", [])
    colors = {str(s["name"]): PALETTE[i % len(PALETTE)] for i, s in enumerate(stages)}
    title = f"sitsmesh latency chain: {doc.get('pipeline', '')}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_text(title)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>{_text(title)}</h1>",
        f'<p class="summary">last {_text(doc.get("window", ""))}: '
        f'<span id="chains">{int(_num(doc.get("chains", 0)))}</span> chains '
        f'({int(_num(doc.get("incomplete", 0)))} incomplete, '
        f'{int(_num(doc.get("failed", 0)))} failed); end to end p50 '
        f'{_ms(doc.get("e2e_p50_ms", 0))} ms, p99 {_ms(doc.get("e2e_p99_ms", 0))} ms; '
        f'bottleneck: <strong id="bottleneck">{_text(doc.get("bottleneck") or "-")}</strong>'
        "</p>",
        _tokens(doc.get("tokens")),
        _summary_table(stages, str(doc.get("bottleneck", ""))),
        _waterfall(doc.get("slowest", []), colors),
        _histograms(doc.get("histograms", []), colors),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _tokens(tokens: Mapping[str, Any] | None) -> str:
    """The request-level token line, where the pipeline streams."""
    if not tokens:
        return ""

    def ms(name: str) -> str:
        return _ms(tokens[name]) if name in tokens else "-"

    return (f'<p class="tokens">requests with tokens: {int(_num(tokens.get("chains", 0)))};'
            f' TTFT p50 {ms("ttft_p50_ms")} ms, p99 {ms("ttft_p99_ms")} ms; ITL p50 '
            f'{ms("itl_p50_ms")} ms, p99 {ms("itl_p99_ms")} ms; TTFT owner in the slowest '
            f'1 %: <strong id="ttft-owner">{_text(tokens.get("ttft_owner") or "-")}</strong>'
            "</p>")


def _summary_table(stages: Sequence[Mapping[str, Any]], bottleneck: str) -> str:
    streams = any("ttft_attributed_ms" in s or "tokens" in s for s in stages)
    extra = ("<th>TTFT part, slowest 1 % ms</th><th>TTFT p50 ms</th><th>TPOT p50 ms</th>"
             "<th>longest stall ms</th>") if streams else ""
    rows = ['<h2>Stages</h2><table id="stages"><thead><tr><th>stage</th><th>p50 ms</th>'
            "<th>p90 ms</th><th>p99 ms</th><th>TTFB p99 ms</th><th>slowest 1 % ms</th>"
            f"<th>share of e2e</th>{extra}</tr></thead><tbody>"]
    for s in stages:
        name = str(s["name"])
        ttfb = _ms(s["ttfb_p99_ms"]) if "ttfb_p99_ms" in s else "-"
        marker = ' class="bottleneck"' if name == bottleneck else ""
        rows.append(
            f'<tr{marker}><td class="stage">{_text(name)}</td><td class="n">{_ms(s["p50_ms"])}'
            f'</td><td class="n">{_ms(s["p90_ms"])}</td><td class="n">{_ms(s["p99_ms"])}</td>'
            f'<td class="n">{ttfb}</td><td class="n">{_ms(s["attributed_ms"])}</td>'
            f'<td class="n">{_num(s["share_of_e2e_p99"]):.0%}</td>'
            f'{_token_cells(s) if streams else ""}</tr>')
    rows.append("</tbody></table>")
    return "".join(rows)


def _token_cells(stage: Mapping[str, Any]) -> str:
    tokens: Mapping[str, Any] = stage.get("tokens", {})
    cells = [_ms(stage["ttft_attributed_ms"]) if "ttft_attributed_ms" in stage else "-"]
    cells += [_ms(tokens[n]) if n in tokens else "-"
              for n in ("ttft_p50_ms", "tpot_p50_ms", "stall_max_ms")]
    return "".join(f'<td class="n">{c}</td>' for c in cells)


def _stream_marks(stage: Mapping[str, Any], x: float, y: int, scale: float) -> str:
    """The first token (a tick) and the stalls (red spans) on a streaming stage's bar,
    kept inside the bar (the stream's clock and the hop's differ by a little)."""
    end = x + _num(stage.get("total_ms", 0)) * scale
    stream: Mapping[str, Any] = stage.get("stream") or {}
    marks = []
    if "ttft_ms" in stream:
        at = min(x + _num(stream["ttft_ms"]) * scale, end - 2.0)
        marks.append(f'<rect class="first-token" x="{at:.1f}" y="{y - 1}" width="2" '
                     f'height="{LANE_H - 1}" fill="{FIRST_MARK}"><title>first token at '
                     f'+{_ms(stream["ttft_ms"])} ms</title></rect>')
    for stall in stream.get("stalls", []):
        at = min(x + _num(stall.get("after_ms", 0)) * scale, end - 1.0)
        width = max(1.0, min(_num(stall.get("length_ms", 0)) * scale, end - at))
        marks.append(f'<rect class="stall" x="{at:.1f}" y="{y + 3}" width="{width:.1f}" '
                     f'height="{LANE_H - 9}" fill="{STALL}"><title>stall of '
                     f'{_ms(stall.get("length_ms"))} ms after {_ms(stall.get("after_ms"))} ms'
                     f'</title></rect>')
    return "".join(marks)


def _chain_tokens(chain: Mapping[str, Any]) -> str:
    if "ttft_ms" not in chain:
        return ""
    return (f' · TTFT <span class="ttft">{_ms(chain["ttft_ms"])} ms</span>, owner '
            f'<span class="ttft-owner">{_text(chain.get("ttft_owner") or "-")}</span>')


def _waterfall(chains: Sequence[Mapping[str, Any]], colors: Mapping[str, str]) -> str:
    out = [f"<h2>Slowest chains ({len(chains)})</h2>", '<div id="waterfall">']
    if not chains:
        out.append('<p class="empty">no finished chain in this window</p>')
    # One time axis for every row, so rows compare by eye.
    span = max([_num(c.get("e2e_ms", 0)) for c in chains]
               + [_num(s.get("offset_ms", 0)) + _num(s.get("total_ms", 0))
                  for c in chains for s in c.get("stages", [])] + [0.001])
    label_w = 220
    if chains:
        ticks = "".join(
            f'<text x="{label_w + f * WATERFALL_W:.1f}" y="12" text-anchor="middle">'
            f"{_bound(span * f)} ms</text>" for f in (0.0, 0.25, 0.5, 0.75, 1.0))
        out.append(f'<svg class="axis" width="{label_w + WATERFALL_W + 30}" height="16" '
                   f'role="img" aria-label="time from the first hop">'
                   f'<text x="0" y="12">from the chain\'s first hop</text>{ticks}</svg>')
    for chain in chains:
        trace = str(chain.get("trace_id", ""))
        failed = " (failed)" if chain.get("failed") else ""
        out.append(
            '<div class="chain waterfall-row"><div class="ids">'
            f'<strong>{_ms(chain.get("e2e_ms", 0))} ms</strong>{failed} · request '
            f'<span class="mono request-id">{_text(chain.get("request_id", ""))}</span> · trace '
            f'<span class="mono trace-id">{_text(trace) if trace else "-"}</span>'
            f'{_chain_tokens(chain)}</div>')
        lanes = list(chain.get("stages", []))
        height = LANE_H * max(1, len(lanes)) + 4
        out.append(f'<svg width="{label_w + WATERFALL_W + 10}" height="{height}" '
                   f'role="img" aria-label="stage waterfall">')
        for i, stage in enumerate(lanes):
            name = str(stage.get("name", ""))
            x = label_w + _num(stage.get("offset_ms", 0)) / span * WATERFALL_W
            width = max(1.0, _num(stage.get("total_ms", 0)) / span * WATERFALL_W)
            y = 2 + i * LANE_H
            out.append(
                f'<g class="bar"><title>{_text(name)}: starts at +{_ms(stage.get("offset_ms"))}'
                f' ms, {_ms(stage.get("total_ms"))} ms in all, {_ms(stage.get("own_ms"))} ms '
                f'its own</title><text x="0" y="{y + 11}">{_text(name)} '
                f'{_ms(stage.get("total_ms"))} ms (own {_ms(stage.get("own_ms"))})</text>'
                f'<rect x="{x:.1f}" y="{y}" width="{width:.1f}" height="{LANE_H - 3}" '
                f'fill="{colors.get(name, PALETTE[0])}"></rect>'
                f'{_stream_marks(stage, x, y, WATERFALL_W / span)}</g>')
        out.append("</svg></div>")
    out.append("</div>")
    return "".join(out)


def _bins(buckets: Sequence[Mapping[str, Any]]) -> list[tuple[float, int]]:
    """The fine buckets summed into powers of two of 0.01 ms, gaps filled with zeros, at
    most MAX_BINS (the lowest ones merged into the first)."""
    grouped: dict[int, int] = {}
    for bucket in buckets:
        le = _num(bucket.get("le_ms", 0))
        power = max(0, math.ceil(math.log2(le / 0.01) - 1e-9)) if le > 0 else 0
        grouped[power] = grouped.get(power, 0) + int(_num(bucket.get("count", 0)))
    if not grouped:
        return []
    low, high = min(grouped), max(grouped)
    low = max(low, high - MAX_BINS + 1)
    counts = [0] * (high - low + 1)
    for power, n in grouped.items():
        counts[max(power, low) - low] += n
    return [(0.01 * 2 ** (low + i), n) for i, n in enumerate(counts)]


def _bound(ms: float) -> str:
    return f"{ms:.3g}" if ms < 10 else f"{ms:.0f}"


def _histograms(hists: Sequence[Mapping[str, Any]], colors: Mapping[str, str]) -> str:
    out = ["<h2>Latency per stage (own time)</h2>", '<div class="hists" id="histograms">']
    left, bottom, top = 40, 34, 14
    plot_w, plot_h = HIST_W - left - 10, HIST_H - bottom - top
    for hist in hists:
        name = str(hist.get("name", ""))
        bins = _bins(hist.get("buckets", []))
        out.append(f'<div class="hist"><div><strong class="hist-name">{_text(name)}</strong>'
                   f' · {sum(n for _, n in bins)} chains</div>')
        if not bins:
            out.append('<p class="empty">no samples</p></div>')
            continue
        peak = max(n for _, n in bins) or 1
        bar_w = plot_w / len(bins)
        out.append(f'<svg width="{HIST_W}" height="{HIST_H}" role="img" '
                   f'aria-label="latency histogram of {_text(name)}">')
        for i, (upper, n) in enumerate(bins):
            h = n / peak * plot_h
            x = left + i * bar_w
            out.append(f'<rect x="{x + 1:.1f}" y="{top + plot_h - h:.1f}" '
                       f'width="{max(1.0, bar_w - 2):.1f}" height="{h:.1f}" '
                       f'fill="{colors.get(name, PALETTE[0])}"><title>{_bound(upper / 2)}-'
                       f'{_bound(upper)} ms: {n}</title></rect>')
        axis_y = top + plot_h
        out.append(
            f'<line x1="{left}" y1="{axis_y}" x2="{left + plot_w}" y2="{axis_y}" '
            f'stroke="#555"></line><line x1="{left}" y1="{top}" x2="{left}" y2="{axis_y}" '
            f'stroke="#555"></line>'
            f'<text x="{left - 4}" y="{top + 8}" text-anchor="end">{peak}</text>'
            f'<text x="{left - 4}" y="{axis_y}" text-anchor="end">0</text>'
            f'<text x="{left}" y="{axis_y + 13}">{_bound(bins[0][0] / 2)}</text>'
            f'<text x="{left + plot_w}" y="{axis_y + 13}" text-anchor="end">'
            f'{_bound(bins[-1][0])}</text>'
            f'<text x="{left + plot_w / 2}" y="{axis_y + 28}" text-anchor="middle">'
            f"ms (own time per chain)</text>"
            f'<text x="10" y="{top + plot_h / 2}" text-anchor="middle" '
            f'transform="rotate(-90 10 {top + plot_h / 2})">chains</text></svg></div>')
    out.append("</div>")
    return "".join(out)
