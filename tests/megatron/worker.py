"""One torchrun launch that trains a tiny Megatron-core GPT through several layouts and checks the served bf16 params.

    torchrun --nproc-per-node N tests/megatron/worker.py OUT_JSON SCENARIO [SCENARIO ...]

Each scenario (names in :data:`SCENARIOS`) re-initialises Megatron's model parallelism in the same gloo process
group, builds the model and optimizer, trains 2 steps and checks, from the full (TP=1) fp32 masters and the full
served bf16 params gathered over every rank, that the served copy is ``fair_cast(master)`` per ROUNDING.md
(Fair Cast on) or round-to-nearest (off). Rank 0 writes ``{scenario: result}`` to OUT_JSON.
"""
from __future__ import annotations

import copy
import datetime
import json
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.megatron import bridge_stubs, cpu_shims, hf_converters  # noqa: E402

# FAIRCAST_MEGATRON_DEVICE=cuda: the same checks on a GPU (NCCL, no stand-ins), for the device script
CUDA = os.environ.get("FAIRCAST_MEGATRON_DEVICE", "cpu") == "cuda"
if not CUDA:
    cpu_shims.install()

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.distributed.finalize_model_grads import finalize_model_grads  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402

from faircast_plugins import FairCastConfig, FairCaster  # noqa: E402
from faircast_plugins.cast import fair_cast  # noqa: E402
from faircast_plugins.key import derive_key  # noqa: E402
from faircast_plugins.megatron import apply_megatron_patch, remove_megatron_patch  # noqa: E402
from faircast_plugins.megatron.hf_map import VOCAB_PARAMS  # noqa: E402
from faircast_plugins.megatron.layout import _unwrap, param_keys  # noqa: E402
from faircast_plugins.patching import FairCastPatchError  # noqa: E402

SEED = 1234
VOCAB, SEQ, MBS = 96, 16, 2
HF_VOCAB = 90  # the HF tokenizer's vocab: Megatron's embedding and output layer pad it to VOCAB rows

# name -> layout and options
SCENARIOS = {
    "do": dict(), "f16": dict(distributed=False), "do_off": dict(faircast=False), "f16_off": dict(distributed=False, faircast=False),
    "overlap": dict(overlap=True), "tp2": dict(tp=2), "pp2": dict(pp=2, layers=4), "ep2": dict(ep=2, experts=4),
    "tp2_off": dict(tp=2, faircast=False), "ef_resume": dict(mode="error_feedback", resume=True),
    "resume": dict(resume=True), "ema_resume": dict(ema=0.5, resume=True),
    "hf": dict(hf=True), "hf_tied": dict(hf=True, tied=True), "hf_tp2": dict(hf=True, tp=2),
    "hf_f16": dict(hf=True, distributed=False), "hf_refusals": dict(special=True),
    "hf_pp2": dict(hf=True, pp=2, layers=4), "hf_ep2": dict(hf=True, ep=2, experts=4),
    "hf_resume": dict(hf=True, resume=True), "hf_ema_resume": dict(hf=True, ema=0.5, resume=True),
    # slime's real converters (FAIRCAST_SLIME_SRC; tests/megatron/test_slime.py); TP2: and slime's own TP gather
    "hf_slime": dict(hf=True, slime=True), "hf_slime_tp2": dict(hf=True, slime=True, tp=2),
    "hf_offload": dict(hf=True, offload=True), "check_one_rank": dict(special=True),
    # the faircast/policy_* probe (faircast_plugins/megatron/policy.py; tests/megatron/test_policy.py)
    "policy": dict(policy=True), "policy_off": dict(policy=True, faircast=False),
    "policy_f16": dict(policy=True, distributed=False), "policy_tp2": dict(policy=True, tp=2),
    "policy_tied": dict(policy=True, tied=True), "policy_pp2": dict(policy=True, pp=2, layers=4),  # + the VPP refusal
    "policy_ep2": dict(policy=True, ep=2, experts=4),
    "audit": dict(audit=True), "refusals": dict(special=True), "verl": dict(special=True), "skip": dict(special=True), "bypass": dict(special=True),
}

# option set on a real optimizer -> words the refusal must contain
REFUSALS = [
    ("config.fp16", True, "fp16"), ("config.bf16", False, "fp16 or fp32"),
    ("config.use_precision_aware_optimizer", True, "precision-aware"),
    ("config.optimizer_cpu_offload", True, "CPU offload"), ("ddp_config.fp8_param_gather", True, "fp8"),
    ("config.reuse_grad_buf_for_mxfp8_param_ag", True, "MXFP8"), ("ddp_config.fp4_param_gather", True, "fp4"), ("ddp_config.use_megatron_fsdp", True, "Megatron-FSDP"),
]


