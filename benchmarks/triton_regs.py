"""Registers and spills of every compiled variant of the Triton cast kernel, without a GPU.

    python3 benchmarks/triton_regs.py                 # sm_90 (H100/H200), the default tile sweep, a table
    python3 benchmarks/triton_regs.py --arch 100 --json out/regs.json

Triton's own compiler builds each (mode, ROWS, num_warps) variant for the target, and the cuobjdump that ships with
Triton reads the cubin's resource usage (REG, STACK, LOCAL: spilled bytes live in local memory). This is what
picked ``DEFAULT_ROWS`` / ``DEFAULT_NUM_WARPS`` (docs/kernels.md); ``benchmarks/gpu/kernel.py`` records the same
table on the GPU it runs on. Needs triton >= 3.3 (the ``ASTSource(constexprs=...)`` API).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, not the interpreter
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MODES = {"stochastic": 0, "nearest": 1, "error_feedback": 2}
ROWS = (64, 128, 256, 512, 1024, 2048)
WARPS = (4, 8)


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resource_usage(cubin: bytes) -> dict:
    """REG, STACK and LOCAL (bytes per thread; spills land there) of a cubin's kernel, read with cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)
    found = dict(re.findall(r"\b(REG|STACK|LOCAL):(\d+)", text))
    return {"regs": int(found["REG"]), "stack": int(found.get("STACK", 0)), "local": int(found.get("LOCAL", 0))}


def compile_variant(mode: str, rows: int, warps: int, arch: int):
    """Triton's compiled kernel of one variant for ``cuda:<arch>`` (no device needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from faircast_plugins.kernels import triton_cast as tc

    sig = {"table_ptr": "*i64", "starts_ptr": "*i64", "ROWS": "constexpr", "SEARCH_STEPS": "constexpr",
           "MODE": "constexpr", "N_ROUNDS": "constexpr"}
    src = ASTSource(fn=tc._cast_many_kernel, signature=sig,
                    constexprs={"ROWS": rows, "SEARCH_STEPS": 9, "MODE": MODES[mode], "N_ROUNDS": tc.N_ROUNDS})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})


def sweep(arch: int, modes=("stochastic", "error_feedback", "nearest"), rows=ROWS, warps=WARPS) -> list[dict]:
    table = []
    for mode in modes:
        for r in rows:
            for w in warps:
                usage = resource_usage(compile_variant(mode, r, w, arch).asm["cubin"])
                table.append({"arch": arch, "mode": mode, "rows": r, "warps": w, **usage,
                              "spills": usage["local"] > 0 or usage["stack"] > 0})
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (default 90: H100/H200)")
    parser.add_argument("--json", help="write the table to this JSON file")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes (default: all)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated tile heights")
    args = parser.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")
    from faircast_plugins.kernels import triton_cast as tc

    table = sweep(args.arch, modes=args.modes.split(","), rows=[int(r) for r in args.rows.split(",")])
    print(f"sm_{args.arch}: {'mode':<15} {'rows':>5} {'warps':>5} {'regs':>5} {'stack':>6} {'local':>6}")
    for row in table:
        default = row["rows"] == tc.DEFAULT_ROWS and row["warps"] == tc.DEFAULT_NUM_WARPS
        print(f"{'':>6} {row['mode']:<15} {row['rows']:>5} {row['warps']:>5} {row['regs']:>5} {row['stack']:>6} "
              f"{row['local']:>6}{'  SPILLS' if row['spills'] else ''}{'  <- default' if default else ''}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(table, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
