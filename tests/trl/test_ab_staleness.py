"""`python -m faircast_plugins.ab.staleness`: the statistics of TRL's importance weights, and the smoke preset end to
end (a tiny random model, synthetic masters; seconds). The real measurement is out of CI (~1 h)."""
from __future__ import annotations

import json
import math

import pytest

from faircast_plugins.ab.staleness import main, weight_stats


def test_weight_stats_say_what_trls_sequence_mask_does():
    r = weight_stats([math.log(4.0), 0.0])  # weights 4 and 1; TRL's cap is 3
    assert r["ess_fraction"] == pytest.approx(25 / 34)
    assert r["masked_fraction"] == 0.5 and r["masked_weight"] == pytest.approx(0.8)
    assert r["truncated_weight"] == pytest.approx(0.2) and r["ess_fraction_after_mask"] == pytest.approx(0.5)
    same = weight_stats([0.0] * 8)
    assert same["ess_fraction"] == 1.0 and same["sd_log_ratio"] == 0.0 and same["masked_weight"] == 0.0


def test_smoke_preset_measures_every_sampler_at_every_length(tmp_path):
    assert main(["--preset", "smoke", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    table = json.loads((tmp_path / "report" / "table.json").read_text())
    assert (tmp_path / "report" / "lengths.png").stat().st_size > 0
    by = res["times"]["2"]
    assert set(by) == {"master", "rtn", "sr", "stale", "frozen"}
    control = by["master"]["by_length"]["5"]
    assert control["sd_log_ratio"] == 0.0 and control["ess_fraction"] == 1.0  # the same forward on both sides
    # the synthetic masters drift linearly: the frozen sampler is further off than the stale one
    assert by["frozen"]["by_length"]["5"]["kl_per_token"] > by["stale"]["by_length"]["5"]["kl_per_token"] > 0
    assert len(table["rows"]) == 5 * 2
    prov = json.loads((tmp_path / "provenance-all.json").read_text())
    assert prov["started"] and "code" in prov and prov["preset"]["name"] == "smoke"
