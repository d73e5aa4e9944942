"""OpenRLHF's own policy path on CPU: args from its CLI, its DeepspeedStrategy, Actor, PolicyLoss.

    python openrlhf_actor_worker.py OUT_FILE ZERO_STAGE FAIRCAST(on|off|ema) [policy]

``ema`` adds ``--faircast.ema_decay EMA_DECAY``. ``policy`` adds ``--faircast.policy_metrics_every 1
--faircast.policy_metrics_seqs 2 --rollout.temperature TEMPERATURE`` (also with ``off``: then only the probe is
attached) and trains through the probe's wrapper of ``ActorPPOTrainer.training_step`` (:mod:`faircast_plugins.openrlhf.
policy_probe`'s ``install``, as the Ray actor's init installs it), recording each measurement's tokens, rows and the
two weight views as the probe's forwards read them. The batch is in OpenRLHF 0.11.2's own layout, built by its own
functions (:mod:`experiences`): the first sample is multi-turn (prompt, action, observation, action), the second is
shorter (right-padded); ``action_mask`` is ``[B, T-1]``, 0 on the prompt and the observation.

Trains a tiny Qwen2 (bf16, built on the fly) for a few PPO steps the way ``ActorPPOTrainer.training_step``
does (old log-probs from the eval forward, new log-probs, ``PolicyLoss``, ``strategy.backward`` and
``strategy.optimizer_step``), with Fair Cast attached by the same function the Ray policy actor uses.
After each step it records what ``broadcast_to_vllm`` sends (``actor.model.module.named_parameters()``,
gathered under ZeRO-3), the full fp32 masters, and the logits of a separate HF model loaded with the sent
weights next to those of the trainer's own eval forward.

CPU substitutions (each one is a transport or build detail, not Fair Cast logic):
* ``DeepspeedStrategy.setup_distributed`` is CUDA-only (``torch.cuda.set_device``, a "cuda" device mesh):
  the process group is initialized with gloo here and ``world_size``/``accumulated_gradient`` set as it would.
* DeepSpeed's AdamW defaults to FusedAdam (a multi-minute C++ JIT build): ``"torch_adam": true`` is added
  to the optimizer config OpenRLHF generates.
* vLLM's weight receiver is CUDA-only: the sent tensors are loaded into a plain HF model instead.
* ``save_ckpt`` ends with ``torch.cuda.synchronize()``: only its barrier is kept.
"""
from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))  # tests/, last (its folders are named like the frameworks): deepspeed_probe_counts
import shims  # noqa: E402

shims.install()
from experiences import experience_batch  # noqa: E402

SEED = 1234
STEPS = 3
EMA_DECAY = 0.5
TEMPERATURE = 0.8


