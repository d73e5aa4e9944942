"""``faircast selftest``: check this installation against ROUNDING.md's golden vectors on every backend here.

Run it on each machine type of a cluster: it exercises the exact code the adapters call (``fair_cast`` with
an explicit backend), on every device it can see, and exits non-zero on any mismatch.
"""
from __future__ import annotations

import argparse
from typing import Callable, List, Tuple

import torch

from . import golden, torch_ref
from .cast import available_backends, fair_cast, fair_cast_many
from .key import derive_key, sticky_key

Check = Tuple[str, Callable[[], bool]]


def _key_checks() -> List[Check]:
    return [
        (f"key{args[:3]}", lambda a=args: derive_key(*a[:3]) == a[3]) for args in (golden.KEY_ZERO, golden.KEY_K)
    ] + [
        (f"sticky_key{args[:2]}", lambda a=args: sticky_key(*a[:2]) == a[2])
        for args in (golden.STICKY_KEY_ZERO, golden.STICKY_KEY_S)
    ]


def _philox_checks() -> List[Check]:
    def one(ctr, key, want):
        out = torch_ref.philox4x32(*(torch.tensor(c, dtype=torch.int64) for c in ctr), *key)
        return tuple(int(w) & 0xFFFFFFFF for w in out) == want

    return [(f"philox KAT {i}", lambda c=c, k=k, w=w: one(c, k, w)) for i, (c, k, w) in enumerate(golden.PHILOX_KAT)]


def _backend_checks(backend: str, device: torch.device) -> List[Check]:
    key = golden.KEY_K[3]
    tag = f"{backend}@{device}"

    def table():
        x = golden.fp32_from_bits(golden.STOCHASTIC_K_IN, device)
        return golden.bf16_bits(fair_cast(x, key=key, backend=backend)) == golden.STOCHASTIC_K_OUT

    def sticky_table():
        x = golden.fp32_from_bits(golden.STOCHASTIC_K_IN, device)
        got = fair_cast(x, key=golden.STICKY_KEY_S[2], mode="sticky", backend=backend)
        return golden.bf16_bits(got) == golden.STICKY_S_OUT

    def error_feedback_table():
        x = golden.fp32_from_bits([row[0] for row in golden.ERROR_FEEDBACK], device)
        r = golden.fp32_from_bits([row[1] for row in golden.ERROR_FEEDBACK], device)
        q = fair_cast(x, key=0, mode="error_feedback", residual=r, backend=backend)
        return (golden.bf16_bits(q) == [row[2] for row in golden.ERROR_FEEDBACK]
                and [v & 0xFFFFFFFF for v in r.cpu().view(torch.int32).tolist()] == [row[3] for row in golden.ERROR_FEEDBACK])

    def shifted():
        # the same table cast as one shard at global offset 2**32 + 3, against the torch reference
        x = golden.fp32_from_bits(golden.STOCHASTIC_K_IN, device)
        got = fair_cast(x, key=key, offset=2**32 + 3, backend=backend)
        ref = fair_cast(x.cpu(), key=key, offset=2**32 + 3, backend="torch")
        return golden.bf16_bits(got) == golden.bf16_bits(ref)

    def random_vs_reference():
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(n, generator=g) * s for n, s in ((1000, 1.0), (4099, 1e-3), (777, 3e4))]
        offs = [0, 13, 2**40 + 1]
        keys = [derive_key(7, 3, f"p{i}") for i in range(3)]
        got = fair_cast_many([x.to(device) for x in xs], keys=keys, offsets=offs, backend=backend)
        ref = fair_cast_many(xs, keys=keys, offsets=offs, backend="torch")
        return all(torch.equal(a.cpu().view(torch.int16), b.view(torch.int16)) for a, b in zip(got, ref))

    def nearest():
        x = torch.randn(5000, generator=torch.Generator().manual_seed(1)).to(device)
        return torch.equal(fair_cast(x, key=0, mode="nearest", backend=backend).view(torch.int16),
                           x.to(torch.bfloat16).view(torch.int16))

    def error_feedback():
        x = torch.randn(3000, generator=torch.Generator().manual_seed(2)) * 1e-2
        r_ref = torch.full_like(x, 1e-5)
        r = r_ref.clone().to(device)
        q = fair_cast(x.to(device), key=0, mode="error_feedback", residual=r, backend=backend)
        q_ref = fair_cast(x, key=0, mode="error_feedback", residual=r_ref, backend="torch")
        return torch.equal(q.cpu().view(torch.int16), q_ref.view(torch.int16)) and torch.equal(r.cpu(), r_ref)

    def noise():
        return all(torch_ref.noise16(key, start, len(want), device=device).tolist() == want
                   for start, want in golden.NOISE_K)

    def error_feedback_identity():
        x = torch.randn(3000, generator=torch.Generator().manual_seed(2)).to(device) * 1e-2
        r = torch.full_like(x, 1e-5)
        s = x + r
        q = fair_cast(x, key=0, mode="error_feedback", residual=r, backend=backend)
        return torch.equal(q.float() + r, s) and torch.equal(q.view(torch.int16), s.to(torch.bfloat16).view(torch.int16))

    checks = [(f"{tag} golden table", table), (f"{tag} sticky golden table", sticky_table),
              (f"{tag} error feedback golden table", error_feedback_table), (f"{tag} nearest == .to(bf16)", nearest)]
    if backend == "torch" and device.type == "cpu":  # the reference itself: checked against the contract only
        return checks + [(f"{tag} golden noise", noise), (f"{tag} error feedback q + r == x + r0", error_feedback_identity)]
    return checks + [(f"{tag} offset 2**32+3 == reference", shifted), (f"{tag} random == reference", random_vs_reference),
                     (f"{tag} error feedback == reference", error_feedback)]


def plan() -> List[Check]:
    checks = _key_checks() + _philox_checks()
    backends = available_backends()
    checks += _backend_checks("torch", torch.device("cpu"))
    if "cpu" in backends:
        checks += _backend_checks("cpu", torch.device("cpu"))
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        checks += _backend_checks("torch", cuda)
        if "triton" in backends:
            checks += _backend_checks("triton", cuda)
    return checks


def add_selftest_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true", help="print only failures and the summary")


def run_selftest(args: argparse.Namespace) -> int:
    checks = plan()
    failed = []
    for name, check in checks:
        try:
            ok = bool(check())
            err = ""
        except Exception as exc:  # noqa: BLE001 - a crash is a failed check, reported with its message
            ok, err = False, f" ({type(exc).__name__}: {exc})"
        if not ok:
            failed.append(name)
        if not ok or not args.quiet:
            print(f"{'PASS' if ok else 'FAIL'}  {name}{err}")
    ran = sorted({n.split()[0] for n, _ in checks if "@" in n})
    print(f"backends checked: {', '.join(ran)}; available here: {', '.join(available_backends())}")
    print(f"selftest: {len(checks) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0
