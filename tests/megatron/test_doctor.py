"""`faircast doctor megatron` (megatron-core's patched copy, a real optimizer step) and the opt-in it gates.

The check needs CUDA on a user's machine; here it runs on the CPU over gloo, in this process, with the stand-ins of
tests/megatron/cpu_shims.py installed by the test (none ships in the package).
"""
from __future__ import annotations

import contextlib
import functools
import io
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

from faircast_plugins import patching  # noqa: E402
from faircast_plugins.doctor import CHECKS, DoctorCannotRun, DoctorFailure  # noqa: E402
from faircast_plugins.doctor import megatron as megatron_doctor  # noqa: E402
from tests.unverified import check_opt_in_runs_the_doctor  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def shims():
    from tests.megatron import cpu_shims

    cpu_shims.install()
    yield
    cpu_shims.uninstall()


@pytest.fixture
def patches():
    from faircast_plugins.megatron.patch import PATCHES

    return PATCHES


def test_registered_for_the_distribution_the_patch_checks(patches):
    assert patching.FRAMEWORKS[patches.distribution] == ("megatron",) and "megatron" in CHECKS


def test_doctor_check_passes_on_cpu_with_the_stand_ins(shims):
    """Served == fair_cast(master) after each of 2 steps and detached == round-to-nearest (the check asserts both,
    bit for bit), for the distributed and the Float16 optimizers; every wrapped method resolves."""
    lines = megatron_doctor.check(device="cpu")
    assert "the cast sites resolve" in lines[0]
    for site in ("DistributedOptimizer._copy_main_params_to_model_params(self)",
                 "Float16OptimizerWithFloat16Params._copy_main_params_to_model_params(self)",
                 "MixedPrecisionOptimizer.step(self)", "ChainedOptimizer.step(self)"):
        assert site in lines[0], lines[0]
    assert lines[1].startswith("DistributedOptimizer: all 16 bf16 params") and "fair_cast(master)" in lines[1]
    assert lines[2].startswith("Float16OptimizerWithFloat16Params: all 16") and "round-to-nearest" in lines[2]


def test_doctor_check_fails_when_the_copy_rounds_to_nearest(shims, monkeypatch):
    """Negative control: a patch that keeps Megatron's round-to-nearest copy fails the check."""
    from faircast_plugins.megatron.patch import MegatronFairCast

    def nearest(self, key, main, start, end, dst, *rest):  # (step_ema, param)
        dst.copy_(main.detach().reshape(-1))

    monkeypatch.setattr(MegatronFairCast, "_cast", nearest)
    with pytest.raises(DoctorFailure, match="not fair_cast"):
        megatron_doctor.check(device="cpu")


class _Optimizer:
    def _copy_main_params_to_model_params(self, overlap):  # a copy with an argument the wrapper would drop
        return overlap


def test_a_cast_site_with_another_signature_fails():
    ps = patching.PatchSet("Megatron-core", "megatron-core", ">=0").wrap(
        f"{__name__}:_Optimizer._copy_main_params_to_model_params",
        lambda original: functools.wraps(original)(lambda self, *a: original(self, *a)))
    ps.apply()
    try:
        with pytest.raises(DoctorFailure, match=r"_copy_main_params_to_model_params\(self, overlap\) takes arguments"):
            megatron_doctor.cast_sites(ps)
    finally:
        ps.remove()


def _doctor_in_process(monkeypatch, device):
    """``patching.self_check``'s subprocess, run in this process (where the stand-ins are installed): the real
    ``faircast doctor`` command line, with the Megatron check on ``device``."""
    from faircast_plugins import cli

    calls = []
    monkeypatch.setattr(megatron_doctor, "check", functools.partial(megatron_doctor.check, device=device))

    def run(cmd, env, **kwargs):
        calls.append(cmd[3:])
        assert env[patching.DOCTOR_ENV] == "1"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = cli.main(cmd[3:])
        os.environ.pop(patching.DOCTOR_ENV, None)  # set by run_doctor in its own process
        return subprocess.CompletedProcess(cmd, rc, stdout=out.getvalue(), stderr="")

    monkeypatch.setattr(patching.subprocess, "run", run)
    return calls


