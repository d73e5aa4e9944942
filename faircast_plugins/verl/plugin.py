"""The ``verl.plugins`` entry point: imported by ``import verl`` in every process (driver, Ray workers, rollout).

Importing verl's worker module at ``import verl`` time would slow every process and can recurse into a
half-initialised ``verl`` package, so this module only arranges for :func:`faircast_plugins.verl.patches.patch`
to run right after ``verl.workers.engine_workers`` is imported (or at once if it already is). Fair Cast then
stays inert until a worker's config sets ``actor_rollout_ref.faircast``.

verl swallows plugin import errors at DEBUG level, so nothing that can fail runs here: failures surface when
the worker module is imported, loudly, naming the installed verl version.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys

logger = logging.getLogger("faircast_plugins")

TRIGGER = "verl.workers.engine_workers"


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs a callback right after one module finishes executing (a one-shot post-import hook)."""

    def __init__(self, module_name: str, callback):
        self.module_name, self.callback = module_name, callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module_name:
            return None
        sys.meta_path.remove(self)  # find the real spec with the remaining finders, and fire once
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, callback = spec.loader, self.callback
        exec_module = loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            callback()

        loader.exec_module = exec_then_patch
        return spec


def _patch_or_guard() -> None:
    """Apply the verl patches; if they cannot apply, keep verl usable but make ``faircast`` configs fail loudly."""
    from ..patching import FairCastPatchError
    from .patches import guard_unsupported, patch

    try:
        patch()
    except FairCastPatchError as exc:
        logger.error("Fair Cast is UNAVAILABLE in this process: %s", exc)
        guard_unsupported(str(exc))


def install() -> None:
    """Arrange for the verl patches to be applied when verl's worker module is imported."""
    if TRIGGER in sys.modules:
        _patch_or_guard()
    elif not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport(TRIGGER, _patch_or_guard))
    logger.info("faircast_plugins: verl plugin loaded; Fair Cast patches verl when %s is imported", TRIGGER)


install()
