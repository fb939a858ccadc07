"""Training in sessions (issue 17, point 4): `baton fit --until / --time-limit / Ctrl-C`, the
continue command, `--reschedule`, the session log and the time budget.

The CLI runs in-process through `trainer.cli.main`; Ray's part (`trainer.on_ray.ray_fit.fit`) is
replaced by `tests/inprocess_fit.InProcessFit`, which runs the real worker loop, so what is
checked is the real snapshots, metrics and session log. The one end-to-end test through
Ray (SIGINT to a real `baton fit` process) is marked slow.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import threading
from pathlib import Path

import pytest
import torch
from inprocess_fit import InProcessFit, train_worker
from inprocess_fit import baton as _baton
from snapshot_compare import assert_same_state, final_state

from elastic.store.snapshot_store import SnapshotStore
from trainer.cli import main
from trainer.config import load_recipe
from trainer.run.metrics import read_records
from trainer.run.session_log import TimeBudget, parse_duration, read_sessions
from trainer.train.optim import lr_at

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny.toml")


def _sets(dataset: str, steps: int) -> list[str]:
    return ["--set", f'data.uri="{dataset}"', "--set", f"steps={steps}", "--set",
            "eval.every=0"]


def _continue_argv(text: str) -> list[str]:
    command = text.split("continue with: ", 1)[1].split(" ┏")[0].strip()
    argv = shlex.split(command)
    assert argv[:2] == ["baton", "fit"], command
    return argv[1:]


def _lrs(run: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_records(str(run)) if r["kind"] == "step"}


# --------------------------------------------------------------------------- sessions

@pytest.mark.slow  # ~1 min: a reference run, two sessions and a 2-process gloo group
def test_until_then_continue_on_another_world_size_equals_the_uninterrupted_run(
    capsys: pytest.CaptureFixture[str], fake_fit: InProcessFit, tmp_path: Path,
    tiny_dataset: str,
) -> None:
    """`--until 12` commits step 12 and exits 0 with the continue command; that command, run
    on 2 workers, ends where one uninterrupted single-worker run ends (P1, P2, P5), with the
    same learning rate at every step (the schedule is the recipe's, not the session's)."""
    steps = 24
    reference = tmp_path / "reference"
    cfg = load_recipe(TINY, [f'snapshots.run_uri="{reference}"', f'data.uri="{tiny_dataset}"',
                             f"steps={steps}", "eval.every=0"])
    train_worker(0, 1, cfg, None)

    run = tmp_path / "sessions"
    code, text = _baton(capsys, ["fit", TINY, "--run-dir", str(run), *_sets(tiny_dataset, steps),
                                 "--until", "12"])
    assert code == 0, text
    assert "stopped at step 12; continue with: baton fit" in text, text
    assert max(SnapshotStore(str(run)).committed_steps()) == 12
    argv = _continue_argv(text)
    assert "--until" not in argv and argv[argv.index("--run-dir") + 1] == str(run)

    fake_fit.world_size = 2
    code, text = _baton(capsys, argv)
    assert code == 0, text
    assert "continuing run" in text and "from committed step 12" in text, text
    assert "stopped at" not in text
    assert_same_state(final_state(reference, tmp_path, steps), final_state(run, tmp_path, steps))
    assert _lrs(run) == pytest.approx(_lrs(reference), rel=1e-12)
    outcomes = [(e["from_step"], e["outcome"], e["step"]) for e in read_sessions(
        SnapshotStore(str(run)))]
    assert outcomes == [(0, "stopped", 12), (12, "finished", steps)]


def test_reschedule_is_refused_without_the_flag_and_explained_with_it(
    capsys: pytest.CaptureFixture[str], fake_fit: InProcessFit, tmp_path: Path,
    tiny_dataset: str,
) -> None:
    run = tmp_path / "run"
    base = ["fit", TINY, "--run-dir", str(run), "--set", f'data.uri="{tiny_dataset}"',
            "--set", "eval.every=0"]
    code, text = _baton(capsys, [*base, "--set", "steps=8", "--until", "4"])
    assert code == 0, text

    for change, field, old in (("steps=12", "steps", "8"), ("optim.lr=0.001", "optim.lr", "0.003"),
                               ("optim.warmup_steps=2", "optim.warmup_steps", "4")):
        sets = ["--set", "steps=8", "--set", change] if field != "steps" else ["--set", change]
        assert main([*base, *sets]) == 2
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith(f"error: {field}:"), lines[0]
        assert f"{field} = {old}" in lines[0] and "--reschedule" in lines[0], lines[0]
    assert max(SnapshotStore(str(run)).committed_steps()) == 4  # nothing trained

    code, text = _baton(capsys, [*base, "--set", "steps=12", "--reschedule", "--until", "6"])
    assert code == 0, text
    assert "rescheduled: steps 8 -> 12" in text, text
    new = load_recipe(TINY, ["snapshots.run_uri=x", "steps=12"]).optim
    assert f"schedule from here: lr {lr_at(new, 12, 4):.3g} at step 5" in text, text
    assert "cosine decay to" in text and "at step 12" in text
    # Without the flag now: the session log holds the new schedule, so it simply continues.
    code, text = _baton(capsys, [*base, "--set", "steps=12"])
    assert code == 0, text
    lrs = _lrs(run)
    old = load_recipe(TINY, ["snapshots.run_uri=x", "steps=8"]).optim
    assert [lrs[s] for s in range(1, 5)] == pytest.approx([lr_at(old, 8, s - 1)
                                                           for s in range(1, 5)])
    assert [lrs[s] for s in range(5, 13)] == pytest.approx([lr_at(new, 12, s - 1)
                                                            for s in range(5, 13)])
    entries = read_sessions(SnapshotStore(str(run)))
    assert [(e["from_step"], e["schedule"]["steps"], e["rescheduled"], e["outcome"])
            for e in entries] == [(0, 8, False, "stopped"), (4, 12, True, "stopped"),
                                  (6, 12, False, "finished")]


def test_python_api_accepts_a_schedule_change_with_accept_schedule(
    capsys: pytest.CaptureFixture[str], fake_fit: InProcessFit, tmp_path: Path,
    tiny_dataset: str,
) -> None:
    from trainer.run.run_dir import RunDirError, check_run_dir
    from trainer.run.session_log import accept_schedule

    run = tmp_path / "run"
    assert _baton(capsys, ["fit", TINY, "--run-dir", str(run), *_sets(tiny_dataset, 8),
                           "--until", "4"])[0] == 0
    cfg = load_recipe(TINY, [f'snapshots.run_uri="{run}"', f'data.uri="{tiny_dataset}"',
                             "steps=12", "eval.every=0"])
    with pytest.raises(RunDirError, match="accept_schedule"):
        check_run_dir(cfg)
    # Not while a driver holds the run: its session entry is its own to close.
    from elastic.lease.run_lease import LeaseHeldError, RunLease

    store = SnapshotStore(str(run))
    before = read_sessions(store)
    driver = RunLease(store)
    driver.acquire()
    with pytest.raises(LeaseHeldError, match="held by another driver"):
        accept_schedule(cfg)
    assert read_sessions(store) == before
    driver.release()
    assert accept_schedule(cfg).startswith(f"lr {lr_at(cfg.optim, 12, 4):.3g} at step 5")
    assert check_run_dir(cfg) == 4


def test_the_schedule_in_a_snapshot_never_overrides_the_recipe() -> None:
    from trainer.train.optim import WarmupCosine

    cfg = load_recipe(TINY, ["snapshots.run_uri=x"]).optim
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([param], lr=cfg.lr)
    schedule = WarmupCosine(optimizer, cfg, total_steps=100)
    schedule.load_state_dict({"step": 50})
    assert schedule.total_steps == 100 and schedule.current_step == 50
    assert optimizer.param_groups[0]["lr"] == lr_at(cfg, 100, 50)


# --------------------------------------------------------------------------- stopping

def _signal_when_started(fake: InProcessFit, times: int) -> threading.Thread:
    def send() -> None:
        assert fake.started.wait(60)
        for _ in range(times):
            os.kill(os.getpid(), signal.SIGINT)
            threading.Event().wait(0.5)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_ctrl_c_stops_after_the_current_step_with_a_commit(
    capsys: pytest.CaptureFixture[str], fake_fit: InProcessFit, tmp_path: Path,
    tiny_dataset: str,
) -> None:
    run = tmp_path / "run"
    fake_fit.wait_for_stop, fake_fit.stop_step = True, 5
    handler_before = signal.getsignal(signal.SIGINT)  # an earlier test's Ray may have set one
    sender = _signal_when_started(fake_fit, 1)
    code, text = _baton(capsys, ["fit", TINY, "--run-dir", str(run), *_sets(tiny_dataset, 12)])
    sender.join()
    assert code == 0, text
    assert "stopping after the current step (Ctrl-C again to abort)" in text, text
    assert "stopped at step 5; continue with: baton fit" in text, text
    assert read_sessions(SnapshotStore(str(run)))[-1]["outcome"] == "stopped"
    assert signal.getsignal(signal.SIGINT) is handler_before  # put back


def test_second_ctrl_c_aborts_at_once_with_exit_130(
    capsys: pytest.CaptureFixture[str], fake_fit: InProcessFit, tmp_path: Path,
    tiny_dataset: str,
) -> None:
    run = tmp_path / "run"
    fake_fit.wait_for_stop, fake_fit.stop_step = True, 2
    release = threading.Event()

    def slow(*args: object, **kwargs: object) -> object:
        fake_fit.started.set()
        release.wait(30)  # still "training" when the second Ctrl-C comes
        return None

    import trainer.on_ray.ray_fit
    trainer.on_ray.ray_fit.fit = slow  # type: ignore[assignment]  # undone by the fixture
    sender = _signal_when_started(fake_fit, 2)
    code, text = _baton(capsys, ["fit", TINY, "--run-dir", str(run), *_sets(tiny_dataset, 12)])
    release.set()
    sender.join()
    assert code == 130, text
    assert "aborted" in text and "continue with: baton fit" in text, text
    assert read_sessions(SnapshotStore(str(run)))[-1]["outcome"] == "aborted"


def test_time_limit_asks_the_workers_to_stop(
    capsys: pytest.CaptureFixture[str], fake_fit: InProcessFit, tmp_path: Path,
    tiny_dataset: str,
) -> None:
    """A limit shorter than the reserve for the final commit stops at the first check."""
    run = tmp_path / "run"
    fake_fit.wait_for_stop, fake_fit.stop_step = True, 3
    code, text = _baton(capsys, ["fit", TINY, "--run-dir", str(run), *_sets(tiny_dataset, 12),
                                 "--time-limit", "5s"])
    assert code == 0, text
    assert "time limit: stopping after the current step" in text, text
    assert "stopped at step 3; continue with:" in text and "--time-limit" not in \
        text.split("continue with:")[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_on_a_real_baton_fit_commits_and_the_run_continues_exactly(
    capsys: pytest.CaptureFixture[str], fake_fit: InProcessFit, tmp_path: Path,
    tiny_dataset: str,
) -> None:
    """End to end through Ray: SIGINT to a `baton fit` process mid-run -> exit 0, the stop
    message, the step it names committed; continuing from it (here in-process) ends where an
    uninterrupted run ends."""
    import re
    import subprocess
    import sys

    steps, run = 40, tmp_path / "run"
    argv = ["fit", TINY, "--run-dir", str(run), *_sets(tiny_dataset, steps), "--pace", "0.3"]
    env = {**os.environ, "BATON_SKIP_CODE_CHECK": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "trainer.cli", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            lines.append(line)
            match = re.search(r"\bstep (\d+)/", line)
            if match and int(match.group(1)) >= 3:
                proc.send_signal(signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = " ".join(("".join(lines) + rest).split())
    assert proc.returncode == 0, text[-3000:]
    assert "stopping after the current step (Ctrl-C again to abort)" in text, text[-3000:]
    match = re.search(r"stopped at step (\d+); continue with: (baton fit .*?)(?: ┏|$)", text)
    assert match, text[-3000:]
    stopped = int(match.group(1))
    assert 3 <= stopped < steps
    assert max(SnapshotStore(str(run)).committed_steps()) == stopped
    assert read_sessions(SnapshotStore(str(run)))[-1]["outcome"] == "stopped"

    code, out = _baton(capsys, shlex.split(match.group(2))[1:])
    assert code == 0, out
    reference = tmp_path / "reference"
    cfg = load_recipe(TINY, [f'snapshots.run_uri="{reference}"', f'data.uri="{tiny_dataset}"',
                             f"steps={steps}", "eval.every=0"])
    train_worker(0, 1, cfg, None)
    assert_same_state(final_state(reference, tmp_path, steps), final_state(run, tmp_path, steps))


def test_time_budget_keeps_room_for_the_last_step_and_commit() -> None:
    now = {"mono": 0.0, "wall": 1000.0}
    budget = TimeBudget(100.0, margin_s=10.0, default_commit_s=5.0,
                        clock=lambda: now["mono"], wall=lambda: now["wall"])
    assert budget.reserve_s() == 2 * (0 + 5) + 10
    for step in range(1, 6):  # 3 s per step; step 4 commits 2 s after its end
        record = {"step": step, "time": 1000.0 + 3 * step, "last_commit": 4 if step >= 5 else 0}
        now["wall"] = 1000.0 + 3 * step + (3 if step == 5 else 0.5)
        budget.observe(record)
    assert budget.reserve_s() == pytest.approx(2 * (3 + 6) + 10)  # commit seen 6 s after 4
    now["mono"] = 100 - 28.5
    assert not budget.due()
    now["mono"] = 100 - 27.5
    assert budget.due()


@pytest.mark.parametrize(("text", "seconds"), [
    ("2h30m", 9000.0), ("45m", 2700.0), ("90s", 90.0), ("1.5h", 5400.0), ("1h0m5s", 3605.0)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


# --------------------------------------------------------------------------- bad flags

@pytest.mark.parametrize(("flags", "needles"), [
    (["--until", "abc"], ["--until 'abc'", "step number"]),
    (["--until", "0"], ["--until '0'"]),
    (["--until", "500"], ["--until 500", "steps = 24"]),
    (["--time-limit", "2x"], ["--time-limit '2x'", "2h30m"]),
    (["--time-limit", "30"], ["--time-limit '30'"]),
    (["--time-limit", "0s"], ["longer than zero"]),
    (["--data-cursor", "keep"], ["--data-cursor", "--from"]),
])
def test_bad_session_flags_are_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], needles: list[str],
) -> None:
    assert main(["fit", TINY, "--run-dir", str(tmp_path / "r"), *flags]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not (tmp_path / "r").exists()  # refused before the run directory is touched


def test_until_at_or_before_the_committed_step_is_refused(
    capsys: pytest.CaptureFixture[str], fake_fit: InProcessFit, tmp_path: Path,
    tiny_dataset: str,
) -> None:
    run = tmp_path / "run"
    assert _baton(capsys, ["fit", TINY, "--run-dir", str(run), *_sets(tiny_dataset, 8),
                           "--until", "4"])[0] == 0
    assert main(["fit", TINY, "--run-dir", str(run), *_sets(tiny_dataset, 8),
                 "--until", "4"]) == 2
    line = capsys.readouterr().err.strip()
    assert "--until 4" in line and "committed step 4" in line and "\n" not in line


def test_steps_below_the_committed_step_is_refused_and_a_multi_line_failure_is_one_line(
    capsys: pytest.CaptureFixture[str], fake_fit: InProcessFit, tmp_path: Path,
    tiny_dataset: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`steps` below the run's committed step used to be accepted (and the driver then
    reported a commit failure, exit 1, every time); a driver-side failure whose reason spans
    lines (a CUDA error's text) is printed on one line."""
    run = tmp_path / "run"
    assert _baton(capsys, ["fit", TINY, "--run-dir", str(run), *_sets(tiny_dataset, 12),
                           "--until", "8"])[0] == 0
    argv = ["fit", TINY, "--run-dir", str(run), *_sets(tiny_dataset, 6), "--reschedule"]
    assert main(argv) == 2
    line = capsys.readouterr().err.strip()
    assert "steps: the run is at committed step 8" in line and "\n" not in line, line
    assert max(SnapshotStore(str(run)).committed_steps()) == 8

    import trainer.cli.fit
    from trainer.run.commit_watch import FinalCommitError

    def failing(*args: object, **kwargs: object) -> None:
        raise FinalCommitError("training reached step 12 but its snapshot did not commit; "
                               "RuntimeError: CUDA error\nCUDA kernel errors might be "
                               "asynchronously reported\nFix the cause")

    monkeypatch.setattr(trainer.cli.fit, "_fit_interruptibly", failing)
    assert main(["fit", TINY, "--run-dir", str(run), *_sets(tiny_dataset, 12)]) == 1
    printed = capsys.readouterr()
    errors = [ln for ln in (printed.out + printed.err).splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "Fix the cause" in errors[0], errors


def test_session_log_is_untrusted(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    (tmp_path / "sessions.json").write_text("{not json")
    assert read_sessions(store) == []
    (tmp_path / "sessions.json").write_text(json.dumps({"sessions": [
        {"from_step": "3", "schedule": {}}, {"from_step": 2, "schedule": {
            "steps": 8, "optim.lr": 0.1, "optim.warmup_steps": 1, "optim.min_lr_ratio": 0.1}}]}))
    assert [e["from_step"] for e in read_sessions(store)] == [2]
