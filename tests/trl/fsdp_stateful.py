"""Run by test_fsdp.py under torchrun (2 CPU processes, gloo): GRPO on FSDP2 (bf16) with every Fair Cast mode,
the vLLM export stream recorded, checkpoints and resume. All scenarios of one launch share the process group.

    torchrun --nproc_per_node 2 fsdp_stateful.py MODEL_DIR OUT_DIR SCENARIO [SCENARIO ...]

A scenario is ``MODE:ROLE``:

* MODE: ``stochastic``, ``error_feedback``, ``ema`` (stochastic with ``faircast_ema_decay=EMA_DECAY``) or ``off``
  (Fair Cast off, audit on: the negative control);
* ROLE: ``save`` (4 steps straight through, a full checkpoint -- model, optimizer, RNG, Fair Cast state -- after step
  2), ``resume`` (resume from the ``save`` scenario's ``checkpoint-2``), ``nostate`` (resume from a copy of it without
  the per-rank Fair Cast state files), ``worldsize`` (resume from a copy whose ``faircast.json`` says it was written
  at world size 4), ``fresh`` (``nostate`` with ``faircast_resume_without_state=True``), ``async`` (AsyncGRPOTrainer with the stand-ins of async_stubs.py, 3 steps) or ``run`` (4 steps).

GRPO generates without vLLM (2 optimizer steps per generation batch, so the old log-probs are a separate forward).
What is recorded, per rank, in ``OUT_DIR/<MODE>-<ROLE>.rank<R>.pt``:

* ``masters``: the full fp32 masters (``full_tensor()``) at the start of training and after every optimizer step;
* ``served``: the bf16 weights every leaf module read at its first forward of each weight version (FSDP's cast,
  all-gathered), and ``inconsistent``: forwards of one version that read other bits than the first one;
* ``exported``: the export stream at each version. GRPO: TRL's own ``VLLMGeneration.sync_weights`` in server mode
  (its metadata pass, then the stream, both walking ``_iter_named_params`` on every rank), run after Fair Cast's
  callback at train begin and after every optimizer step, with the vLLM server and its NCCL transport (CUDA only)
  replaced by a client that records what rank 0 would broadcast; AsyncGRPO: what ``_streaming_iter`` sent.

The test compares ``served`` and ``exported`` with a single-process reference replaying the masters.

CPU shim (tests only): fsdp_cpu_shim.py finishes accelerate's FSDP branch for ``MULTI_CPU``.
"""
import gc
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "trl"))
sys.path.insert(0, HERE)

model_dir, out_dir, scenarios = sys.argv[1], sys.argv[2], sys.argv[3:]

import torch  # noqa: E402

torch.set_num_threads(1)

from accelerate.state import AcceleratorState  # noqa: E402

import fsdp_cpu_shim  # noqa: E402

fsdp_cpu_shim.install()

import faircast_plugins.trl  # noqa: E402,F401
from datasets import Dataset  # noqa: E402
from tiny import PROMPTS, cat_reward  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.generation.vllm_generation import VLLMGeneration  # noqa: E402

from faircast_plugins.key import canonical_name  # noqa: E402
from faircast_plugins.patching import FairCastPatchError  # noqa: E402

SEED = 2468
EMA_DECAY = 0.5
STEPS = 4
SAVE_AT = 2


class RecordingClient:
    """Stand-in for TRL's ``VLLMClient`` on rank 0 (the server and NCCL need CUDA): keeps what would be broadcast."""

    def __init__(self):
        self.metadata, self.received = None, None

    def update_named_params(self, metadata, named_params):
        self.metadata = list(metadata)
        self.received = {n: t.detach().clone() for n, t in named_params}

    def reset_prefix_cache(self):
        pass


class RecordingServerGeneration(VLLMGeneration):
    """TRL's ``VLLMGeneration`` in server mode, with ``_init_vllm`` (connect to the server) replaced by the recorder."""

    def _init_vllm(self):
        self.vllm_client = RecordingClient() if self.accelerator.is_main_process else None


def full_masters(model):
    return {canonical_name(n): p.full_tensor().detach().clone() for n, p in model.named_parameters()}


class Recorder(TrainerCallback):
    """Added after Fair Cast's callback; see the module docstring."""

    def __init__(self, trainer, stream: bool):
        self.trainer, self.stream = trainer, stream
        self.version = None
        self.masters, self.served, self.exported, self.metadata = {}, {}, {}, None
        self.inconsistent = []
        self.forwards = {"grad": 0, "no_grad": 0}
        self.generation = None
        self.hooked = False

    def hook(self, prefix, names):
        def pre_forward(module, args):
            served = self.served.setdefault(self.version, {})
            for n in names:
                t = getattr(module, n).detach()
                t = t.to_local() if hasattr(t, "to_local") else t
                name = canonical_name(f"{prefix}.{n}" if prefix else n)
                if name not in served:
                    served[name] = t.clone()
                elif not torch.equal(t, served[name]):
                    self.inconsistent.append((self.version, name))
        return pre_forward

    def count(self, module, args):
        self.forwards["grad" if torch.is_grad_enabled() else "no_grad"] += 1

    def sync(self):
        if not self.stream:
            return
        self.generation.sync_weights()
        client = self.generation.vllm_client
        if client is not None:
            self.exported[self.version] = client.received
            self.metadata = client.metadata

    def on_train_begin(self, args, state, control, **kwargs):
        model = self.trainer.model
        self.version = state.global_step
        self.masters[self.version] = full_masters(model)
        if not self.hooked:
            for prefix, sub in model.named_modules():
                names = [n for n, _ in sub.named_parameters(recurse=False)]
                if names and not list(sub.children()):
                    sub.register_forward_pre_hook(self.hook(prefix, names))
            getattr(model, "model", model).register_forward_pre_hook(self.count)
            self.hooked = True
        if self.stream:
            self.generation = RecordingServerGeneration(model, self.trainer.accelerator, self.trainer.processing_class,
                                                        mode="server")
            self.generation._faircast = getattr(self.trainer, "_faircast", None)  # what the adapter sets on GRPO's
        self.sync()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.version += 1
        self.masters[self.version] = full_masters(self.trainer.model)

    def on_step_end(self, args, state, control, **kwargs):
        self.sync()


