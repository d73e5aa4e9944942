"""One rank of verl's real ``ActorRolloutRefWorker`` on CPU/gloo, run as a subprocess by the tests.

    python -m tests.verl.harness '<json options>'

The rank composes verl's own ``ppo_trainer.yaml`` (CPU overrides only), builds the worker, and runs the path a
PPO step takes: ``init_model`` -> ``compute_log_prob`` -> ``update_actor`` (two optimizer steps) ->
``update_weights(mode="naive")`` into a recording rollout -> ``compute_log_prob`` again. Forward pre-hooks record
the bf16 weights each forward actually used. It saves, per rank, the exported tensors, the weights the last
forward used, the full fp32 masters at export time, and the Fair Cast version, for the test to compare.
"""
from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import sys

import torch

VERL_CONFIG_NAME = "ppo_trainer"


def cpu_overrides(model_dir: str, strategy: str, batch: int, world: int) -> list:
    """The minimal overrides that let verl's own config run on CPU (see shims/cpu_platform.py)."""
    a = "actor_rollout_ref."
    return [
        f"{a}model.path={model_dir}",
        f"{a}actor.strategy={strategy}",
        f"{a}ref.strategy={strategy}",
        f"{a}model.use_remove_padding=False",
        f"{a}model.enable_gradient_checkpointing=False",
        f"+{a}model.override_config.attn_implementation=sdpa",
        f"{a}actor.use_torch_compile=False",
        f"{a}actor.fsdp_config.use_torch_compile=False",
        f"{a}actor.ppo_mini_batch_size={batch // 2 * world}",
        f"{a}actor.ppo_micro_batch_size_per_gpu={batch // 2}",
        f"{a}actor.use_dynamic_bsz=False",
        f"{a}actor.optim.lr=1e-3",
        f"{a}actor.use_kl_loss=False",
        f"{a}rollout.name=faircast_record",
        f"{a}rollout.free_cache_engine=False",
        f"{a}rollout.log_prob_micro_batch_size_per_gpu={batch}",
        f"{a}rollout.n=1",
        f"{a}rollout.tensor_model_parallel_size=1",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "trainer.use_v1=false",
    ]


def compose(overrides: list, config_file: str | None = None):
    """Compose verl's ``ppo_trainer`` (or a user config file that builds on it) with ``overrides``, as hydra would."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import verl.trainer.config as verl_config

    if config_file is None:
        config_dir, name = os.path.dirname(verl_config.__file__), VERL_CONFIG_NAME
    else:
        config_dir, name = os.path.dirname(os.path.abspath(config_file)), os.path.basename(config_file)[:-len(".yaml")]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir, version_base=None):
        return hydra_compose(name, overrides=overrides)


def make_batch(batch: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    """A left/right-padded PPO batch the way verl's driver hands it to the worker (no-padding conversion)."""
    from tensordict import TensorDict

    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    total = prompt_len + response_len
    input_ids = torch.randint(3, vocab, (batch, total), generator=g)
    attention_mask = torch.ones(batch, total, dtype=torch.int64)
    for i in range(batch):  # ragged prompts (left padding) and responses (right padding)
        attention_mask[i, : i % 3] = 0
        attention_mask[i, total - (i % 4):] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    response_mask = attention_mask[:, prompt_len:].clone()
    td = TensorDict(
        {
            "prompts": input_ids[:, :prompt_len],
            "responses": input_ids[:, prompt_len:],
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "old_log_probs": torch.randn(batch, response_len, generator=g) * 0.1 - 3.0,
            "advantages": torch.randn(batch, response_len, generator=g),
        },
        batch_size=[batch],
    )
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=1.0, multi_turn=False)
    return td


class ForwardRecorder:
    """Forward pre-hooks that keep the weights (bf16 compute copies) each module's forward actually reads."""

    def __init__(self, module):
        self.seen = {}
        self.handles = []
        for prefix, sub in module.named_modules():
            names = [n for n in ("weight", "bias") if isinstance(getattr(sub, n, None), torch.Tensor)]
            names += [n for n, _ in sub.named_parameters(recurse=False) if n not in names]  # packed MoE experts
            if names and (not list(sub.children()) or "experts" in prefix.rsplit(".", 1)[-1]):
                self.handles.append(sub.register_forward_pre_hook(self._hook(prefix, names)))

    def _hook(self, prefix, names):
        from faircast_plugins.key import canonical_name

        def hook(module, args):
            for n in names:
                t = getattr(module, n)
                self.seen[canonical_name(f"{prefix}.{n}")] = t.detach().to_local().clone() if hasattr(t, "to_local") else t.detach().clone()

        return hook

    def take(self):
        seen, self.seen = self.seen, {}
        return seen


