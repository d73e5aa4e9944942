"""The patch reaches OpenRLHF's policy actor inside a Ray worker (real ray, a local loopback cluster).

Ray ships ``PolicyModelActor`` to its workers by value, so a patch of the importable class on the driver
would not reach them. The CLI wrapper patches the shipped class instead; this test runs the real
``PolicyModelActor.init_model_from_pretrained`` in a Ray worker process (CPU plumbing from
``ray_cpu_hook.py``) and checks from inside that worker that the policy engine has Fair Cast, and that
OpenRLHF's own PPO training phase (``forward`` for the old log-probs, ``append``, ``fit``) serves
``fair_cast(master)`` and reports the ``faircast/*`` metrics, ``faircast/policy_*`` included (measured inside the
worker's own ``ActorPPOTrainer.training_step``).

Not run here: ``PPOTrainer.fit``'s rollouts and ``broadcast_to_vllm``, which need vLLM engines and a CUDA
weight transport (see docs/openrlhf.md).
"""
from __future__ import annotations

import os

import pytest

import openrlhf_actor_worker  # noqa: E402  (tests/openrlhf is on sys.path via conftest)

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


N_SAMPLES, N_ACTIONS = 6, 4  # micro-batches of 2 (train.micro_batch_size) -> 3 optimizer steps in one fit


@pytest.fixture(scope="module")
def policy_worker(ray_cluster, tmp_path_factory):
    """OpenRLHF's PolicyModelActor in a Ray worker: its real init, one PPO training phase through its own
    ``forward`` (the old log-probs the experience maker asks for), ``append`` and ``fit``, then a probe."""
    ray = ray_cluster
    import openrlhf_actor_worker as setup
    import ray_cpu_hook
    import torch
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    from faircast_plugins.openrlhf import policy

    model_path = str(tmp_path_factory.mktemp("ray") / "tiny")
    setup.tiny_qwen2(model_path)
    # Parsed by OpenRLHF's CLI through the wrapper, which patches the class Ray will ship.
    args, get_strategy = setup.openrlhf_args(model_path, 2, True, keep_patches=True, policy_metrics=True)
    strategy = get_strategy(args)
    shipped = PolicyModelActor.__ray_metadata__.modified_class
    out = {"shipped_init": shipped.init_model_from_pretrained, "shipped_fit": shipped.fit,
           "local_init": PolicyModelActor.__ray_actor_class__.init_model_from_pretrained}
    shipped.faircast_probe = ray_cpu_hook.probe  # a window into the worker, shipped with the class
    try:
        actor = PolicyModelActor.options(num_cpus=1, num_gpus=0).remote(1, 0, "127.0.0.1", None)
        ray.get(actor.init_model_from_pretrained.remote(strategy, model_path, 10, None), timeout=600)
        # Ray handles only know the methods declared at decoration time; OpenRLHF's own execute_batch
        # calls any attribute of the worker's actor object by name.
        out["after_init"] = ray.get(actor.execute_batch.remote("faircast_probe", {"steps": [0]}, 0, 1), timeout=600)[0]

        g = torch.Generator().manual_seed(11)
        sequences = torch.randint(2, 320, (N_SAMPLES, 12), generator=g)
        attention_mask = torch.ones_like(sequences)
        action_mask = torch.ones(N_SAMPLES, N_ACTIONS, dtype=torch.bool)
        old_log_probs = ray.get(actor.forward.remote(sequences, action_mask, attention_mask), timeout=600)
        experience = Experience(
            sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
            action_log_probs=old_log_probs, advantages=torch.randn(N_SAMPLES, N_ACTIONS, generator=g),
            response_length=torch.full((N_SAMPLES,), float(N_ACTIONS)), total_length=torch.full((N_SAMPLES,), 12.0),
        )
        ray.get(actor.append.remote(experience), timeout=600)
        out["fit_status"] = ray.get(actor.fit.remote(0.0), timeout=600)
        out["after_fit"] = ray.get(actor.execute_batch.remote("faircast_probe", {"steps": [0]}, 0, 1), timeout=600)[0]
        out["old_log_probs"] = old_log_probs
        ray.kill(actor)
    finally:
        del shipped.faircast_probe
        policy.POLICY_PATCHES.remove()
    return out


def test_policy_actor_in_a_ray_worker_gets_fair_cast(policy_worker):
    from faircast_plugins.openrlhf import policy

    assert policy_worker["shipped_init"] is policy.init_model_from_pretrained
    assert policy_worker["shipped_fit"] is policy.fit
    assert policy_worker["local_init"] is not policy.init_model_from_pretrained  # only the shipped class
    out = policy_worker["after_init"]
    assert out["pid"] != os.getpid()  # it ran in a Ray worker process
    assert out["init_function"] == "faircast_plugins.openrlhf.policy.init_model_from_pretrained", out
    assert out["attached"], out
    assert not out["ema_attached"]
    assert (out["seed"], out["mode"], out["version_before"]) == (openrlhf_actor_worker.SEED, "stochastic", 0)


def test_openrlhf_fit_in_the_ray_worker_serves_fair_cast(policy_worker):
    """OpenRLHF's own PPO training phase (PolicyModelActor.fit -> ActorPPOTrainer.ppo_train -> training_step,
    PolicyLoss, DeepSpeed steps) with Fair Cast: 3 optimizer steps, after which the policy's bf16 weights (what
    broadcast_to_vllm sends) are fair_cast(master) at version 3; fit's status carries the faircast/* metrics."""
    status = policy_worker["fit_status"]
    assert policy_worker["old_log_probs"].shape == (N_SAMPLES, N_ACTIONS)
    assert "policy_loss" in status and "actor_grad_norm" in status  # OpenRLHF's own status
    assert status["faircast/version"] == 3.0
    for key in ("faircast/lag_steps", "faircast/served_changed_frac", "faircast/master_moved_frac"):
        assert key in status, status
    out = policy_worker["after_fit"]
    assert out["version"] == 3
    assert out["mismatched"] == 0, f"{out['mismatched']} bf16 weights differ from fair_cast(master) in the worker"


def test_openrlhf_fit_in_the_ray_worker_reports_the_policy_metrics(policy_worker):
    """--faircast.policy_metrics_every 1 --faircast.policy_metrics_seqs 2: the shipped init wrapped the worker's own
    ActorPPOTrainer.training_step, which measured before each of the 3 updates (2 sequences of 4 response tokens
    each), and fit's status carries faircast/policy_* of those 6 sequences (the masters moved after the first step:
    Fair Cast's rounding noise shows)."""
    status = policy_worker["fit_status"]
    assert (status["faircast/policy_seqs"], status["faircast/policy_tokens"]) == (6.0, 24.0), status
    assert status["faircast/policy_kl"] > 0 and 0 < status["faircast/policy_ess_frac"] <= 1
    assert "faircast/policy_nonfinite_seqs" not in status
