# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which weights serve the engine and each request, resolved as vLLM
resolves them, identified by their bytes
(:func:`~vllm.worker.vineyard.storage.weights.checkpoint_identity`).

- The base model (:func:`model_identity`, once per worker at startup,
  after vLLM loaded it): a local path as it is, a Hub id as the snapshot
  folder vLLM downloaded (the pinned revision, else the one ``refs``
  names), in vLLM's download folder. Weights streamed from object storage
  or ModelScope cannot be identified: the engine runs without the cache.
- LoRA adapters (:class:`AdapterIdentities`, in the scheduler): the path
  as :func:`vllm.lora.utils.get_adapter_absolute_path` resolves it (an
  absolute path, ``~``, a relative path, a Hub id), identified on a
  background thread when first seen, never on the scheduler's thread. An
  adapter that cannot be identified is served without the cache (logged
  once, counted); an adapter vLLM reloads in place (``load_inplace``) is
  identified again for every request (unchanged files cost a ``stat``).
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import vllm.envs as envs
from vllm.logger import init_logger

from vllm.worker.vineyard.storage.weights import (
    FileDigests,
    WeightsUnidentified,
    checkpoint_identity,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

logger = init_logger(__name__)

#: Adapters remembered, at most (their identities; a forgotten one is
#: identified again when it comes back).
MAX_ADAPTERS = 1024


@functools.cache
def file_digests() -> FileDigests:
    """This process's digests of weight files, remembered across restarts
    in vLLM's cache folder."""
    return FileDigests(
        os.path.join(envs.VLLM_CACHE_ROOT, "vineyard_cache", "weight_digests.json")
    )


def model_weights_path(vllm_config: VllmConfig) -> str:
    """The local folder or file the base model's weights were loaded from.
    Raises :class:`WeightsUnidentified`."""
    model_config = vllm_config.model_config
    if model_config.model_weights:
        raise WeightsUnidentified(
            f"weights streamed from {model_config.model_weights!r}"
        )
    model = model_config.model
    if os.path.exists(model):
        return model
    if envs.VLLM_USE_MODELSCOPE:
        raise WeightsUnidentified(f"{model!r} comes from ModelScope")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            model,
            revision=model_config.revision,
            cache_dir=vllm_config.load_config.download_dir,
            local_files_only=True,
        )
    except Exception as e:  # noqa: BLE001 - any Hub error: not identified
        raise WeightsUnidentified(f"no local snapshot of {model!r} ({e})") from e


def model_identity(vllm_config: VllmConfig) -> str:
    """The identity of the base model's weights. Raises
    :class:`WeightsUnidentified`."""
    return checkpoint_identity(model_weights_path(vllm_config), file_digests())


def adapter_identity(lora_path: str) -> str:
    """The identity of an adapter's weights, its path resolved as vLLM's
    workers resolve it (a Hub id is downloaded if it is not in the Hub
    cache, as vLLM would). Raises :class:`WeightsUnidentified`."""
    from vllm.lora.utils import get_adapter_absolute_path

    try:
        path = get_adapter_absolute_path(lora_path)
    except Exception as e:  # noqa: BLE001 - any resolution error
        raise WeightsUnidentified(f"cannot resolve {lora_path!r} ({e})") from e
    return checkpoint_identity(path, file_digests())


#: An adapter's key: vLLM's id, name and path (and the request for an
#: adapter reloaded in place).
_Key = tuple[int, str, str, str]


@dataclass
class _Job:
    lora_path: str
    done: threading.Event = field(default_factory=threading.Event)
    identity: str | None = None  # None: cannot be identified
    why: str = ""


class Pending:
    """An adapter being identified: ask again later."""


PENDING = Pending()


class AdapterIdentities:
    """Identities of LoRA adapters, computed on a background thread.

    :meth:`identity` answers at once: the identity, ``None`` for an
    adapter that cannot be identified, or :data:`PENDING` while it is
    being identified (the caller asks again, as with lookups)."""

    def __init__(self) -> None:
        self._jobs: dict[_Key, _Job] = {}
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._logged: set[str] = set()
        self._thread = threading.Thread(
            target=self._run, name="vineyard-cache-adapters", daemon=True
        )
        self._thread.start()

    @staticmethod
    def _key(lora: LoRARequest, req_id: str) -> _Key:
        # vLLM reads an adapter once per id, or for every request that
        # reloads it in place.
        request = req_id if lora.load_inplace else ""
        return (lora.lora_int_id, lora.lora_name, lora.lora_path, request)

    def identity(
        self,
        lora: LoRARequest,
        request: Request,
        deadline: float = float("inf"),
        wait_s: float = 0.0,
    ) -> str | None | Pending:
        """The identity of ``request``'s adapter ``lora``, ``None`` if it
        cannot be identified (or not by ``deadline``, monotonic), or
        :data:`PENDING` (after waiting up to ``wait_s``)."""
        req_id = request.request_id
        key = self._key(lora, req_id)
        job = self._jobs.get(key)
        if job is None:
            while len(self._jobs) >= MAX_ADAPTERS:
                del self._jobs[next(iter(self._jobs))]
            job = self._jobs[key] = _Job(lora.lora_path)
            self._queue.put(job)
        if not job.done.wait(wait_s):
            return PENDING if time.monotonic() < deadline else None
        if job.identity is None and lora.lora_path not in self._logged:
            self._logged.add(lora.lora_path)
            logger.warning(
                "vineyard cache off for LoRA adapter %r: its weights cannot be "
                "identified (%s); its requests are served without the cache",
                lora.lora_name,
                job.why,
            )
        return job.identity

    def forget(self, lora: LoRARequest, req_id: str) -> None:
        """A request is done: an in-place adapter's per-request answer goes."""
        if lora.load_inplace:
            self._jobs.pop(self._key(lora, req_id), None)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                job.identity = adapter_identity(job.lora_path)
            except WeightsUnidentified as e:
                job.why = str(e)
            except Exception as e:  # noqa: BLE001 - never the engine's error
                job.why = f"{type(e).__name__}: {e}"
            job.done.set()

    def close(self) -> None:
        self._queue.put(None)
