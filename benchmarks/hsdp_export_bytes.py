"""Bytes the error-feedback/EMA export moves under HSDP, gathering over every rank (before issue 29's finding 7) and
over one replica's shard group (after), side by side in one run: four gloo ranks on the CPU as a 2x2 mesh (replicas
{0, 1} and {2, 3}), each replica sharding every parameter in FSDP2's dim-0 chunks.

A rank receives ``(ranks in the gather - 1) x largest shard x 2 B`` per parameter (the bf16 all-gather); the bytes
are counted at the collective calls, and the served copies of both ways are checked equal.

    python benchmarks/hsdp_export_bytes.py [--params 24] [--rows 512] [--cols 384]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from faircast_plugins import FairCastConfig, FairCaster, fsdp  # noqa: E402


def _rank(rank, store, args, results):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.manual_seed(0)
    shapes = [(args.rows + 7 * i, args.cols) for i in range(args.params)]
    fulls = [torch.randn(r * c) * 0.02 for r, c in shapes]
    received = {"n": 0, "bytes": 0}
    for fn in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, fn):
            real = getattr(dist, fn)

            def counted(output, tensor, *a, _real=real, **k):
                world = dist.get_world_size(k.get("group"))
                received["n"] += 1
                received["bytes"] += (world - 1) * tensor.numel() * tensor.element_size()
                return _real(output, tensor, *a, **k)

            setattr(dist, fn, counted)
    out = {}
    for label, group in (("before: every rank", None), ("after: the shard group", groups[rank // 2])):
        ranks, me = 2, rank % 2  # HSDP: each replica shards over its two ranks; replicas hold the same shards
        caster = FairCaster(FairCastConfig(enabled=True, mode="error_feedback", seed=1))
        for version in range(2):  # the first export also exchanges the layout; count the second
            received.update(n=0, bytes=0)
            copies = []
            for i, ((r, c), full) in enumerate(zip(shapes, fulls)):
                chunk = -(-r // ranks) * c
                lo, hi = min(me * chunk, r * c), min((me + 1) * chunk, r * c)
                copies.append(fsdp.assemble_served(caster, f"p{i}", (lo, full[lo:hi]), (r * c,), "cpu", group=group))
            caster.advance()
        out[label] = (dict(received), [q.view(torch.int16).sum().item() for q in copies])
    results[rank] = out
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=24)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--cols", type=int, default=384)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.Manager().dict()
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), args, results), nprocs=4)
        results = dict(results)
    (before, before_bits), (after, after_bits) = results[0]["before: every rank"], results[0]["after: the shard group"]
    assert before_bits == after_bits, "the served copies differ"
    bf16 = sum((args.rows + 7 * i) * args.cols * 2 for i in range(args.params))
    print(f"HSDP 2x2 (4 gloo ranks), error feedback, {args.params} parameters, bf16 model {bf16 / 2**20:.1f} MiB; "
          f"a later export, rank 0")
    print(f"{'':28s} {'gathers':>8s} {'MiB received':>13s} {'x bf16 model':>13s}")
    for label, r in (("before: every rank", before), ("after: the shard group", after)):
        print(f"{label:28s} {r['n']:8d} {r['bytes'] / 2**20:13.2f} {r['bytes'] / bf16:13.2f}")
    print(f"ratio after/before: {after['bytes'] / before['bytes']:.2f} (the same served copies on every rank)")


if __name__ == "__main__":
    main()