def copy_checkpoint(src: str, dst: str, drop_rank_state: bool = False, world_size=None) -> str:
    """A copy of a checkpoint (rank 0 writes it), without its per-rank Fair Cast state or with another world size."""
    if torch.distributed.get_rank() == 0:
        shutil.copytree(src, dst)
        if drop_rank_state:
            for f in os.listdir(dst):
                if f.startswith("faircast_state_rank"):
                    os.remove(os.path.join(dst, f))
        if world_size is not None:
            path = os.path.join(dst, "faircast.json")
            with open(path) as f:
                info = json.load(f)
            info["world_size"] = world_size
            with open(path, "w") as f:
                json.dump(info, f)
    torch.distributed.barrier()
    return dst


def run(scenario: str) -> None:
    mode, role = scenario.split(":")
    tag = f"{mode}-{role}"
    is_async = role == "async"
    resume = None
    if role in ("resume", "nostate", "worldsize", "fresh"):
        resume = os.path.join(out_dir, f"{mode}-save", f"checkpoint-{SAVE_AT}")
        if role in ("nostate", "fresh"):
            resume = copy_checkpoint(resume, os.path.join(out_dir, f"{tag}-checkpoint"), drop_rank_state=True)
        elif role == "worldsize":
            resume = copy_checkpoint(resume, os.path.join(out_dir, f"{tag}-checkpoint"), world_size=4)
    common = dict(
        output_dir=os.path.join(out_dir, tag), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, learning_rate=1e-4, bf16=True, use_cpu=True, report_to="none", logging_steps=1,
        seed=0, data_seed=0, dataloader_num_workers=0, lr_scheduler_type="constant", warmup_steps=0,
        save_strategy="steps" if role == "save" else "no", save_steps=SAVE_AT,
        fsdp="full_shard auto_wrap", fsdp_config={"version": 2, "reshard_after_forward": True},
        faircast=(mode != "off"), faircast_mode=("error_feedback" if mode == "error_feedback" else "stochastic"),
        faircast_seed=SEED, faircast_ema_decay=(EMA_DECAY if mode == "ema" else 0.0), faircast_audit=True,
        faircast_resume_without_state=(role == "fresh"),
    )
    injected = {}
    if is_async:
        from trl.experimental.async_grpo import AsyncGRPOConfig

        from async_stubs import RecordingTransfer, StubRolloutWorker, install_cpu_shims

        trainer_class = install_cpu_shims()
        args = AsyncGRPOConfig(max_steps=3, token_budget=128, vllm_server_timeout=5, **common)
        injected = dict(processing_class=AutoTokenizer.from_pretrained(model_dir), rollout_worker=StubRolloutWorker(),
                        weight_transfer=RecordingTransfer())
    else:
        trainer_class = GRPOTrainer
        args = GRPOConfig(max_steps=STEPS, gradient_accumulation_steps=1, steps_per_generation=2, beta=0.0, **common)
    trainer = trainer_class(model=model_dir, reward_funcs=cat_reward, args=args,
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS}), **injected)
    if is_async:
        injected["weight_transfer"].trainer = trainer
    recorder = Recorder(trainer, stream=not is_async)
    trainer.add_callback(recorder)
    error = None
    try:
        trainer.train(resume_from_checkpoint=resume)
    except FairCastPatchError as e:
        if role not in ("nostate", "worldsize"):
            raise
        error = str(e)
    rank = trainer.accelerator.process_index
    exported = recorder.exported
    if is_async:
        exported = {version: sent for version, sent in injected["weight_transfer"].syncs}
    fc = getattr(trainer, "_faircast", None)
    torch.save({
        "rank": rank, "world": trainer.accelerator.num_processes, "is_fsdp": trainer.is_fsdp_enabled,
        "trainer": type(trainer).__name__, "mode": mode, "seed": SEED, "ema_decay": args.faircast_ema_decay,
        "error": error, "steps": trainer.state.global_step, "version": fc.caster.version if fc is not None else None,
        "masters": recorder.masters, "served": recorder.served, "inconsistent": recorder.inconsistent,
        "forwards": recorder.forwards, "exported": exported, "metadata": recorder.metadata,
        "output_dir": args.output_dir,
        "logs": [{k: v for k, v in h.items() if k.startswith("faircast/")} for h in trainer.state.log_history],
    }, os.path.join(out_dir, f"{tag}.rank{rank}.pt"))
    del trainer, recorder
    gc.collect()
    AcceleratorState._reset_state(reset_partial_state=False)  # the next scenario builds a new FSDP plugin
    torch.distributed.barrier()


for scenario in scenarios:
    run(scenario)
