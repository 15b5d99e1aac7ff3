# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The several-instance scenario of ``benchmark_serve.py --scenario chats``:
``N`` ``vllm serve`` instances on one cache root, users chatting about a
long document of their own through the OpenAI API (streamed completions),
each round's whole history sent again, rounds routed round-robin so that
every later round lands on an instance that did not compute the round
before, users concurrent, each next round sent as soon as the previous
answer is in (as agents do) or after a think time.

Per configuration (no cache, this cache and, with ``--peer``, vLLM's
``ExampleConnector`` on one folder both instances share): the mean TTFT of
first and later rounds, the share of the tokens the previous round computed
(its prompt and answer, on the other instance) that the next round found
cached (``prompt_tokens_details.cached_tokens``, local and external hits),
and for the cache, updates submitted and skipped and backend restarts.
Usage::

    python benchmarks/vineyard/serve_chats.py [--quick] [--json out.json]
        [--runs N] [--think-s S] [--peer]

(the same as ``benchmark_serve.py --scenario chats``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness
from serve_harness import (  # noqa: E402
    Server,
    add_run_arguments,
    counter,
    run_folder,
    setup,
    write_result,
)

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


QUICK_CHATS = ChatPlan(users=2, rounds=3, document_words=300, runs=1)


@dataclass
class Turn:
    user: int
    round: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


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


def run_config(
    plan: ChatPlan,
    name: str,
    model: str,
    work: Path,
    env: dict[str, str],
    extra_args: list[str],
) -> dict[str, Any]:
    args = ["--enable-prompt-tokens-details", *extra_args]
    # One core per instance where there are enough (their backends move to
    # the others': busy cores, as on a CPU-only server).
    cores = os.cpu_count() or 1
    servers = [
        Server(
            f"{name}-{i}",
            model,
            work,
            {**env, "VLLM_CPU_OMP_THREADS_BIND": str(i % cores)},
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
        if "VLLM_USE_VINEYARD_CACHE" in env:
            for metric in ("updates_submitted", "updates_skipped", "backend_restarts"):
                result[metric] = sum(
                    counter(s.url, f"vllm:vineyard_cache_{metric}_total")
                    for s in servers
                )
        return result
    finally:
        for server in servers:
            server.stop()


def run_chats(
    plan: ChatPlan, work: Path, model: str, base_env: dict[str, str],
    cache_env: Any,
) -> dict[str, Any]:  # fmt: skip
    """Every configuration, ``plan.runs`` times (a fresh root each run)."""
    runs: list[dict[str, Any]] = []
    for i in range(plan.runs):
        run: dict[str, Any] = {}
        configs: list[tuple[str, dict[str, str], list[str]]] = [
            ("no cache", base_env, []),
            ("vineyard", cache_env(work / f"root-{i}"), []),
        ]
        if plan.peer:
            peer = json.dumps({
                "kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "shared_storage_path": str(work / f"peer-{i}")},
            })  # fmt: skip
            configs.append(
                ("ExampleConnector", base_env, ["--kv-transfer-config", peer])
            )
        for name, env, args in configs:
            print(f"  run {i + 1}: {name} ...", end="", flush=True)
            try:
                run[name] = run_config(
                    plan, f"{name.replace(' ', '-')}-{i}", model, work, env, args
                )
            except Exception as e:  # noqa: BLE001 - the peer's engine can crash
                print(f" failed: {e}", flush=True)
                run[name] = {"failed": str(e)[-300:]}
                continue
            print(
                f" later rounds {run[name]['later_rounds_ttft_ms']:.0f} ms", flush=True
            )
        runs.append(run)
    return {"plan": asdict(plan), "runs": runs}


def print_chats(result: dict[str, Any]) -> None:
    p = result["plan"]
    print(
        f"\n{p['instances']} instances on one root, {p['users']} users, "
        f"{p['rounds']} rounds round-robin, a {p['document_words']}-word "
        f"document each, think time {p['think_s']:g} s"
    )
    cols = ("first_round_ttft_ms", "later_rounds_ttft_ms",
            "previous_round_hit_share", "updates_submitted", "updates_skipped",
            "backend_restarts")  # fmt: skip
    print(f"  {'run / config':22}" + "".join(f"{c:>26}" for c in cols) + "  ratio")
    for i, run in enumerate(result["runs"]):
        base = run["no cache"]["later_rounds_ttft_ms"]
        for name, r in run.items():
            if "failed" in r:
                print(f"  {f'{i + 1}: {name}':22} failed: {r['failed'][-120:]}")
                continue
            row = "".join(f"{r[c]:26.2f}" if c in r else f"{'-':>26}" for c in cols)
            ratio = r["later_rounds_ttft_ms"] / base if base else 0.0
            print(f"  {f'{i + 1}: {name}':22}{row}  {ratio:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    parser.add_argument("--runs", type=int, help="runs of each config")
    parser.add_argument("--think-s", type=float, help="pause before each next round")
    parser.add_argument(
        "--peer", action="store_true", help="also vLLM's ExampleConnector"
    )
    args = parser.parse_args(argv)
    chats = QUICK_CHATS if args.quick else ChatPlan()
    if args.runs:
        chats = replace(chats, runs=args.runs)
    if args.think_s is not None:
        chats = replace(chats, think_s=args.think_s)
    chats = replace(chats, peer=args.peer)
    with run_folder(args.workdir) as work:
        model, base_env, cache_env = setup()
        result = run_chats(chats, work, model, base_env, cache_env)
        print_chats(result)
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
