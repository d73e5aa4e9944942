"""Framework drift: newer releases are refused unless FAIRCAST_ALLOW_UNVERIFIED names them, and then only when every
patch target resolves and the ``faircast doctor`` self-check passes on this stack."""
import logging
import subprocess

import pytest

from faircast_plugins import doctor, patching
from faircast_plugins.patching import ALLOW_UNVERIFIED_ENV, DOCTOR_ENV, FairCastPatchError, PatchSet


class Target:
    def method(self):
        return "original"


@pytest.fixture
def newer_torch(monkeypatch):
    """The installed torch looks like a release above the verified range; no self-check has passed yet."""
    monkeypatch.setattr(patching, "installed_version", lambda dist: "2.99.0" if dist == "torch" else None)
    monkeypatch.setattr(patching, "_passed", set())
    monkeypatch.delenv(ALLOW_UNVERIFIED_ENV, raising=False)
    monkeypatch.delenv(DOCTOR_ENV, raising=False)
    monkeypatch.setenv("RANK", "3")  # as under a launcher: the self-check must not join its process group
    yield
    assert Target().method() == "original"


def _patch_set(*extra_targets):
    ps = PatchSet("torch FSDP", "torch", ">=2.11,<2.15").wrap(f"{__name__}:Target.method", lambda o: lambda self: "patched")
    for t in extra_targets:
        ps.wrap(t, lambda o: o)
    return ps


def _fake_doctor(monkeypatch, returncode, output=""):
    calls = []

    def run(cmd, **kwargs):
        calls.append((cmd, kwargs["env"]))
        return subprocess.CompletedProcess(cmd, returncode, stdout=output, stderr="")

    monkeypatch.setattr(patching.subprocess, "run", run)
    return calls


def test_a_newer_release_is_refused_by_default_naming_the_opt_in(newer_torch, monkeypatch):
    calls = _fake_doctor(monkeypatch, 0)
    ps = _patch_set()
    with pytest.raises(FairCastPatchError, match=f"installed torch is 2.99.0.*{ALLOW_UNVERIFIED_ENV}=torch.*faircast doctor torch"):
        ps.apply()
    assert not ps.active and not calls and Target().method() == "original"


def test_an_opt_in_for_another_framework_does_not_allow_this_one(newer_torch, monkeypatch):
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "trl,verl")
    with pytest.raises(FairCastPatchError, match="installed torch is 2.99.0"):
        _patch_set().apply()


def test_an_older_release_is_refused_even_with_the_opt_in(newer_torch, monkeypatch):
    monkeypatch.setattr(patching, "installed_version", lambda dist: "2.5.0")
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "all")
    with pytest.raises(FairCastPatchError, match="Upgrade torch"):
        _patch_set().apply()


def test_opt_in_proceeds_loudly_when_targets_resolve_and_the_self_check_passes(newer_torch, monkeypatch, caplog):
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "torch")
    calls = _fake_doctor(monkeypatch, 0, "PASS fsdp")
    ps = _patch_set()
    with caplog.at_level(logging.WARNING, logger="faircast_plugins"):
        ps.apply()
    try:
        assert Target().method() == "patched" and ps.active and not ps.verified
        assert "UNVERIFIED" in caplog.text and "torch 2.99.0" in caplog.text and ALLOW_UNVERIFIED_ENV in caplog.text
        [(cmd, env)] = calls
        assert cmd[-2:] == ["doctor", "torch"] and env[DOCTOR_ENV] == "1" and "RANK" not in env
        _patch_set().check()  # the self-check ran once for this process
        assert len(calls) == 1
    finally:
        ps.remove()


def test_opt_in_refuses_when_a_patch_target_is_missing(newer_torch, monkeypatch):
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "torch")
    calls = _fake_doctor(monkeypatch, 0)
    ps = _patch_set(f"{__name__}:Target.renamed_upstream")
    with pytest.raises(FairCastPatchError, match="renamed_upstream"):
        ps.apply()
    assert not ps.active and not calls and Target().method() == "original"


def test_opt_in_refuses_when_the_self_check_fails(newer_torch, monkeypatch):
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "all")
    _fake_doctor(monkeypatch, 1, "FAIL fsdp (0.3 s): DoctorFailure: 12 of 1920 elements of 0.weight ...")
    ps = _patch_set()
    with pytest.raises(FairCastPatchError, match=r"`faircast doctor torch` failed(.|\n)*12 of 1920"):
        ps.apply()
    assert not ps.active and Target().method() == "original"


def test_a_framework_without_a_self_check_cannot_be_allowed(monkeypatch):
    monkeypatch.setattr(patching, "installed_version", lambda dist: "9.0")
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "all")
    monkeypatch.delenv(DOCTOR_ENV, raising=False)
    with pytest.raises(FairCastPatchError, match="names somelib, but faircast doctor has no self-check"):
        PatchSet("somelib", "somelib", "<2").wrap(f"{__name__}:Target.method", lambda o: o).apply()


def test_the_real_self_check_runs_faircast_doctor_in_a_subprocess(newer_torch, monkeypatch, caplog):
    """End to end on this stack: the opt-in runs `faircast doctor torch` (the FSDP2 check), which passes."""
    monkeypatch.setenv(ALLOW_UNVERIFIED_ENV, "torch")
    ps = _patch_set()
    with caplog.at_level(logging.WARNING, logger="faircast_plugins"):
        ps.check()
    assert "UNVERIFIED" in caplog.text and patching._passed == {"torch"}


def test_doctor_fsdp_check_passes_in_process_and_fails_without_the_cast_patches(monkeypatch):
    """The FSDP2 check and its negative control: without Fair Cast's cast patches FSDP rounds to nearest."""
    from faircast_plugins import fsdp

    lines = doctor.run_check("fsdp")
    assert "fair_cast(master) bit for bit" in lines[0]
    fsdp.remove_fsdp_cast_patches()
    monkeypatch.setattr(fsdp, "apply_fsdp_cast_patches", lambda: fsdp.PATCHES)
    with pytest.raises(doctor.DoctorFailure, match="not fair_cast"):
        doctor.run_check("fsdp")
