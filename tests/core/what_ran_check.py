"""Checks docs/what-ran.md against the committed results, and the other pages against docs/what-ran.md.

``check(root)`` returns a list of problems (empty: all agree). Rules:

1. Every "one GPU" cell that cites ``runN `part` P/T`` names a committed run (benchmarks/gpu/results/<date>-*/runN-*.json
   with that date) whose part finished with T checks and T - P failures; a row whose results key has a finished,
   failure-free part in any run must say **ran**; a row without evidence must not.
2. "more than one GPU" cells say "ran" only if a committed run saw more than one device.
3. Every backticked ``pkg==version`` in the CPU column is pinned in noxfile.py.
4. In README.md and docs/ (not docs/ab/ run records), a sentence that says something did not run / was not measured
   on a GPU must link to what-ran.md, and must not name a path that ran on one GPU unless it is about more than one
   GPU or a GPU engine.
5. README.md and every top-level docs page link to what-ran.md.
"""
from __future__ import annotations

import glob
import os
import re
import sys
from typing import Dict, List, Set, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.gpu.record import load  # noqa: E402 - the reader of every committed GPU result, old ones included

MATRIX = "docs/what-ran.md"
RESULTS = "benchmarks/gpu/results"

# Names a page uses for the path each results key covers (rule 4).
ALIASES: Dict[str, Tuple[str, ...]] = {
    "kernel": ("triton kernel", "the kernel", "tile", "master16", "2 b masters"),
    "export": ("the export", "faircast export"),
    "trl": ("trl",),
    "fsdp2": ("fsdp2",),
    "deepspeed": ("deepspeed", "zero-2", "zero-3"),
    "megatron": ("megatron", "megatron-core"),
    "realsize": ("fp8_loss", "fp8 quantizer"),
}
# A sentence about these is not about the one-GPU path (rule 4).
QUALIFIERS = ("more than one gpu", "multi-gpu", "multiple gpus", "world size > 1", "world sizes above 1",
              "gpu engine", "vllm", "sglang", "multi-node", "nccl wire", "gpus)", "8 gpus", "worker")

# A sentence that says something did not run on a GPU (rule 4).
NEG_GPU = [re.compile(p, re.I) for p in (
    r"\b(never|not|no|none of \w+)\b(\s+\w+){0,3}?\s+(run|ran|been run|measured|timed|tuned|tested|verified)\b"
    r"[^.;:]{0,40}?\bon (a |any |the |one )?(CUDA )?GPU",
    r"\b(unmeasured|untested|unverified|untimed|unrun) on (a |the )?GPU",
    r"\bno GPU (has|have|was|were) (run|ran|measured|timed)",
    r"\bnot (verified|run|measured)( here)?: [^.]*\bGPU (run|session)",
    r"\bGPU (figures|numbers|runs?|timings?)( \w+)? (not|never) (measured|run|ran)",
)]
# "... has not run on a GPU; the device script's Megatron part did": the sentence itself says what ran.
POSITIVE = re.compile(r"(?<!never )(?<!not )\b(ran on one|did\b|passed on)", re.I)


def _read(root: str, rel: str) -> str:
    with open(os.path.join(root, rel), encoding="utf-8") as f:
        return f.read()


def gpu_evidence(root: str) -> Tuple[Dict[Tuple[str, int, str], Tuple[int, int]], Set[str], int]:
    """{(date, run, part): (passed, total)}, the keys with a failure-free finished part, the most devices seen."""
    runs: Dict[Tuple[str, int, str], Tuple[int, int]] = {}
    clean: Set[str] = set()
    devices = 0
    for path in sorted(glob.glob(os.path.join(root, RESULTS, "*/run*.json"))):
        date = os.path.basename(os.path.dirname(path))[:10]
        m = re.match(r"run(\d+)-", os.path.basename(path))
        data = load(path)
        devices = max(devices, int(data["device"].get("count") or 0))
        for part, rec in (data.get("parts") or {}).items():
            res = rec.get("result") or {}
            if rec.get("status") != "done" or not isinstance(res.get("checks"), list):
                continue
            total, failed = len(res["checks"]), len(res.get("failed") or [])
            runs[(date, int(m.group(1)), part)] = (total - failed, total)
            if failed == 0 and not res.get("errors"):
                clean.add(part)
    return runs, clean, devices


