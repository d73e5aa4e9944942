"""What Fair Cast's Megatron patch costs per optimizer step and at attach, at 7B- and 70B-layer shapes (issue 37).

Per step, on the same elements side by side: the main->model cast of one transformer layer's params as the patch
runs it (``MegatronFairCast._cast``) for each layout against the contiguous path (one ``fair_cast`` per range, what a
Megatron-native TP=1 layout costs):

* ``hf tp1``: keyed by Hugging Face names and indices through the converters (verl's default): the fused QKV is a run
  per head block, SwiGLU's fc1 two runs;
* ``native tp8``: tensor-parallel rank 1 of 8 with Megatron-native keys: row-parallel ``linear_proj``/``linear_fc2``
  are one run per row of the full tensor;
* ``hf tp8``: the same shards keyed by HF names;
* ``before``: the per-element path this replaced (``HFGroup.expand`` + the unchunked torch reference), on the
  ``hf tp1`` QKV only, at the small preset (it needs ~133 B/element).

Columns: ms per step (median), the ratio to the contiguous path on the same ranges, peak transient bytes per
element cast (host: the resident-set high-water mark over the resident set before the cast, with glibc's mmap
threshold at 64 KiB so freed buffers leave, timings with it at 4 GiB as the nox sessions set it; CUDA: ``max_memory_allocated`` over the allocated), and host syncs per
step (ops that make the host wait on CUDA: a value read, ``nonzero``, ``repeat_interleave`` without
``output_size``, ``unique``, ``tolist``; on CUDA also ``torch.cuda.set_sync_debug_mode``'s count).

At attach: ``build_element_map`` + ``ElementMap.groups`` of each param of the layer set (TP=1, one whole-param range,
the worst case): seconds and the peak transient host bytes per element of the param.

    python benchmarks/megatron_cost.py [--preset smoke|7b|70b] [--device cpu|cuda] [--before] [--no-cast]
                                       [--no-attach] [--json out.json]

``smoke`` (CI: a few seconds) is a 1/64-width layer; ``7b`` a Qwen2.5-7B layer (hidden 3584, 28 heads, 4 KV groups,
FFN 18944); ``70b`` a Llama-3-70B layer (hidden 8192, 64 heads, 8 KV groups, FFN 28672). CPU numbers use one thread
(``OMP_NUM_THREADS=1``) and the numba kernel; ``python -m benchmarks.gpu megatron`` runs the per-step part on CUDA.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from tests.megatron.hf_converters import gated, qkv, same  # noqa: E402  (the test suite's Megatron->HF converters)
from faircast_plugins import torch_ref  # noqa: E402
from faircast_plugins.caster import FairCaster  # noqa: E402
from faircast_plugins.config import FairCastConfig  # noqa: E402
from faircast_plugins.megatron.hf_map import build_element_map  # noqa: E402
from faircast_plugins.megatron.layout import ParamKey  # noqa: E402
from faircast_plugins.megatron.patch import MegatronFairCast  # noqa: E402

PRESETS = {  # hidden, heads, kv groups, head dim, ffn
    "smoke": (128, 4, 2, 32, 448),
    "7b": (3584, 28, 4, 128, 18944),
    "70b": (8192, 64, 8, 128, 28672),
}
TP = 8


# -- the layer ---------------------------------------------------------------------------------------------------
def layer_params(preset: str, tp: int = 1, tp_rank: int = 0) -> List[tuple]:
    """``(ParamKey, converter)`` of one decoder layer's weights as Megatron holds them at ``tp`` (rank ``tp_rank``):
    column-parallel QKV and fc1 (partition dim 0; fc1 de-interleaved per rank, stride 2), row-parallel proj and fc2
    (partition dim 1)."""
    hidden, heads, groups, hd, ffn = PRESETS[preset]
    p, h = "decoder.layers.0.", "model.layers.0."
    qkv_rows = groups * (heads // groups + 2) * hd
    split = dict(tp_size=tp, tp_rank=tp_rank) if tp > 1 else {}
    return [
        (ParamKey(p + "self_attention.linear_qkv.weight", (qkv_rows // tp, hidden), partition_dim=0 if tp > 1 else -1,
                  **split),
         qkv(heads, groups, *(f"{h}self_attn.{x}_proj.weight" for x in "qkv"))),
        (ParamKey(p + "self_attention.linear_proj.weight", (hidden, heads * hd // tp), partition_dim=1 if tp > 1 else -1,
                  **split), same(h + "self_attn.o_proj.weight")),
        (ParamKey(p + "mlp.linear_fc1.weight", (2 * ffn // tp, hidden), partition_dim=0 if tp > 1 else -1,
                  stride=2 if tp > 1 else 1, **split),
         gated(h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight")),
        (ParamKey(p + "mlp.linear_fc2.weight", (hidden, ffn // tp), partition_dim=1 if tp > 1 else -1, **split),
         same(h + "mlp.down_proj.weight")),
    ]


# -- measuring -------------------------------------------------------------------------------------------------
_SYNC_OPS = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "_unique", "_unique2", "unique_consecutive")


class SyncCount(TorchDispatchMode):
    """Counts the ops that make the host wait for a CUDA device (on any device: the same Python path runs there)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.ops: Dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _SYNC_OPS or (name == "repeat_interleave" and kwargs.get("output_size") is None
                                 and len(args) and isinstance(args[0], torch.Tensor) and len(args) < 2):
            self.count += 1
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting_syncs(device: torch.device):
    """``(counter, cuda_warnings)``: dispatch-level sync ops, and on CUDA the sync debug mode's warnings."""
    real_tolist = torch.Tensor.tolist
    counter = SyncCount()

    def tolist(self, *a, **k):
        counter.count += 1
        counter.ops["tolist"] = counter.ops.get("tolist", 0) + 1
        return real_tolist(self, *a, **k)

    torch.Tensor.tolist = tolist
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            with counter:
                yield counter, caught
    finally:
        torch.Tensor.tolist = real_tolist
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)


