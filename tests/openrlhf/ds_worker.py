"""Runs tiny bf16 DeepSpeed trainings on CPU (gloo) and records masters and served weights for the tests.

    python ds_worker.py OUT_DIR WORLD_SIZE SCENARIO [SCENARIO ...]

A scenario is ``<config>:<faircast>``, e.g. ``z2_offload:stochastic``, ``z3:off`` or ``z2:ema`` (stochastic
with ``ema_decay=EMA_DECAY``); ``<config>:partial`` and ``<config>:nothing`` are the failure drills of
:func:`run_failure` (one step, whose copy-back the last rank writes partly or wholly outside Fair Cast). Every rank writes
``OUT_DIR/<scenario>.rank<r>.pt`` with, per canonical parameter name, the initial bf16 weights, the fp32
masters after every step and the bf16 weights (what a rollout engine would be sent) after every step.
Every rank sees the same batch, so the fp32 masters are the same whatever the stage or the world size.
All scenarios of one world size share one process group (importing DeepSpeed is the slow part).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))

SEED = 1234
STEPS = 6
LR = 2e-5  # half a bf16 step at |w| in [0.5, 1) is ~1e-3: round-to-nearest freezes the copy for ~50 steps
EMA_DECAY = 0.75

# name -> (zero stage, extra DeepSpeed config)
CONFIGS = {
    "z0": (0, {}),                       # FP16_UnfusedOptimizer (torch optimizer)
    "z0_fused": (0, {}),                 # FP16_Optimizer (FusedAdam-typed torch optimizer, see make_optimizer)
    "bf16opt": (1, {"data_types": {"grad_accum_dtype": "fp32"}}),  # BF16_Optimizer
    "z1": (1, {}),
    "z2": (2, {}),
    "z2_offload": (2, {"offload_optimizer": {"device": "cpu"}}),
    "z3": (3, {}),
    "z3_offload": (3, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
}


class TinyLM(torch.nn.Module):
    """A few parameters of awkward sizes, so ZeRO partitions cut through them; HF-style names."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(37, 24)
        self.model.proj = torch.nn.Linear(24, 29)
        self.model.norm = torch.nn.LayerNorm(29)
        self.lm_head = torch.nn.Linear(29, 37, bias=False)

    def forward(self, ids):
        h = self.model.norm(torch.tanh(self.model.proj(self.model.embed_tokens(ids))))
        return self.lm_head(h)


def make_model() -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM()
    with torch.no_grad():
        for p in model.parameters():  # |w| in [0.5, 1): a bf16 step is 2**-8..2**-7
            p.copy_(torch.empty_like(p).uniform_(0.5, 1.0) * torch.sign(torch.randn_like(p)))
    return model.to(torch.bfloat16)


def make_optimizer(name, params):
    if name != "z0_fused":
        return None  # DeepSpeed builds torch.optim.AdamW from the config ("torch_adam": true)
    from deepspeed.ops.adam import FusedAdam

    # DeepSpeed picks FP16_Optimizer for ZeRO-0 only when the optimizer is a FusedAdam. FusedAdam's C++ op
    # would cost minutes of JIT build; this FusedAdam-typed object delegates to a torch AdamW that shares
    # its param_groups and state, so DeepSpeed's FP16_Optimizer (and its copy-back) runs unchanged.
    class TorchAdamTypedFused(FusedAdam):
        def __init__(self, params):
            inner = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
            self.__dict__.update(inner.__dict__)
            self._inner = inner

        def step(self, closure=None):
            return self._inner.step(closure)

    return TorchAdamTypedFused(params)


def ds_config(name: str, world: int) -> dict:
    stage, extra = CONFIGS[name]
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2 * world,
        "gradient_clipping": 0.0,
        "bf16": {"enabled": True},
        # ZeRO-3 keeps parameters below 64 elements gathered (the biases and the norm): both kinds are covered.
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 64, **{k: v for k, v in extra.items() if k.startswith("offload")}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    cfg.update({k: v for k, v in extra.items() if not k.startswith("offload")})
    if name != "z0_fused":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}}
    if stage == 3:
        cfg["zero_optimization"]["reduce_bucket_size"] = 64
    return cfg


