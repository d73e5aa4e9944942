"""Run by test_fsdp.py under torchrun (2 CPU processes, gloo): TRL trainers on FSDP2 through accelerate, bf16.

    torchrun --nproc_per_node 2 fsdp_grpo.py MODEL_DIR OUT_DIR MODE [vllm|rloo|async|policy]   (MODE: stochastic | off)

Forward pre-hooks on every leaf module record, at every forward (generation, old log-probs, loss), whether the
bf16 weights the forward read equal ``fair_cast(full fp32 master)`` at the current weight version (``off``: the
round-to-nearest copy of the master). The full masters are gathered (``full_tensor()``) at the start of training
and after every optimizer step. With ``vllm``, GRPO generates with a colocated vLLM engine on every rank, and after
each sync every vLLM parameter is compared with the same expected copy. ``rloo`` runs RLOOTrainer instead of GRPO
(no vLLM). ``async`` runs AsyncGRPOTrainer with the test stand-ins of async_stubs.py (rollout worker, recording
weight transfer, CPU tree attention): rank 0 checks every streamed tensor of every sync. ``policy`` turns on
``faircast_policy_metrics_every=1`` and records what each measurement scored, at which weight version. Each rank writes
``OUT_DIR/<MODE>[-<variant>]-rank<R>.pt``.

CPU shim (tests only): fsdp_cpu_shim.py finishes accelerate's FSDP branch for ``MULTI_CPU``.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "trl"))
sys.path.insert(0, HERE)

model_dir, out_dir, mode = sys.argv[1], sys.argv[2], sys.argv[3]
variant = sys.argv[4] if len(sys.argv) > 4 else ""
use_vllm, rloo, is_async = variant == "vllm", variant == "rloo", variant == "async"
policy = variant == "policy"  # faircast_policy_metrics_every=1 on 2 sequences per rank; what each measurement scored
tag = f"{mode}-{variant}" if variant else mode

import torch  # noqa: E402

torch.set_num_threads(1)

import fsdp_cpu_shim  # noqa: E402

fsdp_cpu_shim.install()

import faircast_plugins.trl  # noqa: E402,F401
from datasets import Dataset  # noqa: E402
from tiny import PROMPTS, cat_reward  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402
from trl.experimental.async_grpo import AsyncGRPOConfig  # noqa: E402

from async_stubs import RecordingTransfer, StubRolloutWorker, install_cpu_shims  # noqa: E402

from faircast_plugins import derive_key, fair_cast  # noqa: E402
from faircast_plugins.key import canonical_name  # noqa: E402

SEED = 4321
# FAIRCAST_TEST_REAL_MODEL=1 (tests/realmodel): a real model, so 2 steps of 2 prompts x 2 completions of 4 tokens,
# no checkpoint, and the full masters left out of the result file (540 MB per version at 135M parameters).
REAL = os.environ.get("FAIRCAST_TEST_REAL_MODEL") == "1"
STEPS = 2 if REAL else 3


def full_masters(model):
    return {canonical_name(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


class Recorder(TrainerCallback):
    """Checks every forward of the policy against the expected served copy of the gathered masters."""

    def __init__(self):
        self.trainer = None
        self.version = 0
        self.masters = {}        # version -> {name: full fp32 master}
        self.expected = {}       # (version, name) -> expected bf16
        self.forwards = {"grad": 0, "no_grad": 0}
        self.logp_calls = {"grad": 0, "no_grad": 0}  # loss / old log-probs (_get_per_token_logps_and_entropies)
        self.checked = 0         # weights compared
        self.mismatches = []     # (version, name, dtype)
        self.differs_from_nearest = 0
        self.vllm_syncs = []     # (version, compared, mismatches, differs_from_nearest)
        self.repacked = []       # vLLM parameters repacked on this host (oneDNN/AMX): not comparable bitwise
        self.fsdp_types = set()

    def want(self, version, name):
        key = (version, name)
        if key not in self.expected:
            master = self.masters[version][name]
            if mode == "off":
                self.expected[key] = master.to(torch.bfloat16)
            else:
                self.expected[key] = fair_cast(master, key=derive_key(SEED, version, name), mode=mode, backend="torch")
        return self.expected[key]

    def hook(self, names):
        """``names``: (attribute, canonical name of the parameter) pairs of one leaf module (a tied weight: its owner's)."""
        def pre_forward(module, args):
            for n, name in names:
                t = getattr(module, n).detach()
                t = t.to_local() if hasattr(t, "to_local") else t
                want = self.want(self.version, name)
                self.checked += 1
                if t.dtype != torch.bfloat16 or not torch.equal(t, want):
                    self.mismatches.append((self.version, name, str(t.dtype)))
                master = self.masters[self.version][name]
                self.differs_from_nearest += int(not torch.equal(t.float(), master.to(torch.bfloat16).float()))
        return pre_forward

    def count(self, module, args):
        self.forwards["grad" if torch.is_grad_enabled() else "no_grad"] += 1

    def on_train_begin(self, args, state, control, **kwargs):
        model = self.trainer.model
        self.fsdp_types = sorted({type(m).__name__ for m in model.modules() if "FSDP" in type(m).__name__})
        self.masters[0] = full_masters(model)
        owner = {id(p): canonical_name(n) for n, p in model.named_parameters()}  # tied: lm_head -> embed_tokens
        for prefix, sub in model.named_modules():
            names = [(n, owner[id(p)]) for n, p in sub.named_parameters(recurse=False, remove_duplicate=False)]
            if names and not list(sub.children()):
                sub.register_forward_pre_hook(self.hook(names))
        inner = getattr(model, "model", model)
        inner.register_forward_pre_hook(self.count)
        logps = getattr(self.trainer, "_get_per_token_logps_and_entropies", None)
        if logps is None:  # AsyncGRPO: no old-policy forward (vLLM's sampling log-probs are the old ones)
            return

        def counted(*a, **k):
            self.logp_calls["grad" if torch.is_grad_enabled() else "no_grad"] += 1
            return logps(*a, **k)

        self.trainer._get_per_token_logps_and_entropies = counted
        if use_vllm:
            self._wrap_sync()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.version += 1
        self.masters[self.version] = full_masters(self.trainer.model)

    def _wrap_sync(self):
        generation = self.trainer.vllm_generation
        original = generation.sync_weights

        def sync_weights():
            original()
            self.check_vllm()

        generation.sync_weights = sync_weights

    def check_vllm(self):
        """Every vLLM parameter (fused qkv / gate_up split back) against the expected copy of the current version."""
        model = self.trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
        held = dict(model.named_parameters())
        self.repacked += [n for n, p in held.items() if p.numel() == 0]
        if self.repacked:
            return
        cfg = self.trainer.model.config
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        compared = bad = differs = 0
        for name, master in self.masters[self.version].items():
            if ".q_proj." in name or ".k_proj." in name or ".v_proj." in name:
                part = name.split(".")[-2]
                fused = held[name.replace(f"{part}.", "qkv_proj.")]
                start = {"q_proj": 0, "k_proj": q, "v_proj": q + kv}[part]
                got = fused[start:start + master.shape[0]]
            elif ".gate_proj." in name or ".up_proj." in name:
                part = name.split(".")[-2]
                fused = held[name.replace(f"{part}.", "gate_up_proj.")]
                start = 0 if part == "gate_proj" else cfg.intermediate_size
                got = fused[start:start + master.shape[0]]
            else:
                got = held[name]
            compared += 1
            bad += int(got.dtype != torch.bfloat16 or not torch.equal(got, self.want(self.version, name)))
            differs += int(not torch.equal(got, master.to(torch.bfloat16)))
        self.vllm_syncs.append((self.version, compared, bad, differs))


vllm_args = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, vllm_max_model_length=128,
                 vllm_importance_sampling_correction=True) if use_vllm else {}