def build(opts):
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=opts.get("tp", 1), pipeline_model_parallel_size=opts.get("pp", 1),
                                 expert_model_parallel_size=opts.get("ep", 1))
    model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)
    experts = opts.get("experts")
    config = TransformerConfig(
        num_layers=opts.get("layers", 2), hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=opts.get("tp", 1),
        pipeline_model_parallel_size=opts.get("pp", 1), expert_model_parallel_size=opts.get("ep", 1),
        num_moe_experts=experts, moe_router_topk=2 if experts else 2, moe_token_dispatcher_type="allgather",
        moe_ffn_hidden_size=48 if experts else None, moe_aux_loss_coeff=0.0,
    )
    config.finalize_model_grads_func = finalize_model_grads
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=experts), vocab_size=VOCAB,
        max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        position_embedding_type="rope" if opts.get("hf") else "learned_absolute",  # HF Llama: rotary, no position table
        share_embeddings_and_output_weights=opts.get("tied", False),
    )
    if opts.get("slime"):  # slime builds through megatron.training's get_model, which does this for every param
        for p in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=opts.get("distributed", True),
        overlap_param_gather=opts.get("overlap", False), overlap_grad_reduce=opts.get("overlap", False),
        bucket_size=3000 if opts.get("overlap") else None,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=Float16Module(config, model.cuda() if CUDA else model))
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16,
                                 use_distributed_optimizer=opts.get("distributed", True), clip_grad=1.0,
                                 overlap_param_gather=opts.get("overlap", False))
    for key, value in opts.get("opt_config", {}).items():
        setattr(opt_config, key, value)
    optimizer = get_megatron_optimizer(opt_config, [model])
    return config, model, optimizer


def batch_step(model, step):
    """Forward and backward of one batch (the batch is a function of ``step``)."""
    g = torch.Generator().manual_seed(100 + step)
    device = "cuda" if CUDA else "cpu"
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g).to(device)
    position_ids = torch.arange(SEQ, device=device).unsqueeze(0).expand(MBS, -1)
    labels = torch.roll(tokens, -1, dims=1)

    def forward_step(data_iterator, m):
        out = m(tokens, position_ids, None, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
                                num_microbatches=1, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)


def train_step(config, model, optimizer, step):
    model.zero_grad_buffer()
    optimizer.zero_grad()
    batch_step(model, step)
    return optimizer.step()


def sync_params(model, optimizer):
    """The served params after the step: finish any overlapped all-gather."""
    if optimizer.config.overlap_param_gather:
        model.start_param_sync(force_sync=True)


def full_master_and_served(model, optimizer):
    """``{local name: (param, full TP-local fp32 master, served bf16)}`` on this rank (masters summed over DP)."""
    out = {}
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    masters = {}
    for opt in subs:
        if type(opt).__name__ == "DistributedOptimizer":
            shards = {id(p): shard for mgroup, sgroup in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups)
                      for p, shard in zip(mgroup, sgroup)}
            # every DP rank walks the same params (a rank may own no range of some): sum the shards over DP
            for p in [p for buffer in opt.buffers for p in buffer.params if p.dtype == torch.bfloat16]:
                full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
                if id(p) in shards:
                    r = opt._get_model_param_range_map(p)["param"]
                    full[r.start:r.end] = shards[id(p)].detach().view(-1)
                dist.all_reduce(full, group=opt.data_parallel_group)
                masters[id(p)] = full.view(p.shape)
        else:
            for mgroup, fgroup in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for p, main in zip(mgroup, fgroup):
                    masters[id(p)] = main.detach().clone()
    for name, p in model.module.named_parameters():
        if id(p) in masters:
            out[name] = (p, masters[id(p)], p.detach().clone())
    return out


def tp_full(t, p, expert):
    """The full (TP=1) tensor of a TP-local ``t``, gathered over the TP group (Megatron's strided split undone)."""
    if not getattr(p, "tensor_model_parallel", False):
        return t
    group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
    world = dist.get_world_size(group)
    if world == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    d, stride = p.partition_dim, getattr(p, "partition_stride", 1)
    chunks = [part.chunk(stride, dim=d) for part in parts]
    return torch.cat([chunks[r][c] for c in range(stride) for r in range(world)], dim=d)


def full_params(model, optimizer):
    """``{local name: (param, full TP=1 fp32 master, full served bf16)}``, gathered over DP and TP."""
    out = {}
    for name, (p, master, served) in full_master_and_served(model, optimizer).items():
        expert = not getattr(p, "allreduce", True)
        out[name] = (p, tp_full(master, p, expert), tp_full(served, p, expert))
    return out


def ema_of(history, decay):
    """The EMA of the master over ``history`` (full masters at versions 0, 1, ...), as ROUNDING.md §4 defines it."""
    ema = {n: m.clone() for n, m in history[0].items()}
    for masters in history[1:]:
        for n, m in ema.items():
            d = masters[n] - m
            d.mul_(1.0 - decay)
            m.add_(d)
    return ema