def full_masters(engine) -> dict:
    """Full fp32 master of every parameter (a collective under ZeRO-1/2/3: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param

    opt = engine.optimizer
    out = {}
    if engine.zero_optimization_stage() == 0:
        kind = type(opt).__name__
        for gi, group in enumerate(opt.fp16_groups):
            if kind == "FP16_Optimizer":
                from torch._utils import _unflatten_dense_tensors

                masters = _unflatten_dense_tensors(opt.fp32_groups_flat[gi], group)
            else:
                masters = opt.fp32_groups[gi]
            for p, m in zip(group, masters):
                out[id(p)] = m.detach().clone().float()
    else:
        for p in engine.module.parameters():
            out[id(p)] = safe_get_full_fp32_param(p).detach().clone().cpu()
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return {names[k]: v for k, v in out.items()}


def full_weights(engine) -> dict:
    """The full bf16 weights, as OpenRLHF's broadcast_to_vllm reads them (gathered under ZeRO-3)."""
    import deepspeed

    out = {}
    for n, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], enabled=engine.zero_optimization_stage() == 3):
            out[n] = p.data.detach().clone().cpu()
    return out


def persistent_mismatches(engine) -> list:
    """ZeRO-3 persistent parameters whose full bf16 data (what is read and served) is not the all-gather of their
    partitions (what the copy-back wrote). A collective: every rank calls it."""
    if engine.zero_optimization_stage() != 3:
        return []
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    names = {id(p): n for n, p in engine.module.named_parameters()}
    params = [p for p in engine.optimizer.persistent_parameters if p.ds_status == ZeroParamStatus.AVAILABLE]
    seen = [p.data.detach().clone() for p in params]  # first, as a reader would see them right after step()
    bad = []
    for p, got in zip(params, seen):
        parts = [torch.empty_like(p.ds_tensor) for _ in range(dist.get_world_size(group=p.ds_process_group))]
        dist.all_gather(parts, p.ds_tensor.data, group=p.ds_process_group)
        want = torch.cat([t.to(got.device) for t in parts])[: p.ds_numel].view(got.shape)
        if got.shape != p.ds_shape or not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            bad.append(names[id(p)])
    return bad


def persistent_check_control(engine) -> dict:
    """Negative control of persistent_mismatches: it must flag a persistent parameter whose data is corrupted."""
    p = engine.optimizer.persistent_parameters[0]
    name = next(n for n, q in engine.module.named_parameters() if q is p)
    kept = p.data.clone()
    p.data.copy_(-kept - 1)
    try:
        return {"corrupted": name, "flagged": persistent_mismatches(engine)}
    finally:
        p.data.copy_(kept)


def batch():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 37, (2, 9), generator=g)


