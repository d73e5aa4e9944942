"""Fair Cast on megatron-core 0.16.1, 0.18.2 and 0.19.2 (CPU, gloo): the served bf16 params after each step, for every layout.

Three torchrun launches serve every test (a launch costs ~10 s of imports): world sizes 1, 2 and 4 (TP2 x DP2); each
runs its scenarios (tests/megatron/worker.py) one after another in one process group.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# the HF-keyed scenarios last: with megatron-bridge installed they import it behind TransformerEngine stand-ins
WS1 = ["do", "f16", "do_off", "f16_off", "resume", "ef_resume", "ema_resume", "audit", "refusals", "skip", "bypass",
       "hf", "hf_tied", "hf_f16", "hf_resume", "hf_ema_resume", "hf_refusals", "hf_offload",
       "policy", "policy_off", "policy_f16", "policy_tied"]  # policy*: tests/megatron/test_policy.py
WS2 = ["do", "f16", "do_off", "overlap", "tp2", "tp2_off", "pp2", "ep2", "resume", "ef_resume", "hf", "hf_tp2", "hf_pp2",
       "hf_ep2", "policy", "policy_off", "policy_tp2", "policy_ep2", "policy_pp2",
       "check_one_rank"]  # check_one_rank last: before its fix it hung until the gloo timeout
WS4 = ["tp2", "tp2_off", "hf_tp2", "policy_tp2"]  # TP2 x DP2
LAUNCH_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, scenarios, tmp_path_factory) -> dict:
    """Run ``scenarios`` of tests/megatron/worker.py in one torchrun launch of ``nproc`` ranks: ``{name: [per rank]}``."""
    out = tmp_path_factory.mktemp(f"megatron_ws{nproc}") / "results.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={_free_port()}",
           os.path.join(HERE, "worker.py"), str(out), *scenarios]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"torchrun ws{nproc} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


# the fixtures ws1 / ws2 / ws4 (one launch each, shared with test_policy.py): tests/megatron/conftest.py


def _ranks(results, name):
    ranks = results[name]
    errors = [r["error"] for r in ranks if "error" in r]
    assert not errors, errors[0]
    return ranks


def _served_fair_cast(results, name, layout=""):
    for r in _ranks(results, name):
        check = r["check"]
        assert r["steps_ok"] and r["version"] == 2, r
        assert check["mismatches"] == [], f"{name}{layout}: served != fair_cast(master) for {check['mismatches']}"
        assert check["differs_from_rtn"] == check["params"] > 0, f"{name}: some params are still round-to-nearest"


def _served_rtn(results, name):
    for r in _ranks(results, name):
        check = r["check"]
        assert check["mismatches"] == [] and check["differs_from_rtn"] == 0, check


@pytest.mark.parametrize("name", ["do", "f16"])
def test_world1_serves_fair_cast_of_the_master(ws1, name):
    _served_fair_cast(ws1, name)


@pytest.mark.parametrize("name", ["do_off", "f16_off"])
def test_world1_stock_control_is_round_to_nearest(ws1, name):
    _served_rtn(ws1, name)


@pytest.mark.parametrize("name", ["do", "f16", "overlap", "tp2", "pp2", "ep2"])
def test_world2_layouts_serve_fair_cast_of_the_master(ws2, name):
    _served_fair_cast(ws2, name)
    if name in ("do", "overlap"):  # the distributed optimizer's DP ranks split what the Float16 one casts on each
        whole = {r["elements_cast"] for r in ws2["f16"]}
        assert len(whole) == 1 and sum(r["elements_cast"] for r in ws2[name]) == whole.pop()
        assert all(r["elements_cast"] > 0 for r in ws2[name])


@pytest.mark.parametrize("name", ["do_off", "tp2_off"])
def test_world2_stock_control_is_round_to_nearest(ws2, name):
    _served_rtn(ws2, name)


@pytest.mark.parametrize("name,axis", [("pp2", "pp"), ("ep2", "ep")])
def test_stages_and_expert_ranks_never_share_a_key(ws2, name, axis):
    """Local names repeat on every stage / expert rank; the canonical names of different tensors must not."""
    ranks = _ranks(ws2, name)
    assert ranks[0]["coords"][axis] != ranks[1]["coords"][axis]
    names0, names1 = ranks[0]["check"]["names"], ranks[1]["check"]["names"]
    shared = set(names0) & set(names1)
    if axis == "pp":
        assert shared == set(), shared
    else:  # dense params are replicated over expert ranks; experts are not
        assert not any(".experts." in n for n in shared), shared
        experts = sorted(n for n in set(names0) | set(names1) if ".local_experts." in n)
        assert {n.split(".local_experts.")[1].split(".")[0] for n in experts} == {"0", "1", "2", "3"}


def test_tp2_x_dp2_serves_fair_cast_of_the_master(ws4):
    """Four ranks: two TP ranks, each with two data-parallel ranks splitting its distributed-optimizer ranges."""
    _served_fair_cast(ws4, "tp2", " (TP2 x DP2)")
    _served_rtn(ws4, "tp2_off")
    ranks = _ranks(ws4, "tp2")
    assert sorted(r["coords"]["tp"] for r in ranks) == [0, 0, 1, 1]
    for tp in (0, 1):  # the two DP ranks of a TP rank split its elements between them
        cast = [r["elements_cast"] for r in ranks if r["coords"]["tp"] == tp]
        assert all(c > 0 for c in cast) and len(set(tuple(r["check"]["names"]) for r in ranks)) == 1


def test_tensor_parallel_keys_the_full_tensor(ws2):
    """Both TP ranks key the same names (each its slice of the full tensor): the full-tensor check above passed."""
    ranks = _ranks(ws2, "tp2")
    assert ranks[0]["check"]["names"] == ranks[1]["check"]["names"]
    assert {r["coords"]["tp"] for r in ranks} == {0, 1}


@pytest.mark.parametrize("launch,name", [("ws1", "resume"), ("ws1", "ef_resume"), ("ws1", "ema_resume"),
                                         ("ws2", "resume"), ("ws2", "ef_resume")])
def test_resume_is_bit_exact(request, launch, name):
    for r in _ranks(request.getfixturevalue(launch), name):
        assert r["resume"]["version"] == 3 and r["resume"]["mismatches"] == [], r["resume"]
        refused = r["resume"]["refused_without_state"]
        assert (refused is None) == (name == "resume"), refused  # stateful modes need their saved state
        assert refused is None or "does not exist" in refused
    if name == "ema_resume":
        _served_fair_cast(request.getfixturevalue(launch), name, " (EMA)")


def test_every_refusal_names_the_option(ws1):
    (r,) = _ranks(ws1, "refusals")
    assert r.pop("disabled_attaches_nothing") is True
    assert all(v == "refused" for v in r.values()), r


def test_skipped_step_keeps_version_and_weights(ws1):
    (r,) = _ranks(ws1, "skip")
    assert r == {"success": False, "version": 1, "unchanged": True}


def test_a_copy_around_fair_cast_fails_the_step(ws1):
    (r,) = _ranks(ws1, "bypass")
    assert r["raised"] and "cast 0 elements" in r["raised"], r


def test_version_guard():
    """Exactly the releases tests-megatron runs are verified: no pre-, post- or other release of them (finding 11)."""
    from faircast_plugins.megatron.patch import MEGATRON_SPECIFIER
    from faircast_plugins.patching import _newer_than_verified, version_matches

    assert {v for v in ("0.16.1", "0.18.2", "0.19.2") if version_matches(v, MEGATRON_SPECIFIER)} == {"0.16.1", "0.18.2", "0.19.2"}
    unrun = ("0.15.3", "0.16.0rc0", "0.16.0", "0.16.2", "0.17.0", "0.18.0", "0.18.1", "0.18.2rc0", "0.18.2.post1",
             "0.18.3", "0.19.0", "0.19.2rc1", "0.19.2.post1", "0.20.0", "0.20.0rc0")
    assert not any(version_matches(v, MEGATRON_SPECIFIER) for v in unrun)
    # above the oldest verified release: refused unless opted in (then `faircast doctor megatron-core` must pass)
    assert all(_newer_than_verified(v, MEGATRON_SPECIFIER) for v in ("0.17.0", "0.18.2.post1", "0.19.0", "0.20.0"))
    assert not any(_newer_than_verified(v, MEGATRON_SPECIFIER) for v in ("0.15.3", "0.16.0rc0", "0.16.0"))  # upgrade


def test_the_installed_release_is_the_one_this_session_runs():
    """nox's tests-megatron runs this suite once per release (FAIRCAST_EXPECT_MEGATRON_CORE): the gate accepts it."""
    from faircast_plugins.megatron.patch import MEGATRON_SPECIFIER
    from faircast_plugins.patching import installed_version, version_matches

    expected = os.environ.get("FAIRCAST_EXPECT_MEGATRON_CORE")
    installed = installed_version("megatron-core")
    if expected:
        assert installed == expected, (installed, expected)
    assert version_matches(installed, MEGATRON_SPECIFIER), installed


