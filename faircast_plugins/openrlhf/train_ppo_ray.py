"""``python -m faircast_plugins.openrlhf.train_ppo_ray --faircast <every openrlhf.cli.train_ppo_ray argument>``

The same run as ``python -m openrlhf.cli.train_ppo_ray`` plus Fair Cast on the policy:

    --faircast                   turn Fair Cast on (alias --faircast.enable)
    --faircast.mode MODE         stochastic (default), sticky, error_feedback or nearest
    --faircast.seed N            run seed keying the rounding noise (default 0)
    --faircast.ema_decay B       serve fair_cast(EMA of the fp32 master), decay B in [0, 1); 0 = off (default)
    --faircast.audit             log faircast/* lag metrics (also without --faircast: measures the baseline)
    --faircast.policy_metrics_every N   every N optimizer steps, faircast/policy_* (KL, ESS/n served vs master)
    --faircast.policy_metrics_seqs K    sequences per rank those score (default 2)

OpenRLHF builds its parser inline under ``if __name__ == "__main__":``, so the flags are added to it
when it parses (a one-shot wrap of ``ArgumentParser.parse_args``) and the module is then run as
``__main__``. The flags land in ``args.faircast`` after OpenRLHF's ``hierarchize`` and reach every actor
through ``strategy.args``.
"""
from __future__ import annotations

import argparse
import runpy
import sys
from typing import List, Optional

from ..config import FairCastConfig
from ..patching import PatchSet
from .policy import OPENRLHF_SPECIFIER, patch_policy_actor, refused_option

TARGET_MODULE = "openrlhf.cli.train_ppo_ray"


def add_faircast_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``--faircast*`` flags (dotted dests, as OpenRLHF's ``hierarchize`` expects)."""
    group = parser.add_argument_group("Fair Cast (faircast-plugins)")
    group.add_argument("--faircast", "--faircast.enable", dest="faircast.enable", action="store_true", default=False,
                       help="unbiased fp32->bf16 copy of the policy (stochastic rounding per ROUNDING.md)")
    group.add_argument("--faircast.mode", dest="faircast.mode", default="stochastic",
                       help="stochastic (default), sticky, error_feedback or nearest")
    group.add_argument("--faircast.seed", dest="faircast.seed", default=0, help="unsigned 64-bit seed of the rounding noise")
    group.add_argument("--faircast.ema_decay", dest="faircast.ema_decay", default=0.0,
                       help="serve the cast of an EMA of the fp32 master with this decay in [0, 1) (default 0: off); "
                            "the optimizer still trains the master")
    group.add_argument("--faircast.audit", dest="faircast.audit", action="store_true", default=False,
                       help="log faircast/* metrics (lag of the served copy behind the fp32 master)")
    group.add_argument("--faircast.policy_metrics_every", dest="faircast.policy_metrics_every", default=0,
                       help="every N optimizer steps, log faircast/policy_* (per-token KL and effective sample "
                            "fraction between the served copy and the fp32 master on a few sequences of the batch); "
                            "0 = off (default). Works without --faircast too")
    group.add_argument("--faircast.policy_metrics_seqs", dest="faircast.policy_metrics_seqs", default=2,
                       help="sequences per rank the faircast/policy_* metrics score (default 2)")


def config_from_namespace(ns: argparse.Namespace) -> FairCastConfig:
    """Validate the parsed flags (raises ValueError with the offending flag's name)."""
    return FairCastConfig.from_value({
        "enable": getattr(ns, "faircast.enable"),
        "mode": getattr(ns, "faircast.mode"),
        "seed": getattr(ns, "faircast.seed"),
        "ema_decay": getattr(ns, "faircast.ema_decay"),
        "audit": getattr(ns, "faircast.audit"),
        "policy_metrics_every": getattr(ns, "faircast.policy_metrics_every"),
        "policy_metrics_seqs": getattr(ns, "faircast.policy_metrics_seqs"),
    })


def _normalize(ns: argparse.Namespace, config: FairCastConfig) -> None:
    """Store the validated, typed values, so every actor reads the same config."""
    for field, value in (("enable", config.enabled), ("mode", config.mode), ("seed", config.seed),
                         ("ema_decay", config.ema_decay), ("audit", config.audit),
                         ("policy_metrics_every", config.policy_metrics_every),
                         ("policy_metrics_seqs", config.policy_metrics_seqs)):
        setattr(ns, f"faircast.{field}", value)


def _wrap_parse_args(original):
    state = {"done": False}

    def parse_args(self, args=None, namespace=None):
        if state["done"]:
            return original(self, args, namespace)
        state["done"] = True  # only OpenRLHF's parser, the first one to parse
        add_faircast_arguments(self)
        ns = original(self, args, namespace)
        try:
            config = config_from_namespace(ns)
            get = lambda dotted, default: getattr(ns, dotted, default)  # noqa: E731
            refusal = refused_option(get, config) if config.active else None
            if refusal:
                raise ValueError(refusal)
        except ValueError as exc:
            self.error(str(exc))
        _normalize(ns, config)
        if config.active:
            patch_policy_actor()
        return ns

    return parse_args


def main(argv: Optional[List[str]] = None) -> None:
    """Run OpenRLHF's PPO/GRPO Ray trainer with the ``--faircast`` flags added."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    from ..entry_points import explain_if_missing

    explain_if_missing("python -m faircast_plugins.openrlhf.train_ppo_ray", "openrlhf", OPENRLHF_SPECIFIER,
                       "OpenRLHF's `python -m openrlhf.cli.train_ppo_ray` with the --faircast flags added (same\n"
                       "arguments); --faircast turns Fair Cast on, --faircast.audit logs the faircast/* metrics.",
                       sys.argv[1:])
    cli = PatchSet("OpenRLHF", "openrlhf", OPENRLHF_SPECIFIER).wrap("argparse:ArgumentParser.parse_args", _wrap_parse_args)
    cli.apply(details="--faircast flags added to openrlhf.cli.train_ppo_ray")
    try:
        runpy.run_module(TARGET_MODULE, run_name="__main__", alter_sys=True)
    finally:
        cli.remove()


if __name__ == "__main__":
    main()
