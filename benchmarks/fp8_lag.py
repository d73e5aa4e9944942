"""Lag, delivered fraction, bias and served changes of each Fair Cast mode followed by verl's fp8 stage.

A synthetic model (two fp32 weight matrices, 512x512 and 300x200 (not multiples of 128), ~N(0, 0.02), saved in
bf16: the masters start on the bf16 grid) trained by ``torch.optim.Adam`` at lr 1e-6 on a synthetic gradient
(a fixed per-element direction plus fresh noise of half its size: a steady drift, like a bf16 checkpoint
fine-tuned at a small LR). Per weight version, for ``nearest`` (Fair Cast off), ``stochastic``, ``sticky`` and
``error_feedback`` (one ``FairCaster`` each), the served bf16 copy goes through:

* ``bf16``: nothing (what a bf16 engine serves),
* ``verl fp8``: verl 0.9.1's real ``scaled_fp8_blockwise`` (``VERL_DISABLE_TRITON_FP8=1``, its PyTorch path; what
  ``quant_weights`` hands verl's fp8 vLLM engine), dequantized,
* ``pow2 fp8 (emulation)``: this package's emulation of power-of-two (UE8M0-style) block descales,
  ``2 ** ceil(log2(amax / 448))`` (``faircast_plugins.fp8``, ``scales="pow2"``): NOT a verl code path,

plus ``fp32 -> verl fp8`` (verl's quantizer on the fp32 master, no bf16 stage; verl itself always casts to bf16
first). Metrics: the package's audit (every element) on (master, engine copy): ``lag_steps`` (mean over the 10
versions up to 30, 100 and the end), ``served_changed_frac`` (mean per version over the last 50 versions),
``bias_rel_cumulative`` at the end; "delivered" = projection of the engine copy's displacement since version 0 on
the master's, ``sum((q_v - q_0)(x_v - x_0)) / sum((x_v - x_0)^2)``, at versions 30, 100 and the end.

Run in the tests-verl venv (``--emulate`` uses the package's emulation of verl's quantizer, bit-identical, where
verl is not installed)::

    python benchmarks/fp8_lag.py                # 400 versions (about 1-2 minutes on one CPU core)
    python benchmarks/fp8_lag.py --smoke        # 30 versions
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VERL_DISABLE_TRITON_FP8", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from faircast_plugins import FairCaster, FairCastConfig  # noqa: E402
from faircast_plugins.audit import Audit  # noqa: E402
from faircast_plugins.fp8 import dequantize_blockwise, quantize_blockwise  # noqa: E402

MODES = ("nearest", "stochastic", "sticky", "error_feedback")
SHAPES = {"w_a": (512, 512), "w_b": (300, 200)}
SEED = 1234


def verl_quantizer(emulate: bool):
    if emulate:
        return lambda x: quantize_blockwise(x), "faircast_plugins.fp8 emulation of verl's PyTorch quantizer"
    from verl.utils.kernel import fp8_kernel

    assert not fp8_kernel.is_triton_available() or fp8_kernel._DISABLE_TRITON_FP8
    import verl

    def quant(x):
        q, s = fp8_kernel.scaled_fp8_blockwise(x, weight_block_size=[128, 128])
        return q, s.squeeze(-1)

    return quant, f"verl {verl.__version__} scaled_fp8_blockwise (PyTorch path)"


class Row:
    """One (mode, stage) pipeline: its audit and its version-0 copy (for the delivered fraction)."""

    def __init__(self, mode: str, stage: str):
        self.mode, self.stage = mode, stage
        self.audit = Audit(sample=1 << 30)
        self.q0 = self.x0 = None
        self.lag, self.changed, self.delivered, self.bias = [], [], {}, None

    def observe(self, version: int, masters: dict, engine: dict, marks: tuple) -> None:
        for n in masters:
            self.audit.observe(n, version, masters[n], engine[n])
        m = self.audit.metrics()
        if "faircast/lag_steps" in m:
            self.lag.append((version, m["faircast/lag_steps"]))
        if "faircast/served_changed_frac" in m:
            self.changed.append((version, m["faircast/served_changed_frac"]))
        self.bias = m.get("faircast/bias_rel_cumulative", self.bias)
        if self.q0 is None:
            self.q0 = {n: q.double().clone() for n, q in engine.items()}
            self.x0 = {n: x.double().clone() for n, x in masters.items()}
        if version in marks:
            num = sum(float(((engine[n].double() - self.q0[n]) * (masters[n].double() - self.x0[n])).sum())
                      for n in masters)
            den = sum(float(((masters[n].double() - self.x0[n]) ** 2).sum()) for n in masters)
            self.delivered[version] = num / den

    def summary(self, marks: tuple, versions: int) -> dict:
        def mean_upto(series, end, k):
            vals = [v for ver, v in series if end - k < ver <= end]
            return sum(vals) / len(vals) if vals else float("nan")

        return {"mode": self.mode, "stage": self.stage,
                "lag": [mean_upto(self.lag, m, 10) for m in marks],
                "delivered": [self.delivered.get(m, float("nan")) for m in marks],
                "changed": mean_upto(self.changed, versions - 1, 50), "bias_rel_cumulative": self.bias}


def run(versions: int, emulate: bool) -> dict:
    quant, quant_label = verl_quantizer(emulate)
    g = torch.Generator().manual_seed(SEED)
    params = {n: torch.nn.Parameter((torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16).float())
              for n, s in SHAPES.items()}
    direction = {n: torch.randn(p.shape, generator=g) for n, p in params.items()}
    opt = torch.optim.Adam(params.values(), lr=1e-6)
    casters = {m: FairCaster(FairCastConfig(enabled=m != "nearest", mode="stochastic" if m == "nearest" else m,
                                            seed=SEED)) for m in MODES}
    stages = ("bf16", "verl fp8", "pow2 fp8 (emulation)")
    rows = {(m, s): Row(m, s) for m in MODES for s in stages}
    rows[("fp32 (no bf16 stage)", "verl fp8")] = Row("fp32 (no bf16 stage)", "verl fp8")
    marks = tuple(sorted({min(30, versions - 1), min(100, versions - 1), versions - 1}))
    for version in range(versions):
        if version:
            opt.zero_grad()
            for n, p in params.items():
                p.grad = direction[n] + 0.5 * torch.randn(p.shape, generator=g)
            opt.step()
            for c in casters.values():
                c.advance()
        masters = {n: p.detach().clone() for n, p in params.items()}
        for m, caster in casters.items():
            served = {n: caster.cast(n, x) for n, x in masters.items()}
            rows[(m, "bf16")].observe(version, masters, served, marks)
            rows[(m, "verl fp8")].observe(version, masters, {n: dequantize_blockwise(*quant(q))
                                                             for n, q in served.items()}, marks)
            rows[(m, "pow2 fp8 (emulation)")].observe(
                version, masters, {n: dequantize_blockwise(*quantize_blockwise(q, scales="pow2"))
                                   for n, q in served.items()}, marks)
        rows[("fp32 (no bf16 stage)", "verl fp8")].observe(
            version, masters, {n: dequantize_blockwise(*quant(x)) for n, x in masters.items()}, marks)
    return {"quantizer": quant_label, "versions": versions, "marks": list(marks), "lr": 1e-6,
            "shapes": {n: list(s) for n, s in SHAPES.items()},
            "rows": [r.summary(marks, versions) for r in rows.values()]}


def table(result: dict) -> str:
    at = " / ".join(f"v{m}" for m in result["marks"])
    lines = [f"| mode | stage | lag, steps ({at}) | delivered ({at}) | served changed per version "
             f"(last 50) | bias_rel_cumulative |", "| --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        lag = " / ".join(f"{v:.2f}" for v in r["lag"])
        delivered = " / ".join(f"{v:.3f}" for v in r["delivered"])
        lines.append(f"| `{r['mode']}` | {r['stage']} | {lag} | {delivered} | {100 * r['changed']:.2f}% | "
                     f"{r['bias_rel_cumulative']:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--versions", type=int, default=400)
    ap.add_argument("--smoke", action="store_true", help="30 versions")
    ap.add_argument("--emulate", action="store_true", help="the package's emulation of verl's quantizer")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    t0 = time.time()
    result = run(30 if args.smoke else args.versions, args.emulate)
    result["seconds"] = round(time.time() - t0, 1)
    print(f"quantizer: {result['quantizer']}; {result['versions']} versions, Adam lr 1e-6, shapes "
          f"{result['shapes']}, {result['seconds']} s")
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
