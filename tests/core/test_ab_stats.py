"""The A/B's statistics, arms, protocols and task files (no trainer needed)."""
from __future__ import annotations

import json
import math
import os

import pytest

from faircast_plugins.ab import stats
from faircast_plugins.ab.arms import AA_SEED_OFFSET, parse_arm
from faircast_plugins.ab.protocol import load, presets
from faircast_plugins.ab.task import add2_problems, load_jsonl, make_reward, task_problems
from faircast_plugins.cli import main as faircast


def test_sign_test_is_exact():
    assert stats.sign_test_p(6, 0) == pytest.approx(2 / 64)
    assert stats.sign_test_p(5, 0) == pytest.approx(2 / 32)
    assert stats.sign_test_p(3, 3) == 1.0
    assert stats.sign_test_p(0, 0) == 1.0
    assert stats.sign_test_p(9, 1) == pytest.approx(2 * 11 / 1024)


def test_compare_counts_wins_and_gives_a_bootstrap_interval_around_the_mean():
    values = {"a": {s: 0.5 + 0.01 * s + 0.002 for s in range(8)}, "b": {s: 0.5 + 0.01 * s for s in range(8)}}
    values["a"][3] = values["b"][3]  # one tie
    r = stats.compare("a", "b", values)
    assert (r.n, r.wins, r.ties, r.losses) == (8, 7, 1, 0)
    assert r.mean_diff == pytest.approx(0.002 * 7 / 8)
    assert r.ci_low <= r.mean_diff <= r.ci_high and not r.ci_contains_zero
    assert r.sign_p == pytest.approx(2 / 128)
    assert r.sd_a > 10 * r.sd_diff  # what pairing buys: the arms' spread dwarfs the paired differences'


def test_compare_uses_only_seeds_both_arms_ran_and_null_pairs_straddle_zero():
    values = {"a": {0: 1.0, 1: 2.0, 2: 0.0, 3: 5.0}, "b": {0: 2.0, 1: 1.0, 2: 1.0, 3: 4.0, 9: 0.0}}
    r = stats.compare("a", "b", values)
    assert r.n == 4 and r.ci_contains_zero and r.sign_p == 1.0
    with pytest.raises(ValueError, match="no results for arm 'c'"):
        stats.compare("c", "b", values)


def test_final_value_is_the_mean_of_the_last_fifth_of_points():
    pts = [(s, float(s)) for s in range(10, 110, 10)]  # 10 points: the last 2
    assert stats.final_value(pts) == 95.0
    assert stats.final_value(pts[:3]) == 30.0  # at least one point
    assert stats.final_value(list(reversed(pts))) == 95.0


def test_default_pairs_put_the_aa_control_first():
    pairs = stats.default_pairs(["standard", "faircast", "faircast-aa", "fp32-served"])
    assert pairs == [("faircast-aa", "faircast"), ("faircast", "standard"), ("fp32-served", "standard")]


@pytest.mark.parametrize("name", ["standard", "faircast", "faircast-ef", "fp32-served", "fp32-delayed@20",
                                  "standard@lr=3e-6", "faircast@lr=1e-7", "export-only", "loss-only", "faircast-aa",
                                  "sticky", "fp32-frozen"])
def test_arms_parse(name):
    assert parse_arm(name).name == name


def test_arm_semantics():
    assert parse_arm("fp32-delayed@20").delay == 20 and parse_arm("fp32-delayed@20").engine_dtype == "float32"
    assert parse_arm("fp32-frozen").frozen and parse_arm("fp32-frozen").engine_dtype == "float32"
    assert not parse_arm("fp32-frozen").faircast and parse_arm("fp32-frozen@lr=1e-5").lr == 1e-5
    assert parse_arm("standard@lr=3e-6").lr == 3e-6 and not parse_arm("standard@lr=3e-6").faircast
    assert parse_arm("faircast-aa").seed_offset == AA_SEED_OFFSET
    assert parse_arm("loss-only").faircast and parse_arm("loss-only").mode == "nearest"
    assert not parse_arm("export-only").faircast and parse_arm("export-only").export == "stochastic"


@pytest.mark.parametrize("name, match", [
    ("nope", "unknown A/B arm 'nope'"), ("standard@lr=x", "not lr=<number>"), ("standard@lr=-1", "must be > 0"),
    ("fp32-delayed", "give the delay"), ("standard@7", "unknown modifier"), ("", "non-empty"),
])
def test_bad_arms_get_a_clear_error(name, match):
    with pytest.raises(ValueError, match=match):
        parse_arm(name)


