"""``faircast bench`` runs end to end on a small size (nothing here is timed or compared against a speed)."""
import pytest
import torch

from faircast_plugins import bench
from faircast_plugins.cli import main


def test_bench_prints_every_case_and_checks_bits(capsys):
    assert main(["bench", "--numel", "40000", "--ref-numel", "10000", "--reps", "2"]) == 0
    out = capsys.readouterr().out
    for label in (".to(torch.bfloat16)", "out.copy_(x), preallocated", "fair_cast stochastic     cpu",
                  "fair_cast sticky         cpu",
                  "fair_cast nearest        cpu", "fair_cast error_feedback cpu", "reference: timed on 10,000, x4"):
        assert label in out, label
    assert out.count("bit-identical vs torch reference") == 4 and "MISMATCH" not in out
    assert "repetition 2/2 done" in out


@pytest.mark.parametrize("device", ["nodevice", "cuda:0"])
def test_bench_refuses_a_device_it_cannot_use(device, capsys):
    if device == "cuda:0" and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: --device cuda:0 is usable here")
    with pytest.raises(SystemExit, match=f"cannot use --device '{device}' here"):
        main(["bench", "--device", device, "--numel", "1000", "--reps", "1"])
    assert "faircast bench" not in capsys.readouterr().out  # refused before any timing starts


def test_bench_check_reports_a_mismatch(monkeypatch):
    # negative control: a backend that returns the plain round-to-nearest cast must be flagged
    real = bench.fair_cast

    def wrong(x, *, backend, mode, **kw):
        if backend == "cpu" and mode == "stochastic":
            return x.to(torch.bfloat16)
        return real(x, backend=backend, mode=mode, **kw)

    monkeypatch.setattr(bench, "fair_cast", wrong)
    line = bench._check("cpu", "stochastic", torch.randn(5000), key=3)
    assert "MISMATCH" in line


def test_cpu_breakdown_script_runs_every_case():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "cpu_breakdown.py"), "--numel", "65536",
                           "--reps", "1"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for label in (".to(torch.bfloat16)", "nearest kernel", "Philox pass alone", "rounding pass alone",
                  "stochastic kernel", "EF traffic alone", "error_feedback kernel"):
        assert label in done.stdout, label
