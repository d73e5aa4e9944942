"""TEST-ONLY stand-in for the NCCL transport of TRL's vLLM server mode, so that a real ``vllm serve`` runs on CPU.

TRL 1.16 pushes weights to a vLLM server over vLLM's NCCL weight-transfer engine, which needs CUDA. These stand-ins
replace only the wire (NCCL -> gloo on CPU); everything around it is the real code:

* server side (imported in vLLM's worker process through ``--worker-extension-cls cpu_weight_transfer.ServerProbe``):
  :class:`GlooWeightTransferEngine` is vLLM's own ``NCCLWeightTransferEngine`` (layerwise reload in
  ``start_weight_update``/``finish_weight_update``, the packed receive of ``receive_weights``, the model's
  ``load_weights``) with its process group swapped for :class:`GlooBroadcastGroup`. It is registered in vLLM's
  ``WeightTransferEngineFactory`` as :data:`BACKEND`, so the server is started with
  ``--weight-transfer-config '{"backend": "faircast_test_gloo"}'`` instead of ``nccl``.
  :class:`ServerProbe` adds one worker method that writes the served weights to a file (read back through the
  dev-mode ``/collective_rpc`` endpoint) and reports the dtypes the engine was told to receive.
* trainer side (:func:`install_trainer_side`): in ``trl.generation.vllm_client``, ``open_trainer_endpoint`` opens
  a :class:`GlooBroadcastGroup` as rank 0 instead of a ``PyNcclCommunicator``, and ``packed_nccl_broadcast_producer``
  is vLLM's own producer run with CPU streams (:func:`cpu_streams`). ``VLLMClient.init_communicator`` is TRL's own
  method, called with ``device="cuda"`` (no index) in place of the trainer's CPU device: TRL uses the device only to
  refuse non-CUDA devices and, for an indexed device, ``torch.cuda.set_device``; with the endpoint replaced nothing
  touches CUDA. TRL's HTTP protocol (``/server_info``, ``/get_world_size``, ``/init_weight_transfer_engine``,
  ``/start_weight_update``, ``/update_weights`` with the announced ``dtype_names``, ``/finish_weight_update``) runs
  unchanged. AsyncGRPO's ``trl.experimental.async_grpo.weight_transfer`` gets the same two replacements (its
  ``WeightTransferClient`` has no device check).

vLLM's packed helpers double-buffer on CUDA streams and ask ``torch.accelerator`` for the device index;
:func:`cpu_streams` gives them synchronous no-op streams and index 0 while they run. Bytes move unchanged: gloo's
broadcast copies the packed uint8 buffer as is.
"""
from __future__ import annotations

import contextlib
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist

BACKEND = "faircast_test_gloo"
TIMEOUT = timedelta(seconds=180)


class GlooBroadcastGroup:
    """What vLLM's weight transfer uses of a ``PyNcclCommunicator`` (``broadcast(tensor, src)`` and ``.group``),
    over a gloo process group on CPU. The rendezvous is vLLM's ``StatelessProcessGroup`` (a TCPStore hosted by
    rank 0, the trainer), as for NCCL."""

    def __init__(self, host: str, port: int, rank: int, world_size: int):
        from vllm.distributed.utils import StatelessProcessGroup

        self.group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = TIMEOUT
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # trainer and server: one host
        store = dist.PrefixStore("faircast-test-gloo", self.group.store)
        self.gloo = dist.ProcessGroupGloo(store, rank, world_size, options)
        self.rank, self.world_size = rank, world_size

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"the gloo stand-in broadcasts contiguous CPU tensors, got {tensor.device} "
                             f"contiguous={tensor.is_contiguous()}")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.gloo.broadcast([tensor], opts).wait()


class _NoStream:
    """A CUDA stream stand-in for CPU: work is synchronous, so there is nothing to wait for."""

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def cpu_streams():
    """Run vLLM's packed broadcast helpers on CPU: synchronous no-op streams, accelerator index 0.

    (``torch.cuda.stream(obj)`` is already a no-op without CUDA; only the stream factory and the index lookup
    would raise.)"""
    from vllm.distributed.weight_transfer import packed_tensor

    streams = lambda device_idx, num_buffers: tuple(_NoStream() for _ in range(num_buffers))  # noqa: E731
    with mock.patch.object(packed_tensor, "_get_streams", streams), \
            mock.patch.object(torch.accelerator, "current_device_index", lambda: 0):
        yield


