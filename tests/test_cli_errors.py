"""The ``fedweigh`` command: one-line errors (``--debug`` for the traceback), ``--version``."""

from __future__ import annotations

import pytest

from fedweigh import __version__
from fedweigh.cli import main
from fedweigh.errors import ConfigError


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
    assert "unknown option(s) beta_mx of scheme 'feddraw'; its options: beta_max," in lines[0]
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


def test_site_check_reports_a_bad_site_config_in_one_line(tmp_path, capsys):
    config = tmp_path / "fedweigh_site.json"
    config.write_text('{"dataset": "chestmnist", "data_path": "/data/c.npz", "size": "64"}')
    assert main(["site", "check", str(config)]) == 2
    lines = _error_lines(capsys)
    assert (
        lines[0]
        == f"error: site data config {config}: size = '64' (str) is not allowed; must be an integer >= 8"
    )


def test_site_check_finds_the_kit_config_and_loads_the_data(tmp_path, capsys):
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "fedweigh_site.json").write_text('{"dataset": "digits", "num_images": 100}')
    assert main(["site", "check", "--workspace", str(tmp_path), "--load", "--site-name", "hospital-a"]) == 0
    out = capsys.readouterr().out
    assert "fedweigh_site.json: valid (digits, 32 px)" in out
    assert "hospital-a: 90 training and 10 validation images" in out and "10 classes (multiclass)" in out


def test_site_check_without_a_config_says_where_it_looked(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FEDWEIGH_SITE_CONFIG", raising=False)
    assert main(["site", "check"]) == 2
    assert "no site data config" in _error_lines(capsys)[0]
