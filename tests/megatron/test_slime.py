"""Fair Cast's HF keys through slime's own Megatron->HF converters (faircast_plugins/megatron/slime.py).

Two tiers:

* always (CI has no GitHub access): the adapter against a hand-written stand-in of slime's ``convert_to_hf``
  contract (written here from slime's documented behaviour, not copied): slime's names, the padded rows it drops,
  the refusals, and what is said when slime is missing;
* with ``FAIRCAST_SLIME_SRC`` (a slime source tree, tests/megatron/slime_source.py): slime's REAL converter modules
  key the tiny GPT of tests/megatron under the names slime's Megatron models have (TransformerEngine layer spec:
  the norms fused into ``linear_qkv`` / ``linear_fc1``; grouped experts ``linear_fc1.weight<E>``), and the HF names
  and shapes they give must be those of the matching Hugging Face transformers model; plus one megatron-core
  worker run (``hf_slime``). Without the variable these tests skip, saying how to run them.
"""
from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from faircast_plugins.megatron import slime as fc_slime
from faircast_plugins.megatron.hf_map import ConverterError, build_element_map
from faircast_plugins.megatron.layout import ParamKey
from tests.megatron import hf_converters, slime_source

# the tiny GPT of tests/megatron/worker.py: hidden 64, 4 heads in 2 query groups (head dim 16), SwiGLU 96,
# vocab 96 padded over an HF vocab of 90
HIDDEN, HEADS, GROUPS, FFN, VOCAB, HF_VOCAB, LAYERS = 64, 4, 2, 96, 96, 90, 2
HEAD_DIM = HIDDEN // HEADS
QKV_ROWS = (HEADS + 2 * GROUPS) * HEAD_DIM


def slime_args(**kw):
    """The fields of slime's Megatron arguments its converters read."""
    return SimpleNamespace(vocab_size=HF_VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                           kv_channels=None, q_lora_rank=None, **kw)


def te_spec_params(tied=False, qkv_bias=False, qk_norm=False, experts=0, moe_ffn=48):
    """``{Megatron name: shape}`` of the tiny GPT under the TransformerEngine layer spec slime builds (the input
    norm is ``linear_qkv.layer_norm_weight``; the pre-MLP norm ``linear_fc1.layer_norm_weight``, or
    ``pre_mlp_layernorm.weight`` before an MoE layer; grouped experts ``linear_fc{1,2}.weight<E>``)."""
    out = {"embedding.word_embeddings.weight": (VOCAB, HIDDEN), "decoder.final_layernorm.weight": (HIDDEN,)}
    if not tied:
        out["output_layer.weight"] = (VOCAB, HIDDEN)
    for layer in range(LAYERS):
        p = f"decoder.layers.{layer}."
        out[p + "self_attention.linear_qkv.layer_norm_weight"] = (HIDDEN,)
        out[p + "self_attention.linear_qkv.weight"] = (QKV_ROWS, HIDDEN)
        if qkv_bias:
            out[p + "self_attention.linear_qkv.bias"] = (QKV_ROWS,)
        if qk_norm:
            out[p + "self_attention.q_layernorm.weight"] = (HEAD_DIM,)
            out[p + "self_attention.k_layernorm.weight"] = (HEAD_DIM,)
        out[p + "self_attention.linear_proj.weight"] = (HIDDEN, HEADS * HEAD_DIM)
        if experts:
            out[p + "pre_mlp_layernorm.weight"] = (HIDDEN,)
            out[p + "mlp.router.weight"] = (experts, HIDDEN)
            for e in range(experts):  # global expert ids, as slime's names and Fair Cast's canonical names hold them
                out[p + f"mlp.experts.linear_fc1.weight{e}"] = (2 * moe_ffn, HIDDEN)
                out[p + f"mlp.experts.linear_fc2.weight{e}"] = (HIDDEN, moe_ffn)
        else:
            out[p + "mlp.linear_fc1.layer_norm_weight"] = (HIDDEN,)
            out[p + "mlp.linear_fc1.weight"] = (2 * FFN, HIDDEN)
            out[p + "mlp.linear_fc2.weight"] = (HIDDEN, FFN)
    return out


def element_maps(lookup, params):
    """The element map of every param (build_element_map's self-check: a bijection onto the HF tensors, values
    only rearranged), and ``{HF name: shape}`` over all of them (no HF tensor from two params)."""
    maps, shapes = {}, {}
    for name, shape in params.items():
        emap = build_element_map(ParamKey(name, shape), lookup(name), hf_vocab_size=HF_VOCAB,
                                 generator=torch.Generator().manual_seed(0))
        for hf_name, hf_shape in emap.hf_shapes.items():
            assert hf_name not in shapes, f"{hf_name} from two params"
            shapes[hf_name] = hf_shape
        maps[name] = emap
    return maps, shapes


