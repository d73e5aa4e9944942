"""The one results format of benchmarks/gpu: every part's JSON and the run's merged JSON start with the same
envelope (what code, when, with which versions, on which device), then their checks, sections, skips and errors.

The envelope (``envelope()``; ``FORMAT`` 1):

  format        1
  program       what wrote it (``benchmarks.gpu`` for a whole run, ``benchmarks.gpu.kernel`` for one part, ...)
  command       its command line
  commit        ``git rev-parse HEAD`` of the checkout it ran from (in a copy without .git: ``FAIRCAST_COMMIT``)
  dirty         whether tracked files differed from that commit (None where unknown)
  commit_from   "git", "FAIRCAST_COMMIT" or "unknown"
  time          when it started, UTC, ISO 8601
  python        the interpreter's version and path
  versions      {distribution: {"version", "from"}}: every library a part uses, and where it was imported from
  faircast_plugins  the file the package was imported from (the checkout's, as the parts put it first on the path)
  device        {"cuda", "name", "count", "capability", "cuda_runtime", "nccl"}: the machine's CUDA devices

A part's record (``Report``) is rewritten after every section, so a run cut short keeps what it did: each
section's state (running, done, crashed, skipped), ``checks``, ``skipped`` (what, and why), ``errors``, and
``failed`` (every failed check and crashed section). A crashed section does not take the next ones down (the
device is synchronized and torch's cache emptied, the error recorded).

``load(path)`` reads any committed record, the first ones (2026-12-04, written before the envelope: format 0,
the versions and device under ``env``, no commit) included, and returns it with the envelope filled in as far as
the file tells it (a standalone script's flat ``device`` name goes into the envelope's ``device``).
"""
from __future__ import annotations

import datetime
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Callable, Iterable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FORMAT = 1
# Every library a part imports (where it is installed), recorded with where it was imported from.
DISTRIBUTIONS = ("torch", "triton", "numpy", "numba", "transformers", "accelerate", "peft", "huggingface_hub", "trl",
                 "datasets", "pyarrow", "fsspec", "dill", "multiprocess", "deepspeed", "pydantic", "pydantic_core",
                 "typing_extensions", "megatron-core", "megatron-bridge", "verl")
ENVELOPE = ("format", "program", "command", "commit", "dirty", "commit_from", "time", "python", "versions",
            "faircast_plugins", "device")


def code_commit() -> dict:
    """The code a result came from: ``git rev-parse HEAD`` of this checkout and whether its tracked files differ from
    it; where the copy has no .git (a tree copied to another machine), ``FAIRCAST_COMMIT`` as set by whoever copied
    it."""
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=60)
        if head.returncode == 0:
            return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip()), "commit_from": "git"}
    except (OSError, subprocess.SubprocessError):
        pass
    given = os.environ.get("FAIRCAST_COMMIT")
    return {"commit": given or None, "dirty": None,
            "commit_from": "FAIRCAST_COMMIT" if given else "unknown (no .git, FAIRCAST_COMMIT unset)"}


def _versions() -> dict:
    out = {}
    for dist in DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = None
        module = dist.split("-")[0].replace("-", "_")  # megatron-core, megatron-bridge: the megatron package
        try:
            spec = importlib.util.find_spec(module) if version else None
        except (ImportError, ValueError):
            spec = None
        origin = spec.origin if spec and spec.origin else (list(spec.submodule_search_locations or [None])[0]
                                                           if spec else None)
        where = os.path.dirname(origin) if origin and origin.endswith(".py") else origin
        out[dist] = {"version": version, "from": where}
    return out


def _device() -> dict:
    import torch

    device = {"cuda": torch.cuda.is_available(), "name": None, "count": 0}
    if device["cuda"]:
        device.update(name=torch.cuda.get_device_name(0), count=torch.cuda.device_count(),
                      capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                      cuda_runtime=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())))
    return device


def envelope(program: Optional[str] = None) -> dict:
    """The head of every record: the code (commit, dirty), the time, the versions and the device."""
    spec = importlib.util.find_spec("faircast_plugins")
    program = program or _program()
    command = " ".join([f"python -m {program}" if "/" not in program else program, *sys.argv[1:]])
    return {"format": FORMAT, "program": program, "command": command,
            **code_commit(),
            "time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "python": {"version": sys.version.split()[0], "executable": sys.executable},
            "versions": _versions(), "faircast_plugins": spec.origin if spec else None, "device": _device()}


def _program() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None and spec.name else os.path.relpath(os.path.abspath(sys.argv[0]), REPO)


