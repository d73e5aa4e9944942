"""The ``faircast`` console command.

Each subcommand ``NAME`` lives in a module that defines ``add_NAME_arguments(parser)`` and
``run_NAME(args) -> int``; this file only wires them up, importing a module when its subcommand runs.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help), in a user's order: do I have the problem, checkpoints, my stack, benchmarks
SUBCOMMANDS = {
    "estimate": ("faircast_plugins.audit_cli", "from a checkpoint: how much of one optimizer step round-to-nearest "
                                                "loses in the bf16 copy, against stochastic rounding (seconds, no GPU)"),
    "export": ("faircast_plugins.export", "write the served bf16 copy of an fp32 checkpoint at a weight version"),
    "verify": ("faircast_plugins.export", "re-derive a served-copy export and compare it bit for bit"),
    "doctor": ("faircast_plugins.doctor", "check on this stack (seconds) that Fair Cast's patches still take effect"),
    "selftest": ("faircast_plugins.selftest", "check the cast kernels installed here against the contract's golden "
                                              "vectors, per backend"),
    "bench": ("faircast_plugins.bench", "throughput of fair_cast against .to(torch.bfloat16), side by side"),
    "ab": ("faircast_plugins.ab.cli", "paired A/B runs of GRPO (needs TRL and vLLM) that differ only in the export"),
    "ab-stats": ("faircast_plugins.ab.cli", "the A/B's paired report from per-step metrics of runs you already made"),
}
# old name -> current name: still accepted, with a note on stderr
DEPRECATED = {"audit": "estimate"}  # "audit" now names only the live training metrics (faircast_audit: true)

EPILOG = """start here:
  faircast estimate --checkpoint MODEL_DIR --lr LR   do updates of size LR vanish in bf16? (no GPU)
  faircast doctor                                    do the patches work on the frameworks installed here?
  faircast export --checkpoint CKPT --out SERVED     the copy the rollout engine served: evaluate and ship it
Entry points per stack: faircast-trl (TRL's trl command), python -m faircast_plugins.verl.main_ppo (or verl's
plugin), python -m faircast_plugins.openrlhf.train_ppo_ray; the training metrics are turned on by the audit option
(faircast_audit: true). Exit codes: 0 ok, 1 a check failed, 2 a usage or input error."""


def _py(name: str) -> str:
    return name.replace("-", "_")


def _module(name: str):
    return importlib.import_module(SUBCOMMANDS[name][0])


def _version() -> str:
    from . import __version__

    return f"faircast-plugins {__version__}"


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="faircast", description="Fair Cast: unbiased fp32 -> bf16 export for RL trainers",
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-V", "--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    chosen = DEPRECATED.get(chosen, chosen)
    for name, (_, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           aliases=[old for old, new in DEPRECATED.items() if new == name])
        if name == chosen:  # import only the module that will run
            getattr(_module(name), f"add_{_py(name)}_arguments")(p)
    return parser


class UsageExit(SystemExit):
    """Exit status 2 (argparse's code for a usage error); ``str()`` is the message, already printed on stderr."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def usage_error(command: str, message: str) -> UsageExit:
    """One style for every subcommand: stderr, ``faircast <command>: error: ...``, exit 2."""
    prefix = f"faircast {command}: "
    message = message[len(prefix):] if message.startswith(prefix) else message
    message = message[len("error: "):] if message.startswith("error: ") else message
    print(f"{prefix}error: {message}", file=sys.stderr)
    return UsageExit(message)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    command = DEPRECATED.get(args.command, args.command)
    if command != args.command:
        print(f"faircast {args.command}: deprecated name, now `faircast {command}` (\"audit\" names the training "
              f"metrics only)", file=sys.stderr)
    try:
        return int(getattr(_module(command), f"run_{_py(command)}")(args) or 0)
    except SystemExit as exc:  # a subcommand's refusal of its input: SystemExit("faircast <cmd>: ...")
        if isinstance(exc.code, str):
            raise usage_error(command, exc.code) from None
        raise


def trl_main(argv: list[str] | None = None) -> int:
    """The ``faircast-trl`` console script: says what to install when TRL is missing (``faircast_plugins.trl``
    patches TRL on import, so its CLI module cannot be imported without it), else TRL's ``trl`` command."""
    from .entry_points import TRL_ABOUT, TRL_SPECIFIER, explain_if_missing

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["hook"]:
        explain_if_missing("faircast-trl", "trl", TRL_SPECIFIER, TRL_ABOUT, argv)
    from .trl.cli import main as trl_cli_main

    return trl_cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
