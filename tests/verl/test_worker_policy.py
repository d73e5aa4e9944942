"""actor_rollout_ref.faircast.policy_metrics_every on verl's real ActorRolloutRefWorker (CPU/gloo, FSDP1 and FSDP2,
world sizes 1 and 2): ``update_actor`` returns ``faircast/policy_*`` (logged by verl under ``actor/``), measured
before its first optimizer step on the first sequences of the batch, equal to a one-process fp32 reference; the
probe changes no training step."""
from __future__ import annotations

import pytest
import torch

from faircast_plugins import derive_key, fair_cast
from faircast_plugins.policy_lag import KEYS, KL_KEY, SEQS_KEY, PolicyLagProbe, metrics_of, weights_swapped

from . import tiny_model
from .conftest import SEED

SEQS = 3  # policy_metrics_seqs in conftest's POLICY_ON / POLICY_OFF


def _reference(model_dir: str, masters: dict, on: bool, world: int, temperature: float = 1.0) -> dict:
    """The metrics from one process: the HF model holding the full fp32 masters of version 0, each weight's full
    served copy swapped in (Fair Cast at version 0, or round to nearest), on the first SEQS sequences of the batch
    every rank trained on (the harness gives every rank the same batch)."""
    from transformers import AutoModelForCausalLM
    from verl.utils import tensordict_utils as tu

    from faircast_plugins.key import canonical_name
    from faircast_plugins.verl.policy import probe_batch

    from .harness import make_batch

    data = make_batch(8, 6, 10, tiny_model.VOCAB)
    tu.assign_non_tensor(data, temperature=temperature)
    batch = probe_batch(data, SEQS)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    params = {canonical_name(n): p for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(masters[name])
    served = {id(p): (fair_cast(masters[n], key=derive_key(SEED, 0, n), backend="torch") if on
                      else masters[n].to(torch.bfloat16)).float() for n, p in params.items()}
    probe = PolicyLagProbe(1, SEQS)
    for _ in range(world):
        probe.measure(model, 0, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"],
                      batch["completion_mask"], count_mask=batch["count_mask"], served=lambda p: served[id(p)],
                      master=lambda p: None, temperature=temperature, swap=weights_swapped)
    return metrics_of(probe.take())


@pytest.mark.parametrize("world, name, on, temperature, baseline", [
    (1, "fsdp2_policy_off", False, 1.0, "fsdp2_audit_only"),
    (1, "fsdp_policy", True, 1.0, "fsdp_on"),
    (2, "fsdp2_policy", True, 1.0, "fsdp2_on"),
    (2, "fsdp_policy_off", False, 0.7, None),
])
def test_update_actor_returns_policy_metrics_equal_to_the_reference(worker_runs, model_dir, world, name, on,
                                                                    temperature, baseline):
    _, runs = worker_runs(world)
    results = runs[name]
    got = [r["metrics"] for r in results]
    assert all(g == got[0] for g in got)  # gathered: every rank returns the same numbers
    got = got[0]
    want = _reference(model_dir, results[0]["masters_v0"], on, world, temperature)
    assert got[SEQS_KEY] == SEQS * world
    assert {k: got[k] for k in KEYS} == pytest.approx(want, rel=1e-5, abs=1e-9)
    assert got[KL_KEY] > 0  # the masters are off the bf16 grid: the served copy differs from them
    # the check tells the served copies apart: Fair Cast's from round to nearest
    other = _reference(model_dir, results[0]["masters_v0"], not on, world, temperature)
    assert got[KL_KEY] != pytest.approx(other[KL_KEY], rel=1e-3)
    if baseline is not None:  # the probe changed no step: the masters equal those of the same run without it
        for r, b in zip(results, runs[baseline]):
            assert len(r["masters_by_step"]) == len(b["masters_by_step"]) == 2
            for mine, theirs in zip(r["masters_by_step"], b["masters_by_step"]):
                assert all(torch.equal(mine[n], t) for n, t in theirs.items())
            assert all(torch.equal(r["masters"][n], t) for n, t in b["masters"].items())


def test_probe_batch_reads_padded_and_nested_batches_alike():
    """verl hands the worker padded prompts/responses (with attention_mask), or nested (jagged) ones: the probe gets
    the same left-padded prompts, right-padded responses and masks from both."""
    from faircast_plugins.verl.policy import probe_batch

    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6])]
    responses = [torch.tensor([7]), torch.tensor([8, 9]), torch.tensor([10, 11, 12])]
    response_mask = torch.tensor([[1, 0, 0], [1, 0, 0], [1, 1, 1]])  # the second response's last token: a tool's
    nested = {"prompts": torch.nested.nested_tensor(prompts, layout=torch.jagged),
              "responses": torch.nested.nested_tensor(responses, layout=torch.jagged), "response_mask": response_mask}
    padded_prompts = torch.tensor([[1, 2, 3], [0, 4, 5], [0, 0, 6]])
    padded_responses = torch.tensor([[7, 0, 0], [8, 9, 0], [10, 11, 12]])
    attention = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]])
    padded = {"prompts": padded_prompts, "responses": padded_responses, "attention_mask": attention,
              "response_mask": response_mask}
    a, b = probe_batch(nested, 2), probe_batch(padded, 2)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key][:, : a[key].shape[1]]) if key.startswith(("completion", "count")) \
            else torch.equal(a[key], b[key][:, -a[key].shape[1]:]), key
    assert torch.equal(b["prompt_ids"], padded_prompts[:2]) and torch.equal(b["prompt_mask"], attention[:2, :3])
    assert torch.equal(a["count_mask"], torch.tensor([[1, 0], [1, 0]]))
    assert torch.equal(a["completion_mask"], torch.tensor([[1, 0], [1, 1]]))


