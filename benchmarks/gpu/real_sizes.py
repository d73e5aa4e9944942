"""Issue 29's device checks: what only real sizes and a real GPU show.

The GPU run's part ``realsize`` (``python -m benchmarks.gpu``); alone, from the repository root:

    python3 -m benchmarks.gpu.real_sizes --json out/real_sizes.json [--only audit,fp8quant,fp8loss,offload] [--cpu-smoke]

Sections:

  audit     finding 1: ``Audit.observe`` and an audited ``FairCaster.cast`` of one 151936 x 4096 fp32 master (a
            Qwen-sized embedding, 622M elements, above 2**24) on CUDA: the sampled positions end at ``numel - 1``
            (the float32 linspace of before ran past the end: a device-side assert), the positions computed on the
            device equal those on the host, and the metrics are finite.
  fp8quant  finding 3: verl's Triton fp8 quantizer (``verl/utils/kernel/fp8_kernel.py`` of an installed verl,
            ``pip install --no-deps verl==0.9.1``, loaded as a file: verl's package imports are not needed) against
            Fair Cast's fp8 copy (``faircast_plugins.fp8.quantize_blockwise``) and verl's PyTorch path, descale
            bits and fp8 bytes, on blocks whose amax is every positive normal bf16 value, and on a random 4096 x
            14336 weight.
  fp8loss   finding 2: ``fp8_loss`` on one 4096 x 14336 linear (a 7B MLP's down projection), forward + backward
            over 8192 tokens, with and without activation checkpointing, against the same layer in plain bf16:
            time (CUDA events) and peak memory above the start.
  offload   finding 8: an uneven FSDP2 shard (rank 5 of 6, a fake process group: no peers needed) offloaded as
            verl does (``model.to("cpu", non_blocking=True)``) behind a busy stream, then reloaded: the host
            shard and the reloaded one equal the shard before, bit for bit.

Under ``--cpu-smoke`` the same code runs at tiny sizes on the CPU (structure only; what needs CUDA is skipped
with the reason): tests/core/test_gpu_real_sizes_smoke.py runs it in CI.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import sys
import time

SECTIONS = ("audit", "fp8quant", "fp8loss", "offload")
_ARGS = argparse.ArgumentParser(description=__doc__.split("\n")[0])
_ARGS.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (how CI runs this script)")
_ARGS.add_argument("--json", default="real_sizes.json", help="results, rewritten after every section")
_ARGS.add_argument("--only", default="", help=f"comma-separated sections to run (default all): {','.join(SECTIONS)}")
_ARGS.add_argument("--verbose", action="store_true", help="print every passing check too")
_ARGS.add_argument("--deadline-s", type=float, default=None, help="skip the sections not started by then")
ARGS = _ARGS.parse_args()
SMOKE = ARGS.cpu_smoke

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from benchmarks.gpu.record import Report, Skip, say  # noqa: E402

from faircast_plugins import FairCastConfig, FairCaster, fp8  # noqa: E402
from faircast_plugins.audit import Audit, sample_positions  # noqa: E402
from faircast_plugins.fsdp import uneven_shards  # noqa: E402

if not SMOKE and not torch.cuda.is_available():
    sys.exit("benchmarks.gpu.real_sizes: no CUDA device (use --cpu-smoke to exercise the script on CPU)")
DEV = torch.device("cpu" if SMOKE else "cuda")
REPORT = Report(ARGS.json, only=ARGS.only.split(","), deadline_s=ARGS.deadline_s, verbose=ARGS.verbose)
RESULTS = REPORT.results
check = REPORT.check


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


# -- finding 1: the audit at a real size ---------------------------------------------------------------------

EMBED = (1024, 4097) if SMOKE else (151936, 4096)


def audit_section() -> None:
    rows, cols = EMBED
    numel = rows * cols
    sample = 4096
    on_device, on_host = sample_positions(numel, sample, DEV), sample_positions(numel, sample, "cpu")
    check(f"sample_positions({numel}, {sample}) on {DEV.type} == on the host, last == numel - 1",
          torch.equal(on_device.cpu(), on_host) and on_host[-1].item() == numel - 1,
          f"last {on_device[-1].item()} of {numel}")
    gen = torch.Generator(device=DEV).manual_seed(29)
    master = torch.randn(rows, cols, device=DEV, generator=gen) * 0.02
    audit = Audit(sample=sample)
    t = time.perf_counter()
    for version in range(3):
        audit.observe("model.embed_tokens.weight", version, master, master.to(torch.bfloat16))
        master.add_(1e-6)
    totals = audit.totals()
    sync()
    RESULTS["audit"] = {"numel": numel, "observe_3_versions_s": round(time.perf_counter() - t, 3), "totals": totals}
    check(f"Audit.observe of a {rows} x {cols} master on {DEV.type}, 3 versions: finite totals, {sample} per version",
          all(v == v and abs(v) != float("inf") for v in totals.values()) and totals["n"] >= sample,
          str({k: round(v, 6) for k, v in totals.items()}))
    caster = FairCaster(FairCastConfig(enabled=True, seed=29, audit=True, audit_sample=sample))
    for _ in range(3):
        caster.cast("model.embed_tokens.weight", master)
        caster.advance()
        master.add_(1e-6)
    metrics = caster.metrics()
    RESULTS["audit"]["caster_metrics"] = metrics
    check(f"audited FairCaster.cast of the {rows} x {cols} master on {DEV.type}: finite metrics",
          bool(metrics) and all(v == v and abs(v) != float("inf") for v in metrics.values()), str(metrics))
    del master


# -- finding 3: verl's Triton quantizer against Fair Cast's fp8 copy -------------------------------------------


def verl_fp8_kernel():
    """verl's fp8_kernel.py as a module of its own (it imports torch and triton only), from an installed verl (or
    the offline wheels of wheels.sh installed under /tmp/site)."""
    candidates = [os.path.join(p, "verl", "utils", "kernel", "fp8_kernel.py") for p in sys.path if p]
    candidates += glob.glob("/tmp/site/verl/utils/kernel/fp8_kernel.py")
    found = next((c for c in candidates if os.path.isfile(c)), None)
    if found is None:
        raise Skip("verl's fp8_kernel.py is not here: pip install --no-deps verl==0.9.1 (only that file is used)")
    spec = importlib.util.spec_from_file_location("verl_fp8_kernel", found)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def provide_verl_fp8_kernel() -> str:
    """Make ``import verl.utils.kernel.fp8_kernel`` (what the verl adapter's fp8 audit and fp8_loss call) give that
    one file, without verl's package imports (Ray, tensordict, ...: not on the device). Under --cpu-smoke with no
    verl wheel at hand, a stand-in of verl's PyTorch path (faircast_plugins.fp8, bit-identical to it) takes its
    place. Returns what was provided."""
    import types

    try:
        module, what = verl_fp8_kernel(), "verl's fp8_kernel.py"
    except Skip:
        if not SMOKE:
            raise
        module, what = types.ModuleType("verl_fp8_kernel"), "a stand-in of verl's PyTorch path (smoke)"
        module._TRITON_AVAILABLE, module._DISABLE_TRITON_FP8 = False, False
        module.scaled_fp8_blockwise = lambda x, block: fp8.quantize_blockwise(x, block=block[0])
    for name in ("verl", "verl.utils", "verl.utils.kernel"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["verl.utils.kernel.fp8_kernel"] = module
    return what


def every_bf16_amax(block: int = 128) -> torch.Tensor:
    """A bf16 matrix of 128x128 blocks, one per positive normal bf16 value, that value the block's amax (its only
    non-zero element, signs alternating over the blocks)."""
    bits = torch.arange(0x0080, 0x7F80, dtype=torch.int32)  # positive normal bf16 values
    values = bits.to(torch.int16).view(torch.bfloat16)
    n = values.numel()  # 32512 = 256 * 127
    br, bc = 256, n // 256
    assert br * bc == n
    m = torch.zeros(br * block, bc * block, dtype=torch.bfloat16)
    signs = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0).to(torch.bfloat16)
    grid = (values * signs).reshape(br, bc)
    m[::block, ::block] = grid  # the top-left element of each block
    return m


def fp8_compare(label: str, x: torch.Tensor, verl_q, verl_s, scales: str) -> dict:
    ours_q, ours_s = fp8.quantize_blockwise(x, scales=scales)
    verl_s = verl_s.reshape(ours_s.shape)  # verl's PyTorch path keeps a trailing 1: (blocks_m, blocks_n, 1)
    desc_diff = int((ours_s.float().view(torch.int32) != verl_s.float().view(torch.int32)).sum())
    byte_diff = int((ours_q.view(torch.uint8) != verl_q.view(torch.uint8)).sum())
    return {"what": label, "scales": scales, "descales": ours_s.numel(), "descale_bits_differ": desc_diff,
            "fp8_bytes": ours_q.numel(), "fp8_bytes_differ": byte_diff}


def fp8quant_section() -> None:
    if DEV.type != "cuda":
        raise Skip("verl's Triton fp8 quantizer runs on CUDA only (the formulas are unit-tested on CPU in tests/)")
    kernel = verl_fp8_kernel()
    if not kernel.is_triton_available():
        raise Skip("verl's fp8_kernel found no Triton")
    rows = []
    gen = torch.Generator(device=DEV).manual_seed(3)
    inputs = {"every positive normal bf16 amax (32512 blocks)": every_bf16_amax().to(DEV),
              "random 4096 x 14336 weight (std 0.02)": (torch.randn(4096, 14336, device=DEV, generator=gen) * 0.02)
              .to(torch.bfloat16)}
    # faircast_plugins.fp8's emulation of the Triton formula (correctly rounded division): measured, not required
    triton_scales = [s for s in fp8.SCALES if "triton" in s]
    for label, x in inputs.items():
        triton_q, triton_s = kernel.scaled_fp8_blockwise_triton(x, [128, 128])
        torch_q, torch_s = kernel._scaled_fp8_blockwise_pytorch(x, [128, 128])
        sync()
        for scales in ["verl"] + triton_scales:
            row = fp8_compare(label, x, triton_q, triton_s, scales)
            row["against"] = "verl Triton"
            rows.append(row)
        row = fp8_compare(label, x, torch_q, torch_s, "verl")
        row["against"] = "verl PyTorch"
        rows.append(row)
        check(f"fp8 ({label}): Fair Cast's 'verl' copy == verl's PyTorch quantizer on CUDA, descales and bytes",
              row["descale_bits_differ"] == 0 and row["fp8_bytes_differ"] == 0, str(row))
    # What the verl adapter's fp8 audit and fp8_loss compute with: verl's own quantizer, by verl's rule (Triton here)
    provide_verl_fp8_kernel()
    from faircast_plugins.verl import fp8 as verl_fp8

    path, x = verl_fp8.verl_fp8_path(), inputs["random 4096 x 14336 weight (std 0.02)"]
    triton_q, triton_s = kernel.scaled_fp8_blockwise_triton(x, [128, 128])
    want = fp8.dequantize_blockwise(triton_q, triton_s.reshape(triton_s.shape[0], triton_s.shape[1]))
    got = verl_fp8.engine_fp8(x)
    check(f"the verl adapter's fp8 copy (engine_fp8, verl's {path} path) == verl's Triton quantizer's, dequantized",
          path == "triton" and torch.equal(got.view(torch.int32), want.view(torch.int32)),
          f"path {path}, {int((got != want).sum())} elements differ")
    RESULTS["fp8quant"] = rows
    for r in rows:
        say(f"  {r['against']:>12} vs Fair Cast {r['scales']!r:>14}, {r['what']}: descales differ "
            f"{r['descale_bits_differ']}/{r['descales']}, fp8 bytes differ {r['fp8_bytes_differ']}/{r['fp8_bytes']}")


# -- finding 2: fp8_loss on one 7B MLP layer ----------------------------------------------------------------

LAYER = (64, 192) if SMOKE else (4096, 14336)  # (out, in) of down_proj: in = 14336
TOKENS = 16 if SMOKE else 8192


class _Block(torch.nn.Module):
    def __init__(self, out_features: int, in_features: int, checkpoint: bool):
        super().__init__()
        self.down_proj = torch.nn.Linear(in_features, out_features, bias=False)
        self.checkpoint = checkpoint

    def forward(self, x):
        if self.checkpoint:
            return torch.utils.checkpoint.checkpoint(self.down_proj, x, use_reentrant=False)
        return self.down_proj(x)


def fp8loss_run(fp8_loss: bool, checkpoint: bool, reps: int) -> dict:
    from faircast_plugins.verl import fp8 as verl_fp8

    out_f, in_f = LAYER
    outer = torch.nn.Module()
    outer.mlp = _Block(out_f, in_f, checkpoint).to(DEV, torch.bfloat16)  # FSDP's full bf16 compute weight
    if fp8_loss:
        changed = verl_fp8.enable_fp8_loss(outer)
        if changed != 1:
            raise RuntimeError(f"enable_fp8_loss changed {changed} layers, expected 1")
    x = torch.randn(TOKENS, in_f, device=DEV, dtype=torch.bfloat16, requires_grad=True)

    def step():
        y = outer.mlp(x)
        y.float().square().mean().backward()
        outer.mlp.down_proj.weight.grad = None
        x.grad = None

    step()  # warm-up (Triton/cuBLAS choices)
    sync()
    if DEV.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            step()
        end.record()
        sync()
        ms = start.elapsed_time(end) / reps
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        t = time.perf_counter()
        for _ in range(reps):
            step()
        ms, peak = (time.perf_counter() - t) * 1e3 / reps, None
    return {"fp8_loss": fp8_loss, "checkpoint": checkpoint, "ms_per_fwd_bwd": round(ms, 3),
            "peak_mib_above_start": None if peak is None else round(peak, 1)}


def fp8loss_section() -> None:
    RESULTS["fp8loss_quantizer"] = provide_verl_fp8_kernel()
    reps = 1 if SMOKE else 5
    rows = [fp8loss_run(fp8_loss, ckpt, reps) for ckpt in (False, True) for fp8_loss in (False, True)]
    RESULTS["fp8loss"] = {"layer_out_in": LAYER, "tokens": TOKENS, "rows": rows}
    for r in rows:
        plain = next(p for p in rows if not p["fp8_loss"] and p["checkpoint"] == r["checkpoint"])
        ratio = r["ms_per_fwd_bwd"] / plain["ms_per_fwd_bwd"]
        r["time_vs_bf16"] = round(ratio, 2)
        say(f"  fp8_loss={r['fp8_loss']!s:5} checkpoint={r['checkpoint']!s:5}: {r['ms_per_fwd_bwd']:9.2f} ms "
            f"({ratio:5.2f}x bf16), peak {r['peak_mib_above_start']} MiB above start")
    check(f"fp8_loss forward+backward of one {LAYER[0]} x {LAYER[1]} layer runs, with and without checkpointing",
          all(r["ms_per_fwd_bwd"] > 0 for r in rows))
    REPORT.write()


# -- finding 8: an uneven FSDP2 shard through verl's offload ---------------------------------------------------


def offload_round_trip(mesh, world: int, dim0: int, non_blocking: bool) -> dict:
    """One FSDP2 linear of ``dim0`` rows sharded over ``world`` ranks (this process is the last one), its local shard
    set to known values, offloaded behind a busy stream and reloaded: whether the host and reloaded shards are
    unchanged."""
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Linear(1 << 14, dim0, bias=False, device="cuda")
    fully_shard(model, mesh=mesh)
    detected = bool(uneven_shards(model))  # what makes the verl adapter offload this module blocking
    local = model.weight.to_local()
    local.copy_(torch.arange(local.numel(), device="cuda", dtype=torch.float32).reshape(local.shape) + 1)
    before = local.clone()
    busy = torch.randn(8192, 8192, device="cuda")
    for _ in range(20):  # keep the stream busy so a non-blocking device-to-host copy lands late
        busy = busy @ busy * 1e-4
    model.to("cpu", non_blocking=non_blocking)  # verl's offload_fsdp2_model_to_cpu: non_blocking=True
    torch.cuda.synchronize()
    host = model.weight.to_local().clone()
    model.to("cuda", non_blocking=non_blocking)
    torch.cuda.synchronize()
    back = model.weight.to_local()
    padded = -(-dim0 // world)
    return {"dim0": dim0, "non_blocking": non_blocking, "local_rows": before.shape[0], "padded_rows": padded,
            "uneven": before.shape[0] != padded, "detected_uneven": detected,
            "host_equal": torch.equal(host, before.cpu()),
            "reloaded_equal": torch.equal(back, before),
            "host_zero_rows": int((host == 0).all(dim=1).sum()) if host.numel() else 0}


@torch.no_grad()
def offload_section() -> None:
    """Finding 8 (upstream, suspected): torch's FSDP2 re-pads an uneven shard with a host copy inside ``_apply``;
    after verl's ``model.to("cpu", non_blocking=True)`` that copy may read the pinned buffer before the
    device-to-host copy lands. Controls: the same uneven shard offloaded blocking, and an even shard non-blocking,
    must come back unchanged (else this check itself is wrong). The non-blocking uneven case is the observation."""
    if DEV.type != "cuda":
        raise Skip("the race needs a CUDA device-to-host copy (pinned, non-blocking)")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world, rank = 6, 5
    os.environ.setdefault("LOCAL_RANK", "0")
    torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = torch.distributed.device_mesh.DeviceMesh("cuda", list(range(world)))
        # 16 rows over 6 ranks: rank 5 holds 1 of 3 (padded); 4097: 682 of 683; 18: 3 of 3 (even)
        rows = [offload_round_trip(mesh, world, dim0, nb) for dim0, nb in
                ((16, False), (4097, False), (18, True), (16, True), (4097, True))]
        RESULTS["offload"] = rows
        for r in rows:
            say(f"  {r['dim0']:5} rows, rank {rank} of {world} holds {r['local_rows']} of {r['padded_rows']}, "
                f"non_blocking={r['non_blocking']!s:5}: host shard unchanged {r['host_equal']}, reloaded unchanged "
                f"{r['reloaded_equal']} ({r['host_zero_rows']} all-zero host rows)")
        for r in rows:
            if not r["non_blocking"] or not r["uneven"]:
                check(f"control: FSDP2 shard of {r['dim0']} rows ({r['local_rows']} of {r['padded_rows']}), "
                      f"non_blocking={r['non_blocking']}: unchanged on the host and after the reload",
                      r["host_equal"] and r["reloaded_equal"], str(r))
        check("fsdp.uneven_shards (the verl adapter's trigger for a blocking offload) flags exactly the uneven shards",
              all(r["detected_uneven"] == (r["dim0"] % world != 0) for r in rows), str(rows))
        hazard = [r for r in rows if r["non_blocking"] and r["uneven"] and not (r["host_equal"] and r["reloaded_equal"])]
        RESULTS["offload_hazard_reproduced"] = bool(hazard)
        say(f"  finding 8 (upstream): uneven shards after a non-blocking offload "
            f"{'CHANGED: hazard reproduced' if hazard else 'unchanged: not reproduced here'}")
    finally:
        dist.destroy_process_group()


def main() -> int:
    say(f"benchmarks.gpu.real_sizes on {torch.cuda.get_device_name(0) if DEV.type == 'cuda' else 'CPU (smoke)'}, "
        f"torch {torch.__version__}")
    RESULTS["on"] = {"device": DEV.type, "smoke": SMOKE}
    for name, fn in (("audit", audit_section), ("fp8quant", fp8quant_section), ("fp8loss", fp8loss_section),
                     ("offload", offload_section)):
        REPORT.section(name, fn)
    return REPORT.finish("real_sizes")


if __name__ == "__main__":
    sys.exit(main())
