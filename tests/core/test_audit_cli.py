"""faircast estimate (formerly faircast audit): one step from bf16 weights, nearest vs stochastic."""
import json

import pytest
import torch
from safetensors.torch import save_file

from faircast_plugins import cli
from faircast_plugins.audit_cli import audit_step


def test_tiny_default_shows_nearest_losing_the_step(capsys):
    assert cli.main(["estimate", "--json", "--max-elements", "300000"]) == 0
    res = json.loads(capsys.readouterr().out)  # stdout is the JSON only
    assert res["nearest"]["bias_rel"] > 0.5  # most of a 1e-5 step vanishes under round-to-nearest
    assert res["stochastic"]["bias"] < 6 * res["stochastic"]["sigma"]  # unbiased within 6 sigma
    assert res["ratio"] > 10


def test_checkpoint_directory(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    save_file({"a.weight": torch.randn(300, 300, generator=g) * 0.02, "steps": torch.arange(3)}, str(tmp_path / "model.safetensors"))
    assert cli.main(["estimate", "--checkpoint", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "nearest / stochastic" in out and "a.weight" in out and "round-to-nearest loses" in out


def test_large_steps_survive_both_modes():
    """Negative control: a step far above half a bf16 step is kept by nearest too."""
    res = audit_step([("w", torch.randn(100000) * 0.02)], lr=1e-1, seed=0, max_elements=10**6, progress=False)
    assert res["nearest"]["bias_rel"] < 0.05


def test_empty_checkpoint_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit, match="no model.safetensors") as exc:
        cli.main(["estimate", "--checkpoint", str(tmp_path)])
    out = capsys.readouterr()
    assert exc.value.code == 2
    assert out.out == "" and out.err.startswith("faircast estimate: error: ") and "no model.safetensors" in out.err
