"""``faircast-trl``: the ``trl`` command with Fair Cast loaded in the launcher *and* in every training process.

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


def main(argv: list[str] | None = None) -> int:
    import faircast_plugins.trl  # noqa: F401  (config fields for the parent's parse, trainer patches)

    PatchSet("TRL CLI", "trl", SUPPORTED).wrap(LAUNCHER, _launch_through_faircast).apply(
        details="training processes start through faircast_plugins.trl.launch"
    )
    from trl.cli.main import main as trl_main

    return int(trl_main(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())
