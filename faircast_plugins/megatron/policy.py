"""``faircast/policy_*`` under Megatron-core: the served bf16 params against the optimizer's fp32 masters, on a batch.

What the two views are here (faircast_plugins/policy_lag.py has the metrics' definitions):

* **served**: the model's bf16 params, widened to fp32 (exact). They are what the rollout engine receives: with
  Fair Cast's patch (:mod:`.patch`) the main->model copy writes ``fair_cast(master)`` into them; with the flag off
  (or without the patch) Megatron's own copy writes round to nearest of the master, what the standard export serves.
* **master**: the fp32 main param the optimizer trains, for the param's tensor-parallel-local shape. The Float16
  optimizer holds it whole on every rank (``fp32_from_float16_groups``); the distributed optimizer holds one range of
  each bucket per data-parallel rank (``shard_fp32_from_float16_groups``, the ranges :func:`.layout.dp_ranges` reads):
  it is assembled by one all-reduce over the optimizer's data-parallel group per param, of the int32 bit patterns
  (each element is owned by exactly one rank, the others add zero bits: exact, ``-0.0`` and NaN included).

Both views run one module at a time (:func:`~faircast_plugins.policy_lag.weights_swapped` with ``rebind=True``: each
module's params are swapped in by a forward pre-hook and back after its forward, in the module's parameter slots: the
Parameter objects, whose gradient accumulators carry Megatron DDP's gradient hooks, are never touched; the tied output layer also swaps the embedding weight
its parent hands it), in fp32: the probe calls the GPT inside Megatron's ``DistributedDataParallel`` and
``Float16Module`` wrappers directly (``Float16Module`` casts the first stage's float inputs to bf16 and upcasts the
last stage's outputs to fp32; the token ids pass unchanged, and bypassing it leaves nothing to round), so with fp32
weights swapped in every matmul is fp32; the attention softmax, which Megatron rounds back to bf16 in a bf16 model
(``FusedScaleMaskSoftmax.input_in_bf16``), is kept fp32 for the probe's forwards (:func:`fp32_softmax`); in eval
mode (no dropout), without autocast. The logits are vocab-parallel (``[B, T, V / TP]`` per tensor-parallel rank):
:func:`~faircast_plugins.policy_lag.vocab_parallel_sequence_stats` makes the log-softmax exact over the whole
(padded) vocabulary. Every tensor-parallel rank gets the same rows; they are gathered over the data-parallel group.

Pipeline parallelism: the probe runs megatron-core's own forward-only schedule (``get_forward_backward_func()``, one
micro-batch of the probe's sequences) once per view, every stage's params swapped, the activations sent between the
stages in fp32 (``config.pipeline_dtype`` is fp32 for the call: Megatron would send them in bf16, a rounding that is
not the weights' difference); the last stage scores the logits and broadcasts its rows over the pipeline group, so
every stage holds the same rows. Every stage of a data-parallel rank is given the same batch.

Only what the counted tokens need is computed: the positions after the last counted token are cut before the forwards
(causal attention: nothing counted depends on them), the statistics read the counted positions only
(:func:`counted_positions`), and at TP 1 they are :func:`~faircast_plugins.policy_lag.sequence_stats` (the whole
vocabulary is on the rank; the vocab-parallel path's collectives and extra float64 passes buy nothing there).

Collectives: each rank of a data-parallel group runs the same forwards, hence the same per-param all-reduces in the
same order (every module that holds params must run on every rank: Megatron's ``SequentialMLP`` calls every local
expert, also with no tokens); ranks whose batches chunk differently agree on the most forwards any of them runs (a
rank with fewer repeats its first chunk, its rows discarded). Refused at construction, with what to use instead:
virtual pipeline chunks, context parallelism (the sequence is split), ``overlap_param_gather`` (the params are
gathered by forward hooks of the training schedule).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Dict, List, Optional

import torch

from ..patching import FairCastPatchError
from ..policy_lag import (DEFAULT_SEQS, LOGIT_BUDGET, PolicyLagProbe, chunk_size, chunk_slices, eval_mode, gather_rows,
                          metrics_of, sequence_stats, vocab_parallel_sequence_stats, weights_swapped, widened)
from .layout import _unwrap, dp_ranges, float16_pairs, first_device, sub_optimizers

WHERE = "the faircast/policy_* metrics under Megatron-core (faircast_plugins.megatron.policy)"


class MasterView:
    """``param -> its fp32 master`` (TP-local shape) for the bf16 params of a Megatron optimizer; None for params
    the optimizer does not train in fp32 (frozen or fp32 params: they are what they are in both views)."""

    def __init__(self, optimizer):
        self.whole: Dict[int, torch.Tensor] = {}  # Float16 optimizer: id(param) -> fp32 main param
        self.sharded: Dict[int, tuple] = {}  # distributed optimizer: id(param) -> (group, shard or None, start, end)
        for opt in sub_optimizers(optimizer):
            if getattr(opt, "is_stub_optimizer", False):
                continue
            if type(opt).__name__ == "DistributedOptimizer":
                group = opt.data_parallel_group
                for buffer in opt.buffers:
                    for p in buffer.params:
                        if p.dtype == torch.bfloat16:
                            self.sharded[id(p)] = (group, None, 0, 0)
                for main, p, start, end, _ in dp_ranges(opt, destinations=False):
                    self.sharded[id(p)] = (group, main, start, end)
            else:
                for main, p in float16_pairs(opt):
                    self.whole[id(p)] = main
        #: the view assembles params by collectives over data-parallel ranks (their forwards must pair up)
        self.collective = any(torch.distributed.get_world_size(group) > 1 for group, *_ in self.sharded.values())

    def __call__(self, p: torch.nn.Parameter) -> Optional[torch.Tensor]:
        main = self.whole.get(id(p))
        if main is not None:
            return main.detach().view(p.shape)
        entry = self.sharded.get(id(p))
        if entry is None:
            return None
        group, shard, start, end = entry
        alone = torch.distributed.get_world_size(group) == 1
        if alone and shard is not None and (start, end) == (0, p.numel()) and shard.device == p.device:  # DP 1: the shard is the whole param, no copy
            return shard.detach().view(p.shape)
        full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        if shard is not None:
            full[start:end] = shard.detach().reshape(-1).to(p.device)
        if not alone:  # one owner per element: the bit patterns add exactly
            torch.distributed.all_reduce(full.view(torch.int32), group=group)
        return full.view(p.shape)


#: the served view: the model's bf16 param (the served copy) widened to fp32; fp32 params as they are
served_view = widened


#: attributes of megatron-core's ``FusedScaleMaskSoftmax`` that make it round the attention probabilities back to the
#: model's 16-bit dtype (``config.bf16``): cleared while the probe runs, so the softmax stays fp32
_HALF_SOFTMAX = ("input_in_fp16", "input_in_bf16", "input_in_float16")


@contextmanager
def fp32_softmax(model: torch.nn.Module):
    """Inside, the attention softmax modules of ``model`` neither expect nor produce 16-bit tensors (megatron-core's
    ``FusedScaleMaskSoftmax`` casts its fp32 probabilities to bf16 when the model trains in bf16: a rounding that is
    not the weights' difference). Restored on exit."""
    saved = []
    for module in model.modules():
        if all(hasattr(module, a) for a in _HALF_SOFTMAX):
            saved.append((module, [getattr(module, a) for a in _HALF_SOFTMAX]))
            for a in _HALF_SOFTMAX:
                setattr(module, a, False)
    try:
        yield
    finally:
        for module, values in saved:
            for a, v in zip(_HALF_SOFTMAX, values):
                setattr(module, a, v)


def counted_positions(served: torch.Tensor, master: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor):
    """``(served, master, tokens, mask)`` ``[B, T, ...]`` cut to the counted positions (``mask != 0``) of each
    sequence, packed to the left in their order (``[B, W, ...]``, ``W`` the most any sequence counts; a shorter one is
    filled with uncounted positions, mask 0): the statistics of the other positions are multiplied by 0 anyway."""
    keep = mask != 0
    width = int(keep.sum(1).max()) if keep.numel() else 0
    if width == mask.shape[1]:
        return served, master, tokens, mask
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :width]  # counted first, in order
    rows = torch.arange(mask.shape[0], device=mask.device).unsqueeze(1)
    return served[rows, order], master[rows, order], tokens[rows, order], mask[rows, order]


