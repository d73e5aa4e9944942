"""Hugging Face safetensors checkpoint directories, read and written one tensor at a time.

Reading: :class:`SafetensorsCheckpoint` opens ``model.safetensors`` or the shards named by
``model.safetensors.index.json`` and checks that every file is complete and consistent before anything
is read. Writing: :func:`safetensors_header` lays out a file's header from names, dtypes and shapes alone,
so tensors can be streamed after it; :func:`atomic_directory` makes an output directory appear whole or
not at all.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import struct
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# safetensors dtype string -> (torch dtype, itemsize)
DTYPES = {
    "F32": (torch.float32, 4),
    "BF16": (torch.bfloat16, 2),
    "F16": (torch.float16, 2),
    "F64": (torch.float64, 8),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
}
# Weight, optimizer and trainer-state files that are not copied next to the served weights.
SKIPPED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".pkl", ".npz")
SKIPPED_FILES = {INDEX, "pytorch_model.bin.index.json"}


class ExportError(RuntimeError):
    """A checkpoint read, served-copy export or verification that cannot proceed; the message says why."""


# -- reading a safetensors checkpoint ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str
    dtype: str  # safetensors dtype string
    shape: Tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype][1]


class SafetensorsCheckpoint:
    """A Hugging Face safetensors checkpoint directory (one file, or shards with an index), read lazily."""

    def __init__(self, path: Union[str, os.PathLike]):
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        if not self.path.is_dir():
            raise ExportError(f"checkpoint {self.path} is not a directory")
        self.index: Optional[dict] = None
        if (self.path / INDEX).is_file():
            self.index = read_json(self.path / INDEX, "safetensors index")
            weight_map = self.index.get("weight_map") if isinstance(self.index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise ExportError(f"{self.path / INDEX} has no 'weight_map': not a safetensors index")
            files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE).is_file():
            weight_map, files = None, [SINGLE]
        else:
            found = sorted(p.name for p in self.path.iterdir() if p.suffix in (".safetensors", ".bin"))
            raise ExportError(
                f"no {SINGLE} or {INDEX} in {self.path} (found: {', '.join(found) or 'no weight files'}); "
                f"save the fp32 model with save_pretrained (safetensors is the default)"
            )
        self._stack = ExitStack()
        self._handles = {}
        self.tensors: Dict[str, TensorInfo] = {}
        self.metadata: Dict[str, Dict[str, str]] = {}
        try:
            for fname in files:
                fpath = self.path / fname
                if not fpath.is_file():
                    raise ExportError(f"{fpath} is named in {INDEX} but does not exist")
                try:
                    handle = self._stack.enter_context(safe_open(str(fpath), framework="pt"))
                except SafetensorError as e:
                    raise ExportError(f"{fpath} is not a readable safetensors file ({e}); is it truncated or corrupt?") from None
                self._handles[fname] = handle
                self.metadata[fname] = dict(handle.metadata() or {})
                for name in handle.keys():
                    if name in self.tensors:
                        raise ExportError(f"tensor {name} is stored twice: in {self.tensors[name].file} and {fname}")
                    sl = handle.get_slice(name)
                    dtype = sl.get_dtype()
                    self.tensors[name] = TensorInfo(name, fname, dtype, tuple(int(d) for d in sl.get_shape()))
            if weight_map is not None:
                for name, fname in weight_map.items():
                    info = self.tensors.get(name)
                    if info is None or info.file != fname:
                        raise ExportError(f"{INDEX} maps {name} to {fname}, but that file does not hold it")
                extra = sorted(set(self.tensors) - set(weight_map))
                if extra:
                    raise ExportError(f"shard files hold tensors that {INDEX} does not list: {extra[:5]}")
        except BaseException:
            self.close()
            raise
        self.config = read_json(self.path / "config.json", "config") if (self.path / "config.json").is_file() else {}

    @property
    def files(self) -> List[str]:
        return list(self._handles)

    def names(self) -> List[str]:
        """Tensor names in a stable order: by file, then by name."""
        return [t.name for t in sorted(self.tensors.values(), key=lambda t: (t.file, t.name))]

    def read(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        try:
            return self._handles[info.file].get_tensor(name)
        except Exception as e:  # noqa: BLE001 - surface which file and tensor could not be read
            raise ExportError(f"cannot read tensor {name} from {self.path / info.file}: {e}") from None

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_json(path: Path, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot read {what} {path}: {e}") from None


# -- bytes and hashes --------------------------------------------------------------------------------------
def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw little-endian bytes as a flat uint8 tensor (no copy when contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(as_bytes(t).numpy())


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


# -- writing -------------------------------------------------------------------------------------------------
def safetensors_header(entries: List[Tuple[str, str, Tuple[int, ...]]], metadata: Mapping[str, str]) -> Tuple[bytes, List[Tuple[str, int, int]]]:
    """The safetensors header for ``entries`` (name, dtype, shape), laid out largest itemsize first (aligned)."""
    layout, header, pos = [], {"__metadata__": dict(metadata)}, 0
    for name, dtype, shape in sorted(entries, key=lambda e: (-DTYPES[e[1]][1], e[0])):
        n = DTYPES[dtype][1]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        layout.append((name, pos, pos + n))
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(len(raw) + 8) % 8)
    return struct.pack("<Q", len(raw)) + raw, layout


@contextmanager
def atomic_directory(out: Path, overwrite: bool) -> Iterator[Path]:
    """A temporary sibling of ``out`` that becomes ``out`` on success and vanishes on any failure."""
    if out.exists() and not overwrite:
        raise ExportError(f"{out} already exists; choose another --out or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would make the served copy private
        yield tmp
        if out.exists():  # --overwrite: move the old one aside, put the new one in place, then delete the old
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / out.name)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old / out.name, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_side_files(src: Path, dst: Path, skip: Tuple[str, ...] = ()) -> List[str]:
    """Copy config, tokenizer and other small top-level files (not weights, optimizer or trainer state);
    ``config.json`` is rewritten with its dtype set to bfloat16. Returns the names copied."""
    copied = []
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.name in SKIPPED_FILES or p.name in skip or p.name.endswith(SKIPPED_SUFFIXES) or p.name.startswith("."):
            continue
        if p.name == "config.json":
            config = read_json(p, "config")
            set_bf16_dtype(config)
            (dst / p.name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        else:
            shutil.copy2(p, dst / p.name)
        copied.append(p.name)
    return copied


def set_bf16_dtype(config: dict) -> None:
    """Mark a (possibly nested) HF config as bf16, so dtype="auto" loads the served copy as it is."""
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    for k in keys:
        config[k] = "bfloat16"
    for value in config.values():
        if isinstance(value, dict) and ("dtype" in value or "torch_dtype" in value):
            set_bf16_dtype(value)


