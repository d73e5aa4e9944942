"""``faircast_plugins.deepspeed.policy_views`` without DeepSpeed, one process: a stand-in ZeRO-3 engine (the optimizer
attributes DeepSpeed 0.19 has, read by ``master_windows.Zero3Layout``; every parameter partitioned away, its bf16 and
fp32 partitions in the flat buffers) measured through OpenRLHF's entry point (``openrlhf.policy_probe.measure``).
Real engines at 1 and 2 ranks: ``tests/trl/test_deepspeed.py`` and ``tests/openrlhf/test_openrlhf_actor.py``."""
from types import SimpleNamespace

import torch

from faircast_plugins.deepspeed import master_windows as mw
from faircast_plugins.openrlhf import policy_probe
from faircast_plugins.policy_lag import PolicyLagProbe

VOCAB, HIDDEN = 11, 4


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=VOCAB)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, attention_mask=None, use_cache=False, position_ids=None):
        return SimpleNamespace(logits=self.head(torch.tanh(self.embed(input_ids))))


class Coordinator:
    """ZeRO-3's prefetch coordinator, as far as the probe reads it."""

    def __init__(self):
        self.invalid = False

    def is_invalid_trace(self):
        return self.invalid

    def _invalidate_trace(self):
        self.invalid = True


class Engine:
    def __init__(self, module, optimizer):
        self.module, self.optimizer, self.global_steps = module, optimizer, 0

    def zero_optimization_stage(self):
        return 3


def _zero3_engine():
    """A ZeRO-3 stand-in at one rank: sub-group 0 holds every parameter; the fp32 masters and a served bf16 copy that
    differs from their rounding are the flat partitions; each parameter's own data is empty (partitioned away), and
    DeepSpeed's module hooks are stand-ins that fail if a direct forward runs them."""
    model = TinyLM()
    params = list(model.parameters())
    g = torch.Generator().manual_seed(0)
    masters = [torch.randn(p.shape, generator=g) for p in params]
    served = [(m + 0.05 * torch.randn(m.shape, generator=g)).bfloat16() for m in masters]
    fp32 = torch.cat([m.reshape(-1) for m in masters])
    bf16 = torch.cat([s.reshape(-1) for s in served])
    positions, offset = {}, 0
    for p, m in zip(params, masters):
        n = m.numel()
        p.data = torch.empty(0, dtype=torch.bfloat16)
        p.ds_numel, p.ds_shape, p.ds_tensor = n, m.shape, bf16.narrow(0, offset, n)
        p.partition_numel = lambda n=n: n
        p.ds_status = SimpleNamespace(name="NOT_AVAILABLE")
        positions[id(p)] = (0, offset, n)
        offset += n

    def gather(module, args):
        raise AssertionError("DeepSpeed's gather hook ran in a direct forward")

    hooks = [m.register_forward_pre_hook(gather) for m in (model.embed, model.head)]
    offload = SimpleNamespace(forward_hooks=hooks, backward_hooks=[], get_param_coordinator=lambda c=Coordinator(): c)
    optimizer = SimpleNamespace(fp16_groups=[params], fp32_partitioned_groups_flat=[fp32],
                                fp16_partitioned_groups_flat=[bf16], grad_position=positions, get_param_id=id,
                                _get_param_partition_group=lambda p: None, parameter_offload=offload)
    return Engine(model, optimizer), masters, [s.float() for s in served], hooks


def test_one_zero3_measurement_builds_each_layout_once_and_reads_the_partitions(monkeypatch):
    """One measurement: one master and one served ``Zero3Layout`` (before: the master three times, the served twice:
    the views, their direct check, the scope's direct check), the forwards with DeepSpeed's hooks detached (put back
    after), the prefetch trace invalidated, and rows equal to the plain probe on the two copies."""
    built = {"master": 0, "served": 0}
    init = mw.Zero3Layout.__init__

    def counted(self, optimizer, served=False):
        built["served" if served else "master"] += 1
        init(self, optimizer, served)

    monkeypatch.setattr(mw.Zero3Layout, "__init__", counted)
    engine, masters, served, hooks = _zero3_engine()
    probe = policy_probe.attach(SimpleNamespace(model=engine), SimpleNamespace(policy_metrics_every=1,
                                                                               policy_metrics_seqs=4))
    seqs = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(1))
    actions = torch.ones(3, 4, dtype=torch.bool)
    actions[1, 2:] = False
    experience = SimpleNamespace(sequences=seqs, attention_mask=torch.ones_like(seqs), action_mask=actions)
    policy_probe.measure(engine, experience, temperature=0.7)
    assert built == {"master": 1, "served": 1}
    assert engine.optimizer.parameter_offload.get_param_coordinator().is_invalid_trace()
    for h, module in zip(hooks, (engine.module.embed, engine.module.head)):
        assert list(module._forward_pre_hooks) == [h.id]  # DeepSpeed's hooks back in place, nothing of the probe's
    assert all(p.data.numel() == 0 for p in engine.module.parameters())  # still partitioned away

    plain = TinyLM()  # the reference: the plain probe, each view a lookup of the full tensors
    params = list(plain.parameters())
    served_of = {id(p): s for p, s in zip(params, served)}
    master_of = {id(p): m for p, m in zip(params, masters)}
    want = PolicyLagProbe(every=1, seqs=4)
    want.measure(plain, 0, seqs[:, :-4], torch.ones(3, 3, dtype=torch.long), seqs[:, -4:], actions.long(),
                 served=lambda p: served_of[id(p)], master=lambda p: master_of[id(p)], temperature=0.7,
                 mask_positions=True)
    rows = probe.take()
    assert rows.shape == (3, 3) and torch.allclose(rows, want.take(), rtol=1e-6, atol=1e-9)
