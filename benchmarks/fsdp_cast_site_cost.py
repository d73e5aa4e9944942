"""FSDP cast-site costs before and after findings 5, 6 and 9 of docs/gpu-paths.md, side by side (CPU, gloo; no timed test).

    PYTHONPATH=. python benchmarks/fsdp_cast_site_cost.py [--before 81b1184] [--markdown]

The "before" tree is ``faircast_plugins`` at ``--before`` (extracted with ``git archive`` into a temporary directory),
the "after" tree is this checkout's; each is measured in its own subprocess with that tree first on the path, the same
script and the same inputs. Use a Python with numba and without a vLLM CPU build (e.g. the ``tests-core`` venv), so
CPU tensors take the numba kernel as they do next to a CUDA vLLM. Rows:

* finding 6 -- FSDP2 at world size 2 (gloo): per all-gather, parameters in the group, calls of the rounding engine's
  run function (``cast._run``: one key-table build and launch each), keys hashed, and host time spent in
  ``_get_param_all_gather_inputs`` (stock FSDP: the same model unregistered, patches off);
* finding 5 -- offloaded shards (``CPUOffloadPolicy``), the FSDP2 fast path over host shards whose all-gather inputs
  live on another device (``meta`` stands in for the GPU, which this machine lacks): where the cast runs and the host
  time per all-gather, with torch at one thread as under torchrun's ``OMP_NUM_THREADS=1``;
* finding 9 -- the error-feedback export at world size 2: collectives and bytes per export (tensor bytes handed to
  the collectives, and what a ring sends per rank), host time, against the fp32 ``full_tensor`` gather every export
  already does (stock traffic).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BEFORE = "81b1184"
BLOCKS, LINEARS, WIDTH = 8, 6, 64  # 8 parameter groups of 12 parameters (weight + bias), 4160 elements each
STEPS = 2
LATER_EXPORTS = 3  # host time: the fastest of these (gloo on a shared machine is noisy)
OFFLOAD_PARAMS, OFFLOAD_NUMEL = 12, 1 << 16


# -- measurements (run in a child, with the tree under test first on the path) -----------------------------------

def _model(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[
        torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LINEARS)]) for _ in range(BLOCKS)])


def _sharded(torch, register, caster):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from faircast_plugins import fsdp

    model = _model(torch)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if register:
        fsdp.register_fsdp_module(model, caster)
    return model


def _all_gathers(torch, faircast: bool) -> dict:
    """Finding 6: train STEPS steps (after one warm-up step), timing every fast-path call."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from faircast_plugins import FairCaster, FairCastConfig, cast, fsdp

    if faircast:
        fsdp.apply_fsdp_cast_patches()
    else:
        fsdp.remove_fsdp_cast_patches()
    caster = FairCaster(FairCastConfig(enabled=True, seed=1))
    model = _sharded(torch, faircast, caster)
    runs, hashed, calls = [0], [0], []
    run, key, fast = cast._run, caster.key, _fsdp_collectives._get_param_all_gather_inputs

    def counted_run(items, mode, backend):
        runs[0] += 1
        return run(items, mode, backend)

    def counted_key(name):
        hashed[0] += 1
        return key(name)

    def timed(fsdp_params):
        r, h, t = runs[0], hashed[0], time.perf_counter()
        out = fast(fsdp_params)
        calls.append((len(fsdp_params), runs[0] - r, hashed[0] - h, time.perf_counter() - t))
        return out

    cast._run, caster.key, _fsdp_collectives._get_param_all_gather_inputs = counted_run, counted_key, timed
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(2))
    try:
        for step in range(STEPS + 1):
            if step == 1:
                calls.clear()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            caster.advance()
    finally:
        cast._run, _fsdp_collectives._get_param_all_gather_inputs = run, fast
        if faircast:
            fsdp.unregister_fsdp_module(model)
    n = len(calls)
    gathered = sum(c[0] for c in calls)  # parameter all-gathers; each parameter is gathered twice per version
    return {"all_gathers": n, "params": gathered / n, "runs": sum(c[1] for c in calls) / n,
            "keys_per_version": sum(c[2] for c in calls) / (gathered / 2), "host_ms": 1e3 * sum(c[3] for c in calls) / n}


