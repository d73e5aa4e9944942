"""The A/B's warm starts, saved in bf16 like real checkpoints.

* :func:`warm_start`: a small Qwen3 trained here from scratch by SFT from a fixed seed (the toy testbed);
* :func:`finetune_warm_start`: a pretrained model (``--model smollm2``) fine-tuned briefly on the task's answer
  format (the protocol's ``sft``), so that GRPO starts where some groups have a success to learn from.

Saved in bf16, so the fp32 masters of every arm start on the bf16 grid (as when a run loads a released model).
The result is cached under ``out/`` by the spec's hash: every arm and seed of an A/B starts from the same file.
The SFT runs with a fixed number of torch threads (``SFT_THREADS``), whatever the calling process has: another
thread count sums in another order and gives another warm start (measured: 1 thread and 2 threads give held-out
expected success 35.8% and 35.4% from the same seed). Its bits also depend on the CPU's kernels (recorded).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from ..export import export_served
from .provenance import machine
from .scoring import encode, score_model
from .task import build_char_tokenizer, task_problems


#: torch threads of the warm-start SFT (fixed, so the warm start does not depend on the caller's thread count).
SFT_THREADS = 2


@dataclass(frozen=True)
class WarmStartSpec:
    task: str = "add2"
    hidden_size: int = 256
    layers: int = 2
    heads: int = 4
    sft_steps: int = 175
    sft_batch: int = 256
    sft_lr: float = 1e-3
    seed: int = 0
    heldout: int = 1000

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def build_model(spec: WarmStartSpec, vocab_size: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if spec.hidden_size % spec.heads:
        raise ValueError(f"hidden_size {spec.hidden_size} is not a multiple of heads {spec.heads}")
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=spec.hidden_size, intermediate_size=4 * spec.hidden_size,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
        head_dim=spec.hidden_size // spec.heads, max_position_embeddings=64, tie_word_embeddings=False,
        eos_token_id=0, pad_token_id=0, bos_token_id=None,
    )
    torch.manual_seed(spec.seed)
    return Qwen3ForCausalLM(config)


def sft(model, tokenizer, spec: WarmStartSpec, log: Callable[[str], None] = print) -> dict:
    """Plain fp32 SFT on the training problems' answers (loss on the answer tokens only)."""
    train, heldout = task_problems(spec.task, spec.seed, spec.heldout)
    enc = encode(tokenizer, train)
    rows = [p + a for p, a in zip(enc.prompt_ids, enc.answer_ids)]
    if len({len(r) for r in rows}) != 1:
        raise ValueError("the built-in SFT expects equal-length problems")
    ids = torch.tensor(rows)
    n_ans = len(enc.answer_ids[0])
    gen = torch.Generator().manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, weight_decay=0.0)
    model.train()
    start = time.time()
    for step in range(1, spec.sft_steps + 1):
        batch = ids[torch.randint(len(ids), (spec.sft_batch,), generator=gen)]
        logits = model(input_ids=batch).logits[:, -n_ans - 1:-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, -n_ans:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == spec.sft_steps:
            log(f"  warm start SFT step {step}/{spec.sft_steps}  loss {loss.item():.3f}  ({time.time() - start:.0f} s)")
    return score_model(model, encode(tokenizer, heldout))


def warm_start(root: str, spec: WarmStartSpec, log: Callable[[str], None] = print) -> str:
    """The warm-start model directory for ``spec`` under ``root`` (built once, then reused)."""
    path = os.path.join(root, f"warmstart-{spec.task}-{spec.digest()}")
    info_file = os.path.join(path, "warmstart.json")
    if os.path.isfile(info_file):
        return path
    log(f"building the warm start ({spec.task}, d={spec.hidden_size}, {spec.layers} layers, SFT {spec.sft_steps} steps)")
    tmp = path + f".tmp{os.getpid()}"
    tokenizer = build_char_tokenizer(tmp)
    model = build_model(spec, len(tokenizer))
    threads = torch.get_num_threads()
    torch.set_num_threads(SFT_THREADS)
    try:
        fp32_scores = sft(model, tokenizer, spec, log)
    finally:
        torch.set_num_threads(threads)
    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp)
    bf16_scores = score_model(model.float(), encode(tokenizer, task_problems(spec.task, spec.seed, spec.heldout)[1]))
    info = {"spec": asdict(spec), "heldout_fp32": fp32_scores, "heldout_bf16": bf16_scores,
            "parameters": sum(p.numel() for p in model.parameters()), "sft_threads": SFT_THREADS, "machine": machine()}
    with open(os.path.join(tmp, "warmstart.json"), "w") as f:
        json.dump(info, f, indent=1)
    os.replace(tmp, path)
    log(f"warm start: {info['parameters'] / 1e6:.1f}M parameters, held-out expected success "
        f"{bf16_scores['expected']:.3f}, greedy {bf16_scores['greedy']:.3f} (bf16)")
    return path


