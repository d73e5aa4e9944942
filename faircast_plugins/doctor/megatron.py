"""Doctor check ``megatron``: megatron-core's patched main->model param copy, a tiny GPT at world size 1 on the GPU.

Megatron-core trains on CUDA, so this check runs there (NCCL, the current CUDA device): a tiny GPT (local layer
spec, no downloads) is trained with megatron-core's own ``get_megatron_optimizer``, once with the distributed optimizer
and once with the Float16 optimizer, each with Fair Cast attached (:func:`apply_megatron_patch`). After each of two
steps every bf16 param -- what the next forward computes with and what verl's bridge, NeMo-RL and slime export --
must be ``fair_cast(fp32 master)`` at the new weight version, keyed here from the param's name in the unwrapped model
(ROUNDING.md, "Megatron-core without a converter": world size 1, so the name and flat index are the native ones).
Detached, the next step's copy must be round-to-nearest (the class-level wraps are inert without Fair Cast).
Every cast site the patch wraps must resolve, be Fair Cast's wrapper, and keep the signature the wrapper assumes.

Without CUDA it raises :class:`~faircast_plugins.doctor.DoctorCannotRun`. ``check(device="cpu")`` runs it on the
CPU over gloo, which megatron-core can only do once the caller has replaced its CUDA-only calls (the test suite's
stand-ins, ``tests/megatron/cpu_shims.py``; none ships in this package).
"""
from __future__ import annotations

import inspect
from typing import Dict, List, Optional

from . import SEED, DoctorCannotRun, check_served, expect, world_of_one

DISTRIBUTION = "megatron-core"
STEPS = 2
VOCAB, SEQ, MBS = 96, 16, 2


def _device(device: Optional[str]):
    import torch

    from ..patching import installed_version

    if installed_version(DISTRIBUTION) is None:
        raise DoctorCannotRun(f"{DISTRIBUTION} is not installed: there is no Megatron-core stack to check here")
    if device is None:
        if not torch.cuda.is_available():
            raise DoctorCannotRun(
                f"this check needs a CUDA GPU: it runs a real {DISTRIBUTION} optimizer step, and Megatron-core trains on "
                f"CUDA, but torch {torch.__version__} sees no CUDA device here. Run `faircast doctor megatron` on a GPU "
                f"node of the training image (one GPU is enough)")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


