"""verl 0.9.1's own MegatronEngine, end to end, with Fair Cast attached as the verl worker attaches it (CPU, gloo).

    torchrun --nproc-per-node N tests/megatron/verl_engine.py OUT_JSON MODELS_DIR SCENARIO [SCENARIO ...]

Each scenario builds the engine through verl's ``EngineRegistry`` and ``initialize()`` (megatron-bridge's
``AutoBridge`` loads an HF checkpoint of tests/megatron/verl_model.py from MODELS_DIR: ``llama``, or ``qwen3moe``), attaches Fair Cast with ``faircast_plugins.verl.megatron.activate``
(what the worker's ``init_model`` does after ``initialize``), takes train steps through verl's ``train_batch``, and
exports the weights with verl's own ``get_per_tensor_param()`` (what the rollout receives). The reference is built
independently of Fair Cast: the fp32 masters of the optimizer (gathered over DP) exported to HF tensors by the same
bridge export (its conversion tasks, each holding the master instead of the bf16 param: its real TP gather and PP
broadcast), written as an HF safetensors checkpoint, and served from it by ``faircast export``
(``faircast_plugins.export.iter_served``). Fair Cast on: the export must equal it bit for bit; off: the export must
equal round-to-nearest of the same masters. Rank 0 writes ``{scenario: [result per rank]}`` to OUT_JSON.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import os
import shutil
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.megatron import verl_stand_ins  # noqa: E402

verl_stand_ins.install()

from megatron.core import parallel_state as mpu  # noqa: E402

from faircast_plugins import FairCastConfig  # noqa: E402
from faircast_plugins.export import iter_served  # noqa: E402
from faircast_plugins.verl import megatron as verl_megatron  # noqa: E402
from tests.megatron.worker import full_master_and_served  # noqa: E402

SEED = 1234
# scenario -> engine layout and options
SCENARIOS = {
    "on": dict(), "off": dict(faircast=False), "dp2": dict(), "dp2_off": dict(faircast=False),
    "tp2": dict(tp=2), "tp2_off": dict(tp=2, faircast=False), "pp2": dict(pp=2),
    "resume": dict(resume=True), "param_offload": dict(param_offload=True), "param_offload_off": dict(param_offload=True, faircast=False),
    "optimizer_offload": dict(optimizer_offload=True), "moe": dict(moe=True),
    "dp2_overlap": dict(overlap=True),
    # by hand (not in CI): the resume with Fair Cast off, and both without the stand-in that gives each torch Adam
    # state its own ``step`` after megatron-core's load (verl_stand_ins._one_step_per_state_after_load)
    "resume_ef": dict(resume=True, mode="error_feedback"),  # its residuals through verl's checkpoint manager
    "resume_off": dict(resume=True, faircast=False), "resume_shared_step": dict(resume=True, shared_step=True),
    "resume_off_shared_step": dict(resume=True, faircast=False, shared_step=True),
    # faircast/policy_* measured by the engine's train_batch (policy_run)
    "policy": dict(policy=True), "policy_off": dict(policy=True, faircast=False), "policy_tp2": dict(policy=True, tp=2),
}


def build_engine(models_dir, opts):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine.base import EngineRegistry

    mpu.destroy_model_parallel()  # each scenario its own layout (verl initialises it unless already initialised)
    model_dir = os.path.join(models_dir, "qwen3moe" if opts.get("moe") else "llama")
    model_config = HFModelConfig(path=model_dir, use_remove_padding=False, override_config={"attn_implementation": "eager"})
    engine_config = McoreEngineConfig(
        tensor_model_parallel_size=opts.get("tp", 1), pipeline_model_parallel_size=opts.get("pp", 1),
        use_distributed_optimizer=True, dtype="bfloat16", seed=1, use_remove_padding=False, micro_batch_size_per_gpu=2,
        sequence_parallel=False,  # megatron-core's torch norm (no TE) asserts it off
        override_ddp_config={"overlap_param_gather": True, "overlap_grad_reduce": True} if opts.get("overlap") else {},
        param_offload=opts.get("param_offload", False), optimizer_offload=opts.get("optimizer_offload", False),
        override_transformer_config={**verl_stand_ins.TRANSFORMER_OVERRIDES,
                                     **(verl_stand_ins.MOE_OVERRIDES if opts.get("moe") else {})},
        forward_only=False)
    optim_config = McoreOptimizerConfig(
        lr=1e-3, clip_grad=1.0, total_training_steps=10, use_checkpoint_opt_param_scheduler=bool(opts.get("resume")),
        override_optimizer_config={"overlap_param_gather": True} if opts.get("overlap") else None)
    ckpt_config = CheckpointConfig(save_contents=["model", "optimizer", "extra"],
                                   load_contents=["model", "optimizer", "extra"])
    engine = EngineRegistry.new(model_type="language_model", backend="megatron", model_config=model_config,
                                engine_config=engine_config, optimizer_config=optim_config, checkpoint_config=ckpt_config)
    engine.initialize()
    engine._faircast_test_opts = opts
    offload(engine, opts)
    return engine


def offload(engine, opts):
    """What verl's ``to("cpu", ...)`` does on a GPU with ``param_offload`` / ``optimizer_offload`` (at the end of
    ``initialize()``, and on leaving ``train_mode``): its own ``offload_megatron_model_to_cpu`` (the buckets' bf16
    storage resized to 0) and ``offload_megatron_optimizer``. On the CPU platform ``get_device_name()`` is "cpu", so
    verl's ``to("cpu")`` takes its load branch instead: called here directly. ``train_mode`` and
    ``get_per_tensor_param`` load the model back through verl's own ``load_megatron_model_to_gpu``."""
    from verl.utils.megatron_utils import offload_megatron_model_to_cpu, offload_megatron_optimizer

    if opts.get("param_offload"):
        offload_megatron_model_to_cpu(engine.module)
    if opts.get("optimizer_offload"):
        offload_megatron_optimizer(engine.optimizer)


