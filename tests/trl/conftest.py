"""Fixtures for the TRL adapter tests: a tiny random Qwen3 and a locally trained tokenizer, no downloads.

The builder is the example's own (examples/trl/tiny.py): shaped so vLLM's CPU attention accepts it (head_dim 32)
and saved in bf16, the dtype the colocate vLLM engine serves; the trainers load it as fp32 (their default), so
the masters start on the bf16 grid.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "trl")
sys.path.insert(0, os.path.abspath(EXAMPLES))
from tiny import PROMPTS, build_model, build_tokenizer, cat_reward, make_tiny  # noqa: E402,F401  (the example's builder)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return make_tiny(str(tmp_path_factory.mktemp("tiny-qwen3")))


@pytest.fixture(scope="session")
def prompts_dataset():
    from datasets import Dataset

    prompts = PROMPTS
    return Dataset.from_dict({"prompt": prompts})



@pytest.fixture(autouse=True)
def _no_llvmlite_next_to_vllm():
    """A test that imports numba (llvmlite) in this process breaks every later test that builds a vLLM CPU engine
    (vLLM's kernel-override scan crashes on llvmlite's objects; faircast_plugins.cast.numba_blocked_reason): fail
    that test, by name, instead of the unrelated ones after it. Use backend='torch' in-process, or a subprocess."""
    before = "llvmlite" in sys.modules
    yield
    if not before and "llvmlite" in sys.modules:
        pytest.fail("this test imported numba/llvmlite into the pytest process: later vLLM CPU engines would fail to "
                    "build; use backend='torch' here or run the numba kernel in a subprocess")


@pytest.fixture(autouse=True)
def _isolated_environment():
    """Undo environment changes after each test: TRL's colocated vLLM sets RANK/LOCAL_RANK/WORLD_SIZE/MASTER_PORT
    in this process (vllm_generation.py), and a later test's subprocess would otherwise start a process group on a
    port this process still holds (EADDRINUSE)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
