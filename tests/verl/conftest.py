"""Shared fixtures: the tiny model, and a launcher that runs verl's worker on N gloo ranks (subprocesses)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from . import tiny_model

EXAMPLE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "verl")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANK_TIMEOUT_S = 900  # a safety net for hung collectives on a loaded 2-core machine, not a timed assertion


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return tiny_model.build(str(tmp_path_factory.mktemp("tiny_qwen2")))


@pytest.fixture(scope="session")
def moe_model_dir(tmp_path_factory):
    return tiny_model.build(str(tmp_path_factory.mktemp("tiny_qwen3_moe")), moe=True)


@pytest.fixture(scope="session")
def tied_model_dir(tmp_path_factory):
    return tiny_model.build(str(tmp_path_factory.mktemp("tiny_qwen2_tied")), tie_word_embeddings=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(out_dir, *, model_dir: str, world: int, cases: list) -> dict:
    """Run tests/verl/harness.py on ``world`` gloo ranks, each running ``cases`` in order.

    Returns ``{case name: [rank 0 result, rank 1 result, ...]}``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = {**os.environ, "VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT,
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    procs = []
    for rank in range(world):
        opts = dict(rank=rank, world=world, port=port, model_dir=model_dir, batch=8, vocab=tiny_model.VOCAB,
                    out_dir=str(out_dir), cases=cases)
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "tests.verl.harness", json.dumps(opts)], cwd=ROOT,
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))
    failed = []
    for rank, (proc, log) in enumerate(procs):
        try:
            rc = proc.wait(timeout=RANK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        log.close()
        if rc != 0:
            failed.append((rank, rc))
    if failed:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
        tail = (out_dir / f"rank{failed[0][0]}.log").read_text()[-6000:]
        raise AssertionError(f"ranks {failed} failed; log of rank {failed[0][0]}:\n{tail}")
    return {c["name"]: [torch.load(out_dir / f"{c['name']}_rank{r}.pt", weights_only=False) for r in range(world)]
            for c in cases}


SEED = 1234
ON = f"+actor_rollout_ref.faircast={{enable:true,seed:{SEED}}}"
ON_AUDIT = f"+actor_rollout_ref.faircast={{enable:true,seed:{SEED},audit:true}}"
_RUNS: dict = {}
LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"]  # unmerged (verl's default)
MERGE = [*LORA, "actor_rollout_ref.model.lora.merge=true"]
ON_MERGE = f"+actor_rollout_ref.faircast={{enable:true,seed:{SEED},allow_merged_lora:true}}"  # the explicit opt-in
EF = f"+actor_rollout_ref.faircast={{enable:true,seed:{SEED},mode:error_feedback}}"
EF_AUDIT = f"+actor_rollout_ref.faircast={{enable:true,seed:{SEED},mode:error_feedback,audit:true}}"
EMA = f"+actor_rollout_ref.faircast={{enable:true,seed:{SEED},ema_decay:0.5}}"
STICKY = f"+actor_rollout_ref.faircast={{enable:true,seed:{SEED},mode:sticky}}"
STICKY_MERGE = f"+actor_rollout_ref.faircast={{enable:true,seed:{SEED},mode:sticky,allow_merged_lora:true}}"
POLICY_ON = f"+actor_rollout_ref.faircast={{enable:true,seed:{SEED},policy_metrics_every:1,policy_metrics_seqs:3}}"
POLICY_OFF = "+actor_rollout_ref.faircast={enable:false,policy_metrics_every:1,policy_metrics_seqs:3}"
EXAMPLE = os.path.join(EXAMPLE_DIR, "grpo_tiny_cpu.yaml")  # sets faircast: {enable: true, seed: 1234}


@pytest.fixture(scope="session")
def worker_runs(tmp_path_factory, model_dir, tied_model_dir, moe_model_dir):
    """One multi-rank launch per world size; each rank runs several workers in sequence (saves process start-up)."""

    def get(world: int):
        if world not in _RUNS:
            out = tmp_path_factory.mktemp(f"world{world}")
            cases = [dict(name="fsdp2_on", strategy="fsdp2", overrides=[ON]),
                     dict(name="fsdp_on", strategy="fsdp", overrides=[ON])]
            if world == 1:  # world 1 runs from the tiny CPU example config (the flag set in its YAML)
                cases[0].update(config_file=EXAMPLE, overrides=[])
                cases[1].update(checkpoint_engine=True, overrides=[
                    ON, "actor_rollout_ref.rollout.checkpoint_engine.backend=faircast_record"])
                cases.append(dict(name="fsdp2_audit_only", strategy="fsdp2",
                                  overrides=["+actor_rollout_ref.faircast={enable:false,audit:true}"]))
                cases.append(dict(name="fsdp2_lora", strategy="fsdp2", overrides=[ON, *LORA]))
                cases += [dict(name="fsdp2_lora_merge", strategy="fsdp2", overrides=[ON_MERGE, *MERGE], merged_reference=True),
                          dict(name="fsdp2_lora_merge_off", strategy="fsdp2", overrides=MERGE, merged_reference=True),
                          dict(name="fsdp2_ef", strategy="fsdp2", overrides=[EF], delta=True),
                          dict(name="fsdp_ema", strategy="fsdp", overrides=[EMA], delta=True),
                          dict(name="fsdp2_decoupled", strategy="fsdp2", overrides=[ON], decoupled=True),
                          dict(name="fsdp2_nan_step", strategy="fsdp2", overrides=[ON], nan_first_step=True),
                          # faircast/policy_* (test_worker_policy.py): FSDP2 with Fair Cast off, FSDP1 with it on
                          dict(name="fsdp2_policy_off", strategy="fsdp2", overrides=[POLICY_OFF]),
                          dict(name="fsdp_policy", strategy="fsdp", overrides=[POLICY_ON])]
            if world == 3:  # packed MoE experts (4 over 3 ranks: uneven shards of a 3-D parameter), unfused on export
                cases.append(dict(name="fsdp2_moe", strategy="fsdp2", overrides=[ON], model_dir=moe_model_dir))
                cases += [dict(name="fsdp2_ema", strategy="fsdp2", overrides=[EMA], delta=True),
                          dict(name="fsdp_ef", strategy="fsdp", overrides=[EF], delta=True),
                          dict(name="fsdp2_ema_decoupled", strategy="fsdp2", overrides=[EMA], decoupled=True)]
            if world == 2:
                ckpt = str(out / "ckpt")
                cases[0].update(overrides=[ON_AUDIT], save_checkpoint=ckpt, delta=True)
                cases[1].update(delta=True)
                cases += [dict(name="fsdp2_resume", strategy="fsdp2", overrides=[ON_AUDIT], load_checkpoint=ckpt),
                          dict(name="fsdp2_off", strategy="fsdp2", delta=True),
                          dict(name="fsdp_off", strategy="fsdp", delta=True),
                          dict(name="fsdp2_ef", strategy="fsdp2", overrides=[EF_AUDIT], save_checkpoint=ckpt + "_ef"),
                          dict(name="fsdp2_ef_resume", strategy="fsdp2", overrides=[EF_AUDIT], load_checkpoint=ckpt + "_ef"),
                          dict(name="fsdp_ema", strategy="fsdp", overrides=[EMA], save_checkpoint=ckpt + "_ema"),
                          dict(name="fsdp_ema_resume", strategy="fsdp", overrides=[EMA], load_checkpoint=ckpt + "_ema"),
                          dict(name="fsdp2_sticky", strategy="fsdp2", overrides=[STICKY], delta=True),
                          # merged LoRA in sticky mode here (stochastic at world 1)
                          dict(name="fsdp2_lora_merge", strategy="fsdp2", overrides=[STICKY_MERGE, *MERGE],
                               merged_reference=True),
                          dict(name="fsdp2_export_only", strategy="fsdp2", overrides=[ON], export_only=True),
                          dict(name="fsdp_export_only", strategy="fsdp", overrides=[ON], export_only=True),
                          dict(name="fsdp2_tied", strategy="fsdp2", overrides=[ON], model_dir=tied_model_dir),
                          dict(name="fsdp_tied", strategy="fsdp", overrides=[ON], model_dir=tied_model_dir),
                          dict(name="fsdp_ef_decoupled", strategy="fsdp", overrides=[EF], decoupled=True),
                          dict(name="fsdp2_policy", strategy="fsdp2", overrides=[POLICY_ON]),
                          dict(name="fsdp_policy_off", strategy="fsdp", overrides=[POLICY_OFF], temperature=0.7)]
            _RUNS[world] = (out, run_ranks(out, model_dir=model_dir, world=world, cases=cases))
        return _RUNS[world]

    return get


def rank_log(out_dir, rank: int = 0) -> str:
    return (out_dir / f"rank{rank}.log").read_text()