# -- without slime: a hand-written stand-in of convert_to_hf's contract ----------------------------------------
class StandInConvertToHF:
    """What slime's ``convert_to_hf(args, model_name, name, param, quantization_config)`` is documented to do, for
    a few names: ``module.module.`` + the global Megatron name in, the padded vocab rows past ``args.vocab_size``
    dropped, ``[(HF name, tensor)]`` out; ValueError for a name it does not know. ``norm_plus_one``: a
    zero-centred-norm export (adds 1), which Fair Cast must refuse."""

    def __init__(self, norm_plus_one=False):
        self.norm_plus_one, self.calls = norm_plus_one, []

    def __call__(self, args, model_name, name, param, quantization_config=None, transform_ue8m0=True):
        self.calls.append((model_name, name, quantization_config))
        assert name.startswith("module.module.")
        bare = name[len("module.module."):]
        if bare == "embedding.word_embeddings.weight":
            return [("model.embed_tokens.weight", param[: args.vocab_size])]
        if bare == "decoder.final_layernorm.weight":
            return [("model.norm.weight", param + 1 if self.norm_plus_one else param)]
        if bare == "decoder.layers.3.mlp.linear_fc1.weight":
            gate, up = torch.chunk(param, 2, dim=0)
            return [("model.layers.3.mlp.gate_proj.weight", gate), ("model.layers.3.mlp.up_proj.weight", up)]
        raise ValueError(f"Unknown parameter name: {name}")


HF_CONFIG = SimpleNamespace(quantization_config=None)  # slime's self.hf_config of a bf16 checkpoint


@pytest.fixture
def stand_in(monkeypatch):
    convert = StandInConvertToHF()
    module = types.ModuleType(fc_slime.CONVERTER_MODULE)
    module.convert_to_hf = convert
    monkeypatch.setitem(sys.modules, fc_slime.CONVERTER_MODULE, module)
    return convert


def test_missing_slime_says_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, fc_slime.CONVERTER_MODULE, None)  # not importable
    with pytest.raises(ImportError, match=r"slime's Megatron->HF converters \(slime\.backends\.megatron_utils\."
                                          r"megatron_to_hf.*THUDM/slime"):
        fc_slime.slime_converters(slime_args(), "qwen2config", HF_CONFIG)


def test_the_lookup_runs_convert_to_hf_under_slimes_names(stand_in):
    lookup = fc_slime.slime_converters(slime_args(), "qwen2config", HF_CONFIG)
    emap = build_element_map(ParamKey("decoder.layers.3.mlp.linear_fc1.weight", (8, 3)),
                             lookup("decoder.layers.3.mlp.linear_fc1.weight"))
    assert emap.hf_shapes == {"model.layers.3.mlp.gate_proj.weight": (4, 3), "model.layers.3.mlp.up_proj.weight": (4, 3)}
    assert stand_in.calls[-1] == ("qwen2config", "module.module.decoder.layers.3.mlp.linear_fc1.weight", None)
    # the padded vocab rows slime drops are Fair Cast's padded rows (round to nearest, no HF element)
    emb = ParamKey("embedding.word_embeddings.weight", (VOCAB, 2))
    emap = build_element_map(emb, lookup(emb.name), hf_vocab_size=HF_VOCAB)
    assert emap.hf_shapes == {"model.embed_tokens.weight": (HF_VOCAB, 2)} and emap.padded == 2 * (VOCAB - HF_VOCAB)
    assert lookup(emb.name).__qualname__ == "slime convert_to_hf[qwen2config]"


def test_a_param_slime_does_not_convert_is_refused_naming_it(stand_in):
    lookup = fc_slime.slime_converters(slime_args(), "qwen2config", HF_CONFIG)
    key = ParamKey("decoder.layers.0.input_layernorm.weight", (4,))
    with pytest.raises(ConverterError, match=r"does not convert module\.module\.decoder\.layers\.0\.input_layernorm"):
        build_element_map(key, lookup(key.name))


def test_a_converter_that_adds_is_refused_by_the_self_check(monkeypatch):
    module = types.ModuleType(fc_slime.CONVERTER_MODULE)
    module.convert_to_hf = StandInConvertToHF(norm_plus_one=True)
    monkeypatch.setitem(sys.modules, fc_slime.CONVERTER_MODULE, module)
    lookup = fc_slime.slime_converters(slime_args(), "qwen3nextconfig", HF_CONFIG)
    key = ParamKey("decoder.final_layernorm.weight", (8,))
    with pytest.raises(ConverterError, match=r"decoder\.final_layernorm\.weight through slime convert_to_hf"
                                             r"\[qwen3nextconfig\].*changes values"):
        build_element_map(key, lookup(key.name))


