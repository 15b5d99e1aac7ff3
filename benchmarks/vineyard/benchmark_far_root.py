# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Cached TTFT behind a thin link: real vLLM engines (CPU) on a cache root
whose reads all cross one link of 16, 64 or 256 MB/s, or run at full speed
(a FUSE mount, ``slow_fs.py``, its daemon on a core of its own), side by
side in one run:

- no cache (computing every prompt);
- this cache with its default load policy (``auto``: load a hit only when
  loading is expected to finish sooner than computing it);
- this cache loading every hit (``always``: the previous behaviour);
- vLLM's ``ExampleConnector`` with its storage on the same capped mount.

No cache runs once before the bandwidths and once beside each: its TTFT at a
length is the median of those engines (one engine's prefill can be 10% off
another's, which would move every ratio of a run).

For each model (random-weight Llamas written locally) and bandwidth, each
configuration runs a FRESH engine over a root that an earlier engine filled
at full speed, and asks the prompts of a spread of lengths one at a time
(``max_tokens=1``: the round's wall time is the TTFT). A fresh engine of
this cache starts from the prices its predecessor on the host remembered
(whatever bandwidth that one saw). Printed per model, bandwidth and length:
each configuration's TTFT and its ratio to no cache (target <= 1.1x for
this cache at every bandwidth and length), and whether every answer equals
no cache's; per bandwidth, the MiB each engine of this cache read from the
root (where ``auto`` computes every hit, its link probes'). Usage::

    python benchmarks/vineyard/benchmark_far_root.py [--tiny] \\
        [--models kv-heavy toy] [--mbps 16 64 256 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "vineyard"))

from benchmark_engine import (  # noqa: E402
    MODELS,
    Plan,
    engine,
    engines_on_the_first_core,
    hit_breakdown,
)
from slow_fs import SlowFs, other_cores  # noqa: E402

from tests import vineyard_toy_model as toy  # noqa: E402

TARGET = 1.1  # cached TTFT at most this times no cache's, at any bandwidth
#: Configuration -> (the benchmark's engine configuration, its environment).
CONFIGS: dict[str, tuple[str, dict[str, str]]] = {
    "no cache": ("no cache", {}),
    "auto": ("async", {"VINEYARD_CACHE_LOAD_POLICY": "auto"}),
    "always": ("async", {"VINEYARD_CACHE_LOAD_POLICY": "always"}),
    "peer": ("peer", {}),
}


@dataclass(frozen=True)
class FarPlan:
    models: list[str] = field(default_factory=lambda: ["kv-heavy", "toy"])
    mbps: tuple[float, ...] = (16.0, 64.0, 256.0, 0.0)  # 0: full speed
    lengths: tuple[int, ...] = (500, 1000, 2000, 4096)
    random_lengths: int = 1


TINY = FarPlan(models=["tiny"], mbps=(1.0, 0.0), lengths=(200, 500), random_lengths=0)


def prompt_lengths(plan: FarPlan) -> list[int]:
    rng = random.Random(7)
    extra = [rng.randint(300, max(plan.lengths)) for _ in range(plan.random_lengths)]
    return sorted([*plan.lengths, *extra])


def run_model(
    plan: FarPlan, engine_plan: Plan, model: str, path: str, work: Path
) -> dict[str, Any]:
    vocab = MODELS[model].get("vocab_size", 32000)
    rng = random.Random(11)
    lengths = prompt_lengths(plan)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    warm = [rng.randrange(3, vocab) for _ in range(64)]
    rounds = [{"prompts": [warm], "max_tokens": 1}] + [
        {"prompts": [p], "max_tokens": 1} for p in prompts
    ]
    # The daemon, every thread of it, off the engines' core.
    fs = SlowFs(work / f"{model}-fs", direct_io=True, cores=other_cores())
    rows: list[dict[str, Any]] = []
    try:
        # Both policies of this cache read the same root.
        roots = {"no cache": fs.mount / "none", "peer": fs.mount / "peer"}
        roots["auto"] = roots["always"] = fs.mount / "cache"
        # Fill at full speed: the storage of both caches.
        for cfg in ("always", "peer"):
            kind, env = CONFIGS[cfg]
            engine(engine_plan, path, kind, roots[cfg], rounds,
                   work / f"{model}-{cfg}-fill", env)  # fmt: skip
        no_cache = [engine(engine_plan, path, "no cache", roots["no cache"], rounds,
                           work / f"{model}-no-cache")]  # fmt: skip
        runs_at: dict[float, dict[str, Any]] = {}
        link_mib: dict[float, dict[str, float]] = {}  # read by each engine
        for mbps in plan.mbps:
            fs.set(read_mbps=mbps)
            runs = runs_at[mbps] = {}
            link_mib[mbps] = {}
            for cfg in CONFIGS:
                kind, env = CONFIGS[cfg]
                before = fs.link_bytes()
                runs[cfg] = engine(engine_plan, path, kind, roots[cfg], rounds,
                                   work / f"{model}-{cfg}-{mbps:g}", env)  # fmt: skip
                link_mib[mbps][cfg] = (fs.link_bytes() - before) / (1 << 20)
            no_cache.append(runs.pop("no cache"))
        for mbps, runs in runs_at.items():
            for i, n in enumerate(lengths):
                row: dict[str, Any] = {"mbps": mbps, "tokens": n}
                ttfts = [run.rounds[i + 1].wall_s for run in no_cache]
                base = no_cache[0].rounds[i + 1]
                row["no cache"] = {
                    "ttft_s": statistics.median(ttfts),
                    "ttft_range_s": [min(ttfts), max(ttfts)],
                    "vs_no_cache": 1.0,
                    "same_answer": all(
                        run.rounds[i + 1].outputs == base.outputs for run in no_cache
                    ),
                }
                for cfg, run in runs.items():
                    r = run.rounds[i + 1]
                    row[cfg] = {
                        "ttft_s": r.wall_s,
                        "vs_no_cache": r.wall_s / row["no cache"]["ttft_s"],
                        "cached_tokens": r.num_cached_tokens[0],
                        "same_answer": r.outputs == base.outputs,
                    }
                    if cfg in ("auto", "always"):
                        row[cfg]["breakdown"] = hit_breakdown(run, i + 1, r.wall_s)
                rows.append(row)
            auto = runs["auto"].last
            print(f"    {mbps:g} MB/s: auto computed "
                  f"{auto.counter('tokens_not_loaded_slow')} tokens for speed, "
                  f"stopped {auto.counter('loads_stopped_slow')} load(s), read "
                  f"{link_mib[mbps]['auto']:.1f} MiB (always: "
                  f"{link_mib[mbps]['always']:.1f} MiB)", flush=True)  # fmt: skip
    finally:
        fs.close()
    worst = max(row["auto"]["vs_no_cache"] for row in rows)
    return {
        "model": model,
        "kv_bytes_per_token": toy_kv_bytes(model),
        "rows": rows,
        # MiB each engine read from the root, per bandwidth and configuration.
        "link_mib": {f"{mbps:g}": mib for mbps, mib in link_mib.items()},
        "auto_worst_vs_no_cache": worst,
        "auto_meets_target": worst <= TARGET,
        "answers_identical": all(
            row[c]["same_answer"] for row in rows for c in CONFIGS
        ),
    }


def toy_kv_bytes(model: str) -> int:
    c = toy.ToyLlamaConfig(**MODELS[model])
    element = 4 if c.dtype == "float32" else 2
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * element


def print_model(res: dict[str, Any]) -> None:
    print(f"\n{res['model']}: {res['kv_bytes_per_token'] // 1024} KiB of KV per "
          f"token; answers identical: {res['answers_identical']}")  # fmt: skip
    print(
        f"  {'link':>8} {'tokens':>6} {'no cache':>9} "
        + " ".join(f"{c:>16}" for c in ("auto", "always", "peer"))
    )
    for row in res["rows"]:
        link = "full" if not row["mbps"] else f"{row['mbps']:g} MB/s"
        cells = " ".join(
            f"{1e3 * row[c]['ttft_s']:7.0f} ms {row[c]['vs_no_cache']:5.2f}x"
            for c in ("auto", "always", "peer")
        )
        print(f"  {link:>8} {row['tokens']:>6} "
              f"{1e3 * row['no cache']['ttft_s']:6.0f} ms {cells}")  # fmt: skip
    print(
        f"  auto: worst {res['auto_worst_vs_no_cache']:.2f}x of no cache "
        f"(target <= {TARGET}x): {'met' if res['auto_meets_target'] else 'NOT met'}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes (CI)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS))
    parser.add_argument("--mbps", type=float, nargs="+", help="links (0: full)")
    parser.add_argument("--lengths", type=int, nargs="+")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--workdir", help="engines' logs and roots (default: temp)")
    parser.add_argument(
        "--model-dir",
        default=os.path.expanduser("~/.cache/vineyard-llm-cache-bench"),
    )
    args = parser.parse_args(argv)
    plan = TINY if args.tiny else FarPlan()
    if args.models:
        plan = replace(plan, models=args.models)
    if args.mbps:
        plan = replace(plan, mbps=tuple(args.mbps))
    if args.lengths:
        plan = replace(plan, lengths=tuple(args.lengths), random_lengths=0)
    # One step takes a whole prompt (ExampleConnector stores only the first
    # step's KV); the engines' length fits the longest prompt.
    lengths = prompt_lengths(plan)
    engine_plan = replace(
        Plan(),
        ttft_lengths=tuple(lengths),
        random_lengths=0,
        prompt_tokens=(64, 64),
        max_tokens=1,
        max_num_batched_tokens=max(lengths) + 64,
    )
    # The link's daemon runs on the other cores, with the backends.
    engines_on_the_first_core()
    results = []
    start = time.perf_counter()
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for model in plan.models:
            print(f"{model}:", flush=True)
            path = toy.make_toy_llama(
                os.path.join(args.model_dir, model), toy.ToyLlamaConfig(**MODELS[model])
            )
            res = run_model(plan, engine_plan, model, path, Path(tmp))
            print_model(res)
            results.append(res)
    print(f"\n{time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plan": plan.__dict__, "models": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