def batch(step, world_dp):
    """Two sequences per DP rank, a function of the step and the DP rank (verl's no-padding nested layout)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    g = torch.Generator().manual_seed(1000 * step + mpu.get_data_parallel_rank())
    lens = [12, 9]
    ids = [torch.randint(4, 128, (n,), generator=g) for n in lens]
    nested = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    mask = [torch.cat([torch.zeros(1, dtype=torch.int64), torch.ones(n - 1, dtype=torch.int64)]) for n in lens]
    data = TensorDict({"input_ids": nested(ids), "position_ids": nested([torch.arange(n) for n in lens]),
                       "loss_mask": nested(mask)}, batch_size=[len(lens)])
    return tu.get_tensordict(tensor_dict=dict(data.items()), non_tensor_dict={
        "use_remove_padding": False, "use_dynamic_bsz": False, "max_token_len_per_gpu": 4096,
        "micro_batch_size_per_gpu": 2, "temperature": 1.0, "global_batch_size": 2 * world_dp,
        "pad_mode": DatasetPadMode.NO_PADDING, "pad_token_id": 0, "use_fused_kernels": False})


def train(engine, steps):
    from functools import partial

    from verl.workers.utils.losses import sft_loss

    losses = []
    for step in steps:
        with engine.train_mode():
            out = engine.train_batch(batch(step, mpu.get_data_parallel_world_size()), loss_function=partial(sft_loss, None))
        losses.append(out.get("metrics", {}).get("loss"))
        offload(engine, engine._faircast_test_opts)
    return losses


def exported(engine):
    """What verl sends to the rollout: its own ``get_per_tensor_param()`` generator, as HF name -> bf16 tensor."""
    gen, _ = engine.get_per_tensor_param()
    return {name: t.detach().cpu().clone() for name, t in gen}


def hf_masters(engine):
    """The fp32 masters of the optimizer as HF tensors, through the bridge's own export (tasks holding the masters)."""
    masters = {}
    for chunk in engine.module:
        for _, (param, master, _served) in full_master_and_served(chunk, engine.optimizer).items():
            masters[id(param)] = master
    tasks = []
    for task in engine.bridge.get_conversion_tasks(engine.module):
        if task is not None and task.param_weight is not None and id(task.param_weight) in masters:
            task = dataclasses.replace(task, param_weight=masters[id(task.param_weight)])
        tasks.append(task)
    out = {name: t.detach().cpu().float().clone() for name, t in
           engine.bridge.export_hf_weights(engine.module, conversion_tasks=tasks, show_progress=False)}
    assert all(t.dtype == torch.float32 for t in out.values())
    return out


