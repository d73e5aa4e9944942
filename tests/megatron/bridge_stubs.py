"""Import stand-ins for TransformerEngine and Triton, so that megatron-bridge's modules import on a CPU machine
without them (test-only). They are empty modules whose every attribute is a dummy class, so code that checks for
TransformerEngine would think it present: :func:`bridge_imports` puts them on the import path only while
megatron-bridge (0.3.1, 0.5.1, 0.6.2) and verl's bridge module import, then takes them away again, so megatron-core,
imported before and run after, never sees TransformerEngine. Triton is stubbed only where it does not import
(megatron-core 0.18+ imports the real one at module level; its CPU wheel installs)."""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class _Anything(type):
    """A dummy class: any attribute is another one, calling it with a function returns the function (decorators)."""

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return cls

    def __getitem__(cls, item):
        return cls

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (object,), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Anything(name, (object,), {})
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0+stub"
        return module

    def exec_module(self, module):
        pass


def python312_names() -> None:
    """``typing.override`` (Python 3.12) on 3.11: the megatron-core 0.18.2 / 0.19.2 wheels (cp311 builds that declare
    Requires-Python >=3.12) ship ``megatron/training/models/hybrid.py``, which megatron-bridge imports, and megatron-bridge
    0.5.1 / 0.6.2's ``gpt_builder.py`` / ``mamba_builder.py`` import it; nothing else they import needs 3.12."""
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


@contextlib.contextmanager
def bridge_imports(roots=("transformer_engine", "triton")):
    """Stub ``roots`` that do not import, only for the duration of the ``with`` block (megatron-bridge's imports).

    nvidia-modelopt (a real import of megatron-bridge 0.5+) registers TransformerEngine classes when it sees them, so
    it is imported before the stub goes in."""
    import megatron.core.optimizer  # noqa: F401  megatron-core's own modules first: they must not see the stub

    python312_names()
    for real in ("modelopt.torch.opt", "modelopt.torch.quantization"):
        try:
            if importlib.util.find_spec(real.split(".")[0]) is not None:
                __import__(real)
        except ImportError:
            pass
    missing = []
    for root in roots:
        try:
            __import__(root)
        except ImportError:
            missing.append(root)
    finder = _Finder(missing)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] in finder.roots]:
            del sys.modules[name]


def import_bridge() -> bool:
    """Import megatron-bridge (and verl's bridge module, where verl is installed) behind :func:`bridge_imports`.
    False if megatron-bridge is not installed."""
    if importlib.util.find_spec("megatron.bridge") is None:
        return False
    with bridge_imports():
        import megatron.bridge  # noqa: F401
        import megatron.bridge.models.conversion.auto_bridge  # noqa: F401
        import megatron.bridge.models.conversion.param_mapping  # noqa: F401
        import megatron.bridge.models.llama.llama_bridge  # noqa: F401
        for optional in ("megatron.bridge.models.qwen.qwen3_moe_bridge", "megatron.bridge.models.gpt_provider",
                         "verl.models.mcore.bridge"):
            try:
                if importlib.util.find_spec(optional.rsplit(".", 1)[0]) is not None:
                    __import__(optional)
            except ImportError:
                pass
    return True


def llama_model_bridge():
    """megatron-bridge's LlamaBridge (the model bridge whose mappings verl's export runs), or None if not installed.
    Use it after Megatron's model parallelism is initialised: each mapping keeps the process groups of when its
    ``mapping_registry()`` is built."""
    if not import_bridge():
        return None
    from megatron.bridge.models.llama.llama_bridge import LlamaBridge

    return LlamaBridge()


def llama_mapping_registry():
    """:func:`llama_model_bridge`'s mapping registry, or None."""
    bridge = llama_model_bridge()
    return None if bridge is None else bridge.mapping_registry()


def qwen3_moe_mapping_registry():
    """megatron-bridge's Qwen3MoEBridge mapping registry (Qwen3-MoE: per-expert ``local_experts.E`` mappings, the
    router as ``mlp.gate``), or None if not installed."""
    if not import_bridge():
        return None
    from megatron.bridge.models.qwen import qwen3_moe_bridge

    bridge = getattr(qwen3_moe_bridge, "Qwen3MoEBridge", None) or getattr(qwen3_moe_bridge, "Qwen3MoeBridge")
    return bridge().mapping_registry()
