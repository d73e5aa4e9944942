"""Opt-in start-up hook that gives plain ``trl`` (and every process it launches) the ``faircast`` fields.

``faircast-trl hook install`` writes ``faircast_trl_hook.pth`` into site-packages; Python then runs
``import faircast_trl_hook`` at start-up. This module is deliberately standalone (it imports neither torch nor
``faircast_plugins``): all it does at start-up is put a one-shot finder on ``sys.meta_path``. Only when some code
imports ``trl`` does it load ``faircast_plugins.trl``, right after ``trl`` itself, which patches TRL's configs and
trainers. Cost without ``trl``: one small import per interpreter start. ``faircast-trl hook remove`` undoes it.

If the patch fails (for instance an unsupported TRL version) the hook warns instead of breaking ``import trl``;
a config that sets ``faircast`` then fails loudly in TRL's own parser.
"""
from __future__ import annotations

import importlib.util
import sys
import warnings

TRIGGER = "trl"


class _PatchAfterTrl:
    """Meta-path finder that wraps ``trl``'s loader so Fair Cast is patched in right after ``trl`` loads."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TRIGGER:
            return None
        sys.meta_path.remove(self)  # one shot; find the real spec with the remaining finders
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            try:
                import faircast_plugins.trl  # noqa: F401
            except Exception as exc:  # never break `import trl` for runs that do not ask for Fair Cast
                warnings.warn(f"faircast_trl_hook: Fair Cast could not patch TRL: {exc}", RuntimeWarning)

        spec.loader.exec_module = exec_module
        return spec


def arm() -> None:
    """Install the finder (idempotent; a no-op when ``trl`` is already imported)."""
    if TRIGGER in sys.modules:
        if "faircast_plugins.trl" not in sys.modules:
            import faircast_plugins.trl  # noqa: F401
        return
    if not any(isinstance(f, _PatchAfterTrl) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterTrl())


arm()
