"""``faircast doctor``: prove, on the installed stack, in seconds, that Fair Cast's patched path works (on the CPU;
Megatron-core's on the GPU it trains on).

Each check runs the real patched code on a tiny model built in-process (no downloads) and compares what the
engine would be sent, and what the forward computes with, to ``fair_cast(master)`` keyed independently
(ROUNDING.md), and to round-to-nearest (they must differ somewhere, or the check proves nothing):

* ``fsdp``: torch FSDP2's patched bf16 cast, in-process at world size 1 (verl's and TRL's FSDP path);
* ``deepspeed``: DeepSpeed's patched fp32 -> bf16 copy-back, ZeRO-2 at world size 1 (OpenRLHF's path, TRL's);
* ``trl``: a tiny GRPO run with the Fair Cast callback (every forward on the served copy) and TRL's vLLM export
  iterator (``VLLMGeneration._iter_named_params``) yielding the served bf16 bits.
* ``megatron``: megatron-core's patched main->model param copy (distributed and Float16 optimizers), a tiny GPT at
  world size 1 on the GPU (Megatron-core trains on CUDA; without one the check cannot run: :class:`DoctorCannotRun`).

It is what a user runs on their cluster before a long run, and what :data:`~faircast_plugins.patching.
ALLOW_UNVERIFIED_ENV` requires before Fair Cast runs on a framework release newer than the verified range
(:func:`faircast_plugins.patching.self_check` runs it in a subprocess, so the check's process group and patches never
touch the caller's).
"""
from __future__ import annotations

import importlib
import os
import time
import contextlib
import tempfile
from typing import Dict, List

from ..patching import DOCTOR_ENV, FRAMEWORKS, installed_version, self_check  # noqa: F401 (self_check: re-exported)

#: check -> module with ``check() -> list[str]`` (evidence lines; raises :class:`DoctorFailure`)
CHECKS: Dict[str, str] = {
    "fsdp": "faircast_plugins.doctor.fsdp",
    "deepspeed": "faircast_plugins.doctor.deepspeed",
    "trl": "faircast_plugins.doctor.trl",
    "megatron": "faircast_plugins.doctor.megatron",
}


class DoctorFailure(AssertionError):
    """A doctor check ran and found Fair Cast's bits missing where they must be."""


class DoctorCannotRun(RuntimeError):
    """A doctor check cannot run on this machine (it says what it needs): not a pass, so a framework it gates stays
    refused; ``faircast doctor`` reports it as SKIP when it was not named."""


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise DoctorFailure(message)


SEED = 20240611  # any seed: the checks derive the expected bits from it independently


@contextlib.contextmanager
def world_of_one(backend: str = "gloo"):
    """A process group of one rank (``backend``: gloo, or nccl for a check on the GPU; file store in a temporary
    directory: no port), torn down afterwards."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise DoctorFailure("faircast doctor runs its checks in a process without a process group of its own")
    ranks = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    saved = {k: os.environ.get(k) for k in ranks}
    with tempfile.TemporaryDirectory(prefix="faircast-doctor-") as tmp:
        os.environ.update(ranks)
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield tmp
        finally:
            dist.destroy_process_group()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def check_served(what: str, name: str, got, master, version: int, *, seed: int = SEED) -> bool:
    """Raise unless ``got`` is bit for bit ``fair_cast(master)`` at ``version`` (key derived here, not by the caster);
    return True when it differs from round-to-nearest somewhere (the check could tell the two apart)."""
    import torch

    from ..cast import fair_cast
    from ..key import canonical_name, derive_key

    want = fair_cast(master.detach().float().cpu(), key=derive_key(seed, version, canonical_name(name)),
                     mode="stochastic", backend="torch")
    got = got.detach().cpu()
    expect(got.dtype == torch.bfloat16, f"{what}: {name} is {got.dtype}, not the bf16 served copy")
    expect(got.shape == want.shape, f"{what}: {name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    bad = int((got.view(torch.int16) != want.view(torch.int16)).sum())
    expect(bad == 0, f"{what}: {bad} of {want.numel()} elements of {name} at weight version {version} are not "
                     f"fair_cast(master): Fair Cast's bits did not reach it")
    return not torch.equal(want, master.detach().float().cpu().to(torch.bfloat16))


def run_check(name: str) -> List[str]:
    """Run one check in this process; returns its evidence lines, raises on failure."""
    return importlib.import_module(CHECKS[name]).check()


def _installed_frameworks() -> List[str]:
    return [d for d in FRAMEWORKS if installed_version(d) is not None]


def _checks_of(name: str) -> tuple:
    """The checks a name on the command line runs: a framework's (:data:`FRAMEWORKS`), or the check of that name."""
    return FRAMEWORKS.get(name) or ((name,) if name in CHECKS else ())


def add_doctor_arguments(parser) -> None:
    parser.add_argument("frameworks", nargs="*", metavar="FRAMEWORK",
                        help=f"which to check: {', '.join(FRAMEWORKS)}, or a check by name: {', '.join(CHECKS)} "
                             f"(default: every framework installed)")


def run_doctor(args) -> int:
    named = bool(args.frameworks)
    frameworks = args.frameworks or _installed_frameworks()
    unknown = sorted(f for f in set(frameworks) if not _checks_of(f))
    if unknown:
        raise SystemExit(f"faircast doctor: unknown framework(s) {', '.join(unknown)}; known: {', '.join(FRAMEWORKS)} "
                         f"(checks: {', '.join(CHECKS)})")  # the CLI prints it as a usage error (exit 2)
    os.environ[DOCTOR_ENV] = "1"  # patch newer (unverified) releases here: this run is their self-check
    checks = list(dict.fromkeys(c for f in frameworks for c in _checks_of(f)))
    failed = skipped = 0
    for name in checks:
        start = time.perf_counter()
        try:
            lines = run_check(name)
        except DoctorCannotRun as exc:  # named (or run as a self-check): not a pass; otherwise reported and skipped
            failed += named
            skipped += not named
            print(f"{'CANNOT RUN' if named else 'SKIP'} {name}: {exc}", flush=True)
            continue
        except Exception as exc:  # noqa: BLE001 -- every failure is reported, with its type
            failed += 1
            print(f"FAIL {name} ({time.perf_counter() - start:.1f} s): {type(exc).__name__}: {exc}", flush=True)
            continue
        print(f"PASS {name} ({time.perf_counter() - start:.1f} s)", flush=True)
        for line in lines:
            print(f"     {line}", flush=True)
    passed = len(checks) - failed - skipped
    print(f"faircast doctor: {passed} of {len(checks)} check(s) passed" + (f", {skipped} skipped (cannot run here)"
          if skipped else "") + f" ({', '.join(frameworks)})")
    return 1 if failed else 0


__all__ = ["CHECKS", "FRAMEWORKS", "DoctorCannotRun", "DoctorFailure", "check_served", "expect", "run_check", "self_check", "world_of_one"]
