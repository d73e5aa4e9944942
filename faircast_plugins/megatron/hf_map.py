"""Which Hugging Face element each Megatron param element is: the element map that keys Fair Cast by HF name and
HF flat index through a converter (docs/ROUNDING.md §1, "Megatron-core through a converter").

A Megatron param is not an HF tensor: a fused QKV holds the q, k and v projections interleaved per query group,
SwiGLU's ``linear_fc1`` holds gate and up, the embedding has padded vocab rows. The converter that exports the
param to HF (megatron-bridge's ``mapping.megatron_to_hf``, or any callable with the same contract) knows where
each element goes. The map is learnt from that converter itself, once, at attach:

1. the param's full (TP=1) tensor is replaced by an integer payload ``arange(numel)`` (int32 below 2**31 elements)
   and converted: each HF tensor that comes out holds, at each of its elements, the TP=1 index of the Megatron
   element that lands there. The map keeps only its runs (stretches where both indices advance by one: a head block
   of a fused QKV, the gate or up half of SwiGLU's fc1, a whole plain weight), read from the outputs in bounded
   chunks: 32 bytes per run, not per element;
2. self-check: every Megatron element lands exactly once over the HF tensors (the runs tile the param), and a float
   payload (a hash of each element's index) comes out only permuted, the same way (a converter that adds, scales or
   casts values is refused, naming the param and the converter). The two payloads are converted one after the
   other, so attach holds at most one payload and its converted copy at a time: 8 bytes per element of the
   largest param (int32 payload) with copying converters, plus bounded chunks;
3. rows past the HF vocab size of the embedding and output layer (Megatron pads the vocab) have no HF element:
   they keep no key and are cast round-to-nearest;
4. layout.py's local -> TP=1 rule, as runs (:func:`.runs.local_runs`), intersects the map's runs, so each rank's
   data-parallel range gets its runs per HF name (:meth:`ElementMap.groups`), which the per-step cast casts in one
   launch per range (:func:`range_runs`, :func:`faircast_plugins.cast.fair_cast_runs`).

Bridge mappings are probed without communication: a copy of the mapping tree sees tensor, pipeline and expert
parallel groups of size 1 (so it converts the TP=1 tensor it is given) and any other use of a group raises.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

from ..cast import RunTable
from .layout import ParamKey
from .runs import intersect, local_runs, split_by_name

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



class ElementMap:
    """For every element of one Megatron param's full (TP=1) tensor: its HF tensor and HF flat index, as runs."""

    def __init__(self, megatron_name: str, names: List[str], runs: torch.Tensor, hf_shapes: Dict[str, Tuple[int, ...]]):
        self.megatron_name = megatron_name
        self.names = names  # HF names; name id -1: a padded row
        # int64 (runs, 4): (full first, length, name id, HF first) sorted by full index, tiling the full tensor;
        # padded rows have name id -1 and HF first -1
        self.runs = runs
        self.hf_shapes = hf_shapes

    @property
    def padded(self) -> int:
        return int(self.runs[self.runs[:, 2] < 0, 1].sum())

    @property
    def numel(self) -> int:
        return int(self.runs[:, 1].sum())

    def lookup(self, full_indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(name ids (int32), HF indices (int64))`` of the given TP=1 indices (-1, -1 for padded rows)."""
        full = full_indices.to(device="cpu", dtype=torch.int64)
        first = self.runs[:, 0].contiguous()
        r = torch.searchsorted(first, full.contiguous(), right=True) - 1
        ids = self.runs[r, 2]
        hf = torch.where(ids >= 0, self.runs[r, 3] + (full - first[r]), -1)
        return ids.to(torch.int32), hf

    def groups(self, key: ParamKey, start: int, end: int) -> List[HFGroup]:
        """The HF groups of the TP-local elements ``[start, end)`` (one DP range), in HF-name order (padded rows
        first), from the runs alone: O(runs) work and memory, none per element."""
        out = []
        for nid, runs in split_by_name(intersect(local_runs(key, start, end), self.runs)):
            name = self.names[nid] if nid >= 0 else None
            if runs.shape[0] == 1:
                first, hf_first, n = (int(v) for v in runs[0])
                out.append(HFGroup(name, slice(first, first + n), hf_first if name is not None else 0))
            else:
                out.append(HFGroup(name, runs))
        return out


def range_runs(groups: List[HFGroup]) -> Tuple[List[str], Optional[RunTable], Optional[RunTable]]:
    """One cast range's groups as run tables for :func:`faircast_plugins.cast.fair_cast_runs`: ``(HF names (the key
    slots), the keyed runs, the padded rows' runs (round-to-nearest) or None)``."""
    names, keyed, padded = [], [], []
    for g in groups:
        runs = ([[g.pos.start, g.hf or 0, g.pos.stop - g.pos.start]] if g.contiguous else g.pos.tolist())
        if g.name is None:
            padded += [[p, p, n, 0] for p, _, n in runs]
        else:
            keyed += [[p, h, n, len(names)] for p, h, n in runs]
            names.append(g.name)
    return (names, RunTable(sorted(keyed), max(1, len(names))) if keyed else None,
            RunTable(sorted(padded)) if padded else None)


