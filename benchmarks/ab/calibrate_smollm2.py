"""Calibration of the real-model A/B (issue #28 item 4), EXPLORATION: SmolLM2-135M-Instruct on the word2 task.

Measures on this machine, and writes one JSON record (with the CPU, its ISA flags, the load average before and
after, the code's commit and dirty state, taken at the start):

1. **step time** of one AdamW step of the full model (``--batch`` sequences of prompt + worked answer, the loss on
   the answer tokens) for three compute kinds:
   ``fp32`` (fp32 masters, fp32 arithmetic), ``bf16-autocast`` (torch CPU autocast to bf16 around the forward),
   ``fp32-on-served`` (fp32 arithmetic on the bf16 copy an arm serves, here round-to-nearest: the parameters hold
   ``RTN(master)`` upcast to fp32 during forward and backward, the gradient goes to the fp32 master);
2. **served elements changed per step and the lag** of the standard export (round-to-nearest), Fair Cast
   (stochastic, fresh noise each step) and sticky, at each ``--lrs``, over ``--steps`` AdamW steps from the
   bf16 checkpoint, measured by the package's audit (the harness's definition: lag over a window of 8 steps,
   4096 sampled elements per tensor) and the changed fraction over every element;
3. **the starting point of the task**: the bf16 checkpoint's exact expected success (teacher-forced probability
   of the whole worked solution) and greedy success on held-out problems.

The gradient of part 2 is a supervised proxy (the log-likelihood of the worked solutions), not GRPO's: it sets the
update size the way an RL step of the same learning rate would only roughly. Labelled as such in the record.

    python benchmarks/ab/calibrate_smollm2.py --out docs/ab/smollm2-calibration/calibration.json
    python benchmarks/ab/calibrate_smollm2.py --summarize docs/ab/smollm2-calibration/*.json   # the tables
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import time

import torch

from faircast_plugins.ab.provenance import code_provenance, machine, versions
from faircast_plugins.ab.scoring import encode, score_model
from faircast_plugins.ab.task import word2_problems
from faircast_plugins.ab.warmstart import answer_batch as batch  # right-padded ids, mask, labels (answer only)
from faircast_plugins.audit import Audit
from faircast_plugins.cast import fair_cast
from faircast_plugins.key import derive_key, sticky_key

KINDS = ("fp32", "bf16-autocast", "fp32-on-served")


def load_model(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # fp32 masters on the bf16 grid
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok


class ServedSwap:
    """Puts RTN(master), upcast to fp32, into the parameters for forward and backward; puts the masters back."""

    def __init__(self, model):
        self.params = [p for p in model.parameters()]
        self.masters = None

    def __enter__(self):
        self.masters = [p.data for p in self.params]
        for p in self.params:
            p.data = p.data.to(torch.bfloat16).to(torch.float32)
        return self

    def __exit__(self, *exc):
        for p, m in zip(self.params, self.masters):
            p.data = m


def one_step(model, opt, data, kind: str) -> dict:
    ids, mask, labels = data
    t0 = time.perf_counter()
    swap = ServedSwap(model) if kind == "fp32-on-served" else None
    if swap:
        swap.__enter__()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if kind == "bf16-autocast" else torch.autocast("cpu", enabled=False)
    with ctx:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    if swap:
        swap.__exit__()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    return {"forward_s": t1 - t0, "backward_s": t2 - t1, "optimizer_s": t3 - t2, "total_s": t3 - t0,
            "loss": loss.item()}


def step_times(path, tok, train, args) -> dict:
    out = {}
    for kind in args.kinds:
        model, _ = load_model(path)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        reps = []
        for r in range(args.reps + 1):  # the first is a warm-up, not counted
            data = batch(tok, train[r * args.batch:(r + 1) * args.batch])
            res = one_step(model, opt, data, kind)
            if r:
                reps.append(res)
            print(f"  {kind} rep {r}: {res['total_s']:.1f} s (fwd {res['forward_s']:.1f}, bwd {res['backward_s']:.1f}, "
                  f"opt {res['optimizer_s']:.1f})", flush=True)
        out[kind] = {"reps": reps, "mean_total_s": sum(x["total_s"] for x in reps) / len(reps),
                     "tokens_per_step": int(data[1].sum())}
        del model, opt
    return out


def exports(model, step: int, seed: int):
    """The three served copies of the masters at weight version ``step``: RTN, SR (fresh key), sticky."""
    out = {"standard": {}, "faircast": {}, "sticky": {}}
    for name, p in model.named_parameters():
        x = p.data.contiguous()
        out["standard"][name] = x.to(torch.bfloat16)
        out["faircast"][name] = fair_cast(x, key=derive_key(seed, step, name))
        out["sticky"][name] = fair_cast(x, key=sticky_key(seed, name), mode="sticky")
    return out


def changed_and_lag(path, tok, train, lr: float, args) -> dict:
    model, _ = load_model(path)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    audits = {k: Audit(4096) for k in ("standard", "faircast", "sticky")}
    total = sum(p.numel() for p in model.parameters())
    prev, rows = exports(model, 0, args.seed), []
    for k, a in audits.items():
        for name, p in model.named_parameters():
            a.observe(name, 0, p.data, prev[k][name])
    rng = random.Random(args.seed)
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        res = one_step(model, opt, batch(tok, rng.sample(train, args.batch)), "fp32")
        cur = exports(model, step, args.seed)
        row = {"step": step, "loss": res["loss"], "step_s": time.perf_counter() - t0}
        for k, a in audits.items():
            changed = sum(int((cur[k][n].view(torch.int16) != prev[k][n].view(torch.int16)).sum()) for n in cur[k])
            row[f"{k}_changed_frac"] = changed / total
            for name, p in model.named_parameters():
                a.observe(name, step, p.data, cur[k][name])
            m = a.metrics()
            row[f"{k}_lag_steps"] = m.get("faircast/lag_steps")
            row[f"{k}_bias_rel"] = m.get("faircast/bias_rel")
        prev = cur
        rows.append(row)
        print(f"  lr {lr:g} step {step}: " + ", ".join(
            f"{k} changed {100 * row[f'{k}_changed_frac']:.3f}% lag {row[f'{k}_lag_steps'] or float('nan'):.1f}"
            for k in audits), flush=True)
    return {"lr": lr, "steps": rows, "parameters": total}


@torch.no_grad()
def greedy_success(model, tok, problems, max_new: int) -> dict:
    from faircast_plugins.ab.task import success, word2_answer

    tok.padding_side = "left"
    ok = numeric = 0
    samples = []
    for i in range(0, len(problems), 16):
        chunk = problems[i:i + 16]
        enc = tok([p.prompt for p in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
        for p, row in zip(chunk, out[:, enc["input_ids"].shape[1]:]):
            text = tok.decode(row, skip_special_tokens=True)
            ok += success(text, p.answer)
            numeric += word2_answer(text.split("\n")[0]) == word2_answer(p.answer)
            if len(samples) < 4:
                samples.append({"answer": p.answer, "completion": text})
    return {"n": len(problems), "greedy_format_success": ok / len(problems),
            "greedy_numeric_correct": numeric / len(problems), "samples": samples}


def summarize(paths) -> str:
    """Markdown tables of calibration records: step times per compute kind, served changes and lag per step."""
    lines = []
    for path in paths:
        with open(path) as f:
            rec = json.load(f)
        hw = rec["hardware"]
        lines += [f"**{os.path.basename(path)}** ({rec['label']}): started {rec['started']}, code "
                  f"`{(rec['code'] or {}).get('commit', '')[:10]}` dirty={(rec['code'] or {}).get('dirty')}; "
                  f"{hw['cpu']}, {hw['cores']} vCPUs, ISA {', '.join(hw['isa'])}; torch threads {rec['threads']}; "
                  f"load average at start {rec['loadavg_start'][0]:.1f}, at the last save {rec['loadavg_now'][0]:.1f} "
                  f"({rec['machine_note']}); prompts ~{rec['prompt_tokens']} tokens, answers ~{rec['answer_tokens']}.", ""]
        if "task_start" in rec:
            t = rec["task_start"]
            g = t["generation"]
            lines += [f"Start of the task (bf16 checkpoint, fp32 arithmetic): exact expected success of the worked "
                      f"solution {100 * t['heldout_expected_and_greedy']['expected']:.2f}% and teacher-forced greedy "
                      f"{100 * t['heldout_expected_and_greedy']['greedy']:.1f}% on {rec['args']['heldout']} held-out "
                      f"problems; free greedy decoding of {g['n']}: whole solution {100 * g['greedy_format_success']:.1f}%, "
                      f"right final number {100 * g['greedy_numeric_correct']:.1f}%.", ""]
        if "step_times" in rec:
            lines += [f"| compute kind | one AdamW step, {rec['args']['batch']} sequences (s) | forward | backward | "
                      f"optimizer | reps |", "| --- | --- | --- | --- | --- | --- |"]
            for kind, v in rec["step_times"].items():
                m = lambda k: sum(r[k] for r in v["reps"]) / len(v["reps"])  # noqa: E731
                lines.append(f"| {kind} | {m('total_s'):.1f} | {m('forward_s'):.1f} | {m('backward_s'):.1f} | "
                             f"{m('optimizer_s'):.1f} | {len(v['reps'])} |")
            lines.append("")
        for c in rec.get("changed_and_lag", []):
            lines += [f"lr {c['lr']:g} ({c['parameters'] / 1e6:.1f}M parameters, {rec['args']['batch']} sequences "
                      f"per step, supervised proxy gradient):", "",
                      "| step | standard: served changed | lag (steps) | faircast: changed | lag | sticky: changed | lag |",
                      "| --- | --- | --- | --- | --- | --- | --- |"]
            f = lambda x: "" if x is None else f"{x:.1f}"  # noqa: E731
            for r in c["steps"]:
                lines.append(f"| {r['step']} | {100 * r['standard_changed_frac']:.3f}% | {f(r['standard_lag_steps'])} | "
                             f"{100 * r['faircast_changed_frac']:.3f}% | {f(r['faircast_lag_steps'])} | "
                             f"{100 * r['sticky_changed_frac']:.3f}% | {f(r['sticky_lag_steps'])} |")
            lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--summarize"]:
        print(summarize(argv[1:]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: faircast_plugins.real_model.smollm2_checkpoint())")
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="times,changed,task", help="comma-separated: times, changed, task")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--batch", type=int, default=16, help="sequences per step (4 prompts x 4 completions)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--lrs", default="1e-6,3e-6")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--heldout", type=int, default=200)
    ap.add_argument("--greedy", type=int, default=48, help="held-out problems decoded greedily")
    ap.add_argument("--seed", type=int, default=1000, help="not a seed the pre-registered run uses")
    args = ap.parse_args(argv)
    args.kinds = args.kinds.split(",")
    parts = args.parts.split(",")
    path = args.model
    if path is None:
        from faircast_plugins.real_model import smollm2_checkpoint

        path = str(smollm2_checkpoint())
    record = {"label": "EXPLORATION (issue #28 item 4): calibration, not evidence",
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "code": code_provenance(), "hardware": machine(), "versions": versions(),
              "threads": torch.get_num_threads(), "loadavg_start": os.getloadavg(),
              "machine_note": "2 vCPUs shared with 4 other engineers' jobs: times are upper bounds for a quiet machine",
              "model": path, "args": vars(args)}
    train, heldout = word2_problems(0, args.heldout)
    model, tok = load_model(path)
    record["answer_tokens"] = sorted(len(a) for a in encode(tok, heldout).answer_ids)[len(heldout) // 2]
    record["prompt_tokens"] = sorted(len(p) for p in encode(tok, heldout).prompt_ids)[len(heldout) // 2]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save():
        record["loadavg_now"] = os.getloadavg()
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)

    if "task" in parts:
        t0 = time.perf_counter()
        record["task_start"] = {"heldout_expected_and_greedy": score_model(model, encode(tok, heldout), batch_size=50),
                                "generation": greedy_success(model, tok, heldout[:args.greedy], 40)}
        record["task_start"]["seconds"] = time.perf_counter() - t0
        print("task:", json.dumps(record["task_start"])[:600], flush=True)
        save()
    del model
    if "times" in parts:
        record["step_times"] = step_times(path, tok, train, args)
        save()
    if "changed" in parts:
        record["changed_and_lag"] = [changed_and_lag(path, tok, train, float(lr), args) for lr in args.lrs.split(",")]
        save()
    record["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
