"""Host syncs the audit makes per parameter per version, at ``main`` (81b1184) and in this tree (issue #20, finding 8).

A host sync is what makes the CPU wait for the device: reading a value of a device tensor (``item``, ``float``,
``bool``, ``tolist``) or a blocking device-to-host copy. No GPU is needed: the observed tensors are
``OffHostTensor`` (``tests/core/test_gpu_paths.py``), CPU values that report a non-CPU device and count those
operations at torch's dispatcher; this tree's CUDA branch (pinned memory, ``non_blocking`` copy, one event) is taken
for them with ``torch.cuda.Event`` / ``current_stream`` mocked. The metrics of both versions are compared with an
all-CPU run of the same values.

    python benchmarks/audit_syncs.py [--params 8] [--versions 6] [--numel 4096] [--sample 4096] [--json]

``--numel`` must not exceed ``--sample`` for the ``main`` column: that code puts its sample positions on the
observation's device (``torch.linspace(device=...)``), which a CPU-only host cannot do; this tree's column also
runs with larger tensors (``--numel 65536``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import types
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from faircast_plugins import audit as audit_here  # noqa: E402
from faircast_plugins import fair_cast  # noqa: E402
from tests.core.test_gpu_paths import FakeEvent, OffHostTensor  # noqa: E402

BASE = "81b1184"


def audit_at(commit: str) -> types.ModuleType:
    """faircast_plugins/audit.py as it was at ``commit`` (it imports only torch), loaded as its own module."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:faircast_plugins/audit.py"],
                            check=True, capture_output=True, text=True).stdout
    module = types.ModuleType(f"audit_{commit}")
    exec(compile(source, f"{commit}:faircast_plugins/audit.py", "exec"), module.__dict__)  # noqa: S102
    return module


@contextlib.contextmanager
def mocked_cuda(module):
    """This tree's CUDA copy branch for OffHostTensor (no-op for a module without it)."""
    FakeEvent.recorded = FakeEvent.waited = 0
    with contextlib.ExitStack() as stack:
        if hasattr(module, "_async_copy_ok"):
            stack.enter_context(mock.patch.object(module, "_async_copy_ok", lambda d: d == OffHostTensor.DEVICE))
            stack.enter_context(mock.patch.object(module, "_pinned_empty", lambda s, dt: torch.empty(s, dtype=dt)))
        stack.enter_context(mock.patch.object(torch.cuda, "Event", FakeEvent))
        stack.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda device=None: None))
        yield


