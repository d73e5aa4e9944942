"""Optional fast backends for the ROUNDING.md cast (Triton for CUDA, numba for CPU).

Deliberately empty of imports: each backend is imported on demand by :mod:`faircast_plugins.cast`, so a missing
optional dependency never breaks ``import faircast_plugins``.
"""
