"""The A/B harness's emulated coarse served grid (``faircast_plugins.ab.coarse_grid``, arms ``coarse-rtn@S``,
``coarse-sr@S``, ``coarse-sr-aa@S``): served = w0 + Q_u(w - w0), u = S * ulp_bf16(w0).

No trainer: the rules on tensors, the arms, and ``run_one.EngineExport`` driven by a fake trainer (what the engine
is sent at each sync, and what the audit's lag metrics see)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from faircast_plugins import fair_cast
from faircast_plugins.ab import run_one
from faircast_plugins.ab.arms import AA_SEED_OFFSET, aa_twin, engine_record, parse_arm
from faircast_plugins.ab.coarse_grid import coarse_served, ulp_bf16
from faircast_plugins.key import derive_key
from faircast_plugins.torch_ref import CHUNK

MODES = ("nearest", "stochastic")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def bf16_start(n: int, seed: int = 0, lo: float = 1.1, hi: float = 1.9) -> torch.Tensor:
    """n values on the bf16 grid, both signs, binades 2**-12 .. 2**3, mantissas in [lo, hi) (away from the binade
    edges, so a small update keeps w in w0's binade)."""
    g = torch.Generator().manual_seed(seed)
    mant = lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64)
    exp = torch.randint(-12, 4, (n,), generator=g).double()
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return (sign * mant * torch.exp2(exp)).float().to(torch.bfloat16).float()