def test_quantized_exports_and_mla_q_lora_are_refused(stand_in):
    with pytest.raises(ConverterError, match="quantizes.*fp8"):
        fc_slime.slime_converters(slime_args(), "qwen2config", SimpleNamespace(quantization_config={"quant_method": "fp8"}))
    with pytest.raises(ConverterError, match="quantizes.*w4a16"):  # a transformers QuantizationConfig object, a dict
        fc_slime.slime_converters(slime_args(), "qwen2config",
                                  {"quantization_config": SimpleNamespace(quant_method="w4a16")})
    with pytest.raises(ConverterError, match="q_lora_rank"):
        fc_slime.slime_converters(SimpleNamespace(**{**vars(slime_args()), "q_lora_rank": 8}), "deepseekv3config",
                                  HF_CONFIG)


def test_the_documented_call_without_the_hf_config_is_refused(stand_in):
    """slime's updater reads quantization_config from the actor's HF config: a call that omits it could not refuse
    an fp8 / int4 export (megatron-review.md finding 3)."""
    with pytest.raises(ConverterError, match="pass the actor's HF config"):
        fc_slime.slime_converters(slime_args(), "qwen2config")


def test_apply_megatron_patch_takes_a_lookup_function():
    from faircast_plugins.megatron.hf_map import converter_lookup

    def lookup(name):
        return "converter of " + name

    assert converter_lookup(converters=lookup) is lookup
    assert converter_lookup(converters={"w": 1})("w") == 1


# -- with slime's real converters (FAIRCAST_SLIME_SRC) --------------------------------------------------------
@pytest.fixture
def real_slime():
    src = slime_source.source()
    if src is None:
        pytest.skip(f"slime's source is not here: {slime_source.HOW_TO_RUN}")
    slime_source.uninstall()
    module = slime_source.install(src)
    yield module
    slime_source.uninstall()


def hf_parameters(config_cls, model_cls, **kw):
    """``{name: shape}`` of the parameters of a Hugging Face transformers model (on the meta device; tied weights
    once)."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_cls)(vocab_size=HF_VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                               num_key_value_heads=GROUPS, num_hidden_layers=LAYERS, **kw)
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(config)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_real_slime_qwen2_converters_key_the_tiny_gpt_by_transformers_names(real_slime, tied):
    """slime's convert_to_hf for model 'qwen2config' (convert_qwen2_to_hf: fused QKV with bias, GQA 4/2; SwiGLU fc1;
    the TE-fused norms; the padded vocab dropped): every param's map is a bijection onto HF tensors that are
    exactly Qwen2ForCausalLM's parameters, names and shapes."""
    lookup = fc_slime.slime_converters(slime_args(), "qwen2config", HF_CONFIG)
    params = te_spec_params(tied=tied, qkv_bias=True)
    maps, shapes = element_maps(lookup, params)
    assert shapes == hf_parameters("Qwen2Config", "Qwen2ForCausalLM", intermediate_size=FFN, tie_word_embeddings=tied)
    assert maps["embedding.word_embeddings.weight"].padded == (VOCAB - HF_VOCAB) * HIDDEN
    assert ("lm_head.weight" in shapes) == (not tied)


def test_real_slime_llama_converters_key_the_tiny_gpt_by_transformers_names(real_slime):
    lookup = fc_slime.slime_converters(slime_args(), "llamaconfig", HF_CONFIG)
    _, shapes = element_maps(lookup, te_spec_params())
    assert shapes == hf_parameters("LlamaConfig", "LlamaForCausalLM", intermediate_size=FFN, tie_word_embeddings=False)


def test_real_slime_qwen3_moe_converters_key_experts_by_global_id(real_slime):
    """convert_qwen3moe_to_hf: grouped experts ``linear_fc1.weight<E>`` (E global, as Fair Cast's canonical names)
    -> ``mlp.experts.E.{gate,up,down}_proj``, the router, q/k norms: Qwen3MoeForCausalLM's parameters."""
    lookup = fc_slime.slime_converters(slime_args(), "qwen3moeconfig", HF_CONFIG)
    _, shapes = element_maps(lookup, te_spec_params(qk_norm=True, experts=4))
    want = hf_parameters("Qwen3MoeConfig", "Qwen3MoeForCausalLM", head_dim=HEAD_DIM, intermediate_size=FFN,
                         moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                         mlp_only_layers=[], tie_word_embeddings=False)
    assert shapes == want