def _mmap_threshold(nbytes: int) -> None:
    """glibc's mmap threshold (fixed: no dynamic adjustment). Small (64 KiB) for memory measurements: large buffers
    are their own mappings, freed back at once, so the RSS high-water mark sees each peak. Large (4 GiB, as the
    nox sessions set it, ``MALLOC_ENV``) for timings: no page faults on every reused buffer."""
    try:
        ctypes.CDLL(None).mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


SMALL_MMAP, LARGE_MMAP = 64 << 10, 4 << 30


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.M).group(1))


class Peak:
    """Peak transient bytes of a block: CUDA allocator peak, or the host's RSS high-water mark (Linux)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes: Optional[int] = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as fh:
                    fh.write("5")  # resets VmHWM to the current RSS
                self.base = _status_kb("VmRSS") * 1024
            except OSError:
                self.base = None
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self.base
        elif self.base is not None:
            self.bytes = max(0, _status_kb("VmHWM") * 1024 - self.base)
        return False


def _once(fn: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def _time(fn: Callable[[], None], device: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` (after one warm-up call)."""
    fn()
    return statistics.median(_once(fn, device) for _ in range(reps))


def _time_pair(a: Callable[[], None], b: Callable[[], None], device: torch.device, reps: int) -> tuple:
    """Median seconds of ``a`` and of ``b``, timed alternately (a busy machine's drift hits both alike)."""
    a(), b()
    ta, tb = [], []
    for _ in range(reps):
        ta.append(_once(a, device))
        tb.append(_once(b, device))
    return statistics.median(ta), statistics.median(tb)


@dataclass
class Range:
    param: object
    key: ParamKey
    main: torch.Tensor
    dst: torch.Tensor


