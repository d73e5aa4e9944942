"""`faircast doctor verl` on this stack (FSDP2's patched cast, CPU), as the opt-in for a newer verl runs it."""
from faircast_plugins.verl.patches import PATCHES

from tests.unverified import check_opt_in_runs_the_doctor


def test_a_newer_verl_runs_only_after_faircast_doctor_passes(monkeypatch, caplog):
    check_opt_in_runs_the_doctor(PATCHES, "0.10.0", monkeypatch, caplog)
