"""The record that the device scripts (gpu_check.py, gpu_adapters.py) keep: named checks, sections, skips, errors.

A run on a lent GPU must never lose what it did: the JSON file is rewritten after every section (each section's
state: running, done, crashed, skipped), a crashed section does not take the next ones down (the device is
synchronized and torch's cache emptied, errors recorded), and whatever did not run says why (``skipped``:
what, and the reason). ``failed`` lists every failed check and crashed section.
"""
from __future__ import annotations

import json
import os
import time
import traceback
from typing import Callable, Iterable, Optional


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
        self.results: dict = {"sections": {}, "checks": [], "skipped": [], "errors": [], "seconds": {},
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
