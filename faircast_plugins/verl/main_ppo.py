"""``python -m faircast_plugins.verl.main_ppo faircast=true ...``: verl's ``main_ppo`` with a top-level flag.

Same arguments as ``python -m verl.trainer.main_ppo``. The config is verl's ``ppo_trainer`` plus ``faircast``
(default false), forwarded to ``actor_rollout_ref.faircast``, where every worker reads it. The flag is validated
here, in the driver, before Ray starts.
"""
from __future__ import annotations

import hydra

from .config import read_faircast


def run(config) -> None:
    """Validate the flag, then hand the composed config to verl's own entry point."""
    read_faircast(config.actor_rollout_ref)  # raises a clear ValueError on a bad value, before any worker starts
    from verl.trainer.main_ppo import main as verl_main

    verl_main.__wrapped__(config)


@hydra.main(config_path="hydra_config", config_name="faircast_ppo_trainer", version_base=None)
def main(config) -> None:
    run(config)


if __name__ == "__main__":
    main()
