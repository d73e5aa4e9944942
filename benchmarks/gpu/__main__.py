"""Fair Cast's CUDA paths, kernel and adapters, on one GPU, in one command: ``python -m benchmarks.gpu [PART ...]``.

From the repository root (what each part needs installed, how long it takes and what it prints:
benchmarks/gpu/README.md):

    python3 -m benchmarks.gpu --out out/gpu                 # every part, at most --budget-s (420 s)
    python3 -m benchmarks.gpu kernel export --out out/gpu   # some parts
    python3 -m benchmarks.gpu --list                        # the parts, what each needs, its cap

It writes ``<out>/run.json`` (rewritten every few seconds and after every part: a run cut short keeps what it did;
the envelope of benchmarks/gpu/record.py, then every part's own record) and ``<out>/run.log`` (every line of every
part), and prints the parts' tables and a summary: what passed, what failed, what was skipped and why. Exit status 1
on any failed check or crashed part.

Parts, in this order (correctness first, the kernel's speed last), each in its own process (a CUDA fault or a
framework's process-wide patch stays in it), each under its own cap and the whole under ``--budget-s``:

  kernel     kernel.py bits, auto, stream, paths, master16, huge: the Triton kernel's bits against the CPU
             reference, backend "auto" on CUDA, a non-default stream, the fixes of docs/gpu-paths.md (DTensor
             refused, audit without host syncs, cast_many over two devices), TRL's 2 B masters (Triton compaction
             and recovery, bit-exact, and their cost per step), the aligned branch and error feedback above 2**31
             elements
  realsize   real_sizes.py: the audit of a 151936 x 4096 master, verl's Triton fp8 quantizer against Fair Cast's
             fp8 copy (verl's fp8_kernel.py), fp8_loss time and memory on one 4096 x 14336 layer with and without
             checkpointing, an uneven FSDP2 shard through verl's offload
  megatron   megatron_worker.py: tests/megatron/worker.py on CUDA with NCCL (one rank): distributed and Float16
             optimizers against their stock controls, resume bit for bit, a skipped step, refusals, the HF-keyed
             scenarios; then the per-step cast of one 7B and one 70B layer (HF keys, TP rank 1 of 8) against the
             contiguous path, with host syncs and peak bytes (benchmarks/megatron_cost.py)
  fsdp2      adapters.py fsdp2: FSDP2's cast site, NCCL, world size 1, against its flag-off control
  deepspeed  adapters.py zero2, zero3: DeepSpeed's copy-back, NCCL, world size 1, against flag off
  trl        adapters.py trl: a TRL GRPO run without vLLM (accelerate over NCCL), against flag off
  export     kernel.py export: the Qwen3-1.7B-shaped export against the 3 ms target
  perf       kernel.py regs, speed, tiles: registers and spills, GB/s, the tile sweep (the rest of the budget)

``--cpu-smoke`` runs the same parts on the CPU (tiny sizes, gloo, the Triton interpreter), skipping what needs
CUDA with the reason: tests/trl/test_gpu_acceptance_smoke.py runs it in CI.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the checkout's faircast_plugins, as the parts import it (their PYTHONPATH starts here)

from benchmarks.gpu.record import envelope  # noqa: E402


@dataclass(frozen=True)
class Part:
    name: str
    module: str  # benchmarks.gpu.<module>
    args: tuple
    needs: tuple = ()  # modules it imports beyond torch
    cap_s: float | None = None  # at most this long on the GPU (None: what is left of the budget)


PARTS = (
    Part("kernel", "kernel", ("--only", "bits,auto,stream,paths,master16,huge"), ("triton",), 180),
    Part("realsize", "real_sizes", (), (), 120),
    Part("megatron", "megatron_worker", (), ("megatron.core",), 180),  # worker ~55 s, the 7B/70B cast benchmark ~60 s
    Part("fsdp2", "adapters", ("--only", "fsdp2"), (), 90),
    Part("deepspeed", "adapters", ("--only", "zero2,zero3"), ("deepspeed",), 150),
    Part("trl", "adapters", ("--only", "trl"), ("trl", "datasets"), 150),
    Part("export", "kernel", ("--only", "export"), ("triton",), 120),
    Part("perf", "kernel", ("--only", "regs,speed,tiles"), ("triton",), None),
)
# What to install from PyPI where a module is missing (the versions the committed runs used).
INSTALL = {"triton": "triton>=3.2", "megatron.core": "megatron-core==0.16.1", "deepspeed": "deepspeed==0.19.6",
           "trl": "trl==1.16.0", "datasets": "trl==1.16.0"}
# The adapters' frameworks print progress bars and log dicts on stdout: only the report's own lines reach the
# console (everything is in the log).
REPORT_LINE = re.compile(r"^(==|  \S|benchmarks\.gpu)")
MIN_PART_S = 20  # a part is not started with less time than this left

_ARGS = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n")[0])
_ARGS.add_argument("parts", nargs="*", metavar="PART",
                   help=f"parts to run, in the fixed order (default all): {' '.join(p.name for p in PARTS)}")
_ARGS.add_argument("--out", default="out/gpu", help="folder for run.json and run.log (default out/gpu)")
_ARGS.add_argument("--budget-s", type=float, default=None,
                   help="seconds for all parts together (default 420 on a GPU, 1800 under --cpu-smoke)")
_ARGS.add_argument("--cpu-smoke", action="store_true", help="the same parts on the CPU (how CI runs this)")
_ARGS.add_argument("--list", action="store_true", help="print the parts, what each needs and its cap, and exit")


def say(line: str = "") -> None:
    print(line, flush=True)


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is not there
        return False


def missing(part: Part) -> str | None:
    """Why ``part`` cannot run in this environment, or None."""
    gone = [m for m in part.needs if not installed(m)]
    if gone:
        return "; ".join(f"{m} is not installed here (pip install '{INSTALL[m]}')" for m in gone)
    return None


def die_with_parent() -> None:
    """In the part's process before it starts (Linux): killed when this script dies, whatever kills it."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Run:
    """The merged record of every part, written to ``<out>/run.json`` while the parts run."""

    def __init__(self, out: str, budget_s: float, smoke: bool):
        os.makedirs(out, exist_ok=True)
        self.json_path = os.path.join(out, "run.json")
        self.log = open(os.path.join(out, "run.log"), "w")
        self.parts_dir = tempfile.mkdtemp(prefix="faircast-gpu-")  # the parts' own files (merged into one)
        self.start = time.perf_counter()
        self.budget_s, self.smoke = budget_s, smoke
        self.unselected: list = []
        self.record = {**envelope("benchmarks.gpu"), "smoke": smoke, "budget_s": budget_s, "parts": {},
                       "skipped": [], "failed": [], "finished": False}
        self.lock = threading.Lock()
        self.current = None  # the part's process while one runs
        self.stopped = None  # why the run was stopped from outside (a signal), if it was

    def stop(self, signum, frame) -> None:
        """SIGTERM/SIGINT (a time limit outside): end the running part; main() then starts no other one and writes
        the record (nothing is written here: the signal may arrive in the middle of a write)."""
        self.stopped = f"signal {signum} after {time.perf_counter() - self.start:.0f} s"
        if self.current is not None and self.current.poll() is None:
            self.current.kill()

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def part_json(self, name: str) -> str:
        return os.path.join(self.parts_dir, f"{name}.json")

    def write(self) -> None:
        """Merge every part's own JSON (rewritten after each of its sections) into the one record."""
        with self.lock:
            skipped, failed = list(self.unselected), []
            for name, entry in self.record["parts"].items():
                try:
                    with open(self.part_json(name)) as fh:
                        entry["result"] = json.load(fh)
                except (OSError, ValueError):
                    pass
                result = entry.get("result", {})
                if entry["status"] == "skipped":
                    skipped.append({"what": name, "why": entry["why"]})
                skipped += [{"what": f"{name}: {s['what']}", "why": s["why"]} for s in result.get("skipped", [])
                            if not s["why"].startswith("not selected")]  # the part's --only: this script's choice
                failed += [f"{name}: {f}" for f in result.get("failed", [])]
                if entry["status"] in ("crashed", "timed out"):
                    failed.append(f"{name}: {entry['status']} ({entry['why']})")
            self.record["skipped"], self.record["failed"] = skipped, failed
            tmp = self.json_path + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(self.record, fh, indent=1)
            os.replace(tmp, self.json_path)

    def echo(self, prefix: str, stream, console, tail: collections.deque) -> None:
        """Copy a part's output into the log; lines that ``console`` accepts also to stdout."""
        for line in stream:
            tail.append(line)
            with self.lock:
                self.log.write(f"[{prefix}] {line}")
                self.log.flush()
            if console(line):
                print(f"[{prefix}] {line}", end="", flush=True)

    def run_part(self, part: Part) -> None:
        entry = {"status": "skipped", "module": f"benchmarks.gpu.{part.module}", "args": list(part.args)}
        self.record["parts"][part.name] = entry
        limit = self.left() if part.cap_s is None or self.smoke else min(part.cap_s, self.left())
        why = missing(part) or (f"the time budget was spent ({self.left():.0f} s of {self.budget_s:.0f} s left)"
                                if limit < MIN_PART_S else None)
        if why:
            entry["why"] = why
            say(f"=== {part.name}: skipped ({why})")
            self.write()
            return
        cmd = [sys.executable, "-m", f"benchmarks.gpu.{part.module}", *part.args, "--json", self.part_json(part.name)]
        if self.smoke:
            cmd.append("--cpu-smoke")
        if part.module == "kernel":
            cmd += ["--deadline-s", f"{max(limit - 15, 1):.0f}"]  # stops starting sections, with time to write
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
        say(f"=== {part.name}: {' '.join(cmd[1:])} (at most {limit:.0f} s)")
        t0 = time.perf_counter()
        entry["status"] = "running"
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=die_with_parent)
        self.current = proc
        errors = collections.deque(maxlen=25)  # the last lines of its stderr, shown if it crashes
        console = REPORT_LINE.match if part.module == "adapters" else (lambda line: True)
        streams = ((part.name, proc.stdout, console, collections.deque(maxlen=1)),
                   (part.name + " stderr", proc.stderr, lambda line: False, errors))
        readers = [threading.Thread(target=self.echo, args=args, daemon=True) for args in streams]
        for r in readers:
            r.start()
        while proc.poll() is None:
            if time.perf_counter() - t0 > limit:
                proc.kill()
                entry["status"], entry["why"] = "timed out", f"killed after {limit:.0f} s"
                break
            if self.stopped:
                entry["status"], entry["why"] = "timed out", f"stopped from outside ({self.stopped})"
                break
            self.write()
            time.sleep(5 if not self.smoke else 1)
        proc.wait()
        if self.stopped and entry["status"] == "running":
            entry["status"], entry["why"] = "timed out", f"stopped from outside ({self.stopped})"
        for r in readers:
            r.join(timeout=10)
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        entry["returncode"] = proc.returncode
        self.write()  # reads the part's last JSON
        result = entry.get("result")
        if entry["status"] == "timed out":
            running = [n for n, state in (result or {}).get("sections", {}).items() if state == "running"]
            entry["why"] += f", in section {running[0]}" if running else ""
        elif result is None or proc.returncode != (1 if result.get("failed") else 0):
            entry["status"] = "crashed"
            entry["why"] = f"exit status {proc.returncode}{'' if result else ', no results written'}"
            say(f"=== {part.name} crashed; the end of its stderr:\n" + "".join(errors))
        else:
            entry["status"] = "done"
        self.write()

    def summary(self) -> int:
        self.record["finished"] = True
        self.record["stopped"] = self.stopped
        self.record["seconds"] = round(time.perf_counter() - self.start, 1)
        self.write()
        say(f"=== summary: {self.record['seconds']} s of a {self.budget_s:.0f} s budget; results in {self.json_path}")
        for name, entry in self.record["parts"].items():
            checks = entry.get("result", {}).get("checks", [])
            passed = sum(c["ok"] for c in checks)
            say(f"  {name:<10} {entry['status']:<10} {entry.get('seconds', 0):>6} s  {passed}/{len(checks)} checks passed"
                f"{'  (' + entry['why'] + ')' if entry.get('why') else ''}")
        for s in self.record["skipped"]:
            say(f"  skipped  {s['what']}: {s['why']}")
        for f in self.record["failed"]:
            say(f"  FAILED   {f}")
        say(f"=== {'FAILED: ' + str(len(self.record['failed'])) + ' failure(s)' if self.record['failed'] else 'no failures'}")
        return 1 if self.record["failed"] else 0


