"""The faircast console command: selftest passes here, and fails loudly when the engine is wrong."""
import subprocess
import sys

from faircast_plugins import cli, torch_ref


def test_selftest_passes_on_this_machine(capsys):
    assert cli.main(["selftest"]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out and "torch@cpu" in out and "FAIL" not in out


def test_selftest_catches_a_wrong_engine(monkeypatch, capsys):
    real = torch_ref.stochastic_bits
    monkeypatch.setattr(torch_ref, "stochastic_bits", lambda u, noise: real(u, (noise + 0x8000) & 0xFFFF))
    assert cli.main(["selftest", "--quiet"]) == 1
    assert "FAIL  torch@cpu golden table" in capsys.readouterr().out


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "faircast_plugins.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "selftest" in out.stdout and "export" in out.stdout


def test_selftest_catches_a_wrong_sticky_key_and_error_feedback(monkeypatch, capsys):
    from faircast_plugins import key

    real_ef = torch_ref.error_feedback_bits
    monkeypatch.setattr(key, "STICKY_VERSION", 2**64 - 2)
    monkeypatch.setattr(torch_ref, "error_feedback_bits", lambda x, r: (real_ef(x, r)[0], r * 0))
    assert cli.main(["selftest", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  sticky_key(1234" in out and "FAIL  torch@cpu error feedback golden table" in out
