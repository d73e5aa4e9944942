"""Fair Cast's adapters on one device, world size 1, each against its flag-off control.

The GPU run's parts fsdp2, deepspeed and trl (``python -m benchmarks.gpu``, one process per part); alone, from the
repository root:

    python3 -m benchmarks.gpu.adapters --json out/adapters.json [--only fsdp2,zero2,zero3,trl] [--cpu-smoke]

On CUDA with NCCL (one rank, launched as torchrun would: RANK=0, WORLD_SIZE=1, a free local port); under
``--cpu-smoke`` the same code on the CPU with gloo (``DS_ACCELERATOR=cpu``, TRL's ``use_cpu``). Sections:

  fsdp2  torch FSDP2's patched cast site (``fully_shard``, bf16 ``MixedPrecisionPolicy``): every weight the
         forward computes with, over two SGD steps.
  zero2  DeepSpeed ZeRO-2 bf16 copy-back (``apply_deepspeed_patch``, torch's AdamW: no C++ op is built): the bf16
         weights after each of two steps, what the forward uses and the engine is sent.
  zero3  the same on ZeRO-3 (gathered weights; the small bias stays persistent, the matrices are partitioned).
  trl    a TRL GRPO run on a tiny random Qwen3 without vLLM (two steps): every forward's weights, and what
         TRL's vLLM export iterator (``VLLMGeneration._iter_named_params``) yields after training.

Each runs twice. Fair Cast on: the weights are ``fair_cast(fp32 master)`` at the current weight version, bit for
bit, computed here by the torch reference on the CPU with the key derived independently (ROUNDING.md), and differ
from round-to-nearest somewhere (so the comparison can tell the two apart). Flag off (the control): the same
weights are round-to-nearest of the master (TRL: the forward runs on the fp32 master and the engine-bound copy is
its round-to-nearest cast), and the comparison that passed with Fair Cast on fails. What cannot run here (a
framework that does not import) is skipped with the reason; the record is benchmarks/gpu/record.py's.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile

SECTIONS = ("fsdp2", "zero2", "zero3", "trl")
_ARGS = argparse.ArgumentParser(description=__doc__.split("\n")[0])
_ARGS.add_argument("--cpu-smoke", action="store_true", help="on the CPU with gloo (how CI runs this script)")
_ARGS.add_argument("--json", default="adapters.json", help="results, rewritten after every section")
_ARGS.add_argument("--only", default="", help=f"comma-separated sections to run (default all): {','.join(SECTIONS)}")
_ARGS.add_argument("--verbose", action="store_true", help="print every passing check too")
ARGS = _ARGS.parse_args()
SMOKE = ARGS.cpu_smoke
if SMOKE:
    os.environ["DS_ACCELERATOR"] = "cpu"  # before DeepSpeed is imported
for var, value in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"), ("WANDB_DISABLED", "true")):
    os.environ.setdefault(var, value)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from benchmarks.gpu.record import Report, Skip, say  # noqa: E402

from faircast_plugins import FairCastConfig, FairCaster, derive_key, fair_cast  # noqa: E402
from faircast_plugins.doctor import SEED  # noqa: E402
from faircast_plugins.key import canonical_name  # noqa: E402

if not SMOKE and not torch.cuda.is_available():
    sys.exit("benchmarks.gpu.adapters: no CUDA device (use --cpu-smoke to exercise the script on CPU)")
DEV = torch.device("cpu" if SMOKE else "cuda", None if SMOKE else 0)
BACKEND = "gloo" if SMOKE else "nccl"
STEPS = 2
REPORT = Report(ARGS.json, only=ARGS.only.split(","), verbose=ARGS.verbose)
REPORT.results["adapters"] = {}
check = REPORT.check


def launch_as_one_rank() -> None:
    """The variables torchrun sets for a world of one (a free local port), so every framework inits its own way."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if DEV.type == "cuda":
        torch.cuda.set_device(DEV)


