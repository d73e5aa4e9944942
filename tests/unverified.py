"""Shared by each framework's doctor test: a release newer than the verified range, opted in with
FAIRCAST_ALLOW_UNVERIFIED, passes the adapter's real patch-set check only through a real `faircast doctor` run."""
from __future__ import annotations

import logging

from faircast_plugins import patching


def check_opt_in_runs_the_doctor(patch_set, newer: str, monkeypatch, caplog) -> None:
    real = patching.installed_version
    monkeypatch.setattr(patching, "installed_version",
                        lambda dist: newer if dist == patch_set.distribution else real(dist))
    monkeypatch.setattr(patching, "_passed", set())
    monkeypatch.setattr(patch_set, "version", patch_set.version)
    monkeypatch.setattr(patch_set, "verified", patch_set.verified)
    monkeypatch.delenv(patching.DOCTOR_ENV, raising=False)
    monkeypatch.delenv(patching.ALLOW_UNVERIFIED_ENV, raising=False)
    try:
        patch_set.check()
    except patching.FairCastPatchError as exc:  # negative control: refused without the opt-in
        assert f"{patching.ALLOW_UNVERIFIED_ENV}={patch_set.distribution}" in str(exc)
    else:
        raise AssertionError(f"{patch_set.distribution} {newer} was not refused without the opt-in")
    monkeypatch.setenv(patching.ALLOW_UNVERIFIED_ENV, patch_set.distribution)
    with caplog.at_level(logging.WARNING, logger="faircast_plugins"):
        assert patch_set.check() == newer  # runs `faircast doctor <distribution>` in a subprocess on this stack
    assert not patch_set.verified and patching._passed == {patch_set.distribution}
    assert f"UNVERIFIED: {patch_set.framework} {newer}" in caplog.text
