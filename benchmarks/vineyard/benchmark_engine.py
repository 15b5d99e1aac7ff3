# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Real vLLM engines (CPU) side by side on the same prompts: no cache, the
vineyard cache with synchronous and with asynchronous updates, and vLLM's
own ``ExampleConnector`` (synchronous safetensors files) as a peer.

For each model (random-weight Llamas written locally, no download):

  (i)  no-hit throughput: unique prompts, so every step saves and nothing
       hits; tokens/s of each configuration and its ratio to no cache
       (best of ``--rounds``, the order of the configurations rotating);
  (ii) TTFT of cached prompts over a spread of lengths that are not chosen
       to fit any chunk (200 to 8000 tokens and a few random ones) on a
       FRESH engine pointed at a cache that an earlier engine filled (the
       median of three such engines per configuration, their order
       alternating), next to recomputing them: per length, each
       configuration's TTFT, speedup,
       tokens loaded and recomputed, and the floor (the loaded bytes read at
       this machine's ``readv`` speed plus the forward pass of a one-block
       prompt); the median and worst over the spread; the lookups' ``stat``
       calls.

Every engine runs in its own process (vLLM reads its environment at import)
through the harness of the engine tests
(``tests/vineyard_engine_testing.py``), one process, eager,
its forward pass on one core (``OMP_NUM_THREADS=1``, the engines pinned to
the first core; the cache's backend processes move to the others). Usage::

    python benchmarks/vineyard/benchmark_engine.py [--tiny] \
        [--models kv-heavy toy] [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# The engine harness and the toy model writer are shared with the tests.
sys.path.insert(0, str(ROOT))

from tests import vineyard_toy_model as toy  # noqa: E402
from tests.vineyard_engine_testing import (  # noqa: E402
    EngineRun,
    engine_env,
    run_engine,
)
from vllm.worker.vineyard.metrics import (  # noqa: E402
    HIT_PHASES,
    histogram_metric_name,
)

TARGET_ASYNC_THROUGHPUT = 0.97  # async no-hit throughput vs no cache
TARGET_VS_FLOOR = 1.2  # cached TTFT at most this times the floor
CONFIGS = ("no cache", "sync", "async", "peer")
TTFT_CONFIGS = ("async", "peer")  # sync loads the same way as async
BLOCK_SIZE = 64  # vLLM's block size (the harness's); the cache's chunk is one
#: Cached prompt lengths: none chosen to fit a block or chunk, some just
#: around one; ``Plan.random_lengths`` more are drawn (seeded).
SPREAD = (200, 300, 1000, 2500, 4095, 4096, 4100, 6000, 8000)
#: ToyLlamaConfig fields. "kv-heavy": 8 layers, multi-head attention (8 KV
#: heads of 128) on a hidden size of 256: much KV for little compute, so the
#: cost of moving KV shows. "toy": the demo's model. "tiny": CI.
MODELS: dict[str, dict[str, Any]] = {
    "kv-heavy": {"num_layers": 8, "hidden_size": 256, "num_heads": 8,
                 "num_kv_heads": 8, "head_dim": 128, "intermediate_size": 512},
    "toy": {},
    "tiny": {"num_layers": 2, "hidden_size": 128, "num_heads": 2,
             "num_kv_heads": 2, "head_dim": 64, "intermediate_size": 256,
             "vocab_size": 4096, "max_position_embeddings": 4096},
}  # fmt: skip


@dataclass(frozen=True)
class Plan:
    models: list[str] = field(default_factory=lambda: ["kv-heavy", "toy"])
    prompts: int = 24  # unique prompts of the throughput round
    prompt_tokens: tuple[int, int] = (1024, 2048)
    max_tokens: int = 4
    rounds: int = 2
    ttft_lengths: tuple[int, ...] = SPREAD
    random_lengths: int = 3  # drawn from [100, max(ttft_lengths)]
    ttft_repeats: int = 3  # fresh engines per configuration; the median hit
    # One step takes a whole TTFT probe: ExampleConnector stores only the
    # first step's KV of a prompt (it has no chunked prefill).
    max_num_batched_tokens: int = 8192
    kvcache_space_gib: int = 2


TINY = Plan(models=["tiny"], prompts=4, prompt_tokens=(256, 512), max_tokens=2,
            rounds=1, ttft_lengths=(100, 200, 255, 300), random_lengths=1,
            ttft_repeats=1,
            max_num_batched_tokens=768, kvcache_space_gib=1)  # fmt: skip


def engines_on_the_first_core() -> None:
    """Every engine started from here on (the harness's fork server and its
    engines inherit this) runs one thread on the first core, like a busy
    server's, with glibc's malloc thresholds fixed; the cache's backends
    move to the other cores. Left dynamic, an engine's allocation history
    decides whether each prefill maps its large activations afresh (and
    zeroes their pages): one engine's prefill moved by up to 1.8x against
    another's (vLLM's CPU guide preloads tcmalloc for the same reason)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(256 << 20))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 30))
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def kv_bytes_per_token(model: str) -> int:
    c = toy.ToyLlamaConfig(**MODELS[model])
    element = 4 if c.dtype == "float32" else 2
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * element


def _prompts(rng: random.Random, n: int, low: int, high: int, vocab: int) -> list:
    return [
        [rng.randrange(3, vocab) for _ in range(rng.randint(low, high))]
        for _ in range(n)
    ]


def ttft_lengths(plan: Plan, seed: int = 0) -> list[int]:
    """The spread of cached prompt lengths, random ones included."""
    rng = random.Random(seed + 1)
    top = max(plan.ttft_lengths)
    extra = [rng.randint(100, top) for _ in range(plan.random_lengths)]
    return sorted([*plan.ttft_lengths, *extra])


@dataclass
class Prompts:
    warmup: list[list[int]]  # the throughput engines' first round
    throughput: list[list[int]]
    cold: list[list[int]]  # a one-block prefill before any TTFT probe
    probes: list[list[int]]  # probe 0 only warms up (and is a hit too)


def make_prompts(plan: Plan, model: str, seed: int = 0) -> Prompts:
    vocab = MODELS[model].get("vocab_size", 32000)
    rng = random.Random(seed)
    low, high = plan.prompt_tokens
    lengths = ttft_lengths(plan, seed)
    return Prompts(
        warmup=_prompts(rng, 2, low, high, vocab),
        throughput=_prompts(rng, plan.prompts, low, high, vocab),
        cold=_prompts(rng, 1, BLOCK_SIZE, BLOCK_SIZE, vocab),
        probes=[_prompts(rng, 1, n, n, vocab)[0] for n in [lengths[0], *lengths]],
    )


def readv_gbps(directory: Path, nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """This machine's ``readv`` speed of a file in the page cache (the
    floor's read rate: what a load cannot beat)."""
    import numpy as np

    path = directory / "readv-probe"
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    into = np.empty(nbytes, np.uint8)
    best = float("inf")
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(repeats + 1):  # the first read warms the page cache
            start = time.perf_counter()
            os.preadv(fd, [into.data], 0)
            best = min(best, time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink()
    return nbytes / best / 1e9


def _one(prompt: list[int], max_tokens: int = 1) -> dict[str, Any]:
    return {"prompts": [prompt], "max_tokens": max_tokens}


def engine(
    plan: Plan,
    model_path: str,
    cfg: str,
    root: Path,
    rounds: list[dict[str, Any]],
    workdir: Path,
    extra_env: dict[str, str] | None = None,
) -> EngineRun:
    """One engine of configuration ``cfg`` (cache root / peer storage
    ``root``) running ``rounds`` in its own process; ``extra_env``: more
    of its environment (e.g. the cache's load policy)."""
    extra = {
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(plan.kvcache_space_gib),
        "VINEYARD_CACHE_METRICS_ENABLED": "1",
        "VINEYARD_CACHE_ENABLE_ASYNC_UPDATE": "0" if cfg == "sync" else "1",
        **(extra_env or {}),
    }
    llm_kwargs: dict[str, Any] = {
        "max_model_len": max(*ttft_lengths(plan), plan.prompt_tokens[1])
        + plan.max_tokens
        + BLOCK_SIZE,
        "max_num_batched_tokens": plan.max_num_batched_tokens,
        "block_size": BLOCK_SIZE,
    }
    if cfg == "peer":
        root.mkdir(parents=True, exist_ok=True)
        llm_kwargs["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(root)},
        }
    env = engine_env(root, use_cache=cfg in ("sync", "async"), extra=extra)
    print(f"  engine {workdir.name} ...", end="", flush=True)
    start = time.perf_counter()
    run = run_engine(
        model_path,
        rounds,
        env,
        workdir,
        llm_kwargs=llm_kwargs,
        settle_s=300.0,
        timeout_s=1800.0,
    )
    print(f" {time.perf_counter() - start:.0f} s", flush=True)
    return run


def cpu_s_per_gb(cpu_us: int, nbytes: int) -> float:
    """A backend's CPU seconds per GB it moved (0 if it moved nothing)."""
    return cpu_us / 1e6 / (nbytes / 1e9) if nbytes else 0.0


#: How the workers split a hit's load (``hit_load_s``).
LOAD_PARTS = ("load_read_s", "load_verify_s", "load_copy_s")


def hit_breakdown(run: EngineRun, index: int, ttft_s: float) -> dict[str, Any]:
    """Where the time of round ``index``'s one hit went (its growth of each
    phase's histogram), next to its measured TTFT: the phases are
    consecutive, so what they leave unaccounted is the front end's work
    before the request's arrival and after its forward pass."""
    phases: dict[str, float] = {}
    counts: dict[str, int] = {}
    for name in (*HIT_PHASES, "load_s", *LOAD_PARTS):
        full = histogram_metric_name(name)
        count, total = run.rounds[index].histogram(full)
        count0, total0 = run.rounds[index - 1].histogram(full)
        phases[name], counts[name] = total - total0, count - count0
    # HIT_PHASES add up; the workers' own time of the load (``load_s``)
    # is a part of ``hit_load_s``, read, verify and copy parts of that; of
    # ``hit_forward_s`` for a load before the forward pass (``sync``).
    accounted = sum(phases[name] for name in HIT_PHASES)
    sync = run.delta(index, "loads_before_forward") > 0
    load_phase = phases["hit_forward_s" if sync else "hit_load_s"]
    return {
        "phases_s": phases,
        "counts": counts,
        "sync": sync,
        "load_other_s": load_phase - sum(phases[p] for p in LOAD_PARTS),
        "accounted_s": accounted,
        "ttft_s": ttft_s,
        "accounted_share": accounted / ttft_s,
    }


def run_model(
    plan: Plan, model: str, model_path: str, work: Path, readv: float
) -> dict[str, Any]:
    p = make_prompts(plan, model)
    tokens = sum(len(x) for x in p.throughput) + plan.max_tokens * len(p.throughput)
    tput_rounds = [
        {"prompts": p.warmup, "max_tokens": plan.max_tokens},
        {"prompts": p.throughput, "max_tokens": plan.max_tokens},
    ]
    probes = [_one(x) for x in p.probes]
    ttft_rounds = [_one(p.cold[0]), *probes]  # recompute, or hits
    roots = {cfg: work / f"{model}-{cfg.replace(' ', '-')}" for cfg in CONFIGS}
    tput: dict[str, list[float]] = {cfg: [] for cfg in CONFIGS}
    outputs: dict[str, list[list[int]]] = {}
    saves: dict[str, dict[str, float]] = {}
    recompute: list[float] = []
    recompute_outputs: list[list[int]] = []
    one_block_s = 0.0
    for r in range(plan.rounds):
        for cfg in CONFIGS[r % 4 :] + CONFIGS[: r % 4]:
            root = roots[cfg] / f"round{r}"
            rounds = list(tput_rounds)
            if r == 0 and cfg == "no cache":
                rounds += ttft_rounds  # recomputes the probes
            run = engine(
                plan,
                model_path,
                cfg,
                root,
                rounds,
                work / f"{root.name}-{roots[cfg].name}",
            )
            tput[cfg].append(tokens / run.rounds[1].wall_s)
            outputs.setdefault(cfg, run.rounds[1].outputs)
            if r == 0 and cfg == "no cache":
                one_block_s = run.rounds[2].wall_s  # warm: after throughput
                recompute = [x.wall_s for x in run.rounds[4:]]
                recompute_outputs = [x.outputs[0] for x in run.rounds[3:]]
            if cfg in ("sync", "async") and r == 0:
                name = "vllm:vineyard_cache_save_caller_seconds"
                count0, total0 = run.rounds[0].histogram(name)
                count1, total1 = run.rounds[1].histogram(name)
                count, total = count1 - count0, total1 - total0
                saves[cfg] = {
                    "saves": count,
                    "save_ms_mean": 1e3 * total / count if count else 0.0,
                    "tokens_written": run.delta(1, "tokens_written"),
                    "updates_skipped": run.delta(1, "updates_skipped"),
                    "writer_cpu_s_per_gb": cpu_s_per_gb(
                        run.delta(1, "writer_cpu_us"), run.delta(1, "bytes_written")
                    ),
                    "throughput_round_settled": run.rounds[1].settled,
                }
    kv_bytes = kv_bytes_per_token(model)
    lengths = [len(x) for x in p.probes[1:]]
    rows: list[dict[str, Any]] = [
        {"tokens": n, "recompute_s": recompute[i]} for i, n in enumerate(lengths)
    ]
    ttft: dict[str, Any] = {}
    for cfg in TTFT_CONFIGS:
        # Both configurations fill their storage before any fresh engine
        # reads it, so both find their files equally warm in the page cache
        # (what a user sees).
        engine(
            plan, model_path, cfg, roots[cfg] / "ttft", probes,
            work / f"{model}-{cfg}-fill",
        )  # fmt: skip
    # One hit is one sample of a noisy machine: each configuration reads
    # every length on ``ttft_repeats`` fresh engines, in alternating order,
    # and a row is the median hit.
    runs: dict[str, list[EngineRun]] = {cfg: [] for cfg in TTFT_CONFIGS}
    for r in range(plan.ttft_repeats):
        for cfg in TTFT_CONFIGS[:: 1 if r % 2 == 0 else -1]:
            runs[cfg].append(
                engine(
                    plan,
                    model_path,
                    cfg,
                    roots[cfg] / "ttft",
                    ttft_rounds,
                    work / f"{model}-{cfg}-fresh{r}",
                )
            )
    for cfg in TTFT_CONFIGS:
        for i, row in enumerate(rows):
            # After the cold prefill and the warm-up probe: the median hit.
            samples = sorted(
                ((run.rounds[i + 2], run) for run in runs[cfg]),
                key=lambda sample: sample[0].wall_s,
            )
            hit, run = samples[len(samples) // 2]
            loaded = hit.num_cached_tokens[0]
            floor_s = one_block_s + loaded * kv_bytes / (readv * 1e9)
            row[cfg] = {
                "cached_s": hit.wall_s,
                "cached_s_samples": [x.wall_s for x, _ in samples],
                "speedup": row["recompute_s"] / hit.wall_s,
                "loaded": loaded,
                "recomputed": row["tokens"] - loaded,
                "floor_s": floor_s,
                "vs_floor": hit.wall_s / floor_s,
            }
            if cfg != "peer":
                row[cfg]["breakdown"] = hit_breakdown(run, i + 2, hit.wall_s)
        speedups = [row[cfg]["speedup"] for row in rows]
        run = runs[cfg][0]
        ttft[cfg] = {
            "median_speedup": statistics.median(speedups),
            "worst_speedup": min(speedups),
            "worst_vs_floor": max(row[cfg]["vs_floor"] for row in rows),
            "most_recomputed": max(row[cfg]["recomputed"] for row in rows),
            "outputs_match_recompute": all(
                [x.outputs[0] for x in each.rounds[1:]] == recompute_outputs
                for each in runs[cfg]
            ),
        }
        if cfg != "peer":
            lookups = len(ttft_rounds)
            ttft[cfg]["loaded_tokens"] = run.last.counter("loaded_tokens")
            ttft[cfg]["lookup_stats"] = run.last.counter("lookup_stats")
            ttft[cfg]["lookup_stats_per_request"] = (
                run.last.counter("lookup_stats") / lookups
            )
            ttft[cfg]["reader_cpu_s_per_gb"] = cpu_s_per_gb(
                run.last.counter("reader_cpu_us"), run.last.counter("bytes_read")
            )
    ttft["async"]["at_least_peer_everywhere"] = all(
        row["async"]["speedup"] >= row["peer"]["speedup"] for row in rows
    )
    best = {cfg: max(v) for cfg, v in tput.items()}
    return {
        "model": model,
        "model_config": MODELS[model],
        "kv_bytes_per_token": kv_bytes,
        "throughput": {
            "tokens": tokens,
            "tokens_per_s": tput,
            "best_tokens_per_s": best,
            "ratio_vs_no_cache": {c: best[c] / best["no cache"] for c in CONFIGS},
            "outputs_identical": all(
                o == outputs["no cache"] for o in outputs.values()
            ),
            "saves": saves,
        },
        "ttft": {
            "block_size": BLOCK_SIZE,
            "repeats": plan.ttft_repeats,
            "one_block_forward_s": one_block_s,
            "readv_gbps": readv,
            "rows": rows,
            "configs": ttft,
        },
    }


def print_model(res: dict[str, Any]) -> None:
    t, f = res["throughput"], res["ttft"]
    print(
        f"\n{res['model']}: {res['model_config'] or 'default toy'}, "
        f"{res['kv_bytes_per_token'] // 1024} KiB of KV per token"
    )
    print(f"no-hit throughput ({t['tokens']} tokens; best of "
          f"{len(t['tokens_per_s']['no cache'])}; outputs identical: "
          f"{t['outputs_identical']})")  # fmt: skip
    print(f"  {'config':10} {'tok/s':>9} {'vs no cache':>12} {'save ms':>8} "
          f"{'writer CPU s/GB':>16}")  # fmt: skip
    for cfg in CONFIGS:
        saves = t["saves"].get(cfg)
        extra = ""
        if saves is not None:
            extra = (f"{saves['save_ms_mean']:8.2f} "
                     f"{saves['writer_cpu_s_per_gb']:16.2f}")  # fmt: skip
        print(f"  {cfg:10} {t['best_tokens_per_s'][cfg]:9.0f} "
              f"{t['ratio_vs_no_cache'][cfg]:11.3f}x {extra}")  # fmt: skip
    print(f"TTFT of cached prompts on a fresh engine, the median of "
          f"{f.get('repeats', 1)} (block {f['block_size']}; "
          f"floor: loaded bytes at readv {f['readv_gbps']:.1f} GB/s + a "
          f"one-block forward of {f['one_block_forward_s'] * 1e3:.0f} ms)")  # fmt: skip
    head = "".join(f" | {c + ' ms':>10} {'x':>5} {'loaded':>6} {'recomp':>6} "
                   f"{'floor':>6} {'/fl':>4}" for c in TTFT_CONFIGS)  # fmt: skip
    print(f"  {'tokens':>6} {'recomp ms':>9}{head}")
    for row in f["rows"]:
        line = f"  {row['tokens']:6d} {row['recompute_s'] * 1e3:9.0f}"
        for cfg in TTFT_CONFIGS:
            c = row[cfg]
            line += (f" | {c['cached_s'] * 1e3:10.1f} {c['speedup']:5.1f} "
                     f"{c['loaded']:6d} {c['recomputed']:6d} "
                     f"{c['floor_s'] * 1e3:6.1f} {c['vs_floor']:4.2f}")  # fmt: skip
        print(line)
    for cfg, c in f["configs"].items():
        extra = ""
        if "lookup_stats" in c:
            extra = (f", {c['lookup_stats_per_request']:.1f} stats per lookup, "
                     f"reader CPU {c['reader_cpu_s_per_gb']:.2f} s/GB")  # fmt: skip
        print(f"  {cfg}: speedup median {c['median_speedup']:.1f}x, worst "
              f"{c['worst_speedup']:.1f}x; worst vs floor "
              f"{c['worst_vs_floor']:.2f}; most recomputed "
              f"{c['most_recomputed']}; outputs "
              f"{'match' if c['outputs_match_recompute'] else 'DIFFER'}"
              f"{extra}")  # fmt: skip
    print("where a hit's time goes (async, ms; load = read + verify + copy + "
          "other, where a negative other is the copies' overlap with the next "
          "segment's read; *: loaded before its forward pass, so forward = "
          "read + verify + copy + other; rest: the front end's)")  # fmt: skip
    names = ("queue", "lookup", "to load", "load", "read", "verify", "copy",
             "other", "promote", "forward", "TTFT", "rest")  # fmt: skip
    print(f"  {'tokens':>6} " + " ".join(f"{n:>7}" for n in names))
    for row in f["rows"]:
        b = row["async"]["breakdown"]
        ph = b["phases_s"]
        values = [ph[p] for p in HIT_PHASES[:4]] + [ph[p] for p in LOAD_PARTS]
        values += [b["load_other_s"], ph["hit_promotion_s"], ph["hit_forward_s"]]
        values += [b["ttft_s"], b["ttft_s"] - b["accounted_s"]]
        mark = "*" if b["sync"] else " "
        cells = " ".join(f"{v * 1e3:7.1f}" for v in values)
        print(f"  {row['tokens']:5d}{mark} {cells}")
    a = f["configs"]["async"]
    print("targets: "
          f"recompute <= block + 1: {a['most_recomputed'] <= f['block_size'] + 1}; "
          f"speedup >= peer at every length: {a['at_least_peer_everywhere']}; "
          f"within {TARGET_VS_FLOOR}x of the floor: "
          f"{a['worst_vs_floor'] <= TARGET_VS_FLOOR}; async throughput >= "
          f"{TARGET_ASYNC_THROUGHPUT}: "
          f"{t['ratio_vs_no_cache']['async'] >= TARGET_ASYNC_THROUGHPUT}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes (CI)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS))
    parser.add_argument("--rounds", type=int, help="throughput rounds per config")
    parser.add_argument("--prompts", type=int, help="prompts per throughput round")
    parser.add_argument(
        "--lengths", type=int, nargs="+", help="cached prompt lengths (the spread)"
    )
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    parser.add_argument("--plot", metavar="PNG", help="draw the results here")
    parser.add_argument("--workdir", help="engines' logs and roots (default: temp)")
    parser.add_argument(
        "--model-dir",
        default=os.path.expanduser("~/.cache/vineyard-llm-cache-bench"),
        help="where the random-weight checkpoints are written (and reused)",
    )
    args = parser.parse_args(argv)
    plan = TINY if args.tiny else Plan()
    if args.models:
        plan = replace(plan, models=args.models)
    for name in ("rounds", "prompts"):
        if getattr(args, name):
            plan = replace(plan, **{name: getattr(args, name)})
    if args.lengths:
        plan = replace(plan, ttft_lengths=tuple(args.lengths))
    engines_on_the_first_core()
    start = time.perf_counter()
    results = []
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        readv = readv_gbps(Path(tmp))
        for model in plan.models:
            print(f"{model}:", flush=True)
            path = toy.make_toy_llama(
                os.path.join(args.model_dir, model), toy.ToyLlamaConfig(**MODELS[model])
            )
            results.append(run_model(plan, model, path, Path(tmp) / model, readv))
    result = {
        "plan": asdict(plan),
        "machine": {"cpus": os.cpu_count()},
        "models": results,
        "elapsed_s": time.perf_counter() - start,
    }
    for res in results:
        print_model(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        sys.path.insert(0, str(Path(__file__).parent))
        importlib.import_module("plot").plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