def _collective_counter(torch):
    dist = torch.distributed
    log = []
    saved = {}
    for fn in ("all_reduce", "all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, fn):
            saved[fn] = getattr(dist, fn)

            def counted(*args, _fn=fn, **kwargs):
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                log.append((_fn, [t.numel() * t.element_size() for t in tensors]))
                return saved[_fn](*args, **kwargs)

            setattr(dist, fn, counted)

    def restore():
        for fn, f in saved.items():
            setattr(dist, fn, f)

    return log, restore


def _ring_sent(fn: str, sizes: list, world: int) -> float:
    """Bytes one rank sends in a ring: all-reduce 2(n-1)/n of the buffer, all-gather (n-1)/n of the output."""
    if fn == "all_reduce":
        return 2 * (world - 1) / world * sizes[0]
    return (world - 1) / world * max(sizes)


def _exports(torch) -> dict:
    """Finding 9: error-feedback exports (one per version), each of every parameter in order, as verl/TRL export."""
    from faircast_plugins import FairCaster, FairCastConfig, fsdp
    from faircast_plugins.key import canonical_name

    world = torch.distributed.get_world_size()
    fsdp.apply_fsdp_cast_patches()
    caster = FairCaster(FairCastConfig(enabled=True, mode="error_feedback", seed=1))
    model = _sharded(torch, True, caster)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(2))
    params = [(canonical_name(n), tuple(p.shape)) for n, p in model.named_parameters()]
    numel = sum(torch.Size(s).numel() for _, s in params)
    rows = []
    log, restore = _collective_counter(torch)
    try:
        for _ in range(1 + LATER_EXPORTS):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            caster.advance()
            shards = fsdp.registered_shards(model)
            log.clear()
            t = time.perf_counter()
            for name, shape in params:
                fsdp.assemble_served(caster, name, shards.get(name), shape, "cpu")
            rows.append({"host_ms": 1e3 * (time.perf_counter() - t), "collectives": len(log),
                         "tensor_bytes": sum(sum(s) for _, s in log),
                         "ring_sent": sum(_ring_sent(fn, s, world) for fn, s in log),
                         "kinds": sorted({fn for fn, _ in log})})
    finally:
        restore()
        fsdp.unregister_fsdp_module(model)
    stock = (world - 1) / world * 4 * numel  # full_tensor(): the fp32 all-gather of every parameter
    later = dict(rows[-1], host_ms=min(r["host_ms"] for r in rows[1:]))
    return {"params": len(params), "numel": numel, "first": rows[0], "later": later, "stock_ring_sent": stock}


def _rank(rank: int, store: str, results) -> None:
    import torch

    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    out = {"stock": _all_gathers(torch, False), "faircast": _all_gathers(torch, True), "export": _exports(torch)}
    if rank == 0:
        results.update(out)
    torch.distributed.destroy_process_group()


def _offload() -> dict:
    """Finding 5: the fast path over offloaded (host) shards whose all-gather inputs are on another device."""
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    from faircast_plugins import FairCaster, FairCastConfig, cast, fsdp

    torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1
    caster = FairCaster(FairCastConfig(enabled=True, seed=1))

    class OffloadedParam:  # the FSDPParam attributes the cast sites read, under CPUOffloadPolicy
        def __init__(self, i):
            self.sharded_state, self.offload_to_cpu, self.param_dtype = ShardedState.SHARDED, True, torch.bfloat16
            self._sharded_param_data = self._sharded_local_tensor = torch.randn(OFFLOAD_NUMEL)
            setattr(self, fsdp._ATTR, fsdp._ParamCast(caster, f"layer.{i}.weight", 0, OFFLOAD_NUMEL))

        def _stock(self):  # torch: shard.to(device, non_blocking=True).to(bf16); "meta" is the device here
            return [torch.empty(OFFLOAD_NUMEL, dtype=torch.bfloat16, device="meta")]

    OffloadedParam.all_gather_inputs = fsdp._wrap_all_gather_inputs(property(OffloadedParam._stock))
    fast_path = fsdp._wrap_get_param_all_gather_inputs(lambda ps: [p.all_gather_inputs for p in ps])
    params = [OffloadedParam(i) for i in range(OFFLOAD_PARAMS)]
    where = set()
    run = cast._run

    def located_run(items, mode, backend):
        where.update(item.x.device.type for item in items)
        return run(items, mode, backend)

    def located_batch(xs, *, outs, **kwargs):  # the device kernel cannot run on meta tensors: record, do not cast
        where.update(x.device.type for x in xs)
        return outs

    cast._run = located_run
    if hasattr(fsdp, "fair_cast_many"):
        fsdp.fair_cast_many = located_batch
    try:
        fast_path(params)  # warm-up (numba compile)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fast_path(params)
            times.append(time.perf_counter() - t)
    finally:
        cast._run = run
    return {"params": OFFLOAD_PARAMS, "numel": OFFLOAD_NUMEL, "cast_on": sorted(where),
            "host_ms": 1e3 * sorted(times)[len(times) // 2]}


def child() -> None:
    import torch.multiprocessing as mp

    offload = _offload()
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.Manager().dict()
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), results), nprocs=2)
        out = dict(results)
    out["offload"] = offload
    print("RESULT " + json.dumps(out))