@dataclass(frozen=True)
class FinetuneSpec:
    """A short fp32 SFT of a pretrained model on the training problems' answers (the protocol's ``sft``).

    Full-parameter AdamW, loss on the answer tokens only, ``batch`` problems drawn with ``seed`` per step; the
    result is rounded to bf16 (round to nearest, as a released checkpoint) and scored on the held-out problems.
    """
    steps: int = 40
    batch: int = 16
    lr: float = 1e-5
    seed: int = 0
    #: how the fp32 result becomes the bf16 checkpoint: ``stochastic`` (the package's export, ``faircast export``
    #: with this seed at version 0) or ``nearest`` (what ``model.to(torch.bfloat16)`` does)
    rounding: str = "stochastic"

    def __post_init__(self):
        if self.rounding not in ("stochastic", "nearest"):
            raise ValueError(f"protocol sft.rounding must be 'stochastic' or 'nearest', got {self.rounding!r}")
        for name in ("steps", "batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"protocol sft.{name} must be a positive integer, got {getattr(self, name)!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"protocol sft.lr must be > 0, got {self.lr!r}")


def answer_batch(tokenizer, problems):
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 outside the answer tokens)."""
    enc = encode(tokenizer, problems)
    rows = [p + a for p, a in zip(enc.prompt_ids, enc.answer_ids)]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (r, a) in enumerate(zip(rows, enc.answer_ids)):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
        labels[i, len(r) - len(a):len(r)] = torch.tensor(a)
    return ids, mask, labels


def finetune(model, tokenizer, train, spec: FinetuneSpec, log: Callable[[str], None] = print) -> list:
    """:class:`FinetuneSpec`'s SFT of ``model`` (fp32) on ``train``; returns the loss of every step."""
    gen = torch.Generator().manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    model.train()
    start, losses = time.time(), []
    for step in range(1, spec.steps + 1):
        picks = torch.randint(len(train), (spec.batch,), generator=gen).tolist()
        ids, mask, labels = answer_batch(tokenizer, [train[i] for i in picks])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 5 == 0 or step == spec.steps:
            log(f"  SFT warm start step {step}/{spec.steps}  loss {losses[-1]:.3f}  ({time.time() - start:.0f} s)")
    model.eval()
    return losses


def finetune_warm_start(root: str, base: str, task: str, train, heldout, spec: FinetuneSpec,
                        log: Callable[[str], None] = print) -> str:
    """The fine-tuned model directory for (``base``, ``task``, ``spec``) under ``root`` (built once, then reused).

    The cache key holds the base model's directory name (the real-model builder names its version there), the task,
    the held-out size and the spec. Runs with ``SFT_THREADS`` torch threads, like :func:`warm_start`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ident = {"base": os.path.basename(os.path.normpath(base)), "task": task, "heldout": len(heldout),
             "spec": asdict(spec)}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(root, f"sft-{ident['base']}-{task}-{digest}")
    if os.path.isfile(os.path.join(path, "warmstart.json")):
        return path
    log(f"building the SFT warm start of {ident['base']} on {task} ({spec.steps} steps of {spec.batch}, lr {spec.lr})")
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    held = encode(tokenizer, heldout)
    tmp, master_dir = path + f".tmp{os.getpid()}", path + f".fp32-tmp{os.getpid()}"
    threads = torch.get_num_threads()
    torch.set_num_threads(SFT_THREADS)
    try:
        before = score_model(model, held, batch_size=50)
        losses = finetune(model, tokenizer, train, spec, log)
        scores = {"fp32": score_model(model, held, batch_size=50)}
        model.save_pretrained(master_dir)
        tokenizer.save_pretrained(master_dir)
        for rounding in ("nearest", "stochastic"):
            out = tmp if rounding == spec.rounding else master_dir + "-" + rounding
            export_served(master_dir, out, seed=spec.seed, version=0, mode=rounding)
            copy = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
            scores[rounding] = score_model(copy, held, batch_size=50)
            del copy
            if out != tmp:
                shutil.rmtree(out)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(master_dir, ignore_errors=True)
    info = {"base": ident["base"], "task": task, "spec": asdict(spec), "losses": losses, "heldout_base": before,
            "heldout_fp32": scores["fp32"], "heldout_nearest": scores["nearest"],
            "heldout_stochastic": scores["stochastic"], "heldout_bf16": scores[spec.rounding],
            "sft_threads": SFT_THREADS, "parameters": sum(p.numel() for p in model.parameters()), "machine": machine()}
    with open(os.path.join(tmp, "warmstart.json"), "w") as f:
        json.dump(info, f, indent=1)
    os.replace(tmp, path)
    log(f"SFT warm start: held-out expected success {before['expected']:.4f} -> fp32 {scores['fp32']['expected']:.4f}, "
        f"bf16 round-to-nearest {scores['nearest']['expected']:.4f}, stochastic {scores['stochastic']['expected']:.4f} "
        f"(saved: {spec.rounding})")
    return path


def warm_start_info(path: str) -> Optional[dict]:
    f = os.path.join(path, "warmstart.json")
    return json.load(open(f)) if os.path.isfile(f) else None