def test_ulp_bf16_of_normals_zero_and_subnormals():
    w0 = torch.tensor([1.0, 1.5, 1.9921875, 2.0, -3.0, 2.0**-126, 0.0, -0.0, 2.0**-149, 2.0**-130, 3.0e38])
    want = [2.0**-7, 2.0**-7, 2.0**-7, 2.0**-6, 2.0**-6, 2.0**-133, 2.0**-133, 2.0**-133, 2.0**-133, 2.0**-133,
            2.0**120]
    got = ulp_bf16(w0)
    assert got.dtype == torch.float64 and got.tolist() == want
    with pytest.raises(ValueError, match="non-finite w0"):
        ulp_bf16(torch.tensor([1.0, math.inf]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scale", [1, 16, 64, 3])
def test_step_zero_serves_w0_bit_for_bit(mode, scale):
    w0 = torch.cat([bf16_start(4096), torch.tensor([0.0, -0.0, 2.0**-130, -(2.0**-133), 1.0])])
    served = coarse_served(w0.clone(), w0, scale, mode, key=derive_key(7, 0, "x"))
    assert torch.equal(bits(served), bits(w0))  # -0.0 stays -0.0


@pytest.mark.parametrize("scale", [1, 16, 64])
def test_an_update_below_half_a_grid_step_vanishes_under_rtn_and_survives_in_expectation_under_sr(scale):
    """RTN: |w - w0| < u/2 serves w0 exactly. SR: over K keys x N elements the mean served update is the update, within
    5 sd of the mean (each draw is 0 or +-u: sd <= u/2) plus the 16-bit uniform's bias bound u * 2**-16."""
    n, keys = 1024, 256
    w0 = torch.full((n,), -1.25) if scale == 64 else torch.full((n,), 0.75)  # on the bf16 grid, either sign
    u = float(ulp_bf16(w0[:1])) * scale
    for frac in (0.1, 0.3, -0.45):
        w = (w0.double() + frac * u).float()
        d = float(w[0].double() - w0[0].double())
        assert abs(d) < u / 2
        assert torch.equal(bits(coarse_served(w, w0, scale, "nearest")), bits(w0))  # the update is lost
        total = sum(float((coarse_served(w, w0, scale, "stochastic", key=derive_key(1, k, "p")).double()
                           - w0.double()).sum()) for k in range(keys))
        mean = total / (n * keys)
        tol = 5 * (u / 2) / math.sqrt(n * keys) + u * 2.0**-16
        assert abs(mean - d) < tol, (frac, mean, d, tol)
        assert tol < abs(d) / 10  # the check can tell the update from zero
    above = (w0.double() + 0.75 * u).float()  # past u/2: one whole grid step
    assert torch.equal(coarse_served(above, w0, scale, "nearest").double(), w0.double() + u)


def test_sr_is_deterministic_per_key_and_index_keyed():
    n = CHUNK + 50  # across a chunk boundary of the implementation
    w0 = bf16_start(n, seed=1)
    w = (w0.double() + torch.randn(n, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
         * 30 * ulp_bf16(w0)).float()
    key = derive_key(3, 5, "model.layers.0.mlp.up_proj.weight")
    whole = coarse_served(w, w0, 16, "stochastic", key=key)
    assert torch.equal(whole, coarse_served(w, w0, 16, "stochastic", key=key))
    assert not torch.equal(whole, coarse_served(w, w0, 16, "stochastic", key=key + 1))
    for a, b in ((13, 1000), (CHUNK - 30, CHUNK + 40), (8, 16)):
        part = coarse_served(w[a:b], w0[a:b], 16, "stochastic", key=key, offset=a)
        assert torch.equal(bits(part), bits(whole[a:b])), (a, b)
    two_d = coarse_served(w[:1000].view(40, 25), w0[:1000].view(40, 25), 16, "stochastic", key=key)
    assert torch.equal(two_d.view(-1), whole[:1000])  # row-major global indices


def test_scale_one_is_bf16_rtn_and_fair_cast_inside_w0s_binade():
    """S = 1 with w in w0's binade (and sign): nearest is bf16 round to nearest except at exact ties when w0's bf16
    mantissa is odd (bf16 ties to the even mantissa, the emulation to the even update); stochastic is ``fair_cast``
    bit for bit, at any global index (above 2**31 and 2**32 too)."""
    n = 20000
    w0 = bf16_start(n, seed=4)
    ulp = ulp_bf16(w0)
    g = torch.Generator().manual_seed(5)
    w = (w0.double() + (torch.rand(n, generator=g, dtype=torch.float64) * 6 - 3) * ulp).float()
    assert torch.equal(coarse_served(w, w0, 1, "nearest"), w.to(torch.bfloat16).float())
    for offset in (0, 2**31 + 3, 2**32 + 5):
        key = derive_key(11, 2, "model.embed_tokens.weight")
        assert torch.equal(coarse_served(w, w0, 1, "stochastic", key=key, offset=offset),
                           fair_cast(w, key=key, offset=offset).float()), offset
    k = torch.randint(-3, 3, (n,), generator=g).double()
    tie = (w0.double() + (k + 0.5) * ulp).float()  # exactly halfway: representable in fp32
    odd = (bits(w0) >> 16) & 1 == 1
    same = torch.eq(coarse_served(tie, w0, 1, "nearest"), tie.to(torch.bfloat16).float())
    assert bool(same[~odd].all()) and not bool(same[odd].any())


def test_non_finite_masters_pass_through_and_bad_arguments_are_refused():
    w0 = torch.tensor([1.0, -2.0, 0.5])
    w = torch.tensor([math.nan, math.inf, 0.5])
    for mode in MODES:
        out = coarse_served(w, w0, 16, mode, key=1)
        assert math.isnan(out[0]) and out[1] == math.inf and out[2] == 0.5
    for scale in (0, -4, 1.5, True, "16"):
        with pytest.raises(ValueError, match="integer >= 1"):
            coarse_served(w0, w0, scale, "nearest")
    with pytest.raises(ValueError, match="unknown emulated-grid rounding 'up'"):
        coarse_served(w0, w0, 16, "up")
    with pytest.raises(ValueError, match="needs a key"):
        coarse_served(w0, w0, 16, "stochastic")
    with pytest.raises(ValueError, match="differs from its step-0 shape"):
        coarse_served(w0[:2], w0, 16, "nearest")
    with pytest.raises(TypeError, match="fp32"):
        coarse_served(w0.double(), w0, 16, "nearest")
    with pytest.raises(ValueError, match="non-finite w0"):
        coarse_served(w0, torch.tensor([1.0, math.nan, 0.5]), 16, "nearest")


def test_coarse_arms_parse_and_bad_scales_get_a_clear_error():
    rtn, sr, aa = parse_arm("coarse-rtn@16"), parse_arm("coarse-sr@64@lr=1e-5"), parse_arm("coarse-sr-aa@16")
    assert (rtn.coarse, rtn.export, rtn.engine_dtype, rtn.faircast, rtn.lr) == (16, "coarse-nearest", "float32",
                                                                                False, None)
    assert (sr.coarse, sr.export, sr.lr, sr.faircast, sr.seed_offset) == (64, "coarse-stochastic", 1e-5, False, 0)
    assert (aa.coarse, aa.export, aa.seed_offset, aa.rollout_seed_offset) == (16, "coarse-stochastic",
                                                                              AA_SEED_OFFSET, 0)
    assert aa_twin("coarse-sr-aa@16") == "coarse-sr@16" and aa_twin("fp32-served-aa") == "fp32-served"
    assert aa_twin("coarse-sr@16") is None and aa_twin("faircast-aa@lr=1e-5") == "faircast@lr=1e-5"
    assert engine_record(rtn).startswith("emulated coarse grid S=16:") and "nearest_u" in engine_record(rtn)
    assert "stochastic_u" in engine_record(sr) and engine_record(parse_arm("fp32-served")) == "float32"
    assert parse_arm("fp32-served").coarse == 0
    for name, match in [("coarse-sr", "give the emulated grid's scale S, e.g. coarse-sr@16"),
                        ("coarse-rtn@lr=1e-4", "give the emulated grid's scale S"),
                        ("coarse-sr@0", "integer >= 1"), ("coarse-sr@1.5", "integer >= 1"),
                        ("coarse-rtn@x", "integer >= 1"), ("coarse-sr@16@32", "given twice"),
                        ("coarse-fc@16", "unknown A/B arm"), ("fp32-served@16", "unknown modifier")]:
        with pytest.raises(ValueError, match=match):
            parse_arm(name)


class _FakeTrainer:
    """What ``EngineExport`` touches: the step, the masters, and the engine-bound export TRL iterates."""

    def __init__(self, masters):
        self.masters = masters
        self.state = type("State", (), {"global_step": 0})()
        trainer = self

        class Generation:
            def _iter_named_params(self):  # TRL yields the (fp32) parameters; the arm's rule replaces them
                yield from ((n, t.clone()) for n, t in trainer.masters.items())

        self.vllm_generation = Generation()

    def sync(self, export, step):
        self.state.global_step = step
        return dict(export.iterate())  # EngineExport replaced the engine-bound iterator with this


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(run_one, "_masters", lambda trainer: trainer.masters)

    def make(arm_name, masters, seed=1000):
        trainer = _FakeTrainer(masters)
        arm = parse_arm(arm_name)
        return trainer, run_one.EngineExport(trainer, arm, seed + arm.seed_offset, audit_sample=4096)
    return make


@pytest.mark.parametrize("arm_name", ["coarse-rtn@16", "coarse-sr@16", "coarse-sr-aa@16"])
def test_engine_export_serves_the_emulated_copy_and_the_audit_sees_it(fake, arm_name):
    """Step 0: the engine gets w0 itself. Then 6 steps of a constant update of 0.05 u: coarse-rtn serves w0 all along
    (served_changed_frac 0, lag = the steps taken, as bf16 RTN does for 16x longer); coarse-sr serves exactly
    ``coarse_served`` under the arm's Fair Cast seed and step (its A/A twin under seed + 1000003) and lags ~0."""
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"]
    w0 = {n: bf16_start(3000, seed=i).view(60, 50) for i, n in enumerate(names)}
    masters = {n: t.clone() for n, t in w0.items()}
    trainer, export = fake(arm_name, masters)
    arm = parse_arm(arm_name)
    sent = trainer.sync(export, 0)
    assert all(torch.equal(bits(sent[n]), bits(w0[n])) for n in names)
    step_size = {n: 0.05 * 16 * ulp_bf16(w0[n]) for n in names}
    lags, changed = [], []
    for step in range(1, 7):
        for n in names:
            masters[n].copy_((w0[n].double() + step * step_size[n]).float())
        sent = trainer.sync(export, step)
        for n in names:
            assert sent[n].dtype == torch.float32 and torch.equal(sent[n], export.last_sent[names.index(n)][1])
            if arm.export == "coarse-nearest":
                assert torch.equal(bits(sent[n]), bits(w0[n]))
            else:
                key = derive_key(1000 + arm.seed_offset, step, n)
                assert torch.equal(sent[n], coarse_served(masters[n], w0[n], 16, "stochastic", key=key))
        m = export.metrics()
        lags.append(m["faircast/lag_steps"])
        changed.append(m["faircast/served_changed_frac"])
    if arm.export == "coarse-nearest":
        assert changed == [0.0] * 6 and lags == pytest.approx([1, 2, 3, 4, 5, 6], rel=1e-4)
    else:
        assert all(c > 0 for c in changed) and abs(sum(lags) / len(lags)) < 1.5


def test_engine_export_refuses_a_start_it_cannot_anchor(fake):
    trainer, export = fake("coarse-rtn@16", {"w": bf16_start(64)})
    with pytest.raises(RuntimeError, match="first weight sync came at step 3"):
        trainer.sync(export, 3)
    trainer, export = fake("coarse-sr@16", {"w": bf16_start(64) + 1e-5})
    with pytest.raises(ValueError, match="warm start on the bf16 grid"):
        trainer.sync(export, 0)


def test_report_of_the_preset_adjusts_its_family_and_finds_the_coarse_aa_twin(tmp_path):
    """The toy-coarse-grid preset's report (fake runs): the family member (coarse-sr - coarse-rtn) appears in the
    declared orientation with its Holm p; coarse-sr-aa@S is coarse-sr@S's A/A twin, beside the family."""
    from faircast_plugins.ab.protocol import METRICS, load
    from faircast_plugins.ab.report import build

    proto = load(preset="toy-coarse-grid")
    s = next(parse_arm(a).coarse for a in proto.arms if parse_arm(a).coarse)
    bumps = {f"coarse-rtn@{s}": 0.0, f"coarse-sr@{s}": 0.03, f"coarse-sr-aa@{s}": 0.0301, "fp32-served": 0.05}
    for arm in proto.arms:
        (tmp_path / "runs" / arm).mkdir(parents=True)
        for seed in proto.seeds:
            ev = [{"step": 300, **{m: 0.1 + bumps[arm] + 0.003 * (seed % 3) + 0.001 * (seed % 2) * (arm[-1] == "n")
                                   for m in METRICS}}]
            (tmp_path / "runs" / arm / f"seed{seed}.json").write_text(json.dumps(
                {"arm": arm, "seed": seed, "lr": 1e-4, "evals": ev, "steps": [{"step": 1, "reward": 0.1}]}))
    res = build(str(tmp_path), proto, {"path": proto.source, "sha256": "0" * 64}, None, [], {})
    rows = {(c["a"], c["b"]): c for c in res["comparisons"]["master_expected"]}
    primary = rows[(f"coarse-sr@{s}", f"coarse-rtn@{s}")]
    assert primary["mean_diff"] > 0 and primary["p_holm"] == pytest.approx(primary["t_p"])  # a family of one
    assert math.isnan(rows[(f"coarse-sr-aa@{s}", f"coarse-sr@{s}")]["p_holm"])  # beside the family, not in it
    report = (tmp_path / "report.md").read_text()
    assert f"A/A control (coarse-sr-aa@{s}: coarse-sr@{s} with another rounding seed)" in report


def test_toy_coarse_grid_is_protocol_7s_recipe_with_the_coarse_arms():
    """PROTOCOL-8's preset: PROTOCOL-7's recipe (toy-freshness-3) field for field, except the arms (one S for the
    coarse pair and its A/A twin, and the fresh reference), the seeds, the declared pairs and family, and one run at a
    time (workers: the results do not depend on it, each run being seeded and single-threaded)."""
    from faircast_plugins.ab.protocol import load

    seven, eight = load(preset="toy-freshness-3").as_dict(), load(preset="toy-coarse-grid").as_dict()
    assert {k for k in seven if seven[k] != eight[k]} == {"name", "description", "arms", "seeds", "pairs", "family",
                                                          "workers"}
    assert eight["description"].startswith("Pre-registered") and eight["workers"] == 1
    assert eight["arms"] == ["coarse-rtn@32", "coarse-sr@32", "fp32-served", "coarse-sr-aa@32"]
    assert eight["family"] == [["master_expected", "coarse-sr@32", "coarse-rtn@32"]]
    assert eight["seeds"] == list(range(110, 118)) and eight["equivalence_margin"] == 0.01