def check(model, optimizer, fc, version, faircast, sources=None):
    """Compare every served param with fair_cast (of the master, or of ``sources``) / round-to-nearest."""
    mismatches, differs_from_rtn, count, names = [], 0, 0, {}
    for name, (p, full_master, full_served) in full_params(model, optimizer).items():
        # the reference is the CPU cast: on a GPU run this compares the device's kernel with the CPU one, bit for bit
        full_master, full_served = full_master.cpu(), full_served.cpu()
        rtn = full_master.to(torch.bfloat16)
        if faircast:
            key = fc.keys[id(p)]
            names[key.name] = list(full_master.shape)
            source = (sources or {}).get(name, full_master).cpu()
            if fc.caster.mode == "error_feedback":
                want = None  # checked by the resume comparison
            else:
                want = fair_cast(source.contiguous(), key=derive_key(SEED, version, key.name), mode=fc.caster.mode)
        else:
            want = rtn
        count += 1
        if want is not None and not torch.equal(want.view(torch.int16), full_served.view(torch.int16)):
            mismatches.append(name)
        differs_from_rtn += int(not torch.equal(rtn.view(torch.int16), full_served.view(torch.int16)))
    return {"params": count, "mismatches": mismatches, "differs_from_rtn": differs_from_rtn, "names": names}


def converters_for_test(model, opts):
    """``(what apply_megatron_patch gets, lookup, bridge installed?)``: megatron-bridge's LlamaBridge mappings where it
    is installed (``bridge=`` the model bridge; MoE layers: a ``converters=`` table of its Qwen3MoEBridge mappings,
    the per-expert and router mappings of a Qwen3-MoE), else the hand-written converters of tests/megatron/hf_converters.py."""
    if opts.get("slime"):
        return slime_lookup()
    model_bridge = None if opts.get("experts") else bridge_stubs.llama_model_bridge()
    registry = (bridge_stubs.qwen3_moe_mapping_registry() if opts.get("experts")
                else model_bridge.mapping_registry() if model_bridge is not None else None)
    own = hf_converters.llama_like(heads=4, groups=2, tied=opts.get("tied", False))
    if registry is not None and not opts.get("experts"):
        return {"bridge": model_bridge}, registry.megatron_to_hf_lookup, True
    table = {}
    for key in param_keys([model]).values():
        converter = (registry.megatron_to_hf_lookup(key.name) if registry is not None else None) or own(key.name)
        if converter is not None:
            table[key.name] = converter
    return {"converters": table}, table.get, registry is not None


def slime_lookup():
    """slime's real converters (``FAIRCAST_SLIME_SRC``, tests/megatron/slime_source.py) for this Llama-like GPT, as
    slime's actor names the model of a LlamaConfig. slime's converters know the TransformerEngine spec's names only:
    the local spec's input norm is handed to them under its TE name (the same tensor, fused into ``linear_qkv``)."""
    import re
    from types import SimpleNamespace

    from faircast_plugins.megatron.slime import slime_converters
    from tests.megatron import slime_source

    gather = slime_source.install_weight_gather(slime_source.source())
    args = SimpleNamespace(vocab_size=HF_VOCAB, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                           kv_channels=None, q_lora_rank=None)
    slime = slime_converters(args, "llamaconfig", SimpleNamespace(quantization_config=None))

    def lookup(name):
        return slime(re.sub(r"^(decoder\.layers\.\d+\.)input_layernorm\.weight$",
                            r"\1self_attention.linear_qkv.layer_norm_weight", name))

    lookup.slime_gather = gather  # check_hf gathers the served params as slime's weight sync does
    return {"converters": lookup}, lookup, False


def check_hf(model, optimizer, fc, lookup, bridge, sources=None):
    """Export the served bf16 params and the fp32 masters (or the EMA ``sources``) to Hugging Face tensors through
    the converters, write the masters as an HF safetensors checkpoint and compare the served tensors with what
    ``faircast export`` serves from that checkpoint, bit for bit. Without pipeline or expert parallelism the bridge's
    mappings run for real (TP2: their own TP gather); otherwise they run on the gathered TP=1 tensor, without
    collectives (hf_map.run_converter), as the hand-written converters always do."""
    from safetensors.torch import save_file

    from faircast_plugins.export import iter_served
    from faircast_plugins.megatron.hf_map import run_converter

    gpt = _unwrap(model)
    modules = {id(p): gpt.get_submodule(n.rsplit(".", 1)[0]) for n, p in gpt.named_parameters()}
    real = bridge and ps.get_pipeline_model_parallel_world_size() == 1 and ps.get_expert_model_parallel_world_size() == 1
    hf_master, hf_served, padded_rtn, padded_rows, real_used = {}, {}, True, 0, False
    slime_gather = getattr(lookup, "slime_gather", None)
    for local, (p, master, served) in full_master_and_served(model, optimizer).items():
        name = fc.keys[id(p)].name  # global layer / expert, a tied output layer named as the embedding
        converter, expert = lookup(name), not getattr(p, "allreduce", True)
        if sources is not None:
            master = sources[local]  # TP=1 (world-1 runs only)
        if real and hasattr(converter, "megatron_to_hf") and sources is None:
            m, s = converter.megatron_to_hf(master, modules[id(p)]), converter.megatron_to_hf(served, modules[id(p)])
            real_used = True
        else:
            full = master if sources is not None else tp_full(master, p, expert)
            # the served tensor as the export assembles it (slime: its own all_gather_param of the param, at TP > 1
            # its GLU re-chunk); the master by Megatron's partition rule (tp_full), what Fair Cast's keys assume
            full_served = slime_gather("module.module." + name, p).clone() if slime_gather else tp_full(served, p, expert)
            m = run_converter(converter, full, modules[id(p)])
            s = run_converter(converter, full_served, modules[id(p)])
        for hf_name in m:
            mm, ss = m[hf_name], s[hf_name]
            if name in VOCAB_PARAMS:
                # the padded rows: in the export (megatron-bridge), or dropped by the converter (slime's remove_padding)
                pm, ps_ = (full[HF_VOCAB:], full_served[HF_VOCAB:]) if mm.shape[0] == HF_VOCAB else (mm[HF_VOCAB:], ss[HF_VOCAB:])
                padded_rows += pm.shape[0]
                padded_rtn &= torch.equal(ps_.view(torch.int16), pm.to(torch.bfloat16).view(torch.int16))
                mm, ss = mm[:HF_VOCAB], ss[:HF_VOCAB]
            hf_master[hf_name], hf_served[hf_name] = mm.float().contiguous().cpu(), ss.cpu()
    ckpt = tempfile.mkdtemp(prefix=f"faircast_hf_master_r{dist.get_rank()}_")
    save_file(hf_master, os.path.join(ckpt, "model.safetensors"))
    exported = dict(iter_served(ckpt, seed=SEED, version=2, mode="stochastic"))
    mismatches = [n for n in hf_served if not torch.equal(exported[n].view(torch.int16), hf_served[n].view(torch.int16))]
    rtn = sum(int(not torch.equal(hf_master[n].to(torch.bfloat16).view(torch.int16), hf_served[n].view(torch.int16)))
              for n in hf_served)
    return {"bridge": bridge, "real_export": real_used, "slime_gather": slime_gather is not None, "hf_names": sorted(hf_served), "mismatches": mismatches,
            "differs_from_rtn": rtn, "padded_rows": padded_rows, "padded_rows_rtn": padded_rtn}


