"""The command line behaves like the tools users know: --version, JSON-only --json, help without the framework,
usage errors on stderr with one prefix and exit 2, one name per concept (old names still work, with a note)."""
import json
import sys

import pytest

from faircast_plugins import __version__, cli
from faircast_plugins.patching import DOCTOR_ENV


@pytest.fixture(autouse=True)
def _no_doctor_env_left_behind(monkeypatch):
    """`faircast doctor` marks its own process as a self-check run (DOCTOR_ENV): restore the environment after each
    in-process CLI call, or later tests of the version gate would see newer releases allowed."""
    monkeypatch.delenv(DOCTOR_ENV, raising=False)


def test_version_flag(capsys):
    for flag in ("--version", "-V"):
        with pytest.raises(SystemExit) as exc:
            cli.main([flag])
        assert exc.value.code == 0
        assert capsys.readouterr().out.strip() == f"faircast-plugins {__version__}"


def test_json_output_is_json_only(capsys):
    assert cli.main(["estimate", "--json", "--max-elements", "20000"]) == 0
    out = capsys.readouterr()
    res = json.loads(out.out)  # the whole of stdout
    assert res["elements"] == 20000 and "nearest" in res
    assert "faircast estimate: one step" in out.err  # the banner went to stderr


@pytest.mark.parametrize("argv,message", [
    (["estimate", "--checkpoint", "/nonexistent/model"], "is not a directory"),
    (["audit", "--checkpoint", "/nonexistent/model"], "is not a directory"),
    (["doctor", "bogus"], "unknown framework(s) bogus"),
    (["ab", "--seeds", "x"], "--seeds takes comma-separated integers"),
    (["ab-stats", "--run", "foo", "--metric", "m"], "--run takes ARM:SEED:FILE"),
    (["bench", "--numel", "0"], "must be positive"),
    (["export", "--checkpoint", "/nonexistent", "--out", "/tmp/x-faircast-never"], ""),
])
def test_usage_errors_exit_2_on_stderr_with_one_prefix(argv, message, capsys):
    try:
        code = cli.main(argv)  # export/verify return 2 themselves
    except SystemExit as exc:  # argparse's errors, and the subcommands' refusals (UsageExit)
        code = exc.code
    out = capsys.readouterr()
    command = cli.DEPRECATED.get(argv[0], argv[0])
    errors = [ln for ln in out.err.splitlines() if "error:" in ln]
    assert code == 2 and out.out == "", (code, out)
    assert errors and errors[-1].startswith(f"faircast {command}: error: ") and message in errors[-1], out.err


def test_argparse_usage_errors_follow_the_same_rule(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["export", "--checkpoint", "c"])  # --out missing
    out = capsys.readouterr()
    assert exc.value.code == 2 and out.out == "" and "faircast export: error: " in out.err


def test_the_checkpoint_check_and_the_training_audit_have_one_name_each(capsys):
    """`faircast estimate` is the checkpoint check; "audit" names the training metrics only. The old command name
    still runs, with a note that says the new one."""
    assert cli.main(["audit", "--json", "--max-elements", "20000"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["elements"] == 20000
    assert "now `faircast estimate`" in out.err
    assert "estimate" in cli.build_parser([]).format_help()
    assert "audit" not in cli.SUBCOMMANDS


def test_export_weight_version_and_its_old_spelling():
    for flag in ("--weight-version", "--version"):
        args = cli.build_parser(["export"]).parse_args(["export", "--checkpoint", "c", "--out", "o", flag, "7"])
        assert args.version == 7


@pytest.mark.parametrize("entry", ["faircast-trl", "verl", "openrlhf"])
def test_every_entry_point_helps_without_its_framework(entry, monkeypatch, capsys):
    """--help without the framework says what the command is and what to install (exit 0); a run says it in one
    line on stderr (exit 1), not with a traceback."""
    package = {"faircast-trl": "trl"}.get(entry, entry)
    monkeypatch.setitem(sys.modules, package, None)  # not importable, whether or not this virtualenv has it

    def run(argv):
        if entry == "faircast-trl":
            return cli.trl_main(argv)
        monkeypatch.setattr(sys, "argv", ["prog", *argv])
        if entry == "verl":
            from faircast_plugins.verl.main_ppo import main
        else:
            from faircast_plugins.openrlhf.train_ppo_ray import main
        return main()

    with pytest.raises(SystemExit) as exc:
        run(["--help"])
    out = capsys.readouterr()
    assert exc.value.code == 0 and "usage:" in out.out and f"pip install '{package}>=" in out.out
    with pytest.raises(SystemExit) as exc:
        run(["grpo"] if entry == "faircast-trl" else ["trainer.n_gpus_per_node=1"])
    out = capsys.readouterr()
    assert exc.value.code == 1 and out.out == "" and len(out.err.strip().splitlines()) == 1
    assert ": error: it needs " + package in out.err


def test_trl_entry_point_states_the_supported_range_of_the_adapter():
    import ast
    import pathlib

    from faircast_plugins import entry_points

    source = pathlib.Path(entry_points.__file__).parent / "trl" / "patches.py"  # not imported: it patches TRL
    tree = ast.parse(source.read_text())
    supported = next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
                     and any(getattr(t, "id", None) == "SUPPORTED" for t in node.targets))
    assert entry_points.TRL_SPECIFIER == supported