# -- where the converters come from --------------------------------------------------------------------------
Lookup = Callable[[str], Any]


#: Overrides of megatron-bridge's per-model post-export hook ``MegatronModelBridge.maybe_modify_converted_hf_weight``
#: (run by ``stream_weights_megatron_to_hf`` on every mapping's output, after the converter) that were read and leave
#: the converted weights as they are: DeepSeek-V3's (bridge 0.3.1, 0.5.1, 0.6.2) and Llama's (0.6.2) only add the
#: ``rotary_emb.inv_freq`` buffer, which is not a parameter.
HARMLESS_EXPORT_HOOKS = ("megatron.bridge.models.deepseek.deepseek_v3_bridge.DeepSeekV3Bridge",
                         "megatron.bridge.models.llama.llama_bridge.LlamaBridge")
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


#: elements per chunk when reading runs and checking values: bounds attach's temporaries to a few MB
CHUNK = 1 << 20


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def _value_payload(shape, numel: int, reuse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float payload: each element's index as fp32, negated at odd indices (a converter that adds, scales,
    negates or re-rounds values no longer returns them; exact integers below 2**24, rounded above). Written into
    ``reuse`` (the int32 index payload, no longer read) when given: no second buffer to fault in."""
    values = torch.empty(numel, dtype=torch.float32) if reuse is None else reuse.view(-1).view(torch.float32)
    torch.arange(numel, dtype=torch.float32, out=values)
    values[1::2].neg_()
    return values.view(shape)


def _hf_runs(flat: torch.Tensor) -> torch.Tensor:
    """int64 ``(runs, 3)`` rows ``(HF first, full first, length)`` of an HF tensor's payload (its elements' full
    indices, flat, in HF order): maximal stretches where the full index advances by one, read in chunks."""
    n = flat.numel()
    starts = []
    succ = torch.empty(min(n, CHUNK), dtype=flat.dtype)  # buffers reused chunk after chunk: no allocation per chunk
    brk = torch.empty(min(n, CHUNK) + 1, dtype=torch.bool)
    for s in range(0, n, CHUNK):
        e = min(n, s + CHUNK)
        lo = max(0, s - 1)
        m = e - lo - 1  # comparisons of neighbours in flat[lo:e]
        torch.add(flat[lo: e - 1], 1, out=succ[:m])
        head = 1 if s == 0 else 0  # the very first element starts a run
        brk[0] = True
        torch.ne(flat[lo + 1: e], succ[:m], out=brk[head: head + m])
        starts.append(torch.nonzero(brk[: head + m]).view(-1) + s)
    first = torch.cat(starts) if starts else torch.zeros(0, dtype=torch.int64)
    length = torch.diff(first, append=torch.tensor([n]))
    return torch.stack([first, flat[first].to(torch.int64), length], dim=1)


def _full_of(hf_runs: torch.Tensor, s: int, e: int) -> torch.Tensor:
    """Full indices of HF elements ``[s, e)`` from the HF tensor's runs (sorted by HF first)."""
    pos = torch.arange(s, e, dtype=torch.int64)
    r = torch.searchsorted(hf_runs[:, 0].contiguous(), pos, right=True) - 1
    return hf_runs[r, 1] + (pos - hf_runs[r, 0])


def _first_changed(vflat: torch.Tensor, pflat: torch.Tensor, hf_runs: torch.Tensor) -> Optional[Tuple[int, int]]:
    """``(HF index, full index)`` of the first element of an HF tensor's float output (int32 bits) that is not the
    payload of the element its run names, or None: run by run (slices) when runs are long, else in chunks."""
    if hf_runs.shape[0] * 256 <= max(1, vflat.numel()):
        for h, f, n in hf_runs.tolist():
            if not torch.equal(vflat[h: h + n], pflat[f: f + n]):
                i = int(torch.nonzero(vflat[h: h + n] != pflat[f: f + n])[0])
                return h + i, f + i
        return None
    for s in range(0, vflat.numel(), CHUNK):
        e = min(vflat.numel(), s + CHUNK)
        full = _full_of(hf_runs, s, e)
        bad = torch.nonzero(vflat[s:e] != pflat[full]).view(-1)
        if bad.numel():
            i = int(bad[0])
            return s + i, int(full[i])
    return None