def importable(module: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - the reason is reported, whatever it is
        raise Skip(f"{what} does not import here ({type(exc).__name__}: {str(exc)[:200]}); what to install: "
                   f"benchmarks/gpu/README.md") from exc


def tally(what: str, records, *, faircast: bool) -> None:
    """``records``: (parameter name, bf16 weights seen, fp32 master, weight version).

    Fair Cast on: every weight is ``fair_cast(master)`` at its version (the CPU torch reference, key derived here)
    and the copy differs from round-to-nearest somewhere. Flag off: every weight is ``master.to(bf16)`` and differs
    from ``fair_cast(master)`` somewhere: the comparison that passes with Fair Cast on fails without it."""
    elements = vs_fair = vs_nearest = not_bf16 = 0
    for name, got, master, version in records:
        master, got = master.detach().float().cpu(), got.detach().cpu()
        if got.dtype != torch.bfloat16 or got.shape != master.shape:
            not_bf16 += 1
            continue
        want = fair_cast(master, key=derive_key(SEED, version, canonical_name(name)), mode="stochastic",
                         backend="torch")
        bits = got.view(torch.int16)
        vs_fair += int((bits != want.view(torch.int16)).sum())
        vs_nearest += int((bits != master.to(torch.bfloat16).view(torch.int16)).sum())
        elements += got.numel()
    label = f"{what}, {'Fair Cast on' if faircast else 'flag off'}"
    REPORT.results["adapters"][label] = {"tensors": len(records), "elements": elements, "not_bf16": not_bf16,
                                         "differ_from_fair_cast": vs_fair, "differ_from_nearest": vs_nearest}
    check(f"{label}: {len(records)} bf16 tensors seen, each shaped like its master", bool(records) and not not_bf16,
          f"{not_bf16} are not bf16 or not the master's shape" if not_bf16 else "")
    if faircast:
        check(f"{label}: == fair_cast(master) ({elements} elements)", vs_fair == 0,
              f"{vs_fair} elements differ" if vs_fair else "")
        check(f"{label}: differs from round-to-nearest somewhere (the check can tell them apart)", vs_nearest > 0)
    else:
        check(f"{label}: == round-to-nearest of the master ({elements} elements)", vs_nearest == 0,
              f"{vs_nearest} elements differ" if vs_nearest else "")
        check(f"{label}: differs from fair_cast(master) somewhere (the comparison can fail)", vs_fair > 0)


def host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


# ----------------------------------------------------------------------------------------------------------------
# fsdp2
# ----------------------------------------------------------------------------------------------------------------


def fsdp2_section() -> None:
    import torch.distributed as dist

    from faircast_plugins.doctor.fsdp import sharded_forwards
    from faircast_plugins.fsdp import apply_fsdp_cast_patches

    patches = apply_fsdp_cast_patches()
    REPORT.results["adapters"]["fsdp2 patches"] = {"torch": patches.version, "verified": patches.verified}
    dist.init_process_group(BACKEND)
    try:
        for faircast in (True, False):
            records = sharded_forwards(DEV.type, faircast=faircast)  # the doctor's FSDP2 run, on this device
            check(f"fsdp2, Fair Cast {'on' if faircast else 'off'}: 4 parameters read in each of {STEPS} forwards",
                  len(records) == 4 * STEPS, f"{len(records)} reads")
            tally(f"FSDP2 forward weights ({BACKEND}, {DEV.type})", records, faircast=faircast)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# zero2, zero3
# ----------------------------------------------------------------------------------------------------------------


def deepspeed_ready():
    """DeepSpeed, imported and initialised on this process's group once (its shared-memory op skipped: a JIT C++
    build that one rank never uses)."""
    deepspeed = importable("deepspeed", "DeepSpeed")
    import importlib

    comm_backend = importlib.import_module("deepspeed.comm.torch")  # the module (the package's .torch is torch)
    comm_backend.build_shm_op = lambda: None
    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=BACKEND)
    return deepspeed


def deepspeed_run(deepspeed, stage: int, faircast: bool):
    """Two AdamW steps of the doctor's tiny bf16 model on a ZeRO-``stage`` engine: (name, bf16 weights after the
    step, gathered; fp32 master; version) per parameter per step, and Fair Cast's attachment (None when off)."""
    from deepspeed.utils import safe_get_full_fp32_param

    from faircast_plugins.deepspeed import apply_deepspeed_patch
    from faircast_plugins.doctor.deepspeed import _config, _tiny_model

    config = _config()
    config["zero_optimization"] = {"stage": stage, "stage3_param_persistence_threshold": 64}
    model = _tiny_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    fc = apply_deepspeed_patch(engine, FairCaster(FairCastConfig(enabled=True, seed=SEED))) if faircast else None
    params = dict(engine.module.named_parameters())
    ids = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(7)).to(engine.device)
    records = []
    for step in range(1, STEPS + 1):
        logits = engine(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 37), ids[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        for name, p in params.items():
            master = host(safe_get_full_fp32_param(p))
            with deepspeed.zero.GatheredParameters([p], enabled=stage == 3):
                records.append((name, host(p.data), master, step))
    elements = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params.values())
    engine.destroy()
    return records, fc, elements


def zero_section(stage: int) -> None:
    deepspeed = deepspeed_ready()
    from faircast_plugins.deepspeed import install_deepspeed_patch

    patches = install_deepspeed_patch()
    REPORT.results["adapters"]["deepspeed patches"] = {"deepspeed": patches.version, "verified": patches.verified}
    linear = torch.nn.functional.linear  # a ZeRO-3 engine replaces it process-wide; each run starts from torch's
    for faircast in (True, False):
        torch.nn.functional.linear = linear
        records, fc, elements = deepspeed_run(deepspeed, stage, faircast)
        if fc is not None:
            check(f"zero{stage}: weight version {fc.caster.version} after {STEPS} steps", fc.caster.version == STEPS)
            check(f"zero{stage}: the last copy-back cast every weight element ({fc.last_step_elements} of {elements})",
                  fc.last_step_elements == elements)
        tally(f"DeepSpeed ZeRO-{stage} weights after each step ({BACKEND}, {DEV.type})", records, faircast=faircast)
    torch.nn.functional.linear = linear


