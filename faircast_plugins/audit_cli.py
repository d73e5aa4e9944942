"""``faircast estimate`` (formerly ``faircast audit``): how much of one small optimizer step survives the bf16
export, per rounding mode. (The live training metrics, ``faircast_audit: true``, are "the audit".)

Start from bf16 weights (a checkpoint's tensors rounded to bf16, as a run resumed from a bf16 release
starts), take one Adam-like first step ``d = -lr * sign(g) * (1 + 0.5 n)`` with random ``g`` and ``n``, and
export the result with ``nearest`` and ``stochastic``. For each mode print the bias
``|mean(sign(d) * (w - d))|`` (``w`` = the update the bf16 copy received) and its ratio to ``mean|d|``.
Round-to-nearest loses every update below half a bf16 step, so its bias is close to ``mean|d|``;
stochastic rounding is unbiased, so its bias is noise that shrinks with the number of elements.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Iterator, Tuple

import torch

from .cast import fair_cast
from .key import derive_key


def _checkpoint_tensors(path: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """Opens the checkpoint now (a bad path is refused before any output), reads its tensors lazily."""
    from .hf_checkpoint import ExportError, SafetensorsCheckpoint

    try:
        ckpt = SafetensorsCheckpoint(path)
    except ExportError as e:
        raise SystemExit(f"faircast estimate: {e}") from None

    def tensors():
        with ckpt:
            for name in ckpt.names():
                t = ckpt.read(name)
                if t.is_floating_point():
                    yield name, t

    return tensors()


def _tiny_model(seed: int) -> Iterator[Tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = 256, 688, 2048
    yield "model.embed_tokens.weight", torch.randn(vocab, hidden, generator=g) * 0.02
    for layer in range(2):
        p = f"model.layers.{layer}."
        for proj, shape in (("self_attn.q_proj", (hidden, hidden)), ("self_attn.k_proj", (hidden // 4, hidden)),
                            ("self_attn.v_proj", (hidden // 4, hidden)), ("self_attn.o_proj", (hidden, hidden)),
                            ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                            ("mlp.down_proj", (hidden, inter))):
            yield p + proj + ".weight", torch.randn(*shape, generator=g) * 0.02
        yield p + "input_layernorm.weight", 1 + 0.05 * torch.randn(hidden, generator=g)


class _Sums:
    def __init__(self):
        self.n = 0
        self.dev = 0.0
        self.dev_sq = 0.0
        self.abs_d = 0.0

    def add(self, d: torch.Tensor, w: torch.Tensor) -> None:
        dev = torch.sign(d) * (w - d)
        self.n += d.numel()
        self.dev += float(dev.sum())
        self.dev_sq += float((dev * dev).sum())
        self.abs_d += float(d.abs().sum())

    def bias(self) -> float:
        return abs(self.dev / self.n)

    def sigma(self) -> float:
        mean = self.dev / self.n
        return math.sqrt(max(self.dev_sq / self.n - mean * mean, 0.0) / self.n)


def audit_step(tensors, *, lr: float, seed: int, max_elements: int, progress: bool = True) -> dict:
    """Bias of one step for ``nearest`` and ``stochastic`` over the given named fp32/bf16 tensors."""
    g = torch.Generator().manual_seed(seed)
    sums = {"nearest": _Sums(), "stochastic": _Sums()}
    seen = 0
    for name, t in tensors:
        if seen >= max_elements:
            break
        w0 = t.reshape(-1)[: max_elements - seen].to(torch.bfloat16).float()
        seen += w0.numel()
        d = -lr * torch.sign(torch.randn(w0.shape, generator=g)) * (1 + 0.5 * torch.randn(w0.shape, generator=g))
        master = w0 + d
        true = (master - w0).double()  # the update the fp32 master actually received
        for mode, s in sums.items():
            q = fair_cast(master, key=derive_key(seed, 1, name), mode=mode)
            s.add(true, q.double() - w0.double())
        if progress:
            print(f"  {name}: {w0.numel():,} elements", flush=True)
    if not seen:
        raise SystemExit("faircast estimate: the checkpoint has no floating-point tensors")
    out = {"elements": seen, "lr": lr}
    for mode, s in sums.items():
        out[mode] = {"bias": s.bias(), "bias_rel": s.bias() / (s.abs_d / s.n), "sigma": s.sigma()}
    floor = max(sums["stochastic"].bias(), sums["stochastic"].sigma())
    out["ratio"] = sums["nearest"].bias() / floor if floor else float("inf")
    return out


def add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", help="Hugging Face safetensors model directory (default: a tiny random model)")
    parser.add_argument("--lr", type=float, default=1e-5, help="size of the simulated first Adam step (default 1e-5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the simulated step and of the rounding noise")
    parser.add_argument("--max-elements", type=int, default=1 << 22,
                        help="cap on elements read (default 4194304); the nearest/stochastic ratio grows with it "
                             "(stochastic's noise floor shrinks as 1/sqrt(N)); nearest's relative bias does not")
    parser.add_argument("--json", action="store_true", help="print only the result, as JSON, on stdout")


def run_estimate(args: argparse.Namespace) -> int:
    source = _checkpoint_tensors(args.checkpoint) if args.checkpoint else _tiny_model(args.seed)
    print(f"faircast estimate: one step of lr={args.lr:g} from bf16 weights of "
          f"{args.checkpoint or 'a tiny random model'}", file=sys.stderr if args.json else sys.stdout)
    res = audit_step(source, lr=args.lr, seed=args.seed, max_elements=args.max_elements, progress=not args.json)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"\n{'mode':<12}{'|mean signed deviation|':>26}{'relative to mean|update|':>28}")
    for mode in ("nearest", "stochastic"):
        r = res[mode]
        print(f"{mode:<12}{r['bias']:>26.3e}{r['bias_rel']:>28.4f}")
    print(f"\nround-to-nearest loses {100 * res['nearest']['bias_rel']:.0f}% of a lr={args.lr:g} step in the bf16 copy; "
          f"stochastic rounding {100 * res['stochastic']['bias_rel']:.1f}% (its noise over {res['elements']:,} elements)")
    print(f"nearest / stochastic: {res['ratio']:.0f}x (a signal-to-noise figure: it grows with --max-elements; "
          f"stochastic's 1-sigma noise floor {res['stochastic']['sigma']:.2e})")
    return 0


add_audit_arguments, run_audit = add_estimate_arguments, run_estimate  # the deprecated command name
