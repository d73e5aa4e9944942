"""slime's real Megatron->HF converter modules, imported from a slime source tree without slime's runtime.

``FAIRCAST_SLIME_SRC`` names a folder holding slime's ``slime/`` package (e.g. ``git archive HEAD slime`` of
github.com/THUDM/slime, extracted). slime's full package needs SGLang, Ray, DeepEP, ...; its converter package
``slime/backends/megatron_utils/megatron_to_hf/`` imports only torch, ``re`` and ``misc_utils`` (no imports) at module
level. What is stood in for: the ``__init__`` files of the three packages above it are not run (``slime`` and
``slime.backends`` are empty; ``slime.backends.megatron_utils`` initialises the accelerator and patches DeepEP):
they are registered as bare packages over the source folders, so that the converter modules themselves import
unchanged.
"""
from __future__ import annotations

import importlib
import os
import sys
import types
from typing import Optional

ENV = "FAIRCAST_SLIME_SRC"
BARE_PACKAGES = ("slime", "slime.backends", "slime.backends.megatron_utils")
CONVERTERS = "slime.backends.megatron_utils.megatron_to_hf"
HOW_TO_RUN = (f"set {ENV} to a folder holding slime's slime/ package (github.com/THUDM/slime: git archive HEAD slime | "
              f"tar -x -C DIR), then: {ENV}=DIR nox -s tests-megatron -- -k slime")


def source() -> Optional[str]:
    """The slime source folder named by ``FAIRCAST_SLIME_SRC`` (None when unset)."""
    src = os.environ.get(ENV)
    if not src:
        return None
    if not os.path.isfile(os.path.join(src, *CONVERTERS.split("."), "__init__.py")):
        raise FileNotFoundError(f"{ENV}={src} holds no {CONVERTERS.replace('.', '/')}/__init__.py")
    return os.path.abspath(src)


def install(src: str):
    """Register the bare packages over ``src`` and import slime's converter package (returned)."""
    for name in BARE_PACKAGES:
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(src, *name.split("."))]
        module.__file__ = None
        sys.modules[name] = module
    return importlib.import_module(CONVERTERS)


def install_weight_gather(src: str):
    """slime's real TP gather of its weight sync, ``all_gather_param(name, param)`` (the full tensor of a TP-local
    param from ``partition_dim``, the GLU fc1 re-chunked), from ``update_weight/common.py``; its module imports
    ``slime.utils.types`` for a type annotation only (``ParamInfo``), whose module pulls slime's HTTP utilities: a
    bare ``slime.utils`` package and a ``slime.utils.types`` holding an empty ``ParamInfo`` stand in for them.
    Needs megatron-core (``mpu``) and an initialised process group to run."""
    install(src)
    utils = types.ModuleType("slime.utils")
    utils.__path__ = [os.path.join(src, "slime", "utils")]
    sys.modules["slime.utils"] = utils
    stand_in = types.ModuleType("slime.utils.types")
    stand_in.ParamInfo = type("ParamInfo", (), {})
    sys.modules["slime.utils.types"] = stand_in
    return importlib.import_module("slime.backends.megatron_utils.update_weight.common").all_gather_param


def uninstall() -> None:
    for name in [n for n in sys.modules if n == "slime" or n.startswith("slime.")]:
        del sys.modules[name]