def test_presets_load_and_bad_protocols_are_refused(tmp_path):
    assert {"smoke", "cpu"} <= set(presets())
    for name in presets():
        proto = load(preset=name)
        # every preset compares against the standard export, except a one-arm structure smoke (smollm2-smoke) and a
        # freshness positive control (toy-freshness: fp32 samplers only, the fresh one its baseline)
        assert ("standard" in proto.arms or len(proto.arms) == 1 or proto.baseline == "fp32-served")
        assert proto.source.endswith(name + ".json")
    with pytest.raises(ValueError, match="unknown A/B preset 'huge'"):
        load(preset="huge")
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"name": "x", "arms": ["standard"], "stepz": 3}))
    with pytest.raises(ValueError, match="unknown protocol field"):
        load(path=str(bad))
    bad.write_text(json.dumps({"name": "x", "arms": ["standard", "bogus"]}))
    with pytest.raises(ValueError, match="unknown A/B arm 'bogus'"):
        load(path=str(bad))
    assert load(preset="smoke", steps=9).steps == 9
    subset = load(preset="cpu", arms=["standard", "faircast", "export-only"])  # as docs/ab.md shows
    assert subset.pairs == [["faircast", "export-only"]]
    bad.write_text(json.dumps({"name": "x", "task": "chess"}))
    with pytest.raises(ValueError, match="unknown A/B task 'chess'"):
        load(path=str(bad))


def test_add2_task_and_reward():
    train, held = add2_problems(seed=0, heldout=1000)
    assert len(train) == 9000 and len(held) == 1000 and not {p.prompt for p in train} & {p.prompt for p in held}
    p = held[0]
    a, b = map(int, p.prompt[:-1].split("+"))
    assert p.answer == f"{a + b:03d}"
    reward = make_reward({p.prompt: p.answer})
    assert reward([p.prompt, p.prompt], [p.answer, "000" if p.answer != "000" else "001"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="unknown A/B task 'chess'"):
        task_problems("chess")


def test_jsonl_dataset_needs_prompt_and_answer(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(10)))
    train, held = load_jsonl(str(good), heldout=3)
    assert len(train) == 7 and len(held) == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "q", "solution": "1"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: .*'prompt' and 'answer'.*answer"):
        load_jsonl(str(bad), heldout=0)
    with pytest.raises(ValueError, match="holds out 10"):
        load_jsonl(str(good), heldout=10)
    with pytest.raises(FileNotFoundError):
        load_jsonl(str(tmp_path / "none.jsonl"), heldout=1)


def _write_run(path, values, fmt):
    if fmt == "csv":
        path.write_text("step,eval/success,faircast/lag_steps\n" + "".join(f"{s},{v},{l}\n" for s, v, l in values))
    else:
        path.write_text("".join(json.dumps({"trainer/global_step": s, "eval/success": v, "faircast/lag_steps": l,
                                            "reward": 0.002 * s}) + "\n" for s, v, l in values))


def test_ab_stats_reads_runs_from_a_logger(tmp_path, capsys):
    runs = []
    for seed in range(6):
        for arm, bump, fmt in (("standard", 0.0, "jsonl"), ("faircast", 0.01, "csv")):
            f = tmp_path / f"{arm}{seed}.{fmt}"
            _write_run(f, [(s, 0.3 + 0.001 * s + 0.01 * seed + bump, 10.0 if arm == "standard" else 0.0)
                           for s in range(0, 600, 10)], fmt)
            runs += ["--run", f"{arm}:{seed}:{f}"]
    assert faircast(["ab-stats", "--metric", "eval/success", *runs]) == 0
    out = capsys.readouterr().out
    assert "| faircast vs standard | 6 | +0.010 | [+0.010, +0.010] |" in out and "| 6/0/0 | 0.0312 (0.031) |" in out
    assert "Primary: the paired t-test" in out
    assert "standard: 6 seeds" in out and "lag 10.0 steps" in out
    assert "lag cost +0.0200 reward" in out  # lag 10 x reward slope 0.002 per step (the jsonl runs log a reward)