def refused_layouts() -> List[str]:
    """Why the probe cannot measure under this rank's Megatron parallel layout (empty: it can)."""
    from megatron.core import parallel_state as ps

    out = []
    if ps.get_context_parallel_world_size() > 1:
        out.append(f"context parallelism (context_parallel_size={ps.get_context_parallel_world_size()}): the sequence "
                   f"is split over ranks. Use context_parallel_size=1 for the metric")
    return out


class MegatronPolicyProbe:
    """Measures ``faircast/policy_*`` on a Megatron-core model every ``every`` optimizer steps (before the update:
    the served copy and the masters are then one weight version; the batch was sampled from it only if the engine was
    synced right before this step: docs/metrics.md, "Which served copy").

    ``optimizer``: what ``get_megatron_optimizer`` returned for the policy; ``model_chunks``: its model (one chunk:
    virtual pipeline stages are refused). ``caster``: the FairCaster given to :func:`.apply_megatron_patch`, marked
    as measured so the patch accepts ``policy_metrics_every``. Raises FairCastPatchError for layouts it cannot
    measure (:func:`refused_layouts`, ``overlap_param_gather``)."""

    def __init__(self, optimizer, model_chunks, *, every: int, seqs: int = DEFAULT_SEQS, caster=None):
        chunks = list(model_chunks)
        problems = refused_layouts()
        if len(chunks) != 1:
            problems.append(f"{len(chunks)} model chunks (virtual pipeline parallelism): use one chunk per rank")
        for chunk in chunks:
            ddp = getattr(chunk, "ddp_config", None)
            if getattr(ddp, "overlap_param_gather", False):
                problems.append("overlap_param_gather: the params are all-gathered by forward hooks of the training "
                                "schedule. Set overlap_param_gather=False")
        if problems:
            raise FairCastPatchError(f"{WHERE} does not support {problems[0]}, or remove policy_metrics_every "
                                     f"(faircast audit's faircast/lag_steps measures the lag in weight space)")
        self.optimizer, self.chunk = optimizer, chunks[0]
        self.model = _unwrap(self.chunk)  # the GPT inside DDP / Float16Module: called with fp32 weights swapped in
        self.probe = PolicyLagProbe(every, seqs)
        self.master = MasterView(optimizer)
        if caster is not None:
            caster.policy_measured = True

    def due(self, step: int) -> bool:
        return self.probe.due(step)

    def _shared(self) -> Dict[torch.nn.Module, List[torch.nn.Parameter]]:
        """A tied output layer reads the embedding's weight, handed in by the GPT's own forward."""
        model = self.model
        if getattr(model, "share_embeddings_and_output_weights", False) and getattr(model, "post_process", False):
            weight = model.shared_embedding_or_output_weight()
            if getattr(model, "output_layer", None) is not None and weight is not None:
                return {model.output_layer: [weight]}
        return {}

    def _local_vocab(self) -> Optional[int]:
        """This rank's rows of the output layer (``V / TP``): how many logits per position a forward makes (on every
        pipeline stage: the stages must chunk the sequences alike)."""
        out = getattr(self.model, "output_layer", None)
        weight = getattr(out, "weight", None) if out is not None else None
        if weight is None and getattr(self.model, "share_embeddings_and_output_weights", False):
            weight = self.model.shared_embedding_or_output_weight()
        if weight is not None:
            return int(weight.shape[0])
        vocab = getattr(self.model, "vocab_size", None)  # a pipeline stage without the output layer chunks the same
        if vocab is None:
            return None
        from megatron.core import parallel_state as ps

        return -(-int(vocab) // ps.get_tensor_model_parallel_world_size())

    def _logits(self, view: Callable, ids, positions, attention_mask) -> Optional[torch.Tensor]:
        """``[B, T, V / TP]`` fp32 logits of one forward on ``view``'s weights; None on a pipeline stage that is not
        the last (pipeline parallelism: Megatron's forward-only schedule carries the fp32 activations between the
        stages, every stage's params swapped)."""
        from megatron.core import parallel_state as ps

        with weights_swapped(self.model, view, shared=self._shared(), rebind=True):
            if ps.get_pipeline_model_parallel_world_size() == 1:
                return self.model(ids, positions, attention_mask).float()
            return self._pipelined(ids, positions, attention_mask)

    def _pipelined(self, ids, positions, attention_mask) -> Optional[torch.Tensor]:
        """One forward through every pipeline stage by megatron-core's own forward-only schedule (one micro-batch of
        the probe's sequences), the activations sent between the stages in fp32 (``config.pipeline_dtype`` for the
        call: Megatron sends them in the training's 16-bit dtype otherwise); the logits on the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.utils import get_model_config

        model, got = self.model, []

        def forward_step(_, __):  # the GPT itself, not DDP / Float16Module (see the module's docstring)
            with torch.autocast(device_type=ids.device.type, enabled=False):
                out = model(ids, positions, attention_mask)

            def keep(logits):  # the last stage: keep the logits, hand the schedule a loss it ignores
                got.append(logits.float())
                return logits.new_zeros(()), {}

            return out, keep

        config = get_model_config(self.chunk)  # the config the schedule's p2p reads
        saved = config.pipeline_dtype
        config.pipeline_dtype = torch.float32
        try:
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=None, model=[self.chunk],
                                        num_microbatches=1, seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
                                        forward_only=True)
        finally:
            config.pipeline_dtype = saved
        return got[0] if got else None

    @torch.no_grad()
    def measure(self, step: int, input_ids: torch.Tensor, position_ids: torch.Tensor, token_mask: torch.Tensor, *,
                attention_mask: Optional[torch.Tensor] = None, temperature: float = 1.0) -> None:
        """Score the first ``seqs`` sequences of ``input_ids`` ``[B, T]`` under both views; ``token_mask[b, t]``
        marks the tokens that count (completion tokens; token ``t`` is scored by the logits at ``t - 1``, so
        ``token_mask[:, 0]`` is ignored). ``position_ids`` / ``attention_mask``: what the GPT's forward takes (None:
        its causal mask; right padding then does not touch the counted tokens; a mask ``[b, 1, T, T]``). A collective
        over the model's tensor-, pipeline- and data-parallel groups: every rank calls it with its own batch (every
        pipeline stage of a data-parallel rank with the same batch).

        Only what the counted tokens need is computed: the positions after the last counted token are cut before the
        forwards (causal: nothing counted depends on them), and the statistics read the counted positions only."""
        from megatron.core import parallel_state as ps

        self.probe.measured_step = step
        count = min(self.probe.seqs, input_ids.shape[0])
        input_ids, position_ids, token_mask = input_ids[:count], position_ids[:count], token_mask[:count]
        if attention_mask is not None and attention_mask.shape[0] > 1:
            attention_mask = attention_mask[:count]
        counted = (token_mask[:, 1:] != 0).any(0).nonzero()
        keep = int(counted.max()) + 2 if counted.numel() else min(2, input_ids.shape[1])
        if keep < input_ids.shape[1]:  # causal: the positions after the last counted token change nothing counted
            input_ids, position_ids, token_mask = input_ids[:, :keep], position_ids[:, :keep], token_mask[:, :keep]
            if attention_mask is not None:
                attention_mask = attention_mask[..., :keep, :keep]
        tp = ps.get_tensor_model_parallel_world_size()
        extra = -input_ids.shape[1] % tp if getattr(getattr(self.model, "config", None), "sequence_parallel", False) else 0
        if extra and attention_mask is not None:
            raise ValueError(f"{WHERE}: with sequence parallelism the sequence ({input_ids.shape[1]} tokens) must be a "
                             f"multiple of the tensor-parallel size {tp}, or attention_mask None (then it is padded)")
        if extra:  # sequence parallelism splits the sequence over the TP ranks: right-pad it (causal: nothing counted moves)
            steps = torch.arange(1, extra + 1, device=position_ids.device, dtype=position_ids.dtype)
            input_ids = torch.cat([input_ids, input_ids.new_zeros(count, extra)], dim=1)
            position_ids = torch.cat([position_ids, position_ids[:, -1:] + steps], dim=1)
            token_mask = torch.cat([token_mask, token_mask.new_zeros(count, extra)], dim=1)
        length = input_ids.shape[1]
        local_vocab = self._local_vocab()  # unknown: one sequence per forward (every stage chunks alike)
        chunk = 1 if local_vocab is None else chunk_size(count, length, local_vocab, LOGIT_BUDGET)
        rows = []
        tp_group = ps.get_tensor_model_parallel_group()
        with eval_mode(self.model), torch.autocast(device_type=input_ids.device.type, enabled=False), \
                fp32_softmax(self.model):
            # the master view's all-reduces pair up over the ranks: as many forwards on each (policy_lag)
            for i, j, counted in chunk_slices(count, chunk, collective=self.master.collective,
                                              device=first_device(self.optimizer)):
                ids, pos = input_ids[i:j], position_ids[i:j]
                att = attention_mask[i:j] if attention_mask is not None and attention_mask.shape[0] > 1 else attention_mask
                s = self._logits(served_view, ids, pos, att)
                m = self._logits(self.master, ids, pos, att)
                if s is not None and counted:
                    args = counted_positions(s[:, :-1], m[:, :-1], ids[:, 1:], token_mask[i:j, 1:])
                    rows.append(vocab_parallel_sequence_stats(*args, temperature, group=tp_group) if tp > 1
                                else sequence_stats(*args, temperature))  # TP 1: the whole vocabulary here
                del s, m
        new = torch.cat(rows) if rows else torch.zeros(0, 3, dtype=torch.float64, device=input_ids.device)
        new = self._from_last_stage(new, count).cpu()
        self.probe.pending = new if self.probe.pending is None else torch.cat([self.probe.pending, new])

    def _from_last_stage(self, rows: torch.Tensor, count: int) -> torch.Tensor:
        """The last pipeline stage's rows on every stage (a broadcast over the pipeline group; as they are at PP 1)."""
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() == 1:
            return rows
        device = first_device(self.optimizer) or rows.device
        out = rows.to(device) if ps.is_pipeline_last_stage() else torch.zeros(count, 3, dtype=torch.float64, device=device)
        torch.distributed.broadcast(out, src=ps.get_pipeline_model_parallel_last_rank(),
                                    group=ps.get_pipeline_model_parallel_group())
        return out

    def metrics(self) -> Dict[str, float]:
        """The metrics of the rows measured since the last call, over the data-parallel group (its tensor-parallel
        peers hold the same rows): a collective, every rank calls it; empty when nothing was measured anywhere."""
        from megatron.core import parallel_state as ps

        rows = gather_rows(self.probe.take(), device=first_device(self.optimizer),
                           group=ps.get_data_parallel_group())
        return metrics_of(rows)


__all__ = ["MasterView", "MegatronPolicyProbe", "refused_layouts", "served_view"]
