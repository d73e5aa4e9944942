"""Stand-ins that let verl 0.9.1's ``MegatronEngine`` (megatron-core 0.18.2 / megatron-bridge 0.5.1) run on CPU over
gloo (test-only; the facts are in /work/shared/notes/verl-megatron-cpu.md). They change no installed file.

:func:`install` must run before verl's engine module is imported: 3.12 names, verl's CPU platform
(tests/verl/shims/cpu_platform.py), megatron-core's CUDA calls and streams (cpu_shims.py), megatron-bridge imported
behind a TransformerEngine stub that is gone afterwards (bridge_stubs.py), and the local attention given the masks
verl's inputs carry, and torch Adam's state initialised before a checkpoint load and given one ``step`` per parameter
after it. :data:`TRANSFORMER_OVERRIDES` goes into the engine config's ``override_transformer_config``.
"""
from __future__ import annotations

import torch

# megatron-core's own (non-TransformerEngine) layers and kernels; the layer spec is added by install()
TRANSFORMER_OVERRIDES = {
    "attention_backend": "local",  # verl sets AttnBackend.flash (transformer_impl.py:367): TE/CUDA only
    "apply_rope_fusion": False,  # transformer_config.py: "apply_rope_fusion is not available" without TE
    "gradient_accumulation_fusion": False,
    "masked_softmax_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "persist_layer_norm": False,
    "cross_entropy_loss_fusion": False,
}
# MoE (Qwen3-MoE's provider asks for TransformerEngine's fused permutation and grouped GEMM): megatron-core's own
# token permutation and SequentialMLP experts, which megatron-bridge's Qwen3MoEBridge maps as local_experts
MOE_OVERRIDES = {"moe_permute_fusion": False, "moe_grouped_gemm": False}


def _attention_masks() -> None:
    """verl's padded (BSHD) inputs carry a ``[b, s]`` token mask (True = token), as TransformerEngine's attention takes
    it; megatron-core's local ``DotProductAttention`` wants ``[b, 1, sq, sk]`` with True = masked: causal | key padding.
    verl's packed (THD) inputs: causal attention per sequence over its ``cu_seqlens`` span."""
    from megatron.core.transformer import dot_product_attention as dpa

    original = dpa.DotProductAttention.forward
    if getattr(original, "_faircast_test_mask", False):
        return

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, *args, **kwargs):
        if packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd":
            bounds = packed_seq_params.cu_seqlens_q_padded
            bounds = (packed_seq_params.cu_seqlens_q if bounds is None else bounds).tolist()
            parts = [original(self, query[a:b].unsqueeze(1), key[a:b].unsqueeze(1), value[a:b].unsqueeze(1), None)
                     for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
            return torch.cat(parts, dim=0)
        if attention_mask is not None and attention_mask.dim() == 2:
            sq, sk = query.shape[0], key.shape[0]
            causal = torch.ones(sq, sk, dtype=torch.bool, device=query.device).triu(1)
            attention_mask = (~attention_mask.bool())[:, None, None, :] | causal[None, None]
        return original(self, query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params,
                        *args, **kwargs)

    forward._faircast_test_mask = True
    dpa.DotProductAttention.forward = forward


def _optimizer_state_before_load() -> None:
    """verl's checkpoint load builds the optimizer's sharded state dict from a fresh optimizer. Without apex or
    TransformerEngine, megatron-core's distributed optimizer uses torch's Adam, whose state (and its ``step``) exists
    only after a step, and ``state_dict`` asserts one ``step`` (``distrib_optimizer.py`` state_dict): the state is
    initialised with megatron-core's own dummy values first, as its other load paths do; the load replaces them."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.state_dict
    if getattr(original, "_faircast_test_state", False):
        return

    def state_dict(self, *args, **kwargs):
        if not self.optimizer.state_dict()["state"]:
            self._init_optimizer_states_with_dummy_values()
        return original(self, *args, **kwargs)

    state_dict._faircast_test_state = True
    DistributedOptimizer.state_dict = state_dict


#: the optimizer states that shared one ``step`` tensor after each DistributedOptimizer load (what the stand-in split)
SHARED_STEP_STATES: list = []
#: False: leave megatron-core's shared ``step`` as it is (the negative control of the stand-in below)
SPLIT_SHARED_STEP = True


def _one_step_per_state_after_load() -> None:
    """Without apex or TransformerEngine (``HAVE_APEX_OR_TE`` False: this CPU setup; on a GPU, megatron-bridge installs
    TE and its FusedAdam keeps ``step`` in the param group), megatron-core's ``DistributedOptimizer.load_state_dict``
    (0.16.1, 0.18.2 and 0.19.2: ``s["step"] = step`` in its "non-Apex/TE support" branch) gives every torch Adam
    state one and the same ``step`` tensor, and torch's ``Optimizer.load_state_dict`` keeps that object (a non-fused,
    non-capturable ``step`` is not copied). torch Adam then adds 1 to that one tensor in place for every parameter it
    updates (its single-tensor path, the CPU default: ``step_t += 1``; the foreach path, CUDA's default, adds 1 per
    parameter too), so in the first step after a resume the i-th parameter uses the bias corrections of step 1 + i
    instead of 2. Measured with Fair Cast off and on alike (the Llama's 15 param states, two groups): steps 2 to 16,
    the first parameter's master the same as in the uninterrupted run, the 14 others different (20 of 21 HF tensors).
    Each state gets its own copy of the loaded value, as in the uninterrupted run; :data:`SHARED_STEP_STATES` records
    how many shared one."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.load_state_dict
    if getattr(original, "_faircast_test_step", False):
        return

    def load_state_dict(self, state_dict):
        result = original(self, state_dict)
        states = [s for s in self.optimizer.state.values() if isinstance(s.get("step"), torch.Tensor)]
        owners = {}
        for s in states:
            owners.setdefault(id(s["step"]), []).append(s)
        SHARED_STEP_STATES.append(sum(len(group) for group in owners.values() if len(group) > 1))
        if SPLIT_SHARED_STEP:
            for s in states:
                s["step"] = s["step"].clone()
        return result

    load_state_dict._faircast_test_step = True
    DistributedOptimizer.load_state_dict = load_state_dict


_INSTALLED = False


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from tests.megatron import bridge_stubs, cpu_shims
    from tests.verl.shims import cpu_platform

    bridge_stubs.python312_names()
    cpu_platform.install()
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.optimizer  # noqa: F401

    cpu_shims.install()
    _attention_masks()
    _optimizer_state_before_load()
    _one_step_per_state_after_load()
    bridge_stubs.import_bridge()  # also verl.models.mcore.bridge
    from megatron.bridge.models import gpt_provider

    TRANSFORMER_OVERRIDES["transformer_layer_spec"] = gpt_provider.local_layer_spec
    _INSTALLED = True
