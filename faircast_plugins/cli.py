"""The ``faircast`` console command.

Each subcommand ``NAME`` lives in a module that defines ``add_NAME_arguments(parser)`` and
``run_NAME(args) -> int``; this file only wires them up, importing a module when its subcommand runs.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS = {
    "selftest": ("faircast_plugins.selftest", "check the installed engine against the golden vectors, per backend"),
    "bench": ("faircast_plugins.bench", "throughput of fair_cast against .to(torch.bfloat16), side by side"),
    "export": ("faircast_plugins.export", "write the served bf16 copy of an fp32 checkpoint at a weight version"),
    "verify": ("faircast_plugins.export", "re-derive a served-copy export and compare it bit for bit"),
    "doctor": ("faircast_plugins.doctor", "prove on this stack (seconds) that Fair Cast's patches still work"),
    "audit": ("faircast_plugins.audit_cli", "bias of one optimizer step from bf16 weights: nearest vs stochastic"),
    "ab": ("faircast_plugins.ab.cli", "paired A/B runs of GRPO (TRL + vLLM) that differ only in the export"),
    "ab-stats": ("faircast_plugins.ab.cli", "the A/B's paired report from per-step metrics of runs you already made"),
}


def _py(name: str) -> str:
    return name.replace("-", "_")


def _module(name: str):
    return importlib.import_module(SUBCOMMANDS[name][0])


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="faircast", description="Fair Cast: unbiased fp32 -> bf16 export for RL trainers")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (_, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # import only the module that will run
            getattr(_module(name), f"add_{_py(name)}_arguments")(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    return int(getattr(_module(args.command), f"run_{_py(args.command)}")(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