def build_element_map(key: ParamKey, converter, module=None, hf_vocab_size: Optional[int] = None,
                      *, generator: Optional[torch.Generator] = None) -> ElementMap:
    """The element map of one param (its canonical Megatron name and layout in ``key``), from ``converter``, with
    the self-checks. Raises :class:`ConverterError` naming the param and the converter. Deterministic: it draws no
    random numbers (``generator`` is accepted for compatibility and unused)."""
    what = f"{key.name} through {describe(converter)}"
    if getattr(converter, "is_grouped_export", False):
        raise ConverterError(f"{what}: grouped expert exports (several Megatron params stacked into one HF tensor "
                             f"by the bridge after the converter) are not supported by Fair Cast's element map")
    shape = full_shape(key)
    numel = 1
    for s in shape:
        numel *= s
    dtype = _index_dtype(numel)
    vocab = hf_vocab_size if key.name in VOCAB_PARAMS else None
    # 1. the index payload: each HF tensor's runs (then the payload and its converted copies are dropped)
    payload = torch.arange(numel, dtype=dtype).view(shape)
    index = run_converter(converter, payload, module)
    if not index:
        raise ConverterError(f"{what}: the converter returned no HF tensor")
    names, hf_shapes, out_shapes, by_name = sorted(index), {}, {}, {}
    for name in names:
        got = index.pop(name)
        if not isinstance(got, torch.Tensor) or got.dtype != dtype:
            raise ConverterError(f"{what}: {name} came out as {getattr(got, 'dtype', type(got).__name__)} from an {dtype} "
                                 f"payload: the converter changes values, it does not only rearrange them")
        out_shapes[name] = tuple(got.shape)
        if vocab is not None:
            if got.dim() == 0 or got.shape[0] < vocab:
                raise ConverterError(f"{what}: {name} has {got.shape[0] if got.dim() else 0} rows, fewer than the HF "
                                     f"vocab size {vocab}")
            got = got[:vocab]  # rows past the HF vocab: Megatron's padding, no HF element
        runs = _hf_runs(got.reshape(-1))
        del got
        if runs.shape[0] and (int(runs[:, 1].min()) < 0 or int((runs[:, 1] + runs[:, 2]).max()) > numel):
            raise ConverterError(f"{what}: the converter changes values or invents elements: {name} came back from an "
                                 f"index payload with indices outside the param")
        by_name[name] = runs
        hf_shapes[name] = ((vocab,) + out_shapes[name][1:]) if vocab is not None else out_shapes[name]
    del index
    emap = ElementMap(key.name, names, _tile(by_name, names, numel, shape, vocab, what), hf_shapes)
    # 2. the float payload: each HF tensor must hold exactly the payload of the elements its runs name
    values = _value_payload(shape, numel, payload if dtype == torch.int32 else None)
    del payload
    converted = run_converter(converter, values, module)
    if sorted(converted) != names:
        raise ConverterError(f"{what}: the converter returned other HF names for an index payload "
                             f"({names}) than for a float payload ({sorted(converted)})")
    pflat = values.view(-1).view(torch.int32)
    for name in names:
        vals = converted.pop(name)
        if not isinstance(vals, torch.Tensor) or vals.dtype != torch.float32 or tuple(vals.shape) != out_shapes[name]:
            raise ConverterError(f"{what}: {name} came out as {getattr(vals, 'dtype', type(vals).__name__)} "
                                 f"{tuple(getattr(vals, 'shape', ()))} from an fp32 payload ({out_shapes[name]} from the "
                                 f"index payload): a converter that casts or reshapes values differently per dtype is "
                                 f"refused")
        if vocab is not None:
            vals = vals[:vocab]
        bad = _first_changed(vals.reshape(-1).view(torch.int32), pflat, by_name[name])
        if bad is not None:
            h, f = bad
            got_v, want_v = (float(t[i: i + 1].view(torch.float32)) for t, i in ((vals.reshape(-1).view(torch.int32), h),
                                                                                  (pflat, f)))
            raise ConverterError(
                f"{what}: the converter changes values, it does not only rearrange them ({name} element {h}: "
                f"{got_v!r} from {want_v!r}). Fair Cast's served bits would be rounded again after the cast "
                f"(zero-centred norms add 1, scaling, dtype casts): use a model and converter that only rearrange "
                f"weights")
        del vals
    del converted, values, pflat
    if key.tp_size > 1 and key.partition_dim >= 0 and is_bridge_mapping(converter):
        _check_tensor_parallel_path(emap, key, converter, module, vocab, what)
    return emap


