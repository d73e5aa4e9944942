"""Triton kernel for the Fair Cast rounding contract (``docs/ROUNDING.md``), many tensors per launch.

Design:

* **Group space.** A tile is ``ROWS`` x 8 elements; row ``g`` is the 8 elements with global indices ``8g .. 8g+7``
  and costs exactly one Philox4x32-10 call (counter ``(g_lo, g_hi, 0, 0)``, key ``(k0, k1)``), whose four words
  give each lane its 16 noise bits. Tiles are aligned to the global index, so any shard offset works and the bits
  never depend on ``ROWS``, on the launch, or on how a tensor is split.
* **One launch for many tensors.** The host writes a small int64 table (one row per tensor: pointers, numel, global
  offset, key halves, an alignment flag) and the cumulative tile counts; program ``pid`` finds its tensor by a
  binary search over those counts (a few cached scalar loads). ~310 tensors of a 1.7B model are one launch.
* **Vectorized fast path.** A tensor whose offset and numel are multiples of 8 and whose pointers are 16-byte
  aligned takes a branch where the compiler is told so (``tl.multiple_of``), so loads and stores can be 128-bit;
  any other tensor takes the scalar (still coalesced) branch. The choice is per tensor, at run time, in the
  same launch, and both branches compute the same bits.
* **Integer-only rounding.** Stochastic rounding, round-to-nearest-even and the NaN/inf/saturation rules are
  done on the fp32 bit pattern, so the result does not depend on the device's float conversion instructions.

Under ``TRITON_INTERPRET=1`` (set before triton is imported) the same kernel runs on CPU tensors, slowly
(~20 ms per program instance), so the launcher then picks large tiles.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only where triton is absent
    raise ImportError(
        "faircast_plugins.kernels.triton_cast needs triton: pip install 'triton>=3.2' (a build matching your torch)"
    ) from exc

MODE_IDS = {"stochastic": 0, "sticky": 0, "nearest": 1, "error_feedback": 2}  # sticky: stochastic, version-free key
N_ROUNDS = 10
DEFAULT_ROWS = 256  # 2048 elements per program on a GPU
DEFAULT_NUM_WARPS = 4
TABLE_COLS = tl.constexpr(8)  # int64 columns per tensor: x_ptr, out_ptr, residual_ptr, numel, offset, k0, k1, aligned
MAX_GRID = 2**31 - 1
M32 = 0xFFFFFFFF


# --------------------------------------------------------------------------------------------------------------
# Device code
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def philox4x32(c0, c1, c2, c3, k0, k1, N_ROUNDS: tl.constexpr):
    """Philox4x32 (Random123) on uint32 blocks ``c0..c3`` under the uint32 key ``(k0, k1)``."""
    for _ in tl.static_range(N_ROUNDS):
        hi0 = tl.umulhi(c0, 0xD2511F53)
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo0 = c0 * 0xD2511F53
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _noise16(groups, k0, k1, N_ROUNDS: tl.constexpr):
    """The [ROWS, 8] uint32 noise (16 bits each) of the groups ``groups`` (int64 [ROWS]): one Philox call per row."""
    lo = groups.to(tl.uint32)  # truncation: the low 32 bits
    hi = (groups >> 32).to(tl.uint32)
    zero = lo * 0
    r0, r1, r2, r3 = philox4x32(lo, hi, zero, zero, k0, k1, N_ROUNDS)
    lane = tl.arange(0, 8)[None, :]
    word = tl.where(lane < 4, tl.where(lane < 2, r0[:, None], r1[:, None]),
                    tl.where(lane < 6, r2[:, None], r3[:, None]))
    return tl.where((lane & 1) == 1, word >> 16, word & 0xFFFF)


@triton.jit
def _nan_bits(u):
    """ROUNDING.md's NaN rule: sign and top payload kept, quiet bit set."""
    return (u >> 16) | 0x0040


