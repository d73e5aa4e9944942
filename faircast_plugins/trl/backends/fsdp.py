"""FSDP2 (bf16 mixed precision): the sharded fp32 parameters are the masters; FSDP's bf16 cast of each shard is the
served copy.

At train begin the wrapped policy is registered with the shared FSDP cast patches (:mod:`faircast_plugins.fsdp`), so
FSDP's own bf16 cast of each shard at every all-gather -- the weights generation, old log-probs and the loss run on --
is ``fair_cast(master)`` at the current version; the version advances after each optimizer step, and the export
gives the rollout engine the same bits. Frozen parameters are not registered: FSDP casts them round to nearest.

Error feedback and the EMA are per-element state that each rank keeps for its own shards (``stateful``): each rank
casts its shards once per version, right after the optimizer step (EF advances its residual there, once; every later
cast site of that version -- FSDP's all-gathers, the export -- gets the same bits), the export assembles each full
tensor from every rank's served shard (:func:`faircast_plugins.fsdp.assemble_served`), and checkpoints hold one state
file per rank.

Policy metrics (``faircast_policy_metrics_every``, :mod:`faircast_plugins.fsdp_policy`): served = each module's
unsharded bf16 weight from FSDP2's own forward, widened to fp32; master = a second forward with FSDP's hooks off, each
FSDP2 unit's fp32 shards gathered in one all-gather per parameter group.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Dict, Optional

import torch

from ...audit import sample_positions
from ...cast import fair_cast
from ...export import save_state
from ...key import canonical_name
from ...patching import FairCastPatchError
from . import INFO_FILE, Backend, logger, state_what

#: Under FSDP with error feedback or an EMA: each rank's Fair Cast state (its shards' residuals / EMA), per checkpoint.
RANK_STATE_FILE = "faircast_state_rank{rank:05d}.pt"


class FSDPBackend(Backend):
    def __init__(self, trainer, caster):
        super().__init__(trainer, caster)
        self.names: Dict[str, str] = {}  # registered name -> canonical cast name (Fair Cast on)
        self._views = None  # the policy metrics' FSDP views, during a measurement

    @property
    def stateful(self) -> bool:
        """Error feedback or an EMA: the served copy depends on per-rank state of each rank's shards."""
        return self.config.keeps_state

    def prepare(self) -> None:
        self.fp32_params()

    def begin(self, state, resume_dir: Optional[str]) -> None:
        from ...fsdp import apply_fsdp_cast_patches, register_fsdp_module

        if self.config.enabled and not self.names:  # first: a per-rank state restore checks the registered shards
            apply_fsdp_cast_patches()
            self.names = register_fsdp_module(self.trainer.model, self.caster)
        self.restore(resume_dir, state.global_step)
        self.ready = True
        with torch.no_grad():
            self._cast_shards()

    def _shards(self):
        """``(name, local fp32 shard, global offset)`` of every trainable FSDP2 parameter on this rank: with Fair Cast
        on, exactly the flat shards FSDP's patched cast reads; in an audit-only run (nothing registered) the DTensors'
        local shards."""
        from ...fsdp import registered_shards, shard_offset

        if self.names:
            for name, (offset, master) in registered_shards(self.trainer.model).items():
                yield name, master, offset
            return
        for n, p in self.trainer.model.named_parameters():
            if p.requires_grad and hasattr(p, "to_local"):
                name = canonical_name(n)
                offset, _ = shard_offset(name, p)
                yield name, p.to_local().detach(), offset

    def _cast_shards(self) -> None:
        """Cast this rank's shards at the current version (the same bits as FSDP's own cast). Error feedback advances
        its residual here, once per version, whatever cast site comes next. Audit only: just the audit's sample."""
        if self.stateful or (self.config.enabled and self.caster.audit is not None):
            for name, local, offset in self._shards():
                self.caster.cast(name, local, offset=offset)
        elif self.caster.audit is not None:
            for name, local, offset in self._shards():
                flat = local.reshape(-1)
                pos = sample_positions(flat.numel(), self.config.audit_sample, flat.device)
                if pos is None:
                    self.caster.cast(name, flat, offset=offset)
                else:
                    self.caster.cast(name, flat[pos], indices=pos + offset)

    def after_step(self) -> None:
        with torch.no_grad():
            # EMA: this rank's shards of the EMA move towards its stepped shards (elementwise, so together they are the
            # EMA of the full masters)
            self.caster.advance([(n, m) for n, m, _ in self._shards()] if self.caster.ema_on else None)
            self._cast_shards()  # FSDP casts the stepped shards at the next all-gather, at the new version

    # -- the policy metrics' two views of the weights ---------------------------------------------------------
    policy_collective = True  # every forward all-gathers FSDP's shards: the ranks run as many

    def check_policy_metrics(self, trainer_name: str) -> None:
        """FSDP2 holds both views where its forward gathers them (:mod:`faircast_plugins.fsdp_policy`)."""
        self.caster.policy_measured = True  # register_fsdp_module then accepts the option from this adapter

    @contextmanager
    def policy_scope(self):
        """FSDP's casts of forward inputs to bf16 off; the probe swaps the views in where FSDP gathered the weights."""
        from ...fsdp_policy import FSDPPolicyViews

        self._views = FSDPPolicyViews(self.model())
        try:
            with self._views.scope():
                yield self._views.swapped
        finally:
            self._views = None

    def policy_views(self):
        """Served: each module's unsharded bf16 weight (FSDP's cast of the shards: Fair Cast's, or round to nearest
        with it off) widened to fp32; master: each FSDP2 unit's full fp32 masters, one all-gather of its shards per
        parameter group in forward order (a collective every rank runs). Only inside :meth:`policy_scope`."""
        return self._views.served, self._views.master

    # -- export ---------------------------------------------------------------------------------------------
    @property
    def serves_export(self) -> bool:
        return self.config.enabled

    def export(self, stream):
        """TRL's stream of gathered full fp32 masters (``(name, tensor)``, one at a time), with every registered
        parameter replaced by the served bf16 copy -- the bits FSDP's patched cast gives its shards.

        Stateless modes cast the full tensor. With error feedback or an EMA the copy is assembled from every rank's
        cast of its own shard (:func:`faircast_plugins.fsdp.assemble_served`): a collective, sound because TRL's FSDP2
        sync walks the same names in the same order on every rank. Unregistered tensors (frozen parameters) pass
        unchanged, i.e. round to nearest in the engine, as FSDP's stock cast does."""
        from ...fsdp import assemble_served, registered_shards, shard_groups

        shards = registered_shards(self.trainer.model) if self.stateful else None
        groups = shard_groups(self.trainer.model) if self.stateful else {}
        for name, tensor in stream:
            cast_name = self.names.get(canonical_name(name))
            if cast_name is None or tensor.dtype != torch.float32:
                yield name, tensor
            elif shards is not None:
                yield name, assemble_served(self.caster, cast_name, shards.get(cast_name), tensor.shape, tensor.device,
                                            groups.get(cast_name))
            else:
                yield name, fair_cast(tensor.detach().contiguous(), key=self.caster.key(cast_name),
                                      mode=self.caster.mode, backend=self.config.backend)

    # -- checkpoints ----------------------------------------------------------------------------------------
    def saved_weights(self) -> str:
        return "fp32 masters (FSDP)" if self.config.enabled else "fp32 weights (Fair Cast off)"

    def save_state(self, output_dir: str) -> dict:
        """Stateless modes: ``faircast_state.pt``. Error feedback or an EMA: every rank writes its own state (the
        residuals / EMA of its shards, with each shard's offset) as ``faircast_state_rankNNNNN.pt``, and the record
        names them and the world size; ``faircast export`` merges them."""
        if not self.stateful:
            return super().save_state(output_dir)
        rank, world = self.world()
        # the shard layout: resume checks it, and `faircast export` merges the ranks' files with it
        sharding = {"rank": rank, "world_size": world, "shards": self._shard_layout()}
        save_state(self.caster, output_dir, filename=RANK_STATE_FILE.format(rank=rank), extra={"fsdp": sharding})
        return {"state": RANK_STATE_FILE.replace("{rank:05d}", "*"), "world_size": world}

    def _shard_layout(self) -> Dict[str, list]:
        """``{name: [global offset, numel, full shape]}`` of this rank's registered shards."""
        from ...fsdp import registered_shards

        shapes = {canonical_name(n): list(p.shape) for n, p in self.trainer.model.named_parameters()}
        return {n: [offset, master.numel(), shapes[n]]
                for n, (offset, master) in registered_shards(self.trainer.model).items()}

    def load_state(self, directory: str) -> Optional[str]:
        """Restore this rank's Fair Cast state (its shards' residuals / EMA); refuse what cannot reproduce the run."""
        if not self.stateful:
            return super().load_state(directory)

        rank, world = self.world()
        what = state_what(self.config)
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
                f"world size {saved_world}, or train with faircast_mode=stochastic or sticky and no EMA."
            )
        if state is None:
            return path
        saved_layout = state.get("fsdp", {}).get("shards")
        if saved_layout is not None and saved_layout != self._shard_layout():
            raise FairCastPatchError(
                f"resuming from {directory} with {what} under FSDP: rank {rank}'s shards are laid out differently from "
                f"when {path} was written (another FSDP wrapping or mesh); the per-shard state cannot be reused."
            )
        self.caster.load_state_dict(state)
        logger.warning("Fair Cast: rank %d restored its state (weight version %d) from %s", rank, self.caster.version,
                       path)
        return None