def test_ab_stats_splits_the_learning_effect_from_the_readout_effect(tmp_path, capsys):
    """Where the runs logged their master's evaluation too: same masters in both arms (no learning effect), the
    standard arm's served copy 0.004 below its master (a readout effect)."""
    runs = []
    for seed in range(6):
        for arm, lag in (("standard", 0.004), ("faircast", 0.0)):
            f = tmp_path / f"{arm}{seed}.jsonl"
            f.write_text("".join(json.dumps({"step": s, "eval/master": 0.3 + 0.001 * s + 0.01 * seed,
                                             "eval/served": 0.3 + 0.001 * s + 0.01 * seed - lag}) + "\n"
                                 for s in range(0, 100, 10)))
            runs += ["--run", f"{arm}:{seed}:{f}"]
    assert faircast(["ab-stats", "--metric", "eval/served", "--master-metric", "eval/master", *runs]) == 0
    out = capsys.readouterr().out
    learning, readout = out.split("Learning effect")[1].split("Readout effect")
    assert "| faircast vs standard | 6 | +0.000 | [+0.000, +0.000] | 1.000 |" in learning and "| 0/6/0 |" in learning
    assert "| faircast vs standard | 6 | +0.004 |" in readout and "standard: 6 seeds, mean -0.0040" in readout
    with pytest.raises(SystemExit, match="no values of 'eval/none'"):
        faircast(["ab-stats", "--metric", "eval/served", "--master-metric", "eval/none", *runs])


def test_protocol_names_its_compute_and_grpo_knobs(tmp_path):
    """A protocol must say how the trainer computes (never a framework default); the GRPO knobs are checked."""
    base = {"name": "x", "arms": ["standard"], "compute": "fp32"}
    f = tmp_path / "p.json"
    f.write_text(json.dumps({k: v for k, v in base.items() if k != "compute"}))
    with pytest.raises(ValueError, match="compute must be one of bf16-autocast, fp32"):
        load(path=str(f))
    for bad, match in (({"compute": "bf16"}, "compute must be one of"), ({"lr_schedule": "step"}, "lr_schedule"),
                       ({"num_iterations": 0}, "num_iterations"), ({"epsilon": 1.5}, "epsilon"),
                       ({"readouts": False, "metric": "sr_expected"}, "needs readouts")):
        f.write_text(json.dumps({**base, **bad}))
        with pytest.raises(ValueError, match=match):
            load(path=str(f))
    f.write_text(json.dumps({**base, "num_iterations": 4, "lr_schedule": "cosine", "metric": "sr_expected"}))
    proto = load(path=str(f))
    assert proto.num_iterations == 4 and proto.compute == "fp32"
    assert load(preset="cpu").compute == "bf16-autocast"  # what the committed CPU run ran under (TRL's bf16 default)


def test_exploration_protocols_load_and_say_they_are_exploration():
    import glob
    import os

    root = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "ab", "explore")
    files = sorted(glob.glob(os.path.join(root, "*.json")))
    assert len(files) >= 8
    for path in files:
        proto = load(path=path)
        assert proto.description.startswith("EXPLORATION") and proto.compute in ("bf16-autocast", "fp32"), path
        assert os.path.basename(path) == proto.name + ".json"


def test_longer_addition_tasks():
    for task, digits in (("add3", 3), ("add4", 4)):
        train, held = task_problems(task, seed=0, heldout=500)
        assert len(train) + len(held) == 20_000 and not {p.prompt for p in train} & {p.prompt for p in held}
        for p in held[:50]:
            a, b = map(int, p.prompt[:-1].split("+"))
            assert len(p.prompt) == 2 * digits + 2 and p.answer == f"{a + b:0{digits + 1}d}"
        assert task_problems(task, seed=0, heldout=500)[1] == held  # the same draw every time


def test_code_provenance_names_the_commit_and_dirty_state():
    from faircast_plugins.ab.provenance import code_provenance, versions

    code = code_provenance()
    assert set(code) == {"commit", "dirty", "changed", "untracked"}
    if code["commit"] is not None:  # run from a checkout (not from the installed wheel)
        assert len(code["commit"]) == 40 and isinstance(code["dirty"], bool)
    assert "torch" in versions()


def test_ab_stats_bad_input_is_a_clear_error(tmp_path):
    f = tmp_path / "r.jsonl"
    _write_run(f, [(0, 0.1, 0.0)], "jsonl")
    with pytest.raises(SystemExit, match="no values of 'eval/acc'"):
        faircast(["ab-stats", "--metric", "eval/acc", "--run", f"standard:0:{f}"])
    with pytest.raises(SystemExit, match="ARM:SEED:FILE"):
        faircast(["ab-stats", "--metric", "eval/success", "--run", f"standard:{f}"])
    with pytest.raises(SystemExit, match="two results for arm 'standard' seed 0"):
        faircast(["ab-stats", "--metric", "eval/success", "--run", f"standard:0:{f}", "--run", f"standard:0:{f}"])
    with pytest.raises(SystemExit, match="does not exist"):
        faircast(["ab-stats", "--metric", "x", "--run", f"standard:0:{tmp_path}/none.jsonl"])
    with pytest.raises(SystemExit, match="unknown A/B preset"):
        faircast(["ab", "--preset", "huge"])
    with pytest.raises(SystemExit, match="unknown A/B arm"):
        faircast(["ab", "--preset", "smoke", "--arms", "standard,bogus"])
    with pytest.raises(SystemExit, match="--dataset needs --model"):
        faircast(["ab", "--preset", "smoke", "--dataset", str(f)])
    assert math.isnan(stats.bootstrap_ci([])[0])


