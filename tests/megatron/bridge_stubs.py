"""Import stand-ins for TransformerEngine and Triton, so that megatron-bridge's converter modules import on a CPU
machine without them (test-only). Install them after megatron-core's own modules are imported: they are empty
modules whose every attribute is a dummy class, so code that checks for TransformerEngine would think it present."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
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


def install(roots=("transformer_engine", "triton")) -> None:
    missing = []
    for root in roots:
        try:
            __import__(root)
        except ImportError:
            missing.append(root)
    if missing and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(missing))


def llama_model_bridge():
    """megatron-bridge's LlamaBridge (the model bridge whose mappings verl's export runs), or None if not installed.
    Use it after Megatron's model parallelism is initialised: each mapping keeps the process groups of when its
    ``mapping_registry()`` is built."""
    import importlib.util

    if importlib.util.find_spec("megatron.bridge") is None:
        return None
    install()
    from megatron.bridge.models.llama.llama_bridge import LlamaBridge

    return LlamaBridge()


def llama_mapping_registry():
    """:func:`llama_model_bridge`'s mapping registry, or None."""
    bridge = llama_model_bridge()
    return None if bridge is None else bridge.mapping_registry()