# -- the parent: one child per tree, then the table -------------------------------------------------------------

def _measure(tree: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env, capture_output=True,
                          text=True, timeout=1200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"measuring {tree} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _extract(ref: str, into: str) -> str:
    archive = subprocess.run(["git", "-C", ROOT, "archive", ref, "faircast_plugins"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    return into


def _kb(b: float) -> str:
    return f"{b / 1024:.1f} KiB"


def table(before: dict, after: dict, ref: str) -> list:
    b6, a6, stock = before["faircast"], after["faircast"], after["stock"]
    b5, a5 = before["offload"], after["offload"]
    b9, a9 = before["export"], after["export"]
    rows = [("finding", "measure", f"before ({ref})", "after", "stock FSDP")]
    rows += [
        ("6", f"params per all-gather (group), {a6['all_gathers']} all-gathers", f"{b6['params']:.0f}",
         f"{a6['params']:.0f}", f"{stock['params']:.0f}"),
        ("6", "rounding-engine runs per all-gather", f"{b6['runs']:.1f}", f"{a6['runs']:.1f}", "0"),
        ("6", "keys hashed per parameter per version (2 all-gathers)", f"{b6['keys_per_version']:.1f}",
         f"{a6['keys_per_version']:.1f}", "0"),
        ("6", "host ms per all-gather (incl. the CPU cast)", f"{b6['host_ms']:.2f}", f"{a6['host_ms']:.2f}",
         f"{stock['host_ms']:.2f}"),
        ("5", f"offload: cast runs on ({a5['params']} x {a5['numel']} elements)", "/".join(b5["cast_on"]),
         "/".join(a5["cast_on"]) + " (the device)", "the device"),
        ("5", "offload: host ms per all-gather (1 thread)", f"{b5['host_ms']:.2f}", f"{a5['host_ms']:.2f}", "-"),
    ]
    for when in ("first", "later"):
        label = "first export" if when == "first" else "later exports"
        rows += [
            ("9", f"{label}: collectives ({a9['params']} params)", f"{b9[when]['collectives']} "
             f"({'+'.join(b9[when]['kinds'])})", f"{a9[when]['collectives']} ({'+'.join(a9[when]['kinds'])})", "-"),
            ("9", f"{label}: bytes a rank sends (ring), stock fp32 gather = {_kb(a9['stock_ring_sent'])}",
             f"{_kb(b9[when]['ring_sent'])} ({b9[when]['ring_sent'] / b9['stock_ring_sent']:.2f}x)",
             f"{_kb(a9[when]['ring_sent'])} ({a9[when]['ring_sent'] / a9['stock_ring_sent']:.2f}x)",
             _kb(a9["stock_ring_sent"])),
            ("9", f"{label}: host ms{' (fastest of ' + str(LATER_EXPORTS) + ')' if when == 'later' else ''}",
             f"{b9[when]['host_ms']:.1f}", f"{a9[when]['host_ms']:.1f}", "-"),
        ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE, help="git ref of the 'before' tree (default %(default)s)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child()
        return
    with tempfile.TemporaryDirectory(prefix="faircast-before-") as tmp:
        before = _measure(_extract(args.before, tmp))
    after = _measure(ROOT)
    rows = table(before, after, args.before)
    if args.markdown:
        print("| " + " | ".join(rows[0]) + " |")
        print("|" + "---|" * len(rows[0]))
        for row in rows[1:]:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    main()
