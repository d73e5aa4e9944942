"""Fair Cast on megatron-core on one GPU: tests/megatron/worker.py's scenarios under NCCL, with no CPU stand-ins.

Run by ``python -m benchmarks.gpu megatron`` (needs ``pip install megatron-core``); alone, from the repository root:

    python -m benchmarks.gpu.megatron_worker --json out/megatron.json [--cpu-smoke]

One torchrun launch of one rank (``FAIRCAST_MEGATRON_DEVICE=cuda``: NCCL, the model on the GPU, the reference cast
recomputed on the CPU from the gathered fp32 masters) runs the distributed and Float16 optimizers with Fair Cast on
(every bf16 param must be ``fair_cast(master)`` and differ from round-to-nearest) and off (the stock controls: every
param round-to-nearest), resume bit for bit (stochastic, error feedback, EMA), a skipped step, a copy around Fair
Cast, and the refusals, with the HF-keyed scenarios (converters; megatron-bridge where installed): served, tied,
Float16, resume, EMA resume, refusals. Then the per-step cast of one 7B and one 70B decoder layer at world size 1
(``benchmarks/megatron_cost.py``: HF keys at TP=1, TP rank 1 of 8 with native and HF keys, against the contiguous
path on the same ranges; host syncs per step and peak transient bytes are checks, times are reported). Under
``--cpu-smoke`` the same launch runs on the CPU with gloo and the stand-ins (how CI
runs this script).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from benchmarks.gpu.record import Report, Skip, say  # noqa: E402

# HF-keyed scenarios last (megatron-bridge, where installed, imports behind TransformerEngine stand-ins)
SCENARIOS = ("do", "f16", "do_off", "f16_off", "resume", "ef_resume", "ema_resume", "skip", "bypass", "refusals", "hf",
             "hf_tied", "hf_f16", "hf_resume", "hf_ema_resume", "hf_refusals")
RESUME_VERSION = 3  # two steps, a save, a load and one more step


def launch(smoke: bool, out: str) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    if not smoke:
        env["FAIRCAST_MEGATRON_DEVICE"] = "cuda"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={port}",
           os.path.join(ROOT, "tests", "megatron", "worker.py"), out, *SCENARIOS]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


def judge(report: Report, results: dict) -> None:
    """The pass criteria of tests/megatron/test_megatron.py, for one rank."""
    check = report.check
    for name in SCENARIOS:
        if name == "hf_refusals":
            continue
        (r,) = results[name]
        if "error" in r:
            check(f"megatron {name}: runs", False, r["error"][-1500:])
            continue
        if "hf" in r:  # keyed by HF name and index: compared with faircast export of the HF checkpoint instead
            h = r["hf"]
            check(f"megatron {name}: served HF tensors == faircast export of the HF checkpoint of the master "
                  f"({len(h['hf_names'])} tensors, {'megatron-bridge' if h['bridge'] else 'hand-written'} converters)",
                  h["mismatches"] == [] and h["padded_rows_rtn"] is True and h["differs_from_rtn"] == len(h["hf_names"]) > 0,
                  f"mismatches {h['mismatches'][:5]}, padded rows RTN {h['padded_rows_rtn']}")
        elif "check" in r:
            c = r["check"]
            on = not name.endswith("_off")
            want = c["params"] if on else 0
            check(f"megatron {name}: every bf16 param is {'fair_cast(master)' if on else 'round-to-nearest'} "
                  f"({c['params']} params)", c["mismatches"] == [] and c["params"] > 0 and c["differs_from_rtn"] == want,
                  f"mismatches {c['mismatches'][:5]}, {c['differs_from_rtn']} of {c['params']} differ from nearest")
        if "resume" in r:
            res = r["resume"]
            check(f"megatron {name}: resume bit for bit", res["mismatches"] == [] and res["version"] == RESUME_VERSION,
                  str(res)[:300])
    check("megatron skip: a skipped step keeps the version and the weights",
          results["skip"][0] == {"success": False, "version": 1, "unchanged": True}, str(results["skip"][0]))
    raised = results["bypass"][0].get("raised") or ""
    check("megatron bypass: a copy around Fair Cast fails the step", "cast 0 elements" in raised, raised[:300])
    hf_refusals = results["hf_refusals"][0]
    check("megatron hf_refusals: each HF-keying refusal names the param",
          bool(hf_refusals) and all(v == "refused" for v in hf_refusals.values()), str(hf_refusals)[:300])
    refusals = dict(results["refusals"][0])
    check("megatron refusals: each refused with its option named",
          refusals.pop("disabled_attaches_nothing", None) is True and all(v == "refused" for v in refusals.values()),
          str(refusals)[:300])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="on the CPU with gloo and the stand-ins")
    parser.add_argument("--json", default="gpu_megatron.json", help="results")
    args = parser.parse_args()
    report = Report(args.json)

    def section() -> None:
        import importlib.util

        if importlib.util.find_spec("megatron.core") is None:
            raise Skip("megatron-core is not installed: pip install megatron-core==0.16.1 (without network: "
                       "benchmarks/gpu/wheels.sh, see benchmarks/gpu/README.md)")
        import torch

        if not args.cpu_smoke and not torch.cuda.is_available():
            raise Skip("no CUDA device (use --cpu-smoke)")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "worker.json")
            proc = launch(args.cpu_smoke, out)
            if proc.returncode != 0 or not os.path.exists(out):
                raise RuntimeError(f"torchrun failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
            with open(out) as fh:
                results = json.load(fh)
        report.results["worker"] = results
        judge(report, results)

    def doctor() -> None:
        """``faircast doctor megatron`` as a user runs it on the GPU (the self-check FAIRCAST_ALLOW_UNVERIFIED needs)."""
        if args.cpu_smoke:
            raise Skip("faircast doctor megatron needs CUDA (tests/megatron/test_doctor.py runs it on the CPU with "
                       "the stand-ins)")
        proc = subprocess.run([sys.executable, "-m", "faircast_plugins.cli", "doctor", "megatron"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        say(proc.stdout[-2000:])
        report.results["doctor"] = {"rc": proc.returncode, "stdout": proc.stdout[-4000:], "stderr": proc.stderr[-2000:]}
        report.check("faircast doctor megatron passes on the GPU", proc.returncode == 0 and "PASS megatron" in proc.stdout,
                     f"rc {proc.returncode}")

    def cost() -> None:
        """The per-step cast of one 7B and one 70B decoder layer (world size 1) as the patch runs it, against the
        contiguous path on the same ranges (benchmarks/megatron_cost.py): HF-keyed at TP=1, and tensor-parallel
        rank 1 of 8 with Megatron-native and HF keys; the replaced per-element path on the 7B QKV."""
        from benchmarks import megatron_cost
        import torch

        if not args.cpu_smoke and not torch.cuda.is_available():
            raise Skip("no CUDA device (use --cpu-smoke)")
        device = torch.device("cpu" if args.cpu_smoke else "cuda")
        out = report.results.setdefault("cost", {})
        for preset in (("smoke",) if args.cpu_smoke else ("7b", "70b")):
            rows = megatron_cost.cast_rows(preset, device, reps=3 if args.cpu_smoke else 10, before=preset != "70b")
            megatron_cost.print_cast(rows, preset, device, "auto")
            out[preset] = rows
            for r in rows:
                report.check(f"megatron cost {preset} {r['layout']}: no host sync per step ({r['runs']} runs, "
                             f"{r['ratio']:.2f}x the contiguous path)", r["syncs"] == 0, f"{r['syncs']} syncs")
                if r["peak_B_per_elem"] is not None:
                    report.check(f"megatron cost {preset} {r['layout']}: at most 8 B/element transient",
                                 r["peak_B_per_elem"] <= 8, f"{r['peak_B_per_elem']:.2f} B/element")
            if device.type == "cuda":
                torch.cuda.empty_cache()

    say(f"gpu_megatron ({'CPU smoke' if args.cpu_smoke else 'CUDA'})")
    report.section("megatron", section)
    report.section("megatron-cost", cost)
    report.section("megatron-doctor", doctor)
    return report.finish("gpu_megatron")


if __name__ == "__main__":
    sys.exit(main())