def _ranges(params, device, seed=0) -> List[Range]:
    g = torch.Generator(device).manual_seed(seed)
    out = []
    for key, _ in params:
        main = torch.randn(key.numel, generator=g, device=device).mul_(0.02)
        out.append(Range(object(), key, main, torch.empty(key.numel, dtype=torch.bfloat16, device=device)))
    return out


def _before(fc: MegatronFairCast, ranges: List[Range]) -> Callable[[], None]:
    """The per-step path this replaced: each non-contiguous HF group expanded to per-element indices (host syncs)
    and cast by the unchunked torch reference."""
    caster = fc.caster

    def step():
        for r in ranges:
            src = r.main
            for g in fc.hf_groups[(id(r.param), 0, r.key.numel)]:
                k = caster.key(g.name)
                if g.contiguous:
                    r.dst[g.pos] = torch_ref.cast_stochastic_at(src[g.pos], k, torch.arange(
                        g.pos.stop - g.pos.start, device=src.device) + g.hf)
                else:
                    pos, hf = g.expand(src.device)
                    r.dst[pos] = torch_ref.cast_stochastic_at(src[pos], k, hf)

    return step


def cast_rows(preset: str, device: torch.device, backend: str = "auto", reps: int = 5,
              before: bool = False) -> List[dict]:
    """One row per layout: the per-step cast of a whole layer's ranges against the contiguous path on the same
    ranges."""
    caster = FairCaster(FairCastConfig(enabled=True, seed=7, backend=backend), version=3)
    rows = []
    layouts = [("hf tp1", 1, True), (f"native tp{TP}", TP, False), (f"hf tp{TP}", TP, True)]
    for label, tp, hf in layouts:
        params = layer_params(preset, tp, 1 if tp > 1 else 0)
        ranges = _ranges(params, device)
        keys = {id(r.param): r.key for r in ranges}
        groups = None
        if hf:
            groups = {}
            for r, (key, conv) in zip(ranges, params):
                groups[(id(r.param), 0, key.numel)] = build_element_map(key, conv).groups(key, 0, key.numel)
        fc = MegatronFairCast(None, caster, keys, groups)
        n = sum(r.key.numel for r in ranges)
        n_runs = sum(len(p[1]) if p[1] is not None else 1 for p in fc._hf_runs.values()) if hf else None

        def patched(fc=fc, ranges=ranges):
            for r in ranges:
                fc._cast(r.key, r.main, 0, r.key.numel, r.dst, False, r.param)

        def contiguous(ranges=ranges):
            for r in ranges:
                caster.cast(r.key.name, r.main, offset=0, out=r.dst)

        def measure(fn):
            fn()  # warm-up: kernels compiled, run tables on the device
            with Peak(device) as peak:
                fn()
            with counting_syncs(device) as (count, cuda_warnings):
                fn()
            return peak.bytes, count.count + len(cuda_warnings)

        m_c, s_c = measure(contiguous)
        m_p, s_p = measure(patched)
        t_c, t_p = _time_pair(contiguous, patched, device, reps)
        if not hf:
            n_runs = sum(len(t) for t in fc._native_runs.values()) + sum(1 for r in ranges if r.key.contiguous)
        row = {"layout": label, "elements": n, "runs": n_runs, "contiguous_ms": t_c * 1e3, "ms": t_p * 1e3,
               "ratio": t_p / t_c, "peak_B_per_elem": None if m_p is None else m_p / n,
               "contiguous_peak_B_per_elem": None if m_c is None else m_c / n, "syncs": s_p, "contiguous_syncs": s_c}
        if before and label == "hf tp1":
            step = _before(fc, ranges[:1])  # the QKV only: the old path needs ~133 B/element
            nq = ranges[0].key.numel
            m_b, s_b = measure(step)
            caster_q = lambda r=ranges[0]: caster.cast(r.key.name, r.main, offset=0, out=r.dst)  # noqa: E731
            t_q, t_b = _time_pair(caster_q, step, device, max(1, reps // 2))
            row["before_qkv"] = {"elements": nq, "ms": t_b * 1e3, "ratio": t_b / t_q,
                                 "peak_B_per_elem": None if m_b is None else m_b / nq, "syncs": s_b}
        rows.append(row)
        del ranges, fc
    return rows


def attach_rows(preset: str) -> List[dict]:
    """``build_element_map`` + ``groups`` of each param of the layer at TP=1 (the whole param as one range): timed
    with glibc's usual large-buffer reuse, then once more for the peak with small-mmap accounting."""
    out = []
    for key, conv in layer_params(preset):
        _mmap_threshold(LARGE_MMAP)
        t = time.perf_counter()
        emap = build_element_map(key, conv)
        groups = emap.groups(key, 0, key.numel)
        dt = time.perf_counter() - t
        del emap, groups
        _mmap_threshold(SMALL_MMAP)
        with Peak(torch.device("cpu")) as peak:
            emap = build_element_map(key, conv)
            groups = emap.groups(key, 0, key.numel)
        out.append({"param": key.name.rsplit(".", 2)[-2], "elements": key.numel, "seconds": dt,
                    "peak_B_per_elem": None if peak.bytes is None else peak.bytes / key.numel,
                    "map_runs": int(emap.runs.shape[0]), "groups": len(groups)})
        del emap, groups
    return out


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def print_cast(rows: List[dict], preset: str, device, backend: str) -> None:
    print(f"per-step cast of one {preset} layer, {device} ({backend}), {torch.get_num_threads()} thread(s); "
          f"contiguous = one fair_cast per range on the same ranges")
    print(f"  {'layout':<12} {'elements':>12} {'runs':>7} {'contig ms':>10} {'ms':>9} {'x contig':>9} "
          f"{'peak B/el':>10} {'syncs':>6}")
    for r in rows:
        print(f"  {r['layout']:<12} {r['elements']:>12,} {r['runs']:>7} {r['contiguous_ms']:>10.2f} {r['ms']:>9.2f} "
              f"{r['ratio']:>9.2f} {_fmt(r['peak_B_per_elem'], '>10.2f')} {r['syncs']:>6}")
        b = r.get("before_qkv")
        if b:
            print(f"  {'before (qkv)':<12} {b['elements']:>12,} {'':>7} {'':>10} {b['ms']:>9.2f} {b['ratio']:>9.2f} "
                  f"{_fmt(b['peak_B_per_elem'], '>10.2f')} {b['syncs']:>6}")


def print_attach(rows: List[dict], preset: str) -> None:
    total = sum(r["seconds"] for r in rows)
    print(f"attach: element map + groups per param of one {preset} layer at TP=1 (whole param), "
          f"{torch.get_num_threads()} thread(s): {total:.2f} s for the layer")
    print(f"  {'param':<14} {'elements':>12} {'map runs':>9} {'s':>7} {'peak B/el':>10}")
    for r in rows:
        print(f"  {r['param']:<14} {r['elements']:>12,} {r['map_runs']:>9} {r['seconds']:>7.2f} "
              f"{_fmt(r['peak_B_per_elem'], '>10.2f')}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--before", action="store_true", help="also time the replaced per-element path (QKV)")
    parser.add_argument("--no-attach", action="store_true")
    parser.add_argument("--no-cast", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    _mmap_threshold(SMALL_MMAP)  # the cast's peaks (its timing allocates nothing per step)
    device = torch.device(args.device)
    result = {"preset": args.preset, "device": str(device), "torch": torch.__version__,
              "threads": torch.get_num_threads()}
    if not args.no_cast:
        result["cast"] = cast_rows(args.preset, device, args.backend, args.reps, args.before)
        print_cast(result["cast"], args.preset, device, args.backend)
    if not args.no_attach:
        result["attach"] = attach_rows(args.preset)
        print_attach(result["attach"], args.preset)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
