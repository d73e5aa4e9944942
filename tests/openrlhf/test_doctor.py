"""`faircast doctor openrlhf` on this stack (DeepSpeed ZeRO-2 copy-back, CPU), as the opt-in for a newer OpenRLHF runs it."""
from faircast_plugins.openrlhf.policy import POLICY_PATCHES

from tests.unverified import check_opt_in_runs_the_doctor


def test_a_newer_openrlhf_runs_only_after_faircast_doctor_passes(monkeypatch, caplog):
    check_opt_in_runs_the_doctor(POLICY_PATCHES, "0.12.0", monkeypatch, caplog)
