"""Runs an A/B protocol: the warm start, then every (arm, seed) as its own process, a few at a time.

Each run writes ``runs/<arm>/seed<N>.json`` (and its log beside it) when it ends; a finished run whose spec is
unchanged is not run again, so an interrupted A/B resumes where it stopped. A run that fails is reported, never
dropped: the A/B exits non-zero and the report lists it.

Every invocation is a *session*, recorded in ``sessions.json`` when it starts (UTC time, code commit, dirty state
with untracked files) and again when it ends: the runs it found finished (a resume), the runs it ran, every
retry (the failed attempt's exit code and its kept log) and the runs that failed. results.json carries them all.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Callable, Dict, List, Optional, Tuple

from .protocol import Protocol
from .task import load_jsonl, task_problems
from .warmstart import finetune_warm_start, warm_start


def check_causal_lm(path: str) -> None:
    """A clear error unless ``path`` is a local Hugging Face causal-LM directory with a tokenizer."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not os.path.isdir(path):
        raise FileNotFoundError(f"--model {path!r} is not a directory (a local Hugging Face model directory)")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {path!r} is not a Hugging Face model directory: {e}") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"--model {path!r} is a {config.model_type!r} model, not a causal LM (GRPO needs one)")
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"--model {path!r} has no tokenizer files")


#: ``--model NAME`` for a built-in real model: the name, and the function that returns its cached checkpoint.
BUILT_IN_MODELS = {"smollm2": "faircast_plugins.real_model:smollm2_checkpoint"}


def resolve_model(model: str) -> str:
    """A model directory: ``model`` itself, or the cached checkpoint of a built-in real model (built on first use)."""
    if model not in BUILT_IN_MODELS:
        return model
    import importlib

    module, _, func = BUILT_IN_MODELS[model].partition(":")
    try:
        build = getattr(importlib.import_module(module), func)
    except ImportError as e:
        raise ValueError(f"--model {model}: the real-model builder ({module}) is not available: {e}") from None
    return str(build())


def prepare(proto: Protocol, out: str, log: Callable[[str], None]) -> Tuple[str, list, list, Optional[dict]]:
    """The model directory and the (train, held-out) problems of the protocol."""
    if proto.model:
        check_causal_lm(resolve_model(proto.model))
    elif proto.dataset:
        raise ValueError("--dataset needs --model (the built-in warm start is trained on the built-in task)")
    if proto.dataset:
        train, heldout = load_jsonl(proto.dataset, proto.heldout, seed=0)
    else:
        train, heldout = task_problems(proto.task, proto.warmstart.seed, proto.heldout)
    if proto.model and proto.sft:
        path = finetune_warm_start(os.path.join(out, "cache"), resolve_model(proto.model), proto.task, train, heldout,
                                   proto.sft, log)
    elif proto.model:
        return resolve_model(proto.model), train, heldout, None
    else:
        path = warm_start(os.path.join(out, "cache"), proto.warmstart, log)
    with open(os.path.join(path, "warmstart.json")) as f:
        return path, train, heldout, json.load(f)


