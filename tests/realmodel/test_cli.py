"""The CLI on the real checkpoint after one real optimizer step: ``faircast export`` writes fair_cast of every fp32
master bit for bit (the 28.3M-element embedding above 2**24 included) and ``faircast verify`` accepts it; the
flag-off control (``--mode nearest``) writes round-to-nearest; ``faircast estimate --checkpoint`` and the step audit
(:class:`faircast_plugins.audit.Audit`) give finite metrics on the full embedding."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from faircast_plugins import derive_key, fair_cast
from faircast_plugins.audit import Audit
from faircast_plugins.key import canonical_name

SEED, VERSION = 29, 1
EMBED = "model.embed_tokens.weight"


def faircast_cli(*args):
    run = subprocess.run([sys.executable, "-m", "faircast_plugins.cli", *args], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}, timeout=600)
    return run


@pytest.fixture(scope="module")
def stepped(smollm2, tmp_path_factory):
    """The checkpoint's weights as fp32 masters after one AdamW step (lr 1e-5, 2 chat prompts, fp32 compute), saved
    as an fp32 checkpoint; the masters before and after."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    before = {canonical_name(n): p.detach().clone() for n, p in model.named_parameters()}
    text = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True) + a
            for q, a in (("What is 27 + 58?", "85"), ("What is 12 + 30?", "42"))]
    batch = tok(text, return_tensors="pt", padding=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model(**batch, labels=batch["input_ids"]).loss.backward()
    opt.step()
    out = tmp_path_factory.mktemp("smollm2-fp32") / "step1"
    model.save_pretrained(out)
    after = {canonical_name(n): p.detach().clone() for n, p in model.named_parameters()}
    return out, before, after


def test_one_step_moved_the_masters_off_the_bf16_grid(stepped):
    _, before, after = stepped
    assert all(torch.equal(m, m.bfloat16().float()) for m in before.values())  # "as released": on the grid
    assert after[EMBED].numel() == 49152 * 576 > 2 ** 24
    assert not torch.equal(after[EMBED], after[EMBED].bfloat16().float())


def test_export_and_verify_write_fair_cast_of_every_master(stepped, tmp_path):
    ckpt, _, after = stepped
    run = faircast_cli("export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "served"), "--seed", str(SEED),
                       "--version", str(VERSION), "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    run = faircast_cli("verify", "--checkpoint", str(ckpt), "--served", str(tmp_path / "served"), "--quiet")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    served = {canonical_name(n): t for n, t in load_file(tmp_path / "served" / "model.safetensors").items()}
    assert sorted(served) == sorted(after)  # tied: the embedding once, no lm_head
    differs_from_rtn = 0
    for name, master in after.items():
        want = fair_cast(master, key=derive_key(SEED, VERSION, name), mode="stochastic", backend="torch")
        assert served[name].dtype == torch.bfloat16
        assert torch.equal(served[name].view(torch.int16), want.view(torch.int16)), name
        differs_from_rtn += not torch.equal(served[name], master.to(torch.bfloat16))
    assert not torch.equal(served[EMBED], after[EMBED].to(torch.bfloat16))  # the check tells Fair Cast from RTN
    assert differs_from_rtn > len(after) // 2

    # Negative control, flag off: round to nearest, which the same check rejects as Fair Cast.
    run = faircast_cli("export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "rtn"), "--seed", str(SEED),
                       "--version", str(VERSION), "--mode", "nearest", "--quiet")
    assert run.returncode == 0, run.stderr[-3000:]
    rtn = {canonical_name(n): t for n, t in load_file(tmp_path / "rtn" / "model.safetensors").items()}
    assert all(torch.equal(rtn[n].view(torch.int16), m.to(torch.bfloat16).view(torch.int16)) for n, m in after.items())
    assert not torch.equal(rtn[EMBED], served[EMBED])


def test_estimate_checkpoint_covers_the_whole_embedding(stepped):
    ckpt, _, _ = stepped
    run = faircast_cli("estimate", "--checkpoint", str(ckpt), "--max-elements", str(1 << 25), "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    assert res["elements"] == 1 << 25 > 49152 * 576  # the embedding first (sorted names), then layer 0
    values = [res["ratio"]] + [v for mode in ("nearest", "stochastic") for v in res[mode].values()]
    assert all(math.isfinite(v) for v in values), res
    assert res["nearest"]["bias_rel"] > 0.9 > 0.1 > res["stochastic"]["bias_rel"]  # RTN loses the step; SR does not


def test_step_audit_on_every_master_is_finite(stepped):
    """The training audit (every adapter's ``faircast_audit``) on the real step: Fair Cast, then the flag-off control."""
    _, before, after = stepped
    metrics = {}
    for mode in ("stochastic", "nearest"):
        audit = Audit()
        for version, masters in ((0, before), (1, after)):
            for name, m in masters.items():
                served = fair_cast(m, key=derive_key(SEED, version, name), mode=mode, backend="torch")
                audit.observe(name, version, m, served)
        metrics[mode] = audit.metrics()
        assert metrics[mode] and all(math.isfinite(v) for v in metrics[mode].values()), metrics[mode]
        assert metrics[mode]["faircast/master_moved_frac"] > 0.5
    sr, rtn = metrics["stochastic"], metrics["nearest"]
    print(sr, rtn)
    assert rtn["faircast/bias_rel"] > 0.9 and sr["faircast/bias_rel"] < 0.2  # RTN loses the step, Fair Cast does not
    assert sr["faircast/served_changed_frac"] > 2 * rtn["faircast/served_changed_frac"]