def test_a_newer_megatron_core_runs_only_after_faircast_doctor_passes(shims, patches, monkeypatch, caplog):
    """Refused without the opt-in (naming the version, the variable and the doctor); with it, allowed once
    `faircast doctor megatron-core` passed on this stack."""
    calls = _doctor_in_process(monkeypatch, "cpu")
    check_opt_in_runs_the_doctor(patches, "0.19.0", monkeypatch, caplog)
    assert calls == [["doctor", "megatron-core"]]


def test_the_refusal_names_the_version_and_what_to_do(patches, monkeypatch):
    monkeypatch.setattr(patching, "installed_version", lambda dist: "0.17.0")
    monkeypatch.delenv(patching.ALLOW_UNVERIFIED_ENV, raising=False)
    monkeypatch.delenv(patching.DOCTOR_ENV, raising=False)
    with pytest.raises(patching.FairCastPatchError) as refused:
        patching.check_version(patches.distribution, patches.specifier)
    msg = str(refused.value)
    assert "installed megatron-core is 0.17.0" in msg and "FAIRCAST_ALLOW_UNVERIFIED=megatron-core" in msg
    assert "`faircast doctor megatron-core` passes" in msg
    monkeypatch.setattr(patching, "installed_version", lambda dist: "0.15.0")  # older: upgrade, with or without
    monkeypatch.setenv(patching.ALLOW_UNVERIFIED_ENV, "megatron-core")
    with pytest.raises(patching.FairCastPatchError, match="installed megatron-core is 0.15.0.*Upgrade"):
        patching.check_version(patches.distribution, patches.specifier)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_opt_in_is_refused_where_the_doctor_cannot_run(patches, monkeypatch):
    """No GPU and no stand-ins: the self-check cannot run, so the opt-in does not pass."""
    calls = _doctor_in_process(monkeypatch, None)
    real = patching.installed_version
    monkeypatch.setattr(patching, "installed_version", lambda dist: "0.19.0" if dist == "megatron-core" else real(dist))
    monkeypatch.setattr(patching, "_passed", set())
    monkeypatch.setattr(patches, "version", patches.version)
    monkeypatch.setattr(patches, "verified", patches.verified)
    monkeypatch.setenv(patching.ALLOW_UNVERIFIED_ENV, "megatron-core")
    monkeypatch.delenv(patching.DOCTOR_ENV, raising=False)
    with pytest.raises(patching.FairCastPatchError, match=r"(?s)faircast doctor megatron-core` failed.*needs a CUDA GPU"):
        patches.check()
    assert calls == [["doctor", "megatron-core"]] and patching._passed == set()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cli_without_cuda_says_it_needs_a_gpu():
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    named = subprocess.run([sys.executable, "-m", "faircast_plugins.cli", "doctor", "megatron"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert named.returncode == 1, named.stdout + named.stderr
    assert "CANNOT RUN megatron: this check needs a CUDA GPU" in named.stdout, named.stdout + named.stderr
    assert "0 of 1 check(s) passed" in named.stdout


def test_a_check_that_cannot_run_is_skipped_when_not_named(monkeypatch, capsys):
    """`faircast doctor` without names runs what is installed: a check that cannot run here is a SKIP, not a FAIL."""
    from faircast_plugins import doctor

    def cannot(name):
        raise DoctorCannotRun("needs a CUDA GPU")

    monkeypatch.setattr(doctor, "run_check", cannot)
    monkeypatch.setattr(doctor, "_installed_frameworks", lambda: ["megatron-core"])
    monkeypatch.setenv(patching.DOCTOR_ENV, "")  # run_doctor sets it: restored (unset) afterwards
    monkeypatch.delenv(patching.DOCTOR_ENV)
    assert doctor.run_doctor(type("Args", (), {"frameworks": []})()) == 0
    assert "SKIP megatron: needs a CUDA GPU" in capsys.readouterr().out
    assert doctor.run_doctor(type("Args", (), {"frameworks": ["megatron"]})()) == 1
    assert "CANNOT RUN megatron" in capsys.readouterr().out