# -- statistics for few seeds (issue #28): reference values from scipy 1.17.1 -------------------------------------
D6 = [0.012, -0.004, 0.020, 0.009, 0.015, 0.003]


def test_t_distribution_matches_scipy():
    assert stats.t_cdf(-2.5, 3) == pytest.approx(0.04385332350403278, abs=1e-13)  # scipy.stats.t.cdf
    assert stats.t_cdf(1.3, 30) == pytest.approx(0.8982495207309416, abs=1e-13)
    assert stats.t_ppf(0.975, 3) == pytest.approx(3.1824463052837078, abs=1e-10)  # scipy.stats.t.ppf
    assert stats.t_ppf(0.8, 5) == pytest.approx(0.9195437802408271, abs=1e-10)
    assert stats.t_cdf(0.0, 4) == 0.5 and stats.t_cdf(math.inf, 4) == 1.0


def test_paired_t_matches_scipy_ttest_1samp():
    t, p, lo, hi = stats.paired_t(D6)
    assert t == pytest.approx(2.6072500472698747, rel=1e-12)     # scipy.stats.ttest_1samp(D6, 0)
    assert p == pytest.approx(0.047828429596299196, rel=1e-9)
    assert (lo, hi) == pytest.approx((0.00012891946196706174, 0.018204413871366273), rel=1e-8)  # t.interval


def test_tost_matches_two_one_sided_scipy_tests():
    # max(ttest_1samp(D6, -0.02, alternative="greater"), ttest_1samp(D6, 0.02, alternative="less")).pvalue
    assert stats.tost_p(D6, 0.02) == pytest.approx(0.013714612661396652, rel=1e-9)
    assert stats.tost_p(D6, 0.001) > 0.5  # a margin inside the effect: equivalence not shown
    r = stats.compare("a", "b", {"a": dict(enumerate(D6)), "b": dict.fromkeys(range(6), 0.0)}, margin=0.02)
    assert r.equivalent is True and stats.compare("a", "b", {"a": {0: 1.0, 1: 2.0}, "b": {0: 0.0, 1: 0.0}}).equivalent is None


def test_holm_by_hand():
    # sorted 0.01, 0.03, 0.04 -> 3 x 0.01, max(0.03, 2 x 0.03), max(0.06, 1 x 0.04); NaN stays out of the family
    assert stats.holm([0.01, 0.04, 0.03, float("nan")])[:3] == pytest.approx([0.03, 0.06, 0.06])
    assert math.isnan(stats.holm([0.01, float("nan")])[1]) and stats.holm([0.6, 0.7]) == pytest.approx([1.0, 1.0])


def test_limits_of_the_secondary_tests_at_few_seeds():
    assert stats.sign_test_floor(4) == 0.125 and stats.sign_test_floor(6) == pytest.approx(0.03125)
    # the percentile bootstrap's real coverage: P(|T_{n-1}| < 1.96 sqrt((n-1)/n)); the audit's exact enumeration at
    # n = 4 found it excludes 0 19.8% of the time under the null
    assert stats.bootstrap_coverage(4) == pytest.approx(0.812, abs=0.002)
    assert 0.86 < stats.bootstrap_coverage(6) < 0.87 and stats.bootstrap_coverage(100) > 0.945


def test_minimum_detectable_effect():
    # (t_.975,3 + t_.80,3) / sqrt(4) = (3.18245 + 0.97847) / 2 per unit sd (the exact noncentral-t value is 2.128)
    assert stats.mde(1.0, 4) == pytest.approx((3.1824463052837078 + 0.9784723123633045) / 2, rel=1e-9)
    assert stats.mde(0.5, 4) == pytest.approx(stats.mde(1.0, 4) / 2) and math.isnan(stats.mde(1.0, 1))


def test_family_adjustment_touches_only_its_members():
    values = {"a": dict(enumerate(D6)), "b": dict.fromkeys(range(6), 0.0), "c": {s: 0.001 * s for s in range(6)}}
    rs = [stats.compare("a", "b", values), stats.compare("c", "b", values), stats.compare("a", "c", values)]
    stats.adjust_family(rs, family=[("a", "b"), ("c", "b")])
    assert rs[0].p_holm == pytest.approx(max(2 * min(rs[0].t_p, rs[1].t_p), min(rs[0].t_p, rs[1].t_p)) if
                                         rs[0].t_p < rs[1].t_p else max(rs[0].t_p, 2 * rs[1].t_p))
    assert math.isnan(rs[2].p_holm) and "(not in family)" in stats.table(rs)