# ----------------------------------------------------------------------------------------------------------------
# trl
# ----------------------------------------------------------------------------------------------------------------


def trl_run(model_dir: str, out_dir: str, faircast: bool):
    """Two GRPO steps (no vLLM: TRL generates with the policy); returns (forward records, export records, grid,
    setup), where ``grid`` counts the forwards whose weights were all on the bf16 grid, of how many, and ``setup``
    says how accelerate ran it (distributed type, processes, device)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation import vllm_generation

    from faircast_plugins.doctor.tiny import PROMPTS
    from faircast_plugins.doctor.trl import _reward
    from faircast_plugins.trl.patches import find_callback

    args = GRPOConfig(
        output_dir=out_dir, faircast=faircast, faircast_seed=SEED, max_steps=STEPS, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=4, use_cpu=SMOKE, beta=0.0, optim="sgd", learning_rate=1e-2,
        lr_scheduler_type="constant", warmup_steps=0, report_to="none", save_strategy="no", logging_steps=1, seed=0,
        data_seed=0, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model_dir, reward_funcs=_reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS[:8]}))
    callback = find_callback(trainer)
    check(f"trl, Fair Cast {'on' if faircast else 'off'}: the Fair Cast callback is {'there' if faircast else 'absent'}",
          (callback is not None) == faircast)
    model = trainer.accelerator.unwrap_model(trainer.model)
    forwards, on_grid, total = [], 0, 0

    def masters():
        if callback is not None:
            return callback.masters, callback.caster.version
        return {canonical_name(n): p.detach() for n, p in model.named_parameters()}, trainer.state.global_step

    def record(module, args, kwargs):
        nonlocal on_grid, total
        held, version = masters()
        params = {canonical_name(n): p.detach() for n, p in model.named_parameters()}
        total += 1
        on_grid += all(torch.equal(p, p.to(torch.bfloat16).to(p.dtype)) for p in params.values())
        forwards.extend((n, host(p).to(torch.bfloat16), host(held[n]), version) for n, p in params.items())

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        trainer.train()
    finally:
        hook.remove()
    # TRL's export iterator, as VLLMGeneration.sync_weights walks it; vLLM's load_weights copies each tensor into its
    # bf16 parameters (round-to-nearest for an fp32 tensor, exact for the served bf16 copy).
    generation = vllm_generation.VLLMGeneration.__new__(vllm_generation.VLLMGeneration)
    generation.model = trainer.model
    generation._dist = vllm_generation.DistributedBackend(trainer.accelerator)
    generation._faircast = callback
    held, version = masters()
    exported = [(n, host(t).to(torch.bfloat16), host(held[canonical_name(n)]), version)
                for n, t in vllm_generation.VLLMGeneration._iter_named_params(generation)]
    check(f"trl, Fair Cast {'on' if faircast else 'off'}: weight version {version} after {STEPS} steps",
          version == STEPS)
    state = trainer.accelerator.state
    setup = f"{state.distributed_type.value}, {state.num_processes} process(es), {state.device}"
    return forwards, exported, (on_grid, total), setup


def trl_section() -> None:
    importable("trl", "TRL")
    importable("datasets", "datasets")
    import faircast_plugins.trl  # noqa: F401  (patches TRL, its configs included)
    from faircast_plugins.doctor.tiny import build_model, build_tokenizer
    from faircast_plugins.trl.patches import PATCHES

    REPORT.results["adapters"]["trl patches"] = {"trl": PATCHES.version, "verified": PATCHES.verified}
    with tempfile.TemporaryDirectory(prefix="gpu-adapters-trl-") as tmp:
        build_tokenizer(tmp)
        build_model(tmp)
        for faircast in (True, False):
            forwards, exported, (on_grid, total), setup = trl_run(tmp, os.path.join(tmp, f"out-{faircast}"), faircast)
            where = f"({setup})"
            if faircast:
                check(f"GRPO forwards {where}, Fair Cast on: all {total} ran on bf16-grid weights", on_grid == total > 0)
                tally(f"GRPO forward weights {where}", forwards, faircast=True)
            else:
                check(f"GRPO forwards {where}, flag off: the fp32 master, off the bf16 grid once SGD moved it",
                      0 < on_grid < total, f"{on_grid} of {total} forwards on the grid")
            tally(f"TRL export iterator (engine-bound copy) {where}", exported, faircast=faircast)


def main() -> int:
    launch_as_one_rank()
    name = torch.cuda.get_device_name(DEV) if DEV.type == "cuda" else "CPU (smoke: gloo)"
    REPORT.results["process_group"] = {"backend": BACKEND, "world_size": 1}
    say(f"benchmarks.gpu.adapters: {name}; torch {torch.__version__}; {BACKEND}, world size 1; results in {ARGS.json}")
    sections = {"fsdp2": fsdp2_section, "zero2": lambda: zero_section(2), "zero3": lambda: zero_section(3),
                "trl": trl_section}
    for section in SECTIONS:
        REPORT.section(section, sections[section])
    return REPORT.finish("adapters")


if __name__ == "__main__":
    sys.exit(main())
