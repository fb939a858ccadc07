"""Run metrics round-trip through the run directory; summaries and the report PNG."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.run.metrics import MetricsWriter, read_records, summarize
from trainer.run.report import write_report


def _fake_run(writer: MetricsWriter) -> None:
    """Attempt 0 at 2 workers reaches step 7, a node dies, attempt 1 restores step 5 at 1
    worker (steps 6 and 7 are redone) and finishes at step 10."""
    t = 1000.0
    writer.add({"kind": "start", "attempt": 0, "step": 0, "world_size": 2, "time": t})
    for step in range(1, 8):
        writer.add({"kind": "step", "attempt": 0, "step": step, "loss": 5.0 - 0.1 * step,
                    "val_loss": 4.9 if step == 5 else None, "lr": 1e-3, "tokens_per_s": 100.0,
                    "world_size": 2, "peak_rss_mb": 1.0, "time": t + step})
    writer.add({"kind": "start", "attempt": 1, "step": 5, "world_size": 1, "time": t + 20})
    for step in range(6, 11):
        writer.add({"kind": "step", "attempt": 1, "step": step, "loss": 5.0 - 0.1 * step,
                    "val_loss": 4.5 if step == 10 else None, "lr": 1e-3, "tokens_per_s": 50.0,
                    "world_size": 1, "peak_rss_mb": 1.0, "time": t + 20 + step})
    writer.flush()


def test_summary_counts_restarts_and_redone_steps(tmp_path: Path) -> None:
    _fake_run(MetricsWriter(str(tmp_path), flush_every=3))
    records = read_records(str(tmp_path))
    assert len(list((tmp_path / "metrics").glob("part-*.jsonl"))) > 1  # several objects
    summary = summarize(records)
    assert summary.steps == 10
    assert summary.restarts == 1
    assert summary.steps_redone == 2
    assert summary.world_sizes == [2, 1]
    assert summary.final_loss == pytest.approx(4.0)
    assert summary.final_val_loss == pytest.approx(4.5)


def test_summary_counts_in_process_recoveries(tmp_path: Path) -> None:
    writer = MetricsWriter(str(tmp_path))
    t = 1000.0
    writer.add({"kind": "start", "attempt": 0, "step": 0, "world_size": 3, "time": t})
    for step in range(1, 21):
        writer.add({"kind": "step", "attempt": 0, "step": step, "loss": 3.0, "lr": 1e-3,
                    "tokens_per_s": 9.0, "world_size": 3 if step <= 8 else 2, "time": t + step})
        if step == 8:
            writer.add({"kind": "recovery", "attempt": 0, "reason": "failure", "step": 8,
                        "world_size": 2, "before": 3, "seconds": 0.5, "counted": False,
                        "time": t + step + 0.5})
        if step == 15:
            writer.add({"kind": "recovery", "attempt": 0, "reason": "join", "step": 15,
                        "world_size": 3, "before": 2, "seconds": 0.1, "counted": False,
                        "time": t + step + 0.5})
    writer.flush()
    summary = summarize(read_records(str(tmp_path)))
    assert summary.restarts == 0
    assert summary.steps_redone == 1  # the interrupted step
    assert summary.world_sizes == [3, 2, 3]
    assert (summary.recovered_in_process, summary.replacements_joined) == (1, 1)
    assert summary.recovery_s_max == pytest.approx(0.5)


def test_metrics_on_s3_and_report_png(s3_bucket: str, tmp_path: Path) -> None:
    run = f"s3://{s3_bucket}/runs/a"
    _fake_run(MetricsWriter(run))
    assert summarize(read_records(run)).steps_redone == 2
    png = tmp_path / "report.png"
    summary = write_report(run, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary.restarts == 1


def test_report_of_an_empty_run_names_it(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    with pytest.raises(FileNotFoundError, match="no metrics"):
        write_report(str(tmp_path / "run"), tmp_path / "r.png")
