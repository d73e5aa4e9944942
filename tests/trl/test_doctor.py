"""`faircast doctor trl` on this stack (tiny GRPO + TRL's export iterator, CPU), as the opt-in for a newer TRL runs it."""
from faircast_plugins.trl.patches import PATCHES

from tests.unverified import check_opt_in_runs_the_doctor


def test_a_newer_trl_runs_only_after_faircast_doctor_passes(monkeypatch, caplog):
    check_opt_in_runs_the_doctor(PATCHES, "1.17.0", monkeypatch, caplog)