def tiny_qwen2(path: str) -> None:
    """A 2-layer Qwen2 (hidden 64, vocab 320) in bf16, and a word-level tokenizer for it, saved to ``path``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=320, max_position_embeddings=64, tie_word_embeddings=False)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 320)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(path)


def openrlhf_args(model_path: str, stage: int, faircast: bool, keep_patches: bool = False, ema: bool = False,
                  policy_metrics: bool = False):
    """OpenRLHF's hierarchized args exactly as its CLI builds them, through the Fair Cast wrapper.

    With ``keep_patches`` the policy-actor patch the CLI installed stays (a Ray test then creates actors).
    """
    import openrlhf.utils
    import ray

    from faircast_plugins.openrlhf import policy
    from faircast_plugins.openrlhf.train_ppo_ray import main

    captured = {}

    class Launched(Exception):
        pass

    def stop(args):
        captured["args"] = args
        raise Launched

    real_get_strategy, real_is_init = openrlhf.utils.get_strategy, ray.is_initialized
    openrlhf.utils.get_strategy, ray.is_initialized = stop, (lambda: True)
    argv = [
        "--actor.model_name_or_path", model_path, "--reward.remote_url", "http://127.0.0.1:1/r",
        "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2",
        "--ds.zero_stage", str(stage), "--ds.attn_implementation", "eager",
        "--train.micro_batch_size", "2", "--train.batch_size", "2", "--rollout.batch_size", "2",
        "--actor.num_gpus_per_node", "1",
        "--actor.adam.lr", "1e-5", "--actor.lr_warmup_ratio", "0", "--actor.lr_scheduler", "constant",
    ] + (["--faircast", "--faircast.seed", str(SEED), "--faircast.audit"] if faircast else []) + (
        ["--faircast.ema_decay", str(EMA_DECAY)] if ema else []) + (
        ["--faircast.policy_metrics_every", "1", "--faircast.policy_metrics_seqs", "2",
         "--rollout.temperature", str(TEMPERATURE)] if policy_metrics else [])
    try:
        main(argv)
    except Launched:
        pass
    finally:
        openrlhf.utils.get_strategy, ray.is_initialized = real_get_strategy, real_is_init
        if not keep_patches:
            policy.POLICY_PATCHES.remove()
    return captured["args"], real_get_strategy


def record_probe(actor, holder, names):
    """Wrap the probe's measuring so each measurement's tokens, rows and weight views are recorded."""
    from faircast_plugins.deepspeed import policy_views
    from faircast_plugins.openrlhf import policy_probe

    from deepspeed_probe_counts import count_probe_calls

    probes, seen = [], {}
    counts = count_probe_calls()

    def record(kind, view):
        def wrapped(p):
            out = view(p)
            if id(p) in names and names[id(p)] not in seen[kind]:
                seen[kind][names[id(p)]] = (out if out is not None else p.data).detach().float().clone()
            return out
        return wrapped

    class RecordedViews(policy_views.DeepSpeedPolicyViews):
        def __init__(self, engine):
            super().__init__(engine)
            self.served, self.master = record("served", self.served), record("master", self.master)

    policy_views.DeepSpeedPolicyViews = RecordedViews
    original = policy_probe.measure

    def measure(engine, experience, temperature):
        probe = engine.__dict__[policy_probe.PROBE_ATTR]
        before = probe.pending.shape[0] if probe.pending is not None else 0
        seen["served"], seen["master"] = {}, {}
        counts.update(dict.fromkeys(counts, 0))
        original(engine, experience, temperature)
        rows = probe.pending[before:] if probe.pending is not None else None
        if rows is not None and rows.shape[0]:
            stale = [names[id(p)] for p in engine.module.parameters() if getattr(getattr(p, "ds_status", None),
                     "name", None) == "NOT_AVAILABLE" and p.data.numel() != 0]
            probes.append({"step": int(engine.global_steps), "temperature": temperature, "rows": rows.clone(),
                           "served_view": dict(seen["served"]), "master_view": dict(seen["master"]), "stale": stale, **counts,
                           "sequences": experience.sequences.clone(), "action_mask": experience.action_mask.clone(),
                           "attention_mask": experience.attention_mask.clone()})

    policy_probe.measure = measure
    return probes


def main(out_file: str, stage: int, flag: str, policy: bool = False) -> None:
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    from deepspeed.utils import safe_get_full_fp32_param
    from openrlhf.models import Actor, PolicyLoss
    from openrlhf.utils.deepspeed import DeepspeedStrategy
    from transformers import AutoModelForCausalLM

    from faircast_plugins.openrlhf import attach_to_policy, policy_metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # a 2-minute JIT build gloo does not need
    deepspeed.init_distributed(dist_backend="gloo")

    model_path = tempfile.mkdtemp(prefix="tiny-qwen2-")
    tiny_qwen2(model_path)
    faircast = flag != "off"
    args, get_strategy = openrlhf_args(model_path, stage, faircast, ema=flag == "ema", policy_metrics=policy)
    strategy = get_strategy(args)
    strategy.world_size, strategy.accumulated_gradient = 1, 1  # what setup_distributed computes at world size 1

    real_train_config = DeepspeedStrategy.get_ds_train_config

    def torch_adam_config(self, optim_dict=None, **kw):
        cfg = real_train_config(self, optim_dict, **kw)
        if "optimizer" in cfg:
            cfg["optimizer"]["params"]["torch_adam"] = True
        return cfg

    DeepspeedStrategy.get_ds_train_config = torch_adam_config
    # save_ckpt ends with a barrier plus torch.cuda.synchronize(); keep the barrier.
    sys.modules["openrlhf.utils.deepspeed.deepspeed"].torch_dist_barrier_and_cuda_sync = torch.distributed.barrier

    actor_cfg = dict(optim=args.actor.optim, muon=vars(args.actor.muon), adam=vars(args.actor.adam),
                     lr_scheduler=args.actor.lr_scheduler, lr_warmup_ratio=args.actor.lr_warmup_ratio,
                     min_lr_ratio=args.actor.min_lr_ratio, max_norm=args.actor.max_norm, scheduler_steps=100)

    class PolicyActorState:  # what attach_to_policy reads from PolicyModelActor: its prepared ``actor``
        pass

    def build_policy(ckpt_path=None):
        """As PolicyModelActor.init_model_from_pretrained: build, prepare, load the checkpoint, then Fair Cast."""
        actor = Actor(model_path, attn_implementation="eager", param_dtype="bf16", ds_config=strategy.get_ds_train_config())
        actor, optim, sched = strategy.prepare((actor, actor_cfg))
        if ckpt_path:
            strategy.load_ckpt(actor.model, ckpt_path)
        holder = PolicyActorState()
        holder.actor = actor
        attach_to_policy(holder, args)
        return actor, optim, sched

    actor, optim, sched = build_policy()
    engine = actor.model
    assert (engine.__dict__.get("_faircast") is not None) == (faircast or policy)

    loss_fn = PolicyLoss(clip_eps_low=args.actor.eps_clip_low_high[0], clip_eps_high=args.actor.eps_clip_low_high[1],
                         token_level_loss=args.actor.loss_agg_mode == "token-mean")
    g = torch.Generator().manual_seed(3)
    words = torch.randint(2, 320, (21,), generator=g).tolist()
    experience = experience_batch([
        [(words[:3], False), (words[3:5], True), (words[5:7], False), (words[7:10], True)],  # 5 action tokens
        [(words[10:14], False), (words[14:16], True)],  # 2 action tokens, right-padded to 10
    ])
    sequences, attention_mask = experience.sequences, experience.attention_mask
    advantages = torch.randn(*experience.action_mask.shape, generator=g)

    record = {"served": [], "masters": [], "trainer_logits": [], "served_logits": [], "versions": [], "metrics": [],
              "zero_stage": engine.zero_optimization_stage(), "ema_decay": args.faircast.ema_decay}
    record["initial"] = {}
    for name, param in actor.model.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=stage == 3):
            record["initial"][name] = param.data.detach().clone()
    def training_step(experience, kl_ctl=0.0, step=0):  # the parts of ActorPPOTrainer.training_step that train
        actor.eval()
        with torch.no_grad():
            old_log_probs = actor(experience.sequences, experience.action_mask, experience.attention_mask)
        actor.train()
        log_probs = actor(experience.sequences, experience.action_mask, attention_mask=experience.attention_mask)
        loss = loss_fn(log_probs, old_log_probs, advantages, action_mask=experience.action_mask)[0]
        strategy.backward(loss, actor, optim)
        strategy.optimizer_step(optim, actor, sched)

    record["probes"] = []
    if policy:  # as PolicyModelActor.init_model_from_pretrained installs it on its ActorPPOTrainer
        from types import SimpleNamespace

        from faircast_plugins.openrlhf import policy_probe

        names = {id(p): n for n, p in actor.model.module.named_parameters()}
        record["probes"] = record_probe(actor, None, names)
        holder = SimpleNamespace(actor=actor, trainer=SimpleNamespace(training_step=training_step, args=args))
        policy_probe.install(holder)
        training_step = holder.trainer.training_step
    for step in range(STEPS):
        training_step(experience, 0.0, step)

        # What broadcast_to_vllm sends (ppo_actor.py: model = self.actor.model.module; named_parameters()).
        model = actor.model.module
        served, masters = {}, {}
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], enabled=stage == 3):
                served[name] = param.data.detach().clone()
            masters[name] = safe_get_full_fp32_param(param).detach().clone()
        record["served"].append(served)
        record["masters"].append(masters)
        record["versions"].append(engine.__dict__["_faircast"].caster.version if faircast else None)
        record.setdefault("global_steps", []).append(int(engine.global_steps))
        record["metrics"].append(policy_metrics(engine))

        # The old log-probs of the next rollout come from the trainer's eval forward through the DeepSpeed
        # engine; a rollout engine that loaded the sent weights computes its logits from the same bf16 tensors.
        actor.eval()
        with torch.no_grad():
            record["trainer_logits"].append(engine(sequences, attention_mask=attention_mask).logits.clone())
        actor.train()
        served_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, attn_implementation="eager")
        served_model.load_state_dict(served)
        served_model.eval()
        with torch.no_grad():
            record["served_logits"].append(served_model(sequences, attention_mask=attention_mask).logits.clone())

    # OpenRLHF's own checkpoint round trip (PolicyModelActor.save_checkpoint / --ckpt.load_enable).
    ckpt = tempfile.mkdtemp(prefix="ckpt-")
    strategy.save_ckpt(engine, ckpt, tag=f"global_step{STEPS}", max_num=2, max_mem=1000)
    resumed, _, _ = build_policy(ckpt)
    fc = resumed.model.__dict__.get("_faircast")
    record["resumed_version"] = fc.caster.version if fc else None
    record["resumed_served"] = {}
    for name, param in resumed.model.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=stage == 3):
            record["resumed_served"][name] = param.data.detach().clone()
    torch.save(record, out_file)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], policy=sys.argv[4:] == ["policy"])