if is_async:
    trainer_class = install_cpu_shims()
    config_class = AsyncGRPOConfig
    extra = dict(token_budget=128, vllm_server_timeout=5)
    gen_args = {}
else:
    config_class, trainer_class = (RLOOConfig, RLOOTrainer) if rloo else (GRPOConfig, GRPOTrainer)
    extra = {}
    gen_args = dict(gradient_accumulation_steps=1, steps_per_generation=2, beta=0.0)  # 2 optimizer steps per generation
args = config_class(
    output_dir=os.path.join(out_dir, tag), per_device_train_batch_size=2 if REAL else 4,
    num_generations=2 if REAL else 4, max_completion_length=4 if REAL else 8,
    max_steps=STEPS, learning_rate=1e-4, bf16=True, use_cpu=True, report_to="none",
    # the plain GRPO run also saves a checkpoint at step 2 (FSDP's full state dict + Fair Cast state)
    save_strategy="steps" if not (variant or REAL) else "no", save_steps=2, save_only_model=True,
    logging_steps=1, seed=0, data_seed=0, dataloader_num_workers=0, lr_scheduler_type="constant", warmup_steps=0,
    **gen_args, **extra,
    fsdp="full_shard auto_wrap", fsdp_config={"version": 2, "reshard_after_forward": True},
    faircast=(mode != "off"), faircast_mode=("stochastic" if mode == "off" else mode), faircast_seed=SEED,
    faircast_audit=True, **vllm_args,
    **(dict(faircast_policy_metrics_every=1, faircast_policy_metrics_seqs=2) if policy else {}),
)
recorder = Recorder()
injected = {}
if is_async:
    from transformers import AutoTokenizer

    injected = dict(processing_class=AutoTokenizer.from_pretrained(model_dir), rollout_worker=StubRolloutWorker(),
                    weight_transfer=RecordingTransfer())
