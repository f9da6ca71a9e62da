"""The command line reads as a manual: every option says what it does, in plain text."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from tailserve import __version__
from tailserve.cli import build_parser, main
from tailserve.settings import LOG_LEVELS

# reST that reads as noise in a terminal: ``literal``, :role:`target`, .. directive::
MARKUP = re.compile(r"``|:[a-z]+:`|^\s*\.\. \w+::", re.MULTILINE)


def commands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    # argparse has no public way to walk its subcommands; its _actions is the usual one.
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from commands(sub)


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        action
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction | argparse._HelpAction)
    ]


COMMANDS = dict(commands(build_parser()))


def test_every_command_is_walked() -> None:
    expected = {"serve", "examples", "bench", "route", "up", "precompute", "warm"}
    # (At least these: a new command is walked, and held to the same rules, as it comes.)
    assert set(COMMANDS) >= {"tailserve"} | {f"tailserve {name}" for name in expected}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_says_what_it_does(name: str) -> None:
    parser = COMMANDS[name]
    silent = [action.dest for action in options(parser) if not (action.help or "").strip()]
    assert silent == [], f"{name}: options with no help"


@pytest.mark.parametrize("name", COMMANDS)
def test_help_is_plain_text(name: str) -> None:
    parser = COMMANDS[name]
    texts = [parser.description, parser.epilog, *(action.help for action in parser._actions)]
    texts += [
        choice.help
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for choice in action._choices_actions
    ]
    marked = [text for text in texts if text and MARKUP.search(text)]
    assert marked == [], f"{name}: reST markup in its help"
    # The rendered help as well: a %-format in a help string would break it.
    assert not MARKUP.search(parser.format_help())


def test_serve_up_and_route_take_the_same_log_levels() -> None:
    for name in ("serve", "up", "route"):
        (level,) = [a for a in options(COMMANDS[f"tailserve {name}"]) if a.dest == "log_level"]
        assert tuple(level.choices or ()) == LOG_LEVELS, name


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out == f"tailserve {__version__}\n"