def compare(engine, served, version, faircast, mode="stochastic"):
    """The served HF tensors against ``faircast export`` of the HF checkpoint of the masters (on) or RTN (off).
    Other modes than stochastic: ``mismatches`` is None (the reference needs the run's state), the rest as usual."""
    from safetensors.torch import save_file

    masters = hf_masters(engine)
    ckpt = tempfile.mkdtemp(prefix=f"faircast_verl_hf_master_r{dist.get_rank()}_")
    try:
        save_file({n: t.contiguous() for n, t in masters.items()}, os.path.join(ckpt, "model.safetensors"))
        reference = faircast and mode == "stochastic"
        fair = dict(iter_served(ckpt, seed=SEED, version=version, mode="stochastic")) if reference else {}
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    bits = lambda t: t.view(torch.int16)  # noqa: E731
    mismatches, differs_from_rtn = [], 0
    for name, s in served.items():
        rtn = masters[name].to(torch.bfloat16)
        want = fair[name] if reference else None if faircast else rtn
        if want is not None and (s.dtype != torch.bfloat16 or s.shape != want.shape
                                 or not torch.equal(bits(want), bits(s))):
            mismatches.append(name)
        differs_from_rtn += int(s.shape == rtn.shape and not torch.equal(bits(rtn), bits(s)))
    return {"tensors": len(served), "names": sorted(served), "missing": sorted(set(masters) - set(served)),
            "mismatches": mismatches if reference or not faircast else None, "differs_from_rtn": differs_from_rtn}


def policy_run(name, models_dir):
    """Fair Cast (on or off) with ``policy_metrics_every=1``, attached as the worker attaches it: two steps through
    verl's ``train_batch`` (its patched version measures the batch before the update), the ``faircast/*`` metrics the
    worker's ``update_actor`` returns (``MegatronFairCast.metrics``) after each."""
    opts = SCENARIOS[name]
    engine = build_engine(models_dir, opts)
    config = FairCastConfig(enabled=opts.get("faircast", True), seed=SEED, policy_metrics_every=1,
                            policy_metrics_seqs=2)
    fc = verl_megatron.activate(engine, config)
    out = {"coords": {"tp": mpu.get_tensor_model_parallel_rank(), "dp": mpu.get_data_parallel_rank()}, "metrics": []}
    for step in (0, 1):
        out["losses"] = train(engine, [step])
        out["metrics"].append(fc.metrics())
    out["version"] = fc.caster.version
    verl_megatron.PATCHES.remove()
    from faircast_plugins.megatron import remove_megatron_patch

    remove_megatron_patch(engine.optimizer)
    return out


def run(name, models_dir):
    opts = SCENARIOS[name]
    if opts.get("policy"):
        return policy_run(name, models_dir)
    faircast = opts.get("faircast", True)
    engine = build_engine(models_dir, opts)
    config = FairCastConfig(enabled=True, seed=SEED, mode=opts.get("mode", "stochastic"))
    fc = verl_megatron.activate(engine, config) if faircast else None
    out = {"coords": {"tp": mpu.get_tensor_model_parallel_rank(), "pp": mpu.get_pipeline_model_parallel_rank(),
                      "dp": mpu.get_data_parallel_rank()}, "bridge": type(engine.bridge).__name__}
    out["losses"] = train(engine, [0])
    served = exported(engine)
    version = fc.caster.version if fc else None
    out.update(version=version, **compare(engine, served, 1, faircast, config.mode))
    if opts.get("resume"):
        out["resume"] = resume(engine, fc, models_dir, opts, config, served)  # it detaches Fair Cast from both engines
    elif fc is not None:
        verl_megatron.PATCHES.remove()
        from faircast_plugins.megatron import remove_megatron_patch

        remove_megatron_patch(engine.optimizer)
    return out


