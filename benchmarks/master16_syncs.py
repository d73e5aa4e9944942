"""What keeping TRL's masters costs per optimizer step in host syncs and kernel launches, before and after issue 29's
finding 4, side by side in one run (CPU; no GPU needed).

* ``stochastic``/``sticky``, 2 B masters: the step's compaction with the fused Triton kernels (under
  ``TRITON_INTERPRET=1``): before, ``master16.compact`` per parameter reads each miss count (one host sync per
  parameter); after, ``master16.compact_all`` reads them all at once.
* ``nearest``: before, 2 B masters through the chunked torch reference (compaction after the step, recovery before
  the next: no fused kernel for nearest); after, the default for ``nearest`` is fp32 masters (a copy each way).

Host syncs are counted as the reads of a tensor's value (``item``, ``tolist``, ``int``, ``bool``, ``float``) and
``nonzero`` (its output size needs the device); launches as the aten operations dispatched (each one a kernel
launch on CUDA; on the CPU they run inline; not for the Triton rows, where the interpreter's own tensor traffic
would be counted: the fused compaction is one launch per parameter before and after). Shapes: ``--layers`` decoder layers of a Qwen3-1.7B-like model scaled
down by ``--scale`` in both dimensions (the counts per parameter do not depend on the scale; the nearest reference's
count grows with the elements, one chunk per 2**20: the ``per 1.7B`` column multiplies by the real size, labelled).

    TRITON_INTERPRET=1 python benchmarks/master16_syncs.py [--layers 28] [--scale 16] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from faircast_plugins import derive_key, fair_cast, master16  # noqa: E402

HIDDEN, INTER, VOCAB, KV = 2048, 6144, 151936, 1024  # Qwen3-1.7B
REAL_ELEMENTS = 1.72e9
READS = ("item", "tolist", "__int__", "__bool__", "__float__")


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.nonzero = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func.overloadpacket is torch.ops.aten.nonzero:
            self.nonzero += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting():
    reads = {"n": 0}
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(real):
        def read(self, *a, **k):
            reads["n"] += 1
            return real(self, *a, **k)
        return read

    for name, real in saved.items():
        setattr(torch.Tensor, name, counted(real))
    mode = _Ops()
    try:
        with mode:
            yield reads, mode
    finally:
        for name, real in saved.items():
            setattr(torch.Tensor, name, real)


def model(layers: int, scale: int) -> dict:
    h, i, v, kv = HIDDEN // scale, INTER // scale, VOCAB // scale, KV // scale
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,), p + "self_attn.q_norm.weight": (128 // scale,),
                       p + "self_attn.k_norm.weight": (128 // scale,)})
    g = torch.Generator().manual_seed(0)
    return {n: (torch.randn(s, generator=g) * 0.02).reshape(-1) for n, s in shapes.items()}


def measure(fn) -> dict:
    with counting() as (reads, mode):
        fn()
    return {"host_syncs": reads["n"] + mode.nonzero, "launches": mode.ops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--scale", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    masters = model(args.layers, args.scale)
    n_params, n_elem = len(masters), sum(x.numel() for x in masters.values())
    keys = {n: derive_key(1, 1, n) for n in masters}
    master16._kernels("triton", torch.device("cpu"), "sticky")  # the one-time self-check, outside the counts
    rows = []
    before = measure(lambda: [master16.compact(x, None, key=keys[n], mode="sticky", backend="triton")
                              for n, x in masters.items()])
    after = measure(lambda: master16.compact_all(masters, keys=keys, mode="sticky", backend="triton"))
    before["launches"] = after["launches"] = None  # under the interpreter aten ops are its own tensor traffic
    rows.append(("sticky/stochastic, 2 B masters: compaction", before, after, "per parameter"))
    served = {n: x.to(torch.bfloat16) for n, x in masters.items()}

    def nearest_2b():  # after the step: compact; before the next: recover (the chunked torch reference)
        for n, x in masters.items():
            c = master16.compact(x, served[n], key=None, mode="nearest", backend="torch")
            master16.recover(served[n], c, backend="torch")

    params = {n: x.clone() for n, x in masters.items()}
    full = {n: x.clone() for n, x in masters.items()}

    def nearest_fp32():  # fp32 masters: the parameter gets its master back, then its served copy
        for n, p in params.items():
            p.copy_(full[n])
            full[n].copy_(p)
            p.copy_(served[n])

    rows.append(("nearest: 2 B (before) vs fp32 masters (after, the default)", measure(nearest_2b),
                 measure(nearest_fp32), "per 2**20 elements"))
    out = {"params": n_params, "elements": n_elem, "layers": args.layers, "scale": args.scale, "rows": [
        {"what": what, "before": b, "after": a, "grows": grows} for what, b, a, grows in rows]}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{n_params} parameters, {n_elem / 1e6:.1f}M elements (Qwen3-1.7B shapes / {args.scale} per dimension)")
    print(f"{'per optimizer step':58s} {'host syncs before':>17s} {'after':>6s} {'launches before':>15s} {'after':>6s}")
    for what, b, a, _ in rows:
        launches = (f"{b['launches']:15d} {a['launches']:6d}" if b["launches"] is not None
                    else f"{'(interpreter)':>15s} {'-':>6s}")
        print(f"{what:58s} {b['host_syncs']:17d} {a['host_syncs']:6d} {launches}")
    per_chunk = rows[1][1]
    chunks = sum(-(-x.numel() // master16.CHUNK) for x in masters.values())
    print(f"nearest before, at 1.72e9 elements (extrapolated from {chunks} chunks here, one nonzero per 2**20 "
          f"elements): ~{REAL_ELEMENTS / 2**20 + n_params:.0f} host syncs, "
          f"~{per_chunk['launches'] / chunks * REAL_ELEMENTS / 2**20:.0f} launches per step")


if __name__ == "__main__":
    main()
