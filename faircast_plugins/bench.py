"""``faircast bench``: throughput of ``fair_cast`` against a plain ``.to(torch.bfloat16)``, side by side, in one run.

Every case is timed once per repetition, in turn, so a noisy (shared) machine slows all of them alike; the
ratio to ``.to(torch.bfloat16)`` is given both from the best times and as the median of the per-repetition
ratios. GB/s counts the bytes the cast must move: 6 per element (4 read, 2 written), 14 for error feedback
(x and the residual read, bf16 and the residual written). The pure-torch reference is ~100x slower than a plain
cast on CPU (0.01x of ``.to``, docs/kernels-cpu.md), so it runs on ``--ref-numel`` elements and its time is scaled linearly, and labelled so.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, List

import torch

from .cast import MODES, STOCHASTIC_RULE, available_backends, fair_cast
from .key import mode_key

BYTES_PER_ELEMENT = {"stochastic": 6, "sticky": 6, "nearest": 6, "error_feedback": 14, "plain": 6}


@dataclass
class Case:
    label: str
    run: Callable[[], object]
    numel: int  # elements one call touches
    scale: float  # numel of the headline size / numel timed (1 unless extrapolated)
    bytes_per_element: int
    times: List[float] = field(default_factory=list)  # wall seconds, already scaled to the headline size
    cpu_times: List[float] = field(default_factory=list)  # CPU seconds of all this process's threads, scaled


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--numel", type=int, default=64 << 20, help="elements per tensor (default 64M)")
    parser.add_argument("--ref-numel", type=int, default=1 << 20,
                        help="elements for the slow torch reference, scaled up to --numel (default 1M)")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions of every case (default 7)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device of the tensors (default: cuda when available, else cpu)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated backends to time, 'torch' being the reference (default: all available on the device)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated modes (default {','.join(MODES)})")


def machine_name(device: torch.device) -> str:
    """The device's name for a benchmark record: the GPU's, or the CPU model with its logical CPU count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical CPUs"


def _device_backends(device: torch.device) -> List[str]:
    """Fast backends that run on this device (the torch reference is added separately)."""
    here = available_backends()
    if device.type == "cuda":
        return [b for b in ("triton",) if b in here]
    if device.type == "cpu":
        return [b for b in ("cpu",) if b in here]
    return []


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn):
        sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        fn()
        sync()
        return time.perf_counter() - start, time.process_time() - cpu_start

    return timed


def _cases(args, device: torch.device, backends: List[str], modes: List[str]) -> tuple[List[Case], List[str]]:
    n, n_ref = args.numel, min(args.ref_numel, args.numel)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(n, generator=gen) * 0.02).to(device)
    x_ref = x[:n_ref].clone()
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    cases = [
        Case(".to(torch.bfloat16)", lambda: x.to(torch.bfloat16), n, 1.0, 6),
        Case("out.copy_(x), preallocated", lambda: out.copy_(x), n, 1.0, 6),
    ]
    checks = []
    for backend in backends:
        ref = backend == "torch"
        xb = x_ref if ref else x
        for mode in modes:
            key = mode_key(0, 1, "bench.weight", mode)  # sticky: the version-free key
            residual = torch.zeros_like(xb) if mode == "error_feedback" else None
            label = f"fair_cast {mode:<14} {backend}"
            if ref:
                label += f"  (reference: timed on {n_ref:,}, x{n / n_ref:g})"
            cases.append(Case(label, lambda xb=xb, mode=mode, r=residual, b=backend:
                              fair_cast(xb, key=key, mode=mode, residual=r, backend=b),
                              xb.numel(), n / xb.numel(), BYTES_PER_ELEMENT[mode]))
            if not ref:
                checks.append(_check(backend, mode, x_ref, key))
    return cases, checks


# fp32 bit patterns mixed into the checked slice: NaNs with payloads, infinities, fp32 max, subnormals, a tie
_SPECIALS = [0x7F800001, -1, 0x7F800000, -0x800000, 0x7F7FFFFF, 0x7F7F0001, 1, -0x7FFFFFFF, 0x3F808000]