@triton.jit
def _stochastic_bits(u, noise):
    """bf16 bits (uint32) of fp32 bits ``u`` under 16-bit ``noise``: sign-magnitude, saturating (ROUNDING.md §4)."""
    mag = u & 0x7FFFFFFF
    hi = tl.minimum((mag + noise) >> 16, 0x7F7F)  # no wrap: mag + noise <= 0x8000FFFE
    hi = tl.where(mag == 0x7F800000, 0x7F80, hi)
    bits = ((u >> 16) & 0x8000) | hi
    return tl.where(mag > 0x7F800000, _nan_bits(u), bits)


@triton.jit
def _nearest_bits(u):
    """bf16 bits (uint32) of fp32 bits ``u``, round to nearest even; overflow goes to inf; NaN rule of §4."""
    mag = u & 0x7FFFFFFF
    hi = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16  # carries into the exponent; inf stays inf
    bits = ((u >> 16) & 0x8000) | hi
    return tl.where(mag > 0x7F800000, _nan_bits(u), bits)


@triton.jit
def _cast_tile(x_ptr, out_ptr, res_ptr, local, mask, groups, k0, k1, MODE: tl.constexpr, N_ROUNDS: tl.constexpr):
    """Cast one [ROWS, 8] tile: ``local`` are element indices within the tensor, ``groups`` the rows' global groups."""
    x = tl.load(x_ptr + local, mask=mask, other=0.0)
    if MODE == 2:  # error feedback, ROUNDING.md §4
        r = tl.load(res_ptr + local, mask=mask, other=0.0)
        r = tl.where((r.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) >= 0x7F800000, 0.0, r)  # non-finite r counts as 0
        s = x + r  # finite or +-inf when x is finite; a NaN s (x not finite) is never read below
        bits = _nearest_bits(s.to(tl.uint32, bitcast=True))
        saturated = (bits & 0x7FFF) >= 0x7F80  # rounds past the largest finite bf16, or overflowed
        bits = tl.where(saturated, (bits & 0x8000) | 0x7F7F, bits)
        q = (bits << 16).to(tl.float32, bitcast=True)
        xu = x.to(tl.uint32, bitcast=True)
        x_special = (xu & 0x7FFFFFFF) >= 0x7F800000
        bits = tl.where(x_special, _nearest_bits(xu), bits)  # inf or NaN master: served from its own bits
        tl.store(res_ptr + local, tl.where(saturated | x_special, 0.0, s - q), mask=mask)
    elif MODE == 0:
        bits = _stochastic_bits(x.to(tl.uint32, bitcast=True), _noise16(groups, k0, k1, N_ROUNDS))
    else:
        bits = _nearest_bits(x.to(tl.uint32, bitcast=True))
    tl.store(out_ptr + local, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)