# --------------------------------------------------------------------------------------------------- server side


def _engine_class():
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    class GlooWeightTransferEngine(NCCLWeightTransferEngine):
        """vLLM's NCCL weight-transfer engine with the NCCL group replaced by :class:`GlooBroadcastGroup`."""

        #: dtype names announced by each ``update_weights`` call, as this engine received them (read by the probe)
        announced: list[list[str]] = []

        def init_transfer_engine(self, init_info) -> None:
            if init_info.master_address is None:
                raise ValueError("the gloo stand-in needs master_address/master_port (TCPStore rendezvous)")
            self.packed = init_info.packed
            self.packed_buffer_size_bytes = init_info.packed_buffer_size_bytes
            self.packed_num_buffers = init_info.packed_num_buffers
            parallel = self.parallel_config  # the worker's rank in the trainer+workers group, as vLLM computes it
            rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
            self.model_update_group = GlooBroadcastGroup(
                init_info.master_address, init_info.master_port, rank, init_info.world_size)

        def receive_weights(self, update_info) -> None:
            if not self.packed:
                raise RuntimeError("the gloo stand-in carries the packed protocol only (TRL sends packed=True)")
            type(self).announced.append(list(update_info.dtype_names))
            with cpu_streams():
                super().receive_weights(update_info)

    return GlooWeightTransferEngine


def register_backend() -> None:
    """Register :data:`BACKEND` in vLLM's worker-side factory (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, _engine_class())


class ServerProbe:
    """``--worker-extension-cls``: mixed into vLLM's worker class. Importing this module (which vLLM does before it
    builds the worker, and so before the weight-transfer engine is created) registers the gloo backend."""

    def faircast_test_dump_weights(self, path: str) -> dict:
        """Write every parameter of the served model to ``path`` (safetensors); return the dtype names announced by
        each weight update so far and the parameters' dtypes."""
        from safetensors.torch import save_file

        model = self.model_runner.get_model()
        tensors = {name: p.detach().to("cpu").contiguous().clone() for name, p in model.named_parameters()}
        save_file(tensors, path)
        engine = self.weight_transfer_engine
        return {
            "announced": list(getattr(type(engine), "announced", [])),
            "engine": type(engine).__name__,
            "param_dtypes": sorted({str(t.dtype) for t in tensors.values()}),
        }


register_backend()


# -------------------------------------------------------------------------------------------------- trainer side


def install_trainer_side(monkeypatch) -> None:
    """Replace the NCCL endpoint and broadcast with the gloo stand-in (see module doc) in TRL's ``VLLMClient``
    (GRPO/RLOO server mode) and in AsyncGRPO's ``WeightTransferClient``, which has no CUDA check of its own."""
    import trl.experimental.async_grpo.weight_transfer as async_weight_transfer
    import trl.generation.vllm_client as vllm_client
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

    def open_trainer_endpoint(init_info, rank: int = 0):
        return GlooBroadcastGroup(init_info["master_address"], init_info["master_port"], rank,
                                  init_info["world_size"])

    def producer(**kwargs):
        with cpu_streams():
            return packed_nccl_broadcast_producer(**kwargs)

    original_init = vllm_client.VLLMClient.init_communicator

    def init_communicator(self, device=0):
        return original_init(self, device="cuda")

    for module in (vllm_client, async_weight_transfer):
        assert module._HAS_STATEFUL_TRAINER_ENGINE, "the stand-in covers TRL's vLLM >= 0.28 path"
        monkeypatch.setattr(module, "open_trainer_endpoint", open_trainer_endpoint)
        monkeypatch.setattr(module, "packed_nccl_broadcast_producer", producer)
    monkeypatch.setattr(vllm_client.VLLMClient, "init_communicator", init_communicator)
