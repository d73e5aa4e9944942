"""Import shims for running OpenRLHF on a CPU machine (tests only).

* ``flash_attn`` is an sdist that cannot build without CUDA, yet ``openrlhf.models.ring_attn_utils``
  imports it at module level (only ring attention uses it). Stubs raise if anything actually calls them.
* ``datasets`` (HF) is an OpenRLHF dependency this venv does not install; ``openrlhf.trainer.ppo_trainer`` imports
  it at module level (through ``openrlhf.datasets``), and no test loads a dataset.
* ``vllm`` (the CUDA distribution OpenRLHF names) is not installed here; ``openrlhf.trainer.ray`` imports
  a few names from it at module level. Rollouts are not run in these tests, so stubs that raise on use
  are enough; a test that would need real vLLM must skip with a reason instead.

All are installed only when the real package is missing. Every stub module gets a ``__spec__``:
transformers' availability checks call ``importlib.util.find_spec`` and raise on a module without one.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types


def _unavailable(qualname: str):
    def stub(*args, **kwargs):
        raise RuntimeError(f"{qualname} is a CPU test stub (the real package is not installed here)")

    stub.__qualname__ = stub.__name__ = qualname.rsplit(".", 1)[-1]
    return stub


def _module(name: str, attrs=(), **values) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    mod.__path__ = []
    mod.__faircast_test_stub__ = True
    for attr in attrs:
        setattr(mod, attr, _unavailable(f"{name}.{attr}"))
    for k, v in values.items():
        setattr(mod, k, v)
    return mod


def _install(tree: dict) -> None:
    for name, (attrs, values) in tree.items():
        if name not in sys.modules:
            sys.modules[name] = _module(name, attrs, **values)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, sys.modules[name])


def install() -> None:
    if importlib.util.find_spec("flash_attn") is None:
        _install({
            "flash_attn": ((), {"__version__": "0.0.0+cpu-test-stub"}),
            "flash_attn.bert_padding": (("index_first_axis", "pad_input", "rearrange", "unpad_input"), {}),
            "flash_attn.utils": ((), {}),
            "flash_attn.utils.distributed": (("all_gather",), {}),
        })
    if importlib.util.find_spec("datasets") is None:  # openrlhf.trainer.ppo_trainer imports it via openrlhf.datasets
        _install({"datasets": (("Dataset", "interleave_datasets", "load_dataset", "load_from_disk"), {})})
    if importlib.util.find_spec("vllm") is None:
        _install({
            "vllm": (("LLM", "SamplingParams"), {"__version__": "0.29.0"}),
            "vllm.inputs": (("TokensPrompt",), {}),
            "vllm.utils": (("random_uuid",), {}),
            "vllm.distributed": ((), {}),
            "vllm.distributed.device_communicators": ((), {}),
            "vllm.distributed.device_communicators.pynccl": (("PyNcclCommunicator",), {}),
            "vllm.distributed.utils": (("StatelessProcessGroup",), {}),
        })
