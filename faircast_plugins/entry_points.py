"""What a stack's entry point says when its framework is not installed.

``faircast-trl --help`` (or verl's / OpenRLHF's wrapper) on a machine without that framework prints what the command
is and what to install, and exits 0; any other invocation prints that as one line on stderr and exits 1, instead of
a traceback.
"""
from __future__ import annotations

import importlib.util
import sys
from typing import Sequence

# faircast_plugins.trl patches TRL when imported, so what its entry point needs is stated here (a test keeps
# TRL_SPECIFIER equal to faircast_plugins.trl.patches.SUPPORTED).
TRL_SPECIFIER = ">=1.16.0,<1.17"
TRL_ABOUT = ("TRL's `trl` command with Fair Cast loaded in the launcher and in every training process: the same\n"
             "arguments as `trl` (e.g. faircast-trl grpo --config cfg.yaml with `faircast: true` in the YAML).\n"
             "faircast-trl hook install|remove|status: let plain `trl` accept the faircast fields instead.")


def installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, or a broken package
        return False


def explain_if_missing(prog: str, package: str, specifier: str, about: str, argv: Sequence[str],
                       extra: str = "") -> None:
    """Return if ``package`` imports; otherwise print help (``-h``/``--help``/no arguments: exit 0) or a one-line
    error (exit 1) that names the package, the versions Fair Cast supports and the install command."""
    if installed(package):
        return
    need = (f"needs {package} {specifier}, which is not installed here: pip install '{package}{specifier}' "
             f"(or, in a checkout of faircast-plugins, pip install '.[{extra or package}]')")
    if not argv or any(a in ("-h", "--help") for a in argv):
        print(f"usage: {prog} ...\n\n{about}\n\nIt {need}")
        sys.exit(0)
    print(f"{prog}: error: it {need}", file=sys.stderr)
    sys.exit(1)
