"""What an offloaded master's Fair Cast state costs per step, before and after issue 29's findings 5 and 6, side by
side in one run on one GPU (the "before" rows reproduce the old placement with the same package calls).

Finding 6 (FSDP CPU offload with an EMA): the all-gather copies the EMA of a pinned host master shard to the GPU
with ``non_blocking=True``. Before, the EMA was pageable, so that copy held the host until it had run (behind
whatever the stream was doing); after, it is pinned beside the master (``caster._beside``) and the copy is queued.
Measured: host time of queueing the copy behind a busy stream, and the copy's device time.

Finding 5 (verl ``param_offload`` with error feedback): at the export, the master shard is on the host. Before, the
cast ran there (numba, on torch's threads: one under Ray) and its residual and kept served copy lived on the host,
copied back to the GPU at the next all-gather; after, ``fsdp.stage_for_cast`` copies the master to the GPU and the
cast and its state stay there. Measured: one export's cast, host wall and bytes moved between host and device.

    python3 benchmarks/offload_state_cost.py [--elements N] [--threads 1] [--json out.json] [--cpu-smoke]

Sizes: one rank's shard of a 7B model over 8 ranks by default (~875M / 8 elements). ``--cpu-smoke`` runs the same
code on tiny CPU tensors (structure only, no figures): tests/core/test_gpu_real_sizes_smoke.py runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from faircast_plugins import FairCastConfig, FairCaster  # noqa: E402
from faircast_plugins.fsdp import stage_for_cast  # noqa: E402


def busy(device, ms: float = 50.0) -> None:
    """Queue about ``ms`` of work on the current stream (a copy that lands late shows in the host time)."""
    if device.type == "cuda":
        torch.cuda._sleep(int(ms * 1.98e6))  # ~1.98 GHz SM clock: cycles for ms milliseconds


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def ema_copy_rows(n: int, device, reps: int) -> list:
    """Finding 6: the EMA beside a pinned master, pageable (before) and pinned (after), copied to the device."""
    master = torch.randn(n).pin_memory() if device.type == "cuda" else torch.randn(n)
    pageable = master.clone()  # the EMA as it was: a plain clone of the master
    pinned = pageable.pin_memory() if device.type == "cuda" else pageable
    rows = []
    for label, ema in (("before: pageable EMA", pageable), ("after: pinned EMA (caster._beside)", pinned)):
        host_ms = []
        for _ in range(reps):
            sync(device)
            busy(device)
            t = time.perf_counter()
            ema.to(device, non_blocking=True)
            host_ms.append((time.perf_counter() - t) * 1e3)
            sync(device)
        rows.append({"what": label, "elements": n, "host_ms_to_queue_behind_50ms": round(min(host_ms), 3),
                     "pinned": bool(ema.is_pinned()) if device.type == "cuda" else None})
    return rows


def ef_export_rows(n: int, device, reps: int) -> list:
    """Finding 5: one error-feedback export of a host master shard: cast on the host (before) or staged (after)."""
    master = torch.randn(n) * 0.02
    if device.type == "cuda":
        master = master.pin_memory()
    rows = []
    for label, staged in (("before: cast on the host, state on the host", False),
                          ("after: stage_for_cast, cast and state on the GPU", True)):
        caster = FairCaster(FairCastConfig(enabled=True, mode="error_feedback", seed=5))
        walls = []
        for step in range(reps + 1):
            caster.advance()
            sync(device)
            t = time.perf_counter()
            src = stage_for_cast(master, device) if staged else master
            served = caster.cast("model.layers.0.mlp.up_proj.weight", src)
            if not staged:  # the served bits go to the device for the rollout, as the export sends them
                served = served.to(device)
            sync(device)
            if step:  # the first cast of each arm builds its state
                walls.append((time.perf_counter() - t) * 1e3)
        state = caster.state_device("model.layers.0.mlp.up_proj.weight")
        # bytes between host and device per step for this shard: before, the residual (4 B) and the kept served copy
        # (2 B) went back to the GPU at the all-gather and came back at the export, and the served bits (2 B) went to
        # the device; after, the master (4 B) goes to the device once
        moved = n * (4 + 2) * 2 + n * 2 if not staged else n * 4
        rows.append({"what": label, "elements": n, "export_cast_ms": round(min(walls), 2),
                     "state_on": str(state), "bytes_moved_per_step_from_the_mechanism": moved, "threads": torch.get_num_threads()})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, default=7_000_000_000 // 8 // 8, help="elements of the shard")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the host cast (Ray's default: 1)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("offload_state_cost: no CUDA device (use --cpu-smoke)")
    n = 4096 if args.cpu_smoke else args.elements
    torch.set_num_threads(args.threads)
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (smoke)",
              "torch": torch.__version__, "elements": n, "threads": args.threads,
              "finding6_ema_copy": ema_copy_rows(n, device, args.reps),
              "finding5_ef_export": ef_export_rows(n, device, args.reps)}
    print(f"offload_state_cost on {result['device']}, torch {result['torch']}, {n:,} elements, "
          f"{args.threads} host thread(s)")
    for r in result["finding6_ema_copy"]:
        print(f"  finding 6  {r['what']:<48} host {r['host_ms_to_queue_behind_50ms']:9.3f} ms to queue the copy")
    for r in result["finding5_ef_export"]:
        print(f"  finding 5  {r['what']:<48} {r['export_cast_ms']:9.2f} ms per export, state on {r['state_on']}, "
              f"{r['bytes_moved_per_step_from_the_mechanism'] / 2**20:8.1f} MiB moved per step (counted from the mechanism)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
