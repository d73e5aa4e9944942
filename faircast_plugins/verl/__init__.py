"""Fair Cast for verl (FSDP engines): ``actor_rollout_ref.faircast: true``.

* :mod:`.plugin` -- the ``verl.plugins`` entry point (loaded by ``import verl`` in every process);
* :mod:`.patches` -- the verl patch set (activation in ``init_model``, export, version, checkpoint, metrics);
* :mod:`.engine` -- the per-engine Fair Cast state those patches share;
* :mod:`.config` -- reading and validating ``actor_rollout_ref.faircast``;
* :mod:`.main_ppo` -- ``python -m faircast_plugins.verl.main_ppo faircast=true ...``.

The FSDP1/FSDP2 cast patches themselves are torch-level: :mod:`faircast_plugins.fsdp`.
"""