@triton.jit
def _cast_many_kernel(table_ptr, starts_ptr, ROWS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                      MODE: tl.constexpr, N_ROUNDS: tl.constexpr):
    """One program casts ROWS groups of one tensor; ``starts`` holds each tensor's first program (padded, sorted)."""
    pid = tl.program_id(0).to(tl.int64)
    # Binary search for the last tensor t with starts[t] <= pid (padding rows hold a huge start).
    t = pid * 0
    for step in tl.static_range(SEARCH_STEPS - 1, -1, -1):
        cand = t + (1 << step)
        t = tl.where(tl.load(starts_ptr + cand) <= pid, cand, t)
    row = table_ptr + t * TABLE_COLS
    x_addr = tl.load(row + 0)
    out_addr = tl.load(row + 1)
    res_addr = tl.load(row + 2)
    numel = tl.load(row + 3)
    offset = tl.load(row + 4)
    k0 = tl.load(row + 5).to(tl.uint32)
    k1 = tl.load(row + 6).to(tl.uint32)
    aligned = tl.load(row + 7)
    tile = (pid - tl.load(starts_ptr + t)) * ROWS + tl.arange(0, ROWS)  # tile rows, counted from the tensor's first group
    groups = (offset >> 3) + tile
    lane = tl.arange(0, 8)[None, :]
    if aligned != 0:
        # offset % 8 == 0, numel % 8 == 0, every pointer 16-byte aligned: whole rows are in or out.
        local = tile[:, None] * 8 + lane
        mask = (tile < (numel >> 3))[:, None] & (lane < 8)
        _cast_tile(tl.multiple_of(x_addr.to(tl.pointer_type(tl.float32)), 16),
                   tl.multiple_of(out_addr.to(tl.pointer_type(tl.bfloat16)), 16),
                   tl.multiple_of(res_addr.to(tl.pointer_type(tl.float32)), 16),
                   local, mask, groups, k0, k1, MODE, N_ROUNDS)
    else:
        local = tile[:, None] * 8 + lane - (offset & 7)
        mask = (local >= 0) & (local < numel)
        _cast_tile(x_addr.to(tl.pointer_type(tl.float32)), out_addr.to(tl.pointer_type(tl.bfloat16)),
                   res_addr.to(tl.pointer_type(tl.float32)), local, mask, groups, k0, k1, MODE, N_ROUNDS)


@triton.jit
def _cast_runs_kernel(x_ptr, out_ptr, runs_ptr, starts_ptr, keys_ptr, base_misaligned, ROWS: tl.constexpr,
                      SEARCH_STEPS: tl.constexpr, MODE: tl.constexpr, N_ROUNDS: tl.constexpr):
    """One program casts ROWS groups of one run of a run table (``pos, first, length, slot`` per row) of ONE flat
    (x, out) pair; ``starts`` holds each run's first program (padded, sorted), ``keys`` the key halves per slot."""
    pid = tl.program_id(0).to(tl.int64)
    t = pid * 0
    for step in tl.static_range(SEARCH_STEPS - 1, -1, -1):
        cand = t + (1 << step)
        t = tl.where(tl.load(starts_ptr + cand) <= pid, cand, t)
    row = runs_ptr + t * 4
    pos = tl.load(row + 0)
    offset = tl.load(row + 1)
    numel = tl.load(row + 2)
    slot = tl.load(row + 3)
    k0 = tl.load(keys_ptr + 2 * slot).to(tl.uint32)
    k1 = tl.load(keys_ptr + 2 * slot + 1).to(tl.uint32)
    tile = (pid - tl.load(starts_ptr + t)) * ROWS + tl.arange(0, ROWS)
    groups = (offset >> 3) + tile
    lane = tl.arange(0, 8)[None, :]
    if ((pos | offset | numel) & 7 | base_misaligned) == 0:
        # x and out 16-byte aligned, pos, offset and numel multiples of 8: whole rows are in or out.
        local = tile[:, None] * 8 + lane
        mask = (tile < (numel >> 3))[:, None] & (lane < 8)
        _cast_tile(tl.multiple_of(x_ptr + pos, 16), tl.multiple_of(out_ptr + pos, 16), x_ptr,
                   local, mask, groups, k0, k1, MODE, N_ROUNDS)
    else:
        local = tile[:, None] * 8 + lane - (offset & 7)
        mask = (local >= 0) & (local < numel)
        _cast_tile(x_ptr + pos, out_ptr + pos, x_ptr, local, mask, groups, k0, k1, MODE, N_ROUNDS)


