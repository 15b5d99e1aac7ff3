# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Runs one real vLLM engine per process for the engine-level tests of the
vineyard KV cache, and helpers to build prompts and read the results.

vLLM reads its environment at plugin-load time (and lazily after), and its
metrics live in a per-process Prometheus registry, so every engine runs in a
process of its own: the parent (pytest) writes a JSON spec, starts this file
with the engine's environment (forked from a server that has imported vLLM
already, or as a new interpreter with ``VINEYARD_ENGINE_TESTS_FORK_SERVER=0``)
and reads back a JSON result; the engine's log stays beside it.

A spec is ``{"llm_kwargs": {...}, "rounds": [ROUND, ...], "settle_s": S}``.
In each ``ROUND`` the ``prompts`` (token id lists) are generated greedily
(``temperature=0, ignore_eos``, ``max_tokens``) in one ``LLM.generate`` call,
or one call per prompt (``one_by_one``), with a LoRA adapter
(``lora``: ``[name, id, path]``), as seeded random prompt embeddings instead
of the prompts (``prompt_embeds``: ``[[seed, tokens, hidden size], ...]``),
or step by step with the cache's
writer backends stopped until every request has its first token
(``stop_writer_during_prefill``), all with one ``cache_salt`` if a round
gives one; ``freeze_file`` is created for the round's generation and removed
after it (the freeze switch of a ``slow_fs.py`` cache root), and
``fs_control`` (``[path, {...}]``) is merged into that root's control file
before it (its latency, read link or EIO files change);
``kv_transfer_params`` go with every request of the round. Before the
prompts, ``gate`` (a path) holds the round until the test lets it go (see
:func:`wait_at_gate`; to change the world between rounds of a running
engine), ``pause_s`` waits (for background work such as a sweep), ``kill_backends``
SIGKILLs every vineyard backend process below the engine and ``break_path``
replaces that directory (the cache root) by a regular file. After each round
the runner waits (up to ``S`` seconds) until every update the cache submitted
is done, stepping the engine with a one-token prompt so the worker reports
its counters, and then reads ``LLM.get_metrics()``. The result is written
before the engine shuts down and again after: an orderly shutdown (drain
and backends stopped) longer than :data:`SHUTDOWN_BOUND_S` fails the run
(``error`` set, exit code :data:`SHUTDOWN_HUNG_EXIT`) without hanging it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.vineyard_testing import engine_cpu, random_tokens

#: vLLM block size of every test engine, and the cache's chunk size: the
#: default (``VINEYARD_CACHE_CHUNK_SIZE`` unset), one block.
from vllm.worker.vineyard import launch

BLOCK_SIZE = 64
CHUNK_SIZE = BLOCK_SIZE
METRIC_PREFIX = "vllm:vineyard_cache_"
#: Modules that must stay unimported when the cache is off.
VINEYARD_MODULES = (
    "vineyard",
    "vineyard.llm",
    "vllm.worker.vineyard.connector.vineyard_connector",
    "vllm.worker.vineyard_llm_cache",
    "vllm.worker.vineyard.backend.client",
)
_BACKEND_COMMAND = launch.command("backend")[1:]
_FLUSH_PROMPT = [7]  # shorter than a block: nothing to look up or save
#: Longest orderly engine shutdown (drain timeout, 5 s by default, plus
#: stopping the backends); beyond it the engine test fails.
SHUTDOWN_BOUND_S = 30.0
SHUTDOWN_HUNG_EXIT = 3
#: How long a round's ``gate`` waits for the test.
GATE_TIMEOUT_S = 300.0

#: ``factory(**ToyLlamaConfig fields) -> checkpoint dir`` (a fixture).
ModelFactory = Callable[..., str]
#: ``reference(model, prompts, max_tokens=8, **llm_kwargs) -> EngineRun``.
ReferenceRunner = Callable[..., "EngineRun"]

DEFAULT_LLM_KWARGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "enforce_eager": True,
    "max_model_len": 4096,
    "max_num_batched_tokens": 1024,
    "block_size": BLOCK_SIZE,
    "dtype": "float32",
    "disable_log_stats": False,
    "seed": 0,
}