def coords():
    return {"pp": ps.get_pipeline_model_parallel_rank(), "ep": ps.get_expert_model_parallel_rank(),
            "tp": ps.get_tensor_model_parallel_rank()}


def served_bits(model):
    return {n: p.detach().clone() for n, p in model.module.named_parameters() if p.dtype == torch.bfloat16}


def verl_engine(config, model, optimizer):
    """verl 0.9.1's MegatronEngine with Fair Cast activated as its worker does, stepped by verl's own
    ``optimizer_step``; its checkpoint methods run with a stand-in checkpoint manager (verl's needs megatron-bridge)."""
    import types

    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    from faircast_plugins.verl import megatron as verl_megatron

    engine = MegatronEngine.__new__(MegatronEngine)  # initialize() needs megatron-bridge: give it what it builds
    saved = []
    engine.module, engine.optimizer, engine._qat_enabled, engine._is_offload_param = [model], optimizer, False, False
    engine._is_offload_optimizer, engine.lr_scheduler = False, None
    engine.checkpoint_mananager = types.SimpleNamespace(save_checkpoint=lambda **kw: saved.append(kw),
                                                       load_checkpoint=lambda **kw: saved.append(kw))
    fc = verl_megatron.activate(engine, FairCastConfig(enabled=True, seed=SEED))
    for s in range(2):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        batch_step(model, s)
        engine.optimizer_step()
    out = {"version": fc.caster.version, "check": check(model, optimizer, fc, 2, True)}
    tmp = tempfile.mkdtemp(prefix="faircast_verl_megatron_")
    engine.save_checkpoint(tmp)
    engine.load_checkpoint(tmp)
    out["state_files"] = sorted(f for f in os.listdir(tmp) if f.startswith("faircast_state_rank"))
    out["verl_checkpoint_calls"] = len(saved)
    out["version_after_load"] = fc.caster.version
    verl_megatron.PATCHES.remove()
    remove_megatron_patch(optimizer)
    return out


