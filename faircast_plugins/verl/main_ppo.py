"""``python -m faircast_plugins.verl.main_ppo faircast=true ...``: verl's ``main_ppo`` with a top-level flag.

Same arguments as ``python -m verl.trainer.main_ppo``. The config is verl's ``ppo_trainer`` plus ``faircast``
(default false), forwarded to ``actor_rollout_ref.faircast``, where every worker reads it. The flag is validated
here, in the driver, before Ray starts.
"""
from __future__ import annotations

import sys

from .config import read_faircast

ABOUT = ("verl's `python -m verl.trainer.main_ppo` with a top-level `faircast=true` flag (same arguments, Hydra\n"
         "overrides). Without this wrapper, `actor_rollout_ref.faircast: true` in your config does the same.")


def run(config) -> None:
    """Validate the flag, then hand the composed config to verl's own entry point."""
    read_faircast(config.actor_rollout_ref)  # raises a clear ValueError on a bad value, before any worker starts
    from verl.trainer.main_ppo import main as verl_main

    verl_main.__wrapped__(config)


def main() -> None:
    from ..entry_points import explain_if_missing

    explain_if_missing("python -m faircast_plugins.verl.main_ppo", "verl", ">=0.9.1,<0.10", ABOUT, sys.argv[1:])
    import hydra

    hydra.main(config_path="hydra_config", config_name="faircast_ppo_trainer", version_base=None)(run)()


if __name__ == "__main__":
    main()
