"""The shadow-master callback: the loss runs on the served copy, the optimizer steps the fp32 master.

With Fair Cast on, every fp32 parameter of the policy *holds* the served copy ``q = fair_cast(master)`` (bf16
values stored in fp32) whenever the model runs, and its fp32 master is kept aside:

* ``on_train_begin``: ``master = p.clone()``, then ``p <- q`` (version 0, or the restored version on resume);
* ``on_pre_optimizer_step``: ``p <- master``, so the gradient computed at ``q`` is applied to the master;
* ``on_optimizer_step``: ``master <- p`` (the stepped value), version += 1, ``p <- q`` at the new version.

So generation (with or without vLLM), old log-probs and the loss all see ``q``; autocast's bf16 cast of ``q`` is
exact, and so is vLLM's ``copy_`` into its bf16 weights. Cost: +4 B/param for the masters (+4 more for an
error-feedback residual or an EMA), two copies per optimizer step. TRL's continuous-batching generation casts the
policy itself to bf16 and never back; :meth:`FairCastCallback.bf16_generation` hands it bf16 copies of the
parameters (exact for ``q``) instead, and puts the buffers back afterwards.

Under DeepSpeed (bf16) nothing is swapped either: the module's bf16 parameters are the served copy and the fp32
masters live in DeepSpeed's optimizer, so ``on_train_begin`` attaches the shared DeepSpeed copy-back patch
(:func:`faircast_plugins.deepspeed.apply_deepspeed_patch`) to the trainer's engine with this callback's caster; it
advances the weight version at each optimizer step and writes ``fair_cast(master)`` into the bf16 weights, and it
saves/restores per-rank Fair Cast state in DeepSpeed's checkpoint folder.

Under FSDP2 (bf16 mixed precision) nothing is swapped either: the sharded fp32 parameters are the masters, and
``on_train_begin`` registers the wrapped policy with the shared FSDP cast patches (:mod:`faircast_plugins.fsdp`),
so FSDP's own bf16 cast of each shard at every all-gather -- the weights generation, old log-probs and the loss
run on -- is ``fair_cast(master)`` at the current version; the version advances after each optimizer step, and the
vLLM export gives the rollout engine the same bits. Error feedback and the EMA are per-element state that each rank
keeps for its own shards (:meth:`FairCastCallback.stateful`): each rank casts its shards once per version, right
after the optimizer step (EF advances its residual there, once; every later cast site of that version -- FSDP's
all-gathers, the export -- gets the same bits), the export assembles each full tensor from every rank's served
shard (:func:`faircast_plugins.fsdp.assemble_served`), and checkpoints hold one state file per rank.

With only ``faircast_audit`` on, nothing is swapped: the callback measures how far the round-to-nearest copy that
vLLM serves trails the master, and TRL's logs get the same ``faircast/*`` metrics.
"""
from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from typing import Dict, Optional

import torch
from transformers import TrainerCallback

from ..audit import finalize
from ..cast import fair_cast
from ..caster import FairCaster
from ..config import FairCastConfig
from ..export import STATE_FILE, save_state
from ..key import canonical_name
from ..patching import FairCastPatchError

logger = logging.getLogger("faircast_plugins")

INFO_FILE = "faircast.json"
#: Under FSDP with error feedback or an EMA: each rank's Fair Cast state (its shards' residuals / EMA), per checkpoint.
RANK_STATE_FILE = "faircast_state_rank{rank:05d}.pt"