# --------------------------------------------------------------------------
# Parent side (pytest).
# --------------------------------------------------------------------------


def standard_prompts() -> list[list[int]]:
    """Three prompts of 1.2k-1.7k tokens, two sharing a 1024-token prefix."""
    rng = random.Random(11)
    base = random_tokens(rng, 1024)
    return [
        base + random_tokens(rng, 500),
        base + random_tokens(rng, 700),
        random_tokens(rng, 1300),
    ]


def whole_chunks(num_tokens: int, chunk_size: int = CHUNK_SIZE) -> int:
    """Tokens in the whole chunks of ``num_tokens``."""
    return num_tokens // chunk_size * chunk_size


def cacheable_prefix(prompt_len: int, chunk_size: int = CHUNK_SIZE) -> int:
    """The most a prompt can get from the cache: whole chunks, leaving at
    least one token to compute."""
    return whole_chunks(prompt_len - 1, chunk_size)


def saved_tokens(prompt_len: int, max_tokens: int, chunk: int = CHUNK_SIZE) -> int:
    """Tokens a request saves: whole chunks of the tokens whose KV was
    computed (the last sampled token never is)."""
    return whole_chunks(prompt_len + max_tokens - 1, chunk)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def flip_a_payload_byte(path: str | os.PathLike[str]) -> None:
    """Bit rot at rest: one KV byte of a chunk file's last entry flipped
    (before its trailer)."""
    with open(path, "r+b") as f:
        f.seek(-200, os.SEEK_END)
        byte = f.read(1)
        f.seek(-200, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))


def engine_env(
    cache_root: str | os.PathLike[str] | None,
    *,
    use_cache: bool = True,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of one engine: nothing inherited from the caller's
    vineyard settings; with ``use_cache`` only ``VLLM_USE_VINEYARD_CACHE=1``
    turns the cache on."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VINEYARD_", "VLLM_USE_VINEYARD"))
        and k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "POD_NAME")
    }
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=str(engine_cpu()),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VINEYARD_CACHE_BACKEND_TIMEOUT_S="20",
        # A loaded test machine must not turn a slow lookup into a miss (the
        # frozen-root test sets its own deadline).
        VINEYARD_CACHE_LOOKUP_TIMEOUT_S="30",
        # Every hit is loaded, whatever the machine's load: the tests count
        # them (the load-or-compute decision has tests of its own).
        VINEYARD_CACHE_LOAD_POLICY="always",
        PYTHONUNBUFFERED="1",
    )
    if cache_root is not None:
        env["VINEYARD_CACHE_ROOT"] = str(cache_root)
    if use_cache:
        env["VLLM_USE_VINEYARD_CACHE"] = "1"
    env.update(extra or {})
    return env


@dataclass
class Round:
    """One ``generate`` call (or one per prompt) and what it returned."""

    outputs: list[list[int]]
    num_cached_tokens: list[int]
    wall_s: float
    metrics: dict[str, Any]  # cumulative, after the round settled
    settled: bool
    killed_backends: int
    writer_stopped_s: float  # how long the writers were stopped (SIGSTOP)

    def counter(self, name: str) -> int:
        """A ``vllm:vineyard_cache_*`` counter (or another by full name)."""
        key = name if name.startswith("vllm:") else METRIC_PREFIX + name
        return int(self.metrics.get(key, 0))

    def histogram(self, name: str) -> tuple[int, float]:
        """``(count, sum)`` of a histogram, by full name."""
        value = self.metrics.get(name) or {"count": 0, "sum": 0.0}
        return int(value["count"]), float(value["sum"])


