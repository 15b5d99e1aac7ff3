# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The vineyard LLM cache, end to end: two vLLM instances share one KV cache.

What it does:

1. Makes (or reuses) a small Llama checkpoint with seeded random weights, so
   nothing is downloaded; ``--model DIR`` uses a real checkpoint instead.
2. Builds a shared-prefix workload: a few long "documents" (random token ids),
   several users per document asking a question each, and a second turn whose
   prompt holds the first turn's answer (a multi-turn chat).
3. Runs three engines, one after the other, each in a fresh process:

   * **instance 1**, cache ON, on an empty cache root: users A chat about the
     documents; their KV is saved to vineyard in the background;
   * **instance 2**, cache ON, a fresh engine on the same cache root (as a
     second server would be): users B chat about the same documents and load
     the documents' KV from vineyard instead of recomputing it;
   * **reference**, vineyard cache OFF (vLLM's own prefix cache on, as by
     default): the same requests in the same order as instance 1 and then
     instance 2, in one engine.

   Each engine also times the first token of a few long single prompts
   ("TTFT probes"): cold on the reference and on instance 1 (a cache miss),
   a vineyard hit on instance 2, and a hit in vLLM's own in-memory prefix
   cache when the reference sees them a second time.
4. Prints a report (hit rate, cached tokens, time to first token, updates,
   the cache's timing histograms, turned on here with
   ``VINEYARD_CACHE_METRICS_ENABLED=1`` unless you set it) and
   checks that every output is identical with and without the vineyard cache
   and that instance 2 got hits. It exits with status 1 if a check fails.

Why the reference keeps vLLM's prefix cache on: greedy decoding of a model
with random weights has many near-ties, so a different computation order
(say, recomputing a prompt that the instance took from a cache) can flip a
token now and then without anything being wrong. The reference therefore
computes exactly what the two instances compute, only with every prefix hit
served from vLLM's memory instead of vineyard; documents are whole chunks so
that both caches cover the same tokens. Any difference then means KV that did
not round-trip through vineyard unchanged.

The cache runs on its embedded file backend (no server to start). This script
sets the engines' environment before vLLM is imported: ``VLLM_USE_VINEYARD_CACHE``
(1 for the instances, 0 for the reference) and ``VINEYARD_CACHE_ROOT``, and,
unless you set them, ``VINEYARD_CACHE_METRICS_ENABLED=1`` and on the CPU
``VLLM_CPU_KVCACHE_SPACE=1`` and ``VLLM_CPU_OMP_THREADS_BIND=0``. Other
``VINEYARD_CACHE_*`` variables in your environment (e.g.
``VINEYARD_CACHE_CHUNK_SIZE``) are passed through.

Usage::

    python examples/offline_inference/vineyard_llm_cache.py           # 2-3 min
    python examples/offline_inference/vineyard_llm_cache.py --quick   # CI
    python examples/offline_inference/vineyard_llm_cache.py --model /path/to/llama
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRIC_PREFIX = "vllm:vineyard_cache_"
DEFAULT_TOY_MODEL_DIR = os.path.join(
    os.path.expanduser("~"), ".cache", "vineyard-llm-cache-demo", "model"
)
#: Engines, in the order they run: (name, vineyard cache on).
ENGINES: tuple[tuple[str, bool], ...] = (
    ("instance 1", True),
    ("instance 2", True),
    ("reference", False),
)
#: What each engine runs, in order: TTFT probes for the first or second time,
#: and the two turns of a user group. The reference runs what instance 1 and
#: then instance 2 run.
ENGINE_PLAN: dict[str, list[str]] = {
    "instance 1": ["probes 1", "A"],
    "instance 2": ["probes 2", "B"],
    "reference": ["probes 1", "A", "probes 2", "B"],
}
PROBE_PHASES = {
    "probes 1": "TTFT probes, 1st time",
    "probes 2": "TTFT probes, 2nd time",
}
#: vLLM environment variables and the values this demo gives them if unset.
ENV_DEFAULTS_CPU = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}

# --------------------------------------------------------------------------
# Options.
# --------------------------------------------------------------------------

