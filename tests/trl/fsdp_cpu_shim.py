"""CPU shim for TRL-on-FSDP2 tests (tests only): accelerate only turns a multi-process run into FSDP on accelerator
devices (``AcceleratorState.__init__`` checks ``MULTI_GPU``/...); on CPU it stays ``MULTI_CPU`` and drops the FSDP
plugin. :func:`install` finishes that branch for ``MULTI_CPU``: same plugin, same mixed-precision policy, FSDP
distributed type. Everything else is accelerate's own FSDP2 preparation."""
import accelerate.state
from accelerate.utils import DistributedType

_original_state_init = accelerate.state.AcceleratorState.__init__


def _state_init_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _original_state_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin
        accelerate.state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def install() -> None:
    """Patch ``AcceleratorState.__init__`` (idempotent); call before the trainer (and its accelerator) is built."""
    accelerate.state.AcceleratorState.__init__ = _state_init_fsdp_on_cpu