def special(name):
    """Refusals, a skipped step, a copy that bypasses Fair Cast (the collective check's negative control), verl."""
    config, model, optimizer = build({"hf": True} if name == "hf_refusals" else {})
    if name == "verl":
        return verl_engine(config, model, optimizer)
    if name == "hf_refusals":
        return hf_refusals(model, optimizer)
    cfg = FairCastConfig(enabled=True, seed=SEED)
    sub = optimizer.chained_optimizers[0]
    out = {}
    if name == "refusals":
        for path, value, words in REFUSALS:
            owner_name, attr = path.split(".")
            owner = getattr(sub, owner_name)
            before = getattr(owner, attr, None)  # fp4_param_gather is newer than 0.16.1
            setattr(owner, attr, value)
            try:
                apply_megatron_patch(optimizer, FairCaster(cfg), model_chunks=[model])
                out[path] = "accepted"
            except FairCastPatchError as exc:
                out[path] = "refused" if words.lower() in str(exc).lower() else f"wrong message: {exc}"
            finally:
                setattr(owner, attr, before)
                remove_megatron_patch(optimizer)
        model.module.config.layernorm_zero_centered_gamma = True
        try:
            apply_megatron_patch(optimizer, FairCaster(cfg), model_chunks=[model])
            out["zero_centered_gamma"] = "accepted"
        except FairCastPatchError as exc:
            out["zero_centered_gamma"] = "refused" if "zero-centred" in str(exc) else f"wrong message: {exc}"
        model.module.config.layernorm_zero_centered_gamma = False
        remove_megatron_patch(optimizer)
        fake = type("LayerWiseDistributedOptimizer", (), {})()
        try:
            apply_megatron_patch(fake, FairCaster(cfg), model_chunks=[model])
            out["layer_wise"] = "accepted"
        except FairCastPatchError as exc:
            out["layer_wise"] = "refused" if "LayerWiseDistributedOptimizer" in str(exc) else f"wrong message: {exc}"
        off = apply_megatron_patch(optimizer, FairCaster(FairCastConfig(enabled=False)), model_chunks=[model])
        out["disabled_attaches_nothing"] = off is None and "_faircast" not in sub.__dict__
        return out
    fc = apply_megatron_patch(optimizer, FairCaster(cfg), model_chunks=[model])
    train_step(config, model, optimizer, 0)
    before = served_bits(model)
    if name == "skip":  # found_inf: Megatron returns before the copy; the version must not move
        optimizer.prepare_grads = lambda: True
        result = train_step(config, model, optimizer, 1)
        after = served_bits(model)
        out.update(success=result[0], version=fc.caster.version,
                   unchanged=all(torch.equal(before[n], after[n]) for n in before))
    else:  # a sub-optimizer whose copy goes around Fair Cast: every rank must raise
        sub._copy_main_params_to_model_params = lambda: stock_copy(sub)
        try:
            train_step(config, model, optimizer, 1)
            out["raised"] = None
        except FairCastPatchError as exc:
            out["raised"] = str(exc)
        out["version"] = fc.caster.version
        del sub._copy_main_params_to_model_params
    remove_megatron_patch(optimizer)
    return out


def hf_refusals(model, optimizer):
    """Attach-time refusals of the HF keying: a param without a converter, an arithmetic converter (also the
    bridge's own zero-centred norm mapping where installed), no HF vocab size."""
    _, lookup, bridge = converters_for_test(model, {})
    cfg = FairCastConfig(enabled=True, seed=SEED)
    out = {}
    table = {n: lookup(n) for n, _ in _unwrap(model).named_parameters()}
    cases = {
        "missing": ({"converters": {n: c for n, c in table.items() if n != "decoder.final_layernorm.weight"}},
                    ["no converter", "decoder.final_layernorm.weight"]),
        "arithmetic": ({"converters": {**table, "decoder.final_layernorm.weight": hf_converters.plus_one("model.norm.weight")}},
                       ["decoder.final_layernorm.weight", "changes values"]),
        "no_vocab_size": ({"converters": table, "hf_vocab_size": None}, ["hf_vocab_size"]),
    }
    if bridge:
        from megatron.bridge.models.conversion.param_mapping import RMSNorm2ZeroCenteredRMSNormMapping

        zc = RMSNorm2ZeroCenteredRMSNormMapping("decoder.final_layernorm.weight", "model.norm.weight")
        cases["bridge_zero_centred"] = ({"converters": {**table, "decoder.final_layernorm.weight": zc}},
                                        ["RMSNorm2ZeroCenteredRMSNormMapping", "changes values"])
    for case, (kwargs, words) in cases.items():
        kwargs = {"hf_vocab_size": HF_VOCAB, **kwargs}
        try:
            apply_megatron_patch(optimizer, FairCaster(cfg), model_chunks=[model], **kwargs)
            out[case] = "accepted"
        except FairCastPatchError as exc:
            out[case] = "refused" if all(w in str(exc) for w in words) else f"wrong message: {exc}"
        finally:
            remove_megatron_patch(optimizer)
    return out


def stock_copy(opt):
    """Megatron's own (round-to-nearest) distributed-optimizer copy, as it was before Fair Cast wrapped it."""
    from faircast_plugins.megatron.patch import PATCHES

    for applied in PATCHES._applied:
        if applied.attr == "_copy_main_params_to_model_params" and applied.owner is type(opt):
            return applied.previous(opt)
    raise AssertionError("no original copy recorded")


def offload(model):
    """verl's ``offload_megatron_model_to_cpu`` (param_offload=True): each DDP buffer's param_data to the host, its
    storage resized to 0 (what the bucket views see until :func:`reload`)."""
    for buffer in list(model.buffers) + list(model.expert_parallel_buffers):
        buffer.param_data.cpu_data = buffer.param_data.detach().clone()
        buffer.param_data_size = buffer.param_data.storage().size()
        buffer.param_data.storage().resize_(0)


def offloaded_views(model):
    """The bucket views as verl's offload leaves them, for after a CPU step (a gloo step leaves the buffer's storage
    not resizable here): each bucket's ``param_data`` swapped for a tensor of its shape on a 0-byte storage. Returns
    what :func:`restore_views` puts back."""
    saved = []
    for buffer in list(model.buffers) + list(model.expert_parallel_buffers):
        for bucket in buffer.buckets:
            empty = torch.empty(bucket.param_data.shape, dtype=bucket.param_data.dtype)
            empty.untyped_storage().resize_(0)
            saved.append((bucket, bucket.param_data))
            bucket.param_data = empty
    return saved


def restore_views(saved):
    for bucket, param_data in saved:
        bucket.param_data = param_data


