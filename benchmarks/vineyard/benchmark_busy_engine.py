# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Hits queued behind long prompts on a busy engine, with and without
read-ahead: real vLLM engines (CPU) on a cache root whose reads all cross
one link of 16 or 64 MB/s, or run at full speed (a FUSE mount,
``slow_fs.py``, its daemon off the engines' core), side by side in one run.

One batch per engine: two long prompts new to the root first (they take
every step's token budget for several steps), then four prompts of a spread
of lengths that an earlier engine saved (their hits wait behind the long
ones; their answers are compared with no cache's). Per
model and link, each configuration runs a FRESH engine:

- no cache;
- this cache without read-ahead (``VINEYARD_CACHE_READ_AHEAD_BUFFERS=0``);
- this cache with the default read-ahead (4 buffers of a quarter step) and
  with 16.

Printed per row: the batch's time to its last first token and its ratio
to no cache, the hits' loaded tokens, the tokens read ahead, loads stopped for
slowness, and the hits' mean load time after scheduling (the load sent to
the workers until they report it finished) in engine steps (a step: no
cache's batch time over its number of steps; target: at most one). Usage::

    python benchmarks/vineyard/benchmark_busy_engine.py [--tiny] \\
        [--models kv-heavy toy] [--mbps 16 64 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "vineyard"))

from benchmark_engine import MODELS, Plan, engine, engines_on_the_first_core  # noqa: E402
from slow_fs import SlowFs, other_cores  # noqa: E402

from tests import vineyard_toy_model as toy  # noqa: E402
from vllm.worker.vineyard.metrics import histogram_metric_name  # noqa: E402

STEP_TOKENS = 512  # max_num_batched_tokens: the long prompts take many steps
#: Configuration -> (the benchmark's engine configuration, its environment).
AUTO = {"VINEYARD_CACHE_LOAD_POLICY": "auto"}  # the default (tests load all)
CONFIGS: dict[str, tuple[str, dict[str, str]]] = {
    "no cache": ("no cache", {}),
    "no read-ahead": ("async", {**AUTO, "VINEYARD_CACHE_READ_AHEAD_BUFFERS": "0"}),
    "read-ahead 4": ("async", AUTO),
    "read-ahead 16": ("async", {**AUTO, "VINEYARD_CACHE_READ_AHEAD_BUFFERS": "16"}),
}
CACHED = [c for c in CONFIGS if c != "no cache"]


@dataclass(frozen=True)
class BusyPlan:
    models: list[str] = field(default_factory=lambda: ["kv-heavy", "toy"])
    mbps: tuple[float, ...] = (16.0, 64.0, 0.0)  # 0: full speed
    long_tokens: int = 2048  # each of the two long prompts
    hit_lengths: tuple[int, ...] = (500, 900, 1400, 2000)


TINY = BusyPlan(models=["tiny"], mbps=(4.0, 0.0), long_tokens=1024,
                hit_lengths=(300, 600))  # fmt: skip


def hits_load_steps(run: Any, step_s: float) -> float:
    """The busy round's hits' mean load time after scheduling, in steps."""
    name = histogram_metric_name("hit_load_s")
    count, total = run.rounds[-1].histogram(name)
    count0, total0 = run.rounds[-2].histogram(name)
    return (total - total0) / max(1, count - count0) / step_s


def run_model(plan: BusyPlan, model: str, path: str, work: Path) -> dict[str, Any]:
    vocab = MODELS[model].get("vocab_size", 32000)
    rng = random.Random(5)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    hits = [fresh(n) for n in plan.hit_lengths]
    warm = {"prompts": [fresh(64)], "max_tokens": 1}

    def busy() -> dict[str, Any]:
        """Long prompts new to the root (no engine saved them) first."""
        longs = [fresh(plan.long_tokens) for _ in range(2)]
        return {"prompts": longs + hits, "max_tokens": 1}

    engine_plan = replace(
        Plan(),
        ttft_lengths=(plan.long_tokens,),
        random_lengths=0,
        prompt_tokens=(64, 64),
        max_tokens=1,
        max_num_batched_tokens=STEP_TOKENS,
    )
    # The daemon, every thread of it, off the engines' core.
    fs = SlowFs(work / f"{model}-fs", direct_io=True, cores=other_cores())
    rows: list[dict[str, Any]] = []
    try:
        root = fs.mount / "cache"
        engine(engine_plan, path, "async", root, [{"prompts": hits, "max_tokens": 1}],
               work / f"{model}-fill")  # fmt: skip
        no_cache = engine(engine_plan, path, "no cache", fs.mount / "none",
                          [warm, busy()], work / f"{model}-no-cache")  # fmt: skip
        base = no_cache.last
        # A step: no cache's batch time over its steps (all prefill).
        tokens = 2 * plan.long_tokens + sum(plan.hit_lengths)
        step_s = base.wall_s / -(-tokens // STEP_TOKENS)
        for mbps in plan.mbps:
            fs.set(read_mbps=mbps)
            for cfg in CACHED:
                kind, env = CONFIGS[cfg]
                run = engine(engine_plan, path, kind, root, [warm, busy()],
                             work / f"{model}-{cfg}-{mbps:g}", env)  # fmt: skip
                r = run.last
                rows.append({
                    "mbps": mbps,
                    "config": cfg,
                    "wall_s": r.wall_s,
                    "vs_no_cache": r.wall_s / base.wall_s,
                    "loaded_tokens": run.delta(1, "loaded_tokens"),
                    "read_ahead_tokens": run.delta(1, "read_ahead_tokens"),
                    "loads_stopped_slow": run.delta(1, "loads_stopped_slow"),
                    "load_steps": hits_load_steps(run, step_s),
                    "same_answer": r.outputs[2:] == base.outputs[2:],
                })  # fmt: skip
    finally:
        fs.close()
    return {
        "model": model,
        "no_cache_wall_s": base.wall_s,
        "step_s": step_s,
        "rows": rows,
        "answers_identical": all(row["same_answer"] for row in rows),
    }


def print_model(res: dict[str, Any]) -> None:
    print(f"\n{res['model']}: no cache {1e3 * res['no_cache_wall_s']:.0f} ms "
          f"(a step {1e3 * res['step_s']:.0f} ms); "
          f"answers identical: {res['answers_identical']}")  # fmt: skip
    print(f"  {'link':>8} {'config':>14} {'batch':>9} {'vs none':>7} "
          f"{'loaded':>7} {'ahead':>6} {'stopped':>7} {'load/step':>9}")  # fmt: skip
    for row in res["rows"]:
        link = "full" if not row["mbps"] else f"{row['mbps']:g} MB/s"
        steps = row["load_steps"]  # the hits' mean load after scheduling
        print(f"  {link:>8} {row['config']:>14} {1e3 * row['wall_s']:6.0f} ms "
              f"{row['vs_no_cache']:6.2f}x {row['loaded_tokens']:7d} "
              f"{row['read_ahead_tokens']:6d} {row['loads_stopped_slow']:7d} "
              f"{steps:9.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes (CI)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS))
    parser.add_argument("--mbps", type=float, nargs="+", help="links (0: full)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--workdir", help="engines' logs and roots (default: temp)")
    parser.add_argument(
        "--model-dir",
        default=os.path.expanduser("~/.cache/vineyard-llm-cache-bench"),
    )
    args = parser.parse_args(argv)
    plan = TINY if args.tiny else BusyPlan()
    if args.models:
        plan = replace(plan, models=args.models)
    if args.mbps:
        plan = replace(plan, mbps=tuple(args.mbps))
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
            res = run_model(plan, model, path, Path(tmp))
            print_model(res)
            results.append(res)
    print(f"\n{time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plan": plan.__dict__, "models": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