def matrix_rows(text: str) -> List[Dict[str, str]]:
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = []
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows.append(dict(zip(head, cells)))
    return rows


def _says_ran(cell: str) -> bool:
    return bool(re.search(r"\*\*ran\*\*|^ran\b", cell, re.I))


def check_matrix(root: str) -> List[str]:
    problems = []
    runs, clean, devices = gpu_evidence(root)
    nox = _read(root, "noxfile.py")
    for row in matrix_rows(_read(root, MATRIX)):
        name, one, multi = row["path"], row["one GPU"], row["more than one GPU"]
        key = row.get("results key", "").strip()
        dates = re.findall(r"(\d{4}-\d{2}-\d{2})", one)
        for run, part, passed, total in re.findall(r"run(\d+) `(\w+)` (\d+)/(\d+)", one):
            got = runs.get((dates[0] if dates else None, int(run), part))
            if got != (int(passed), int(total)):
                problems.append(f"{MATRIX}: {name}: run{run} `{part}` {passed}/{total} on {dates[:1]}, but the "
                                f"committed results say {got}")
        if key and key in clean and not _says_ran(one):
            problems.append(f"{MATRIX}: {name}: `{key}` ran on a GPU ({RESULTS}) but the cell says: {one}")
        if _says_ran(one) and (not key or key not in clean):
            problems.append(f"{MATRIX}: {name}: says ran on a GPU, but no committed run has a clean `{key}` part")
        if _says_ran(multi) and devices < 2:
            problems.append(f"{MATRIX}: {name}: says ran on more than one GPU; no committed run saw 2 devices")
        for pin in re.findall(r"`([A-Za-z0-9_.-]+==[^`]+)`", row["CPU, real framework"]):
            if pin not in nox:
                problems.append(f"{MATRIX}: {name}: `{pin}` is not pinned in noxfile.py")
    return problems


def pages(root: str) -> List[str]:
    out = ["README.md"] + sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "docs/*.md")))
    return [p for p in out if p != MATRIX]


def _sentences(text: str):
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for para in re.split(r"\n\s*\n", text):
        items = para.splitlines() if para.lstrip().startswith("|") else re.split(r"\n(?=\s*(?:[-*]|\d+\.) )", para)
        for line in (" ".join(item.split()) for item in items):
            yield from re.split(r"(?<=[.;])\s+(?=[A-Z*`(])", line)


def check_pages(root: str) -> List[str]:
    problems = []
    _, clean, _ = gpu_evidence(root)
    for rel in pages(root):
        text = _read(root, rel)
        if "what-ran.md" not in text:
            problems.append(f"{rel}: does not link docs/what-ran.md")
        for s in _sentences(text):
            if not any(p.search(s) for p in NEG_GPU):
                continue
            low = s.lower()
            if "what-ran.md" not in s:
                problems.append(f"{rel}: says what did not run on a GPU without linking what-ran.md: {s[:160]!r}")
                continue
            if any(q in low for q in QUALIFIERS) or POSITIVE.search(s):
                continue  # about more GPUs or an engine, or it also says what did run
            named = [k for k in clean if any(re.search(r"(?<![\w-])" + re.escape(a) + r"(?![\w-])[^,;:()\[\]]{0,40}?"
                                                       r"\b(never|not|none|unmeasured|untested|unverified)\b", low)
                                             for a in ALIASES.get(k, ()))]  # the path is the negation's subject
            if named:
                problems.append(f"{rel}: says a path did not run on a GPU, but {named} ran "
                                f"({RESULTS}): {s[:160]!r}")
    return problems


def check(root: str) -> List[str]:
    return check_matrix(root) + check_pages(root)


if __name__ == "__main__":
    import sys
    found = check(sys.argv[1] if len(sys.argv) > 1 else ".")
    print("\n".join(found) or "what-ran: consistent")
    sys.exit(1 if found else 0)
