"""The patch reaches OpenRLHF's policy actor inside a Ray worker (real ray, a local loopback cluster).

Ray ships ``PolicyModelActor`` to its workers by value, so a patch of the importable class on the driver
would not reach them. The CLI wrapper patches the shipped class instead; this test runs the real
``PolicyModelActor.init_model_from_pretrained`` in a Ray worker process (CPU plumbing from
``ray_cpu_hook.py``) and checks from inside that worker that the policy engine has Fair Cast and that
its training steps serve ``fair_cast(master)``.
"""
from __future__ import annotations

import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    # Ray gives its raylet a fixed 30 s to register; on a loaded shared machine a start can miss that, so
    # a failed start is retried (the error of the last attempt is raised). Workers import DeepSpeed and
    # OpenRLHF in the setup hook before they register, which can take longer than Ray's default 60 s here.
    for attempt in range(3):
        try:
            ray.init(
                address="local", num_cpus=2, num_gpus=0, include_dashboard=False, _node_ip_address="127.0.0.1",
                log_to_driver=False, _system_config={"worker_register_timeout_seconds": 600},
                runtime_env={
                    "env_vars": {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
                                 "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"},
                    "worker_process_setup_hook": "ray_cpu_hook.install",
                },
            )
            break
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception on a start timeout
            ray.shutdown()
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
    yield ray
    ray.shutdown()


def test_policy_actor_in_a_ray_worker_gets_fair_cast(ray_cluster, tmp_path):
    ray = ray_cluster
    import openrlhf_actor_worker as setup
    import ray_cpu_hook
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    from faircast_plugins.openrlhf import policy

    model_path = str(tmp_path / "tiny")
    setup.tiny_qwen2(model_path)
    # Parsed by OpenRLHF's CLI through the wrapper, which patches the class Ray will ship.
    args, get_strategy = setup.openrlhf_args(model_path, 2, True, keep_patches=True)
    strategy = get_strategy(args)
    shipped = PolicyModelActor.__ray_metadata__.modified_class
    assert shipped.init_model_from_pretrained is policy.init_model_from_pretrained
    assert PolicyModelActor.__ray_actor_class__.init_model_from_pretrained is not policy.init_model_from_pretrained
    shipped.faircast_probe = ray_cpu_hook.probe  # a window into the worker, shipped with the class
    try:
        actor = PolicyModelActor.options(num_cpus=1, num_gpus=0).remote(1, 0, "127.0.0.1", None)
        ray.get(actor.init_model_from_pretrained.remote(strategy, model_path, 10, None), timeout=600)
        # Ray handles only know the methods declared at decoration time; OpenRLHF's own execute_batch
        # calls any attribute of the worker's actor object by name.
        out = ray.get(actor.execute_batch.remote("faircast_probe", {"steps": [2]}, 0, 1), timeout=600)[0]
        ray.kill(actor)
    finally:
        del shipped.faircast_probe
        policy.POLICY_PATCHES.remove()
    assert out["pid"] != os.getpid()  # it ran in a Ray worker process
    assert out["init_function"] == "faircast_plugins.openrlhf.policy.init_model_from_pretrained", out
    assert out["attached"], out
    assert not out["ema_attached"]
    assert (out["seed"], out["mode"], out["version_before"]) == (setup.SEED, "stochastic", 0)
    assert out["version"] == 2
    assert out["mismatched"] == 0, f"{out['mismatched']} bf16 weights differ from fair_cast(master) in the worker"
    assert out["metrics"]["faircast/version"] == 2.0