#: Workload sizes of the full run, and of ``--quick``.
FULL_SIZES: dict[str, int] = {
    "num_documents": 3,
    "document_tokens": 1536,
    "users_per_document": 3,
    "question_tokens": 64,
    "answer_tokens": 32,
    "num_probes": 5,
    "probe_tokens": 2048,
}
QUICK_SIZES: dict[str, int] = {
    "num_documents": 2,
    "document_tokens": 768,
    "users_per_document": 2,
    "question_tokens": 32,
    "answer_tokens": 8,
    "num_probes": 3,
    "probe_tokens": 1024,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(
            "Demo of the vineyard LLM cache for vLLM: two engines share one "
            "KV cache on the embedded file backend; prints hit rate, time to "
            "first token and update counts, and checks that outputs are "
            "identical with and without the cache (exit status 1 if not)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="A local Hugging Face checkpoint to serve instead of the toy "
        "model. Prompts are random token ids (no tokenizer is loaded), so any "
        "decoder model works.",
    )
    model.add_argument(
        "--toy-model-dir",
        metavar="DIR",
        default=DEFAULT_TOY_MODEL_DIR,
        help="Where the toy Llama (4 layers, seeded random weights, ~170 MB) "
        "is written, or reused if it is already there. Ignored with --model.",
    )
    model.add_argument(
        "--dtype",
        default="auto",
        help="vLLM's --dtype; 'auto' lets vLLM choose (on the CPU it runs the "
        "float32 toy model in bfloat16).",
    )
    cache = parser.add_argument_group("cache")
    cache.add_argument(
        "--cache-root",
        metavar="DIR",
        default=None,
        help="VINEYARD_CACHE_ROOT of both instances. Default: a fresh "
        "temporary directory, deleted at the end. A given directory is "
        "emptied first (so instance 1 starts cold) and kept.",
    )
    cache.add_argument(
        "--keep-cache",
        action="store_true",
        help="Keep the temporary cache root and print where it is.",
    )
    work = parser.add_argument_group(
        "workload (defaults of the full run; --quick picks smaller ones)"
    )
    work.add_argument(
        "--quick",
        action="store_true",
        help="Reduced sizes for CI (about a minute of work plus three engine "
        "startups). Sizes given explicitly still win.",
    )
    work.add_argument(
        "--num-documents",
        type=int,
        help=f"Shared documents (full: {FULL_SIZES['num_documents']}).",
    )
    work.add_argument(
        "--document-tokens",
        type=int,
        help="Mean document length in tokens; each document is 75-125%% of it, "
        "rounded to whole cache chunks "
        f"(full: {FULL_SIZES['document_tokens']}).",
    )
    work.add_argument(
        "--users-per-document",
        type=int,
        help="Users per document per instance; instance 1 and 2 serve "
        f"different users (full: {FULL_SIZES['users_per_document']}).",
    )
    work.add_argument(
        "--question-tokens",
        type=int,
        help="Mean question length in tokens, per turn "
        f"(full: {FULL_SIZES['question_tokens']}).",
    )
    work.add_argument(
        "--answer-tokens",
        type=int,
        help=f"Tokens generated per turn (full: {FULL_SIZES['answer_tokens']}).",
    )
    work.add_argument(
        "--num-probes",
        type=int,
        help="Long single prompts whose time to first token is measured, one "
        f"at a time; the report shows the median (full: {FULL_SIZES['num_probes']}).",
    )
    work.add_argument(
        "--probe-tokens",
        type=int,
        help="Cacheable length of each TTFT probe, rounded up to whole cache "
        "chunks; a probe has one token more, so that on a hit only that last "
        f"token is computed (full: {FULL_SIZES['probe_tokens']}).",
    )
    work.add_argument("--seed", type=int, default=0, help="Seed of the workload.")
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="vLLM's token budget per step (also sizes the cache's update buffers).",
    )
    engine.add_argument(
        "--multiprocessing",
        action="store_true",
        help="Use vLLM's default multi-process engine (scheduler and worker "
        "in their own processes; ~15 s slower startup per engine) instead of "
        "VLLM_ENABLE_V1_MULTIPROCESSING=0.",
    )
    engine.add_argument(
        "--engine-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="Longest run of one engine process before it is killed.",
    )
    engine.add_argument(
        "--settle-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="Longest wait, after an instance's work, for its background "
        "cache updates to finish (instance 2 should see all of them).",
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--verbose",
        action="store_true",
        help="Show vLLM's own log (by default it goes to a log file that is "
        "printed only if an engine fails).",
    )
    out.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="Also write every measurement and the checks' results as JSON.",
    )
    # Internal: this script re-runs itself to host one engine.
    parser.add_argument("--run-engine", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    for name, default in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
        if getattr(args, name) < (0 if name == "num_probes" else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


# --------------------------------------------------------------------------
# The workload.
# --------------------------------------------------------------------------


@dataclass
class Conversation:
    """A user's two-turn chat about one document."""

    user: str  # e.g. "A3"
    document: int
    question_1: list[int]
    question_2: list[int]


@dataclass
class Workload:
    documents: list[list[int]]
    conversations: dict[str, list[Conversation]]  # by user group
    probes: list[list[int]]
    answer_tokens: int
    token_range: tuple[int, int]  # token ids are drawn from [low, high]

    def max_prompt_len(self) -> int:
        longest_chat = max(
            len(self.documents[c.document])
            + len(c.question_1)
            + self.answer_tokens
            + len(c.question_2)
            for group in self.conversations.values()
            for c in group
        )
        return max([longest_chat, *map(len, self.probes)])


def make_workload(
    args: argparse.Namespace, vocab_size: int, chunk_size: int
) -> Workload:
    """Random token ids; documents and probes are whole chunks (probes plus
    one token), so a prefix hit covers the same tokens in vineyard (chunk
    granular) and in vLLM's prefix cache (block granular)."""
    rng = random.Random(args.seed)
    # Keep clear of the lowest ids (special tokens in most vocabularies).
    low, high = min(100, vocab_size // 4), vocab_size - 1

    def tokens(mean: int, multiple_of: int = 1) -> list[int]:
        n = round(mean * rng.uniform(0.75, 1.25) / multiple_of) * multiple_of
        return [rng.randint(low, high) for _ in range(max(n, multiple_of))]

    documents = [
        tokens(args.document_tokens, chunk_size) for _ in range(args.num_documents)
    ]
    conversations = {
        group: [
            Conversation(
                user=f"{group}{d * args.users_per_document + u}",
                document=d,
                question_1=tokens(args.question_tokens),
                question_2=tokens(args.question_tokens),
            )
            for d in range(args.num_documents)
            for u in range(args.users_per_document)
        ]
        for group in ("A", "B")
    }
    probe_len = -(-args.probe_tokens // chunk_size) * chunk_size + 1
    probes = [
        [rng.randint(low, high) for _ in range(probe_len)]
        for _ in range(args.num_probes)
    ]
    return Workload(documents, conversations, probes, args.answer_tokens, (low, high))


def model_vocab_size(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    for section in (config, config.get("text_config") or {}):
        if "vocab_size" in section:
            return int(section["vocab_size"])
    raise ValueError(f"{model_dir}/config.json has no vocab_size")


# --------------------------------------------------------------------------
# Engine side: this script run with --run-engine SPEC, in a fresh process.
# --------------------------------------------------------------------------

_PROGRESS_FD_VAR = "VINEYARD_DEMO_PROGRESS_FD"
_FLUSH_PROMPT = [7]  # shorter than a chunk: no lookup, no save


def _progress(message: str) -> None:
    """A progress line on the terminal of the parent (vLLM's log goes
    elsewhere unless --verbose)."""
    line = f"    {time.strftime('%H:%M:%S')} {message}\n"
    fd = os.environ.get(_PROGRESS_FD_VAR)
    if fd:
        os.write(int(fd), line.encode())
    else:
        sys.stdout.write(line)
        sys.stdout.flush()


def _progress_bar() -> Any:
    """vLLM's progress bars on the parent's terminal, if it is one."""
    fd = os.environ.get(_PROGRESS_FD_VAR)
    if not fd or not os.isatty(int(fd)):
        return False
    import functools

    from tqdm import tqdm

    stream = os.fdopen(int(fd), "w", closefd=False)
    return functools.partial(tqdm, file=stream, leave=False)


def _read_counters(llm: Any) -> dict[str, int]:
    """Every counter of ``LLM.get_metrics()`` (vineyard's and vLLM's)."""
    from vllm.v1.metrics.reader import Counter

    out: dict[str, int] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter):
            out[metric.name] = out.get(metric.name, 0) + int(metric.value)
    return out


def _read_histograms(llm: Any) -> dict[str, tuple[int, float]]:
    """``(count, sum)`` of every vineyard cache histogram."""
    from vllm.v1.metrics.reader import Histogram

    out: dict[str, tuple[int, float]] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Histogram) and metric.name.startswith(METRIC_PREFIX):
            count, total = out.get(metric.name, (0, 0.0))
            out[metric.name] = (count + metric.count, total + metric.sum)
    return out


def _pending_updates(counters: Mapping[str, int]) -> int:
    def get(name: str) -> int:
        return counters.get(METRIC_PREFIX + name, 0)

    done = get("updates_completed") + get("updates_failed") + get("updates_dropped")
    return get("updates_submitted") - done


def _settle(llm: Any, timeout_s: float) -> dict[str, int]:
    """Wait until every cache update submitted so far is written. The worker
    reports its counters with each engine step, so keep stepping it with a
    one-token prompt (no lookup, no save)."""
    from vllm import SamplingParams

    flush = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    deadline = time.monotonic() + timeout_s
    counters = _read_counters(llm)
    while _pending_updates(counters) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        llm.generate([{"prompt_token_ids": _FLUSH_PROMPT}], flush, use_tqdm=False)
        counters = _read_counters(llm)
    return counters


def _delta(after: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def _run_engine(spec_path: str) -> None:
    """Host one engine: run the spec's phases and write their results."""
    with open(spec_path) as f:
        spec = json.load(f)
    result: dict[str, Any] = {"phases": [], "error": None, "cache_config": None}
    llm = None
    try:
        _progress("importing vLLM and starting the engine")
        start = time.perf_counter()
        from vllm.inputs import TokensPrompt

        from vllm import LLM, SamplingParams

        llm = LLM(**spec["llm_kwargs"])
        result["startup_s"] = time.perf_counter() - start
        _progress(f"engine ready after {result['startup_s']:.0f} s")
        model_config = llm.llm_engine.model_config
        result["dtype"] = str(model_config.dtype).removeprefix("torch.")
        result["block_size"] = llm.llm_engine.vllm_config.cache_config.block_size
        if spec["use_cache"]:
            from vllm.worker.vineyard_llm_cache import VineyardLLMCacheConfig

            result["cache_config"] = vars(VineyardLLMCacheConfig.from_env())

        def generate(
            prompts: list[list[int]], max_tokens: int, one_by_one: bool = False
        ) -> list[Any]:
            params = SamplingParams(
                temperature=0, max_tokens=max_tokens, ignore_eos=True
            )
            items = [TokensPrompt(prompt_token_ids=p) for p in prompts]
            if one_by_one:
                return [llm.generate([i], params, use_tqdm=False)[0] for i in items]
            return llm.generate(items, params, use_tqdm=bar)

        bar = _progress_bar()

        # Warm up kernels with a prompt unrelated to the workload.
        generate([spec["warmup"]], 4)
        counters = _settle(llm, spec["settle_s"])
        for phase in spec["phases"]:
            name = phase["name"]
            _progress(f"{name}: {len(phase['prompts'])} request(s)")
            ttft: list[float] = []
            begin = time.perf_counter()
            if phase["kind"] == "probe":
                outs = []
                for prompt in phase["prompts"]:
                    t0 = time.perf_counter()
                    outs += generate([prompt], 1, one_by_one=True)
                    ttft.append(time.perf_counter() - t0)
            else:
                prompts = phase["prompts"]
                if phase["kind"] == "turn 2":
                    # Turn 2 = turn 1's prompt + its answer + a new question.
                    turn_1 = next(
                        p for p in result["phases"] if p["name"] == phase["continues"]
                    )
                    prompts = [
                        p + a + q
                        for p, a, q in zip(
                            turn_1["prompts"],
                            turn_1["outputs"],
                            phase["prompts"],
                            strict=True,
                        )
                    ]
                outs = generate(prompts, phase["max_tokens"])
            wall_s = time.perf_counter() - begin
            # Per-request time to first token, where vLLM records it.
            latencies = [
                getattr(o.metrics, "first_token_latency", 0.0) or 0.0 for o in outs
            ]
            after = _read_counters(llm)
            result["phases"].append(
                {
                    "name": name,
                    "kind": phase["kind"],
                    "users": phase["users"],
                    "prompts": [list(o.prompt_token_ids) for o in outs],
                    "outputs": [list(o.outputs[0].token_ids) for o in outs],
                    "num_cached_tokens": [o.num_cached_tokens or 0 for o in outs],
                    "wall_s": wall_s,
                    "probe_ttft_s": ttft,
                    "first_token_latency_s": latencies,
                    "counters": _delta(after, counters),
                }
            )
            counters = after
            _progress(f"{name}: done in {wall_s:.1f} s")
        if spec["use_cache"]:
            _progress("waiting for the background cache updates to finish")
            after = _settle(llm, spec["settle_s"])
            result["settle_counters"] = _delta(after, counters)
            result["pending_updates"] = _pending_updates(after)
            counters = after
        result["counters"] = counters
        result["histograms"] = _read_histograms(llm)
    except Exception as e:  # reported to the parent
        import traceback

        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
    with open(spec["result"], "w") as f:
        json.dump(result, f)
    if llm is not None:
        # An orderly shutdown: the cache drains its last updates and stops
        # its backend processes. Bounded, so a stuck engine cannot hang us.
        import threading

        stopper = threading.Thread(
            target=llm.llm_engine.engine_core.shutdown, daemon=True
        )
        stopper.start()
        stopper.join(30)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (engine threads and atexit hooks can hang
    # after a failed startup); the backend processes exit with us.
    os._exit(0 if result["error"] is None else 1)


# --------------------------------------------------------------------------
# Parent side.
# --------------------------------------------------------------------------


def engine_env(use_cache: bool, cache_root: str, args: argparse.Namespace) -> dict:
    """The environment of one engine process, set before vLLM is imported."""
    env = dict(os.environ)
    env["VLLM_USE_VINEYARD_CACHE"] = "1" if use_cache else "0"
    env["VINEYARD_CACHE_ROOT"] = cache_root
    # The timing histograms are off by default in production; show them here.
    env.setdefault("VINEYARD_CACHE_METRICS_ENABLED", "1")
    if not args.multiprocessing:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not _has_cuda():
        for name, value in ENV_DEFAULTS_CPU.items():
            env.setdefault(name, value)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


@dataclass
class EngineResult:
    name: str
    use_cache: bool
    wall_s: float
    data: dict[str, Any] = field(default_factory=dict)

    def phase(self, name: str) -> dict[str, Any]:
        for p in self.data["phases"]:
            if p["name"] == name:
                return p
        raise KeyError(name)

    def counter(self, name: str, phase: str | None = None) -> int:
        source = self.data["counters"] if phase is None else self.phase(phase)
        if phase is not None:
            source = source["counters"]
        return int(source.get(METRIC_PREFIX + name, 0))


def engine_phases(name: str, workload: Workload) -> list[dict[str, Any]]:
    """The phases one engine runs (see :data:`ENGINE_PLAN`); the engine
    appends turn 1's answers to the turn 2 prompts itself."""
    phases: list[dict[str, Any]] = []
    for step in ENGINE_PLAN[name]:
        if step in PROBE_PHASES:
            if workload.probes:
                phases.append(
                    {
                        "name": PROBE_PHASES[step],
                        "kind": "probe",
                        "users": [],
                        "prompts": workload.probes,
                        "max_tokens": 1,
                    }
                )
            continue
        chats = workload.conversations[step]
        users = [c.user for c in chats]
        turn_1 = f"users {step}, turn 1"
        phases.append(
            {
                "name": turn_1,
                "kind": "turn 1",
                "users": users,
                "prompts": [
                    workload.documents[c.document] + c.question_1 for c in chats
                ],
                "max_tokens": workload.answer_tokens,
            }
        )
        phases.append(
            {
                "name": f"users {step}, turn 2",
                "kind": "turn 2",
                "continues": turn_1,
                "users": users,
                "prompts": [c.question_2 for c in chats],
                "max_tokens": workload.answer_tokens,
            }
        )
    return phases


def run_engine(
    name: str,
    use_cache: bool,
    model: str,
    workload: Workload,
    cache_root: str,
    workdir: Path,
    args: argparse.Namespace,
) -> EngineResult:
    slug = name.replace(" ", "_")
    spec_path = workdir / f"{slug}.spec.json"
    result_path = workdir / f"{slug}.result.json"
    log_path = workdir / f"{slug}.log"
    # The same warm-up prompt everywhere: instance 1 saves it and instance 2
    # loads it, so first-call costs (kernels, the backends' buffer setup) are
    # paid before anything is timed.
    rng = random.Random("warmup")
    low, high = workload.token_range
    max_len = workload.max_prompt_len() + workload.answer_tokens
    llm_kwargs: dict[str, Any] = {
        "model": model,
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": args.dtype,
        "max_model_len": -(-max_len // 256) * 256,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "disable_log_stats": False,  # LLM.get_metrics() needs the stats
        "seed": 0,
    }
    spec = {
        "llm_kwargs": llm_kwargs,
        "use_cache": use_cache,
        # As long as a probe, so the first probe meets warm kernels.
        "warmup": [
            rng.randint(low, high)
            for _ in range(len(workload.probes[0]) if workload.probes else 300)
        ],
        "phases": engine_phases(name, workload),
        "settle_s": args.settle_timeout,
        "result": str(result_path),
    }
    spec_path.write_text(json.dumps(spec))
    env = engine_env(use_cache, cache_root, args)
    progress_fd = os.dup(sys.stdout.fileno())
    env[_PROGRESS_FD_VAR] = str(progress_fd)
    sys.stdout.flush()
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        output: Any = None if args.verbose else log
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--run-engine", str(spec_path)],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT if output is not None else None,
            pass_fds=(progress_fd,),
            start_new_session=True,  # so a timeout kills its whole tree
        )
        try:
            proc.wait(timeout=args.engine_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            os.close(progress_fd)
    wall_s = time.perf_counter() - start
    data: dict[str, Any] = {}
    if result_path.exists():
        data = json.loads(result_path.read_text())
    error = data.get("error") if data else "the engine wrote no result"
    if proc.returncode != 0 or error:
        tail = "" if args.verbose else log_path.read_text(errors="replace")[-6000:]
        raise RuntimeError(
            f"{name} failed (exit code {proc.returncode}): {error}\n"
            f"--- last lines of {log_path} ---\n{tail}"
        )
    return EngineResult(name, use_cache, wall_s, data)


# --------------------------------------------------------------------------
# The report.
# --------------------------------------------------------------------------


def _ratio(num: float, den: float) -> str:
    return f"{num / den:.0%}" if den else "-"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  " + "  ".join(cells).rstrip())
        if n == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _span(values: Sequence[int]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.{1 if seconds < 0.01 else 0}f} ms"


def compare_outputs(
    engines: Mapping[str, EngineResult],
) -> tuple[int, list[str]]:
    """Compare every output of the two instances with the reference's.
    Returns (number compared, descriptions of the mismatches)."""
    ref = engines["reference"]
    compared, mismatches = 0, []
    for name in ("instance 1", "instance 2"):
        for phase in engines[name].data["phases"]:
            ref_phase = ref.phase(phase["name"])
            pairs = zip(phase["outputs"], ref_phase["outputs"], strict=True)
            for i, (got, want) in enumerate(pairs):
                compared += 1
                if got != want:
                    who = phase["users"][i] if phase["users"] else f"probe {i}"
                    mismatches.append(
                        f"{name}, {phase['name']}, {who}: {got[:8]}... vs "
                        f"reference {want[:8]}..."
                    )
    return compared, mismatches


def build_report(
    engines: Mapping[str, EngineResult],
    workload: Workload,
    model_desc: str,
    cache_root: str,
) -> tuple[str, dict[str, Any]]:
    """The printed report and its machine-readable summary."""
    i1, i2, ref = engines["instance 1"], engines["instance 2"], engines["reference"]
    config = i1.data.get("cache_config") or {}
    doc_lens = [len(d) for d in workload.documents]
    n_chats = len(workload.conversations["A"])
    lines = [
        "",
        "=" * 78,
        "vineyard LLM cache demo: report",
        "=" * 78,
        f"model:       {model_desc}",
        f"             run in {i1.data.get('dtype')}, KV block size "
        f"{i1.data.get('block_size')} tokens",
        f"cache:       file backend at {cache_root}",
        f"             chunk {config.get('chunk_size')} tokens, "
        f"{'async' if config.get('enable_async_update') else 'sync'} updates, "
        f"at most {config.get('max_inflight_tasks')} in flight",
        f"workload:    {len(doc_lens)} documents of {min(doc_lens)}-{max(doc_lens)} "
        f"tokens, {n_chats} users per instance, 2 turns of "
        f"{workload.answer_tokens} answer tokens; "
        f"{len(workload.probes)} TTFT probe(s) of "
        f"{len(workload.probes[0]) if workload.probes else 0} tokens",
        "",
        "Prompt tokens served from a cache, per phase (cached = num_cached_tokens:",
        "vLLM's own prefix cache + vineyard; hit rate = vineyard hit / query tokens)",
        "",
    ]
    rows = [
        [
            "engine / phase",
            "reqs",
            "prompt tok",
            "cached tok",
            "vineyard hit/query",
            "hit rate",
            "wall",
        ]
    ]
    summary_phases = []
    for engine in (i1, i2, ref):
        for p in engine.data["phases"]:
            prompt = sum(len(x) for x in p["prompts"])
            cached = sum(p["num_cached_tokens"])
            query = p["counters"].get(METRIC_PREFIX + "query_tokens", 0)
            hit = p["counters"].get(METRIC_PREFIX + "hit_tokens", 0)
            rows.append(
                [
                    f"{engine.name}: {p['name']}",
                    str(len(p["prompts"])),
                    str(prompt),
                    f"{cached} ({_ratio(cached, prompt)})",
                    f"{hit}/{query}" if engine.use_cache else "cache off",
                    _ratio(hit, query) if engine.use_cache else "-",
                    f"{p['wall_s']:.1f} s",
                ]
            )
            summary_phases.append(
                {
                    "engine": engine.name,
                    "phase": p["name"],
                    "prompt_tokens": prompt,
                    "cached_tokens": cached,
                    "query_tokens": query,
                    "hit_tokens": hit,
                    "wall_s": p["wall_s"],
                }
            )
    lines.append(_table(rows))
    hit_rates: dict[str, float | None] = {}
    for e in (i1, i2):
        phases = [p for p in summary_phases if p["engine"] == e.name]
        hit = sum(p["hit_tokens"] for p in phases)
        query = sum(p["query_tokens"] for p in phases)
        cached = sum(p["cached_tokens"] for p in phases)
        prompt = sum(p["prompt_tokens"] for p in phases)
        hit_rates[e.name] = hit / query if query else None
        lines.append(
            f"  {e.name}, all phases: vineyard hit rate {_ratio(hit, query)} "
            f"({hit} of {query} looked-up tokens); {_ratio(cached, prompt)} of "
            "prompt tokens cached"
        )

    ttft: dict[str, float] = {}
    if workload.probes:
        first, second = PROBE_PHASES["probes 1"], PROBE_PHASES["probes 2"]
        cases = [
            ("cold", "no vineyard, cold (reference, 1st time)", ref, first),
            ("miss", "vineyard miss (instance 1, 1st time)", i1, first),
            ("vineyard_hit", "vineyard hit (instance 2, fresh engine)", i2, second),
            ("local_hit", "vLLM prefix cache hit (reference, 2nd time)", ref, second),
        ]
        probe_len = len(workload.probes[0])
        lines += [
            "",
            f"Time to first token of one {probe_len}-token prompt at a time "
            f"(median of {len(workload.probes)}):",
        ]
        for key, label, engine, phase in cases:
            p = engine.phase(phase)
            ttft[key] = statistics.median(p["probe_ttft_s"])
            cached = _span(p["num_cached_tokens"])
            lines.append(f"  {label:<46} {_ms(ttft[key]):>8}   {cached} tokens cached")
        if ttft["vineyard_hit"] > 0:
            lines.append(
                f"  a vineyard hit is {ttft['cold'] / ttft['vineyard_hit']:.1f}x "
                "faster than the cold prefill"
            )

    rows = [["updates", "submitted", "completed", "skipped", "failed", "dropped"]]
    rows += [
        [e.name]
        + [
            str(e.counter(n))
            for n in (
                "updates_submitted",
                "updates_completed",
                "updates_skipped",
                "updates_failed",
                "updates_dropped",
            )
        ]
        for e in (i1, i2)
    ]
    lines += ["", "Background cache updates (vllm:vineyard_cache_updates_*):"]
    lines.append(_table(rows))
    for e in (i1, i2):
        extra = [
            f"{n}={e.counter(n)}"
            for n in (
                "tokens_written",
                "loaded_tokens",
                "load_errors",
                "backend_restarts",
            )
        ]
        lines.append(f"  {e.name}: " + ", ".join(extra))
        if not e.counter("updates_submitted") and not e.counter("updates_skipped"):
            lines.append(
                f"  {e.name}: nothing to save, every whole chunk of its requests "
                "was in vineyard already (partial chunks are not saved)"
            )
        if e.data.get("pending_updates"):
            lines.append(
                f"  {e.name}: {e.data['pending_updates']} update(s) still pending "
                "after --settle-timeout"
            )

    timings = []
    for e in (i1, i2):
        parts = []
        for key, label in (
            ("save_caller", "save on the forward thread"),
            ("update_queue_delay", "queue delay"),
            ("update_exec", "write"),
            ("load", "load on the forward thread"),
        ):
            count, total = e.data.get("histograms", {}).get(
                f"{METRIC_PREFIX}{key}_seconds", (0, 0.0)
            )
            if count:
                parts.append(f"{label} {_ms(total / count)} (x{count})")
        if parts:
            timings.append(f"  {e.name}: " + ", ".join(parts))
    if timings:
        lines += ["", "Mean times (vllm:vineyard_cache_*_seconds histograms):"]
        lines += timings

    compared, mismatches = compare_outputs(engines)
    identical = not mismatches
    i2_hits = i2.counter("hit_tokens")
    checks = {
        "outputs_identical": identical,
        "instance_2_hits": i2_hits > 0,
    }
    lines += [
        "",
        "Checks:",
        f"  outputs identical with and without the cache ({compared} requests): "
        + ("PASS" if identical else f"FAIL ({len(mismatches)} differ)"),
    ]
    lines += [f"    {m}" for m in mismatches[:10]]
    lines.append(
        f"  instance 2 loaded KV that instance 1 saved ({i2_hits} hit tokens): "
        + ("PASS" if i2_hits > 0 else "FAIL")
    )
    lines.append(f"Result: {'PASS' if all(checks.values()) else 'FAIL'}")
    summary = {
        "checks": checks,
        "passed": all(checks.values()),
        "compared": compared,
        "mismatches": mismatches,
        "phases": summary_phases,
        "ttft_s": ttft,
        "hit_rate": hit_rates,
        "counters": {
            e.name: {
                k.removeprefix(METRIC_PREFIX): v
                for k, v in e.data["counters"].items()
                if k.startswith(METRIC_PREFIX)
            }
            for e in (i1, i2)
        },
        "engine_wall_s": {e.name: e.wall_s for e in engines.values()},
        "engine_startup_s": {e.name: e.data.get("startup_s") for e in engines.values()},
        "cache_config": config,
    }
    return "\n".join(lines), summary


# --------------------------------------------------------------------------
# Main.
# --------------------------------------------------------------------------


def prepare_model(args: argparse.Namespace) -> tuple[str, str, int]:
    """(model path, description, vocabulary size)."""
    if args.model:
        path = os.path.abspath(os.path.expanduser(args.model))
        return path, path, model_vocab_size(path)
    from vllm.worker.vineyard_toy_model import ToyLlamaConfig, make_toy_llama

    config = ToyLlamaConfig()
    path = make_toy_llama(os.path.expanduser(args.toy_model_dir), config)
    desc = (
        f"toy Llama at {path} ({config.num_layers} layers, hidden "
        f"{config.hidden_size}, {config.num_kv_heads} KV heads, seeded random "
        "weights)"
    )
    return path, desc, config.vocab_size


def cache_chunk_size() -> int:
    """The chunk size the engines will use (VINEYARD_CACHE_CHUNK_SIZE)."""
    raw = os.environ.get("VINEYARD_CACHE_CHUNK_SIZE", "")
    if raw.strip():
        try:
            return max(1, int(raw))
        except ValueError:
            pass  # the engine reports the bad value at startup
    from vllm.worker.vineyard_llm_cache import ENV_VARS

    return int(ENV_VARS["VINEYARD_CACHE_CHUNK_SIZE"].default)


def prepare_cache_root(args: argparse.Namespace) -> tuple[str, bool]:
    """(root, whether to delete it at the end)."""
    if args.cache_root:
        root = os.path.abspath(os.path.expanduser(args.cache_root))
        if os.path.isdir(root) and os.listdir(root):
            print(f"Emptying the cache root {root} (instance 1 starts cold)")
            shutil.rmtree(root)
        os.makedirs(root, exist_ok=True)
        return root, False
    root = tempfile.mkdtemp(prefix="vineyard-llm-cache-demo-")
    return root, not args.keep_cache


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run_engine:
        _run_engine(args.run_engine)  # does not return
    start = time.perf_counter()
    print("vineyard LLM cache demo")
    print("  preparing the model")
    model, model_desc, vocab_size = prepare_model(args)
    workload = make_workload(args, vocab_size, cache_chunk_size())
    cache_root, delete_root = prepare_cache_root(args)
    workdir = Path(tempfile.mkdtemp(prefix="vineyard-llm-cache-demo-logs-"))
    print(f"  cache root {cache_root}; engine logs in {workdir}")
    engines: dict[str, EngineResult] = {}
    try:
        for i, (name, use_cache) in enumerate(ENGINES, 1):
            what = (
                "vineyard cache ON"
                if use_cache
                else "vineyard cache OFF, vLLM's prefix cache on"
            )
            print(f"[{i}/{len(ENGINES)}] {name} ({what}), a fresh engine process")
            engines[name] = run_engine(
                name, use_cache, model, workload, cache_root, workdir, args
            )
            print(f"  {name} finished in {engines[name].wall_s:.0f} s")
    except RuntimeError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 2
    finally:
        if delete_root:
            shutil.rmtree(cache_root, ignore_errors=True)
    report, summary = build_report(engines, workload, model_desc, cache_root)
    summary["total_s"] = time.perf_counter() - start
    print(report)
    print(f"Total time {summary['total_s']:.0f} s.")
    if args.keep_cache or not delete_root:
        print(f"Cache kept at {cache_root}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    if summary["passed"]:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"Engine logs kept in {workdir}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
