"""The element map that keys Megatron params by Hugging Face name and index (docs/ROUNDING.md §1, "through a
converter"), with hand-written converters: no megatron-core needed."""
from __future__ import annotations

import pytest
import torch

from faircast_plugins import golden
from faircast_plugins.cast import fair_cast
from faircast_plugins.key import derive_key
from faircast_plugins.megatron.hf_map import ConverterError, build_element_map
from faircast_plugins.megatron.layout import ParamKey
from tests.megatron import hf_converters as conv

QKV = "decoder.layers.0.self_attention.linear_qkv.weight"


def _qkv_key(**kw):
    return ParamKey(QKV, golden.HF_QKV_SHAPE, **kw)


def test_golden_vector_of_the_contract():
    """ROUNDING.md §1's example: fused QKV element -> (HF name, HF index) -> the served bits."""
    converter = conv.qkv(golden.HF_QKV_HEADS, golden.HF_QKV_GROUPS,
                         *(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"))
    emap = build_element_map(_qkv_key(), converter)
    native_name, native_out = golden.NATIVE_QKV
    for element, name, index, key, bits_in, bits_out in golden.HF_QKV:
        ids, hf = emap.lookup(torch.tensor([element]))
        assert (emap.names[int(ids[0])], int(hf[0])) == (name, index)
        assert derive_key(1234, 7, name) == key
        x = golden.fp32_from_bits([bits_in] * 16)
        assert golden.bf16_bits(fair_cast(x, key=key))[index] == bits_out
        assert golden.bf16_bits(fair_cast(x, key=derive_key(1234, 7, native_name)))[element] == native_out


def test_padded_vocab_rows_have_no_key():
    key = ParamKey("embedding.word_embeddings.weight", (6, 2))
    emap = build_element_map(key, conv.same("model.embed_tokens.weight"), hf_vocab_size=5)
    assert emap.hf_shapes == {"model.embed_tokens.weight": (5, 2)} and emap.padded == 2
    ids, hf = emap.lookup(torch.arange(12))
    assert ids[:10].tolist() == [0] * 10 and hf[:10].tolist() == list(range(10)) and ids[10:].tolist() == [-1, -1]
    groups = emap.groups(key, 8, 12)
    assert [(g.name, g.pos, g.hf) for g in groups] == [(None, slice(2, 4), 0), ("model.embed_tokens.weight", slice(0, 2), 8)]
    with pytest.raises(ConverterError, match="no HF tensor"):  # without the vocab size the padding is not an HF element
        build_element_map(key, lambda w: {"model.embed_tokens.weight": w[:5]})


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_tensor_parallel_slices_compose_with_the_map(tp_rank):
    """A TP-local slice of a strided SwiGLU fc1 (partition stride 2): local element -> TP=1 index -> HF element."""
    full = torch.arange(8 * 3).view(8, 3)  # gate rows 0-3, up rows 4-7
    key = ParamKey("decoder.layers.0.mlp.linear_fc1.weight", (4, 3), tp_size=2, tp_rank=tp_rank, partition_dim=0, stride=2)
    emap = build_element_map(key, conv.gated("gate", "up"))
    local = key.indices(0, 12)
    assert torch.equal(local, torch.cat([full[2 * tp_rank: 2 * tp_rank + 2], full[4 + 2 * tp_rank: 6 + 2 * tp_rank]]).view(-1))
    groups = emap.groups(key, 0, 12)
    assert [(g.name, g.pos, g.hf) for g in groups] == [("gate", slice(0, 6), 6 * tp_rank), ("up", slice(6, 12), 6 * tp_rank)]


def test_a_column_split_gets_per_element_indices():
    key = ParamKey("decoder.layers.0.self_attention.linear_proj.weight", (4, 2), tp_size=2, tp_rank=1, partition_dim=1)
    emap = build_element_map(key, conv.same("o_proj"))
    (g,) = emap.groups(key, 1, 7)
    assert not g.contiguous and g.pos.tolist() == [[0, 3, 1], [1, 6, 2], [3, 10, 2], [5, 14, 1]]  # runs
    pos, hf = g.expand()
    assert pos.tolist() == list(range(6)) and hf.tolist() == [3, 6, 7, 10, 11, 14]


def test_a_fused_qkv_range_is_kept_as_runs_of_head_blocks():
    converter = conv.qkv(4, 2, "q", "k", "v")
    key = ParamKey(QKV, (16, 8))  # head dim 2, hidden 8: rows q0 q0 q1 q1 k0 k0 v0 v0 | q2 q2 q3 q3 k1 k1 v1 v1
    groups = {g.name: g for g in build_element_map(key, converter).groups(key, 0, 128)}
    assert groups["q"].pos.tolist() == [[0, 0, 32], [64, 32, 32]]
    assert groups["k"].contiguous is False and groups["k"].pos.tolist() == [[32, 0, 16], [96, 16, 16]]


def test_arithmetic_converter_is_refused_naming_param_and_converter():
    key = ParamKey("decoder.final_layernorm.weight", (8,))
    with pytest.raises(ConverterError, match=r"decoder\.final_layernorm\.weight.*changes values"):
        build_element_map(key, conv.plus_one("model.norm.weight"))

    def scaled(w):
        return {"model.norm.weight": w * 2 if w.is_floating_point() else w}

    with pytest.raises(ConverterError, match="changes values"):
        build_element_map(key, scaled)

    def to_bf16(w):
        return {"model.norm.weight": w.to(torch.bfloat16) if w.is_floating_point() else w}

    with pytest.raises(ConverterError, match="casts"):
        build_element_map(key, to_bf16)


def test_duplicating_or_dropping_converters_are_refused():
    key = ParamKey("decoder.final_layernorm.weight", (8,))
    with pytest.raises(ConverterError, match="lands in 2 HF elements"):
        build_element_map(key, lambda w: {"a": w, "b": w})
    with pytest.raises(ConverterError, match="land in no HF tensor"):
        build_element_map(key, lambda w: {"a": w[:4]})
    with pytest.raises(ConverterError, match="no HF tensor"):
        build_element_map(key, lambda w: {})


def test_converter_lookup_takes_an_autobridge_a_model_bridge_or_a_registry():
    from types import SimpleNamespace

    from faircast_plugins.megatron.hf_map import converter_lookup, hf_vocab_size_of

    registry = SimpleNamespace(megatron_to_hf_lookup=lambda name: f"mapping of {name}")
    model_bridge = SimpleNamespace(mapping_registry=lambda: registry)
    auto = SimpleNamespace(_model_bridge=model_bridge, hf_pretrained=SimpleNamespace(config=SimpleNamespace(vocab_size=90)))
    for source in (auto, model_bridge):
        assert converter_lookup(source)("w") == "mapping of w"
    with pytest.raises(ValueError, match="pass the AutoBridge or its model bridge"):  # cannot tell its export hook
        converter_lookup(registry)
    assert hf_vocab_size_of(auto) == 90 and hf_vocab_size_of(registry) is None
    assert converter_lookup(converters={"w": 1})("w") == 1
    with pytest.raises(ValueError, match="vanilla mbridge"):
        converter_lookup(SimpleNamespace(export_weights=lambda m: None))
    with pytest.raises(ValueError, match="exactly one"):
        converter_lookup()


class MegatronModelBridge:  # megatron-bridge's base class (only its name and hook matter here)
    def mapping_registry(self):
        return _Registry()

    def maybe_modify_converted_hf_weight(self, task, converted, hf_state_dict):
        return converted


class _Registry:
    def megatron_to_hf_lookup(self, name):
        return f"mapping of {name}"


def test_a_model_bridge_whose_export_hook_changes_weights_is_refused():
    """megatron-bridge runs ``maybe_modify_converted_hf_weight`` after every mapping (MiMo swaps halves, Kimi-K2.5-VL
    re-quantizes): a model bridge that overrides it is refused, the base hook is not (megatron-review.md finding 5)."""
    from faircast_plugins.megatron.hf_map import converter_lookup

    class LlamaBridge(MegatronModelBridge):
        pass

    class MimoBridge(MegatronModelBridge):
        def maybe_modify_converted_hf_weight(self, task, converted, hf_state_dict):
            return {k: torch.cat(torch.chunk(v, 2, dim=-1)[::-1], dim=-1) for k, v in converted.items()}

    assert converter_lookup(LlamaBridge())("w") == "mapping of w"
    with pytest.raises(ConverterError, match=r"MimoBridge post-processes the exported weights.*maybe_modify_converted"):
        converter_lookup(MimoBridge())
    with pytest.raises(ConverterError, match="MimoBridge"):  # through an AutoBridge
        converter_lookup(type("AutoBridge", (), {"_model_bridge": MimoBridge()})())


AUTOBRIDGE = """
import sys
sys.path.insert(0, {root!r})
from tests.megatron import bridge_stubs
bridge_stubs.import_bridge()
from transformers import LlamaConfig
from megatron.bridge import AutoBridge
from faircast_plugins.megatron.hf_map import converter_lookup, hf_vocab_size_of
bridge = AutoBridge.from_hf_config(LlamaConfig(vocab_size=90, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                               intermediate_size=96, num_hidden_layers=2, architectures=["LlamaForCausalLM"]))
mapping = converter_lookup(bridge)("decoder.layers.1.self_attention.linear_qkv.weight")
import importlib
from megatron.bridge.models.deepseek.deepseek_v3_bridge import DeepSeekV3Bridge
from megatron.bridge.models.llama.llama_bridge import LlamaBridge
from faircast_plugins.megatron.hf_map import EXPORT_HOOK, ConverterError
converter_lookup(DeepSeekV3Bridge())  # its hook only adds rotary inv_freq: accepted
converter_lookup(LlamaBridge())  # no hook (0.3.1, 0.5.1) or the inv_freq one (0.6.2): accepted
# a bridge whose hook changes weights, in this release: Qwen3-VL-MoE regroups experts (0.3.1), MiMo swaps halves (0.5+)
for module, name in (("qwen_vl.qwen3_vl_bridge", "Qwen3VLMoEBridge"), ("mimo.mimo_bridge", "MimoBridge")):
    try:
        cls = getattr(importlib.import_module("megatron.bridge.models." + module), name)
    except (ImportError, AttributeError):
        continue
    if EXPORT_HOOK in vars(cls):
        break
try:
    converter_lookup(cls())
    print("hook accepted")
except ConverterError as exc:
    print("hook refused" if name in str(exc) else exc)
print(type(mapping).__name__, mapping.hf_param["k"], hf_vocab_size_of(bridge))
"""


def test_a_real_autobridge_gives_its_mappings_and_vocab_size():
    """megatron-bridge's AutoBridge (the object verl's engine holds), built from an HF config without weights."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("megatron.bridge") is None:
        if os.environ.get("FAIRCAST_EXPECT_MEGATRON_BRIDGE") == "1":
            pytest.fail("megatron-bridge is not installed in this virtualenv")
        pytest.skip("megatron-bridge not installed")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", AUTOBRIDGE.format(root=root)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-5:] == ["hook", "refused", "QKVMapping", "model.layers.1.self_attn.k_proj.weight",
                                        "90"], proc.stdout


class _GatedLikeBridge:
    """A stand-in with megatron-bridge's mapping shape (process-group attributes, ``gather_from_tp_ranks``): its TP
    path splits every gathered shard into gate and up, as GatedMLPMapping does."""

    def __init__(self):
        self.pp_group = self.ep_group = self._tp_group = self._etp_group = None

    def gather_from_tp_ranks(self, tensor):
        raise AssertionError("a real collective: the probe must replace it")

    def hf_to_megatron(self, weights, module):
        raise NotImplementedError

    def megatron_to_hf(self, weights, module):
        size = self._tp_group.size() if self._tp_group is not None else 1
        if size == 1:
            return dict(zip(("gate", "up"), torch.chunk(weights, 2, dim=0)))
        parts = [torch.chunk(shard, 2, dim=0) for shard in self.gather_from_tp_ranks(weights)]
        return {"gate": torch.cat([p[0] for p in parts]), "up": torch.cat([p[1] for p in parts])}


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_the_converters_own_tensor_parallel_path_must_agree_with_the_map(tp_rank):
    """At TP>1 the map (learnt on the TP=1 tensor Megatron's partition rule assembles) is checked against the
    converter's own TP path on this rank's shard: a param whose metadata says stride 1 while the converter
    de-interleaves each shard (as for a strided fc1) is refused instead of keyed wrongly."""
    strided = ParamKey("decoder.layers.0.mlp.linear_fc1.weight", (4, 3), tp_size=2, tp_rank=tp_rank, partition_dim=0,
                       stride=2)
    build_element_map(strided, _GatedLikeBridge())
    wrong = ParamKey(strided.name, (4, 3), tp_size=2, tp_rank=tp_rank, partition_dim=0, stride=1)
    with pytest.raises(ConverterError, match="own TP path"):
        build_element_map(wrong, _GatedLikeBridge())