def test_unverified_release_is_refused_with_its_version(monkeypatch):
    from faircast_plugins import patching
    from faircast_plugins.megatron.patch import MEGATRON_SPECIFIER

    monkeypatch.setattr(patching, "installed_version", lambda dist: "0.19.0")
    monkeypatch.delenv(patching.ALLOW_UNVERIFIED_ENV, raising=False)
    with pytest.raises(patching.FairCastPatchError, match="0.19.0"):
        patching.check_version("megatron-core", MEGATRON_SPECIFIER)


def test_audit_metrics(ws1):
    (r,) = _ranks(ws1, "audit")
    m = r["metrics"]
    assert m["faircast/version"] == 2.0 and 0 < m["faircast/served_changed_frac"] <= 1
    assert abs(m["faircast/lag_steps"]) < 0.5 and "faircast/bias_rel" in m
    assert set(_ranks(ws1, "do")[0]["metrics"]) == {"faircast/version"}  # audit off: the version only


def _bridge_expected() -> bool:
    import importlib.util

    return os.environ.get("FAIRCAST_EXPECT_MEGATRON_BRIDGE") == "1" or importlib.util.find_spec("megatron.bridge") is not None


@pytest.mark.parametrize("launch,name", [("ws1", "hf"), ("ws1", "hf_tied"), ("ws1", "hf_f16"), ("ws1", "hf_resume"),
                                         ("ws1", "hf_ema_resume"), ("ws2", "hf"), ("ws2", "hf_tp2"), ("ws2", "hf_pp2"),
                                         ("ws2", "hf_ep2"), ("ws4", "hf_tp2"), ("ws1", "hf_offload")])
