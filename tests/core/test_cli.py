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
