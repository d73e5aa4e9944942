"""Which Hugging Face element each Megatron param element is: the element map that keys Fair Cast by HF name and
HF flat index through a converter (docs/ROUNDING.md §1, "Megatron-core through a converter").

A Megatron param is not an HF tensor: a fused QKV holds the q, k and v projections interleaved per query group,
SwiGLU's ``linear_fc1`` holds gate and up, the embedding has padded vocab rows. The converter that exports the
param to HF (megatron-bridge's ``mapping.megatron_to_hf``, or any callable with the same contract) knows where
each element goes. The map is learnt from that converter itself, once, at attach:

1. the param's full (TP=1) tensor is replaced by an int64 payload ``arange(numel)`` and converted: each HF tensor
   that comes out holds, at each of its elements, the TP=1 index of the Megatron element that lands there;
2. self-check: every Megatron element lands exactly once over the HF tensors (a bijection onto each of them), and
   a random float payload comes out only permuted, the same way (a converter that adds, scales or casts values is
   refused, naming the param and the converter);
3. rows past the HF vocab size of the embedding and output layer (Megatron pads the vocab) have no HF element:
   they keep no key and are cast round-to-nearest;
4. layout.py's local -> TP=1 index composes with the map, so each rank's data-parallel range gets, per element,
   ``(HF name, HF flat index)``, grouped per HF name (:meth:`ElementMap.groups`).

Bridge mappings are probed without communication: a copy of the mapping tree sees tensor, pipeline and expert
parallel groups of size 1 (so it converts the TP=1 tensor it is given) and any other use of a group raises.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

from .layout import ParamKey

#: Megatron params whose dim 0 is the (padded) vocabulary
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


class ConverterError(ValueError):
    """A converter whose output Fair Cast cannot key bit for bit (not a pure rearrangement, missing, duplicated)."""


@dataclass(frozen=True)
class HFGroup:
    """Elements of a DP range (offsets from its start) that are elements of the HF tensor ``name``.

    One contiguous run of both: ``pos`` is a slice and ``hf`` the HF index of its first element. Otherwise ``pos``
    is an int64 ``(runs, 3)`` tensor of ``(first offset, first HF index, length)`` per run, where both advance by
    one per element, and ``hf`` is None: :meth:`expand` makes the per-element indices when casting, so a rank keeps
    24 bytes per run (a row of a column split, a head block of a fused QKV), not 16 per element.
    ``name`` None: padded vocab rows, no HF element (round-to-nearest)."""

    name: Optional[str]
    pos: Union[slice, torch.Tensor]
    hf: Optional[int] = None

    @property
    def contiguous(self) -> bool:
        return isinstance(self.pos, slice)

    def expand(self, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(offsets, HF indices)`` of every element, int64 on ``device``."""
        if self.contiguous:
            n = self.pos.stop - self.pos.start
            local = torch.arange(n, dtype=torch.int64, device=device)
            return local + self.pos.start, local + (self.hf or 0)
        runs = self.pos.to(device)
        lengths = runs[:, 2]
        firsts = torch.cumsum(lengths, 0) - lengths
        within = torch.arange(int(lengths.sum()), dtype=torch.int64, device=device) - torch.repeat_interleave(firsts, lengths)
        return torch.repeat_interleave(runs[:, 0], lengths) + within, torch.repeat_interleave(runs[:, 1], lengths) + within

    def on(self, device) -> "HFGroup":
        return self if self.contiguous or self.pos.device == torch.device(device) else HFGroup(self.name, self.pos.to(device))


def _runs(pos: torch.Tensor, hf: torch.Tensor) -> torch.Tensor:
    """``(first pos, first hf, length)`` of each maximal run where both advance by one."""
    n = pos.numel()
    start = torch.ones(n, dtype=torch.bool)
    start[1:] = ((pos[1:] - pos[:-1]) != 1) | ((hf[1:] - hf[:-1]) != 1)
    firsts = torch.nonzero(start).view(-1)
    lengths = torch.diff(firsts, append=torch.tensor([n]))
    return torch.stack([pos[firsts], hf[firsts], lengths], dim=1)


