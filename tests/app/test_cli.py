"""`inharness` is built from one table of subcommands: every row parses, shows its help and reaches
its own handler, and bad numbers are refused by the parser with the flag's name."""

import pytest

from inharness import cli


def leaves() -> list[tuple[list[str], cli.Command]]:
    rows: list[tuple[list[str], cli.Command]] = []
    for entry in cli.COMMANDS:
        if isinstance(entry, cli.Group):
            rows += [([entry.name, c.name], c) for c in entry.commands]
        else:
            rows.append(([entry.name], entry))
    return rows


@pytest.mark.parametrize("path,command", leaves(), ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_every_subcommand_shows_its_help(
    path: list[str], command: cli.Command, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main([*path, "--help"])
    assert exited.value.code == 0
    assert f"inharness {' '.join(path)}" in capsys.readouterr().out


def test_each_row_dispatches_to_its_own_handler() -> None:
    required = {
        ("model", "init-tiny"): ["d"],
        ("engine",): ["--model", "m"],
        ("operator", "render"): ["f.yaml"],
        ("run",): ["f.yaml"],
        ("sft",): ["--from", "r", "--model", "m", "--out", "o"],
        ("train",): ["--config", "c", "--out", "o"],
    }
    for path, command in leaves():
        args = cli.parser().parse_args([*path, *required.get(tuple(path), [])])
        assert args.handler is command.run, path


def test_numbers_out_of_range_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, flag in (
        (["engine", "--model", "m", "--threads", "0"], "--threads: must be at least 1"),
        (
            ["run", "f.yaml", "--max-consecutive-failures", "-1"],
            "--max-consecutive-failures: must be at least 0",
        ),
    ):
        with pytest.raises(SystemExit) as exited:
            cli.main(argv)
        assert exited.value.code == 2 and flag in capsys.readouterr().err
