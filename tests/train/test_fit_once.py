"""One `baton fit`, one pre-flight and one renew thread: the CLI checks the run directory and
takes the lease; `trainer.on_ray.ray_fit.fit` uses both as they are. The Python API's
`fit(config)` does each once itself.

Ray is left out: `ray_fit._fit_leased` (what runs under the lease) is replaced by a stub
that records what it was handed; everything before it is the real code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import trainer.cli.fit
import trainer.on_ray.ray_fit as ray_fit
from elastic.lease import RunLease
from elastic.store.snapshot_store import SnapshotStore
from trainer.cli import main
from trainer.config import load_recipe
from trainer.run.metrics import summarize

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny.toml")


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Counts of the pre-flight and of renew threads started, and what the stub was given."""
    seen: dict[str, Any] = {"checks": 0, "renew_starts": 0}
    check = trainer.cli.fit.check_run_dir

    def counting_check(*args: Any, **kwargs: Any) -> int:
        seen["checks"] += 1
        return check(*args, **kwargs)

    start = RunLease.start_renewing

    def counting_start(self: RunLease, interval_s: float | None = None) -> None:
        seen["renew_starts"] += 1
        start(self, interval_s)

    def fit_leased(config: Any, lease: RunLease, resumed_from: int, **_: Any) -> Any:
        seen.update(resumed_from=resumed_from, renewing=lease.renewing,
                    held=lease.token is not None and lease.lost is None)
        return ray_fit.FitResult(run_uri=config.snapshots.run_uri, summary=summarize([]),
                                 resumed_from=resumed_from)

    monkeypatch.setattr(trainer.cli.fit, "check_run_dir", counting_check)
    monkeypatch.setattr(ray_fit, "check_run_dir", counting_check)
    monkeypatch.setattr(RunLease, "start_renewing", counting_start)
    monkeypatch.setattr(ray_fit, "_fit_leased", fit_leased)
    monkeypatch.setattr(ray_fit, "connect_ray", lambda: False)
    return seen


def test_baton_fit_checks_the_run_dir_and_starts_renewing_once(
        counted: dict[str, Any], tmp_path: Path, tiny_dataset: str) -> None:
    run = tmp_path / "run"
    assert main(["fit", TINY, "--run-dir", str(run), "--set", f'data.uri="{tiny_dataset}"',
                 "--set", "steps=4", "--set", "eval.every=0"]) == 0
    assert counted["checks"] == 1 and counted["renew_starts"] == 1
    assert counted["resumed_from"] == 0 and counted["renewing"] and counted["held"]
    assert RunLease(SnapshotStore(str(run))).read() is None  # released at the end


def test_the_python_api_fit_checks_and_takes_the_lease_itself(
        counted: dict[str, Any], tmp_path: Path, tiny_dataset: str) -> None:
    run = tmp_path / "run"
    cfg = load_recipe(TINY, [f'snapshots.run_uri="{run}"', f'data.uri="{tiny_dataset}"',
                             "steps=4"])
    assert ray_fit.fit(cfg).resumed_from == 0
    assert counted["checks"] == 1 and counted["renew_starts"] == 1
    assert counted["renewing"] and counted["held"]
    assert RunLease(SnapshotStore(str(run))).read() is None