class ElementMap:
    """For every element of one Megatron param's full (TP=1) tensor: its HF tensor and HF flat index."""

    def __init__(self, megatron_name: str, names: List[str], name_ids: torch.Tensor, hf_index: torch.Tensor,
                 hf_shapes: Dict[str, Tuple[int, ...]]):
        self.megatron_name = megatron_name
        self.names = names  # HF names; name id -1: a padded row
        self.name_ids = name_ids  # int32, one per TP=1 element
        self.hf_index = hf_index  # int64, one per TP=1 element (-1 for padded rows)
        self.hf_shapes = hf_shapes

    @property
    def padded(self) -> int:
        return int((self.name_ids < 0).sum())

    def lookup(self, full_indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(name ids, HF indices)`` of the given TP=1 indices."""
        full_indices = full_indices.to(self.name_ids.device)
        return self.name_ids[full_indices], self.hf_index[full_indices]

    def groups(self, key: ParamKey, start: int, end: int) -> List[HFGroup]:
        """The HF groups of the TP-local elements ``[start, end)`` (one DP range), in HF-name order."""
        full = torch.arange(start, end, dtype=torch.int64) + key.offset(0) if key.contiguous else key.indices(start, end)
        ids, hf = self.lookup(full)
        out = []
        for nid in torch.unique(ids).tolist():
            pos = torch.nonzero(ids == nid).view(-1)
            name = self.names[nid] if nid >= 0 else None
            where = hf[pos] if name is not None else pos  # padded rows: runs of offsets only
            runs = _runs(pos, where)
            if runs.shape[0] == 1:
                first, hf_first, n = (int(v) for v in runs[0])
                out.append(HFGroup(name, slice(first, first + n), hf_first if name is not None else 0))
            else:
                out.append(HFGroup(name, runs))
        return out


# -- where the converters come from --------------------------------------------------------------------------
Lookup = Callable[[str], Any]


#: Overrides of megatron-bridge's per-model post-export hook ``MegatronModelBridge.maybe_modify_converted_hf_weight``
#: (run by ``stream_weights_megatron_to_hf`` on every mapping's output, after the converter) that were read and leave
#: the converted weights as they are: DeepSeek-V3's only adds the ``rotary_emb.inv_freq`` buffer (bridge 0.3.1, 0.5.1).
HARMLESS_EXPORT_HOOKS = ("megatron.bridge.models.deepseek.deepseek_v3_bridge.DeepSeekV3Bridge",)
EXPORT_HOOK = "maybe_modify_converted_hf_weight"


def check_export_hook(model_bridge) -> None:
    """Refuse a model bridge whose post-export hook can change the exported weights after the converter Fair Cast
    probes (MiMo swaps halves of ``eh_proj``, Kimi-K2.5-VL re-quantizes experts to INT4, Gemma4 rescales the router):
    the served elements would not be where, or what, the element map says."""
    for cls in type(model_bridge).__mro__:
        if EXPORT_HOOK in vars(cls):
            where = f"{cls.__module__}.{cls.__qualname__}"
            if cls.__name__ == "MegatronModelBridge" or where in HARMLESS_EXPORT_HOOKS:
                return
            raise ConverterError(
                f"megatron-bridge's {type(model_bridge).__name__} post-processes the exported weights ({where}."
                f"{EXPORT_HOOK}: after the converter, it may permute, rescale or quantize them), which Fair Cast's "
                f"element map does not see: the served bits would not be the keyed fair_cast of the master. Not "
                f"supported for this model; pass converters= that export exactly what is served, or turn Fair Cast off")


def converter_lookup(bridge=None, converters: Optional[Mapping[str, Any]] = None) -> Lookup:
    """``megatron name -> converter`` from megatron-bridge (an ``AutoBridge`` or a ``MegatronModelBridge``: a model
    bridge whose post-export hook changes weights is refused, :func:`check_export_hook`), from an explicit
    ``{megatron name: converter}`` map, or from a callable ``lookup(megatron name) -> converter or None`` (slime:
    :func:`faircast_plugins.megatron.slime.slime_converters`). A converter is a bridge param mapping
    (``megatron_to_hf(weights, module) -> {hf name: tensor}``) or a callable ``f(full TP=1 tensor) -> {hf name:
    tensor}`` that only rearranges elements."""
    if (bridge is None) == (converters is None):
        raise ValueError("pass exactly one of bridge= and converters=")
    if converters is not None:
        if callable(converters) and not isinstance(converters, Mapping):
            return converters
        table = dict(converters)
        return table.get
    model_bridge = bridge
    if hasattr(model_bridge, "_model_bridge") and not hasattr(model_bridge, "mapping_registry"):  # AutoBridge
        model_bridge = model_bridge._model_bridge
    if hasattr(model_bridge, "megatron_to_hf_lookup"):
        raise ValueError(f"bridge= got a {type(bridge).__name__} (megatron-bridge's mapping registry): pass the AutoBridge "
                         f"or its model bridge, whose export may post-process the converted weights "
                         f"({EXPORT_HOOK}), which the registry alone does not say")
    if not hasattr(model_bridge, "mapping_registry"):
        raise ValueError(f"{type(bridge).__name__} is not a megatron-bridge AutoBridge or MegatronModelBridge (the "
                         f"vanilla mbridge is not supported); pass converters= instead")
    check_export_hook(model_bridge)
    return model_bridge.mapping_registry().megatron_to_hf_lookup


def hf_vocab_size_of(bridge) -> Optional[int]:
    """The HF vocab size a megatron-bridge ``AutoBridge`` was built for (its HF config), or None."""
    pretrained = getattr(bridge, "hf_pretrained", None)
    for config in (getattr(pretrained, "config", None), pretrained, getattr(bridge, "hf_config", None)):
        size = getattr(config, "vocab_size", None)
        if isinstance(size, int):
            return size
    return None


def describe(converter) -> str:
    """The converter's class (a bridge mapping, with its HF names) or function name, for messages."""
    if hasattr(converter, "megatron_to_hf"):
        name = type(converter).__name__
    else:
        name = getattr(converter, "__qualname__", type(converter).__name__)
    hf = getattr(converter, "hf_param", None)
    return f"{name}({hf})" if hf is not None else name


# -- running a converter without communication ---------------------------------------------------------------
class _LocalGroup:
    """A process-group stand-in for probe copies: its size and rank only; any other use is communication."""

    def __init__(self, size: int = 1, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __getattr__(self, name):
        raise ConverterError(f"the converter used its process group ({name!r}) while Fair Cast probed it: it "
                             f"communicates outside the tensor/expert-parallel gather helpers")


_GROUP_ATTRS = ("pp_group", "ep_group", "_tp_group", "_etp_group")


def _probe(mapping, module, tp_size: int = 1, tp_rank: int = 0):
    """A copy of a bridge mapping tree (composite mappings delegate to inner ones; AutoMapping creates its concrete
    delegate lazily) that runs without any collective: pipeline and expert parallel size 1, and tensor parallel
    ``(tp_size, tp_rank)`` whose gather returns the given shard at ``tp_rank`` and -1 (another rank's elements) at
    the others. At size 1 it converts the TP=1 tensor it is given."""
    seen: Dict[int, Any] = {}

    def gather(tensor):
        return [tensor if r == tp_rank else torch.full_like(tensor, -1) for r in range(tp_size)]

    def warm(m):
        if hasattr(m, "_detect_parallelism_type") and getattr(m, "_mapping", "absent") is None and module is not None:
            kind = m._detect_parallelism_type(module)
            m._mapping = m._get_or_create_mapping(kind)
            m._detected_type = kind

    def local(m):
        if id(m) in seen:
            return seen[id(m)]
        warm(m)
        c = copy.copy(m)
        seen[id(m)] = c
        for attr in _GROUP_ATTRS:
            if hasattr(c, attr):
                setattr(c, attr, _LocalGroup(tp_size, tp_rank) if attr in ("_tp_group", "_etp_group") else _LocalGroup())
        c.gather_from_ep_ranks = lambda weights, mod, name: {str(name): weights}
        c.gather_from_tp_ranks = gather
        for attr, value in list(vars(c).items()):
            if hasattr(type(value), "megatron_to_hf") and hasattr(type(value), "hf_to_megatron"):  # an inner mapping
                setattr(c, attr, local(value))
        return c

    return local(mapping)


def is_bridge_mapping(converter) -> bool:
    return hasattr(converter, "megatron_to_hf") and any(hasattr(converter, a) for a in _GROUP_ATTRS)


def run_converter(converter, payload: torch.Tensor, module, tp_size: int = 1, tp_rank: int = 0) -> Dict[str, torch.Tensor]:
    """``{hf name: tensor}`` of the converter applied to a full (TP=1) payload, without communication; a bridge
    mapping at ``tp_size > 1`` takes rank ``tp_rank``'s shard instead (see :func:`_probe`)."""
    if hasattr(converter, "megatron_to_hf"):
        if is_bridge_mapping(converter):
            converter = _probe(converter, module, tp_size, tp_rank)
        out = converter.megatron_to_hf(payload, module)
    else:
        out = converter(payload)
    return dict(out or {})


# -- the map of one param ------------------------------------------------------------------------------------
def full_shape(key: ParamKey) -> Tuple[int, ...]:
    shape = list(key.local_shape)
    if key.partition_dim >= 0:
        shape[key.partition_dim] *= key.tp_size
    return tuple(shape)


def build_element_map(key: ParamKey, converter, module=None, hf_vocab_size: Optional[int] = None,
                      *, generator: Optional[torch.Generator] = None) -> ElementMap:
    """The element map of one param (its canonical Megatron name and layout in ``key``), from ``converter``, with
    the self-checks. Raises :class:`ConverterError` naming the param and the converter."""
    what = f"{key.name} through {describe(converter)}"
    if getattr(converter, "is_grouped_export", False):
        raise ConverterError(f"{what}: grouped expert exports (several Megatron params stacked into one HF tensor "
                             f"by the bridge after the converter) are not supported by Fair Cast's element map")
    shape = full_shape(key)
    numel = 1
    for s in shape:
        numel *= s
    index = run_converter(converter, torch.arange(numel, dtype=torch.int64).view(shape), module)
    values = torch.randn(shape, generator=generator, dtype=torch.float32)
    converted = run_converter(converter, values, module)
    if not index:
        raise ConverterError(f"{what}: the converter returned no HF tensor")
    if sorted(index) != sorted(converted):
        raise ConverterError(f"{what}: the converter returned other HF names for an index payload "
                             f"({sorted(index)}) than for a float payload ({sorted(converted)})")
    vocab = hf_vocab_size if key.name in VOCAB_PARAMS else None
    names, hf_shapes = sorted(index), {}
    name_ids = torch.full((numel,), -1, dtype=torch.int32)
    hf_index = torch.full((numel,), -1, dtype=torch.int64)
    hits = torch.zeros(numel, dtype=torch.int32)
    flat_values = values.view(-1)
    for nid, name in enumerate(names):
        got, vals = index[name], converted[name]
        if not isinstance(got, torch.Tensor) or got.dtype != torch.int64:
            raise ConverterError(f"{what}: {name} came out as {getattr(got, 'dtype', type(got).__name__)} from an int64 "
                                 f"payload: the converter changes values, it does not only rearrange them")
        if vals.dtype != torch.float32 or vals.shape != got.shape:
            raise ConverterError(f"{what}: {name} came out as {vals.dtype} {tuple(vals.shape)} from an fp32 payload "
                                 f"({tuple(got.shape)} from the index payload): a converter that casts or reshapes "
                                 f"values differently per dtype is refused")
        if vocab is not None:
            if got.dim() == 0 or got.shape[0] < vocab:
                raise ConverterError(f"{what}: {name} has {got.shape[0] if got.dim() else 0} rows, fewer than the HF "
                                     f"vocab size {vocab}")
            got, vals = got[:vocab], vals[:vocab]  # rows past the HF vocab: Megatron's padding, no HF element
        flat, vflat = got.reshape(-1), vals.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= numel):
            raise ConverterError(f"{what}: the converter changes values or invents elements: {name} came back from an "
                                 f"index payload with indices outside the param")
        if not torch.equal(vflat.view(torch.int32), flat_values[flat].view(torch.int32)):
            bad = int(torch.nonzero(vflat.view(torch.int32) != flat_values[flat].view(torch.int32))[0])
            raise ConverterError(
                f"{what}: the converter changes values, it does not only rearrange them ({name} element {bad}: "
                f"{float(vflat[bad])!r} from {float(flat_values[flat][bad])!r}). Fair Cast's served bits would be "
                f"rounded again after the cast (zero-centred norms add 1, scaling, dtype casts): use a model and "
                f"converter that only rearrange weights")
        hits.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        name_ids[flat] = nid
        hf_index[flat] = torch.arange(flat.numel(), dtype=torch.int64)
        hf_shapes[name] = tuple(got.shape)
    if int(hits.max()) > 1:
        dup = int(torch.nonzero(hits > 1)[0])
        raise ConverterError(f"{what}: element {dup} of the param lands in {int(hits[dup])} HF elements; Fair Cast "
                             f"keys each element once (a bijection onto the HF tensors)")
    missing = torch.nonzero(hits == 0).view(-1)
    if missing.numel():
        rows = numel // shape[0] if shape else 1
        padded = vocab is not None and int(missing[0]) >= vocab * rows and missing.numel() == numel - vocab * rows
        if not padded:
            raise ConverterError(f"{what}: {missing.numel()} elements of the param (first: {int(missing[0])}) land in "
                                 f"no HF tensor; only padded vocab rows of {', '.join(VOCAB_PARAMS)} may")
    emap = ElementMap(key.name, names, name_ids, hf_index, hf_shapes)
    if key.tp_size > 1 and key.partition_dim >= 0 and is_bridge_mapping(converter):
        _check_tensor_parallel_path(emap, key, converter, module, vocab, what)
    return emap


def _check_tensor_parallel_path(emap: ElementMap, key: ParamKey, converter, module, vocab: Optional[int],
                                what: str) -> None:
    """The map is learnt on the TP=1 tensor that layout.py's local -> TP=1 rule assembles; the export runs the
    converter's own TP path on the gathered shards. Run that path on this rank's shard (its TP=1 indices; the other
    ranks' elements -1, no collective) and require every local element to land where the map says."""
    local = key.indices(0, key.numel).view(key.local_shape)
    out = run_converter(converter, local, module, key.tp_size, key.tp_rank)
    seen = 0
    for name, got in out.items():
        if vocab is not None and got.dim() and got.shape[0] >= vocab:
            got = got[:vocab]
        flat = got.reshape(-1)
        where = torch.nonzero(flat >= 0).view(-1)
        if not where.numel():
            continue
        nid = emap.names.index(name) if name in emap.names else -2
        ids, hf = emap.lookup(flat[where])
        if nid == -2 or not (bool((ids == nid).all()) and torch.equal(hf, where)):
            raise ConverterError(
                f"{what}: at tensor parallel rank {key.tp_rank} of {key.tp_size} the converter's own TP path puts this "
                f"rank's elements elsewhere in {name} than its TP=1 path does on the tensor Megatron's partition rule "
                f"assembles (partition_dim {key.partition_dim}, stride {key.stride}): Fair Cast cannot tell which is "
                f"exported. Run this model at tensor parallel size 1, or attach without converters")
        seen += where.numel()
    expected = key.numel - int((emap.lookup(local.reshape(-1))[0] < 0).sum())
    if seen != expected:
        raise ConverterError(f"{what}: at tensor parallel rank {key.tp_rank} of {key.tp_size} the converter's own TP "
                             f"path exports {seen} of this rank's {expected} elements")
