"""One process or DDP: the policy's fp32 parameters hold the served copy, the fp32 masters are kept aside.

* at construction: ``master = p.clone()``, then ``p <- q = fair_cast(master)`` at version 0, so an ``evaluate()`` or
  an engine sync before the first ``train()`` already sees the served copy; frozen parameters are cast once, round
  to nearest, the way a rollout engine loads them (and the way DeepSpeed and FSDP cast them);
* at train begin: on a resume, the masters are the checkpoint's (the Trainer loaded them into the parameters);
* before each optimizer step: ``p <- master``, so the gradient computed at ``q`` is applied to the master;
* after it: ``master <- p``, version += 1, ``p <- q`` at the new version.

Generation (with or without vLLM), old log-probs and the loss all see ``q``; autocast's bf16 cast of ``q`` is exact,
and so is vLLM's ``copy_`` into its bf16 weights.

Cost: +2 B/param for ``stochastic`` and ``sticky`` (and ``nearest`` with ``faircast_master_bytes: 2``): a master is kept as its low 16 bits plus an exception
list (:mod:`faircast_plugins.master16`) and rebuilt in place from ``q`` before each step, so "``p <- master``" is a
recovery and "``master <- p``" takes the low bits. Error feedback and EMA keep fp32 masters (+4 B, plus their own
state): their ``q`` is not a function of the master alone. Frozen parameters keep theirs in 2 B too. While saving,
the parameters hold the fp32 masters, so checkpoints are what they were.

With only ``faircast_audit`` on nothing is swapped: the audit measures the round-to-nearest copy that vLLM serves,
casting only the sampled elements.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, Mapping, Optional

import torch

from ...audit import sample_positions
from ...cast import fair_cast
from ...cast import STOCHASTIC_RULE
from ...master16 import COMPACT_MODES, Compact, compact, compact_all, recover, recover_
from . import Backend, restoring_buffers


class ShadowMasters(Backend):
    """Single process / DDP (and audit-only runs without DeepSpeed or FSDP)."""

    def __init__(self, trainer, caster):
        super().__init__(trainer, caster)
        self.params: Dict[str, torch.nn.Parameter] = {}  # trainable: cast at every version
        self.frozen: Dict[str, torch.nn.Parameter] = {}  # frozen: round to nearest once
        self.compacts: Dict[str, Compact] = {}  # 2 B masters beside the served copy each parameter holds
        self.in_params: set = set()  # names whose parameter holds its master right now (not the served copy)

    @property
    def shadow(self) -> bool:
        return self.config.enabled

    @property
    def compact_trainable(self) -> bool:
        """Trainable masters kept in 2 B: the served copy gives them back (not with EMA or error feedback, whose served
        copy is not a function of the master alone)."""
        master_bytes = getattr(self.trainer.args, "faircast_master_bytes", None)
        if master_bytes == 4:  # the user's choice: fp32 masters, no recovery
            return False
        if master_bytes is None and self.caster.mode == "nearest":  # no fused nearest compaction: its chunked torch
            return False  # reference would cost launches and host syncs per 1M elements every step (docs/trl.md)
        return self.shadow and self.caster.mode in COMPACT_MODES and not self.caster.ema_on

    # -- the masters: kept in fp32 (``full``), or as 2 B beside the served copy (``compacts``) ----------------------
    @property
    def masters(self) -> Mapping[str, torch.Tensor]:
        """The fp32 masters by canonical name (trainable and frozen); compact ones are recovered on each read."""
        return _Masters(self) if self.shadow else {}

    @masters.setter
    def masters(self, value) -> None:  # Backend.__init__ sets {}
        self.full = dict(value)

    def _master(self, name: str) -> torch.Tensor:
        if name in self.full:
            return self.full[name]
        p = self.params.get(name, self.frozen.get(name))
        if name in self.in_params:  # the parameter holds it: the live tensor, as a kept fp32 master is
            return p.detach()
        return recover(p.detach(), self.compacts[name], self.config.backend)

    def _take_masters(self) -> None:
        """The parameters hold the masters now (fresh, or a checkpoint's): keep the fp32 ones aside (error feedback,
        EMA), mark the others as held by their parameters, and cast the frozen ones (round to nearest, once)."""
        if not self.shadow:
            return
        with torch.no_grad():
            self.full = {} if self.compact_trainable else {n: p.detach().clone() for n, p in self.params.items()}
            self.in_params = set(self.frozen) | (set(self.params) - set(self.full))
            for n, p in self.frozen.items():
                q = p.data.to(torch.bfloat16)
                self.compacts[n] = compact(p.data, q, key=None, mode="nearest", low16=self._buffer(n))
                p.data.copy_(q)
                self.in_params.discard(n)

    def _buffer(self, name: str) -> Optional[torch.Tensor]:
        c = self.compacts.get(name)
        return None if c is None else c.low16

    def _recover_in_params(self, names) -> None:
        """The parameters of ``names`` that hold their served copy hold their master afterwards (in place)."""
        params = self.everything()
        for n in names:
            if n not in self.in_params and n not in self.full:
                recover_(params[n].data, self.compacts[n], self.config.backend)
                self.in_params.add(n)

    def everything(self) -> Dict[str, torch.nn.Parameter]:
        return {**self.params, **self.frozen}

    def prepare(self) -> None:
        params = self.fp32_params()
        self.params = {n: p for n, p in params.items() if p.requires_grad}
        self.frozen = {n: p for n, p in params.items() if not p.requires_grad}
        self._take_masters()
        with torch.no_grad():
            self._serve()  # version 0
        self.ready = True

    def begin(self, state, resume_dir: Optional[str]) -> None:
        if resume_dir:
            self._take_masters()  # the Trainer loaded the checkpoint's fp32 masters into the parameters
        self.restore(resume_dir, state.global_step)
        with torch.no_grad():
            self._serve()

    def _serve(self) -> None:
        """Cast the trainable parameters at the current version; with Fair Cast on, they then hold the served copy."""
        if not self.shadow:
            self._audit()
            return
        if self.full:
            served = self.caster.cast_many({n: self.full[n] for n in self.params})
            for n, q in served.items():
                self.params[n].data.copy_(q)
            return
        stale = [n for n in self.params if n not in self.in_params and self.compacts[n].key != self._key(n)]
        self._recover_in_params(stale)  # served at another version (a resume without a checkpoint's masters)
        names = [n for n in self.params if n in self.in_params]
        fresh = {}
        if self.caster.mode in STOCHASTIC_RULE:  # from the intact masters, with one host read for the whole step
            buffers = {n: self._buffer(n) for n in names if n in self.compacts}
            fresh = compact_all({n: self.params[n].data for n in names}, keys={n: self._key(n) for n in names},
                                mode=self.caster.mode, backend=self.config.backend, buffers=buffers)
        for n in names:  # one at a time: no second copy of the model
            p = self.params[n]
            q = self.caster.cast(n, p.data)
            self.compacts[n] = fresh[n] if n in fresh else compact(p.data, q, key=self._key(n), mode=self.caster.mode,
                                                                   backend=self.config.backend, low16=self._buffer(n))
            p.data.copy_(q)
            self.in_params.discard(n)

    def _key(self, name: str) -> Optional[int]:
        return None if self.caster.mode == "nearest" else self.caster.key(name)

    def _audit(self) -> None:
        """Audit only: cast the audit's sample of each trainable weight (widened to fp32: exact, and it matters once
        TRL's continuous-batching generation has cast the policy to bf16 in place, which Fair Cast off keeps)."""
        if self.caster.audit is None:
            return
        for n, p in self.params.items():
            flat = p.detach().reshape(-1)
            pos = sample_positions(flat.numel(), self.config.audit_sample, flat.device)
            # index first, then widen: the sample only, not a full fp32 copy of each parameter every step
            self.caster.cast(n, flat.float()) if pos is None else self.caster.cast(n, flat[pos].float(), indices=pos)

    # -- the policy metrics' two views of the weights ---------------------------------------------------------
    def check_policy_metrics(self, trainer_name: str) -> None:
        """Both views exist here: the parameters hold one copy, the other is made one parameter at a time."""

    def policy_views(self):
        """Fair Cast on: the parameters hold the served copy; the master view recovers each master when its module
        runs (a kept fp32 master is used as it is). Off: the parameters hold the masters; the served view is round to
        nearest of each, what vLLM's bf16 load of the fp32 export gives."""
        if self.shadow:
            names = {id(p): n for n, p in self.everything().items()}
            return _as_is, lambda p: self._master(names[id(p)]) if id(p) in names else None
        return _round_to_nearest, _as_is

    def before_step(self) -> None:
        if self.shadow:
            with torch.no_grad():
                for n, p in self.params.items():
                    if n in self.full:
                        p.data.copy_(self.full[n])
                self._recover_in_params(self.params)

    def after_step(self) -> None:
        with torch.no_grad():
            if self.shadow:
                if self.full:
                    for n, p in self.params.items():
                        self.full[n].copy_(p.data)
                    self.caster.advance({n: self.full[n] for n in self.params})
                else:
                    self.in_params |= set(self.params)  # the optimizer wrote the new masters into the parameters
                    self.caster.advance()
            else:
                self.caster.advance()
            self._serve()

    # -- export and generation ------------------------------------------------------------------------------
    @property
    def serves_export(self) -> bool:
        return self.shadow

    def export(self, stream):
        for name, tensor in stream:
            # The parameter holds the served copy (fair_cast(master), or round to nearest once when frozen): exact.
            yield name, tensor.to(torch.bfloat16) if tensor.dtype == torch.float32 else tensor

    @contextmanager
    def bf16_generation(self):
        """Each fp32 parameter (holding the served copy) is swapped out of its module for the generation, and a bf16
        ``Parameter`` with the same values (exact) takes its place, so TRL's ``unwrapped_model.to(torch.bfloat16)``
        finds the parameters bf16 already and ``generate_batch`` runs on the served copy bit for bit. Afterwards the
        original parameters go back. They never change dtype: the optimizer, their pending gradients and DDP's
        gradient hooks (tied to each parameter's gradient accumulator, which a dtype change would replace) are
        untouched. The buffers are put back too."""
        model = self.model()
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
            with restoring_buffers(model):
                yield
        finally:
            for module, name, p in swapped:
                module.register_parameter(name, p)

    @contextmanager
    def masters_in_params(self):
        """Every parameter holds its master while saving, and its served copy afterwards: the fp32 ones are pointed at
        (no copy), the compact ones recovered in place and cast back (the same bits: same master, same key)."""
        if not self.shadow:
            yield
            return
        params = self.everything()
        served = {n: p.data for n, p in params.items() if n in self.full}
        recovered = [n for n in params if n not in self.full and n not in self.in_params]
        try:
            for n in served:
                params[n].data = self.full[n]
            with torch.no_grad():
                self._recover_in_params(recovered)
            yield
        finally:
            for n, data in served.items():
                params[n].data = data
            with torch.no_grad():
                for n in recovered:
                    self._reserve(n)

    def _reserve(self, name: str) -> None:
        """Cast back a parameter that holds its master, under the key its compact state was made with."""
        p, c = self.everything()[name], self.compacts[name]
        if c.mode == "nearest" and name in self.frozen:
            q = p.data.to(torch.bfloat16)
        else:
            q = fair_cast(p.data, key=c.key or 0, mode=c.mode, backend=self.config.backend)
        p.data.copy_(q)
        self.in_params.discard(name)

    def state_bytes(self) -> int:
        """Bytes of the tensors this backend keeps beside the parameters (masters, their compact state)."""
        return (sum(t.numel() * t.element_size() for t in self.full.values())
                + sum(c.nbytes() for c in self.compacts.values()))

    def saved_weights(self) -> str:
        return "fp32 masters" if self.shadow else "fp32 weights (Fair Cast off)"


def _as_is(p: torch.nn.Parameter) -> None:
    return None


def _round_to_nearest(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The standard export's served copy of one fp32 parameter (vLLM loads it into bf16: round to nearest even)."""
    return p.data.to(torch.bfloat16).to(p.dtype) if p.dtype == torch.float32 else None


class _Masters(Mapping):
    """Read-only view of a :class:`ShadowMasters`' fp32 masters: each read of a compact one recovers it."""

    def __init__(self, backend: ShadowMasters):
        self.backend = backend

    def _names(self):
        return list(self.backend.params) + list(self.backend.frozen)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.backend.params and name not in self.backend.frozen:
            raise KeyError(name)
        with torch.no_grad():
            return self.backend._master(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())