def test_real_slime_keys_equal_the_bridge_like_keys(real_slime):
    """The keys slime's converters give the fused QKV and SwiGLU fc1 are element for element those of
    megatron-bridge's QKVMapping / GatedMLPMapping layout (tests/megatron/hf_converters.py, which the worker checks
    against megatron-bridge 0.3.1): a model keyed through verl's bridge or through slime's sync casts alike."""
    lookup = fc_slime.slime_converters(slime_args(), "qwen2config", HF_CONFIG)
    prefix = "model.layers.1."
    pairs = {
        "decoder.layers.1.self_attention.linear_qkv.weight": hf_converters.qkv(
            HEADS, GROUPS, *(prefix + f"self_attn.{p}_proj.weight" for p in "qkv")),
        "decoder.layers.1.mlp.linear_fc1.weight": hf_converters.gated(prefix + "mlp.gate_proj.weight",
                                                                      prefix + "mlp.up_proj.weight"),
    }
    params = te_spec_params()
    for name, bridge_like in pairs.items():
        key = ParamKey(name, params[name])
        a, b = build_element_map(key, lookup(name)), build_element_map(key, bridge_like)
        assert a.names == b.names and a.hf_shapes == b.hf_shapes
        assert torch.equal(a.name_ids, b.name_ids) and torch.equal(a.hf_index, b.hf_index)


@pytest.mark.parametrize("nproc,name", [(1, "hf_slime"), (2, "hf_slime_tp2")])
def test_real_slime_converters_on_a_megatron_core_optimizer(real_slime, tmp_path_factory, nproc, name):
    """tests/megatron/worker.py's ``hf_slime`` (world size 1) and ``hf_slime_tp2`` (TP2; distributed optimizer, 2
    steps): Fair Cast attached with slime's converters (model 'llamaconfig'); the served params, gathered by slime's
    own ``all_gather_param`` (TP2: its GLU re-chunk of fc1) and exported through slime's convert_to_hf, are what
    ``faircast export`` serves from the HF checkpoint of the fp32 master (assembled by Megatron's partition rule),
    bit for bit; the padded rows slime drops stay round-to-nearest. The local layer spec's
    ``input_layernorm.weight`` is handed to slime under its TransformerEngine name
    ``self_attention.linear_qkv.layer_norm_weight`` (the same tensor; slime's converters know only the TE names)."""
    pytest.importorskip("megatron.core")
    from tests.megatron.test_megatron import launch

    ranks = launch(nproc, [name], tmp_path_factory)[name]
    assert sorted(r["coords"]["tp"] for r in ranks) == list(range(nproc))
    for r in ranks:
        assert "error" not in r, r["error"]
        hf = r["hf"]
        assert r["steps_ok"] and r["version"] == 2
        assert hf["slime_gather"] is True and hf["bridge"] is False
        assert hf["mismatches"] == [] and hf["differs_from_rtn"] == len(hf["hf_names"]) == 21, hf  # 3 + 9 per layer
        assert hf["padded_rows"] == 2 * (VOCAB - HF_VOCAB) and hf["padded_rows_rtn"] is True
        assert len(r["check"]["mismatches"]) == r["check"]["params"]  # Megatron-native keys no longer fit the bits
        assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.k_proj.weight",
                "model.layers.0.input_layernorm.weight", "model.layers.1.mlp.up_proj.weight"} <= set(hf["hf_names"])


@pytest.mark.parametrize("mode, warns", [("stochastic", True), ("error_feedback", True), ("sticky", False)])
def test_slime_delta_weight_sync_warns_for_modes_that_resend_most_elements(stand_in, caplog, mode, warns):
    """slime's --update-weight-mode=delta sends only the HF elements that changed; stochastic redraws its noise every
    version, so that is nearly a full sync (megatron-review.md finding 12): apply_megatron_patch says so."""
    from faircast_plugins.caster import FairCaster
    from faircast_plugins.config import FairCastConfig
    from faircast_plugins.megatron import apply_megatron_patch

    delta = fc_slime.slime_converters(SimpleNamespace(**{**vars(slime_args()), "update_weight_mode": "delta"}),
                                      "qwen2config", HF_CONFIG)
    full = fc_slime.slime_converters(SimpleNamespace(**{**vars(slime_args()), "update_weight_mode": "full"}),
                                     "qwen2config", HF_CONFIG)
    assert delta.delta_sync == "slime's --update-weight-mode=delta" and not hasattr(full, "delta_sync")
    for converters, expected in ((delta, warns), (full, False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="faircast_plugins"), pytest.raises(Exception):
            apply_megatron_patch(object(), FairCaster(FairCastConfig(enabled=True, mode=mode)), model_chunks=[object()],
                                 converters=converters, hf_vocab_size=HF_VOCAB)  # no optimizer: raises after the advice
        said = [r.getMessage() for r in caplog.records if "delta weight sync" in r.getMessage()]
        assert bool(said) == expected, said
        if expected:
            assert "mode=sticky" in said[0] and "--update-weight-mode=delta" in said[0]