def reload(model):
    for buffer in list(model.buffers) + list(model.expert_parallel_buffers):
        cpu = buffer.param_data.cpu_data
        buffer.param_data.storage().resize_(buffer.param_data_size)
        buffer.param_data.copy_(cpu)


def check_one_rank():
    """A problem found on one data-parallel rank only (the EMA-missing path, a rank-local bypass): every rank must
    raise after the step, none may wait in a collective the others skip."""
    config, model, optimizer = build({})
    fc = apply_megatron_patch(optimizer, FairCaster(FairCastConfig(enabled=True, seed=SEED)), model_chunks=[model])
    copy_distributed = fc.copy_distributed

    def one_rank_problem(opt, *args, **kwargs):
        copy_distributed(opt, *args, **kwargs)
        if dist.get_rank() == dist.get_world_size() - 1:
            fc.problem = fc.problem or "a problem on the last rank only"

    fc.copy_distributed = one_rank_problem
    out = {}
    try:
        train_step(config, model, optimizer, 0)
        out["raised"] = None
    except FairCastPatchError as exc:
        out["raised"] = str(exc)
    remove_megatron_patch(optimizer)
    return out


def policy_batch(step, seqs=3):
    """``(input_ids, position_ids, token_mask)`` of one data-parallel rank's batch (a function of the step and the
    DP rank, the same on its TP peers): a 5-token prompt, then completion tokens; the second sequence's are shorter."""
    g = torch.Generator().manual_seed(7000 + 100 * step + ps.get_data_parallel_rank())
    device = "cuda" if CUDA else "cpu"
    ids = torch.randint(0, VOCAB, (seqs, SEQ), generator=g).to(device)
    pos = torch.arange(SEQ, device=device).unsqueeze(0).expand(seqs, -1)
    mask = torch.zeros(seqs, SEQ, dtype=torch.long, device=device)
    mask[:, 5:] = 1
    mask[1, 11:] = 0
    return ids, pos, mask


def policy_reference(opts, full, batches, seqs):
    """The metrics from a one-process reference: a TP=1 fp32 GPT holding the full served copy, then the full master
    (every param at once, no swap, no vocab-parallel softmax), scoring every DP rank's first ``seqs`` sequences."""
    from faircast_plugins.policy_lag import metrics_of, sequence_stats

    experts = opts.get("experts")
    config = TransformerConfig(
        num_layers=opts.get("layers", 2), hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
        params_dtype=torch.float32, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=experts, moe_router_topk=2, moe_token_dispatcher_type="allgather",
        moe_ffn_hidden_size=48 if experts else None, moe_aux_loss_coeff=0.0)
    ref = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=experts), vocab_size=VOCAB,
                   max_sequence_length=SEQ, position_embedding_type="learned_absolute",
                   share_embeddings_and_output_weights=opts.get("tied", False)).eval()
    params = dict(ref.named_parameters())
    logits = {}
    for view in ("served", "master"):
        with torch.no_grad():
            assert set(full) == set(params), sorted(set(full) ^ set(params))
            for name, tensors in full.items():
                params[name].copy_(tensors[view])
            logits[view] = [ref(ids.cpu(), pos.cpu(), None).float() for ids, pos, _ in batches]
    rows = [sequence_stats(s[:seqs, :-1], m[:seqs, :-1], ids[:seqs, 1:].cpu(), mask[:seqs, 1:].cpu())
            for s, m, (ids, _, mask) in zip(logits["served"], logits["master"], batches)]
    return metrics_of(torch.cat(rows))