def test_a_measurement_at_the_first_update_at_or_after_each_multiple_of_n():
    from faircast_plugins import FairCastConfig
    from faircast_plugins.verl.policy import VerlPolicyProbe

    policy = VerlPolicyProbe.of(FairCastConfig(policy_metrics_every=3))
    # two optimizer steps per update_actor: it starts at versions 0, 2, 4, ...
    assert [v for v in range(0, 14, 2) if policy.due(v)] == [0, 4, 6, 10, 12]
    assert VerlPolicyProbe.of(FairCastConfig()) is None


def _fsdp_stub(kind: str, compute: torch.device):
    """A module FSDP would compute on ``compute`` while its (offloaded) parameters stay on the CPU: FSDP2's
    ``CPUOffloadPolicy`` (verl ``actor.fsdp_config.offload_policy``), FSDP1's ``CPUOffload(offload_params=True)``.
    Stubs: FSDP2's state is only asked for its ``_device``, FSDP1's unit for its ``compute_device``."""
    from types import SimpleNamespace

    from torch import nn

    if kind == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        module = nn.Sequential(nn.Linear(2, 2))
        module.__class__ = type("FSDPSequential", (FSDPModule, nn.Sequential), {})  # as fully_shard does
        module._get_fsdp_state = lambda: SimpleNamespace(_device=compute)
        return module
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    unit = FSDP.__new__(FSDP)
    nn.Module.__init__(unit)
    unit._fsdp_wrapped_module = nn.Linear(2, 2)
    unit.compute_device = compute
    return nn.Sequential(unit)


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_the_probe_batch_goes_to_fsdps_compute_device_not_where_offloaded_shards_live(kind):
    """H4: with CPU offload the first parameter's shard is on the CPU while FSDP computes on the accelerator; the
    probe's batch goes where FSDP computes (the master forward has no FSDP hook to move it)."""
    from faircast_plugins.verl.policy import _device

    module = _fsdp_stub(kind, torch.device("meta"))
    assert next(module.parameters()).device.type == "cpu"
    assert _device(module) == torch.device("meta")


@pytest.mark.parametrize("extra", ["multi_modal_inputs", "mrope_position_ids", "nested_mrope_position_ids"])
def test_a_vision_language_batch_is_refused_at_the_first_measurement(extra):
    """M3: the probe's forward passes only ids and the attention mask, so a vision-language batch (images in
    ``multi_modal_inputs``, mrope's ``[B, 3|4, T]`` position ids) would be scored as text: refused, naming the
    option; a text batch with ``[B, T]`` position ids is not."""
    from tensordict import TensorDict

    from faircast_plugins.patching import FairCastPatchError
    from faircast_plugins.verl.policy import probe_batch

    text = {"prompts": torch.tensor([[1, 2], [3, 4]]), "responses": torch.tensor([[5, 6], [7, 8]]),
            "attention_mask": torch.ones(2, 4, dtype=torch.long), "response_mask": torch.ones(2, 2, dtype=torch.long),
            "position_ids": torch.arange(4).expand(2, 4)}
    probe_batch(TensorDict(text, batch_size=[2]), 2)
    data = TensorDict(text, batch_size=[2])
    if extra == "multi_modal_inputs":
        from tensordict import NonTensorStack

        data["multi_modal_inputs"] = NonTensorStack({"pixel_values": torch.zeros(4, 3)}, {})
    elif extra == "mrope_position_ids":
        data["position_ids"] = torch.arange(4).expand(2, 4, 4)
    else:
        data["position_ids"] = torch.nested.as_nested_tensor([torch.arange(8).view(4, 2), torch.arange(12).view(4, 3)],
                                                             layout=torch.jagged)
    with pytest.raises(FairCastPatchError, match="policy_metrics_every"):
        probe_batch(data, 2)