def list_parts() -> None:
    for part in PARTS:
        needs = ", ".join(dict.fromkeys(INSTALL[m] for m in part.needs)) or "torch only"
        cap = f"at most {part.cap_s:.0f} s" if part.cap_s else "the rest of the budget"
        say(f"  {part.name:<10} benchmarks.gpu.{part.module} {' '.join(part.args)}  ({cap}; needs: {needs})")


def main(argv=None) -> int:
    args = _ARGS.parse_args(argv)
    if args.list:
        list_parts()
        return 0
    chosen = args.parts or [p.name for p in PARTS]
    unknown = sorted(set(chosen) - {p.name for p in PARTS})
    if unknown:
        _ARGS.error(f"unknown part(s) {unknown}; the parts are {', '.join(p.name for p in PARTS)}")
    budget = args.budget_s if args.budget_s is not None else (1800.0 if args.cpu_smoke else 420.0)
    run = Run(args.out, budget, args.cpu_smoke)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, run.stop)
    rec = run.record
    if not args.cpu_smoke and not rec["device"]["cuda"]:
        run.write()
        say("benchmarks.gpu: no CUDA device (use --cpu-smoke to exercise the parts on the CPU)")
        return 2
    code = f"{rec['commit'] or 'unknown commit'}{' (dirty)' if rec['dirty'] else ''}"
    say(f"benchmarks.gpu: {rec['device']['name'] or 'CPU smoke'}; code {code}; python {rec['python']['version']}; "
        + "; ".join(f"{d} {v['version']}" for d, v in rec["versions"].items() if v["version"])
        + f"; faircast_plugins from {rec['faircast_plugins']}; budget {budget:.0f} s")
    run.write()
    for part in PARTS:
        if part.name not in chosen:
            run.unselected.append({"what": part.name, "why": "not selected"})
        elif run.stopped:
            run.unselected.append({"what": part.name, "why": f"not started: the run was stopped ({run.stopped})"})
        else:
            run.run_part(part)
    return run.summary()


if __name__ == "__main__":
    sys.exit(main())
