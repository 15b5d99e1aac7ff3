# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Draws the engine benchmark's results (``benchmark_engine.py --json``):
no-hit throughput vs no cache per model and configuration, and the
cached-TTFT speedup over the spread of prompt lengths. Optionally the core
benchmark's GB/s beside them.

    python benchmarks/vineyard/plot.py ENGINE.json OUT.png [--core CORE.json]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

COLORS = {"no cache": "#9e9e9e", "sync": "#64b5f6", "async": "#1565c0",
          "peer": "#ef6c00"}  # fmt: skip


def plot(engine: dict[str, Any], path: str, core: dict[str, Any] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = engine["models"]
    panels = 3 if core else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4.2))
    width = 0.2

    ax = axes[0]
    for i, cfg in enumerate(COLORS):
        values = [m["throughput"]["ratio_vs_no_cache"][cfg] for m in models]
        xs = [j + (i - 1.5) * width for j in range(len(models))]
        bars = ax.bar(xs, values, width, label=cfg, color=COLORS[cfg])
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(0.97, color="k", ls="--", lw=0.8, label="target (async) 0.97")
    ax.set_xticks(range(len(models)), [m["model"] for m in models])
    ax.set_ylabel("no-hit throughput / no cache")
    top = max(m["throughput"]["ratio_vs_no_cache"][c] for m in models for c in COLORS)
    ax.set_ylim(0, max(1.15, 1.1 * top))
    ax.set_title("No-hit throughput (unique prompts)")
    ax.legend(fontsize=7, loc="lower right")

    ax = axes[1]
    styles = ["-", ":", "--"]
    for m, style in zip(models, styles, strict=False):
        rows = m["ttft"]["rows"]
        xs = [row["tokens"] for row in rows]
        for cfg in ("async", "peer"):
            ax.plot(xs, [row[cfg]["speedup"] for row in rows], style, marker="o",
                    ms=3, color=COLORS[cfg], label=f"{cfg} ({m['model']})")  # fmt: skip
    ax.set_xlabel("prompt tokens (cached on another engine)")
    ax.set_ylabel("TTFT speedup vs recompute")
    ax.set_title("Cached prompts over a spread of lengths")
    ax.legend(fontsize=7)

    if core:
        ax = axes[2]
        s = core["summary"]
        names = ["cache write", "writev", "cache read", "read (MAC)", "readv"]
        keys = ["write_gbps", "writev_gbps", "read_gbps", "read_keyed_gbps",
                "readv_gbps"]  # fmt: skip
        colors = ["#1565c0", "#9e9e9e", "#1565c0", "#64b5f6", "#9e9e9e"]
        bars = ax.bar(names, [s[k] for k in keys], color=colors)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_ylabel("GB/s")
        ax.set_title("Core: 8B-class KV, one core")
        ax.tick_params(axis="x", labelsize=7)

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine_json")
    parser.add_argument("png")
    parser.add_argument("--core", metavar="CORE_JSON")
    args = parser.parse_args()
    with open(args.engine_json) as f:
        engine = json.load(f)
    core = None
    if args.core:
        with open(args.core) as f:
            core = json.load(f)
    plot(engine, args.png, core)


if __name__ == "__main__":
    main()
