"""Where the CPU stochastic cast's time goes: its two passes alone, the fused kernel, and a plain cast, side by side.

The ``cpu`` backend's stochastic kernel (faircast_plugins/kernels/cpu_cast.py) interleaves two passes: Philox4x32-10
(pure arithmetic, 18 32x32->64 products per 8 elements) and the rounding (the memory traffic of a plain cast). This
times, interleaved repetition by repetition on the same tensor and threads:

- ``.to(torch.bfloat16)``, the baseline of ``faircast bench``, and the ``nearest`` kernel (a plain cast in numba);
- the Philox pass alone: the kernel's own Philox blocks for every group of the tensor, no memory traffic;
- the rounding pass alone: the kernel's own rounding chunks over the whole tensor, with one fixed block of noise;
- the full ``stochastic`` kernel;
- the ``error_feedback`` kernel, and its memory traffic alone: a loop that reads x and the residual and writes a
  bf16 and the residual (14 bytes per element, like the kernel) with one integer add and shift per element.

If the Philox pass alone takes most of ``.to``'s time, the stochastic kernel cannot come close to ``.to`` on that
machine, however well the two passes overlap; if error feedback's traffic alone takes over twice ``.to``'s time, no
implementation of the contract's error feedback (an fp32 residual read and written per element) reaches 0.5x
with normal stores. Run in the tests-core venv (numba kernels compile on the first run):

    python benchmarks/cpu_breakdown.py                  # 64M elements, 15 repetitions
    python benchmarks/cpu_breakdown.py --numel 65536 --reps 1   # smoke (tests/core/test_bench.py)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from numba import njit, prange  # noqa: E402

from faircast_plugins.kernels import cpu_cast as kc  # noqa: E402


@njit(parallel=True, nogil=True)
def _philox_pass(sink, n, ks):
    """The Philox words of every group of an ``n``-element tensor at offset 0, block by block like the kernel;
    one word per block goes to ``sink`` so that nothing is optimized away."""
    n_blocks = (n + 8 * kc.BLOCK_GROUPS - 1) // (8 * kc.BLOCK_GROUPS)
    for b in prange(n_blocks):
        words = np.empty(4 * kc.BLOCK_GROUPS, np.uint32)
        g_block = b * kc.BLOCK_GROUPS
        for s0 in range(g_block, g_block + kc.BLOCK_GROUPS, kc.STEP_GROUPS):
            kc.philox_block(words, np.uint64(s0 & 0xFFFFFFFF), np.uint64(s0 >> 32), kc.STEP_GROUPS, ks)
        sink[b] = words[b & 1023]


@njit(parallel=True, nogil=True)
def _rounding_pass(out, xu, noise):
    """The kernel's rounding of every element, step by step, with the same block of noise everywhere."""
    step = 8 * kc.STEP_GROUPS
    n_steps = (xu.size + step - 1) // step
    for s in prange(n_steps):
        lo = s * step
        hi = min(lo + step, xu.size)
        kc._round_block(out[lo:hi], xu[lo:hi], noise[: hi - lo], False)


@njit(parallel=True, nogil=True)
def _error_feedback_traffic(out, xu, ru):
    """error_feedback's loads and stores (x and r in, bf16 and r out) with trivial integer arithmetic."""
    for i in prange(xu.size):
        total = xu[i] + ru[i]
        out[i] = np.uint16(total >> np.uint32(16))
        ru[i] = total & np.uint32(0xFFFF)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=64 << 20)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args(argv)
    n = args.numel
    threads = torch.get_num_threads()
    kc._use_torch_thread_count()  # numba on torch's thread count, torch's count left as it was
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.02
    xu = x.view(torch.int32).numpy().view(np.uint32)
    ks = kc.round_keys(0x243F6A8885A308D3)
    noise = np.random.default_rng(0).integers(0, 1 << 16, 8 * kc.STEP_GROUPS, dtype=np.uint16)
    sink = np.zeros(n // 8 + 1, np.uint32)
    residual = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-5).numpy()
    residual_bits = torch.zeros(n, dtype=torch.int32).numpy().view(np.uint32)

    def fresh_out():
        return torch.empty(n, dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)

    cases = {
        ".to(torch.bfloat16)": lambda: x.to(torch.bfloat16),
        "nearest kernel": lambda: kc._nearest_kernel(fresh_out(), xu),
        "Philox pass alone": lambda: _philox_pass(sink, n, ks),
        "rounding pass alone": lambda: _rounding_pass(fresh_out(), xu, noise),
        "stochastic kernel": lambda: kc._stochastic_kernel(fresh_out(), xu, ks, 0, n >= kc.STREAM_MIN_NUMEL),
        "EF traffic alone": lambda: _error_feedback_traffic(fresh_out(), xu, residual_bits),
        "error_feedback kernel": lambda: kc._error_feedback_kernel(fresh_out(), x.numpy(), residual),
    }
    for run in cases.values():  # compile and warm up
        run()
    wall = {k: [] for k in cases}
    cpu = {k: [] for k in cases}
    for _ in range(args.reps):
        for label, run in cases.items():
            t0, c0 = time.perf_counter(), time.process_time()
            run()
            wall[label].append(time.perf_counter() - t0)
            cpu[label].append(time.process_time() - c0)

    base = wall[".to(torch.bfloat16)"]
    print(f"{n:,} elements, {threads} threads, {args.reps} repetitions, load average {os.getloadavg()[0]:.1f}")
    print(f"{'case':<22} {'ms min':>8} {'ms med':>8} {'ns/el/thread':>13} {'vs .to (med of paired)':>23}")
    for label in cases:
        med_cpu = statistics.median(cpu[label])
        paired = statistics.median(b / t for b, t in zip(base, wall[label]))
        print(f"{label:<22} {min(wall[label]) * 1e3:>8.1f} {statistics.median(wall[label]) * 1e3:>8.1f} "
              f"{med_cpu / n * 1e9:>13.3f} {paired:>22.2f}x")
    print("ns/el/thread: median CPU time of all threads per element. 'vs .to': the median over repetitions of "
          ".to's time / the case's time (above 1: faster than .to).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