@triton.jit
def _philox_kernel(counters_ptr, key_ptr, out_ptr, n, BLOCK: tl.constexpr, N_ROUNDS: tl.constexpr):
    """Philox of ``n`` counters (int64 [n, 4] holding uint32 words) into int64 [n, 4]: for known-answer tests."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: offs * 4 passes 2**31 from 2**29
    mask = offs < n
    c0 = tl.load(counters_ptr + offs * 4 + 0, mask=mask, other=0).to(tl.uint32)
    c1 = tl.load(counters_ptr + offs * 4 + 1, mask=mask, other=0).to(tl.uint32)
    c2 = tl.load(counters_ptr + offs * 4 + 2, mask=mask, other=0).to(tl.uint32)
    c3 = tl.load(counters_ptr + offs * 4 + 3, mask=mask, other=0).to(tl.uint32)
    k0 = tl.load(key_ptr + 0).to(tl.uint32)
    k1 = tl.load(key_ptr + 1).to(tl.uint32)
    r0, r1, r2, r3 = philox4x32(c0, c1, c2, c3, k0, k1, N_ROUNDS)
    tl.store(out_ptr + offs * 4 + 0, r0.to(tl.int64), mask=mask)
    tl.store(out_ptr + offs * 4 + 1, r1.to(tl.int64), mask=mask)
    tl.store(out_ptr + offs * 4 + 2, r2.to(tl.int64), mask=mask)
    tl.store(out_ptr + offs * 4 + 3, r3.to(tl.int64), mask=mask)


# --------------------------------------------------------------------------------------------------------------
# Host code
# --------------------------------------------------------------------------------------------------------------


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_cast_many_kernel, InterpretedFunction)


_INTERPRETED = _interpreted()


def interpreting() -> bool:
    """True when triton was imported under ``TRITON_INTERPRET=1`` (kernels then run on CPU tensors)."""
    return _INTERPRETED


def _launch(kernel, grid, *args, **kwargs):
    """Launch on the device of the first tensor argument (triton itself launches on the current CUDA device).

    Returns what triton's launch returns: the compiled kernel (``n_regs``, ``n_spills``) on a GPU."""
    if _INTERPRETED:  # the interpreter evaluates fp32 NaN/inf arithmetic in numpy, which warns; the bits are right
        import numpy as np

        with np.errstate(all="ignore"):
            return kernel[grid](*args, **kwargs)
    with torch.cuda.device(args[0].device):
        return kernel[grid](*args, **kwargs)


def _check_device(device: torch.device) -> None:
    if interpreting():
        if device.type != "cpu":
            raise ValueError(f"under TRITON_INTERPRET=1 the Triton backend casts CPU tensors only, got {device}")
    elif device.type != "cuda":
        raise ValueError(
            f"the Triton backend casts CUDA tensors (got {device}); for CPU tensors use backend='cpu' or 'torch', "
            "or set TRITON_INTERPRET=1 before triton is imported"
        )


def philox4x32_10(counters: torch.Tensor, key: int, n_rounds: int = N_ROUNDS) -> torch.Tensor:
    """Run this module's device Philox on ``counters`` (int64 [N, 4] of uint32 words): int64 [N, 4] outputs.

    For known-answer tests of the generator the cast kernel uses.
    """
    if counters.dtype != torch.int64 or counters.dim() != 2 or counters.shape[1] != 4:
        raise ValueError("counters must be an int64 tensor of shape [N, 4]")
    _check_device(counters.device)
    counters = counters.contiguous()
    out = torch.empty_like(counters)
    n = counters.shape[0]
    block = 1024
    if n:
        key_t = torch.tensor([key & M32, key >> 32], dtype=torch.int64).to(counters.device)
        _launch(_philox_kernel, (triton.cdiv(n, block),), counters, key_t, out, n, BLOCK=block, N_ROUNDS=n_rounds)
    return out


def _groups(offset: int, numel: int) -> int:
    """Number of 8-element groups that elements ``offset .. offset+numel-1`` touch."""
    return ((offset + numel + 7) >> 3) - (offset >> 3)