def test_old_results_json_rows_still_render():
    """Reports of runs made before the t-test fields existed: the new columns stay empty, nothing breaks."""
    old = {"a": "faircast", "b": "standard", "n": 4, "wins": 4, "ties": 0, "losses": 0, "mean_diff": 0.004,
           "ci_low": 0.003, "ci_high": 0.005, "sign_p": 0.125, "sd_diff": 0.0002, "sd_a": 0.001, "sd_b": 0.001,
           "mean_a": 0.37, "mean_b": 0.366, "ci_contains_zero": False}
    assert "| faircast vs standard | 4 | +0.400 | [, ] |" in stats.table([stats.PairResult.from_dict(old)])


def test_protocol_family_and_margin_are_checked(tmp_path):
    base = {"name": "x", "arms": ["standard", "faircast"], "compute": "fp32"}
    f = tmp_path / "p.json"
    f.write_text(json.dumps({**base, "family": [["master_expected", "faircast", "standard"]],
                             "equivalence_margin": 0.002}))
    proto = load(path=str(f))
    assert proto.family == [["master_expected", "faircast", "standard"]] and proto.equivalence_margin == 0.002
    for bad, match in (({"family": [["faircast", "standard"]]}, "must be \\[metric, arm A, arm B\\]"),
                       ({"family": [["nope", "faircast", "standard"]]}, "must be"),
                       ({"equivalence_margin": -1}, "positive number")):
        f.write_text(json.dumps({**base, **bad}))
        with pytest.raises(ValueError, match=match):
            load(path=str(f))


def test_word2_task_has_a_fixed_answer_format_and_a_disjoint_heldout_set():
    from faircast_plugins.ab.task import success, word2_answer, word2_problems

    train, held = word2_problems(seed=0, heldout=200, count=2000)
    assert len(train) == 1800 and not {p.prompt for p in train} & {p.prompt for p in held}
    assert word2_problems(seed=0, heldout=200, count=2000)[1] == held  # the same draw every time
    for p in held:
        body = p.prompt.rsplit("Problem: ", 1)[1]
        nums = [int(t) for t in body.replace("?", " ").replace(".", " ").split() if t.isdigit()]
        a, b, c = nums
        total = a + b * c if " buys " in body else a - b * c
        assert p.answer == f" {b} * {c} = {b * c}. {a} {'+' if ' buys ' in body else '-'} {b * c} = {total}. Answer: {total}\n"
        assert total > 0 and word2_answer(p.answer) == total and p.prompt.endswith("\nSolution:")
    ans = held[0].answer
    assert success(ans + "Problem: ...", ans) and success("  " + ans, ans)
    assert not success(ans.rstrip("\n") + "7\n", ans)  # "Answer: 634" is not "Answer: 63"
    assert task_problems("word2", seed=0, heldout=100)[1][0].prompt == word2_problems(0, 100)[1][0].prompt


def test_word2z_is_word2_without_the_worked_examples():
    from faircast_plugins.ab.task import WORD2_EXAMPLES

    w2, w2z = task_problems("word2", seed=0, heldout=50), task_problems("word2z", seed=0, heldout=50)
    for few, zero in zip(w2[1] + w2[0][:50], w2z[1] + w2z[0][:50]):
        assert few.prompt == WORD2_EXAMPLES + zero.prompt and few.answer == zero.answer
        assert zero.prompt.startswith("Problem: ") and zero.prompt.count("Problem: ") == 1


def test_protocol_sft_needs_a_model_and_checks_its_fields(tmp_path):
    base = {"name": "x", "compute": "fp32", "task": "word2z", "model": "smollm2",
            "sft": {"steps": 3, "batch": 2, "lr": 1e-5, "seed": 1, "rounding": "nearest"}}
    f = tmp_path / "p.json"
    f.write_text(json.dumps(base))
    proto = load(path=str(f))
    assert proto.sft.steps == 3 and proto.as_dict()["sft"] == base["sft"]
    for bad, match in (({"model": None}, "needs model"), ({"sft": {"steps": 0}}, "sft.steps"),
                       ({"sft": {"lr": -1}}, "sft.lr"), ({"sft": {"epochs": 2}}, "unknown protocol sft field"),
                       ({"sft": {"rounding": "sticky"}}, "sft.rounding")):
        f.write_text(json.dumps({**base, **bad}))
        with pytest.raises(ValueError, match=match):
            load(path=str(f))