def load(path: str) -> dict:
    """A committed record with its envelope filled in. Format 0 (the 2026-12-04 runs): the versions and the device
    under ``env`` (the run's JSON) or two flat keys ``device`` and ``torch`` (a standalone script's), no commit and no
    time (the results folder's README names each run's commit)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if data.get("format") == FORMAT:
        return data
    env = data.get("env") if isinstance(data.get("env"), dict) else {}
    if "versions" in env:
        device = {"cuda": bool(env.get("cuda")), "name": env.get("device"), "count": int(env.get("devices") or 0)}
        device.update({k: env[k] for k in ("capability", "cuda_runtime", "nccl") if k in env})
        python = {"version": env.get("python"), "executable": env.get("executable")}
        versions, package = env["versions"], env.get("faircast_plugins")
    else:  # a standalone script's record: the device's name and torch's version only
        name = data.get("device") if isinstance(data.get("device"), str) else None
        device = {"cuda": bool(name and name != "cpu"), "name": name, "count": 1 if name and name != "cpu" else 0}
        python, package = None, None
        versions = {"torch": {"version": data["torch"], "from": None}} if isinstance(data.get("torch"), str) else {}
    head = {"format": 0, "program": None, "command": None, "commit": None, "dirty": None,
            "commit_from": "not recorded (format 0: see the results folder's README)", "time": None,
            "python": python, "versions": versions, "faircast_plugins": package, "device": device}
    return {**head, **{k: v for k, v in data.items() if k not in head}}


class Skip(Exception):
    """Raised inside a section that cannot run here (no CUDA device, a framework not installed): the reason."""


def say(line: str = "") -> None:
    print(line, flush=True)


class Report:
    def __init__(self, path: Optional[str], *, only: Iterable[str] = (), skip: Iterable[str] = (),
                 deadline_s: Optional[float] = None, verbose: bool = False):
        self.path = path
        self.only, self.excluded = set(only) - {""}, set(skip) - {""}
        self.start = time.perf_counter()
        self.deadline_s = deadline_s
        self.verbose = verbose
        self.failed: list = []
        self.results: dict = {**envelope(), "sections": {}, "checks": [], "skipped": [], "errors": [], "seconds": {},
                              "failed": self.failed}

    def time_left(self) -> float:
        if self.deadline_s is None:
            return float("inf")
        return self.deadline_s - (time.perf_counter() - self.start)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.results["checks"].append({"check": name, "ok": bool(ok), "detail": detail})
        if not ok:
            self.failed.append(name)
        if not ok or self.verbose:
            say(f"  {'ok  ' if ok else 'FAIL'} {name}{(' : ' + detail) if detail else ''}")
        return bool(ok)

    def skip(self, what: str, reason: str) -> None:
        """Something that did not run, and why (a section, or one check inside a section)."""
        self.results["skipped"].append({"what": what, "why": reason})
        say(f"  skipped {what}: {reason}")

    def write(self) -> None:
        """Write everything gathered so far (after every section: a run cut short keeps its results)."""
        if not self.path:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(self.results, fh, indent=1)
        os.replace(tmp, self.path)

    def _not_run(self, name: str) -> Optional[str]:
        if name in self.excluded or (self.only and name not in self.only):
            return "not selected (--only/--skip)"
        if self.time_left() <= 0:
            return f"the time budget ({self.deadline_s:.0f} s) was spent before it started"
        return None

    def section(self, name: str, fn: Callable[[], None]) -> None:
        reason = self._not_run(name)
        if reason:
            say(f"== {name}: skipped ({reason})")
            self.results["sections"][name] = "skipped"
            self.results["skipped"].append({"what": f"section {name}", "why": reason})
            self.write()
            return
        say(f"== {name}")
        t = time.perf_counter()
        self.results["sections"][name] = "running"
        self.write()
        try:
            fn()
            self.results["sections"][name] = "done"
        except Skip as why:
            self.results["sections"][name] = "skipped"
            self.skip(f"section {name}", str(why))
        except Exception as exc:  # noqa: BLE001 - one crashed section must not hide the others' results
            self.failed.append(f"{name} crashed")
            self.results["sections"][name] = "crashed"
            self.results["errors"].append({"section": name, "error": repr(exc), "trace": traceback.format_exc()[-4000:]})
            say(f"  FAIL section {name} crashed: {exc!r}")
            say(traceback.format_exc()[-2000:])
        finally:
            self.release_device()
            self.results["seconds"][name] = round(time.perf_counter() - t, 1)
            self.write()
        say(f"  ({time.perf_counter() - t:.1f} s)")

    def release_device(self) -> None:
        """Wait for the device and give its cached memory back; never raises (the device may be in an error state)."""
        import torch

        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        for step in (torch.cuda.synchronize, torch.cuda.empty_cache):
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - recorded; the next section still gets its chance
                self.results["errors"].append({"section": "release", "error": repr(exc)})

    def finish(self, title: str) -> int:
        """Print the summary line and write the file; the exit status (1 on any failure)."""
        self.write()
        checks = self.results["checks"]
        say(f"== summary ({title}): {sum(c['ok'] for c in checks)}/{len(checks)} checks passed; "
            f"{len(self.results['skipped'])} skipped; "
            f"{'FAILED: ' + '; '.join(self.failed) if self.failed else 'no failures'}")
        return 1 if self.failed else 0