def policy(name, opts):
    """Fair Cast (on or off) with the policy probe, against a control run without it: 3 steps, measuring before each
    (every=1). Step 0: served == master (KL 0). Before step 2: the probe's metrics against the one-process reference,
    its master view against the independently gathered masters, the served view against fair_cast / RTN of them, and
    nothing left behind (params and master shards bit-identical). After step 3: the masters and served params
    equal the control run's."""
    from faircast_plugins.megatron.policy import MasterView, served_view

    faircast = opts.get("faircast", True)
    seqs = 2
    cfg = FairCastConfig(enabled=faircast, seed=SEED, policy_metrics_every=1, policy_metrics_seqs=seqs)
    plain = FairCastConfig(enabled=faircast, seed=SEED)
    # the control: the same run without the probe (Fair Cast off: no patch at all, Megatron's own copy)
    config, model, optimizer = build(opts)
    control_fc = apply_megatron_patch(optimizer, FairCaster(plain), model_chunks=[model]) if faircast else None
    for s in range(3):
        train_step(config, model, optimizer, s)
    control = {n: (m.clone(), sv.clone()) for n, (_, m, sv) in full_master_and_served(model, optimizer).items()}
    if control_fc is not None:
        remove_megatron_patch(optimizer)
    del model, optimizer

    config, model, optimizer = build(opts)
    fc = apply_megatron_patch(optimizer, FairCaster(cfg), model_chunks=[model], measure_policy=True)
    out = {"coords": coords(), "metrics": []}
    tp_rank = ps.get_tensor_model_parallel_rank()
    for s in range(3):
        ids, pos, mask = policy_batch(s)
        step = fc.caster.version
        assert fc.policy.due(step)
        if s == 2:
            before = {n: p.detach().clone() for n, p in model.module.named_parameters()}
            shards = [m.detach().clone() for o in getattr(optimizer, "chained_optimizers", [optimizer]) for m in _mains(o)]
            # a submodule kept in eval (a frozen block) inside the training model: each module's own mode comes back
            frozen = [m for m in model.module.modules() if next(m.parameters(recurse=False), None) is not None][0]
            model.train()
            frozen.eval()
            modes = [m.training for m in model.modules()]
        fc.policy.measure(step, ids, pos, mask)
        if s == 2:
            out["modes_kept"] = [m.training for m in model.modules()] == modes and not frozen.training
            frozen.train()
            after = dict(model.module.named_parameters())
            out["params_unchanged"] = all(before[n].dtype == p.dtype and torch.equal(_bits(before[n]), _bits(p))
                                          for n, p in after.items())
            now = [m.detach() for o in getattr(optimizer, "chained_optimizers", [optimizer]) for m in _mains(o)]
            out["shards_unchanged"] = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(shards, now))
            # the views against the independently gathered masters (summed over DP) and the served copy
            masters = full_master_and_served(model, optimizer)
            view = MasterView(optimizer)
            full, master_view_exact, served_is, differs = {}, True, True, 0
            for local, (p, master, served) in masters.items():
                got = view(p)
                master_view_exact &= torch.equal(got.view(torch.int32), master.view(torch.int32))
                differs += int(not torch.equal(served_view(p), got))
                expert = not getattr(p, "allreduce", True)
                name = fc.keys[id(p)].name  # canonical: global layer and expert ids, the TP=1 model's names
                full[name] = {"served": tp_full(served_view(p), p, expert).cpu(), "master": tp_full(master, p, expert).cpu()}
                whole = full[name]["master"].contiguous()  # the cast keys index the full (TP=1) tensor
                want = (fair_cast(whole, key=derive_key(SEED, step, name), mode="stochastic")
                        if faircast else whole.to(torch.bfloat16))
                served_is &= torch.equal(full[name]["served"].to(torch.bfloat16).view(torch.int16), want.view(torch.int16))
            out.update(master_view_exact=master_view_exact, served_view_is=served_is, views_differ=differs,
                       params=len(masters))
            local_batches = [(ids, pos, mask)]
        out["metrics"].append(fc.metrics())  # a collective over DP; every rank logs the same numbers
        train_step(config, model, optimizer, s)
    if not (opts.get("tp") or opts.get("ep") or opts.get("pp")) and ps.get_data_parallel_world_size() > 1:  # DP only
        # DP ranks whose batches chunk differently (one sequence per forward; 1 and 2 sequences): the master view's
        # all-reduces must still pair up (before: the rank with fewer forwards left the other hanging)
        from faircast_plugins.megatron import policy as megatron_policy

        saved, megatron_policy.LOGIT_BUDGET = megatron_policy.LOGIT_BUDGET, 1
        try:
            n = 1 + ps.get_data_parallel_rank() % 2
            fc.policy.measure(100, ids[:n], pos[:n], mask[:n])
            out["uneven_rows"] = [n, int(fc.policy.probe.take().shape[0])]
        finally:
            megatron_policy.LOGIT_BUDGET = saved
    # the reference, on rank 0's view of every DP rank's batch: gather the batches of the TP-rank-0 ranks
    gathered = [None] * dist.get_world_size()
    first = tp_rank == 0 and ps.get_pipeline_model_parallel_rank() == 0  # one copy of each DP rank's batch
    dist.all_gather_object(gathered, (first, [(i.cpu(), p.cpu(), m.cpu()) for i, p, m in local_batches], full))
    batches = [b for one, bs, _ in gathered if one for b in bs]
    full = {n: t for _, _, part in gathered for n, t in part.items()}  # every expert rank's experts, every stage's params
    if opts.get("pp"):  # what stays refused: virtual pipeline chunks
        from faircast_plugins.megatron.policy import MegatronPolicyProbe
        try:
            MegatronPolicyProbe(optimizer, [model, model], every=1)
            out["refused"] = None
        except FairCastPatchError as exc:
            out["refused"] = str(exc)
    final = full_master_and_served(model, optimizer)
    out["differs_from_control"] = [n for n in control if not (torch.equal(_bits(control[n][0]), _bits(final[n][1])) and
                                   torch.equal(_bits(control[n][1]), _bits(final[n][2])))]
    out["same_as_control"] = not out["differs_from_control"] and set(control) == set(final)
    out["version"] = fc.caster.version
    remove_megatron_patch(optimizer)
    ps.destroy_model_parallel()  # the reference is a TP=1 model
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(SEED)
    out["reference"] = policy_reference(opts, full, batches, seqs)
    return out


def _bits(t):
    return t.detach().contiguous().view(-1).view(torch.uint8)


