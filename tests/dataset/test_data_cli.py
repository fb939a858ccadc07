"""`baton data prepare` and `baton data inspect`, locally and on S3 (moto server)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from trainer.cli import build_parser
from trainer.cli.data import register


def baton_data(argv: list[str]) -> int:
    """Run `baton data ...` through this package's own parser group."""
    parser = argparse.ArgumentParser(prog="baton")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["data", *argv])
    return int(args.func(args))


def test_the_baton_cli_routes_data_commands_here() -> None:
    args = build_parser().parse_args(["data", "inspect", "/somewhere"])
    assert args.func.__module__ == "trainer.cli.data"


def test_prepare_then_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "ds")
    assert baton_data(["prepare", "--out", out, "--seq-len", "64", "--max-bytes", "80000"]) == 0
    captured = capsys.readouterr()
    assert "prepare: tokenizing: 100%" in captured.err  # plain progress lines off a TTY
    assert f"prepared {out}" in captured.out and "sequences x 64" in captured.out

    assert baton_data(["inspect", out, "--verify", "--show", "1"]) == 0
    text = capsys.readouterr().out
    assert "checksums OK" in text and "--- train[0] ---" in text

    assert baton_data(["inspect", out, "--json", "--split", "val"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert list(summary["splits"]) == ["val"] and summary["seq_len"] == 64
    assert summary["splits"]["val"]["sequences"] > 0


def test_prepare_own_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "notes"
    src.mkdir()
    for i in range(4):
        (src / f"n{i}.txt").write_text(f"note {i}: " + "lorem ipsum " * 100)
    out = str(tmp_path / "ds")
    assert (
        baton_data(
            [
                "prepare",
                "--out",
                out,
                "--seq-len",
                "32",
                "--val-fraction",
                "0.25",
                "--quiet",
                str(src),
            ]
        )
        == 0
    )
    assert "from 4 files" in capsys.readouterr().out


def test_errors_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert baton_data(["inspect", str(tmp_path / "none")]) == 2
    assert "not a prepared dataset" in capsys.readouterr().err
    out = str(tmp_path / "ds")
    assert baton_data(["prepare", "--out", out, "--max-bytes", "30000", "--quiet"]) == 0
    assert baton_data(["prepare", "--out", out, "--max-bytes", "30000", "--quiet"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (
        baton_data(["prepare", "--out", out, "--max-bytes", "30000", "--quiet", "--overwrite"]) == 0
    )


def test_prepare_and_inspect_on_s3(s3_bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"s3://{s3_bucket}/cli"
    assert (
        baton_data(["prepare", "--out", uri, "--seq-len", "128", "--max-bytes", "40000", "--quiet"])
        == 0
    )
    assert baton_data(["inspect", uri, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "checksums OK" in out and "train:" in out and "val:" in out