class FairCastCallback(TrainerCallback):
    """Keeps fp32 masters aside and serves ``fair_cast(master)`` from the policy's own parameters."""

    def __init__(self, trainer, config: FairCastConfig):
        self.trainer = trainer
        self.config = config
        self.caster = FairCaster(config)
        self.params: Dict[str, torch.nn.Parameter] = {}
        self.masters: Dict[str, torch.Tensor] = {}
        self.resume_dir: Optional[str] = None
        self.deepspeed = None  # the attached DeepSpeedFairCast under DeepSpeed
        self.fsdp_names: Dict[str, str] = {}  # under FSDP (Fair Cast on): registered name -> canonical cast name
        self._cumulative = {"dev_along": 0.0, "abs_update": 0.0}  # FSDP audit, summed over ranks

    @property
    def on_deepspeed(self) -> bool:
        return bool(getattr(self.trainer, "is_deepspeed_enabled", False))

    @property
    def on_fsdp(self) -> bool:
        return bool(getattr(self.trainer, "is_fsdp_enabled", False))

    @property
    def shadow(self) -> bool:
        """True when fp32 parameters hold the served copy (Fair Cast on, no DeepSpeed or FSDP); False for an
        audit-only run, under DeepSpeed (the bf16 parameters are the served copy) and under FSDP (FSDP's bf16 cast
        of the fp32 shards is)."""
        return self.config.enabled and not self.on_deepspeed and not self.on_fsdp

    @property
    def stateful(self) -> bool:
        """True under FSDP with error feedback or an EMA: the served copy depends on per-element state that each rank
        keeps for its own shards, so the export assembles it from every rank and checkpoints hold a file per rank."""
        cfg = self.config
        return self.on_fsdp and cfg.enabled and (cfg.mode == "error_feedback" or bool(cfg.ema_decay))

    # -- setup ----------------------------------------------------------------------------------------------
    def _collect(self) -> Dict[str, torch.nn.Parameter]:
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        params = {canonical_name(n): p for n, p in model.named_parameters() if p.is_floating_point()}
        bad = sorted(n for n, p in params.items() if p.dtype != torch.float32)
        if bad:
            raise TypeError(
                f"Fair Cast needs fp32 master weights, but {len(bad)} parameter(s) are "
                f"{params[bad[0]].dtype} (e.g. {bad[0]}). Load the policy in fp32 (the GRPO/RLOO default; "
                f"model_init_kwargs={{'dtype': 'float32'}}) and keep bf16=True for bf16 compute."
            )
        return params

    def check_model(self) -> None:
        """Raise a clear ``TypeError`` unless every floating-point parameter of the policy is fp32.

        Not under DeepSpeed: its optimizer keeps the fp32 masters (ZeRO-3 builds the module in bf16 already), and
        the DeepSpeed patch checks the engine when it is attached."""
        if not self.on_deepspeed:
            self._collect()

    def _attach_deepspeed(self, state) -> None:
        """Attach the DeepSpeed copy-back patch to the trainer's engine (prepared by now), sharing this caster."""
        from ..deepspeed import apply_deepspeed_patch

        engine = self.trainer.deepspeed
        if self.deepspeed is not None and self.deepspeed.engine is engine:
            return  # a second train() on the same engine
        self.caster.version = state.global_step  # a DeepSpeed resume then restores the saved state
        module = self.trainer.accelerator.unwrap_model(self.trainer.model)
        self.deepspeed = apply_deepspeed_patch(engine, self.caster, module=module)
        if self.caster.version != state.global_step:
            raise RuntimeError(
                f"Fair Cast state restored from the DeepSpeed checkpoint is at weight version {self.caster.version} "
                f"but the trainer resumes at step {state.global_step}"
            )

    def _attach_fsdp(self) -> None:
        """Register the FSDP-wrapped policy (wrapped by now) with the shared FSDP cast patches, sharing this caster."""
        from ..fsdp import apply_fsdp_cast_patches, register_fsdp_module

        if self.config.enabled and not self.fsdp_names:
            apply_fsdp_cast_patches()
            self.fsdp_names = register_fsdp_module(self.trainer.model, self.caster)

    def _fsdp_shards(self):
        """``(name, local fp32 shard, global offset)`` of every trainable FSDP2 parameter on this rank: with Fair Cast
        on, exactly the flat shards FSDP's patched cast reads (the per-element state of error feedback and the EMA is
        kept for these); in an audit-only run (nothing registered) the DTensors' local shards."""
        from ..fsdp import registered_shards, shard_offset

        if self.fsdp_names:
            for name, (offset, master) in registered_shards(self.trainer.model).items():
                yield name, master, offset
            return
        for n, p in self.trainer.model.named_parameters():
            if p.requires_grad and hasattr(p, "to_local"):
                name = canonical_name(n)
                offset, _ = shard_offset(name, p)
                yield name, p.to_local().detach(), offset

    def _cast_fsdp_shards(self) -> None:
        """Cast this rank's shards at the current version (the same bits as FSDP's own cast: Fair Cast, or
        round-to-nearest when off). Error feedback advances its residual here, once per version, whatever cast site
        comes next; the audit sees every version even if no forward runs."""
        if self.caster.audit is not None or self.stateful:
            for name, local, offset in self._fsdp_shards():
                self.caster.cast(name, local, offset=offset)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.config.enabled:
            from .patches import check_optimizer

            check_optimizer(type(self.trainer).__name__, self.trainer.optimizer)
        if self.on_deepspeed:
            self._attach_deepspeed(state)
            self.resume_dir = None
            return
        if self.on_fsdp:
            self._attach_fsdp()  # first: a per-rank state restore checks this rank's registered shards
        else:
            self.params = self._collect()
        restored = self._load_state(self.resume_dir) if self.resume_dir else False
        if not restored:
            if state.global_step and self.config.enabled and self.resume_dir:
                logger.warning(
                    "Fair Cast: resuming at step %d from a checkpoint without %s; starting Fair Cast state "
                    "(error-feedback residuals, EMA) fresh at weight version %d", state.global_step, STATE_FILE,
                    state.global_step,
                )
            self.caster.version = state.global_step
        elif self.caster.version != state.global_step:
            raise RuntimeError(
                f"Fair Cast state in {self.resume_dir} is at weight version {self.caster.version} but the trainer "
                f"resumes at step {state.global_step}"
            )
        if self.on_fsdp:
            with torch.no_grad():
                self._cast_fsdp_shards()
            self.resume_dir = None
            return
        with torch.no_grad():
            if self.shadow and (restored or self.resume_dir or not self.masters):
                self.masters = {n: p.detach().clone() for n, p in self.params.items()}
            # else: a second train() on this trainer keeps its masters (the params hold the served copy)
            self._serve()
        self.resume_dir = None

    # -- the three swaps ------------------------------------------------------------------------------------
    def _serve(self) -> None:
        """Cast at the current version; with Fair Cast on, the parameters then hold the served copy."""
        source = self.masters if self.shadow else self._weights()
        served = self.caster.cast_many(source)
        if self.shadow:
            for n, q in served.items():
                self.params[n].data.copy_(q)

    def _weights(self) -> Dict[str, torch.Tensor]:
        """Audit only: the weights the optimizer steps, as fp32. Widening is exact; it matters once TRL's
        continuous-batching generation has cast the policy to bf16 in place (Fair Cast off keeps TRL's behaviour),
        after which those bf16 weights are both what is trained and what is served."""
        return {n: p.detach() if p.dtype == torch.float32 else p.detach().float() for n, p in self.params.items()}

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.shadow:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.data.copy_(self.masters[n])

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.on_deepspeed:
            return  # the DeepSpeed patch advanced the version and cast inside the engine's step
        if self.on_fsdp:  # FSDP casts the stepped shards at the next all-gather, at the new version
            with torch.no_grad():
                # EMA: this rank's shards of the EMA move towards its stepped shards (elementwise, so together they
                # are the EMA of the full masters)
                self.caster.advance([(n, m) for n, m, _ in self._fsdp_shards()] if self.caster.ema_on else None)
                self._cast_fsdp_shards()
            return
        with torch.no_grad():
            if self.shadow:
                for n, p in self.params.items():
                    self.masters[n].copy_(p.data)
                self.caster.advance(self.masters)
            else:
                self.caster.advance(self._weights())
            self._serve()

    @contextmanager
    def bf16_generation(self):
        """Around TRL's continuous-batching generation, which casts the policy to bf16 in place and never back.

        With shadow masters, each fp32 parameter (holding ``q = fair_cast(master)``) is swapped out of its module for
        the generation, and a bf16 ``Parameter`` with the same values (exact: ``q`` is bf16-representable) takes
        its place, so TRL's ``unwrapped_model.to(torch.bfloat16)`` finds the parameters bf16 already and
        ``generate_batch`` runs on the served copy bit for bit. Afterwards the original parameters go back. They
        never change dtype: the optimizer, their pending gradients and DDP's gradient hooks (tied to each
        parameter's gradient accumulator, which a dtype change would replace) are untouched. Every floating buffer
        (e.g. rotary ``inv_freq``), which TRL's cast does replace, is put back to the tensor it held before.

        Under DeepSpeed (bf16 parameters: already the served copy; TRL's cast leaves them as they are) only the
        buffers are put back.
        """
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        buffers = [(module, name, buf) for module in model.modules()
                   for name, buf in module.named_buffers(recurse=False) if buf.is_floating_point()]
        swapped = []
        if self.shadow:
            copies: Dict[int, torch.nn.Parameter] = {}  # one copy per parameter, so tied weights stay tied
            with torch.no_grad():
                for module in model.modules():
                    for name, p in list(module.named_parameters(recurse=False)):
                        if not p.is_floating_point():
                            continue
                        if id(p) not in copies:
                            copies[id(p)] = torch.nn.Parameter(p.detach().to(torch.bfloat16),
                                                               requires_grad=p.requires_grad)
                        module.register_parameter(name, copies[id(p)])
                        swapped.append((module, name, p))
        try:
            yield
        finally:
            for module, name, p in swapped:
                module.register_parameter(name, p)
            for module, name, buf in buffers:
                setattr(module, name, buf)

    @contextmanager
    def masters_in_params(self):
        """Temporarily put the fp32 masters back into the parameters (used while saving a checkpoint)."""
        if not (self.shadow and self.masters):
            yield
            return
        with torch.no_grad():
            served = {n: p.data.clone() for n, p in self.params.items()}
            for n, p in self.params.items():
                p.data.copy_(self.masters[n])
            try:
                yield
            finally:
                for n, p in self.params.items():
                    p.data.copy_(served[n])

    # -- metrics --------------------------------------------------------------------------------------------
    def metrics(self) -> Dict[str, float]:
        """``faircast/*`` metrics since the last log (the audit ones only with ``faircast_audit``).

        Under FSDP each rank audits its own shards, so the sums are all-reduced: a collective, and every rank calls
        ``Trainer.log``."""
        audit = self.caster.audit
        if not (self.on_fsdp and audit is not None and torch.distributed.is_initialized()):
            return self.caster.metrics()
        totals = audit.totals()
        keys = sorted(totals)
        summed = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=self.trainer.accelerator.device)
        torch.distributed.all_reduce(summed)
        totals = dict(zip(keys, summed.cpu().tolist()))
        out = {"faircast/version": float(self.caster.version), **finalize(totals)}
        self._cumulative["dev_along"] += totals.get("dev_along", 0.0)
        self._cumulative["abs_update"] += totals.get("abs_update", 0.0)
        if self._cumulative["abs_update"]:
            out["faircast/bias_rel_cumulative"] = abs(self._cumulative["dev_along"]) / self._cumulative["abs_update"]
        return out

    def fsdp_export(self, stream):
        """Under FSDP: TRL's stream of gathered full fp32 masters (``(name, tensor)``, one at a time), with every
        registered parameter replaced by the served bf16 copy -- the bits FSDP's patched cast gives its shards.

        Stateless modes cast the full tensor. With error feedback or an EMA the copy depends on per-rank shard state,
        so it is assembled from every rank's cast of its own shard (:func:`faircast_plugins.fsdp.assemble_served`):
        a collective, which is sound because TRL's FSDP2 sync walks the same names in the same order on every rank
        (it all-gathers each parameter with ``full_tensor()``). Unregistered tensors (frozen parameters) pass
        unchanged, i.e. round to nearest in the engine, as FSDP's stock cast does. Unaudited here: the audit follows
        the shards."""
        from ..fsdp import assemble_served, registered_shards

        shards = registered_shards(self.trainer.model) if self.stateful else None
        for name, tensor in stream:
            cast_name = self.fsdp_names.get(canonical_name(name))
            if cast_name is None or tensor.dtype != torch.float32:
                yield name, tensor
            elif shards is not None:
                yield name, assemble_served(self.caster, cast_name, shards.get(cast_name), tensor.shape, tensor.device)
            else:
                yield name, fair_cast(tensor.detach().contiguous(), key=self.caster.key(cast_name),
                                      mode=self.caster.mode, backend=self.config.backend)

    # -- checkpoints ----------------------------------------------------------------------------------------
    def save_state(self, output_dir: str) -> None:
        """Write the caster state (version, residuals, EMA) and a small JSON record next to the saved model.

        With the fp32 masters as the model weights, ``faircast export`` (:func:`faircast_plugins.export.export_served`)
        rebuilds the served bf16 copy of this checkpoint from ``faircast_state.pt``.

        Under DeepSpeed only the JSON record is written here: the Fair Cast state belongs to the DeepSpeed checkpoint
        (``global_stepN/faircast_state_rankNNNNN.pt``, one per rank, written and restored by the DeepSpeed patch with
        the residuals of that rank's partition), so there is one state and one restore path; :meth:`on_save` points
        the record at those files once the Trainer has written them.

        Under FSDP with error feedback or an EMA every rank writes its own state (the residuals / EMA of its shards) as
        ``faircast_state_rankNNNNN.pt`` (with each shard's offset), and the record names them and the world size;
        ``faircast export`` merges them (:func:`faircast_plugins.export.merge_rank_states`).

        Called on every rank (``Trainer.save_model`` runs on every rank); only the main process writes shared files."""
        if self.stateful:
            self._save_rank_state(output_dir)
        if not self.trainer.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        info = {
            "enabled": self.config.enabled,
            "mode": self.config.effective_mode,
            "seed": self.config.seed,
            "version": self.caster.version,
            "ema_decay": self.config.ema_decay,
            "model_weights": self._saved_weights(),
        }
        if self.stateful:
            info["state"] = RANK_STATE_FILE.replace("{rank:05d}", "*")
            info["world_size"] = self._world()[1]
        elif not self.on_deepspeed:
            save_state(self.caster, output_dir)  # faircast_state.pt, the file `faircast export --state` reads
        with open(os.path.join(output_dir, INFO_FILE), "w") as f:
            json.dump(info, f, indent=2)

    def on_save(self, args, state, control, **kwargs):
        """Under DeepSpeed: point the checkpoint's ``faircast.json`` at the per-rank state files DeepSpeed just wrote."""
        if not (self.on_deepspeed and args.should_save):
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        from ..deepspeed.patch import STATE_FILE as DEEPSPEED_STATE_FILE

        checkpoint = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        info_path = os.path.join(checkpoint, INFO_FILE)
        # The Trainer saves with DeepSpeed's default tag.
        tag = f"global_step{self.trainer.deepspeed.global_steps}"
        rank0_state = os.path.join(checkpoint, tag, DEEPSPEED_STATE_FILE.format(rank=0))
        if not (os.path.exists(info_path) and os.path.exists(rank0_state)):
            return
        with open(info_path) as f:
            info = json.load(f)
        info["state"] = os.path.join(tag, DEEPSPEED_STATE_FILE.replace("{rank:05d}", "*"))
        with open(info_path, "w") as f:
            json.dump(info, f, indent=2)

    def _saved_weights(self) -> str:
        if self.on_fsdp:
            return "fp32 masters (FSDP)" if self.config.enabled else "fp32 weights (Fair Cast off)"
        if self.on_deepspeed:
            return ("bf16 served copy (DeepSpeed's module weights; ZeRO-3 writes them only with "
                    "stage3_gather_16bit_weights_on_model_save; fp32 masters and per-rank Fair Cast state are in the "
                    "DeepSpeed checkpoint)")
        return "fp32 masters" if self.shadow else "fp32 weights (Fair Cast off)"

    def _load_state(self, directory: str) -> bool:
        if self.stateful:
            return self._load_rank_state(directory)
        path = os.path.join(directory, STATE_FILE)
        if not os.path.exists(path):
            return False
        self.caster.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        logger.warning("Fair Cast: restored state (weight version %d) from %s", self.caster.version, path)
        return True

    # -- per-rank state (FSDP with error feedback or an EMA) ----------------------------------------------------
    def _world(self):
        """``(rank, world size)`` of the trainer's processes."""
        accelerator = self.trainer.accelerator
        return accelerator.process_index, accelerator.num_processes

    def _per_rank_what(self) -> str:
        if self.config.mode == "error_feedback":
            return "faircast_mode=error_feedback (its residuals)"
        return f"faircast_ema_decay={self.config.ema_decay} (the EMA of the master)"

    def _shard_layout(self) -> Dict[str, list]:
        """``{name: [global offset, numel, full shape]}`` of this rank's registered shards."""
        from ..fsdp import registered_shards

        shapes = {canonical_name(n): list(p.shape) for n, p in self.trainer.model.named_parameters()}
        return {n: [offset, master.numel(), shapes[n]]
                for n, (offset, master) in registered_shards(self.trainer.model).items()}

    def _save_rank_state(self, output_dir: str) -> str:
        rank, world = self._world()
        # the shard layout: resume checks it, and `faircast export` merges the ranks' files with it
        sharding = {"rank": rank, "world_size": world, "shards": self._shard_layout()}
        return str(save_state(self.caster, output_dir, filename=RANK_STATE_FILE.format(rank=rank),
                              extra={"fsdp": sharding}))

    def _load_rank_state(self, directory: str) -> bool:
        """Restore this rank's Fair Cast state (its shards' residuals / EMA); refuse what cannot reproduce the run."""
        rank, world = self._world()
        what = self._per_rank_what()
        info_path = os.path.join(directory, INFO_FILE)
        saved_world = None
        if os.path.exists(info_path):
            with open(info_path) as f:
                saved_world = json.load(f).get("world_size")
        path = os.path.join(directory, RANK_STATE_FILE.format(rank=rank))
        state = torch.load(path, map_location="cpu", weights_only=True) if os.path.exists(path) else None
        if state is not None and saved_world is None:
            saved_world = state.get("fsdp", {}).get("world_size")
        if saved_world is not None and saved_world != world:
            raise FairCastPatchError(
                f"resuming from {directory} with {what} under FSDP at world size {world}: the checkpoint's Fair Cast "
                f"state was written at world size {saved_world}. It is per-rank state of each rank's shards; resume at "
                f"world size {saved_world}, or train with faircast_mode=stochastic and no EMA."
            )
        if state is None:
            raise FairCastPatchError(
                f"resuming from {directory} with {what} under FSDP needs this rank's Fair Cast state, but {path} does "
                f"not exist (a checkpoint written without Fair Cast, with another mode, or by a plugin version that "
                f"did not save it); starting the state fresh would not reproduce the run."
            )
        saved_layout = state.get("fsdp", {}).get("shards")
        if saved_layout is not None and saved_layout != self._shard_layout():
            raise FairCastPatchError(
                f"resuming from {directory} with {what} under FSDP: rank {rank}'s shards are laid out differently from "
                f"when {path} was written (another FSDP wrapping or mesh); the per-shard state cannot be reused."
            )
        self.caster.load_state_dict(state)
        logger.warning("Fair Cast: rank %d restored its state (weight version %d) from %s", rank, self.caster.version,
                       path)
        return True


def find_callback(trainer) -> Optional[FairCastCallback]:
    return getattr(trainer, "_faircast", None)
