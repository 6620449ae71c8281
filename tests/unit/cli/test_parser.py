"""The command line itself (issue 29, item 6): help on every option of every subcommand,
`--version`, shell completion."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from offsetflow import __version__
from offsetflow.cli.commands import build_parser, version

ROOT = Path(__file__).resolve().parents[3]


def parsers(p: argparse.ArgumentParser, path: str = "offsetflow"
            ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser of the tree, with the command line that reaches it."""
    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def test_every_option_of_every_subcommand_has_help() -> None:
    missing = []
    count = 0
    for path, p in parsers(build_parser()):
        for action in p._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            count += 1
            if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"options without help: {missing}"
    assert count > 40  # the walk reached the subcommands


def test_every_subcommand_has_help() -> None:
    for path, p in parsers(build_parser()):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {a.dest: a.help for a in action._choices_actions}
                assert set(helps) == set(action.choices), path
                assert all(helps.values()), f"{path}: {helps}"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"offsetflow {version()}"
    assert version() == __version__  # the installed distribution is this package


def env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("_ARGCOMPLETE", "COMP_"))},
            "PYTHONPATH": f"{ROOT / 'plugins'}{os.pathsep}{ROOT}"}


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_prints_a_script_for_the_shell(shell: str) -> None:
    r = subprocess.run([sys.executable, "-m", "offsetflow.cli", "completion", shell],
                       env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "offsetflow" in r.stdout and "_ARGCOMPLETE" in r.stdout


def test_completion_completes_subcommands_and_options(tmp_path: Path) -> None:
    """What the script asks the command for on Tab (argcomplete's protocol)."""
    def complete(line: str) -> list[str]:
        out = tmp_path / "out"
        r = subprocess.run(
            [sys.executable, "-m", "offsetflow.cli"], capture_output=True, text=True,
            timeout=60, env={**env(), "_ARGCOMPLETE": "1", "_ARGCOMPLETE_IFS": "\n",
                             "COMP_LINE": line, "COMP_POINT": str(len(line)),
                             "_ARGCOMPLETE_STDOUT_FILENAME": str(out)})
        assert r.returncode == 0, r.stderr
        return out.read_text().split("\n")

    assert complete("offsetflow val") == ["validate "]
    assert "--env-strict" in complete("offsetflow validate --")
    assert complete("offsetflow completion z") == ["zsh "]


def test_audit_flag_and_verbs_parse() -> None:
    """`--audit` reaches the window's conf; `audit show|publish|discard BATCH` parse."""
    from offsetflow.cli.commands import window_conf

    args = build_parser().parse_args(["replay", "-p", "orders", "--from-offset", "0",
                                      "--until-offset", "5", "--audit", "--local"])
    assert window_conf(args)["audit"] is True
    args = build_parser().parse_args(["replay", "-p", "orders", "--from-offset", "0",
                                      "--until-offset", "5"])
    assert "audit" not in window_conf(args)
    args = build_parser().parse_args(["audit", "publish", "42", "--reason", "fix"])
    assert (args.audit_cmd, args.audit_id, args.reason, args.by) == ("publish", 42, "fix", "cli")
    args = build_parser().parse_args(["audit", "show", "42", "--refresh", "--json"])
    assert args.refresh and args.json