def run(name):
    opts = SCENARIOS[name]
    if name == "check_one_rank":
        return check_one_rank()
    if opts.get("policy"):
        return policy(name, opts)
    if opts.get("special"):
        return special(name)
    faircast = opts.get("faircast", True)
    config, model, optimizer = build(opts)
    fc = None
    cfg = FairCastConfig(enabled=True, seed=SEED, mode=opts.get("mode", "stochastic"), ema_decay=opts.get("ema", 0.0),
                         audit=opts.get("audit", False))
    hf, attach = None, {}
    if faircast and opts.get("hf"):
        attach, lookup, bridge = converters_for_test(model, opts)
        attach["hf_vocab_size"] = HF_VOCAB
        hf = (lookup, bridge)
    if faircast:
        if opts.get("offload"):  # verl param_offload: the engine is built offloaded, Fair Cast attaches then
            offload(model)
        fc = apply_megatron_patch(optimizer, FairCaster(cfg), model_chunks=[model], **attach)
        if opts.get("offload"):
            reload(model)
    ema = opts.get("ema")
    history = [{n: m for n, (_, m, _) in full_params(model, optimizer).items()}] if ema else []
    results = []
    for s in range(2):
        results.append(train_step(config, model, optimizer, s))
        if ema:
            history.append({n: m for n, (_, m, _) in full_params(model, optimizer).items()})
    sync_params(model, optimizer)
    sources = ema_of(history, ema) if ema else None
    out = {"steps_ok": all(r[0] for r in results), "version": fc.caster.version if fc else None,
           "check": check(model, optimizer, fc, 2, faircast, sources), "coords": coords()}
    if hf is not None:  # the Megatron-native check above must now mismatch: the keys are the HF ones
        out["hf"] = check_hf(model, optimizer, fc, *hf, sources=sources)
    if opts.get("resume"):
        out["resume"] = resume_check(opts, cfg, config, model, optimizer, fc, attach)
    if opts.get("offload"):  # verl saves and loads checkpoints with the model offloaded again
        views = offloaded_views(model)
        tmp = tempfile.mkdtemp(prefix="faircast_offload_")
        fc.save(tmp)
        fc.load(tmp)
        restore_views(views)
        out["offload_saved"] = sorted(os.listdir(tmp))
    if fc is not None:
        out["elements_cast"] = fc.last_step_elements
        out["metrics"] = fc.metrics()
        remove_megatron_patch(optimizer)
    return out


def _mains(opt):
    """The fp32 main params (or DP shards of them) of one Megatron optimizer, in a fixed order."""
    groups = opt.shard_fp32_from_float16_groups if hasattr(opt, "shard_fp32_from_float16_groups") else opt.fp32_from_float16_groups
    return [m for group in groups for m in group]


def resume_check(opts, cfg, config, model, optimizer, fc, attach=None):
    """Save after 2 steps, take a 3rd; rebuild, load, take the 3rd again: the served bits must be equal."""
    tmp = os.path.join(tempfile.gettempdir(), f"faircast_megatron_{os.environ.get('MASTER_PORT', '0')}")
    model_state = {k: v.clone() for k, v in model.module.state_dict().items() if isinstance(v, torch.Tensor)}
    opt_state = [(copy.deepcopy(o.optimizer.state_dict()), [m.detach().clone() for m in _mains(o)])
                 for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    if dist.get_rank() == 0:
        os.makedirs(tmp, exist_ok=True)
    dist.barrier()
    fc.save(tmp)
    dist.barrier()
    train_step(config, model, optimizer, 2)
    sync_params(model, optimizer)
    want = served_bits(model)
    remove_megatron_patch(optimizer)
    # a fresh run: same layout, the checkpoint's model and optimizer state, then Fair Cast's state
    config2, model2, optimizer2 = build(opts)
    model2.module.load_state_dict(model_state, strict=False)
    for o, (inner, mains) in zip(getattr(optimizer2, "chained_optimizers", [optimizer2]), opt_state):
        o.optimizer.load_state_dict(copy.deepcopy(inner))
        for dst, src in zip(_mains(o), mains):
            dst.data.copy_(src)
    fc2 = apply_megatron_patch(optimizer2, FairCaster(cfg), model_chunks=[model2], **(attach or {}))
    refused = None
    if fc2.caster.keeps_state:  # residuals / EMA cannot be recomputed: a checkpoint without them is refused
        try:
            fc2.load(tempfile.mkdtemp(prefix="faircast_empty_"), step=2)
        except FairCastPatchError as exc:
            refused = str(exc)
    fc2.load(tmp)
    train_step(config2, model2, optimizer2, 2)
    sync_params(model2, optimizer2)
    got = served_bits(model2)
    remove_megatron_patch(optimizer2)
    diff = [n for n in want if not torch.equal(want[n].view(torch.int16), got[n].view(torch.int16))]
    return {"version": fc2.caster.version, "mismatches": diff, "params": len(want), "refused_without_state": refused}


def main():
    out_path, names = sys.argv[1], sys.argv[2:]
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if CUDA else "gloo", timeout=datetime.timedelta(seconds=int(os.environ.get("FAIRCAST_TEST_TIMEOUT", "120"))))
    results = {}
    for name in names:
        try:
            res = run(name)
        except Exception:  # noqa: BLE001 - reported to the test
            res = {"error": traceback.format_exc()}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, res)
        results[name] = gathered
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
