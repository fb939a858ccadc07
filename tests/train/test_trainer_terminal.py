"""What the terminal shows: number formats, restart events from recorded facts, the plain
progress line off a terminal, and the run summary (no Ray)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from trainer.run.terminal import (
    EtaEstimator,
    ProgressDisplay,
    RestartFacts,
    RestartTracker,
    describe_restart,
    fmt_count,
    fmt_duration,
    fmt_eta,
    fmt_loss,
    fmt_ratio,
    progress_line,
    snapshot_has_optimizer_state,
    summary_rows,
)


def test_number_formats() -> None:
    assert fmt_loss(2.5741342306137085) == "2.5741"
    assert fmt_loss(None) == "-"
    assert fmt_duration(3723) == "1h02m03s"
    assert fmt_duration(245) == "4m05s"
    assert fmt_duration(42.4) == "42s"
    assert fmt_duration(3.21) == "3.2s"
    assert fmt_duration(0.25) == "0.25s"
    assert fmt_duration(None) == fmt_duration(float("inf")) == "-"
    assert fmt_count(1234567) == "1,234,567"
    assert fmt_count(12345.6) == "12,346"
    assert fmt_ratio(7.96) == "8.0x"
    assert (fmt_eta(0.3), fmt_eta(7.4), fmt_eta(65), fmt_eta(None)) == ("<1s", "7s", "1m05s", "-")


def test_the_issue_example_reads_as_written() -> None:
    facts = RestartFacts(world_size=1, restored_step=100, reached_step=101,
                         previous_world_size=2, lost_nodes=("127.0.0.1",), optimizer_warm=True)
    assert describe_restart(facts) == (
        "node 127.0.0.1 lost at step 101 → resumed on 1 worker from committed step 100, "
        "optimizer warm, 1 step redone")


@pytest.mark.parametrize(
    ("facts", "expected"),
    [
        (RestartFacts(world_size=2, restored_step=200, reached_step=200, previous_world_size=1,
                      added_nodes=("10.0.0.7",), optimizer_warm=True),
         "scaled up from 1 to 2 workers (node 10.0.0.7 joined) at step 200 → resumed on "
         "2 workers from committed step 200, optimizer warm, 0 steps redone"),
        (RestartFacts(world_size=2, restored_step=0, reached_step=7, previous_world_size=2),
         "worker group restarted at step 7 → restarted on 2 workers from step 0 (nothing "
         "committed yet), 7 steps redone"),
        (RestartFacts(world_size=1, restored_step=40, reached_step=43, previous_world_size=2,
                      optimizer_warm=False),
         "scaled down from 2 to 1 worker at step 43 → resumed on 1 worker from committed "
         "step 40, optimizer cold, 3 steps redone"),
        (RestartFacts(world_size=2, restored_step=40, reached_step=43, previous_world_size=3,
                      lost_nodes=("10.0.0.5", "10.0.0.6")),
         "nodes 10.0.0.5, 10.0.0.6 lost at step 43 → resumed on 2 workers from committed "
         "step 40, 3 steps redone"),
        (RestartFacts(world_size=1, restored_step=40, reached_step=40, previous_world_size=3,
                      lost_nodes=("127.0.0.1", "127.0.0.1"), optimizer_warm=True),
         "2 nodes on 127.0.0.1 lost at step 40 → resumed on 1 worker from committed step 40, "
         "optimizer warm, 0 steps redone"),
    ],
)
def test_restart_lines(facts: RestartFacts, expected: str) -> None:
    assert describe_restart(facts) == expected


def _steps(first: int, last: int) -> list[dict]:
    return [{"kind": "step", "step": s, "loss": 3.0, "world_size": 2}
            for s in range(first, last + 1)]


def test_tracker_turns_records_and_node_changes_into_events() -> None:
    asked: list[int] = []

    def warm(step: int) -> bool:
        asked.append(step)
        return True

    tracker = RestartTracker(optimizer_warm=warm)
    first = tracker.feed([{"kind": "start", "step": 0, "world_size": 2}, *_steps(1, 101)])
    assert first == ["training on 2 workers from step 0"]
    tracker.nodes_changed(lost=["127.0.0.1"])
    events = tracker.feed([{"kind": "start", "step": 100, "world_size": 1}, *_steps(101, 150)])
    assert events == ["node 127.0.0.1 lost at step 101 → resumed on 1 worker from committed "
                      "step 100, optimizer warm, 1 step redone"]
    assert asked == [100]  # the start record did not say: the snapshot was asked
    tracker.nodes_changed(added=["127.0.0.1"])
    events = tracker.feed([{"kind": "start", "step": 150, "world_size": 2,
                            "optimizer_state": False}])
    assert events == ["scaled up from 1 to 2 workers (node 127.0.0.1 joined) at step 150 → "
                      "resumed on 2 workers from committed step 150, optimizer cold, "
                      "0 steps redone"]
    assert asked == [100]  # the record said it


def test_in_process_recoveries_are_events_of_their_own() -> None:
    tracker = RestartTracker()
    tracker.feed([{"kind": "start", "step": 0, "world_size": 3}, *_steps(1, 9)])
    tracker.nodes_changed(lost=["10.0.0.7"])
    lost = tracker.feed([{"kind": "recovery", "reason": "failure", "step": 8, "world_size": 2,
                          "before": 3, "seconds": 0.44, "counted": False}])
    assert lost == ["node 10.0.0.7 lost at step 8 → 2 survivors continued in-process (from 3, "
                    "re-formed in 0.44 s), 1 step redone"]
    tracker.nodes_changed(added=["10.0.0.9"])
    joined = tracker.feed([{"kind": "recovery", "reason": "join", "step": 30, "world_size": 3,
                            "before": 2, "seconds": 0.06, "counted": False}])
    assert joined == ["worker joined at step 30 (node 10.0.0.9 joined) → 3 workers, state "
                      "from a live peer in 0.06 s, the others continued in-process"]


def test_optimizer_state_is_read_from_the_manifest_state() -> None:
    """On the JSON state a snapshot's manifest stores (the registry's skeletons)."""
    import torch

    from elastic.state.registry import StateRegistry

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    registry = StateRegistry()
    registry.register("model", model)
    registry.register("optim", optimizer, model=model)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    assert snapshot_has_optimizer_state(registry.flatten().skeletons)
    # A loop that registered no optimizer (a session API user's choice) restores it cold.
    assert not snapshot_has_optimizer_state(registry.flatten(["model"]).skeletons)
    assert not snapshot_has_optimizer_state({"data": {"state": {}, "param_groups": []}})


def test_eta_follows_the_step_rate_and_resets_after_a_restart() -> None:
    now = [0.0]
    eta = EtaEstimator(100, clock=lambda: now[0])
    assert eta.update(10) is None  # one point: no rate yet
    now[0] = 10.0
    assert eta.update(20) == pytest.approx(80.0)  # 1 step/s, 80 left
    now[0] = 20.0
    assert eta.update(15) is None  # went back to a commit: the old rate no longer holds
    now[0] = 30.0
    assert eta.update(20) == pytest.approx(160.0)  # 0.5 step/s


def test_off_a_terminal_each_update_is_one_plain_unwrapped_line() -> None:
    out = io.StringIO()
    console = Console(file=out, width=40, force_terminal=False)  # lines longer than that
    now = [0.0]
    display = ProgressDisplay(300, console, clock=lambda: now[0])
    assert not display.live
    record = {"step": 10, "loss": 2.5741342306137085, "val_loss": 2.61, "tokens_per_s": 12345.6,
              "world_size": 2, "lr": 3e-3, "last_commit": 10, "warning": None}
    display.update(record)
    now[0] = 10.0
    display.update({**record, "step": 20, "val_loss": None, "warning": "no commit [for] 30"})
    display.event("node 127.0.0.1 lost at step 20")
    display.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == ("step 10/300  loss 2.5741  val 2.6100  12,346 tok/s  workers 2  "
                        "lr 3.00e-03  last commit 10  ETA -")
    assert lines[1].startswith("step 20/300  loss 2.5741  12,346 tok/s")
    assert lines[1].endswith("ETA 4m40s")  # 1 step/s, 280 steps left
    assert lines[2] == "warning: no commit [for] 30"  # markup in messages printed as is
    assert lines[3] == ">>> node 127.0.0.1 lost at step 20"
    assert len(lines) == 4
    assert "\x1b[" not in out.getvalue()  # no colour codes in logs


def test_on_a_terminal_a_bar_is_drawn() -> None:
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=True)
    display = ProgressDisplay(50, console)
    assert display.live
    display.update({"step": 25, "loss": 2.0, "tokens_per_s": 1000.0, "world_size": 1,
                    "lr": 1e-3, "last_commit": 20})
    display.close()
    text = out.getvalue()
    assert "25/50" in text and "loss 2.0000" in text and "commit 20" in text


def test_progress_line_without_optional_fields() -> None:
    line = progress_line({"step": 3, "loss": float("nan")}, 10, None)
    assert line == "step 3/10  loss nan  -  workers -  lr nan  last commit -  ETA -"


def test_summary_values_are_formatted() -> None:
    rows = dict(summary_rows({
        "steps": 12000, "final_loss": 2.5741342306137085, "final_val_loss": None,
        "restarts": 2, "steps_redone": 3, "world_sizes": [2, 1, 2],
        "mean_tokens_per_s": 12345.678, "snapshot_stall_ms_max": 12.3456,
        "wall_time_s": 3723.4, "report": "runs/demo/report.png",
    }))
    assert rows == {
        "steps": "12,000", "final loss": "2.5741", "final val loss": "-", "restarts": "2",
        "steps redone": "3", "workers over the run": "2 → 1 → 2",
        "mean throughput": "12,346 tok/s", "snapshot stall (max)": "12.3 ms",
        "wall time": "1h02m03s", "report": "runs/demo/report.png",
    }


def test_ray_messages_go_to_the_file_and_its_path_is_told_once(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    from ray._private import worker as ray_worker

    from trainer.on_ray.ray_messages import ray_messages_to

    ray_logger = logging.getLogger("ray")
    handlers_before = list(ray_logger.handlers)
    print_before = ray_worker.print_to_stdstream
    told: list[str] = []
    path = tmp_path / "logs" / "ray.log"
    with ray_messages_to(path, told.append):
        ray_logger.info("Connecting to existing Ray cluster at address: 127.0.0.1:6379...")
        # What Ray's error listener thread calls for a node failure (by its module name).
        ray_worker.print_to_stdstream({"lines": ["Raylet is terminated. Termination is "
                                                 "unexpected."], "pid": "raylet",
                                       "is_err": False}, ignore_prefix=False)
    captured = capsys.readouterr()
    assert "Raylet" not in captured.out + captured.err
    assert "Connecting" not in captured.out + captured.err
    text = path.read_text()
    assert "(raylet) Raylet is terminated" in text
    assert "INFO ray: Connecting to existing Ray cluster" in text
    assert told == [f"Ray's own messages (node failures, connection lines) are in {path}"]
    assert ray_logger.handlers == handlers_before  # put back
    assert ray_worker.print_to_stdstream is print_before


def test_run_feed_announces_a_node_loss_between_progress_lines(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver side end to end, with Ray's calls answered by fakes: records from the
    monitor, a node that was alive and is dead, the snapshot's manifest, the display."""
    import types

    from trainer.config import FitConfig, SnapshotConfig
    from trainer.on_ray import monitor as monitor_module

    state = monitor_module.MonitorState(str(tmp_path))
    remote = types.SimpleNamespace(since=types.SimpleNamespace(remote=state.since))
    alive = [{"NodeID": "head", "NodeManagerAddress": "10.0.0.1", "Alive": True},
             {"NodeID": "w1", "NodeManagerAddress": "10.0.0.2", "Alive": True}]
    fake_ray = types.SimpleNamespace(is_initialized=lambda: True, nodes=lambda: alive,
                                     get=lambda value, timeout=None: value)
    monkeypatch.setattr(monitor_module, "ray", fake_ray)
    monkeypatch.setattr(monitor_module, "get_monitor", lambda cfg: remote)
    out = io.StringIO()
    cfg = FitConfig(snapshots=SnapshotConfig(run_uri=str(tmp_path)))
    feed = monitor_module.RunFeed(cfg, ProgressDisplay(cfg.steps, Console(file=out, width=60)))
    feed.tracker.optimizer_warm = lambda step: True  # what the manifest would answer

    def step(n: int, world_size: int) -> None:
        state.add({"step": n, "loss": 3.0, "lr": 1e-3, "tokens_per_s": 10.0,
                   "world_size": world_size, "time": float(n)})
        feed({**state.latest(), "last_commit": 10, "warning": None})

    state.start_attempt(0, 2, 0.0)
    step(11, 2)
    step(12, 2)
    alive = alive[:1]  # the worker node died; the group restarts from committed step 10
    state.start_attempt(10, 1, 20.0)
    step(11, 1)
    feed.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == ">>> training on 2 workers from step 0"
    assert lines[1].startswith("step 11/100") and lines[2].startswith("step 12/100")
    assert lines[3] == (">>> node 10.0.0.2 lost at step 12 → resumed on 1 worker from committed "
                        "step 10, optimizer warm, 2 steps redone")
    assert lines[4].startswith("step 11/100") and "workers 1" in lines[4]
    assert feed.events == [lines[0][4:], lines[3][4:]]


def test_runs_whose_directories_share_a_name_get_their_own_monitor(tmp_path) -> None:
    """The monitor actor is named per run URI: two runs called "b" (two fits in one driver,
    two jobs on one cluster) must not share one (the second run's metrics would go to the
    first run's directory, and its progress would read the first run's last record)."""
    from trainer.config import FitConfig, SnapshotConfig
    from trainer.on_ray.monitor import monitor_name

    def name(run: str) -> str:
        return monitor_name(FitConfig(snapshots=SnapshotConfig(run_uri=run)))

    first, second = str(tmp_path / "x" / "b"), str(tmp_path / "y" / "b")
    assert name(first) != name(second)
    assert name(first) == name(first) and name(first).startswith("baton-monitor-b-")
    assert name("s3://bucket/b") != name(first)
