"""One process or DDP: the policy's fp32 parameters hold the served copy, the fp32 masters are kept aside.

* at train begin: ``master = p.clone()``, then ``p <- q`` (version 0, or the restored version on resume);
* before each optimizer step: ``p <- master``, so the gradient computed at ``q`` is applied to the master;
* after it: ``master <- p``, version += 1, ``p <- q`` at the new version.

Generation (with or without vLLM), old log-probs and the loss all see ``q``; autocast's bf16 cast of ``q`` is exact,
and so is vLLM's ``copy_`` into its bf16 weights. Cost: +4 B/param for the masters (+4 more for an error-feedback
residual or an EMA), two copies per optimizer step.

With only ``faircast_audit`` on nothing is swapped: the audit measures the round-to-nearest copy that vLLM serves.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Optional

import torch

from ...key import canonical_name
from . import Backend, restoring_buffers


class ShadowMasters(Backend):
    """Single process / DDP (and audit-only runs without DeepSpeed or FSDP)."""

    def __init__(self, trainer, caster):
        super().__init__(trainer, caster)
        self.params: Dict[str, torch.nn.Parameter] = {}

    @property
    def shadow(self) -> bool:
        return self.config.enabled

    def _collect(self) -> Dict[str, torch.nn.Parameter]:
        params = {canonical_name(n): p for n, p in self.model().named_parameters() if p.is_floating_point()}
        bad = sorted(n for n, p in params.items() if p.dtype != torch.float32)
        if bad:
            raise TypeError(
                f"Fair Cast needs fp32 master weights, but {len(bad)} parameter(s) are "
                f"{params[bad[0]].dtype} (e.g. {bad[0]}). Load the policy in fp32 (the GRPO/RLOO default; "
                f"model_init_kwargs={{'dtype': 'float32'}}) and keep bf16=True for bf16 compute."
            )
        return params

    def prepare(self) -> None:
        self._collect()

    def begin(self, state, resume_dir: Optional[str]) -> None:
        self.params = self._collect()
        restored = self.restore(resume_dir, state.global_step)
        with torch.no_grad():
            if self.shadow and (restored or resume_dir or not self.masters):
                self.masters = {n: p.detach().clone() for n, p in self.params.items()}
            # else: a second train() on this trainer keeps its masters (the params hold the served copy)
            self._serve()
        self.ready = True

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
                self.caster.advance(self.masters)
            else:
                self.caster.advance(self._weights())
            self._serve()

    # -- export and generation ------------------------------------------------------------------------------
    @property
    def serves_export(self) -> bool:
        return self.shadow

    def export(self, stream):
        for name, tensor in stream:
            # The parameter holds fair_cast(master) at the current version: this cast is exact.
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

    def saved_weights(self) -> str:
        return "fp32 masters" if self.shadow else "fp32 weights (Fair Cast off)"