def test_hf_keyed_served_tensors_equal_faircast_export_of_the_hf_checkpoint(request, launch, name):
    """With converters (megatron-bridge's LlamaBridge where installed, else hand-written stand-ins): the served
    params, exported to HF tensors through the converters, are what ``faircast export`` serves from the HF
    checkpoint of the fp32 master (of its EMA for hf_ema_resume), bit for bit; the padded vocab rows are
    round-to-nearest."""
    names = set()
    for r in _ranks(request.getfixturevalue(launch), name):
        hf = r["hf"]
        assert r["steps_ok"] and r["version"] == 2
        assert hf["bridge"] == _bridge_expected(), hf["bridge"]
        # the bridge's own megatron_to_hf (TP2: its TP gather) is the export wherever it can run without PP/EP
        assert hf["real_export"] == (hf["bridge"] and name in ("hf", "hf_tied", "hf_f16", "hf_tp2", "hf_resume",
                                                                  "hf_offload"))
        assert hf["mismatches"] == [], f"{name} ({launch}): served != faircast export for {hf['mismatches']}"
        assert hf["differs_from_rtn"] == len(hf["hf_names"]) > 0
        held = set(hf["hf_names"])
        vocab_tensors = ("model.embed_tokens.weight" in held) + ("lm_head.weight" in held)
        assert hf["padded_rows"] == 6 * vocab_tensors and hf["padded_rows_rtn"] is True
        # the Megatron-native keys no longer describe the served bits: every param differs from them
        assert len(r["check"]["mismatches"]) == r["check"]["params"]
        names |= held
    assert {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.1.self_attn.v_proj.weight"} <= names
    assert ("model.layers.1.mlp.up_proj.weight" in names) == (name != "hf_ep2")  # MoE: experts, no dense MLP
    assert ("lm_head.weight" in names) == (name != "hf_tied")
    if name == "hf_pp2":
        assert "model.layers.3.self_attn.q_proj.weight" in names
    if name == "hf_ep2":  # each expert rank keys its own experts by their global id
        assert {f"model.layers.0.mlp.experts.{e}.gate_proj.weight" for e in range(4)} <= names


@pytest.mark.parametrize("name", ["hf_resume", "hf_ema_resume"])
def test_hf_keyed_resume_is_bit_exact(ws1, name):
    (r,) = _ranks(ws1, name)
    assert r["resume"]["version"] == 3 and r["resume"]["mismatches"] == [], r["resume"]


def test_hf_keying_refusals_name_the_param(ws1):
    (r,) = _ranks(ws1, "hf_refusals")
    assert all(v == "refused" for v in r.values()), r
    assert ("bridge_zero_centred" in r) == _bridge_expected()


def test_param_offload_attach_and_checkpoints_with_bucket_storage_resized_to_0(ws1):
    """verl's actor.megatron.param_offload=True: Fair Cast attaches, saves and loads while every DDP buffer's storage
    is resized to 0 (megatron-review.md finding 2); the steps in between serve the HF-keyed fair_cast of the master
    (test_hf_keyed_served_tensors_equal_faircast_export_of_the_hf_checkpoint[ws1-hf_offload])."""
    for r in _ranks(ws1, "hf_offload"):
        assert r["steps_ok"] and r["version"] == 2
        assert r["offload_saved"] == ["faircast_state_rank00000.pt"], r


def test_a_problem_on_one_rank_raises_on_every_rank(ws2):
    """The per-step check reaches the same collectives on every rank whatever it found (finding 10): each raises."""
    raised = [r.get("raised") for r in _ranks(ws2, "check_one_rank")]
    assert "a problem on the last rank only" in raised[1], raised
    assert "rank(s) [1]" in raised[0], raised