def test_finetune_warm_start_trains_saves_bf16_and_is_cached(tmp_path):
    """The SFT warm start of a pretrained model, on a tiny saved Qwen3 standing in for it: trained on the training
    problems only, saved in bf16 with its tokenizer and scores, then reused from the cache."""
    import torch
    from transformers import AutoModelForCausalLM

    from faircast_plugins.ab.task import build_char_tokenizer
    from faircast_plugins.ab.warmstart import FinetuneSpec, WarmStartSpec, build_model, finetune_warm_start

    base = tmp_path / "tiny-base"
    tok = build_char_tokenizer(str(base))
    build_model(WarmStartSpec(hidden_size=32, layers=1, heads=2), len(tok)).to(torch.bfloat16).save_pretrained(base)
    train, held = task_problems("add2", seed=0, heldout=20)
    spec = FinetuneSpec(steps=6, batch=8, lr=1e-3, seed=0)
    logs = []
    path = finetune_warm_start(str(tmp_path / "cache"), str(base), "add2", train, held, spec, logs.append)
    info = json.load(open(os.path.join(path, "warmstart.json")))
    assert info["base"] == "tiny-base" and len(info["losses"]) == 6 and info["losses"][-1] < info["losses"][0]
    for k in ("base", "fp32", "nearest", "stochastic", "bf16"):
        assert 0 <= info[f"heldout_{k}"]["expected"] <= 1, k
    assert info["heldout_bf16"] == info["heldout_stochastic"]  # the default: the package's stochastic export
    model = AutoModelForCausalLM.from_pretrained(path)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    manifest = json.load(open(os.path.join(path, "faircast_manifest.json")))
    assert manifest["mode"] == "stochastic" and manifest["seed"] == 0 and manifest["version"] == 0
    assert os.path.isfile(os.path.join(path, "tokenizer.json"))
    logs.clear()
    assert finetune_warm_start(str(tmp_path / "cache"), str(base), "add2", train, held, spec, logs.append) == path
    assert logs == []  # cached: not built again
    other = finetune_warm_start(str(tmp_path / "cache"), str(base), "add2", train, held,
                                FinetuneSpec(steps=1, batch=8, lr=1e-3, seed=0), logs.append)
    assert other != path


def test_grid_records_retries_and_resumes(tmp_path):
    """A run that fails once is retried and the retry is on record; a second invocation resumes past it, on record."""
    from faircast_plugins.ab.runner import Grid, spec_digest

    fake = tmp_path / "fake_python"  # stands in for `python -m faircast_plugins.ab.run_one SPEC OUT`
    fake.write_text("#!/bin/sh\nmark=\"$4.tried\"\nif [ ! -e \"$mark\" ]; then touch \"$mark\"; exit 3; fi\n"
                    "python3 -c \"import json,sys; s=json.load(open(sys.argv[1])); "
                    "json.dump({'spec': s}, open(sys.argv[2], 'w'))\" \"$3\" \"$4\"\n")
    fake.chmod(0o755)
    spec = {"arm": "standard", "seed": 0, "threads": 1}
    grid = Grid(str(tmp_path), 1, log=lambda m: None, python=str(fake))
    seen = []
    assert grid.run({"standard seed 0": spec}, on_start=seen.append) == []
    assert seen == [[]] and grid.ran == ["standard seed 0"]
    assert [(r["run"], r["exit"]) for r in grid.retries] == [("standard seed 0", 3)]
    assert (tmp_path / "runs/standard/seed0.failed.log").exists()
    with open(tmp_path / "runs/standard/seed0.json") as f:
        assert json.load(f)["spec"]["digest"] == spec_digest(spec)
    again = Grid(str(tmp_path), 1, log=lambda m: None, python=str(fake))
    assert again.run({"standard seed 0": spec}, on_start=seen.append) == [] and seen[-1] == ["standard seed 0"]
    assert again.ran == [] and again.retries == []


