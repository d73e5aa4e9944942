"""Test shim: the one-process/DDP backend as it was before the 2 B masters (commit 81b1184 of
faircast_plugins/trl/backends/plain.py, unchanged but for its name and imports): full fp32 masters kept aside. The
reference the compact masters are compared with, bit for bit, at every step."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Optional

import torch

from faircast_plugins.audit import sample_positions
from faircast_plugins.trl.backends import Backend, restoring_buffers


class ReferenceShadowMasters(Backend):
    """Single process / DDP (and audit-only runs without DeepSpeed or FSDP)."""

    def __init__(self, trainer, caster):
        super().__init__(trainer, caster)
        self.params: Dict[str, torch.nn.Parameter] = {}  # trainable: cast at every version
        self.frozen: Dict[str, torch.nn.Parameter] = {}  # frozen: round to nearest once

    @property
    def shadow(self) -> bool:
        return self.config.enabled

    def prepare(self) -> None:
        params = self.fp32_params()
        self.params = {n: p for n, p in params.items() if p.requires_grad}
        self.frozen = {n: p for n, p in params.items() if not p.requires_grad}
        self._take_masters()
        with torch.no_grad():
            self._serve()  # version 0
        self.ready = True

    def _take_masters(self) -> None:
        """The parameters hold the masters now (fresh, or a checkpoint's): keep them aside, and cast the frozen ones
        (round to nearest, once)."""
        if not self.shadow:
            return
        with torch.no_grad():
            self.masters = {n: p.detach().clone() for n, p in {**self.params, **self.frozen}.items()}
            for p in self.frozen.values():
                p.data.copy_(p.data.to(torch.bfloat16))

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
        served = self.caster.cast_many({n: self.masters[n] for n in self.params})
        for n, q in served.items():
            self.params[n].data.copy_(q)

    def _audit(self) -> None:
        """Audit only: cast the audit's sample of each trainable weight (widened to fp32: exact, and it matters once
        TRL's continuous-batching generation has cast the policy to bf16 in place, which Fair Cast off keeps)."""
        if self.caster.audit is None:
            return
        for n, p in self.params.items():
            flat = p.detach().reshape(-1).float()
            pos = sample_positions(flat.numel(), self.config.audit_sample, flat.device)
            self.caster.cast(n, flat) if pos is None else self.caster.cast(n, flat[pos], indices=pos)

    def before_step(self) -> None:
        if self.shadow:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.data.copy_(self.masters[n])

    def after_step(self) -> None:
        with torch.no_grad():
            if self.shadow:
                for n, p in self.params.items():
                    self.masters[n].copy_(p.data)
                self.caster.advance({n: self.masters[n] for n in self.params})
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
        """Point every parameter at its master while saving, and back afterwards: no copy, no extra memory."""
        if not (self.shadow and self.masters):
            yield
            return
        params = {**self.params, **self.frozen}
        served = {n: p.data for n, p in params.items()}
        try:
            for n, p in params.items():
                p.data = self.masters[n]
            yield
        finally:
            for n, p in params.items():
                p.data = served[n]

    def saved_weights(self) -> str:
        return "fp32 masters" if self.shadow else "fp32 weights (Fair Cast off)"
