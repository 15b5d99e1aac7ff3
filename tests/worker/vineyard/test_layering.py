# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The package's folders are its layers, and the imports say so.

``connector/`` (vLLM's hooks) -> the cache (``vineyard_llm_cache.py``) ->
``transfer/`` (torch) and ``backend/`` -> ``storage/`` -> the top-level
modules (config, metrics, logging). ``storage/`` and ``backend/`` import
neither vLLM nor torch: backend processes and the operator's tool run them
without either. No module imports one of a layer above it, and the import
graph has no cycle. Every module is small: at most :data:`MAX_LINES` lines.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "vllm.worker.vineyard"
SRC = Path(__file__).resolve().parents[3] / "vllm" / "worker"
ENTRY = "vllm.worker.vineyard_llm_cache"

#: Most lines a module may have: past this, it is split along a seam.
MAX_LINES = 500

#: Lower number = lower layer; a module may import its own layer and below.
LAYERS = {
    "connector": 4,
    "plugin": 4,
    "cache": 3,  # vineyard_llm_cache.py
    "transfer": 2,
    "backend": 2,
    "cli": 2,
    "storage": 1,
    "config": 0,
    "metrics": 0,
    "log_limiter": 0,
    "cores": 0,
    "launch": 0,
    "package": 0,  # its __init__ (empty)
}
#: Folders that run without vLLM and torch.
NO_VLLM_NO_TORCH = (
    "storage",
    "backend",
    "cli",
    "config",
    "metrics",
    "log_limiter",
    "cores",
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def part_of(module: str) -> str | None:
    """The layer a module of this project belongs to, or ``None``."""
    if module == ENTRY:
        return "cache"
    if module == PACKAGE:
        return "package"
    if not module.startswith(PACKAGE + "."):
        return None
    return module[len(PACKAGE) + 1 :].split(".")[0]


def project_modules() -> dict[str, Path]:
    files = [SRC / "vineyard_llm_cache.py", *sorted((SRC / "vineyard").rglob("*.py"))]
    return {module_name(path): path for path in files}


def imports_of(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports (also inside functions and
    ``TYPE_CHECKING`` blocks)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                base = ".".join(module.split(".")[: -node.level] + [node.module])
            found.add(base)
            # ``from package import module`` imports that module.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


MODULES = project_modules()
GRAPH = {
    module: {
        imported
        for imported in imports_of(path, module)
        if imported in MODULES and imported != module
    }
    for module, path in MODULES.items()
}


def test_every_module_is_in_a_layer() -> None:
    unknown = {m for m in MODULES if part_of(m) not in LAYERS}
    assert not unknown, f"modules outside the known layers: {sorted(unknown)}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    layer = part_of(module)
    assert layer is not None
    upward = [
        imported
        for imported in GRAPH[module]
        if (part := part_of(imported)) is not None and LAYERS[part] > LAYERS[layer]
    ]
    assert not upward, f"{module} ({layer}) imports a layer above it: {upward}"


@pytest.mark.parametrize(
    "module", sorted(m for m in MODULES if part_of(m) in NO_VLLM_NO_TORCH)
)
def test_no_vllm_no_torch_by_source(module: str) -> None:
    outside = [
        imported
        for imported in imports_of(MODULES[module], module)
        if imported.split(".")[0] == "torch"
        or (imported.split(".")[0] == "vllm" and part_of(imported) is None)
    ]
    assert not outside, f"{module} imports {outside}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_are_small(module: str) -> None:
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{module} has {lines} lines (at most {MAX_LINES})"


def test_no_import_cycle() -> None:
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module) :] + [module]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for imported in sorted(GRAPH[module]):
            visit(imported, [*path, module])
        done.add(module)

    for module in sorted(MODULES):
        visit(module, [])


def test_no_vllm_no_torch_when_imported() -> None:
    """What the backend processes and the operator's tool import, imported
    as the launcher does (vLLM's package stood in for): neither torch nor
    any vLLM module comes along."""
    modules = sorted(m for m in MODULES if part_of(m) in NO_VLLM_NO_TORCH)
    launcher = str(SRC / "vineyard" / "launch.py")
    code = f"""
import importlib, importlib.util, sys
spec = importlib.util.spec_from_file_location("launch", {launcher!r})
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)
launch.stand_in_for_vllm()
for name in {modules!r}:
    importlib.import_module(name)
loaded = [m for m in sys.modules if m.split(".")[0] == "torch"
          or (m.split(".")[0] == "vllm" and not m.startswith("vllm.worker")
              and m != "vllm")]
print(",".join(loaded))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"imported: {done.stdout.strip()}"