def _tile(by_name: Dict[str, torch.Tensor], names: List[str], numel: int, shape, vocab: Optional[int],
          what: str) -> torch.Tensor:
    """The map's runs ``(full first, length, name id, HF first)`` sorted by full index, checked to tile the param:
    no element twice, none missing but the padded vocab rows (which get name id -1)."""
    parts = [torch.stack([r[:, 1], r[:, 2], torch.full_like(r[:, 0], nid), r[:, 0]], dim=1)
             for nid, r in ((names.index(n), by_name[n]) for n in names)]
    runs = torch.cat(parts) if parts else torch.zeros((0, 4), dtype=torch.int64)
    runs = runs[torch.argsort(runs[:, 0], stable=True)]
    first, end = runs[:, 0], runs[:, 0] + runs[:, 1]
    over = torch.nonzero(first[1:] < torch.cummax(end, 0).values[:-1]).view(-1) if runs.shape[0] > 1 else first[:0]
    if over.numel():
        dup = int(first[int(over[0]) + 1])
        hits = int(((first <= dup) & (end > dup)).sum())
        raise ConverterError(f"{what}: element {dup} of the param lands in {hits} HF elements; Fair Cast "
                             f"keys each element once (a bijection onto the HF tensors)")
    covered = int(runs[:, 1].sum())
    if covered != numel:
        prev_end = torch.cat([torch.zeros(1, dtype=torch.int64), end[:-1]])
        gaps = torch.nonzero(first != prev_end).view(-1)
        missing0 = int(prev_end[int(gaps[0])]) if gaps.numel() else (int(end[-1]) if runs.shape[0] else 0)
        rows = numel // shape[0] if shape else 1
        padded = vocab is not None and missing0 == vocab * rows and covered == vocab * rows
        if not padded:
            raise ConverterError(f"{what}: {numel - covered} elements of the param (first: {missing0}) land in "
                                 f"no HF tensor; only padded vocab rows of {', '.join(VOCAB_PARAMS)} may")
        runs = torch.cat([runs, torch.tensor([[vocab * rows, numel - vocab * rows, -1, -1]], dtype=torch.int64)])
    return runs


def _check_tensor_parallel_path(emap: ElementMap, key: ParamKey, converter, module, vocab: Optional[int],
                                what: str) -> None:
    """The map is learnt on the TP=1 tensor that layout.py's local -> TP=1 rule assembles; the export runs the
    converter's own TP path on the gathered shards. Run that path on this rank's shard (its TP=1 indices; the other
    ranks' elements -1, no collective) and require every local element to land where the map says."""
    local_layout = local_runs(key, 0, key.numel)
    local = torch.empty(key.numel, dtype=_index_dtype(emap.numel))  # this rank's TP=1 indices, filled run by run
    for p, f, n in local_layout.tolist():
        local[p: p + n] = torch.arange(f, f + n, dtype=local.dtype)
    out = run_converter(converter, local.view(key.local_shape), module, key.tp_size, key.tp_rank)
    del local
    seen = 0
    for name, got in out.items():
        if vocab is not None and got.dim() and got.shape[0] >= vocab:
            got = got[:vocab]
        flat = got.reshape(-1)
        nid = emap.names.index(name) if name in emap.names else -2
        for s in range(0, flat.numel(), CHUNK):  # in chunks: no per-element temporaries of the whole tensor
            c = flat[s: s + CHUNK]
            where = torch.nonzero(c >= 0).view(-1)
            if not where.numel():
                continue
            ids, hf = emap.lookup(c[where])
            if nid == -2 or not (bool((ids == nid).all()) and torch.equal(hf, where + s)):
                raise ConverterError(
                    f"{what}: at tensor parallel rank {key.tp_rank} of {key.tp_size} the converter's own TP path puts "
                    f"this rank's elements elsewhere in {name} than its TP=1 path does on the tensor Megatron's "
                    f"partition rule assembles (partition_dim {key.partition_dim}, stride {key.stride}): Fair Cast "
                    f"cannot tell which is exported. Run this model at tensor parallel size 1, or attach without "
                    f"converters")
            seen += where.numel()
    pieces = intersect(local_layout, emap.runs)
    expected = key.numel - int(pieces[pieces[:, 1] < 0, 3].sum())
    if seen != expected:
        raise ConverterError(f"{what}: at tensor parallel rank {key.tp_rank} of {key.tp_size} the converter's own TP "
                             f"path exports {seen} of this rank's {expected} elements")
