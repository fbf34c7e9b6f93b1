"""The ``fedweigh`` command: one-line errors (``--debug`` for the traceback), ``--version``."""

from __future__ import annotations

import pytest

from fedweigh import __version__
from fedweigh.checks import ConfigError
from fedweigh.cli import main


def _error_lines(capsys) -> list[str]:
    captured = capsys.readouterr()
    return [line for line in (captured.out + captured.err).splitlines() if line.strip()]


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"fedweigh {__version__}"


def test_bench_misspelt_method_option_is_one_line(tmp_path, capsys):
    rc = main(["bench", "--methods", "feddraw:beta_mx=2.0", "--out", str(tmp_path / "b")])
    assert rc == 2
    lines = _error_lines(capsys)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: method 'feddraw'")
    assert "beta_mx" in lines[0] and "beta_max" in lines[0]
    assert not (tmp_path / "b").exists()


def test_bench_dataset_without_path_is_one_line(tmp_path, capsys):
    rc = main(["bench", "--dataset", "chestmnist", "--out", str(tmp_path / "b")])
    assert rc == 2
    lines = _error_lines(capsys)
    assert len(lines) == 1, lines
    assert "--data = None" in lines[0] and "'chestmnist' needs the path" in lines[0]


def test_bench_missing_data_path_is_one_line(tmp_path, capsys):
    rc = main(
        ["bench", "--dataset", "chestmnist", "--data", str(tmp_path / "no.npz"), "--out", str(tmp_path)]
    )
    assert rc == 2
    lines = _error_lines(capsys)
    assert len(lines) == 1 and "no such file or folder" in lines[0], lines


def test_unknown_job_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
    rc = main(["jobs", "export", "--out", str(tmp_path), "no_such_job"])
    assert rc == 2
    lines = _error_lines(capsys)
    assert lines[0].startswith("error: unknown job(s) ['no_such_job']")
    assert lines[1] == "(run with --debug for the traceback)"
    assert len(lines) == 2
    with pytest.raises(KeyError):
        main(["--debug", "jobs", "export", "--out", str(tmp_path), "no_such_job"])


def test_config_error_reaches_the_cli_as_one_line(monkeypatch, capsys):
    import fedweigh.cli as cli

    def broken(args):
        raise ConfigError("site data config /x/fedweigh_site.json", "size", "64", "must be an integer >= 8")

    monkeypatch.setattr(cli, "cmd_scenarios", broken)
    assert main(["scenarios"]) == 2
    lines = _error_lines(capsys)
    assert lines[0] == (
        "error: site data config /x/fedweigh_site.json: size = '64' (str) is not allowed; "
        "must be an integer >= 8"
    )