def train_step(engine, ids):
    logits = engine(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    if engine.zero_optimization_stage() == 3 and engine.world_size > 1:
        # Harness fix for a DeepSpeed-on-gloo race (not Fair Cast's: it shows with Fair Cast off too). At the end
        # of step() ZeRO-3 re-gathers its persistent (small) parameters with one async all-gather each and waits
        # on the last handle only (partition_parameters.py, _allgather_params_coalesced: "Wait ensures the
        # operation is enqueued, but not necessarily complete"), then synchronizes the device, which is a no-op
        # on CPU. NCCL runs those gathers in order on one stream and CUDA's synchronize completes them; gloo runs
        # them on a pool of worker threads, so an earlier one can still be in flight when step() returns and the
        # parameter's data is then a still-unwritten torch.empty buffer (seen as garbage in the recorded weights,
        # ~1 full test run in 6-10). gloo's barrier completes all prior work of this process first.
        import deepspeed

        deepspeed.comm.barrier()


def make_engine(name: str, world: int, mode: str, ckpt_load: str | None = None):
    import deepspeed

    from faircast_plugins import FairCaster
    from faircast_plugins.deepspeed import apply_deepspeed_patch

    model = make_model()
    opt = make_optimizer(name, model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, model_parameters=model.parameters(),
                                      config=ds_config(name, world))
    if ckpt_load:
        engine.load_checkpoint(ckpt_load)
    fc = None
    if mode != "off":
        fc = apply_deepspeed_patch(engine, FairCaster(faircast_config(mode)))
    return engine, fc


def faircast_config(mode: str):
    from faircast_plugins import FairCastConfig

    if mode == "ema":
        return FairCastConfig(enabled=True, mode="stochastic", seed=SEED, ema_decay=EMA_DECAY, audit=True)
    return FairCastConfig(enabled=True, mode=mode, seed=SEED, audit=True)


def run_scenario(name: str, world: int, mode: str, out_dir: str, rank: int) -> dict:
    import deepspeed

    engine, fc = make_engine(name, world, mode)
    ids = batch()
    record = {"initial": full_weights(engine), "masters": [], "served": [], "versions": [], "metrics": [],
              "threads": [], "persistent_mismatches": [], "resumed_persistent_mismatches": []}
    if engine.zero_optimization_stage() == 3:
        record["persistent_names"] = [n for n, p in engine.module.named_parameters()
                                      if any(p is q for q in engine.optimizer.persistent_parameters)]
    for step in range(STEPS):
        train_step(engine, ids)
        record["threads"].append(torch.get_num_threads())  # worker() set 1; the first Fair Cast cast must keep it
        record["persistent_mismatches"].append(persistent_mismatches(engine))
        if step == 0 and engine.zero_optimization_stage() == 3 and world > 1:
            # After a step (gathered; reading them in full_weights releases them) and with a gather (at world 1
            # the full data is the partition itself).
            record["persistent_check_control"] = persistent_check_control(engine)
        record["masters"].append(full_masters(engine))
        record["served"].append(full_weights(engine))
        record["versions"].append(fc.caster.version if fc else None)
        record["metrics"].append(fc.caster.metrics() if fc else {})
        if step == 2 and mode != "off" and name in ("z2", "z3"):
            engine.save_checkpoint(os.path.join(out_dir, f"ckpt-{name}-{mode}"), tag="mid")
    if mode != "off" and name in ("z2", "z3"):
        # Resume from the step-3 checkpoint in a fresh engine and replay steps 4..6.
        resumed, rfc = make_engine(name, world, mode, ckpt_load=os.path.join(out_dir, f"ckpt-{name}-{mode}"))
        record["resumed_version"] = rfc.caster.version
        record["resumed_initial"] = full_weights(resumed)  # what a resume broadcast would send
        record["resumed"] = []
        for _ in range(STEPS - 3):
            train_step(resumed, ids)
            record["resumed_persistent_mismatches"].append(persistent_mismatches(resumed))
            record["resumed"].append(full_weights(resumed))
        del resumed
    engine.destroy() if hasattr(engine, "destroy") else None
    deepspeed.comm.barrier()
    return record


FAILURES = ("partial", "nothing")


def run_failure(name: str, world: int, mode: str, rank: int) -> dict:
    """One Fair Cast step in which, on the last rank only, DeepSpeed writes half (``partial``) or all (``nothing``)
    of each copy-back of the weights outside Fair Cast, round-to-nearest, as a swap path it does not see would.
    Records the error each rank raised (every rank must raise, none may wait forever) and the weight version."""
    import deepspeed

    from faircast_plugins.deepspeed import patch
    from faircast_plugins.patching import FairCastPatchError

    engine, fc = make_engine(name, world, "stochastic")
    intercept = patch._CopyBackInterceptor.copy_

    def copy_missing_some(self, dst, src, non_blocking=False):
        if self._busy or dst.dtype != torch.bfloat16 or not self.layout.segments(dst):
            return intercept(self, dst, src, non_blocking)
        flat_dst, flat_src = dst.view(-1), src.reshape(-1)
        seen = dst.numel() // 2 if mode == "partial" else 0
        patch._ORIGINAL_COPY(flat_dst[seen:], flat_src[seen:])
        if seen:
            intercept(self, flat_dst[:seen], flat_src[:seen], non_blocking)
        return dst

    if rank == world - 1:
        patch._CopyBackInterceptor.copy_ = copy_missing_some
    try:
        train_step(engine, batch())
        error = None
    except FairCastPatchError as e:
        error = str(e)
    finally:
        patch._CopyBackInterceptor.copy_ = intercept
    deepspeed.comm.barrier()
    return {"error": error, "version": fc.caster.version}


def worker(rank: int, world: int, out_dir: str, scenarios: list, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (``import ... as`` would bind deepspeed.comm's ``torch`` attribute)

    # The shared-memory all-reduce op is a 2-minute JIT build that gloo does not need.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    import time

    # A ZeRO-3 engine replaces torch.nn.functional.linear with DeepSpeed's LinearFunctionForZeroStage3 for the
    # whole process ("This will persist unless manually reset"): every later scenario would run its forward and
    # backward on it, and its masters would depend on the scenario order. Each scenario starts from torch's own.
    linear = torch.nn.functional.linear
    for scenario in scenarios:
        name, mode = scenario.split(":")
        t0 = time.perf_counter()
        torch.nn.functional.linear = linear
        record = run_failure(name, world, mode, rank) if mode in FAILURES else run_scenario(name, world, mode, out_dir, rank)
        print(f"[ds_worker] rank {rank} {scenario}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        torch.save(record, os.path.join(out_dir, f"{name}-{mode}.rank{rank}.pt"))


def main(argv):
    out_dir, world, scenarios = argv[0], int(argv[1]), argv[2:]
    os.makedirs(out_dir, exist_ok=True)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if world == 1:
        worker(0, 1, out_dir, scenarios, port)
    else:
        mp.start_processes(worker, args=(world, out_dir, scenarios, port), nprocs=world, start_method="spawn")


if __name__ == "__main__":
    main(sys.argv[1:])
