"""``faircast-trl``: the ``trl`` command with Fair Cast loaded in the launcher *and* in every training process.

``faircast-trl hook install`` instead adds an opt-in start-up hook (see :mod:`faircast_trl_hook`) so that plain
``trl`` gains the fields too.

``faircast-trl grpo --config cfg.yaml`` takes exactly the arguments of ``trl grpo`` (YAML keys ``faircast``,
``faircast_mode``, ... or ``--faircast true`` on the command line). ``trl`` parses the config in this process,
then starts ``accelerate launch trl/scripts/<cmd>.py ...``; here that launch runs the same script through
:mod:`faircast_plugins.trl.launch`, which patches TRL in each child before the script parses its arguments.
"""
from __future__ import annotations

import functools
import importlib.resources
import sys

from ..patching import PatchSet
from .patches import SUPPORTED

LAUNCHER = "trl.cli.accelerate_launcher:launch_training_script"


def _launch_through_faircast(original):
    @functools.wraps(original)
    def launch_training_script(script_name, launch_args, training_script_args, **kwargs):
        from accelerate.commands.launch import launch_command, launch_command_parser

        launch_command_fn = kwargs.get("launch_command_fn", launch_command)
        launch_parser_fn = kwargs.get("launch_parser_fn", launch_command_parser)
        script = str(importlib.resources.files("trl.scripts").joinpath(script_name))
        wrapper = str(importlib.resources.files("faircast_plugins.trl").joinpath("launch.py"))
        parsed = launch_parser_fn().parse_args([*launch_args, wrapper, script, *training_script_args])
        launch_command_fn(parsed)

    return launch_training_script


PTH_NAME = "faircast_trl_hook.pth"
PTH_LINE = "import faircast_trl_hook\n"


def hook(argv: list[str]) -> int:
    """``faircast-trl hook install|remove|status [--site DIR]``: the opt-in start-up hook for plain ``trl``."""
    import argparse
    import os
    import sysconfig

    parser = argparse.ArgumentParser(prog="faircast-trl hook", description=hook.__doc__)
    parser.add_argument("action", choices=["install", "remove", "status"])
    parser.add_argument("--site", default=sysconfig.get_paths()["purelib"], help="site-packages folder (default: this env)")
    args = parser.parse_args(argv)
    path = os.path.join(args.site, PTH_NAME)
    if args.action == "install":
        import faircast_trl_hook  # noqa: F401  (fail now if the module is not importable from this env)

        with open(path, "w") as f:
            f.write(PTH_LINE)
        print(f"installed {path}: plain `trl` now accepts faircast (Fair Cast loads when trl is imported)")
    elif args.action == "remove":
        if os.path.exists(path):
            os.remove(path)
        print(f"removed {path}")
    else:
        print(f"{path}: {'installed' if os.path.exists(path) else 'not installed'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["hook"]:
        return hook(argv[1:])
    if any(a in ("-h", "--help") for a in argv[:1]):
        print("faircast-trl: TRL's `trl` command with Fair Cast loaded (the faircast fields: docs/trl.md); "
              "`faircast-trl hook install|remove|status` makes plain `trl` accept them. TRL's own help follows.\n")
    import faircast_plugins.trl  # noqa: F401  (config fields for the parent's parse, trainer patches)

    PatchSet("TRL CLI", "trl", SUPPORTED).wrap(LAUNCHER, _launch_through_faircast).apply(
        details="training processes start through faircast_plugins.trl.launch"
    )
    from trl.cli.main import main as trl_main

    return int(trl_main(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())
