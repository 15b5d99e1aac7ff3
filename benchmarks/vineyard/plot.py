# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Draws the engine benchmark's results (``benchmark_engine.py --json``):
no-hit throughput vs no cache per model and configuration, and the
cached-TTFT speedup over the spread of prompt lengths. Optionally the core
benchmark's GB/s beside them (``benchmark_core.py --json``).

The docs' plot is drawn from ``plot_data.json`` beside this script: the few
numbers of those two runs that the plot shows (:func:`plot_data`), so the
raw benchmark output stays out of the tree::

    # the docs' plot, from plot_data.json
    python benchmarks/vineyard/plot.py \\
        docs/source/assets/vineyard_llm_cache_benchmark.png
    # new runs: draw them, and keep their numbers for the docs
    python benchmarks/vineyard/plot.py OUT.png --engine ENGINE.json \\
        [--core CORE.json] [--save-data benchmarks/vineyard/plot_data.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

COLORS = {"no cache": "#9e9e9e", "sync": "#64b5f6", "async": "#1565c0",
          "peer": "#ef6c00"}  # fmt: skip
#: The core benchmark's figures the plot shows: label, summary key, color.
CORE_BARS = (
    ("cache write", "write_gbps", "#1565c0"),
    ("writev", "writev_gbps", "#9e9e9e"),
    ("cache read", "read_gbps", "#1565c0"),
    ("read (MAC)", "read_keyed_gbps", "#64b5f6"),
    ("readv", "readv_gbps", "#9e9e9e"),
)
#: The numbers of the docs' plot.
DATA_PATH = Path(__file__).resolve().parent / "plot_data.json"


def plot_data(
    engine: dict[str, Any],
    core: dict[str, Any] | None = None,
    source: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What :func:`plot` reads of the benchmarks' JSON, and nothing else:
    per model its throughput ratios and each cached prompt's speedups, and
    the core's GB/s. :func:`plot` draws the result as it draws the full
    JSON; ``source`` says which runs the numbers come from."""
    models = [
        {
            "model": m["model"],
            "throughput": {
                "ratio_vs_no_cache": {
                    cfg: m["throughput"]["ratio_vs_no_cache"][cfg] for cfg in COLORS
                }
            },
            "ttft": {
                "rows": [
                    {"tokens": row["tokens"]}
                    | {
                        cfg: {"speedup": row[cfg]["speedup"]}
                        for cfg in ("async", "peer")
                    }
                    for row in m["ttft"]["rows"]
                ]
            },
        }
        for m in engine["models"]
    ]
    data: dict[str, Any] = {"source": source or {}, "engine": {"models": models}}
    if core:
        summary = core["summary"]
        data["core"] = {"summary": {k: summary[k] for _, k, _ in CORE_BARS}}
    return data


def load_plot_data(path: Path = DATA_PATH) -> dict[str, Any]:
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


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
        bars = ax.bar(
            [name for name, _, _ in CORE_BARS],
            [s[key] for _, key, _ in CORE_BARS],
            color=[color for _, _, color in CORE_BARS],
        )
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_ylabel("GB/s")
        ax.set_title("Core: 8B-class KV, one core")
        ax.tick_params(axis="x", labelsize=7)

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("png", help="where to draw the plot")
    parser.add_argument(
        "--engine",
        metavar="ENGINE_JSON",
        help="benchmark_engine.py --json output (default: the docs' numbers, "
        f"{DATA_PATH.name})",
    )
    parser.add_argument(
        "--core", metavar="CORE_JSON", help="benchmark_core.py --json output"
    )
    parser.add_argument(
        "--save-data",
        metavar="PATH",
        help=f"also write the numbers the plot shows here (as {DATA_PATH.name})",
    )
    args = parser.parse_args()
    if args.engine is None:
        if args.core or args.save_data:
            parser.error("--core and --save-data need --engine")
        data = load_plot_data()
        plot(data["engine"], args.png, data.get("core"))
        return
    with open(args.engine) as f:
        engine = json.load(f)
    core = None
    if args.core:
        with open(args.core) as f:
            core = json.load(f)
    plot(engine, args.png, core)
    if args.save_data:
        source = {"engine": args.engine, "core": args.core}
        with open(args.save_data, "w") as f:
            json.dump(plot_data(engine, core, source), f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
