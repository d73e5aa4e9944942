"""Run a TRL script with Fair Cast patched in: ``python -m faircast_plugins.trl.launch SCRIPT [ARGS...]``.

``faircast-trl`` hands this file to ``accelerate launch`` in place of the TRL script, so every process it starts
patches TRL before the script builds its parser.
"""
from __future__ import annotations

import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m faircast_plugins.trl.launch SCRIPT [ARGS...]")
    script = sys.argv[1]
    sys.argv = [script, *sys.argv[2:]]
    import faircast_plugins.trl  # noqa: F401

    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
