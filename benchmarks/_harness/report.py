"""What the benchmarks print about measured configurations: the side-by-side
table, the speedup summary and the speedup heatmap.

A configuration record (:func:`rdna4_comm._bench.cases.record`) is a dict
with "op", "tokens", "hidden", "dtype", "bytes", "stats" ({backend:
:class:`rdna4_comm._timing.Stats`}) and "details" ({backend: what was
timed}). The speedup of rdna4_comm over a baseline is
:func:`rdna4_comm._bench.cases.speedup`.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from rdna4_comm._bench.cases import speedup
from rdna4_comm._timing import format_table


def finite(obj):
    """``obj`` with NaN and infinite floats as None (plain JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def comparison_table(records: Sequence[dict]) -> str:
    """One line per measured configuration: its shape, the p50 of rdna4_comm
    and, for every other backend, its p50 and the speedup of rdna4_comm over
    it (:func:`speedup`)."""
    others: list[str] = []
    for rec in records:
        others += [b for b in rec["stats"] if b != "rdna4_comm" and b not in others]
    header = ["op", "tokens", "hidden", "MiB/rank", "rdna4_comm p50 us"]
    for b in others:
        header += [f"{b} p50 us", f"x vs {b}"]
    rows = []
    for rec in records:
        stats = rec["stats"]
        row = [rec["op"], rec["tokens"], rec["hidden"], rec["bytes"] / 2**20, stats["rdna4_comm"].p50_us]
        for b in others:
            row += [stats[b].p50_us, speedup(stats, b)] if b in stats else [math.nan, math.nan]
        rows.append(row)
    return format_table(header, rows)


def speedups(records: list[dict]) -> dict[str, list[float]]:
    """Per baseline, rdna4_comm's speedup over it in every configuration it ran."""
    out: dict[str, list[float]] = {}
    for rec in records:
        for b in rec["stats"]:
            if b != "rdna4_comm":
                out.setdefault(b, []).append(speedup(rec["stats"], b))
    return out


def _cap_text(rec: dict) -> str:
    """", cap N" for a record whose capacity is not its token count, else ""."""
    return f", cap {rec['cap']}" if rec.get("cap", rec["tokens"]) != rec["tokens"] else ""


def summary(records: list[dict]) -> str:
    """The comparison table, what each backend timed, and per baseline the
    geometric-mean and the minimum speedup of rdna4_comm."""
    lines = [comparison_table(records), ""]
    details: dict[str, str] = {}
    for rec in records:
        details.update(rec["details"])
    lines += [f"{b}: {d}" for b, d in details.items()]
    for b, ratios in speedups(records).items():
        geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        worst = min(range(len(ratios)), key=ratios.__getitem__)
        rec = [r for r in records if b in r["stats"]][worst]
        lines.append(f"speedup of rdna4_comm over {b}: geomean {geomean:.2f}x, min {ratios[worst]:.2f}x "
                     f"(tokens {rec['tokens']}{_cap_text(rec)}, hidden {rec['hidden']}), over {len(ratios)} configurations")
    return "\n".join(lines)


def _grid_rows(records: list[dict]) -> list[tuple[int, str]]:
    """The heatmap's rows: (tokens, op), sorted by tokens and then by op in the
    order the ops first appear (bench_ep's decode rows at cap 4096 sit next to
    the cap = tokens ones)."""
    ops = list(dict.fromkeys(r["op"] for r in records))
    return sorted({(r["tokens"], r["op"]) for r in records}, key=lambda k: (k[0], ops.index(k[1])))


def _row_label(tokens: int, op: str, main_op: str) -> str:
    if op == main_op:
        return str(tokens)
    return f"{tokens} {op[len(main_op):].strip() if op.startswith(main_op) else op}"


def save_heatmap(records: list[dict], path: Path, title: str) -> None:
    """A PNG of rdna4_comm's speedup over each baseline on the hidden x tokens
    grid (green: rdna4_comm faster), or a note where matplotlib is missing.
    Records of a second op at the same tokens (e.g. "dispatch+combine (cap
    4096)") get rows of their own, labelled with what sets them apart."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        print(f"note: matplotlib is not installed; no heatmap (pip install matplotlib for {path.name})")
        return
    import numpy as np

    ratios = speedups(records)
    if not ratios:
        return
    hiddens = sorted({r["hidden"] for r in records})
    rows = _grid_rows(records)
    main_op = records[0]["op"]
    spread = max(1.25, *(max(r, 1 / r) for v in ratios.values() for r in v))
    panel_w = max(4.0, 1.8 + 0.9 * len(hiddens))
    fig, axes = plt.subplots(1, len(ratios), figsize=(panel_w * len(ratios), 1.8 + 0.45 * len(rows)), squeeze=False)
    for ax, baseline in zip(axes[0], ratios):
        grid = np.full((len(rows), len(hiddens)), np.nan)
        for rec in records:
            if baseline in rec["stats"]:
                grid[rows.index((rec["tokens"], rec["op"])), hiddens.index(rec["hidden"])] = speedup(rec["stats"], baseline)
        image = ax.imshow(np.ma.masked_invalid(grid), cmap="RdYlGn", norm=LogNorm(1 / spread, spread),
                          aspect="auto", origin="lower")
        for (i, j), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(hiddens)), [str(h) for h in hiddens])
        ax.set_yticks(range(len(rows)), [_row_label(t, op, main_op) for t, op in rows])
        ax.set_xlabel("hidden")
        ax.set_ylabel("tokens per rank")
        ax.set_title(f"vs {baseline}", fontsize=10)
        bar = fig.colorbar(image, ax=ax, label="speedup (baseline p50 / rdna4_comm p50)")
        bar.set_ticks([spread ** (k / 2) for k in range(-2, 3)])  # symmetric about 1 on the log scale
        bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.2g}"))
        bar.ax.yaxis.set_minor_formatter(NullFormatter())
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"heatmap: {path}")