def cast_sites(patches) -> List[str]:
    """Every target of the Megatron patch set resolves to Fair Cast's wrapper around a megatron-core method with the
    signature the wrapper assumes: the copies take nothing but ``self`` (their wrapper drops any argument), the steps
    need nothing else (their wrapper passes arguments through). Returns ``Class.method(signature)`` per target."""
    from ..patching import is_patched, resolve

    sites = []
    for target in patches.targets:
        _, attr, value = resolve(target)
        where = target.split(":", 1)[1]
        expect(is_patched(value), f"{where} is not Fair Cast's wrapper after the Megatron patch was installed")
        signature = inspect.signature(value)  # megatron-core's own (follows the wrapper's __wrapped__)
        rest = list(signature.parameters.values())[1:]
        if attr == "_copy_main_params_to_model_params":
            expect(not rest, f"megatron-core's {where}{signature} takes arguments: Fair Cast's cast replaces the copy "
                             f"without them, so this megatron-core is not supported")
        else:
            required = [p.name for p in rest if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            expect(not required, f"megatron-core's {where}{signature} requires {required}: not the step Fair Cast wraps")
        sites.append(f"{where}{signature}")
    return sites


def _build(device, distributed: bool):
    """A tiny GPT (2 layers, GQA, SwiGLU, RMSNorm, bf16) in Megatron's DDP and its optimizer; ``{id(param): (name in
    the unwrapped model, param)}`` of its bf16 params."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    ps.destroy_model_parallel()
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    config.finalize_model_grads_func = finalize_model_grads
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                   max_sequence_length=SEQ, share_embeddings_and_output_weights=False)
    if device.type == "cuda":
        gpt = gpt.cuda(device)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=Float16Module(config, gpt))
    named = {id(p): (n, p) for n, p in gpt.named_parameters() if p.dtype == torch.bfloat16}  # bf16 in Float16Module
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16,
                        use_distributed_optimizer=distributed, clip_grad=1.0), [model])
    return model, optimizer, named


def _train_step(model, optimizer, step: int, device) -> bool:
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g).to(device)
    position_ids = torch.arange(SEQ, device=device).unsqueeze(0).expand(MBS, -1)
    labels = torch.roll(tokens, -1, dims=1)

    def forward_step(data_iterator, m):
        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return m(tokens, position_ids, None, labels=labels), loss_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
                                num_microbatches=1, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
    result = optimizer.step()
    return bool(result[0] if isinstance(result, tuple) else result)


def _masters(optimizer) -> Dict[int, "object"]:
    """``{id(bf16 param): its fp32 main param}``, read from megatron-core's optimizer groups (world size 1: each main
    param, or distributed-optimizer shard, holds the whole param)."""
    out = {}
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        if hasattr(opt, "shard_fp32_from_float16_groups"):
            pairs = zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups)
        else:
            pairs = zip(opt.float16_groups, opt.fp32_from_float16_groups)
        for params, mains in pairs:
            for p, main in zip(params, mains):
                expect(main.numel() == p.numel(), f"a main param holds {main.numel()} of {p.numel()} elements at "
                                                  f"world size 1")
                out[id(p)] = main.detach().view(p.shape).clone()
    return out


def _optimizer_run(device, distributed: bool) -> str:
    """Two steps with Fair Cast (served == fair_cast(master)), then one detached (served == round-to-nearest)."""
    import torch

    from ..caster import FairCaster
    from ..config import FairCastConfig
    from ..megatron import apply_megatron_patch, remove_megatron_patch

    model, optimizer, named = _build(device, distributed)
    fc = apply_megatron_patch(optimizer, FairCaster(FairCastConfig(enabled=True, seed=SEED)), model_chunks=[model])
    expect(fc is not None, "apply_megatron_patch attached nothing with Fair Cast enabled")
    kind = "+".join(type(o).__name__ for o in getattr(optimizer, "chained_optimizers", None) or [optimizer])
    what = f"{kind} main->model copy"
    elements = sum(p.numel() for _, p in named.values())
    distinct = False
    try:
        for step in range(STEPS):
            expect(_train_step(model, optimizer, step, device), f"{kind}: step {step + 1} was skipped")
            version = step + 1
            expect(fc.caster.version == version, f"{kind}: weight version {fc.caster.version} after {version} steps")
            masters = _masters(optimizer)
            expect(set(masters) == set(named), f"{kind}: the optimizer holds {len(masters)} bf16 params, the model "
                                               f"{len(named)}")
            for i, (name, p) in named.items():
                distinct |= check_served(what, name, p, masters[i], version)
            expect(fc.last_step_elements == elements,
                   f"{kind}: Fair Cast cast {fc.last_step_elements} of the {elements} bf16 elements in step {version}")
    finally:
        remove_megatron_patch(optimizer)
    expect(distinct, f"{kind}: the served copies equal round-to-nearest everywhere: the check cannot tell them apart")
    # The control: detached, the same (still wrapped) copy is megatron-core's round-to-nearest.
    expect(_train_step(model, optimizer, STEPS, device), f"{kind}: the control step was skipped")
    masters = _masters(optimizer)
    for i, (name, p) in named.items():
        want = masters[i].float().cpu().to(torch.bfloat16)
        got = p.detach().cpu()
        bad = int((got.view(torch.int16) != want.view(torch.int16)).sum())
        expect(bad == 0, f"{kind} with Fair Cast detached: {bad} of {want.numel()} elements of {name} are not "
                         f"round-to-nearest of the master: the patch is not inert without Fair Cast")
    expect(fc.caster.version == STEPS, f"{kind}: the detached step moved the weight version to {fc.caster.version}")
    return (f"{kind}: all {len(named)} bf16 params ({elements} elements) after each of {STEPS} steps are "
            f"fair_cast(master); detached, the next copy is round-to-nearest")


def check(device: Optional[str] = None) -> List[str]:
    """Run the check on ``device`` (default: the current CUDA device; ``"cpu"`` only with megatron-core's CUDA-only
    calls replaced by the caller). Returns evidence lines; raises :class:`DoctorFailure` or :class:`DoctorCannotRun`."""
    import torch

    dev = _device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # NCCL's world of one and Megatron's buffers on the same device
    from megatron.core import parallel_state as ps

    from ..megatron import install_megatron_patch

    patches = install_megatron_patch()
    sites = cast_sites(patches)
    lines = [f"megatron-core {patches.version}{'' if patches.verified else ' (UNVERIFIED)'} on {dev}: the cast sites "
             f"resolve: {', '.join(sites)}"]
    with world_of_one("nccl" if dev.type == "cuda" else "gloo"):
        try:
            for distributed in (True, False):
                lines.append(_optimizer_run(dev, distributed))
        finally:
            ps.destroy_model_parallel()
    return lines