def trajectory(params: int, versions: int, numel: int):
    """{name: [(master, served) per version]}: masters drifting by small steps, served with Fair Cast."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for p in range(params):
        x = torch.randn(numel, generator=g) * 0.02
        steps = []
        for v in range(versions):
            x = x + 1e-4 * torch.randn(numel, generator=g)
            steps.append((x.clone(), fair_cast(x, key=1000 * p + v + 1, backend="torch")))
        out[f"model.layers.{p}.w"] = steps
    return out


def measure(module, data, sample: int, on_device: bool = True) -> dict:
    audit = module.Audit(sample=sample)
    wrap = OffHostTensor if on_device else (lambda t: t)
    observations = sum(len(steps) for steps in data.values())
    OffHostTensor.reset_counts()
    with mocked_cuda(module):
        versions = len(next(iter(data.values())))
        for v in range(versions):
            for name, steps in data.items():
                x, q = steps[v]
                audit.observe(name, v, wrap(x), wrap(q))
        at_cast = dict(syncs=OffHostTensor.reads + OffHostTensor.blocking_copies + FakeEvent.waited,
                       async_copies=OffHostTensor.async_copies, events=FakeEvent.recorded)
        OffHostTensor.reset_counts()
        FakeEvent.waited = 0
        metrics = audit.metrics()
        at_report = dict(syncs=OffHostTensor.reads + OffHostTensor.blocking_copies, event_waits=FakeEvent.waited)
    return dict(
        observations=observations,
        observe_syncs_per_param_version=at_cast["syncs"] / observations,
        observe_async_copies_per_param_version=at_cast["async_copies"] / observations,
        observe_events_per_param_version=at_cast["events"] / observations,
        report_syncs=at_report["syncs"],
        report_event_waits=at_report["event_waits"],
        metrics=metrics,
    )


def cpu_metrics_identical(base) -> bool:
    """Both versions on plain CPU tensors report identical metrics (float equality) on a run with version gaps, a
    repeated version, an fp32-served parameter, one that grows past the sample, and reports at several cadences."""
    g = torch.Generator().manual_seed(1)
    xs = {n: torch.randn(k, generator=g) for n, k in (("a", 50), ("b", 300), ("c", 1000))}
    seq = []
    for v in (0, 1, 2, 3, 5, 6, 7, 7, 8, 9, 10, 11, 12, 14, 15):
        for n in xs:
            step = 1e-3 * torch.randn(xs[n].shape, generator=g) * (torch.rand(xs[n].shape, generator=g) < 0.7)
            xs[n] = xs[n] + step
            seq.append((n, v, xs[n].clone(), xs[n].clone() if n == "c" else xs[n].to(torch.bfloat16)))
    for v in (16, 17):
        seq.append(("a", v, torch.randn(500, generator=g), torch.randn(500, generator=g).to(torch.bfloat16)))

    def run(module, every):
        audit, out = module.Audit(sample=64, window=3), []
        for i, (name, v, x, q) in enumerate(seq):
            audit.observe(name, v, x, q)
            if i % every == every - 1:
                out.append(audit.metrics(reset=i % 2 == 0))
        return out + [audit.metrics(), audit.totals()]

    return all(run(base, every) == run(audit_here, every) for every in (1, 3, 7, 1000))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=8)
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--numel", type=int, default=4096)
    ap.add_argument("--sample", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    data = trajectory(args.params, args.versions, args.numel)
    reference = measure(audit_here, data, args.sample, on_device=False)["metrics"]
    results = {}
    base = audit_at(BASE)
    if args.numel <= args.sample:
        results[f"main ({BASE})"] = measure(base, data, args.sample)
    results["this tree"] = measure(audit_here, data, args.sample)
    for r in results.values():
        r["metrics_equal_cpu_run"] = r["metrics"] == reference
    identical = cpu_metrics_identical(base)
    if args.json:
        print(json.dumps({**{k: {f: v for f, v in r.items() if f != "metrics"} for k, r in results.items()},
                          "cpu_metrics_identical_to_main": identical}, indent=1))
        return 0
    rows = [
        ("observe: host syncs / param / version", "observe_syncs_per_param_version"),
        ("  (main: 7 per parameter per version after its first)", None),
        ("observe: non-blocking copies / param / version", "observe_async_copies_per_param_version"),
        ("observe: events recorded / param / version", "observe_events_per_param_version"),
        ("report: host syncs (value reads, blocking copies)", "report_syncs"),
        ("report: event waits (one per queued observation)", "report_event_waits"),
        ("metrics equal to an all-CPU run", "metrics_equal_cpu_run"),
    ]
    print(f"{args.params} parameters x {args.versions} versions, {args.numel} elements each, sample {args.sample} "
          f"(observed on a mocked device; counts at torch's dispatcher)")
    width = max(len(label) for label, _ in rows)
    print(f"{'':{width}}  " + "  ".join(f"{k:>16}" for k in results))
    for label, field in rows:
        if field is None:
            print(label)
            continue
        cells = (("yes" if r[field] else "NO") if isinstance(r[field], bool) else str(round(r[field], 3))
                 for r in results.values())
        print(f"{label:{width}}  " + "  ".join(f"{c:>16}" for c in cells))
    print(f"on CPU tensors, this tree's metrics are identical to {BASE}'s (gaps, repeats, fp32 served, growth, "
          f"reports every 1/3/7 observations): {'yes' if identical else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