def _check(backend: str, mode: str, x: torch.Tensor, key: int) -> str:
    """Bit-identity of one backend with the torch reference on the reference-sized slice (odd offset, specials)."""
    offset = 2**32 + 3
    x = x.clone()
    specials = torch.tensor(_SPECIALS, dtype=torch.int32, device=x.device).view(torch.float32)
    x[: x.numel() // 4096 * 4096].view(-1, 4096)[:, :len(_SPECIALS)] = specials[: min(len(_SPECIALS), x.numel())]
    r_fast = torch.full_like(x, 1e-6) if mode == "error_feedback" else None
    r_ref = None if r_fast is None else r_fast.clone().cpu()
    offset = offset if mode in STOCHASTIC_RULE else 0
    got = fair_cast(x, key=key, offset=offset, mode=mode, residual=r_fast, backend=backend)
    want = fair_cast(x.cpu(), key=key, offset=offset, mode=mode, residual=r_ref, backend="torch")
    same = torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))
    if r_fast is not None:
        same = same and torch.equal(r_fast.cpu().view(torch.int32), r_ref.view(torch.int32))
    return f"{backend} {mode}: {'bit-identical' if same else 'MISMATCH'} vs torch reference on {x.numel():,} elements"


def _fmt_row(case: Case, base: Case, n: int) -> str:
    best, med = min(case.times), statistics.median(case.times)
    gbps = case.bytes_per_element * n / best / 1e9
    ratio_best = min(base.times) / best
    paired = [b / t for b, t in zip(base.times, case.times)]
    cpu = min(case.cpu_times)
    return (f"{case.label:<58} {best * 1e3:>9.1f} {med * 1e3:>9.1f} {gbps:>7.2f} {ratio_best:>8.2f}x "
            f"{statistics.median(paired):>8.2f}x {min(paired):>6.2f}x {cpu * 1e3:>9.1f} {min(base.cpu_times) / cpu:>6.2f}x")


def run_bench(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        device = torch.device(args.device)
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as exc:  # an unknown name, or a device this torch build cannot reach
        raise SystemExit(f"faircast bench: cannot use --device {args.device!r} here ({exc}); leave it out to time "
                         f"CUDA when torch sees a GPU, else the CPU") from None
    if args.numel < 1 or args.ref_numel < 1 or args.reps < 1:
        raise SystemExit("faircast bench: --numel, --ref-numel and --reps must be positive")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"faircast bench: unknown mode(s) {bad}; expected {','.join(MODES)}")
    backends = _device_backends(device)
    if args.backends:
        wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
        missing = [b for b in wanted if b != "torch" and b not in backends]
        if missing:
            raise SystemExit(f"faircast bench: backend(s) {missing} not available on {device} (here: {backends})")
        backends = [b for b in backends if b in wanted] + (["torch"] if "torch" in wanted else [])
    else:
        backends = backends + ["torch"]

    threads = f"torch threads {torch.get_num_threads()}"
    print(f"faircast bench  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}  device {device}: "
          f"{machine_name(device)}")
    print(f"torch {torch.__version__}, {threads}; {args.numel:,} elements, {args.reps} repetitions; "
          f"load average at start {os.getloadavg()[0]:.1f}", flush=True)

    cases, checks = _cases(args, device, backends, modes)
    timed = _timer(device)
    print("warm-up (the first call of a numba kernel compiles it once per machine; cached after):", flush=True)
    for case in cases:
        wall, _ = timed(case.run)
        print(f"  {case.label:<58} {wall * 1e3:9.1f} ms", flush=True)
    if "cpu" in backends:
        import numba

        print(f"numba {numba.__version__}, threading layer {numba.threading_layer()}, {numba.get_num_threads()} threads")
    for line in checks:
        print(f"check: {line}", flush=True)
    for rep in range(args.reps):
        for case in cases:
            wall, cpu = timed(case.run)
            case.times.append(wall * case.scale)
            case.cpu_times.append(cpu * case.scale)
        print(f"  repetition {rep + 1}/{args.reps} done", flush=True)

    base = cases[0]
    print(f"\n{'case (' + format(args.numel, ',') + ' elements)':<58} {'ms min':>9} {'ms med':>9} {'GB/s':>7} "
          f"{'ratio':>9} {'ratio':>9} {'ratio':>7} {'CPU ms':>9} {'ratio':>7}")
    print(f"{'':<58} {'':>9} {'':>9} {'(min)':>7} {'(min t)':>9} {'(med)':>9} {'(min)':>7} {'(min)':>9} {'(CPU)':>7}")
    for case in cases:
        print(_fmt_row(case, base, args.numel))
    print("GB/s: 6 B/element (4 read + 2 written), 14 for error_feedback. sticky is the stochastic kernel under a "
          "version-free key, so it should time as stochastic. ratio: throughput / that of "
          ".to(torch.bfloat16), from the best wall times, then the median and minimum of the per-repetition ratios.\n"
          "CPU ms: CPU time of all threads of this process (insensitive to other processes' load); ratio (CPU) "
          "compares it with .to(torch.bfloat16)'s.")
    print(f"load average at end {os.getloadavg()[0]:.1f}; bench took {time.perf_counter() - started:.0f} s")
    return 0 if all("MISMATCH" not in c for c in checks) else 1
