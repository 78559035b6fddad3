"""The command line as a new user meets it: ``--version``; an argument no option takes is refused by the
(sub)command it follows; a missing or unknown command is named COMMAND; ``data synth --seed`` is checked
as every seed is; the synth presets in its help are every preset there is."""

from __future__ import annotations

import pytest

from prvrlab import __version__
from prvrlab.data.synth import preset_names
from prvrlab.platform.cli import build_parser, main


def _refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    return capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"prvrlab {__version__}\n"


@pytest.mark.parametrize("argv, prog", [
    (["train", "--bogus", "x.yaml"], "prvrlab train"),
    (["train", "x.yaml", "extra"], "prvrlab train"),
    (["data", "synth", "--bogus"], "prvrlab data synth"),
    (["compare", "a", "b", "--nope", "1"], "prvrlab compare"),
])
def test_an_argument_no_option_takes_is_refused_by_its_command(argv, prog, capsys):
    extra = argv[argv.index("x.yaml") + 1:] if "extra" in argv else [a for a in argv if a.startswith("--") or a == "1"]
    assert _refused(argv, capsys) == f"{prog}: error: unrecognized arguments: {' '.join(extra)} (see {prog} --help)\n"


def test_a_missing_or_unknown_command_is_named_command(capsys):
    assert "the following arguments are required: COMMAND (see prvrlab data --help)" in _refused(["data"], capsys)
    assert "argument COMMAND: invalid choice: 'frob'" in _refused(["frob"], capsys)


def test_the_synth_seed_is_checked_as_every_seed(capsys):
    assert "prvrlab data synth: error: argument --seed: expected an integer in [0, 2**32), got '-1'" in _refused(
        ["data", "synth", "--seed", "-1"], capsys)


def test_the_synth_help_names_every_preset():
    synth = build_parser()._subparsers._group_actions[0].choices["data"]._subparsers._group_actions[0].choices["synth"]
    text = next(a.help for a in synth._actions if "--preset" in a.option_strings)
    for name in preset_names():
        base = name.removesuffix("-skewed")
        assert base in text and (name == base or "<name>-skewed" in text), name
