"""Key derivation and canonical parameter names (ROUNDING.md sections 1-2)."""
from __future__ import annotations

import hashlib

U64 = 2**64
# The weight version reserved for ``mode="sticky"`` (ROUNDING.md section 4): its key ignores the version, so real
# versions stay below this value.
STICKY_VERSION = U64 - 1

# Wrapper prefixes that frameworks put in front of the Hugging Face name. Order matters only for readability:
# canonical_name strips every occurrence, wherever it sits in the dotted path.
WRAPPER_PREFIXES = (
    "_fsdp_wrapped_module.",
    "_checkpoint_wrapped_module.",
    "_orig_mod.",
    "module.",
    "base_model.model.",
)


def _check_u64(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Fair Cast {what} must be an int in [0, 2**64), got {type(value).__name__}")
    if not 0 <= value < U64:
        raise ValueError(f"Fair Cast {what} must be in [0, 2**64), got {value}")
    return value


def _key(seed: int, version: int, name: str) -> int:
    _check_u64(seed, "seed")
    if not isinstance(name, str) or not name:
        raise ValueError(f"Fair Cast parameter name must be a non-empty str, got {name!r}")
    digest = hashlib.blake2b(
        seed.to_bytes(8, "little") + version.to_bytes(8, "little") + name.encode("utf-8"), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def derive_key(seed: int, version: int, name: str) -> int:
    """The 63-bit Philox key for (seed, weight version, canonical parameter name); ``version < 2**64 - 1``."""
    _check_u64(version, "version")
    if version == STICKY_VERSION:
        raise ValueError("Fair Cast weight version 2**64-1 is reserved for mode='sticky'; use sticky_key(seed, name)")
    return _key(seed, version, name)


def sticky_key(seed: int, name: str) -> int:
    """The key of ``mode="sticky"``: the same at every version, so each element keeps its rounding threshold."""
    return _key(seed, STICKY_VERSION, name)


def mode_key(seed: int, version: int, name: str, mode: str) -> int:
    """The key a cast in ``mode`` uses at ``version``: :func:`sticky_key` for sticky, else :func:`derive_key`."""
    return sticky_key(seed, name) if mode == "sticky" else derive_key(seed, version, name)


def canonical_name(name: str) -> str:
    """Hugging Face ``state_dict()`` name of a parameter, with framework wrapper prefixes removed.

    ``_fsdp_wrapped_module.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight`` and
    ``module._orig_mod.model.layers.0.mlp.up_proj.weight`` both become ``model.layers.0.mlp.up_proj.weight``.
    PEFT's ``base_model.model.`` prefix and its ``.base_layer`` infix are removed too.
    """
    out = name
    for prefix in WRAPPER_PREFIXES:
        while True:
            if out.startswith(prefix):
                out = out[len(prefix):]
            elif "." + prefix in out:
                out = out.replace("." + prefix, ".")
            else:
                break
    return out.replace(".base_layer.", ".")