@dataclass
class EngineRun:
    returncode: int
    error: str | None
    rounds: list[Round] = field(default_factory=list)
    modules: dict[str, bool] = field(default_factory=dict)
    log: str = ""
    shutdown_s: float | None = None  # None: no engine to shut down

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.error is None

    @property
    def last(self) -> Round:
        return self.rounds[-1]

    def delta(self, index: int, name: str) -> int:
        """How much a counter grew during round ``index``."""
        before = self.rounds[index - 1].counter(name) if index > 0 else 0
        return self.rounds[index].counter(name) - before

    def vineyard_metric_names(self) -> list[str]:
        return sorted(
            name
            for r in self.rounds
            for name in r.metrics
            if name.startswith(METRIC_PREFIX)
        )


def _harness_command(*args: str) -> list[str]:
    """This module run as a program (a new interpreter that imports it)."""
    return [sys.executable, "-m", __name__, *args]


def _importing_tests(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the repository root on ``PYTHONPATH``, so that ``tests``
    imports as a package wherever the process runs."""
    root = str(Path(__file__).resolve().parents[1])
    path = [root, *filter(None, [env.get("PYTHONPATH")])]
    return {**env, "PYTHONPATH": os.pathsep.join(path)}


def _run_fresh(
    spec_path: Path,
    env: Mapping[str, str],
    workdir: Path,
    log_path: Path,
    timeout_s: float,
) -> int:
    """The engine in a fresh interpreter: slower (it imports vLLM again)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            _harness_command(str(spec_path)),
            env=_importing_tests(env),
            cwd=str(workdir),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return -signal.SIGKILL


class _ForkServer:
    """A process that has imported vLLM once and forks one child per engine.

    Importing vLLM takes 5-15 s on a small machine, more than starting the
    engine itself. The fork happens before any engine exists, with the
    engine's environment installed in the child before ``LLM(...)`` loads
    the plugins and reads ``vllm.envs`` (lazily), so each child is as fresh
    as a new interpreter for what the tests vary: environment, plugins,
    metrics registry, loaded modules (nothing of vineyard is imported by
    the server). Child processes vLLM spawns are fresh interpreters anyway.
    """

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            _harness_command("--fork-server"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_importing_tests(engine_env(None, use_cache=False)),
            start_new_session=True,
        )

    def _read(self, timeout_s: float) -> dict[str, Any] | None:
        import selectors

        assert self._proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                return None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("the engine fork server died")
        return json.loads(line)

    def run(
        self,
        spec_path: Path,
        env: Mapping[str, str],
        workdir: Path,
        log_path: Path,
        timeout_s: float,
    ) -> int:
        assert self._proc.stdin is not None
        request = {
            "spec": str(spec_path),
            "env": dict(env),
            "cwd": str(workdir),
            "log": str(log_path),
        }
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        self._proc.stdin.flush()
        started = self._read(120)
        if started is None:
            raise RuntimeError("the engine fork server does not answer")
        done = self._read(timeout_s)
        if done is None:
            # The child leads its own process group (vLLM's engine and
            # worker processes included).
            os.killpg(started["pid"], signal.SIGKILL)
            done = self._read(30)
            return -signal.SIGKILL
        return int(done["exit"])

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()


_server: _ForkServer | None = None


def _fork_server() -> _ForkServer:
    global _server
    if _server is None:
        import atexit

        _server = _ForkServer()
        atexit.register(_server.close)
    return _server


def run_engine(
    model: str,
    rounds: Sequence[Mapping[str, Any]],
    env: Mapping[str, str],
    workdir: Path,
    *,
    llm_kwargs: Mapping[str, Any] | None = None,
    settle_s: float = 30.0,
    timeout_s: float = 240.0,
    expect_ok: bool = True,
    fresh: bool = False,
) -> EngineRun:
    """Start an engine in a fresh process, run ``rounds``, return what it
    did. ``workdir`` keeps the spec, result and log (a failing test shows
    the log's tail). The process is forked from a server that has imported
    vLLM already (one engine at a time); ``fresh`` or
    ``VINEYARD_ENGINE_TESTS_FORK_SERVER=0`` starts a new interpreter
    instead (for an engine that runs beside another)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    result_path = workdir / "result.json"
    log_path = workdir / "engine.log"
    result_path.unlink(missing_ok=True)
    spec = {
        "llm_kwargs": {**DEFAULT_LLM_KWARGS, **(llm_kwargs or {}), "model": model},
        "rounds": [
            {
                "max_tokens": 8,
                "one_by_one": False,
                "kill_backends": False,
                "stop_writer_during_prefill": False,
                "break_path": None,
                "pause_s": 0.0,
                "gate": None,
                "cache_salt": None,
                "lora": None,
                "prompt_embeds": None,
                "freeze_file": None,
                "fs_control": None,
                "kv_transfer_params": None,
                **r,
            }
            for r in rounds
        ],
        "settle_s": settle_s,
        "result": str(result_path),
    }
    spec_path.write_text(json.dumps(spec))
    if not fresh and os.environ.get("VINEYARD_ENGINE_TESTS_FORK_SERVER", "1") == "1":
        returncode = _fork_server().run(spec_path, env, workdir, log_path, timeout_s)
    else:
        returncode = _run_fresh(spec_path, env, workdir, log_path, timeout_s)
    log_text = log_path.read_text(errors="replace")
    if returncode == -signal.SIGKILL and not result_path.exists():
        raise AssertionError(
            f"engine did not finish within {timeout_s} s; log tail:\n"
            + log_text[-6000:]
        )
    result: dict[str, Any] = {}
    if result_path.exists():
        result = json.loads(result_path.read_text())
    run = EngineRun(
        returncode=returncode,
        error=result.get("error") if result else "no result written",
        rounds=[Round(**r) for r in result.get("rounds", [])],
        modules=result.get("modules", {}),
        log=log_text,
        shutdown_s=result.get("shutdown_s"),
    )
    if expect_ok and not run.ok:
        raise AssertionError(
            f"engine failed (exit code {returncode}): {run.error}\nlog tail:\n"
            + log_text[-6000:]
        )
    return run


# --------------------------------------------------------------------------
# Engine side (this file run as a script).
# --------------------------------------------------------------------------


def wait_at_gate(
    gate: Path,
    timeout_s: float = GATE_TIMEOUT_S,
    running: Callable[[], bool] = lambda: True,
) -> None:
    """Until the engine reached the round held at ``gate`` (a round's
    ``gate`` path), having finished the rounds before it; fails when
    ``running()`` turns false first (the engine ended)."""
    ready = gate.with_name(gate.name + ".ready")
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        assert running(), f"the engine ended before reaching {gate.name}"
        assert time.monotonic() < deadline, f"no engine at {gate.name} in {timeout_s} s"
        time.sleep(0.1)


def open_gate(gate: Path) -> None:
    """Let the round held at ``gate`` run."""
    gate.with_name(gate.name + ".go").touch()


def _read_metrics(llm: Any) -> dict[str, Any]:
    from vllm.v1.metrics.reader import Counter, Histogram

    out: dict[str, Any] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter):
            out[metric.name] = out.get(metric.name, 0) + metric.value
        elif isinstance(metric, Histogram) and metric.name.startswith(METRIC_PREFIX):
            prev = out.get(metric.name, {"count": 0, "sum": 0.0})
            out[metric.name] = {
                "count": prev["count"] + metric.count,
                "sum": prev["sum"] + metric.sum,
            }
    return out


def _pending_updates(metrics: Mapping[str, Any]) -> int:
    def get(name: str) -> int:
        return int(metrics.get(METRIC_PREFIX + name, 0))

    return get("updates_submitted") - (
        get("updates_completed") + get("updates_failed") + get("updates_dropped")
    )


def _backends(kind: str | None = None) -> list[Any]:
    """The vineyard backend processes below this one (the workers' readers
    and writers, not the scheduler's lookup processes); ``kind`` "write" or
    "read" picks by their spec: the writer is the one that sweeps the root."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = child.cmdline()
        except psutil.Error:
            continue
        if cmdline[1:3] != _BACKEND_COMMAND:
            continue
        try:
            spec = json.loads(cmdline[cmdline.index("--spec") + 1])
        except (ValueError, IndexError):
            continue
        if spec.get("role") == "lookup":
            continue  # the scheduler's, not a worker's
        if kind is not None and bool(spec.get("sweep")) != (kind == "write"):
            continue
        found.append(child)
    return found


def _kill_backends() -> int:
    import psutil

    victims = _backends()
    for child in victims:
        child.kill()
    psutil.wait_procs(victims, timeout=10)
    return len(victims)


def _generate_with_stopped_writer(
    llm: Any, prompts: list[Any], params: Any, tag: str
) -> tuple[list[Any], float]:
    """Generate step by step with every writer backend stopped (SIGSTOP)
    until each request has its first output token, i.e. through the whole
    prefill: the cache's single in-flight update cannot finish, so every
    other save of the prefill finds the pool empty."""
    writers = _backends("write")
    if not writers:
        raise RuntimeError("no vineyard writer backend found")
    start = time.perf_counter()
    stopped_s = 0.0
    engine = llm.llm_engine
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for writer in writers:
        writer.suspend()
    try:
        for req_id, prompt in zip(ids, prompts, strict=True):
            engine.add_request(req_id, prompt, params)
        started: set[str] = set()
        finished: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs and out.outputs[0].token_ids:
                    started.add(out.request_id)
                if out.finished:
                    finished[out.request_id] = out
            if writers and len(started) == len(ids):
                _note(f"prefill done, resuming {len(writers)} writer(s)")
                stopped_s = time.perf_counter() - start
                for writer in writers:
                    writer.resume()
                writers = []
    finally:
        for writer in writers:
            writer.resume()
    return [finished[req_id] for req_id in ids], stopped_s


def _embeds_prompt(seed: int, num_tokens: int, hidden_size: int) -> Any:
    import torch
    from vllm.inputs import EmbedsPrompt

    gen = torch.Generator().manual_seed(seed)
    return EmbedsPrompt(
        prompt_embeds=torch.randn(num_tokens, hidden_size, generator=gen)
    )


def _note(what: str) -> None:
    print(f"[engine-test {time.strftime('%H:%M:%S')}] {what}", flush=True)


def _main(spec_path: str) -> None:
    _note("importing vllm")
    with open(spec_path) as f:
        spec = json.load(f)
    result: dict[str, Any] = {"rounds": [], "error": None}
    llm = None
    try:
        from vllm.inputs import TokensPrompt

        from vllm import LLM, SamplingParams

        llm = LLM(**spec["llm_kwargs"])
        _note("engine ready")
        flush = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for r in spec["rounds"]:
            if r["gate"]:
                Path(r["gate"] + ".ready").touch()
                _wait_for(Path(r["gate"] + ".go"), GATE_TIMEOUT_S)
            time.sleep(r["pause_s"])  # e.g. for a background sweep to run
            killed = _kill_backends() if r["kill_backends"] else 0
            if r["break_path"]:
                # The cache root turns into a regular file under the engine.
                shutil.rmtree(r["break_path"])
                with open(r["break_path"], "w") as f:
                    f.write("not a directory")
            _note(f"round {len(result['rounds'])}: {killed} backend(s) killed")
            if r["fs_control"]:  # a slow_fs.py root's link or latency changes
                _merge_json(*r["fs_control"])
            params = SamplingParams(
                temperature=0,
                max_tokens=r["max_tokens"],
                ignore_eos=True,
                extra_args=(
                    {"kv_transfer_params": r["kv_transfer_params"]}
                    if r["kv_transfer_params"] is not None
                    else None
                ),
            )
            prompts = [TokensPrompt(prompt_token_ids=p) for p in r["prompts"]]
            if r["prompt_embeds"]:
                prompts = [_embeds_prompt(*e) for e in r["prompt_embeds"]]
            if r["cache_salt"] is not None:
                for prompt in prompts:
                    prompt["cache_salt"] = r["cache_salt"]
            if r["freeze_file"]:  # a FUSE cache root stops answering
                Path(r["freeze_file"]).touch()
            start = time.perf_counter()
            writer_stopped_s = 0.0
            if r["stop_writer_during_prefill"]:
                tag = f"round{len(result['rounds'])}"
                outs, writer_stopped_s = _generate_with_stopped_writer(
                    llm, prompts, params, tag
                )
            elif r["one_by_one"]:
                outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
            else:
                from vllm.lora.request import LoRARequest

                lora = LoRARequest(*r["lora"]) if r["lora"] else None
                outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
            wall_s = time.perf_counter() - start
            if r["freeze_file"]:
                Path(r["freeze_file"]).unlink()
            # Let the background writes finish, and step the engine so that
            # the worker reports them.
            deadline = time.monotonic() + spec["settle_s"]
            metrics = _read_metrics(llm)
            while _pending_updates(metrics) > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
                llm.generate(
                    [TokensPrompt(prompt_token_ids=_FLUSH_PROMPT)],
                    flush,
                    use_tqdm=False,
                )
                metrics = _read_metrics(llm)
            result["rounds"].append(
                {
                    "outputs": [list(o.outputs[0].token_ids) for o in outs],
                    "num_cached_tokens": [o.num_cached_tokens or 0 for o in outs],
                    "wall_s": wall_s,
                    "metrics": metrics,
                    "settled": _pending_updates(metrics) <= 0,
                    "killed_backends": killed,
                    "writer_stopped_s": writer_stopped_s,
                }
            )
    except Exception as e:  # reported to the test
        import traceback

        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
    result["modules"] = {name: name in sys.modules for name in VINEYARD_MODULES}
    _write_result(spec["result"], result)
    _note(f"rounds done, error: {result['error']}")
    exit_code = 0
    if llm is not None:
        # An orderly shutdown (the connector drains and stops its backends)
        # must finish within SHUTDOWN_BOUND_S: one that hangs fails the
        # test (reported in the result and by the exit code) instead of
        # hanging it.
        import threading

        stopper = threading.Thread(
            target=llm.llm_engine.engine_core.shutdown, daemon=True
        )
        start = time.perf_counter()
        stopper.start()
        stopper.join(SHUTDOWN_BOUND_S)
        hung = stopper.is_alive()
        result["shutdown_s"] = round(time.perf_counter() - start, 3)
        if hung:
            exit_code = SHUTDOWN_HUNG_EXIT
            result["error"] = result["error"] or (
                f"engine shutdown did not finish within {SHUTDOWN_BOUND_S} s"
            )
        _write_result(spec["result"], result)
        _note("shutdown hangs" if hung else f"shut down in {result['shutdown_s']} s")
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: engine threads and atexit hooks can hang on
    # an engine that failed mid-startup; the backends exit when we do.
    os._exit(exit_code)


def _merge_json(path: str, values: Mapping[str, Any]) -> None:
    """Merge ``values`` into the JSON object at ``path`` (written whole)."""
    target = Path(path)
    doc = json.loads(target.read_text()) if target.exists() else {}
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps({**doc, **values}))
    tmp.replace(target)


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.1)


def _write_result(path: str, result: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def _serve_forks() -> None:
    """The fork server: reads one JSON request per line on stdin, forks a
    child that runs :func:`_main` with the request's environment, working
    directory and log, and answers ``{"pid"}`` at once, ``{"exit"}`` when
    the child has exited."""
    from vllm.v1.metrics.reader import Counter  # noqa: F401

    import vllm  # noqa: F401 - what the children are spared
    from vllm import LLM, SamplingParams  # noqa: F401

    # Anything printed would corrupt the replies: keep stdout for them.
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the child
            try:
                os.setsid()
                os.environ.clear()
                os.environ.update(request["env"])
                os.chdir(request["cwd"])
                log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.close(log)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                replies.close()
                _main(request["spec"])
            finally:
                os._exit(1)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(
            json.dumps({"pid": pid, "exit": os.waitstatus_to_exitcode(status)}) + "\n"
        )


if __name__ == "__main__":
    if sys.argv[1] == "--fork-server":
        _serve_forks()
    else:
        _main(sys.argv[1])
