# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The several-instance scenario of ``benchmark_serve.py --scenario chats``:
``N`` ``vllm serve`` instances on one cache root, users chatting about a
long document of their own through the OpenAI API (streamed completions),
each round's whole history sent again, rounds routed round-robin so that
every later round lands on an instance that did not compute the round
before, users concurrent, each next round sent as soon as the previous
answer is in (as agents do) or after a think time.

Configurations, side by side in every run (a fresh root each run):

- ``no cache``; ``vineyard`` (this cache on a local root); with ``--peer``
  vLLM's ``ExampleConnector`` on one folder both instances share;
- with ``--root-latency-ms L [L ...]``: ``vineyard, root L ms away`` per
  value, the shared root on a FUSE mount (``slow_fs.py``) adding L ms to
  every ``stat`` and ``open`` and to every ``fsync`` and first ``read`` of a
  file, plus ``vineyard, root 0 ms away``: the same mount adding nothing
  (the FUSE daemon's own cost). One mount per configuration and run, its
  daemon moved off the instances' cores where a core is free, else given a
  kernel client's priority (nice -10, where this process may; the header
  says where and how it ran);
- with ``--glusterfs``: ``vineyard, GlusterFS``, each instance on its own
  client mount of one GlusterFS replica-2 volume (two bricks on this host;
  ``tests/worker/vineyard_glusterfs_testing.py``) as its root, with a POD_NAME
  of its own; the header gives the volume's measured round trip per ``stat``
  and ``open``. Skipped, with the reason, where GlusterFS cannot be set up
  (Debian's glusterfs-server and glusterfs-client, root, ``/dev/fuse``).

Per configuration and run: the mean TTFT of first and later rounds, later
rounds' ratio to no cache's, the share of the tokens the previous round
computed (its prompt and answer, on the other instance) that the next round
found cached (``previous_round_hit_share``, from vLLM's
``prompt_tokens_details.cached_tokens``: local and external hits), whether
every answer equals no cache's for the same (user, round) (greedy runs), and
for this cache: updates submitted and skipped, the skipped share (skipped /
(submitted + skipped)), backend restarts, cached tokens computed instead of
loaded for slowness and loads stopped for slowness
(``tokens_not_loaded_slow``, ``loads_stopped_slow``), and where a hit's
time went: the mean of each ``hit_*`` phase over every request with a hit
(the cache's instances run with ``VINEYARD_CACHE_METRICS_ENABLED=1``).
Usage::

    python benchmarks/vineyard/serve_chats.py [--quick] [--json out.json]
        [--runs N] [--think-s S] [--peer] [--root-latency-ms 1 5]
        [--glusterfs]

(the same as ``benchmark_serve.py --scenario chats``). ``--quick`` runs a
small plan (2 users, 3 rounds, one run) with whichever rows are asked, e.g.
``--quick --root-latency-ms 1`` for the FUSE rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository (tests.*)
sys.path.insert(0, str(HERE))  # the harness
from serve_harness import (  # noqa: E402
    Server,
    add_run_arguments,
    counter,
    histogram_means,
    pin_off,
    run_folder,
    setup,
    write_result,
)
from serve_roots import (  # noqa: E402
    Config,
    SharedVolume,
    as_is,
    describe_roots,
    far_root,
    glusterfs_roots,
    shared_volume,
)
from slow_fs import fuse_unavailable  # noqa: E402

from vllm.worker.vineyard.metrics import HIT_PHASES, histogram_metric_name  # noqa: E402

#: Common words: random text of about one token per word.
_COMMON = """
the of and to in is was for on that with as by at from it his an were are
which this be has had one their not but they all its also after new first
two been other more time year who would most some city into only over world
part later when up such can state people three many under where school may
these between during than them then both since she use well while high work
known each film made before used because team water house music early game
south north home area life any place war book long around much best same
left way four five off end line
"""
WORDS = tuple(_COMMON.split())
#: The cache's counters recorded per configuration
#: (``vllm:vineyard_cache_<name>_total``, summed over the instances).
CACHE_METRICS = (
    "updates_submitted",
    "updates_skipped",
    "backend_restarts",
    "tokens_not_loaded_slow",
    "loads_stopped_slow",
)
GLUSTERFS = "vineyard, GlusterFS"


@dataclass(frozen=True)
class ChatPlan:
    instances: int = 2
    users: int = 6
    rounds: int = 4
    document_words: int = 900
    question_words: int = 24
    answer_tokens: int = 32
    think_s: float = 0.0  # back to back, as agents do
    runs: int = 3
    peer: bool = False  # also vLLM's ExampleConnector on one shared folder
    #: Per value a FUSE root that far away (ms per stat, open, fsync and
    #: first read), and then one 0 ms away too.
    root_latency_ms: tuple[float, ...] = ()
    glusterfs: bool = False  # also a root on a GlusterFS volume


QUICK_CHATS = ChatPlan(users=2, rounds=3, document_words=300, runs=1)


@dataclass
class Turn:
    user: int
    round: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    answer: str = ""


def far_name(latency_ms: float) -> str:
    return f"vineyard, root {latency_ms:g} ms away"


def far_latencies(plan: ChatPlan) -> list[float]:
    """The far roots' latencies: those asked and, beside any, 0 ms."""
    if not plan.root_latency_ms:
        return []
    return sorted({0.0, *plan.root_latency_ms})


def instance_cores(plan: ChatPlan) -> set[int]:
    """The cores the instances bind (``VLLM_CPU_OMP_THREADS_BIND``)."""
    cores = os.cpu_count() or 1
    return {i % cores for i in range(plan.instances)}


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def ask(url: str, prompt: str, max_tokens: int) -> tuple[float, str, dict[str, Any]]:
    """One streamed completion: TTFT, the answer, and its usage."""
    body = json.dumps({
        "model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }).encode()  # fmt: skip
    request = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    ttft, answer = 0.0, []
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices", []):
                if choice.get("text") and not ttft:
                    ttft = time.perf_counter() - start
                answer.append(choice.get("text") or "")
            usage = chunk.get("usage") or usage
    return ttft, "".join(answer), usage


def chat(plan: ChatPlan, urls: list[str], user: int, turns: list[Turn]) -> None:
    rng = random.Random(user)
    history = f"Document {user}: {_text(rng, plan.document_words)}"
    for r in range(plan.rounds):
        history += f"\nQuestion {r + 1}: {_text(rng, plan.question_words)}?\nAnswer:"
        url = urls[(user + r) % len(urls)]
        ttft, answer, usage = ask(url, history, plan.answer_tokens)
        history += answer
        details = usage.get("prompt_tokens_details") or {}
        turns.append(
            Turn(
                user,
                r,
                ttft,
                int(usage.get("prompt_tokens", 0)),
                int(details.get("cached_tokens") or 0),
                int(usage.get("completion_tokens", 0)),
                answer,
            )
        )
        time.sleep(plan.think_s)


def summarize(plan: ChatPlan, turns: list[Turn]) -> dict[str, Any]:
    by_key = {(t.user, t.round): t for t in turns}
    later = [t for t in turns if t.round > 0]
    asked = hit = 0
    for t in later:
        before = by_key[(t.user, t.round - 1)]
        computed = before.prompt_tokens + before.completion_tokens
        asked += computed
        hit += min(t.cached_tokens, computed)
    return {
        "first_round_ttft_ms": 1e3
        * statistics.mean(t.ttft_s for t in turns if t.round == 0),
        "later_rounds_ttft_ms": 1e3 * statistics.mean(t.ttft_s for t in later),
        "previous_round_hit_share": hit / asked if asked else 0.0,
        "requests": len(turns),
    }


def skipped_share(result: dict[str, Any]) -> float:
    """Updates skipped / (submitted + skipped); 0 when there were none."""
    total = result["updates_submitted"] + result["updates_skipped"]
    return result["updates_skipped"] / total if total else 0.0


def run_config(
    plan: ChatPlan,
    name: str,
    model: str,
    work: Path,
    env: dict[str, str] | list[dict[str, str]],
    extra_args: list[str],
) -> dict[str, Any]:
    """One configuration: ``plan.instances`` servers (``env``: theirs, or
    one per instance), every user's chat; the summary, the cache's counters
    and the answers per (user, round) (``"answers"``)."""
    envs = env if isinstance(env, list) else [env] * plan.instances
    cached = "VLLM_USE_VINEYARD_CACHE" in envs[0]
    if cached:  # where a hit's time goes (the hit_* histograms)
        envs = [{**e, "VINEYARD_CACHE_METRICS_ENABLED": "1"} for e in envs]
    args = ["--enable-prompt-tokens-details", *extra_args]
    # One core per instance where there are enough (their backends move to
    # the others': busy cores, as on a CPU-only server).
    cores = os.cpu_count() or 1
    servers = [
        Server(
            f"{name}-{i}",
            model,
            work,
            {**envs[i], "VLLM_CPU_OMP_THREADS_BIND": str(i % cores)},
            args,
        )
        for i in range(plan.instances)
    ]
    try:
        for server in servers:
            server.wait_ready()
        turns: list[Turn] = []
        users = [
            threading.Thread(
                target=chat, args=(plan, [s.url for s in servers], u, turns)
            )
            for u in range(plan.users)
        ]
        for t in users:
            t.start()
        for t in users:
            t.join()
        result = summarize(plan, turns)
        if cached:
            urls = [s.url for s in servers]
            for metric in CACHE_METRICS:
                result[metric] = sum(
                    counter(url, f"vllm:vineyard_cache_{metric}_total") for url in urls
                )
            result["updates_skipped_share"] = skipped_share(result)
            names = {histogram_metric_name(p): p for p in HIT_PHASES}
            means = histogram_means(urls, list(names))
            result["hit_phases_ms"] = {
                phase: 1e3 * means.get(name, 0.0) for name, phase in names.items()
            }
        result["answers"] = {(t.user, t.round): t.answer for t in turns}
        return result
    finally:
        for server in servers:
            server.stop()


def compare_to_no_cache(run: dict[str, dict[str, Any]]) -> None:
    """Per configuration of a run: later rounds' ratio to no cache's and
    whether every answer equals no cache's for the same (user, round)
    (``None`` where no cache has none); the answers themselves are dropped
    (they stay out of the JSON)."""
    answers = {name: r.pop("answers") for name, r in run.items() if "answers" in r}
    reference = answers.get("no cache")
    base = run.get("no cache", {}).get("later_rounds_ttft_ms")
    for name, r in run.items():
        if "later_rounds_ttft_ms" in r and base:
            r["later_rounds_vs_no_cache"] = r["later_rounds_ttft_ms"] / base
        if name == "no cache" or name not in answers:
            continue
        if reference is None:
            r["same_answers"] = None
            continue
        mine = answers[name]
        differing = [k for k in reference.keys() | mine.keys()
                     if mine.get(k) != reference.get(k)]  # fmt: skip
        r["same_answers"] = not differing
        r["answers_differing"] = len(differing)


def run_chats(
    plan: ChatPlan, work: Path, model: str, base_env: dict[str, str],
    cache_env: Callable[[Path], dict[str, str]],
    glusterfs: SharedVolume | str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Every configuration, ``plan.runs`` times (a fresh root each run).
    ``glusterfs``: the volume of the GlusterFS row, or why there is none."""
    runs: list[dict[str, Any]] = []
    no_fuse = fuse_unavailable() if plan.root_latency_ms else None
    for i in range(plan.runs):
        run: dict[str, Any] = {}
        configs: list[tuple[str, contextlib.AbstractContextManager[Config] | str]]
        configs = [
            ("no cache", as_is(plan.instances, base_env)),
            ("vineyard", as_is(plan.instances, cache_env(work / f"root-{i}"))),
        ]
        if plan.peer:
            peer = json.dumps({
                "kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "shared_storage_path": str(work / f"peer-{i}")},
            })  # fmt: skip
            configs.append(
                ("ExampleConnector",
                 as_is(plan.instances, base_env, ["--kv-transfer-config", peer]))
            )  # fmt: skip
        for ms in far_latencies(plan):
            far = far_root(
                plan.instances,
                instance_cores(plan),
                work / f"far-{ms:g}ms-{i}",
                ms,
                cache_env,
            )
            configs.append(
                (far_name(ms), f"no FUSE here: {no_fuse}" if no_fuse else far)
            )
        if isinstance(glusterfs, str):
            configs.append((GLUSTERFS, glusterfs))
        elif glusterfs is not None:
            configs.append(
                (GLUSTERFS, shared_volume(plan.instances, glusterfs, i, cache_env))
            )
        for name, config in configs:
            print(f"  run {i + 1}: {name} ...", end="", flush=True)
            if isinstance(config, str):
                print(f" skipped: {config}", flush=True)
                run[name] = {"skipped": config}
                continue
            label = f"{name.replace(' ', '-').replace(',', '')}-{i}"
            try:
                with config as (envs, args, facts):
                    measured = run_config(plan, label, model, work, envs, args)
                    run[name] = {**measured, **facts}
            except Exception as e:  # noqa: BLE001 - the peer's engine can crash
                print(f" failed: {e}", flush=True)
                run[name] = {"failed": str(e)[-300:]}
                continue
            print(
                f" later rounds {run[name]['later_rounds_ttft_ms']:.0f} ms", flush=True
            )
        compare_to_no_cache(run)
        runs.append(run)
    result: dict[str, Any] = {"plan": asdict(plan), "runs": runs}
    result["instance_cores"] = sorted(instance_cores(plan))
    if plan.root_latency_ms:
        cores = None if no_fuse else pin_off([], instance_cores(plan))
        result["fuse_daemon_cores"] = cores
    if isinstance(glusterfs, SharedVolume):
        result["glusterfs"] = {
            "round_trip_ms": glusterfs.round_trip_ms,
            "cores": glusterfs.cores,
            "nice": glusterfs.nice,
        }
    elif glusterfs is not None:
        result["glusterfs"] = {"skipped": glusterfs}
    return result


#: The table's columns: (JSON key, header, format).
COLUMNS = (
    ("first_round_ttft_ms", "first ms", "{:.0f}"),
    ("later_rounds_ttft_ms", "later ms", "{:.0f}"),
    ("later_rounds_vs_no_cache", "ratio", "{:.2f}x"),
    ("previous_round_hit_share", "prev hit", "{:.2f}"),
    ("updates_submitted", "submitted", "{:.0f}"),
    ("updates_skipped", "skipped", "{:.0f}"),
    ("updates_skipped_share", "skip share", "{:.2f}"),
    ("backend_restarts", "restarts", "{:.0f}"),
    ("tokens_not_loaded_slow", "slow tokens", "{:.0f}"),
    ("loads_stopped_slow", "slow stops", "{:.0f}"),
    ("same_answers", "answers", "{}"),
)


def _cell(r: dict[str, Any], key: str, fmt: str) -> str:
    if key not in r:
        return "-"
    value = r[key]
    if key == "same_answers":
        if value is None:  # no cache has no answers to compare with
            return "?"
        return "same" if value else f"{r['answers_differing']} differ"
    return str(fmt.format(value))


def print_chats(result: dict[str, Any]) -> None:
    p = result["plan"]
    print(
        f"\n{p['instances']} instances on one root, {p['users']} users, "
        f"{p['rounds']} rounds round-robin, a {p['document_words']}-word "
        f"document each, think time {p['think_s']:g} s"
    )
    for line in describe_roots(result):
        print(f"  {line}")
    print(
        "  (first / later ms: mean TTFT of the first / later rounds; ratio: later "
        "rounds vs no cache's; prev hit: previous_round_hit_share; submitted, "
        "skipped, skip share: updates; slow tokens / stops: tokens_not_loaded_slow"
        " / loads_stopped_slow; answers: vs no cache's per (user, round))"
    )
    runs = result["runs"]
    labels = [f"{i + 1}: {name}" for i, run in enumerate(runs) for name in run]
    width = max([22, *map(len, labels)])
    print(f"  {'run / config':{width}}" + "".join(f"{h:>12}" for _, h, _ in COLUMNS))
    for i, run in enumerate(runs):
        for name, r in run.items():
            label = f"{i + 1}: {name}"
            if "failed" in r or "skipped" in r:
                kind = "failed" if "failed" in r else "skipped"
                print(f"  {label:{width}} {kind}: {r[kind][-160:]}")
                continue
            row = "".join(f"{_cell(r, key, fmt):>12}" for key, _, fmt in COLUMNS)
            print(f"  {label:{width}}{row}")
    print("  where a hit's time went (ms, the mean over every request with a hit):")
    heads = [p.removeprefix("hit_").removesuffix("_s") for p in HIT_PHASES]
    print(f"  {'run / config':{width}}" + "".join(f"{h:>12}" for h in heads))
    for i, run in enumerate(runs):
        for name, r in run.items():
            if "hit_phases_ms" in r:
                row = "".join(f"{v:>12.1f}" for v in r["hit_phases_ms"].values())
                print(f"  {f'{i + 1}: {name}':{width}}{row}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    parser.add_argument("--runs", type=int, help="runs of each config")
    parser.add_argument("--think-s", type=float, help="pause before each next round")
    parser.add_argument(
        "--peer", action="store_true", help="also vLLM's ExampleConnector"
    )
    parser.add_argument(
        "--root-latency-ms", type=float, nargs="+", metavar="L", default=[],
        help="per value a row with the root on a FUSE mount L ms away (stat, "
        "open, fsync, first read), and one 0 ms away beside them",
    )  # fmt: skip
    parser.add_argument(
        "--glusterfs", action="store_true",
        help="also a row with each instance on its own client mount of one "
        "GlusterFS volume",
    )  # fmt: skip
    args = parser.parse_args(argv)
    chats = QUICK_CHATS if args.quick else ChatPlan()
    if args.runs:
        chats = replace(chats, runs=args.runs)
    if args.think_s is not None:
        chats = replace(chats, think_s=args.think_s)
    chats = replace(
        chats, peer=args.peer, root_latency_ms=tuple(args.root_latency_ms),
        glusterfs=args.glusterfs,
    )  # fmt: skip
    with run_folder(args.workdir) as work, contextlib.ExitStack() as stack:
        glusterfs = None
        if chats.glusterfs:
            print("  GlusterFS volume ...", end="", flush=True)
            glusterfs = stack.enter_context(
                glusterfs_roots(work / "glusterfs", instance_cores(chats))
            )
            print(" skipped" if isinstance(glusterfs, str) else " mounted", flush=True)
        model, base_env, cache_env = setup()
        result = run_chats(chats, work, model, base_env, cache_env, glusterfs)
        print_chats(result)
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