def run_spec(proto: Protocol, arm: str, seed: int, model: str, train, heldout, out: str) -> dict:
    return {
        "arm": arm, "seed": seed, "lr": proto.lr, "model": model, "steps": proto.steps, "eval_every": proto.eval_every,
        "prompts_per_step": proto.prompts_per_step, "generations": proto.generations, "threads": proto.threads,
        "audit_sample": proto.audit_sample, "compute": proto.compute, "lr_schedule": proto.lr_schedule,
        "num_iterations": proto.num_iterations, "steps_per_generation": proto.steps_per_generation,
        "epsilon": proto.epsilon, "loss_type": proto.loss_type, "is_correction": proto.is_correction,
        # only when off, so the specs (and digests) of protocols written before the field are unchanged
        **({} if proto.gradient_checkpointing else {"gradient_checkpointing": False}),
        "readouts": proto.readouts, "train": [asdict(p) for p in train], "heldout": [asdict(p) for p in heldout],
    }


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spec_digest(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


class Grid:
    """Runs the jobs with a pool of worker processes; relays their progress lines."""

    def __init__(self, out: str, workers: int, log: Callable[[str], None], python: str = sys.executable):
        self.out, self.workers, self.log, self.python = out, workers, log, python
        self.lock = threading.Lock()
        self.done = 0
        self.total = 0
        self.start = time.time()
        self.failed: List[str] = []
        self.retries: List[dict] = []   # every failed attempt that was retried
        self.ran: List[str] = []        # every run this session started
        self.on_progress: Callable[[], None] = lambda: None  # called (under the lock) whenever a run starts or ends
        self.slots: "queue.Queue[int]" = queue.Queue()
        for i in range(workers):
            self.slots.put(i)
        self.gpus = _gpu_count()

    def _say(self, msg: str) -> None:
        with self.lock:
            self.log(msg)

    def _run(self, name: str, spec: dict) -> None:
        run_dir = os.path.join(self.out, "runs", spec["arm"])
        os.makedirs(run_dir, exist_ok=True)
        base = os.path.join(run_dir, f"seed{spec['seed']}")
        spec = {**spec, "workdir": base + ".work", "digest": spec_digest(spec)}
        with open(base + ".spec.json", "w") as f:
            json.dump(spec, f)
        t0 = time.time()
        with self.lock:
            self.ran.append(name)
            self.on_progress()
        rc = self._attempt(base, spec["threads"])
        if rc != 0:  # one retry: parallel runs on one host can lose a rendezvous-port race
            os.replace(base + ".log", base + ".failed.log")
            with self.lock:
                self.retries.append({"run": name, "exit": rc, "log": base + ".failed.log", "at": utc_now()})
            self._say(f"{name} failed (exit {rc}; log kept in {base}.failed.log); retrying once")
            rc = self._attempt(base, spec["threads"])
        with self.lock:
            self.done += 1
            elapsed = time.time() - self.start
            eta = elapsed / self.done * (self.total - self.done)
            if rc != 0:
                self.failed.append(name)
                self.log(f"FAILED {name} (exit {rc}); log: {base}.log")
            self.on_progress()
            self.log(f"[{self.done}/{self.total}] {name} finished in {time.time() - t0:.0f} s; "
                     f"elapsed {elapsed / 60:.1f} min, about {eta / 60:.1f} min left")

    def _attempt(self, base: str, threads: int) -> int:
        threads = str(threads)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}  # the engine's own rendezvous
        slot = self.slots.get()
        try:
            if self.gpus >= self.workers:  # one GPU per worker
                env["CUDA_VISIBLE_DEVICES"] = str(slot)
            return self._spawn(base, env)
        finally:
            self.slots.put(slot)

    def _spawn(self, base: str, env: dict) -> int:
        with open(base + ".log", "w") as logf:
            proc = subprocess.Popen([self.python, "-m", "faircast_plugins.ab.run_one", base + ".spec.json",
                                     base + ".json"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=env)
            for line in proc.stdout:
                logf.write(line)
                if line.startswith("  ["):
                    self._say(line.rstrip())
            return proc.wait()

    def run(self, jobs: Dict[str, dict], on_start: Callable[[List[str]], None] = lambda resumed: None) -> List[str]:
        todo = {}
        for name, spec in jobs.items():
            path = os.path.join(self.out, "runs", spec["arm"], f"seed{spec['seed']}.json")
            if os.path.isfile(path):
                with open(path) as f:
                    if json.load(f).get("spec", {}).get("digest") == spec_digest(spec):
                        continue  # finished before with the same spec: resume past it
            todo[name] = spec
        resumed = [name for name in jobs if name not in todo]
        if resumed:
            self.log(f"resuming: {len(resumed)} of {len(jobs)} runs already finished")
        on_start(resumed)
        self.total = len(todo)
        with ThreadPoolExecutor(self.workers) as pool:
            list(pool.map(lambda item: self._run(*item), todo.items()))
        return self.failed


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


SESSIONS = "sessions.json"


def load_sessions(out: str) -> List[dict]:
    path = os.path.join(out, SESSIONS)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return json.load(f)


def _save_sessions(out: str, sessions: List[dict]) -> None:
    tmp = os.path.join(out, SESSIONS + ".tmp")
    with open(tmp, "w") as f:
        json.dump(sessions, f, indent=1)
    os.replace(tmp, os.path.join(out, SESSIONS))


def run_ab(proto: Protocol, out: str, log: Callable[[str], None] = print,
           session: Optional[dict] = None) -> Tuple[List[str], Optional[dict], str]:
    """Run every (arm, seed) of ``proto`` under ``out``; returns (failed runs, warm-start info, model dir).

    ``session``: this invocation's provenance, taken at its start (:func:`start_session`); recorded in
    ``sessions.json`` before any run starts, and completed when the grid ends."""
    os.makedirs(out, exist_ok=True)
    sessions = load_sessions(out)
    session = dict(session or start_session())
    sessions.append(session)
    _save_sessions(out, sessions)  # recorded before anything runs: a session that dies is still on record
    model, train, heldout, ws_info = prepare(proto, out, log)
    jobs = {f"{arm} seed {seed}": run_spec(proto, arm, seed, model, train, heldout, out)
            for seed in proto.seeds for arm in proto.arms}  # seed-major: partial results stay paired
    log(f"A/B '{proto.name}': {len(proto.arms)} arms x {len(proto.seeds)} seeds, {proto.steps} steps each at lr "
        f"{proto.lr:g}, {proto.workers} at a time")
    grid = Grid(out, proto.workers, log)

    def progress() -> None:  # on record as it happens: a session killed mid-grid still says what it ran
        session.update(ran=list(grid.ran), retries=list(grid.retries), failed=list(grid.failed))
        _save_sessions(out, sessions)

    def started(resumed: List[str]) -> None:
        session["resumed_past"] = resumed
        _save_sessions(out, sessions)

    grid.on_progress = progress
    try:
        failed = grid.run(jobs, on_start=started)
    finally:
        session["finished"] = utc_now()
        progress()
    return failed, ws_info, model


def start_session() -> dict:
    """This invocation's provenance, taken at its start: UTC time, code commit and dirty state (untracked files too),
    the machine and its load."""
    from .provenance import code_provenance, machine

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"started": utc_now(), "code": code_provenance(), "hardware": machine(), "loadavg": load,
            "host": socket.gethostname()}
