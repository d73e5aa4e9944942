"""Fair Cast for RL post-training stacks: an unbiased fp32 -> bf16 export, and the loss on the served copy.

Public API (bit-exact with ``ROUNDING.md``)::

    derive_key(seed, version, name) -> int
    sticky_key(seed, name) -> int      # the version-free key of mode="sticky"
    fair_cast(x, *, key, offset=0, mode="stochastic", residual=None, backend="auto") -> bf16 tensor
    fair_cast_many(xs, *, keys, offsets=None, mode=..., residuals=None, backend="auto") -> list of bf16 tensors
    FairCastConfig, FairCaster     # config and the stateful caster the adapters share
"""
from .cast import MODES, available_backends, block_indices, fair_cast, fair_cast_many
from .caster import FairCaster
from .config import FairCastConfig
from .key import canonical_name, derive_key, sticky_key

__version__ = "0.1.0"

__all__ = [
    "FairCastConfig",
    "FairCaster",
    "MODES",
    "available_backends",
    "block_indices",
    "canonical_name",
    "derive_key",
    "fair_cast",
    "fair_cast_many",
    "sticky_key",
    "__version__",
]
