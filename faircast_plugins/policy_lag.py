"""``faircast/policy_*``: what the served copy's distance from the master costs the batch, in the policy's own terms.

The audit (:mod:`faircast_plugins.audit`) measures the lag in weight space (``faircast/lag_steps``); a user cannot
read from it what the lag does to their samples. This measures it where it acts: on a few sequences of the current
batch, the served copy (the bf16 weights of the current version, what the engine holds after a sync now; the
batch's own sampler only if it was synced right before this step: docs/metrics.md, "Which served copy") and the fp32
master (the policy the loss trains) each score the same tokens, and

``faircast/policy_kl``
    the mean per-token KL(served || master) over the completion tokens, exact over the vocabulary
    (``sum_v p_s (log p_s - log p_m)`` at the sampling temperature), token-weighted;
``faircast/policy_ess_frac``
    the sequence-level effective sample fraction ``(sum w)^2 / (n sum w^2)`` of the importance weights
    ``w_i = exp(sum_t log p_m(y_t) - log p_s(y_t))`` that correct sampling from the served copy to the master:
    1 when the two agree on every sampled sequence, 1/n when one sequence carries all the weight. It is a sample
    estimate over the few sequences measured (at least 1/n, and biased up for small n): read it averaged over steps;
``faircast/policy_seq_log_ratio_std``
    the spread (std over the measured sequences) of ``log w_i``: for log-normal weights ESS/n ~ exp(-std^2), which
    stays meaningful when n is small;
``faircast/policy_seqs``, ``faircast/policy_tokens``
    how many sequences and completion tokens the numbers above come from.

Both forwards run in fp32 with autocast off, so the numbers measure the weights' difference only (not the bf16
kernels' mismatch, which the stacks' own trainer-vs-engine checks see); a transformers model loaded with an attention
implementation that takes 16-bit inputs only (flash-attn) runs them with SDPA (eager where its attention logits are soft-capped: :func:`fp32_attention`). With Fair
Cast off the served copy is round to nearest of the master (what the standard export serves): the metric shows what
its lag costs the batch; with Fair Cast on it shows what the unbiased copy's rounding noise costs.

Pure torch, below the adapters: :func:`sequence_stats` (logits of both copies on the same tokens -> per-sequence
sums; :func:`vocab_parallel_sequence_stats` the same from logits split over the vocabulary by tensor parallelism),
:func:`summarize` (those rows, gathered from every rank -> the metrics), :func:`weights_swapped` (runs a forward on
another copy of the weights, swapping each module's own parameters in just before it runs and back just after: at most one module's other copy is alive at a time, never a second model), :func:`served_weight` (the
served copy of one master, by the export's cast), :func:`hooks_detached` (forwards without given hooks, e.g. FSDP2's
or DeepSpeed ZeRO-3's gathers when the views bring the weights), :func:`chunk_size` / :func:`chunk_slices` (how many
sequences per forward, and the forwards every rank runs: shared with the Megatron probe), :func:`fp32_attention` /
:func:`keeps_logits` (the attention and the logits a transformers model's forwards run with) and
:class:`PolicyLagProbe` (when to measure, and the measuring itself, given the adapter's two weight views).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .cast import fair_cast
from .config import FairCastConfig

KL_KEY = "faircast/policy_kl"
ESS_KEY = "faircast/policy_ess_frac"
LOG_RATIO_STD_KEY = "faircast/policy_seq_log_ratio_std"
SEQS_KEY = "faircast/policy_seqs"
TOKENS_KEY = "faircast/policy_tokens"
KEYS = (KL_KEY, ESS_KEY, LOG_RATIO_STD_KEY, SEQS_KEY, TOKENS_KEY)

#: sequences of the batch measured by default (per rank): the config's default
DEFAULT_SEQS = FairCastConfig.policy_metrics_seqs
#: columns of one sequence's row in :func:`sequence_stats`
COLUMNS = ("kl_sum", "tokens", "log_ratio")
#: positions (summed over the sequences) whose float64 log-softmax :func:`sequence_stats` holds at a time
POSITION_CHUNK = 256
#: bytes of fp32 logits (both views) one forward of the probe may produce: sequences are scored in chunks under it (a
#: single sequence over it is scored alone: ``8 (C + 1) V`` bytes for a completion of C tokens, vocabulary V)
LOGIT_BUDGET = 1 << 30


def sequence_stats(served_logits: torch.Tensor, master_logits: torch.Tensor, tokens: torch.Tensor,
                   mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-sequence sums, float64 ``[B, 3]``: (sum of per-token KL(served || master), tokens counted, sum of per-token
    ``log p_m(y_t) - log p_s(y_t)``).

    ``served_logits`` and ``master_logits`` are ``[B, T, V]``: position ``t`` scores ``tokens[:, t]`` (already shifted:
    the logits that predict the completion tokens); ``mask`` ``[B, T]`` selects the tokens that count. Logits are
    divided by ``temperature`` (the policy the engine sampled from)."""
    if served_logits.shape != master_logits.shape or served_logits.shape[:2] != tokens.shape:
        raise ValueError(f"logits {tuple(served_logits.shape)} / {tuple(master_logits.shape)} do not match tokens "
                         f"{tuple(tokens.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    out = torch.zeros(tokens.shape[0], len(COLUMNS), dtype=torch.float64, device=tokens.device)
    step = max(1, POSITION_CHUNK // max(1, tokens.shape[0]))
    for t in range(0, tokens.shape[1], step):  # float64 temporaries of a bounded number of positions at a time
        log_s = torch.log_softmax(served_logits[:, t:t + step].double() / temperature, dim=-1)
        log_m = torch.log_softmax(master_logits[:, t:t + step].double() / temperature, dim=-1)
        kl = (log_s.exp() * (log_s - log_m)).sum(-1)  # [B, chunk], exact over the vocabulary
        idx = tokens[:, t:t + step].long().unsqueeze(-1)
        ratio = (log_m.gather(-1, idx) - log_s.gather(-1, idx)).squeeze(-1)
        m = mask[:, t:t + step].to(torch.float64)
        out += torch.stack([(kl * m).sum(1), m.sum(1), (ratio * m).sum(1)], dim=1)
    return out


def vocab_parallel_sequence_stats(served_logits: torch.Tensor, master_logits: torch.Tensor, tokens: torch.Tensor,
                                  mask: torch.Tensor, temperature: float = 1.0, *, group=None,
                                  vocab_start: Optional[int] = None) -> torch.Tensor:
    """:func:`sequence_stats` of logits split over the vocabulary (tensor parallelism: Megatron's output layer gives
    each rank of ``group`` its ``[B, T, V / TP]`` slice): the same ``[B, 3]`` rows on every rank of ``group``.

    ``tokens`` are global vocabulary ids; this rank's slice holds ids ``[vocab_start, vocab_start + V_local)``
    (default ``rank(group) * V_local``, Megatron's ``VocabUtility`` split). The log-softmax is exact over the whole
    vocabulary: the max and the sum of exponentials are all-reduced over ``group`` (MAX, then SUM), then the
    per-position KL terms and the sampled token's logits (on one rank, zero on the others) in one more SUM. Float64
    throughout, three collectives per chunk of :data:`POSITION_CHUNK` positions; every rank of ``group`` must call it
    with the same ``tokens`` and ``mask``. Pure torch.distributed; ``group=None`` outside a process group is the
    unsharded computation."""
    import torch.distributed as dist

    if served_logits.shape != master_logits.shape or served_logits.shape[:2] != tokens.shape:
        raise ValueError(f"logits {tuple(served_logits.shape)} / {tuple(master_logits.shape)} do not match tokens "
                         f"{tuple(tokens.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    sharded = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    local = served_logits.shape[-1]
    if vocab_start is None:
        vocab_start = dist.get_rank(group) * local if sharded else 0

    def reduce(t: torch.Tensor, op) -> torch.Tensor:
        if sharded:
            dist.all_reduce(t, op=op, group=group)
        return t

    out = torch.zeros(tokens.shape[0], len(COLUMNS), dtype=torch.float64, device=tokens.device)
    step = max(1, POSITION_CHUNK // max(1, tokens.shape[0]))
    for t in range(0, tokens.shape[1], step):
        both = torch.stack([served_logits[:, t:t + step].double(), master_logits[:, t:t + step].double()]) / temperature
        top = reduce(both.amax(-1, keepdim=True), dist.ReduceOp.MAX)  # [2, B, chunk, 1]
        shifted = both - top
        lse = reduce(shifted.exp().sum(-1, keepdim=True), dist.ReduceOp.SUM).log()
        log_p = shifted - lse  # this rank's slice of each view's exact log-softmax
        kl_part = (log_p[0].exp() * (log_p[0] - log_p[1])).sum(-1)  # [B, chunk]
        idx = tokens[:, t:t + step].long() - vocab_start
        here = (idx >= 0) & (idx < local)
        picked = log_p.gather(-1, idx.clamp(0, local - 1).unsqueeze(0).unsqueeze(-1).expand(2, -1, -1, 1)).squeeze(-1)
        picked = picked * here  # the sampled token's log-prob on the rank that holds it, 0 elsewhere
        sums = reduce(torch.stack([kl_part, picked[1] - picked[0]]), dist.ReduceOp.SUM)
        m = mask[:, t:t + step].to(torch.float64)
        out += torch.stack([(sums[0] * m).sum(1), m.sum(1), (sums[1] * m).sum(1)], dim=1)
    return out


def summarize(stats: torch.Tensor) -> Dict[str, float]:
    """The metrics from :func:`sequence_stats` rows (every rank's, gathered); empty without a counted token."""
    stats = stats.detach().double().cpu().reshape(-1, len(COLUMNS))
    stats = stats[stats[:, 1] > 0]  # sequences with no counted token say nothing
    if stats.shape[0] == 0:
        return {}
    tokens = float(stats[:, 1].sum())
    log_w = stats[:, 2]
    w = torch.exp(log_w - log_w.max())  # the shift cancels in the ratio
    n = log_w.numel()
    ess = float(w.sum() ** 2 / (n * (w * w).sum()))
    std = float(log_w.std(unbiased=False)) if n > 1 else 0.0
    return {KL_KEY: float(stats[:, 0].sum()) / tokens, ESS_KEY: ess, LOG_RATIO_STD_KEY: std,
            SEQS_KEY: float(n), TOKENS_KEY: tokens}


@contextmanager
def swap_hooks(modules, swap_in: Callable, put_back: Callable):
    """Forwards of ``modules`` inside run between ``swap_in(module, args, kwargs, swapped) -> (args, kwargs)``, the
    innermost forward pre-hook (registered last: after e.g. DeepSpeed ZeRO-3's all-gather of the module's partitions),
    which appends what it swaps to the list ``swapped``, and ``put_back(swapped)``, the innermost forward hook
    (``prepend=True``: before e.g. ZeRO-3's or FSDP's release of the gathered weights; ``always_call``: also when the
    forward raises). A ``swap_in`` that raises part way (a view or a gather out of memory) has what it swapped put
    back before the error goes on; whatever is still swapped on exit is put back."""
    saved: Dict[int, List] = {}

    def pre(module, args, kwargs):
        swapped: List = []
        try:
            args, kwargs = swap_in(module, args, kwargs, swapped)
        except BaseException:
            put_back(swapped)
            raise
        saved.setdefault(id(module), []).append(swapped)
        return args, kwargs

    def post(module, args, output):
        stack = saved.get(id(module))
        if stack:  # empty when the pre-hook raised (always_call runs this anyway)
            put_back(stack.pop())

    handles = []
    try:
        for module in modules:
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, prepend=True, always_call=True))
        yield
    finally:
        for h in handles:
            h.remove()
        for stack in saved.values():
            for swapped in reversed(stack):
                put_back(swapped)


@contextmanager
def hooks_detached(handles):
    """Forwards inside run without the hooks of ``handles`` (``torch.utils.hooks.RemovableHandle``: e.g. FSDP2's or
    DeepSpeed ZeRO-3's gather/release hooks, when the probe brings the weights itself): each is taken out of the hook
    dict it was registered in (``handle.hooks_dict_ref()``, keyed by the handle's id, unique over the process) and put
    back on exit in its original place. A hook another removed inside stays removed; one added inside is kept, after
    the original ones."""
    ids = {h.id for h in handles}
    saved: Dict[int, tuple] = {}  # id(hook dict) -> (the dict, its items before)
    for h in handles:
        hooks = h.hooks_dict_ref()
        if hooks is not None and id(hooks) not in saved:
            saved[id(hooks)] = (hooks, list(hooks.items()))
    try:
        for hooks, _ in saved.values():
            for key in [k for k in hooks if k in ids]:
                del hooks[key]
        yield
    finally:
        for hooks, items in saved.values():
            before = {k for k, _ in items}
            added = [(k, v) for k, v in hooks.items() if k not in before]
            kept = [(k, v) for k, v in items if k in ids or k in hooks]
            hooks.clear()
            hooks.update(kept)
            hooks.update(added)


@contextmanager
def weights_swapped(model: torch.nn.Module, view: Callable[[torch.nn.Parameter], Optional[torch.Tensor]],
                    shared: Optional[Dict[torch.nn.Module, List[torch.nn.Parameter]]] = None, *, rebind: bool = False):
    """Forwards of ``model`` inside run on ``view(p)`` instead of each parameter ``p`` (None: ``p`` itself).

    Each module's own parameters are swapped in by a forward pre-hook and back by a forward hook, so at most one
    module's other copy is alive at a time (the view is computed on the fly, e.g. a recovery or a cast of one
    weight). A parameter used outside its module's forward would be read unswapped: this serves modules that use
    their own weights (every ``nn.Linear``, ``nn.Embedding``, norm; a tied ``lm_head`` swaps its shared weight in its
    own forward). ``shared``: parameters a module is handed by its parent and reads in its forward besides its own (a
    Megatron output layer given the tied embedding's weight), swapped around that module's forward too.

    The swap is the innermost of the module's hooks: the pre-hook is registered last (it runs after every pre-hook
    already there, e.g. DeepSpeed ZeRO-3's all-gather of the module's partitions into ``p.data``) and the post-hook
    first (``prepend=True``: it puts ``p.data`` back before every forward hook already there, e.g. ZeRO-3's release
    of the gathered weights), so such hooks see their own tensors and ``view(p)`` reads the gathered parameter.

    ``rebind=False`` swaps ``p.data``. ``rebind=True`` leaves every Parameter object untouched and puts the view in its
    module's ``_parameters`` slot for the forward (a ``shared`` one: in the forward's arguments): needed where the view
    has another dtype than ``p`` and something holds ``p``'s gradient accumulator (torch resets it when ``p.data``
    changes dtype, dropping the hooks registered on it: Megatron's DDP reduces gradients from such hooks)."""
    extra = {id(m): list(ps) for m, ps in (shared or {}).items()}

    def swap_in(module, args, kwargs, swapped):
        if rebind:
            for name, p in list(module._parameters.items()):
                other = view(p) if p is not None else None
                if other is not None:
                    swapped.append((module, name, p))
                    module._parameters[name] = other
            others = {id(p): o for p in extra.get(id(module), ()) if (o := view(p)) is not None}
            if others:
                args = tuple(others.get(id(a), a) for a in args)
                kwargs = {k: others.get(id(v), v) for k, v in kwargs.items()}
        else:
            for p in [*module.parameters(recurse=False), *extra.get(id(module), ())]:
                other = view(p)
                if other is not None:
                    swapped.append((p, p.data))
                    p.data = other
        return args, kwargs

    def put_back(swapped):
        for item in swapped:
            if rebind:
                module, name, p = item
                module._parameters[name] = p
            else:
                p, data = item
                p.data = data

    with swap_hooks([m for m in model.modules()
                     if next(m.parameters(recurse=False), None) is not None or id(m) in extra], swap_in, put_back):
        yield


def widened(t: torch.Tensor) -> Optional[torch.Tensor]:
    """A 16-bit weight (the served copy a module computes with) widened to fp32, exact; None for an fp32 weight (the
    view of a parameter that is the same in both copies)."""
    return t.detach().float() if t.is_floating_point() and t.dtype != torch.float32 else None


def served_weight(master: torch.Tensor, *, enabled: bool, mode: str, key: int, backend: str = "auto") -> torch.Tensor:
    """The served copy of one fp32 master, as the export casts it, widened to fp32 (exact): round to nearest with Fair
    Cast off (what the standard export serves), ``fair_cast(master, key, mode)`` with it on. Modes whose served copy
    depends on state (``error_feedback``, EMA) have no such function of the master: their adapter reads the copy it
    holds."""
    if not enabled or mode == "nearest":
        return master.to(torch.bfloat16).float()
    if mode not in ("stochastic", "sticky"):
        raise ValueError(f"the served copy under mode={mode} depends on per-element state, not on the master alone")
    return fair_cast(master, key=key, mode=mode, backend=backend).float()


@contextmanager
def plain_forward(model: torch.nn.Module):
    """Inside, ``model(...)`` runs the class's own forward: a mixed-precision wrapper that accelerate (and DeepSpeed,
    FSDP's accelerate path) sets as an instance attribute ``forward`` enters bf16 autocast inside, which would round
    the master's weights again in every matmul. Hooks still run (``nn.Module.__call__``)."""
    wrapped = model.__dict__.pop("forward", None)
    try:
        yield
    finally:
        if wrapped is not None:
            model.forward = wrapped


@contextmanager
def eval_mode(model: torch.nn.Module):
    """Inside, every module of ``model`` in eval mode (no dropout: both views score the same function of the
    weights). On exit (also on an error) each module is back in its own mode, not the root's: a submodule kept in
    eval (a frozen tower, a block with dropout turned off) stays in eval. ``model.train`` runs first (a wrapper's
    override sees the root's mode, as before), then each module's own flag is put back where it differs."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        model.train(modes[0][1])
        for module, training in modes:
            if module.training != training:
                module.training = training


#: attention implementations the probe's fp32 forwards run as they are; any other is switched for them
#: (:func:`fp32_attention`)
FP32_ATTENTION = ("eager", "sdpa")


def _attention_configs(model: torch.nn.Module) -> List[Tuple[object, Optional[torch.nn.Module]]]:
    """Every transformers config the forwards of ``model`` read their attention implementation from, each once:
    the ``config`` of every submodule (the HF model inside a wrapper: FSDP1, DeepSpeed's engine, OpenRLHF's Actor, a
    PEFT model; the sub-models of a composite model; the attention modules themselves) and, recursively, its
    ``sub_configs`` (a composite model's text and vision configs). Each with the transformers model that owns it
    (None when no submodule does)."""
    found: Dict[int, Tuple[object, Optional[torch.nn.Module]]] = {}

    def visit(config, owner):
        if id(config) in found:
            if owner is not None and found[id(config)][1] is None:
                found[id(config)] = (config, owner)
            return
        found[id(config)] = (config, owner)
        for key in getattr(config, "sub_configs", None) or ():
            sub = getattr(config, key, None)
            if sub is not None and hasattr(sub, "_attn_implementation"):
                visit(sub, None)

    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            # a transformers model by its class (FSDP1's and DeepSpeed's wrappers hand on the attributes of theirs)
            visit(config, module if hasattr(type(module), "_supports_sdpa") else None)
    return list(found.values())


def _fp32_implementation(config) -> str:
    """What a config's attention is switched to for fp32: ``"eager"`` where attention logits are soft-capped
    (``attn_logit_softcapping``, Gemma 2: transformers' SDPA path drops the cap, flash-attn and eager apply it), else
    ``"sdpa"``."""
    return "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"


def _switch_refused(owner: Optional[torch.nn.Module], target: str) -> Optional[str]:
    """Why ``owner`` (a transformers model) cannot run ``target`` attention when its config says so; None when it can
    (or unknown)."""
    if owner is None:
        return None
    if target == "sdpa" and not getattr(owner, "_supports_sdpa", True):
        return f"{type(owner).__name__} has no SDPA attention"
    can_set = getattr(type(owner), "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        return (f"{type(owner).__name__} picks its attention classes when it is built (not through transformers' "
                f"AttentionInterface), so its implementation cannot be switched for the probe's forwards")
    return None


@contextmanager
def fp32_attention(model: torch.nn.Module):
    """Inside, the transformers models in ``model`` run attention that takes fp32 where their ``attn_implementation``
    is not one of :data:`FP32_ATTENTION`: the probe's forwards are fp32, which flash-attn (``flash_attention_2``/``_3``,
    verl's and OpenRLHF's default) and other fp16/bf16 kernels refuse. The switch is to ``"sdpa"`` (fp32 in its CUDA
    kernels; memory-efficient attention, no ``[T, T]`` scores), or to ``"eager"`` for a model whose attention logits
    are soft-capped (:func:`_fp32_implementation`: SDPA would drop the cap and score another function). Transformers'
    attention modules and mask builders read ``config._attn_implementation`` at every forward, so the switch is that
    attribute on every config found (:func:`_attention_configs`), set without transformers' checks
    (``set_attn_implementation`` would check, and on restoring flash-attn import it, again) and put back exactly on
    exit, also when a forward raises. FairCastPatchError, naming ``attn_implementation``, for a model that cannot be
    switched."""
    switched = []
    try:
        for config, owner in _attention_configs(model):
            current = config._attn_implementation
            if current is None or current in FP32_ATTENTION:
                continue
            target = _fp32_implementation(config)
            problem = _switch_refused(owner, target)
            if problem is not None:
                from .patching import FairCastPatchError

                raise FairCastPatchError(
                    f"faircast policy metrics: the probe scores in fp32, which attn_implementation={current!r} does "
                    f"not run, and {problem}. Load the policy with attn_implementation='sdpa' (or 'eager'), or turn "
                    f"the policy metrics off (policy_metrics_every 0)")
            switched.append((config, config.__dict__.get("_attn_implementation_internal", current)))
            _set_attention(config, target)
        yield
    finally:
        for config, before in reversed(switched):
            _set_attention(config, before)


def _set_attention(config, value) -> None:
    """``config``'s own attention implementation (not its sub-configs', which transformers' setter would also set)."""
    if "_attn_implementation_internal" in config.__dict__:
        config.__dict__["_attn_implementation_internal"] = value
    else:
        config._attn_implementation = value


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count only attended tokens (left padding: the first real token is position 0), as trainers
    that left-pad prompts pass them (OpenRLHF's ``Actor.forward``); padded positions get 1."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill_(attention_mask == 0, 1)


def keeps_logits(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward takes ``logits_to_keep`` (transformers' causal LMs: the LM head runs on the last
    positions only). Read from the signature of the class's ``forward``, through wrappers whose forward hands its
    keyword arguments on to the model they wrap (FSDP1's and DDP's ``module``, PEFT's ``get_base_model()``)."""
    import inspect

    seen = set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        try:
            params = inspect.signature(type(model).forward).parameters
        except (TypeError, ValueError):
            return False
        if "logits_to_keep" in params:
            return True
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return False
        inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module) and callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        model = inner if isinstance(inner, torch.nn.Module) else None
    return False


def _completion_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       completion: int, mask_positions: bool = False, keep: bool = False) -> torch.Tensor:
    """``[B, completion, V]`` fp32 logits that predict the last ``completion`` tokens of ``input_ids`` (with
    ``mask_positions``, position ids from :func:`positions_from_mask`; else the model's default). ``keep``: the
    forward takes ``logits_to_keep`` (:func:`keeps_logits`), so it computes the ``completion + 1`` last positions'
    logits only; else it computes every position's, and the completion's are copied out so that the whole tensor is
    freed (no view keeps it alive)."""
    extra = {"position_ids": positions_from_mask(attention_mask)} if mask_positions else {}
    if keep:
        extra["logits_to_keep"] = completion + 1
    with plain_forward(model):
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
    logits = out.logits if hasattr(out, "logits") else out[0]
    del out
    wanted = logits[:, -completion - 1:-1].float()
    if logits.shape[1] > completion + 1 and wanted.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr():
        wanted = wanted.clone()  # a view would keep every position's logits alive
    return wanted


class PolicyLagProbe:
    """Measures ``faircast/policy_*`` every ``every`` optimizer steps on the first ``seqs`` sequences of a batch.

    The adapter gives the two weight views of its model as parameter -> tensor functions (None: the parameter as it
    is): ``served`` (what the rollout engine holds) and ``master`` (what the optimizer trains). A measurement is two
    no-grad fp32 forwards over the ``seqs`` sequences, one per view, in as few chunks as :data:`LOGIT_BUDGET` allows
    (both views' ``[n, T, V]`` fp32 logits, ``8 n T V`` bytes, where T is the completion + 1 for a forward that takes
    ``logits_to_keep`` (:func:`keeps_logits`: transformers' causal LMs), else the whole sequence: one sequence per
    chunk at 1,000 tokens x 152k vocabulary, 1.2 GB), plus one module's other weights at a time and float64 scratch
    for :data:`POSITION_CHUNK` positions. Attention runs as :func:`fp32_attention` says."""

    def __init__(self, every: int, seqs: int = DEFAULT_SEQS):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"policy metrics every must be a positive int (steps), got {every!r}")
        if isinstance(seqs, bool) or not isinstance(seqs, int) or seqs < 1:
            raise ValueError(f"policy metrics seqs must be a positive int, got {seqs!r}")
        self.every, self.seqs = every, seqs
        self.pending: Optional[torch.Tensor] = None  # rows measured since the last log
        self.measured_step: Optional[int] = None

    def due(self, step: int) -> bool:
        """True once per optimizer step ``step`` (the steps taken so far) that is a multiple of ``every``."""
        return step % self.every == 0 and self.measured_step != step

    @torch.no_grad()
    def measure(self, model: torch.nn.Module, step: int, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                completion_ids: torch.Tensor, completion_mask: torch.Tensor, *,
                served: Callable[[torch.nn.Parameter], Optional[torch.Tensor]],
                master: Callable[[torch.nn.Parameter], Optional[torch.Tensor]], temperature: float = 1.0,
                mask_positions: bool = False, collective: bool = False, count_mask: Optional[torch.Tensor] = None,
                swap: Optional[Callable] = None) -> None:
        """Score the first ``seqs`` sequences under both views and keep their rows for the next :meth:`take`
        (``mask_positions``: position ids from the attention mask, for trainers that score left-padded sequences so).

        ``completion_mask`` is the completion's attention mask; ``count_mask`` (default: the same) selects the tokens
        that count (e.g. not a tool's output). ``swap(model, view)`` is the context that makes a forward read
        ``view`` (default :func:`weights_swapped`; a sharded model gives its own, with views of its own kind).

        ``collective``: the forwards communicate (a view that assembles a sharded master, ZeRO-3's or FSDP's gathers
        in the module hooks), so every rank must run as many as the others: the chunking follows each rank's own
        sequence count and length, so the ranks agree on the most any of them needs (an all-reduce) and a rank with
        fewer runs the extra ones on its first chunk again, its rows discarded."""
        swap = weights_swapped if swap is None else swap
        count_mask = completion_mask if count_mask is None else count_mask
        self.measured_step = step
        rows = []
        device_type = completion_ids.device.type
        count, length = min(self.seqs, completion_ids.shape[0]), completion_ids.shape[1]
        keep = keeps_logits(model)
        positions = length + 1 if keep else prompt_ids.shape[1] + length
        chunk = chunk_size(count, positions, getattr(getattr(model, "config", None), "vocab_size", None))
        with eval_mode(model), torch.autocast(device_type=device_type, enabled=False), fp32_attention(model):
            for i, j, counted in chunk_slices(count, chunk, collective=collective):
                ids = torch.cat([prompt_ids[i:j], completion_ids[i:j]], dim=1)
                att = torch.cat([prompt_mask[i:j], completion_mask[i:j]], dim=1)
                with swap(model, served):
                    s = _completion_logits(model, ids, att, length, mask_positions, keep)
                with swap(model, master):
                    m = _completion_logits(model, ids, att, length, mask_positions, keep)
                if counted:  # the tokens and masks where the logits are (the forward's compute device; no host
                    # sync to an accelerator, a blocking copy to the CPU, which reads it at once)
                    to = dict(device=s.device, non_blocking=s.device.type != "cpu")
                    tokens, counts = completion_ids[i:j].to(**to), count_mask[i:j].to(**to)
                    rows.append(sequence_stats(s, m, tokens, counts, temperature))
                del s, m
        new = torch.cat(rows).cpu() if rows else torch.zeros(0, len(COLUMNS), dtype=torch.float64)
        self.pending = new if self.pending is None else torch.cat([self.pending, new])

    def take(self) -> torch.Tensor:
        """This rank's rows since the last call (``[n, 3]`` float64 on the CPU; empty when nothing was measured)."""
        rows = self.pending if self.pending is not None else torch.zeros(0, len(COLUMNS), dtype=torch.float64)
        self.pending = None
        return rows


def chunk_size(count: int, length: int, vocab: Optional[int], budget: Optional[int] = None) -> int:
    """Sequences per forward of the probe: as many of ``count`` sequences, each with logits at ``length`` positions, as
    fit both views' fp32 logits (``8 * length * vocab`` bytes a sequence) in ``budget`` (default
    :data:`LOGIT_BUDGET`), at least one;
    all ``count`` (at least one) when the vocabulary size is not known."""
    if not vocab:
        return max(1, count)
    budget = LOGIT_BUDGET if budget is None else budget
    return max(1, min(count, budget // (8 * length * int(vocab))))


def chunk_slices(count: int, chunk: int, *, collective: bool = False, device=None) -> List[Tuple[int, int, bool]]:
    """``(i, j, counted)`` for each forward of the probe: sequences ``[i, j)`` of this rank's ``count``, ``chunk`` at a
    time. ``collective``: the forwards communicate, so every rank runs as many as the rank that needs the most (an
    all-reduce MAX over the default group, on ``device``: default CUDA under NCCL, else the CPU); the extra ones
    repeat the first chunk with ``counted`` False (their rows are discarded)."""
    forwards = -(-count // chunk)
    if collective:
        forwards = _most_over_ranks(forwards, device)
    out = []
    for n in range(forwards):
        counted = n * chunk < count
        i = n * chunk if counted else 0
        out.append((i, min(count, i + chunk), counted))
    return out


def _collective_device():
    """Where the default group's collectives run: the CPU when the group has a CPU backend (``gloo``; verl's
    ``cpu:gloo,cuda:nccl``), else the current CUDA device (``nccl``, or only ``cuda:nccl``)."""
    import torch.distributed as dist

    backend = str(dist.get_backend())
    if ":" in backend:  # a device -> backend map
        on_cpu = any(part.split(":")[0].strip() == "cpu" for part in backend.split(","))
    else:
        on_cpu = backend != "nccl"
    return torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())


def _most_over_ranks(n: int, device=None) -> int:
    """The largest ``n`` over the ranks (a collective when torch.distributed is initialised: every rank calls it), on
    ``device`` (default :func:`_collective_device`)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return n
    most = torch.tensor([n], dtype=torch.int64, device=device if device is not None else _collective_device())
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def refuse_policy_metrics(caster, where: str) -> None:
    """Refuse ``policy_metrics_every`` where no adapter measures it (it would be silently absent): a cast-site patch
    given a caster whose adapter did not set ``caster.policy_measured``."""
    config = caster.config
    if getattr(config, "measures_policy", False) and not getattr(caster, "policy_measured", False):
        from .patching import FairCastPatchError

        raise FairCastPatchError(
            f"faircast policy_metrics_every={config.policy_metrics_every} is not measured by {where} on its own: "
            f"the faircast/policy_* metrics need the batch, which the stack adapters hand to the probe (TRL's "
            f"GRPOTrainer/RLOOTrainer: faircast_policy_metrics_every; verl's FSDP and Megatron engines: "
            f"actor_rollout_ref.faircast.policy_metrics_every; OpenRLHF: --faircast.policy_metrics_every; your own "
            f"Megatron loop: apply_megatron_patch(..., measure_policy=True)). Use one of those, or remove the option "
            f"here; faircast audit's faircast/lag_steps measures the lag in weight space on every stack."
        )


def gather_rows(rows: torch.Tensor, device=None, group=None) -> torch.Tensor:
    """Every rank's rows (a collective when torch.distributed is initialised: every rank calls it); ``group``: the
    ranks of that process group only (e.g. Megatron's data-parallel group, whose tensor-parallel peers hold the same
    rows)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return rows
    dev = torch.device(device) if device is not None else _collective_device()
    count = torch.tensor([rows.shape[0]], device=dev)
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, count, group=group)
    most = int(max(int(c) for c in counts))
    padded = torch.zeros(most, len(COLUMNS), dtype=torch.float64, device=dev)
    padded[: rows.shape[0]] = rows.to(dev)
    out = [torch.zeros_like(padded) for _ in counts]
    dist.all_gather(out, padded, group=group)
    return torch.cat([o[: int(c)] for o, c in zip(out, counts)]).cpu()


def metrics_of(rows: torch.Tensor) -> Dict[str, float]:
    """:func:`summarize`, NaN-safe: a non-finite row (a NaN logit) is dropped and counted in the log."""
    finite = torch.isfinite(rows).all(dim=1) if rows.numel() else torch.ones(0, dtype=torch.bool)
    out = summarize(rows[finite])
    dropped = int((~finite).sum())
    if dropped:
        out["faircast/policy_nonfinite_seqs"] = float(dropped)
    return out


__all__ = ["DEFAULT_SEQS", "KEYS", "PolicyLagProbe", "chunk_size", "chunk_slices", "eval_mode", "gather_rows",
           "hooks_detached", "keeps_logits", "metrics_of", "refuse_policy_metrics", "fp32_attention", "sequence_stats",
           "served_weight", "summarize", "swap_hooks", "vocab_parallel_sequence_stats", "weights_swapped", "widened"]