def interpreter_rows(groups: Sequence[int]) -> int:
    """A tile height for the CPU interpreter: it costs ~20 ms per program plus ~0.3 us per (padded) element."""
    best, best_cost = 1, float("inf")
    for log2 in range(0, 18):
        rows = 1 << log2
        programs = sum(-(-g // rows) for g in groups)
        cost = programs * 20e-3 + programs * rows * 8 * 0.3e-6
        if cost < best_cost:
            best, best_cost = rows, cost
    return best


def _table_row(item, ef: bool, device: torch.device) -> list:
    """Validate one item (raw pointers go to the kernel, so nothing is left to chance) and return its table row."""
    x, out, res, key, offset = item.x, item.out, item.residual, item.key, item.offset
    if x.dtype != torch.float32:
        raise TypeError(f"Fair Cast needs fp32 masters, got {x.dtype}")
    if out.dtype != torch.bfloat16:
        raise TypeError(f"Fair Cast writes bf16, got an out tensor of {out.dtype}")
    n = x.numel()
    if out.numel() != n or not (x.is_contiguous() and out.is_contiguous()):
        raise ValueError("x and out must be contiguous with the same number of elements")
    if x.device != device or out.device != device:
        raise ValueError(f"all tensors of one Triton launch must be on {device}")
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 2**64:
        raise ValueError(f"key must be an int in [0, 2**64), got {key!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset + n > 2**63:
        raise ValueError(f"offset must be an int in [0, 2**63 - numel], got {offset!r}")
    x_ptr, out_ptr, res_ptr = x.data_ptr(), out.data_ptr(), 0
    if ef:
        if res is None or res.dtype != torch.float32 or res.numel() != n or not res.is_contiguous() \
                or res.device != device:
            raise ValueError("error_feedback needs a contiguous fp32 residual shaped like x on the same device")
        res_ptr = res.data_ptr()
    aligned = offset % 8 == 0 and n % 8 == 0 and (x_ptr | out_ptr | res_ptr) % 16 == 0
    return [x_ptr, out_ptr, res_ptr, n, offset, key & M32, key >> 32, int(aligned)]


def prepare(items: Sequence, mode: str, *, rows: Optional[int] = None,
            num_warps: Optional[int] = None) -> Callable[[], None]:
    """Validate ``items``, put their launch table on the device, and return a function that runs the ONE launch.

    The returned function keeps the items' tensors alive and may be called again (for timing the kernel alone);
    :func:`cast_many` is ``prepare(...)()``.
    """
    if mode not in MODE_IDS:
        raise ValueError(f"unknown Fair Cast mode {mode!r}; expected one of {', '.join(MODE_IDS)}")
    items = [item for item in items if item.x.numel()]
    if not items:
        return lambda: None
    device = items[0].x.device
    _check_device(device)
    ef = mode == "error_feedback"
    table = [_table_row(item, ef, device) for item in items]
    groups = [_groups(row[4], row[3]) for row in table]
    if rows is None:
        rows = interpreter_rows(groups) if _INTERPRETED else DEFAULT_ROWS
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1 or rows & (rows - 1):
        raise ValueError(f"rows must be a power of two, got {rows!r}")
    starts, total = [], 0
    for g in groups:
        starts.append(total)
        total += -(-g // rows)
    if total > MAX_GRID:
        raise ValueError(f"{total} programs exceed the grid limit; pass a larger rows=")
    steps = max(1, (len(items) - 1).bit_length())
    starts += [2**62] * ((1 << steps) - len(starts))  # padding: the search probes indices up to 2**steps - 1
    # One host-to-device copy of the padded starts and the table rows; pinned and asynchronous on CUDA, so the
    # host does not wait for the device (torch's pinned-memory cache keeps the buffer until the copy is done).
    values = starts + [v for row in table for v in row]
    if device.type == "cuda":
        meta = torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)
    else:
        meta = torch.tensor(values, dtype=torch.int64)
    kernel = _cast_many_kernel
    meta_args = dict(ROWS=rows, SEARCH_STEPS=steps, MODE=MODE_IDS[mode], N_ROUNDS=N_ROUNDS,
                     num_warps=num_warps or DEFAULT_NUM_WARPS)

    def launch() -> None:
        launch.compiled = _launch(kernel, (total,), meta[len(starts):], meta[: len(starts)], **meta_args)

    launch.compiled = None  # after a call on a GPU: the compiled variant (benchmarks/gpu/kernel.py reads its registers)

    launch.items = items  # keeps alive the tensors whose raw pointers are in the table
    return launch


def cast_many(items: Sequence, mode: str, *, rows: Optional[int] = None, num_warps: Optional[int] = None) -> None:
    """Cast every :class:`faircast_plugins.cast.CastItem` (flat fp32 ``x`` -> flat bf16 ``out``) in ONE launch.

    ``mode`` is ``"stochastic"``, ``"sticky"`` (the same kernel: the key carries the difference), ``"nearest"`` or
    ``"error_feedback"`` (which updates each ``residual`` in place).
    ``rows`` is the tile height (a power of two; a tile is ``rows * 8`` elements); it changes speed, never bits.
    """
    prepare(items, mode, rows=rows, num_warps=num_warps)()


def _run_groups(runs) -> torch.Tensor:
    """Groups (8-element rows of the global index) each run touches (int64, host)."""
    first, n = runs.table[:, 1], runs.table[:, 2]
    return ((first + n - 1) >> 3) + 1 - (first >> 3)


def _run_starts(runs, rows: int, device) -> tuple:
    """The run table on ``device`` and each run's first program at tile height ``rows`` (padded to a power of two
    for the binary search), with the number of programs: made once per table, device and tile height."""
    programs = -(-_run_groups(runs) // rows)
    total = int(programs.sum())
    if total > MAX_GRID:
        raise ValueError(f"{total} programs exceed the grid limit; pass a larger rows=")
    steps = max(1, (len(runs) - 1).bit_length())
    firsts = torch.full((1 << steps,), 2**62, dtype=torch.int64)
    firsts[: len(runs)] = torch.cumsum(programs, 0) - programs
    return (runs.table.to(device), firsts.to(device), total, steps)


def cast_runs(x: torch.Tensor, out: torch.Tensor, runs, keys: Sequence[int], mode: str, *,
              rows: Optional[int] = None, num_warps: Optional[int] = None) -> None:
    """:func:`faircast_plugins.cast.fair_cast_runs` in ONE launch: every run of ``runs`` (a
    :class:`faircast_plugins.cast.RunTable`, copied to the device once) of the flat pair ``x`` -> ``out``. Per call
    only the key halves travel (one pinned, asynchronous copy on CUDA): no host read."""
    if mode not in MODE_IDS or mode == "error_feedback":
        raise ValueError(f"cast_runs casts stochastic, sticky or nearest, not {mode!r}")
    if not len(runs):
        return
    device = x.device
    _check_device(device)
    if x.dtype != torch.float32 or out.dtype != torch.bfloat16 or out.device != device or not x.is_contiguous() \
            or not out.is_contiguous() or out.numel() != x.numel() or x.numel() < runs.extent:
        raise ValueError("cast_runs needs contiguous fp32 x and bf16 out of one size on one device, covering every run")
    if rows is None:
        rows = interpreter_rows(_run_groups(runs).tolist()) if _INTERPRETED else DEFAULT_ROWS
    table, starts, total, steps = runs.cached(device, ("triton", rows), lambda: _run_starts(runs, rows, device))
    halves = [h for k in keys for h in (k & M32, k >> 32)]
    if device.type == "cuda":
        key_t = torch.tensor(halves, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)
    else:
        key_t = torch.tensor(halves, dtype=torch.int64)
    misaligned = int((x.data_ptr() | out.data_ptr()) % 16 != 0)
    _launch(_cast_runs_kernel, (total,), x, out, table, starts, key_t, misaligned, ROWS=rows,
            SEARCH_STEPS=steps, MODE=MODE_IDS[mode], N_ROUNDS=N_ROUNDS, num_warps=num_warps or DEFAULT_NUM_WARPS)