from helpers import length_reward  # noqa: E402

trainer = trainer_class(model=model_dir, reward_funcs=length_reward if REAL else cat_reward, args=args,
                        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), callbacks=[recorder], **injected)
recorder.trainer = trainer
measured = []  # policy: per measurement the weight version and the sequences scored (this rank's)
if policy:
    probe = trainer._faircast.policy
    probe_measure = probe.measure

    def measure(model, step, prompt_ids, prompt_mask, completion_ids, completion_mask, **kw):
        n = probe.seqs
        measured.append({"version": recorder.version, "step": step, "temperature": kw["temperature"],
                         "prompt_ids": prompt_ids[:n].cpu(), "prompt_mask": prompt_mask[:n].cpu(),
                         "completion_ids": completion_ids[:n].cpu(), "completion_mask": completion_mask[:n].cpu()})
        return probe_measure(model, step, prompt_ids, prompt_mask, completion_ids, completion_mask, **kw)

    probe.measure = measure
if is_async:
    injected["weight_transfer"].trainer = trainer
trainer.train()
streamed = []  # AsyncGRPO, rank 0: (version, tensors, mismatches, differs from nearest, dtypes) per sync
if is_async and trainer.accelerator.is_main_process:
    for version, sent in injected["weight_transfer"].syncs:
        bad = sum(int(t.dtype != torch.bfloat16 or not torch.equal(t, recorder.want(version, canonical_name(n))))
                  for n, t in sent.items())
        differs = sum(int(not torch.equal(t, recorder.masters[version][canonical_name(n)].to(torch.bfloat16)))
                      for n, t in sent.items())
        streamed.append((version, len(sent), bad, differs, sorted({str(t.dtype) for t in sent.values()})))
export_dtypes = sorted({str(t.dtype) for _, t in trainer.vllm_generation._iter_named_params()}) if use_vllm else []
fc = getattr(trainer, "_faircast", None)
rank = trainer.accelerator.process_index
logs = [{k: v for k, v in h.items() if k.startswith("faircast/")} for h in trainer.state.log_history]
torch.save({
    "rank": rank, "world": trainer.accelerator.num_processes, "is_fsdp": trainer.is_fsdp_enabled,
    "fsdp_version": trainer.accelerator.state.fsdp_plugin.fsdp_version, "fsdp_types": recorder.fsdp_types,
    "param_dtype": str(trainer.accelerator.state.fsdp_plugin.mixed_precision_policy.param_dtype),
    "version": fc.caster.version if fc is not None else None, "steps": trainer.state.global_step,
    "forwards": recorder.forwards, "logp_calls": recorder.logp_calls, "checked": recorder.checked,
    "mismatches": recorder.mismatches[:50],
    "n_mismatches": len(recorder.mismatches), "differs_from_nearest": recorder.differs_from_nearest,
    "masters": {} if REAL else recorder.masters, "vllm_syncs": recorder.vllm_syncs, "repacked": recorder.repacked,
    "export_dtypes": export_dtypes, "streamed": streamed, "output_dir": args.output_dir, "logs": logs,
    "trainer": type(trainer).__name__, "measured": measured,
}, os.path.join(out_dir, f"{tag}-rank{rank}.pt"))
# Leave without interpreter finalization (tests/rank_exit.py says why a rank aborted at exit after every step passed)
import torch.distributed as dist  # noqa: E402

if dist.is_initialized():
    dist.barrier()
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from tests.rank_exit import exit_rank  # noqa: E402

exit_rank()