def resume(engine, fc, models_dir, opts, config, served):
    """Save through verl's checkpoint manager after step 1, take step 2; a fresh engine loads the checkpoint and
    takes step 2 again: verl's exports must be identical, bit for bit (weight version 2 both times). Also what the
    fresh engine holds after the load, before its step: the exported (served) copy against the one ``served`` before
    the save and against ``faircast export`` of the loaded master at version 1, Fair Cast's state against the saved
    one, and how many torch Adam states megatron-core's load left sharing one ``step`` tensor (the stand-in gives each
    its own unless ``shared_step``)."""
    ckpt = os.path.join(tempfile.gettempdir(), f"faircast_verl_ckpt_{os.environ.get('MASTER_PORT', '0')}")
    if dist.get_rank() == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
    dist.barrier()
    faircast = fc is not None
    engine.save_checkpoint(ckpt, global_step=1)
    saved_masters = hf_masters(engine)
    saved_state = copy.deepcopy(fc.caster.state_dict()) if faircast else None
    files = sorted(f for f in os.listdir(ckpt) if f.startswith("faircast_state_rank"))
    train(engine, [1])
    want = exported(engine)
    want_masters = hf_masters(engine)
    if faircast:
        verl_megatron.PATCHES.remove()
        from faircast_plugins.megatron import remove_megatron_patch

        remove_megatron_patch(engine.optimizer)
    verl_stand_ins.SPLIT_SHARED_STEP = not opts.get("shared_step")
    try:
        again = build_engine(models_dir, opts)
        fc2 = verl_megatron.activate(again, config) if faircast else None
        del verl_stand_ins.SHARED_STEP_STATES[:]
        again.load_checkpoint(ckpt)
        shared_step_states = list(verl_stand_ins.SHARED_STEP_STATES)
        loaded_version = fc2.caster.version if faircast else None
        state_differs = _state_differs(saved_state, fc2.caster.state_dict()) if faircast else []
        loaded = hf_masters(again)  # the fp32 masters verl's load restored (== the saved ones if the load is exact)
        loaded_differ = [n for n in saved_masters if not torch.equal(saved_masters[n], loaded[n])]
        left = exported(again)  # the served copy the load left, before a step
        after_load = compare(again, left, 1, faircast, config.mode)
        after_load["differs_from_saved"] = [n for n in served if not torch.equal(served[n].view(torch.int16),
                                                                                  left[n].view(torch.int16))]
        train(again, [1])
    finally:
        verl_stand_ins.SPLIT_SHARED_STEP = True
    got = exported(again)
    diff = [n for n in want if not torch.equal(want[n].view(torch.int16), got[n].view(torch.int16))]
    got_masters = hf_masters(again)
    masters_differ = [n for n in want_masters if not torch.equal(want_masters[n], got_masters[n])]
    check = compare(again, got, 2, faircast, config.mode)
    if faircast:
        verl_megatron.PATCHES.remove()
        from faircast_plugins.megatron import remove_megatron_patch

        remove_megatron_patch(again.optimizer)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
    return {"state_files": files, "loaded_version": loaded_version, "version": fc2.caster.version if faircast else None,
            "mismatches": diff, "masters_differ": masters_differ, "loaded_masters_differ": loaded_differ,
            "tensors": len(want), "check": check, "after_load": after_load, "state_differs": state_differs,
            "shared_step_states": shared_step_states}


def _state_differs(saved, loaded):
    """The entries of two ``FairCaster.state_dict()`` that differ (tensors bit for bit)."""
    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    def same(x, y):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            raw = lambda t: t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
            return x.dtype == y.dtype and x.shape == y.shape and torch.equal(raw(x), raw(y))
        return x == y

    a, b = dict(flat(saved)), dict(flat(loaded))
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not same(a[k], b[k]))


def main():
    out_path, models_dir, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=int(os.environ.get("FAIRCAST_TEST_TIMEOUT", "180"))))
    results = {}
    for name in names:
        try:
            res = run(name, models_dir)
        except Exception:  # noqa: BLE001 - reported to the test
            res = {"error": traceback.format_exc()}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, res)
        results[name] = gathered
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