def _record_fp8_weights() -> dict:
    """Record, by canonical name, the last weight each ``fp8_loss`` linear layer computed with (wraps
    ``faircast_plugins.verl.fp8.compute_weight``, which the layers look up at each call)."""
    from faircast_plugins.verl import fp8 as fc_fp8

    seen = {}
    original = getattr(fc_fp8.compute_weight, "__wrapped__", fc_fp8.compute_weight)

    def compute_weight(name, weight):
        out = original(name, weight)
        seen[name] = out.detach().clone()
        return out

    compute_weight.__wrapped__ = original
    fc_fp8.compute_weight = compute_weight
    return seen


def full_masters(module) -> dict:
    """Full fp32 masters of an FSDP1/FSDP2 module, by canonical name (every rank gets all of them)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from faircast_plugins.key import canonical_name

    if isinstance(module, FSDP):
        with FSDP.summon_full_params(module, writeback=False):
            return {canonical_name(n): p.detach().clone() for n, p in module.named_parameters()}
    return {canonical_name(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in module.named_parameters()}


def run_case(case: dict, opts: dict, world: int) -> dict:
    """One worker through one PPO step's path; returns what the test compares."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from faircast_plugins.verl.engine import state_of
    from tests.verl.shims import cpu_platform

    model_dir = case.get("model_dir", opts["model_dir"])
    if case.get("config_file"):  # a user config file (the tiny CPU example): it carries the CPU settings itself
        overrides = [f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=faircast_record"]
        cfg = compose(overrides + case.get("overrides", []), case["config_file"])
    else:
        overrides = cpu_overrides(model_dir, case["strategy"], opts["batch"], world)
        cfg = compose(overrides + case.get("overrides", []))
    worker_cls = ActorRolloutRefWorker
    if case.get("decoupled"):  # the fully-async / v1 separate-async trainers' worker (masters kept aside by key)
        from verl.experimental.separation.engine_workers import DetachActorWorker as worker_cls
    worker = worker_cls(cfg.actor_rollout_ref, role=case.get("role", "actor_rollout"))
    init_status = worker.init_model()
    if case.get("delta_versions"):
        return delta_versions(worker, case, opts, world)
    if case.get("export_versions"):
        return export_versions(worker, case, opts, world)
    engine = worker.actor.engine
    if case.get("export_only"):
        # Negative control for the trainer half: Fair Cast on for the export only; FSDP keeps its stock cast.
        from faircast_plugins.fsdp import unregister_fsdp_module

        unregister_fsdp_module(engine.module)
    recorder = ForwardRecorder(engine.module)
    fp8_seen = _record_fp8_weights() if case.get("record_fp8_weights") else None
    data = make_batch(opts["batch"], 6, 10, opts["vocab"])

    from verl.utils import tensordict_utils as tu

    if case.get("temperature"):  # the rollout's sampling temperature, as the driver hands it on
        tu.assign_non_tensor(data, temperature=case["temperature"])

    def log_prob():
        td = data.clone()
        tu.assign_non_tensor(td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False)
        worker.compute_log_prob(td)

    result = {"rank": torch.distributed.get_rank(), "init_status": init_status}
    log_prob()
    # light (a real model, tests/realmodel): only the final versions, not v0 nor the masters of every step
    light = case.get("light", False)
    forward_v0 = recorder.take()
    if not light:
        result["forward_v0"] = forward_v0
    if fp8_seen is not None:  # faircast.fp8_loss: the weights the quantized linear layers computed with
        result["forward_fp8_v0"] = dict(fp8_seen)
    if not light:
        result["masters_v0"] = full_masters(engine.module)
    # the full masters after each optimizer step (stateful modes: the reference replays every version)
    result["masters_by_step"] = steps = []
    step = engine.optimizer_step

    def optimizer_step(*args, **kwargs):
        if case.get("nan_first_step") and not steps:  # a non-finite gradient norm: verl skips this step
            next(p for p in engine.module.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
        out = step(*args, **kwargs)
        steps.append(None if light else full_masters(engine.module))
        return out

    engine.optimizer_step = optimizer_step
    if case.get("delta"):  # verl's delta_sharded source: the seed (full export), then the shard snapshots
        seed, _ = engine.get_per_tensor_param()
        result["delta_seed"] = {k: v.clone() for k, v in seed}
        engine.prime_delta_snapshots()


    if case.get("decoupled"):
        # decoupled PPO as verl's fully-async trainer runs it (trigger_parameter_sync_step > 1, no bypass): the
        # weights are synced (version 0 served), saved as pi_old (key 1), trained, and pi_old is restored for the
        # old log-probs of the next step, then the current masters come back.
        asyncio.run(worker.update_weights(mode="naive"))
        result["exported_v0"] = {k: v for part in cpu_platform.RECEIVED for k, v in part.items()}
        cpu_platform.RECEIVED.clear()
        worker.save_model_to_cpu(1)

    if case.get("load_checkpoint"):
        worker.load_checkpoint(case["load_checkpoint"])
    else:
        td = data.clone()
        mb = opts["batch"] // 2 * world
        tu.assign_non_tensor(td, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                             global_batch_size=mb, mini_batch_size=mb, epochs=1, seed=0,
                             dataloader_kwargs={"shuffle": False}, compute_loss=True)
        out = worker.update_actor(td)
        recorder.take()
        metrics = (tu.get(out, "metrics") or {}) if out is not None else {}
        result["metrics"] = {k: v for k, v in metrics.items() if k.startswith("faircast/")}
        if case.get("save_checkpoint"):
            worker.save_checkpoint(case["save_checkpoint"], global_step=2)
    if case.get("decoupled"):
        worker.save_model_to_cpu(2)
        worker.restore_model_from_cpu(1)
        log_prob()
        result["forward_old"] = recorder.take()
        worker.restore_model_from_cpu(2)
        worker.clear_cpu_model(2)

    cpu_platform.RECEIVED.clear()
    asyncio.run(worker.update_weights(mode="naive"))
    assert cpu_platform.RECEIVED, "update_weights did not reach the rollout"
    result["exports"] = list(cpu_platform.RECEIVED)  # LoRA: the base weights, then the adapters
    result["exported"] = {k: v for part in cpu_platform.RECEIVED for k, v in part.items()}
    if case.get("checkpoint_engine"):  # the non-naive path (nccl/nixl/hccl backends): send_weights
        cpu_platform.SENT_BY_CHECKPOINT_ENGINE.clear()
        asyncio.run(worker.update_weights())  # mode "auto" -> rollout.checkpoint_engine.backend
        result["sent_by_checkpoint_engine"] = cpu_platform.SENT_BY_CHECKPOINT_ENGINE.pop()
    if case.get("delta"):  # steady state: this rank's shards and the deltas it sends at the current version
        from verl.workers.engine.spec import derive_dtensor_placement, translate_flat_indices

        shards, _ = engine.get_per_tensor_param_shard()
        result["delta_shards"] = {}
        for name, local, spec in shards:
            place = derive_dtensor_placement(spec)[0]
            idx = (torch.arange(local.numel()) + place if isinstance(place, int)
                   else translate_flat_indices(torch.arange(local.numel()), place))
            result["delta_shards"][name] = (idx, local.clone())
        entries, _ = engine.get_per_tensor_param_delta_shard()
        result["deltas"] = {slots[0][0]: (idx.clone(), val.clone()) for slots, _, _, idx, val, _ in entries}
    if case.get("merged_reference"):  # the fp32 merged weights W + s*B@A, as verl's own merge computes them
        from verl.utils.fsdp_utils import merged_lora_context, normalize_peft_param_name

        with merged_lora_context(engine.module, backup_adapters=True):
            params = normalize_peft_param_name(engine.module.state_dict())
            result["merged"] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                                for k, v in params.items()}
    result["masters"] = full_masters(engine.module)
    log_prob()
    result["forward"] = recorder.take()
    if fp8_seen is not None:
        result["forward_fp8"] = dict(fp8_seen)

    state = state_of(engine)
    result["version"] = state.caster.version if state is not None else None
    result["seed"] = state.caster.config.seed if state is not None else None

    return result


def delta_versions(worker, case: dict, opts: dict, world: int) -> dict:
    """verl's delta_sharded source over many weight versions: the seed export and ``prime_delta_snapshots``, then per
    version one optimizer step (``update_actor``) and ``get_per_tensor_param_delta_shard``. Returns, per version,
    the elements the delta engine would send (summed over every rank), the element total, and the step's
    ``faircast/*`` metrics (the audit, reduced over every rank)."""

    engine = worker.actor.engine
    seed, _ = engine.get_per_tensor_param()
    for _ in seed:  # the full export the rollout is seeded with (consumed, as the delta engine streams it)
        pass
    engine.prime_delta_snapshots()
    data = make_batch(opts["batch"], 6, 10, opts["vocab"])
    mb = opts["batch"] * world  # one mini-batch: one optimizer step, one weight version per update_actor
    changed, metrics = [], []
    total = 0
    for _ in range(case["delta_versions"]):
        metrics.append(one_update(worker, data, mb))
        entries, _ = engine.get_per_tensor_param_delta_shard()
        n, total = 0, 0
        for slots, _dtype, _counts, idx, _val, _group in entries:
            n += idx.numel()
            total += sum(math.prod(shape) for _name, shape in slots)
        changed.append(n)
    sent = torch.tensor(changed, dtype=torch.float64)
    torch.distributed.all_reduce(sent)  # each rank sends the changes of its own shards
    return {"changed": sent.tolist(), "total": total, "metrics": metrics,
            "lr": engine.optimizer.param_groups[0]["lr"]}


def one_update(worker, data, mb: int) -> dict:
    """One ``update_actor`` of one mini-batch (one optimizer step, one weight version); its ``faircast/*`` metrics."""
    from verl.utils import tensordict_utils as tu

    td = data.clone()
    tu.assign_non_tensor(td, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=mb, mini_batch_size=mb, epochs=1, seed=0,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True)
    out = worker.update_actor(td)
    step_metrics = (tu.get(out, "metrics") or {}) if out is not None else {}
    return {k: float(v[-1] if isinstance(v, list) else v) for k, v in step_metrics.items() if k.startswith("faircast/")}


def export_versions(worker, case: dict, opts: dict, world: int) -> dict:
    """A full export (``update_weights(mode="naive")``) at version 0 and after each of ``export_versions`` steps of
    one optimizer step each (``update_actor``): per version the exported tensors, the full fp32 masters, and the
    ``faircast/*`` metrics ``update_actor`` returned (the audit, reduced over every rank)."""

    from tests.verl.shims import cpu_platform

    engine = worker.actor.engine
    data = make_batch(opts["batch"], 6, 10, opts["vocab"])
    mb = opts["batch"] * world  # one mini-batch: one optimizer step, one weight version per update_actor
    exported, masters, metrics = [], [], []
    for version in range(case["export_versions"] + 1):
        if version:
            metrics.append(one_update(worker, data, mb))
        cpu_platform.RECEIVED.clear()
        asyncio.run(worker.update_weights(mode="naive"))
        exported.append({k: v.clone() for part in cpu_platform.RECEIVED for k, v in part.items()})
        masters.append(full_masters(engine.module))
    return {"rank": torch.distributed.get_rank(), "exported_by_version": exported, "masters_by_version": masters,
            "metrics": metrics}


def run(opts: dict) -> None:
    rank, world = opts["rank"], opts["world"]
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(opts["port"]))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)

    from tests.verl.shims import cpu_platform

    cpu_platform.install()
    import verl  # noqa: F401  (loads the faircast verl.plugins entry point, as in every verl process)
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from faircast_plugins.patching import is_patched

    assert is_patched(ActorRolloutRefWorker.init_model), "the verl.plugins entry point did not patch verl"

    for case in opts["cases"]:  # several workers, one after the other, in one process group
        torch.manual_seed(0)
        print(f"=== case {case['name']} ===", flush=True)
        result = run_case(case, opts, world)
        torch.save(result, os.path.join(opts["out_dir"], f"{case['name']}_rank{rank}.pt"))
        gc.collect()
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
    from tests.rank_exit import exit_rank

    exit_rank()
