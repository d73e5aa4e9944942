"""The opt-in start-up hook (``faircast-trl hook install``): plain ``trl`` gains the ``faircast`` fields."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from test_config_cli import example_setup, faircast_trl_exe

PROBE = """
import site, sys
site.addsitedir(sys.argv[1])
assert "trl" not in sys.modules and "torch" not in sys.modules, "the hook must not import anything heavy at start-up"
from trl import GRPOConfig
args = GRPOConfig(output_dir="x", use_cpu=True, report_to="none", faircast=True, faircast_mode="nearest")
print("FAIRCAST", args.faircast, args.faircast_mode)
"""


def test_hook_is_lazy_and_adds_the_field(tmp_path):
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    # negative control: no hook, TRL's own GRPOConfig rejects the field
    plain = subprocess.run([sys.executable, "-c", PROBE, str(site_dir)], capture_output=True, text=True, timeout=600)
    assert plain.returncode != 0 and "unexpected keyword argument 'faircast'" in plain.stderr
    exe = faircast_trl_exe()
    subprocess.run([exe, "hook", "install", "--site", str(site_dir)], check=True, capture_output=True, timeout=600)
    assert (site_dir / "faircast_trl_hook.pth").read_text() == "import faircast_trl_hook\n"
    hooked = subprocess.run([sys.executable, "-c", PROBE, str(site_dir)], capture_output=True, text=True, timeout=600)
    assert hooked.returncode == 0, hooked.stderr[-3000:]
    assert "FAIRCAST True nearest" in hooked.stdout
    subprocess.run([exe, "hook", "remove", "--site", str(site_dir)], check=True, capture_output=True, timeout=600)
    assert not (site_dir / "faircast_trl_hook.pth").exists()


def test_plain_trl_cli_with_hook_runs_grpo(tmp_path, tiny_model_dir):
    trl_exe = shutil.which("trl", path=os.path.dirname(sys.executable))
    if trl_exe is None:
        pytest.skip("the trl console script is not installed")
    site_dir = sysconfig.get_paths()["purelib"]
    pth = os.path.join(site_dir, "faircast_trl_hook.pth")
    if os.path.exists(pth):
        pytest.skip(f"{pth} is already installed in this environment; not touching it")
    cfg, env = example_setup(tmp_path, tiny_model_dir)
    subprocess.run([faircast_trl_exe(), "hook", "install"], check=True, capture_output=True, timeout=600)
    try:
        run = subprocess.run([trl_exe, "grpo", "--config", str(cfg), "--num_processes", "1"], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=900)
    finally:
        subprocess.run([faircast_trl_exe(), "hook", "remove"], check=True, capture_output=True, timeout=600)
    assert not os.path.exists(pth)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    info = json.loads((tmp_path / "tiny-GRPO" / "faircast.json").read_text())
    assert info["enabled"] is True and info["version"] == 4