def test_code_provenance_counts_untracked_files_as_dirty(tmp_path, monkeypatch):
    import subprocess

    from faircast_plugins.ab import provenance

    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (repo / "pkg" / "a.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "c")
    monkeypatch.setattr(provenance, "PACKAGE_DIR", str(repo / "pkg"))
    assert provenance.code_provenance()["dirty"] is False
    (repo / "pkg" / "new.py").write_text("y = 2\n")
    code = provenance.code_provenance()
    assert code["dirty"] is True and code["untracked"] == ["pkg/new.py"] and code["changed"] == []


def test_report_uses_the_t_test_holm_family_margin_and_records_sessions(tmp_path):
    """The A/B report from run records alone (no trainer): the declared family is Holm-adjusted, the margin gives
    TOST, the sessions (with their retries) are in results.json and the report."""
    from faircast_plugins.ab.protocol import METRICS
    from faircast_plugins.ab.report import build

    f = tmp_path / "p.json"
    f.write_text(json.dumps({"name": "t", "compute": "fp32", "arms": ["standard", "faircast", "faircast-aa"],
                             "seeds": [0, 1, 2, 3], "family": [["master_expected", "faircast", "standard"]],
                             "equivalence_margin": 0.002}))
    proto = load(path=str(f))
    for arm, bump in (("standard", 0.0), ("faircast", 0.004), ("faircast-aa", 0.0041)):
        (tmp_path / "runs" / arm).mkdir(parents=True)
        for seed in proto.seeds:
            ev = [{"step": st, **{m: 0.3 + bump + 0.001 * seed + 0.0001 * (seed % 2) * (arm == "faircast")
                                  for m in METRICS}} for st in (10, 20)]
            (tmp_path / "runs" / arm / f"seed{seed}.json").write_text(json.dumps(
                {"arm": arm, "seed": seed, "lr": 1e-6, "evals": ev, "steps": [{"step": 1, "reward": 0.1}]}))
    sessions = [{"started": "2026-12-04T16:00:00+00:00", "code": {"commit": "abc", "dirty": True},
                 "resumed_past": [], "ran": ["standard seed 0"], "failed": [],
                 "retries": [{"run": "standard seed 0", "exit": 3, "log": "x.failed.log", "at": "t"}]}]
    (tmp_path / "sessions.json").write_text(json.dumps(sessions))
    res = build(str(tmp_path), proto, {"path": str(f), "sha256": "0" * 64}, None, [],
                {"started": "2026-12-04T16:00:00+00:00", "code": {"commit": "abc", "dirty": True}})
    rows = {(m, c["a"], c["b"]): c for m, cs in res["comparisons"].items() for c in cs}
    fam = rows[("master_expected", "faircast", "standard")]
    assert fam["p_holm"] == pytest.approx(fam["t_p"]) and fam["margin"] == 0.002 and fam["equivalent"] is False
    assert math.isnan(rows[("served_expected", "faircast", "standard")]["p_holm"])  # not in the declared family
    assert res["family"]["declared"] and res["retries"][0]["exit"] == 3
    report = (tmp_path / "report.md").read_text()
    assert "started 2026-12-04T16:00:00+00:00" in report and "1 retried" in report and "standard seed 0 (exit 3" in report
    assert "pre-declared in the protocol" in report and "TOST" in report and "95% CI (paired t)" in report


def test_report_orients_pairs_as_the_family_declares_and_finds_the_aa_twin(tmp_path):
    """A family declared as [metric, fresh, stale] (the baseline first, as PROTOCOL-7 declares it) is reported in that
    orientation and Holm-adjusted (the default pairs put the baseline second: the member was missed before); an arm
    named ``<arm>-aa`` is that arm's A/A twin and gets the A/A paragraph."""
    from faircast_plugins.ab.protocol import METRICS
    from faircast_plugins.ab.report import build

    f = tmp_path / "p.json"
    arms = ["fp32-served", "fp32-frozen", "fp32-delayed@10", "fp32-served-aa"]
    f.write_text(json.dumps({"name": "t", "compute": "fp32", "arms": arms, "baseline": "fp32-served", "seeds": [0, 1, 2],
                             "family": [["master_expected", "fp32-served", "fp32-frozen"], ["master_expected", "fp32-served", "fp32-delayed@10"]]}))
    proto = load(path=str(f))
    for arm, bump in (("fp32-served", 0.05), ("fp32-frozen", 0.0), ("fp32-delayed@10", 0.04), ("fp32-served-aa", 0.0501)):
        (tmp_path / "runs" / arm).mkdir(parents=True)
        for seed in proto.seeds:
            ev = [{"step": 10, **{m: 0.1 + bump + 0.003 * seed * (arm != "fp32-frozen") for m in METRICS}}]
            (tmp_path / "runs" / arm / f"seed{seed}.json").write_text(json.dumps(
                {"arm": arm, "seed": seed, "lr": 1e-4, "evals": ev, "steps": [{"step": 1, "reward": 0.1}]}))
    res = build(str(tmp_path), proto, {"path": str(f), "sha256": "0" * 64}, None, [], {})
    rows = {(m, c["a"], c["b"]): c for m, cs in res["comparisons"].items() for c in cs}
    fam = [rows[("master_expected", "fp32-served", b)] for b in ("fp32-frozen", "fp32-delayed@10")]
    assert fam[0]["mean_diff"] == pytest.approx(0.053) and fam[0]["mean_diff"] > 0  # fresh - frozen, as declared
    assert all(not math.isnan(r["p_holm"]) for r in fam)  # both members adjusted
    assert ("master_expected", "fp32-frozen", "fp32-served") not in rows  # not also the other way round
    assert ("master_expected", "fp32-served-aa", "fp32-served") in rows  # the A/A as before
    report = (tmp_path / "report.md").read_text()
    assert "A/A control (fp32-served-aa: fp32-served with other draws)" in report


def test_masters_load_into_a_tied_model_and_nothing_else_may_be_missing():
    """SmolLM2 ties lm_head to the embedding: the masters (named once) load, a truly missing tensor is refused."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from faircast_plugins.ab.run_one import load_masters

    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg)
    masters = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters()}
    assert "lm_head.weight" not in masters
    load_masters(model, masters)
    assert float(model.lm_head.weight.mean()) == 0.5
    masters.pop("model.norm.weight")
    with pytest.raises(RuntimeError, match="missing \\['model.norm.weight'\\]"):
        load_masters(model, masters)


def test_ab_stats_margin_adds_the_equivalence_test(tmp_path, capsys):
    runs = []
    for seed in range(4):
        for arm, bump in (("standard", 0.0), ("faircast", 0.0001 * (seed % 2))):
            f = tmp_path / f"{arm}{seed}.jsonl"
            f.write_text("".join(json.dumps({"step": s, "acc": 0.3 + 0.01 * seed + bump}) + "\n" for s in range(5)))
            runs += ["--run", f"{arm}:{seed}:{f}"]
    assert faircast(["ab-stats", "--metric", "acc", "--margin", "0.01", *runs]) == 0
    out = capsys.readouterr().out
    assert "equivalent within ±0.01 (TOST p)" in out and "| yes (" in out
    with pytest.raises(SystemExit, match="--margin must be > 0"):
        faircast(["ab-stats", "--metric", "acc", "--margin", "0", *runs])


def test_the_report_says_how_a_run_differs_from_its_committed_protocol():
    from faircast_plugins.ab.report import _protocol_status

    assert _protocol_status({"committed_unchanged": True}) == ""
    # a declared stage (PROTOCOL-4's stage A is `--arms fp32-served,fp32-frozen`): the file is the committed one
    stage = _protocol_status({"committed_unchanged": False, "file_committed_unchanged": True, "overrides": ["arms"]})
    assert "committed unchanged" in stage and "overrides of arms" in stage and "declares this run" in stage
    # an edited or uncommitted file
    assert "not committed as run" in _protocol_status({"committed_unchanged": False, "overrides": ["arms"]})
    assert "not committed as run" in _protocol_status({"committed_unchanged": False})


def test_toy_freshness_2_amends_protocol_5_only_where_protocol_6_says():
    """PROTOCOL-6 (toy-freshness-2) keeps PROTOCOL-5's design: only the warm start's SFT steps, the split of the 128
    completions per step, the learning rate (its calibration) and the seeds (new) may differ."""
    old, new = load(preset="toy-freshness").as_dict(), load(preset="toy-freshness-2").as_dict()
    amended = {"name", "description", "seeds", "prompts_per_step", "generations", "lr"}
    assert {k for k in old if old[k] != new[k]} <= amended | {"warmstart"}
    assert {k for k in old["warmstart"] if old["warmstart"][k] != new["warmstart"][k]} <= {"sft_steps"}
    assert 100 <= new["warmstart"]["sft_steps"] <= 175
    assert new["prompts_per_step"] * new["generations"] == 128 and new["lr"] in (1e-4, 2e-4)
    assert len(new["seeds"]) == 8 and not set(new["seeds"]) & (set(old["seeds"]) | {1000})


def test_toy_freshness_3_is_protocol_6s_design_at_its_calibrated_values():
    """PROTOCOL-7 (toy-freshness-3) runs PROTOCOL-6's design (toy-freshness-2, which holds C1's pick and C2's try 1)
    without the tripling gate: every field but the name and the description is the same."""
    two, three = load(preset="toy-freshness-2").as_dict(), load(preset="toy-freshness-3").as_dict()
    assert {k for k in two if two[k] != three[k]} == {"name", "description"}
    assert (three["warmstart"]["sft_steps"], three["prompts_per_step"], three["generations"], three["lr"]) == \
        (125, 16, 8, 1e-4)
