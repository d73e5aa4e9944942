"""Served-copy checkpoints: rebuild, offline, the bf16 weights a rollout engine held at one weight version.

With Fair Cast on, the bf16 copy that generated the training data is not round-to-nearest of the fp32
master, so the fp32 checkpoint (or its plain ``.to(bfloat16)``) is a model that was never served. Every
served copy is a pure function of (fp32 master, seed, weight version, canonical name) (``ROUNDING.md``),
so it can be recomputed exactly from any checkpoint::

    export_served("ckpt/", "ckpt-served/", seed=1234, version=200)       # writes a bf16 HF checkpoint
    verify_served("ckpt/", "ckpt-served/").ok                              # re-derives and compares

or ``faircast export --checkpoint ckpt/ --seed 1234 --weight-version 200 --out ckpt-served/`` and
``faircast verify --checkpoint ckpt/ --served ckpt-served/``.

What is written (mirroring the input's shard layout, one tensor at a time):

* fp32 tensors: the Fair Cast bf16 copy, cast by :class:`FairCaster` under their checkpoint name;
* bf16 tensors: copied unchanged (the engine serves them as they are);
* integer and bool tensors: copied unchanged (no engine casts them);
* fp16, fp64 and fp8 tensors: refused (this is not an fp32-master checkpoint);
* ``lm_head.weight`` of a model whose config ties word embeddings: the bits of the embedding it is tied to
  (the canonical name of tied parameters is the first name under which they appear, ROUNDING.md section 1);
* config, tokenizer and other small top-level files: copied, with ``dtype`` set to ``bfloat16`` in
  ``config.json`` so ``from_pretrained(dtype="auto")`` and vLLM load bf16;
* ``faircast_manifest.json``: seed, version, mode, package version and per-tensor SHA-256 of input and output.

``error_feedback`` and EMA casts depend on the run's history: they need the Fair Cast state saved with the
checkpoint (``FairCaster.state_dict()`` written by :func:`save_state`, or passed as ``state=``), holding
full (unsharded) residuals or EMA tensors at the exported version; without it the export is refused.
The output appears atomically (written to a hidden temporary sibling, then renamed), so a failure leaves
no partial directory behind.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch

from .cast import MODES
from .caster import FairCaster
from .config import FairCastConfig
from .hf_checkpoint import (
    INDEX,
    ExportError,
    SafetensorsCheckpoint,
    TensorInfo,
    as_bytes,
    atomic_directory,
    copy_side_files,
    read_json,
    safetensors_header,
    sha256,
    tensor_bytes,
)
from .key import STICKY_VERSION, canonical_name

MANIFEST = "faircast_manifest.json"
MANIFEST_FORMAT = "faircast-served/1"
STATE_FILE = "faircast_state.pt"
# Tensors written unchanged: already what an engine serves (bf16), or never cast (integers, bool).
_COPIED = {"BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"}
StateArg = Union[None, str, os.PathLike, Mapping[str, Any], FairCaster]
Progress = Callable[[int, int, str], None]


# -- Fair Cast state -----------------------------------------------------------------------------------------
def save_state(caster: FairCaster, directory: Union[str, os.PathLike], *, filename: str = STATE_FILE,
               extra: Optional[Dict[str, Any]] = None) -> Path:
    """Write ``caster.state_dict()`` (on CPU) as ``filename`` (default ``faircast_state.pt``) in ``directory``:
    records seed, version and mode with a checkpoint, and the residuals / EMA that ``error_feedback`` / EMA exports
    need. ``extra``: entries stored beside it (a per-rank file's sharding, which resume checks)."""
    os.makedirs(directory, exist_ok=True)
    path = Path(directory) / filename
    torch.save({**_to_cpu(caster.state_dict()), **(extra or {})}, path)
    return path


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def load_state(state: StateArg) -> Optional[dict]:
    """A Fair Cast state dict from a path (``torch.save`` of ``FairCaster.state_dict()``), a dict or a caster.

    A path with ``*`` names per-rank state files of FSDP shards (``faircast_state_rank*.pt``, as the TRL adapter
    writes them under FSDP with error feedback or an EMA): they are merged into one full-tensor state
    (:func:`merge_rank_states`)."""
    if state is None:
        return None
    if isinstance(state, FairCaster):
        return _to_cpu(state.state_dict())
    if isinstance(state, Mapping):
        loaded, what = _to_cpu(dict(state)), "the state given"
    elif "*" in str(state):
        paths = sorted(Path(state).parent.glob(Path(state).name))
        if not paths:
            raise ExportError(f"no Fair Cast state files match {state}")
        loaded, what = merge_rank_states([_read_state(p) for p in paths]), str(state)
    else:
        loaded, what = _read_state(Path(state)), str(state)
    if not isinstance(loaded, dict) or not {"format", "config", "version", "ema", "error_feedback"} <= set(loaded):
        raise ExportError(f"{what} is not a Fair Cast state (FairCaster.state_dict(), saved with torch.save)")
    return loaded


def _read_state(path: Path) -> Any:
    if not path.is_file():
        raise ExportError(f"Fair Cast state file {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing to the user
        raise ExportError(f"cannot read Fair Cast state {path}: {e}") from None


def merge_rank_states(states: List[dict]) -> dict:
    """One full-tensor Fair Cast state from every rank's state of its FSDP shards.

    Each state carries ``"fsdp": {"rank", "world_size", "shards": {name: [global offset, numel, full shape]}}``
    next to ``FairCaster.state_dict()``; its error-feedback residuals, served copies and EMAs are the flat shards at
    those offsets. The merge puts every element back in place and checks that the ranks agree (world size, version,
    config) and that the shards cover each parameter exactly once."""
    infos = [s.get("fsdp") if isinstance(s, dict) else None for s in states]
    if any(not isinstance(i, dict) or "shards" not in i for i in infos):
        raise ExportError("these are not per-rank Fair Cast states of FSDP shards (no shard offsets); only the TRL "
                          "adapter's FSDP faircast_state_rank*.pt files can be merged")
    worlds = {i["world_size"] for i in infos}
    if worlds != {len(states)} or sorted(i["rank"] for i in infos) != list(range(len(states))):
        raise ExportError(f"{len(states)} per-rank Fair Cast state files, written at world size(s) {sorted(worlds)} by "
                          f"ranks {sorted(i['rank'] for i in infos)}: give exactly one file per rank of the run")
    first = states[0]
    for s in states[1:]:
        if s["version"] != first["version"] or s["config"] != first["config"] or s["format"] != first["format"]:
            raise ExportError("the per-rank Fair Cast states disagree on version or config: not from one checkpoint")

    full: Dict[Tuple[str, str], torch.Tensor] = {}  # (what, name) -> flat full tensor
    covered: Dict[Tuple[str, str], torch.Tensor] = {}
    shapes = {n: tuple(sh) for i in infos for n, (_, _, sh) in i["shards"].items()}

    def place(what: str, name: str, info: dict, shard: torch.Tensor, dtype: torch.dtype) -> None:
        offset, numel, shape = info["shards"][name]
        key = (what, name)
        if key not in full:
            full[key] = torch.zeros(math.prod(shape), dtype=dtype)
            covered[key] = torch.zeros(math.prod(shape), dtype=torch.bool)
        if shard.numel() != numel or bool(covered[key][offset: offset + numel].any()):
            raise ExportError(f"the FSDP shards of {name} overlap or do not match their recorded sizes")
        full[key][offset: offset + numel] = shard.reshape(-1).to(dtype)
        covered[key][offset: offset + numel] = True

    versions: Dict[str, set] = {}
    for state, info in zip(states, infos):
        for name, t in state["ema"].items():
            place("ema", name, info, t, torch.float32)
        for name, entry in state["error_feedback"].items():
            place("residual", name, info, entry["residual"], torch.float32)
            if entry["served"] is not None:
                place("served", name, info, entry["served"], torch.bfloat16)
            versions.setdefault(name, set()).add(int(entry["version"]))
    for (what, name), cov in covered.items():
        if not bool(cov.all()):
            raise ExportError(f"the per-rank Fair Cast states do not cover every element of {name} ({what})")
    if any(len(v) != 1 for v in versions.values()):
        raise ExportError("the ranks' error-feedback states are at different versions: not from one checkpoint")
    return {
        "format": first["format"], "version": first["version"], "config": first["config"],
        "ema": {n: t.view(shapes[n]) for (what, n), t in full.items() if what == "ema"},
        "error_feedback": {
            n: {"residual": t.view(shapes[n]), "version": next(iter(versions[n])), "offset": 0,
                "served": full[("served", n)].view(shapes[n]) if ("served", n) in full else None}
            for (what, n), t in full.items() if what == "residual"
        },
    }


def _state_digest(state: dict) -> str:
    """SHA-256 over the parts of a state that determine served bits (version, config, residuals, EMA)."""
    h = hashlib.sha256()
    cfg = dict(state["config"])
    h.update(json.dumps({"version": int(state["version"]), "mode": cfg.get("mode"), "seed": cfg.get("seed"),
                         "enabled": cfg.get("enabled"), "ema_decay": cfg.get("ema_decay")}, sort_keys=True).encode())
    for section in ("ema", "error_feedback"):
        for name in sorted(state.get(section) or {}):
            entry = state[section][name]
            h.update(f"{section}:{name}".encode())
            tensors = [entry] if isinstance(entry, torch.Tensor) else [entry.get("residual"), entry.get("served")]
            for t in tensors:
                if t is not None:
                    h.update(tensor_bytes(t))
            if not isinstance(entry, torch.Tensor):
                h.update(f"{entry.get('version')}:{entry.get('offset')}".encode())
    return h.hexdigest()


# -- planning ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Plan:
    caster: FairCaster
    seed: int
    version: int
    mode: str
    ema_decay: float
    state_digest: Optional[str]
    tied: Dict[str, str]  # tied name -> name of the tensor it is tied to (its canonical name)
    device: torch.device = torch.device("cpu")


def _make_caster(seed: Optional[int], version: Optional[int], mode: Optional[str], state: Optional[dict]) -> Tuple[FairCaster, Optional[str]]:
    if state is None:
        if seed is None or version is None:
            raise ExportError("give the run's Fair Cast seed and the weight version (or a Fair Cast state file)")
        mode = mode or "stochastic"
        if mode == "error_feedback":
            raise ExportError(
                "mode error_feedback depends on the run's residuals: pass the Fair Cast state saved with the "
                f"checkpoint ({STATE_FILE}, FairCaster.state_dict() saved with torch.save)"
            )
        try:
            config = FairCastConfig(enabled=True, mode=mode, seed=seed)
        except ValueError as e:
            raise ExportError(str(e)) from None
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < STICKY_VERSION:
            raise ExportError(f"version must be an int in [0, 2**64 - 1), got {version!r}")
        return FairCaster(config, version=version), None
    try:
        # every backend gives the same bits: the run's (a GPU's triton, say) need not exist where we export
        config = FairCastConfig(**{**state["config"], "audit": False, "backend": "auto"})
    except (TypeError, ValueError) as e:
        raise ExportError(f"Fair Cast state has an invalid config: {e}") from None
    for what, given, saved in (("seed", seed, config.seed), ("version", version, int(state["version"])),
                               ("mode", mode, config.effective_mode)):
        if given is not None and given != saved:
            raise ExportError(f"the Fair Cast state was saved with {what}={saved!r}, but {what}={given!r} was requested")
    caster = FairCaster(config)
    try:
        caster.load_state_dict(state)
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"cannot load Fair Cast state: {e}") from None
    return caster, _state_digest(state)


def _check_state_covers(ckpt: SafetensorsCheckpoint, plan: _Plan, cast_names: List[str]) -> None:
    """error_feedback / EMA exports need full residuals / EMA tensors for every cast tensor at this version."""
    state = plan.caster.state_dict()
    if plan.mode == "error_feedback":
        for name in cast_names:
            cname = plan.tied.get(name, canonical_name(name))
            shape = ckpt.tensors[name].shape
            ef = state["error_feedback"].get(cname)
            if ef is None:
                if plan.version:
                    raise ExportError(f"the Fair Cast state has no error-feedback residual for {cname}; it cannot be "
                                      f"served at version {plan.version} (was the state saved from every parameter?)")
                continue
            if ef["offset"] != 0 or tuple(ef["residual"].shape) != shape:
                raise ExportError(
                    f"the error-feedback residual for {cname} is a shard (offset {ef['offset']}, shape "
                    f"{tuple(ef['residual'].shape)}) of a {shape} parameter: export needs the full residuals "
                    f"(gather them on one rank before saving the state)"
                )
            if ef["version"] not in (plan.version, plan.version + 1):
                raise ExportError(f"the error-feedback residual for {cname} is at version {ef['version']}, the "
                                  f"state at {plan.version}: the state is inconsistent")
    if plan.ema_decay:
        for name in cast_names:
            cname = plan.tied.get(name, canonical_name(name))
            ema = state["ema"].get(cname)
            if ema is None and plan.version:
                raise ExportError(f"the Fair Cast state has no EMA for {cname}; it cannot be served at version {plan.version}")
            if ema is not None and tuple(ema.shape) != ckpt.tensors[name].shape:
                raise ExportError(f"the EMA for {cname} has shape {tuple(ema.shape)}, the checkpoint's {ckpt.tensors[name].shape}")


def _tie_word_embeddings(config: Mapping[str, Any]) -> bool:
    if not config:  # no config.json: nothing says the weights are tied
        return False
    tie = config.get("tie_word_embeddings")
    if tie is None and isinstance(config.get("text_config"), Mapping):
        tie = config["text_config"].get("tie_word_embeddings")
    return True if tie is None else bool(tie)  # transformers' default is True


def _find_ties(ckpt: SafetensorsCheckpoint) -> Dict[str, str]:
    """``lm_head.weight`` -> the embedding it is tied to, when the config ties them and both are stored.

    ``save_pretrained`` stores a tied parameter once, under its first name; a checkpoint that stores both must
    hold the same values in both, else the served copy is ambiguous and the export is refused.
    """
    ties: Dict[str, str] = {}
    for head in [n for n in ckpt.tensors if n == "lm_head.weight" or n.endswith(".lm_head.weight")]:
        if not _tie_word_embeddings(ckpt.config):
            continue
        info = ckpt.tensors[head]
        candidates = [t.name for t in ckpt.tensors.values()
                      if t.name != head and t.shape == info.shape and t.dtype == info.dtype and "embed" in t.name]
        values = ckpt.read(head)
        equal = [c for c in candidates if torch.equal(ckpt.read(c), values)]
        if len(equal) != 1:
            raise ExportError(
                f"config.json ties word embeddings, and the checkpoint stores {head}, which equals "
                f"{'none' if not equal else 'several'} of the embeddings {candidates}: the served copy would be "
                f"ambiguous (save the model with save_pretrained, which stores tied weights once)"
            )
        ties[head] = canonical_name(equal[0])
    return ties


def _device(device) -> torch.device:
    try:
        dev = torch.device(device or "cpu")
    except (RuntimeError, TypeError) as e:
        raise ExportError(f"bad device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ExportError(f"device {device!r} requested, but torch {torch.__version__} sees no CUDA device")
    return dev


def _plan(ckpt: SafetensorsCheckpoint, seed, version, mode, state: Optional[dict], device=None) -> _Plan:
    bad = sorted(f"{t.name} ({t.dtype})" for t in ckpt.tensors.values() if t.dtype != "F32" and t.dtype not in _COPIED)
    if bad:
        raise ExportError(
            f"{ckpt.path} holds tensors that are neither fp32 masters nor bf16/integer: {', '.join(bad[:5])}"
            f"{' ...' if len(bad) > 5 else ''}; faircast export casts fp32 checkpoints only"
        )
    if not any(t.dtype == "F32" for t in ckpt.tensors.values()):
        raise ExportError(f"{ckpt.path} holds no fp32 tensors, so there is nothing to cast: export reads the fp32 "
                          f"master checkpoint (is this already a bf16 or served copy?)")
    caster, digest = _make_caster(seed, version, mode, state)
    plan = _Plan(caster, caster.config.seed, caster.version, caster.mode, caster.config.ema_decay if caster.config.enabled else 0.0,
                 digest, _find_ties(ckpt), _device(device))
    if plan.mode == "error_feedback" or plan.ema_decay:
        _check_state_covers(ckpt, plan, [n for n in ckpt.names() if ckpt.tensors[n].dtype == "F32"])
    return plan


# -- the served tensors --------------------------------------------------------------------------------------
def _served(ckpt: SafetensorsCheckpoint, plan: _Plan, name: str) -> Tuple[torch.Tensor, str, torch.Tensor]:
    """(served tensor, action, source tensor) for one checkpoint tensor."""
    info = ckpt.tensors[name]
    src = ckpt.read(name)
    if info.dtype != "F32":
        return src, "copy", src
    tied = plan.tied.get(name)
    q = plan.caster.cast(tied or name, src.to(plan.device)).cpu()
    return q, (f"tie:{tied}" if tied else "cast"), src


def _out_info(info: TensorInfo) -> TensorInfo:
    """The served tensor's description: fp32 becomes bf16, everything else is copied."""
    return dataclasses.replace(info, dtype="BF16") if info.dtype == "F32" else info


def iter_served(
    checkpoint: Union[str, os.PathLike],
    *,
    seed: Optional[int] = None,
    version: Optional[int] = None,
    mode: Optional[str] = None,
    state: StateArg = None,
    device: Union[None, str, torch.device] = None,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(name, served tensor)`` for every tensor of an fp32 checkpoint, one at a time, without writing.

    The served copy at ``version`` is what a rollout engine synced with Fair Cast held after the trainer's
    ``version``-th optimizer step; compare it with the engine's weights to check an adapter end to end.
    """
    with SafetensorsCheckpoint(checkpoint) as ckpt:
        plan = _plan(ckpt, seed, version, mode, load_state(state), device)
        for name in ckpt.names():
            yield name, _served(ckpt, plan, name)[0]


def export_served(
    checkpoint: Union[str, os.PathLike],
    out: Union[str, os.PathLike],
    *,
    seed: Optional[int] = None,
    version: Optional[int] = None,
    mode: Optional[str] = None,
    state: StateArg = None,
    overwrite: bool = False,
    progress: Optional[Progress] = None,
    device: Union[None, str, torch.device] = None,
) -> dict:
    """Write the served bf16 copy of the fp32 HF checkpoint ``checkpoint`` at weight ``version`` to ``out``.

    ``seed``/``version``/``mode`` name the run's Fair Cast settings (``mode`` defaults to ``stochastic``;
    ``nearest`` gives the plain round-to-nearest copy). ``state`` (a ``faircast_state.pt`` path, a
    ``FairCaster.state_dict()`` or a caster) supplies them instead, and is required for ``error_feedback`` and
    EMA runs. Streams one tensor at a time; ``progress(done_bytes, total_bytes, name)`` is called after each.
    ``device`` (default CPU) is where each tensor is cast, e.g. ``"cuda"`` for the Triton kernel; the bits
    are the same on every device.
    Returns the manifest that was written.
    """
    from . import __version__

    out = Path(out)
    with SafetensorsCheckpoint(checkpoint) as ckpt:
        if out.resolve() == ckpt.path.resolve():
            raise ExportError("--out must differ from --checkpoint")
        if out.exists() and not overwrite:  # fail before any work
            raise ExportError(f"{out} already exists; choose another --out or pass --overwrite")
        plan = _plan(ckpt, seed, version, mode, load_state(state), device)
        by_file: Dict[str, List[str]] = {}
        for name in ckpt.names():
            by_file.setdefault(ckpt.tensors[name].file, []).append(name)
        counter = _ByteCounter(sum(t.nbytes for t in ckpt.tensors.values()), progress)
        file_meta = {"faircast_seed": str(plan.seed), "faircast_version": str(plan.version), "faircast_mode": plan.mode}
        tensors: Dict[str, dict] = {}
        with atomic_directory(out, overwrite) as tmp:
            for fname, names in by_file.items():
                tensors.update(_write_shard(ckpt, plan, fname, names, tmp / fname, file_meta, counter))
            if ckpt.index is not None:
                _write_index(ckpt, tmp / INDEX)
            manifest = {
                "format": MANIFEST_FORMAT,
                "faircast_plugins_version": __version__,
                "seed": plan.seed,
                "version": plan.version,
                "mode": plan.mode,
                "ema_decay": plan.ema_decay,
                "state_sha256": plan.state_digest,
                "source": str(ckpt.path.resolve()),
                "files": sorted(by_file),
                "copied_files": copy_side_files(ckpt.path, tmp, skip=(MANIFEST,)),
                "tensors": tensors,
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


class _ByteCounter:
    """Counts input bytes done and reports them to a ``progress`` callback."""

    def __init__(self, total: int, progress: Optional[Progress]):
        self.total, self.done, self.progress = total, 0, progress

    def __call__(self, info: TensorInfo) -> None:
        self.done += info.nbytes
        if self.progress is not None:
            self.progress(self.done, self.total, info.name)


def _write_shard(ckpt: SafetensorsCheckpoint, plan: _Plan, fname: str, names: List[str], path: Path,
                 file_meta: Mapping[str, str], counter: _ByteCounter) -> Dict[str, dict]:
    """Stream one output file: the header first (it needs only names, dtypes and shapes), then each served
    tensor in header order. Returns the manifest entries of its tensors."""
    entries = [(n, _out_info(ckpt.tensors[n]).dtype, ckpt.tensors[n].shape) for n in names]
    header, layout = safetensors_header(entries, {**ckpt.metadata[fname], "format": "pt", **file_meta})
    records = {}
    with open(path, "wb") as f:
        f.write(header)
        for name, begin, end in layout:
            info = ckpt.tensors[name]
            q, action, src = _served(ckpt, plan, name)
            data = tensor_bytes(q)
            if len(data) != end - begin:
                raise AssertionError(f"{name}: {len(data)} bytes, but the header reserved {end - begin}")
            f.write(data)
            records[name] = {"file": fname, "dtype": _out_info(info).dtype, "shape": list(info.shape), "action": action,
                             "sha256": hashlib.sha256(data).hexdigest(), "source_dtype": info.dtype,
                             "source_sha256": sha256(src)}
            counter(info)
        f.flush()
        os.fsync(f.fileno())
    return records


def _write_index(ckpt: SafetensorsCheckpoint, path: Path) -> None:
    """The output's ``model.safetensors.index.json``: the input's, with the bf16 total size."""
    metadata = {k: v for k, v in (ckpt.index.get("metadata") or {}).items() if k != "total_size"}
    metadata["total_size"] = sum(_out_info(t).nbytes for t in ckpt.tensors.values())
    weight_map = {n: ckpt.tensors[n].file for n in sorted(ckpt.tensors)}
    path.write_text(json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2) + "\n", encoding="utf-8")


# -- verifying -----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class VerifyReport:
    """Outcome of :func:`verify_served`: ``ok``, how many tensors matched, and the first mismatch if any."""

    ok: bool
    checked: int
    total: int
    mismatch: Optional[str] = None  # name of the first mismatching tensor
    detail: str = ""

    def __str__(self) -> str:
        if self.ok:
            return f"OK: all {self.total} tensors match the served copy re-derived from the checkpoint"
        return f"MISMATCH in tensor {self.mismatch} (after {self.checked} of {self.total} matched): {self.detail}"


def read_manifest(served: Union[str, os.PathLike]) -> dict:
    """The manifest of a served-copy export, validated; a clear :class:`ExportError` when missing or malformed."""
    path = Path(served) / MANIFEST
    if not Path(served).is_dir():
        raise ExportError(f"{served} is not a directory")
    if not path.is_file():
        raise ExportError(f"{served} has no {MANIFEST}: it is not a Fair Cast served-copy export (write one with faircast export)")
    manifest = read_json(path, "Fair Cast manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ExportError(f"{path}: unknown manifest format {found!r} (this version reads {MANIFEST_FORMAT!r})")
    problems = []
    for key, kind in (("seed", int), ("version", int), ("mode", str), ("tensors", dict)):
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            problems.append(f"'{key}' must be {kind.__name__}")
    for name, entry in (manifest.get("tensors") or {}).items():
        if not isinstance(entry, dict) or not all(k in entry for k in ("file", "dtype", "shape", "sha256", "source_sha256")):
            problems.append(f"tensor entry {name!r} is incomplete")
            break
    if problems:
        raise ExportError(f"{path} is malformed: {'; '.join(problems)}")
    return manifest


def _first_difference(expected: torch.Tensor, got: torch.Tensor) -> str:
    if expected.dtype != got.dtype or expected.shape != got.shape:
        return f"expected {expected.dtype} {tuple(expected.shape)}, found {got.dtype} {tuple(got.shape)}"
    int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[expected.element_size()]
    if expected.dtype == torch.bool:
        a, b = expected.reshape(-1), got.reshape(-1)
    else:
        a, b = expected.reshape(-1).view(int_type), got.reshape(-1).view(int_type)
    diff = (a != b).nonzero()
    if diff.numel() == 0:
        return "bit-identical values but different bytes"
    i = int(diff[0])
    width = 2 * expected.element_size()
    fmt = lambda v: format(int(v) & ((1 << (4 * width)) - 1), f"0{width}x")  # noqa: E731
    return (f"{diff.numel()} of {a.numel()} elements differ; first at flat index {i}: "
            f"expected bits {fmt(a[i])}, found {fmt(b[i])}")


def verify_served(
    checkpoint: Union[str, os.PathLike],
    served: Union[str, os.PathLike],
    *,
    state: StateArg = None,
    progress: Optional[Progress] = None,
    device: Union[None, str, torch.device] = None,
) -> VerifyReport:
    """Re-derive the served copy of ``checkpoint`` with the seed, version and mode in ``served``'s manifest and
    compare it bit for bit with ``served``. Stops at the first mismatching tensor and names it.

    ``state`` is needed when the export used one (``error_feedback``/EMA); it must be the same state.
    """
    manifest = read_manifest(served)
    if manifest.get("state_sha256"):
        if state is None and (Path(checkpoint) / STATE_FILE).is_file():
            state = Path(checkpoint) / STATE_FILE
        if state is None:
            raise ExportError(f"this export (mode {manifest['mode']}, ema_decay {manifest.get('ema_decay')}) was made "
                              f"from a Fair Cast state; pass the same state (--state {STATE_FILE})")
    state_dict = load_state(state)
    if state_dict is not None and manifest.get("state_sha256") and _state_digest(state_dict) != manifest["state_sha256"]:
        raise ExportError("the Fair Cast state given differs from the one the export was made with")
    with SafetensorsCheckpoint(checkpoint) as ckpt, SafetensorsCheckpoint(served) as out:
        plan = _plan(ckpt, manifest["seed"], manifest["version"], manifest["mode"],
                     state_dict if manifest.get("state_sha256") else None, device)
        names = ckpt.names()
        expected_names, manifest_names, served_names = set(names), set(manifest["tensors"]), set(out.tensors)
        if not expected_names == manifest_names == served_names:
            missing = sorted((expected_names | manifest_names) - served_names)
            extra = sorted(served_names - expected_names)
            return VerifyReport(False, 0, len(names), (missing or extra or sorted(manifest_names ^ expected_names))[0],
                                f"tensor sets differ: missing from served {missing[:5]}, unexpected {extra[:5]}, "
                                f"manifest vs checkpoint {sorted(manifest_names ^ expected_names)[:5]}")
        counter = _ByteCounter(sum(ckpt.tensors[n].nbytes for n in names), progress)
        for checked, name in enumerate(names):
            entry = manifest["tensors"][name]
            q, _, src = _served(ckpt, plan, name)
            got = out.read(name)
            if got.dtype != q.dtype or got.shape != q.shape or not torch.equal(as_bytes(got), as_bytes(q)):
                detail = _first_difference(q, got)
                if sha256(src) != entry["source_sha256"]:
                    detail += "; the checkpoint's tensor is not the one that was exported (checkpoint changed)"
                elif sha256(got) != entry["sha256"]:
                    detail += "; the served file was modified after export"
                return VerifyReport(False, checked, len(names), name, detail)
            if sha256(got) != entry["sha256"]:
                return VerifyReport(False, checked, len(names), name, "matches the re-derived copy but not the manifest checksum")
            counter(ckpt.tensors[name])
        return VerifyReport(True, len(names), len(names))


# -- command line --------------------------------------------------------------------------------------------
class _ProgressLine:
    """Progress on stderr: one refreshed line on a terminal, a line per 10% otherwise."""

    def __init__(self, verb: str, quiet: bool = False):
        self.verb, self.quiet, self.tty, self.last = verb, quiet, sys.stderr.isatty(), -1

    def __call__(self, done: int, total: int, name: str) -> None:
        if self.quiet:
            return
        pct = 100 * done // max(total, 1)
        if self.tty:
            sys.stderr.write(f"\r{self.verb} {pct:3d}%  {done / 2**20:9.1f}/{total / 2**20:.1f} MiB  {name[:60]:<60}")
            if done >= total:
                sys.stderr.write("\n")
        elif pct // 10 != self.last // 10 or done >= total:
            sys.stderr.write(f"{self.verb} {pct:3d}%  {done / 2**20:.1f}/{total / 2**20:.1f} MiB  {name}\n")
        self.last = pct
        sys.stderr.flush()


def _u64(text: str, limit: int = 2**64) -> int:
    value = int(text, 0)
    if not 0 <= value < limit:
        raise ValueError(text)
    return value


def _version(text: str) -> int:
    return _u64(text, STICKY_VERSION)  # 2**64 - 1 is reserved for sticky keys


def add_export_arguments(parser) -> None:
    parser.add_argument("--checkpoint", required=True, help="Hugging Face fp32 checkpoint directory (safetensors)")
    parser.add_argument("--out", required=True, help="output directory for the bf16 served copy (must not exist)")
    parser.add_argument("--seed", type=_u64, help="the run's Fair Cast seed")
    parser.add_argument("--weight-version", "--version", dest="version", type=_version,
                        help="weight version: optimizer steps the master had taken (--version: the old spelling)")
    parser.add_argument("--mode", choices=MODES,
                        help="cast mode of the run (default: the state's, else stochastic)")
    parser.add_argument("--state", help=f"Fair Cast state file ({STATE_FILE}); required for error_feedback and EMA runs. "
                                        f"Used by default when --seed/--weight-version are omitted and the checkpoint has "
                                        f"one. A pattern with '*' (quoted) merges per-rank FSDP states "
                                        f"(faircast_state_rank*.pt, named in faircast.json)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--device", default="cpu", help="where to cast each tensor (cpu, cuda); same bits anywhere")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def _default_state(args) -> Optional[str]:
    if args.state is None and (args.seed is None or args.version is None):
        candidate = Path(args.checkpoint) / STATE_FILE
        info = Path(args.checkpoint) / "faircast.json"
        if not candidate.is_file() and info.is_file():  # per-rank FSDP states named by the adapter's record
            record = read_json(info, "Fair Cast record")
            if record.get("world_size") and record.get("state"):
                candidate = Path(args.checkpoint) / record["state"]
        if candidate.is_file() or "*" in candidate.name:
            print(f"faircast: using the Fair Cast state {candidate}", file=sys.stderr)
            return str(candidate)
    return args.state


def run_export(args) -> int:
    try:
        manifest = export_served(args.checkpoint, args.out, seed=args.seed, version=args.version, mode=args.mode,
                                 state=_default_state(args), overwrite=args.overwrite,
                                 progress=_ProgressLine("export", args.quiet), device=args.device)
    except ExportError as e:
        print(f"faircast export: error: {e}", file=sys.stderr)
        return 2
    cast = sum(1 for t in manifest["tensors"].values() if t["action"] != "copy")
    print(f"wrote the served copy (seed {manifest['seed']}, version {manifest['version']}, mode {manifest['mode']}) to "
          f"{args.out}: {cast} tensors cast, {len(manifest['tensors']) - cast} copied")
    return 0


def add_verify_arguments(parser) -> None:
    parser.add_argument("--checkpoint", required=True, help="the fp32 checkpoint the served copy was exported from")
    parser.add_argument("--served", required=True, help="the served-copy directory written by faircast export")
    parser.add_argument("--state", help="the Fair Cast state used for the export (error_feedback / EMA runs)")
    parser.add_argument("--device", default="cpu", help="where to re-derive each tensor (cpu, cuda)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def run_verify(args) -> int:
    try:
        report = verify_served(args.checkpoint, args.served, state=args.state, progress=_ProgressLine("verify", args.quiet),
                               device=args.device)
    except ExportError as e:
        print(f"faircast verify: error: {e}", file=sys.stderr)
        return 2
    print(report)
    return 0 if report.ok else 1


__all__ = [
    "ExportError",
    "SafetensorsCheckpoint",
    "VerifyReport",
    "export_served",
    "iter_served",
    "load_state",
    "read_manifest",
    "save_state",
    "verify_served",
]
