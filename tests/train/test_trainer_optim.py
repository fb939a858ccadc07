"""Optimizers and learning-rate schedules (issue 16, point 3): `optim.name`, `optim.schedule`,
`FitConfig.optimizer_factory`.

Runs train the tiny recipe in this process (`trainer.train.loop.run_worker`, one rank) or on a
gloo group (`elastic.testing.run_group`), and read the final committed snapshot back
through the public format, as `test_trainer_loop.py` does.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from snapshot_compare import assert_same_state, final_state

from elastic.errors import FatalRunError
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import run_group
from trainer.cli import main
from trainer.config import FitConfig, OptimConfig, load_recipe
from trainer.run.fork import plan_fork
from trainer.run.run_dir import RunDirError, check_run_dir
from trainer.train.continuation import schedule_changes, schedule_of
from trainer.train.loop import WorkerEnv, build, run_worker
from trainer.train.optim import describe_schedule, lr_at

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny.toml")
STEPS = 6


def _cfg(run: Path, dataset: str, sets: list[str], **python: object) -> FitConfig:
    cfg = load_recipe(TINY, [f'snapshots.run_uri="{run}"', f'data.uri="{dataset}"',
                             f"steps={STEPS}", "eval.every=0", *sets])
    if python:
        import dataclasses

        cfg = dataclasses.replace(cfg, **python)  # type: ignore[arg-type]
    return cfg


def _train(cfg: FitConfig, stop_after: int | None = None) -> None:
    run_worker(cfg, WorkerEnv(stop_after=stop_after))


def _train_rank(rank: int, world_size: int, sets: list[str], stop_after: int | None) -> None:
    torch.set_num_threads(1)
    cfg = load_recipe(TINY, sets)
    run_worker(cfg, WorkerEnv(rank=rank, world_size=world_size, stop_after=stop_after))


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def rmsprop(model: torch.nn.Module) -> torch.optim.Optimizer:
    """A custom optimizer_factory (module level: a spawned worker can import it)."""
    return torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.5)


# --------------------------------------------------------------------------- resume


@pytest.mark.parametrize(("sets", "state_key"), [
    (["optim.schedule=\"constant\""], "exp_avg_sq"),
    (["optim.name=\"sgd\"", "optim.nesterov=true", "optim.schedule=\"wsd\"",
      "optim.decay_fraction=0.5"], "momentum_buffer"),
    (["optim.name=\"adafactor\"", "optim.lr=0.01", "optim.schedule=\"linear\""], "col_var"),
    (["optim.name=\"sgd\"", "optim.momentum=0.0"], None),
], ids=["adamw-constant", "sgd-nesterov-wsd", "adafactor-linear", "sgd-plain"])
def test_each_optimizer_and_schedule_resumes_bitwise(
    tmp_path: Path, tiny_dataset: str, sets: list[str], state_key: str | None,
) -> None:
    """Stopped at step 3 (between snapshots) and continued in a fresh process state: the same
    bits as the uninterrupted run, optimizer state included. Plain SGD has none: its snapshot
    holds the param groups only (taken without DCP's fake optimizer step, which on the
    capture thread deadlocked)."""
    reference = tmp_path / "reference"
    _train(_cfg(reference, tiny_dataset, sets))
    resumed = tmp_path / "resumed"
    _train(_cfg(resumed, tiny_dataset, sets), stop_after=3)
    _train(_cfg(resumed, tiny_dataset, sets))
    ref = final_state(reference, tmp_path, STEPS)
    _assert_bitwise(ref, final_state(resumed, tmp_path, STEPS))
    optimizer_state = [k for k in ref if k.startswith("optim.state.")]
    if state_key is None:
        assert not optimizer_state and any(k.startswith("model.") for k in ref)
        groups = SnapshotStore(str(resumed)).load_manifest(STEPS).state["optim"]
        assert groups["state"] == {} and groups["param_groups"][0]["momentum"] == 0.0
        assert all(isinstance(p, str) for g in groups["param_groups"] for p in g["params"])
    else:
        assert any(k.endswith(state_key) for k in optimizer_state)


def _moved_run(tmp_path: Path, tiny_dataset: str, sets: list[str], first: tuple[int, str],
               then: tuple[int, str]) -> None:
    """An uninterrupted single-rank run, and one stopped at step 3 on `first` (world size,
    parallelism) and continued on `then`: the same end state up to summation order (P1)."""
    sets = [*sets, "eval.every=0", f'data.uri="{tiny_dataset}"', f"steps={STEPS}"]
    reference, moved = tmp_path / "reference", tmp_path / "moved"
    _train(load_recipe(TINY, [*sets, f'snapshots.run_uri="{reference}"']))
    for (world_size, parallelism), stop in ((first, 3), (then, None)):
        run_sets = [*sets, f'snapshots.run_uri="{moved}"', f'parallelism="{parallelism}"']
        if world_size == 1:
            _train(load_recipe(TINY, run_sets), stop_after=stop)
        else:
            run_group(_train_rank, world_size, run_sets, stop, tmp_dir=str(tmp_path))
    assert_same_state(final_state(reference, tmp_path, STEPS),
                      final_state(moved, tmp_path, STEPS))


def test_plain_sgd_state_is_read_without_an_optimizer_step() -> None:
    """DCP makes up state for an optimizer that has none with a fake step (lr 0, zero
    gradients): on the capture thread that step deadlocked. The registry reads plain SGD's
    param groups instead, its parameters named exactly as DCP names them."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from elastic.state.module_state import OptimizerState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    plain = torch.optim.SGD([{"params": [model[2].weight, model[0].weight]},
                             {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0}],
                            lr=0.5, weight_decay=0.1)
    state = OptimizerState(model, plain)
    model(torch.randn(5, 4)).sum().backward()
    plain.step()
    plain.zero_grad(set_to_none=True)
    steps: list[int] = []
    plain.register_step_pre_hook(lambda *_: steps.append(1))
    ours = state.state_dict()
    assert steps == [] and all(p.grad is None for p in model.parameters())
    assert [g["lr"] for g in plain.param_groups] == [0.5, 0.5]
    dcp = get_optimizer_state_dict(model, plain)  # takes the fake step
    assert steps == [1]
    assert ours == dcp and ours["state"] == {}
    assert ours["param_groups"][0]["params"] == ["2.weight", "0.weight"]


@pytest.mark.parametrize("momentum", [0.9, 0.0], ids=["momentum", "plain"])
def test_sgd_reshards_to_another_world_size_and_layout(tmp_path: Path, tiny_dataset: str,
                                                       momentum: float) -> None:
    """SGD's momentum buffers (plain SGD: its param groups alone) saved on one DDP rank,
    restored as FSDP2 shards on 2 ranks."""
    _moved_run(tmp_path, tiny_dataset, ['optim.name="sgd"', 'optim.schedule="wsd"',
                                        f"optim.momentum={momentum}"], (1, "ddp"), (2, "fsdp"))


@pytest.mark.slow  # a second gloo group (~10 s on 2 cores); the FSDP2 case above is the fast one
def test_adafactor_reshards_to_another_world_size(tmp_path: Path, tiny_dataset: str) -> None:
    """Adafactor's factored moments (a row and a column vector per matrix) saved at 2 DDP
    ranks, restored on 1. (Adafactor does not run under FSDP2: refused by the config.)"""
    _moved_run(tmp_path, tiny_dataset, ['optim.name="adafactor"', "optim.lr=0.01"],
               (2, "ddp"), (1, "ddp"))


def test_optimizer_factory_state_is_in_the_snapshot_and_resumes(
    tmp_path: Path, tiny_dataset: str,
) -> None:
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    _train(_cfg(reference, tiny_dataset, [], optimizer_factory=rmsprop))
    _train(_cfg(resumed, tiny_dataset, [], optimizer_factory=rmsprop), stop_after=5)
    _train(_cfg(resumed, tiny_dataset, [], optimizer_factory=rmsprop))
    ref = final_state(reference, tmp_path, STEPS)
    _assert_bitwise(ref, final_state(resumed, tmp_path, STEPS))
    assert any(k.endswith("square_avg") for k in ref)
    assert any(k.endswith("momentum_buffer") for k in ref)

    cfg = _cfg(tmp_path / "other", tiny_dataset, [], optimizer_factory=rmsprop)
    built = build(cfg, WorkerEnv())
    try:  # the recipe's schedule drives the factory's learning rate
        assert isinstance(built.optimizer, torch.optim.RMSprop)
        assert built.optimizer.param_groups[0]["lr"] == lr_at(cfg.optim, STEPS, 0)
    finally:
        built.close()
    bad = _cfg(tmp_path / "bad", tiny_dataset, [], optimizer_factory=lambda model: "sgd")
    with pytest.raises(FatalRunError, match="^optimizer_factory: must return a torch.optim"):
        build(bad, WorkerEnv())


# --------------------------------------------------------------------------- refusals


def test_continuing_or_forking_with_another_optimizer_is_refused(
    tmp_path: Path, tiny_dataset: str,
) -> None:
    run = tmp_path / "run"
    sgd = ["optim.name=\"sgd\""]
    _train(_cfg(run, tiny_dataset, sgd), stop_after=2)
    assert check_run_dir(_cfg(run, tiny_dataset, [*sgd, "optim.momentum=0.5"])) == 2
    cases = [
        ([], "optim.name", 'optim.name = "sgd"'),
        ([*sgd, "optim.schedule=\"linear\""], "optim.schedule", "--reschedule"),
        ([*sgd, "optim.schedule=\"wsd\""], "optim.schedule", "--reschedule"),
    ]
    for sets, field, needle in cases:
        with pytest.raises(RunDirError) as err:
            check_run_dir(_cfg(run, tiny_dataset, sets))
        line = str(err.value)
        assert line.startswith(f"{field}:") and needle in line and "\n" not in line, line
    with pytest.raises(RunDirError, match="^optimizer_factory: .*optim.name = 'sgd'"):
        check_run_dir(_cfg(run, tiny_dataset, [], optimizer_factory=rmsprop))
    fork = _cfg(tmp_path / "fork", tiny_dataset, ["steps=20"])
    with pytest.raises(RunDirError, match='^optim.name: a fork restores .*"sgd"'):
        plan_fork(fork, str(run), None)
    plan_fork(_cfg(tmp_path / "fork", tiny_dataset, [*sgd, "steps=20", "optim.lr=0.01"]),
              str(run), None)  # another lr (or schedule) is fine for a fork


@pytest.mark.parametrize(("setting", "field"), [
    ("optim.name=lion", "optim.name"),
    ("optim.schedule=step", "optim.schedule"),
    ("optim.momentum=0.5", "optim.momentum"),  # sgd only
    ("optim.beta2_decay=-0.5", "optim.beta2_decay"),  # adafactor only
    ("optim.decay_fraction=0.3", "optim.decay_fraction"),  # wsd only
    ("optim.momentum=true", "optim.momentum"),
    ('optim.name="sgd" --set optim.momentum=1.0', "optim.momentum"),
    ('optim.name="sgd" --set optim.momentum=0.0 --set optim.nesterov=true', "optim.nesterov"),
    ('optim.name="adafactor" --set parallelism="fsdp"', "optim.name"),
])
def test_bad_optimizer_settings_are_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, setting: str, field: str,
) -> None:
    sets = [arg for part in setting.split(" --set ") for arg in ("--set", part)]
    assert main(["fit", TINY, "--run-dir", str(tmp_path / "r"), *sets]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: {field}:"), lines[0]


def test_optimizer_settings_are_checked_together() -> None:
    from trainer.config import ConfigError, SnapshotConfig

    for kwargs, field in ((dict(name="sgd", momentum=0.0, nesterov=True), "optim.nesterov"),
                          (dict(schedule="wsd", decay_fraction=0.0), "optim.decay_fraction"),
                          (dict(name="adafactor", beta2_decay=0.1), "optim.beta2_decay"),
                          (dict(name="sgd", beta1=0.8), "optim.beta1")):
        with pytest.raises(ConfigError, match=f"^{field}:"):
            OptimConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="^optim.name: does not apply with optimizer_factory"):
        FitConfig(snapshots=SnapshotConfig(run_uri="x"), optim=OptimConfig(name="sgd"),
                  optimizer_factory=rmsprop)


# --------------------------------------------------------------------------- schedules


def _optim(schedule: str, **extra: object) -> OptimConfig:
    return OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, schedule=schedule,
                       **extra)  # type: ignore[arg-type]


def test_schedule_curves() -> None:
    """Warmup to lr at step 10 for all; then, over 100 more steps to the floor 0.1 at 110."""
    total = 110
    for name in ("cosine", "linear", "constant", "wsd"):
        cfg = _optim(name)
        assert lr_at(cfg, total, 0) == pytest.approx(0.1)
        assert lr_at(cfg, total, 9) == 1.0  # warmup ends at lr
        curve = [lr_at(cfg, total, s) for s in range(9, total)]
        assert all(b <= a for a, b in zip(curve, curve[1:], strict=False)), name
    cosine, linear, constant, wsd = (_optim(n) for n in ("cosine", "linear", "constant", "wsd"))
    assert lr_at(cosine, total, 60) == pytest.approx(0.55)  # half way: (1 + cos(pi/2)) / 2
    assert lr_at(cosine, total, 35) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert lr_at(linear, total, 60) == pytest.approx(0.55)
    assert lr_at(linear, total, 35) == pytest.approx(0.1 + 0.9 * 0.75)
    assert lr_at(constant, total, 60) == lr_at(constant, total, total - 1) == 1.0
    # wsd: stable until the last 20 % (22 steps: decay from step 88), then linear to 0.1.
    assert lr_at(wsd, total, 60) == lr_at(wsd, total, 88) == 1.0
    assert lr_at(wsd, total, 99) == pytest.approx(0.55)
    for cfg in (cosine, linear, wsd):
        assert lr_at(cfg, total, total) == pytest.approx(0.1)  # the floor at `steps`
        assert 0.1 < lr_at(cfg, total, total - 1) < 0.15
    assert lr_at(_optim("wsd", decay_fraction=0.5), total, 60) == pytest.approx(
        0.1 + 0.9 * (1 - 5 / 55))
    # The shape is the recipe's steps: a session stopped early never changes it.
    assert [lr_at(wsd, total, s) for s in range(40)] == [lr_at(wsd, total, s) for s in range(40)]
    assert "stable until step 88, then linear decay to" in describe_schedule(wsd, total, 20)
    assert "decaying since step 88" in describe_schedule(wsd, total, 95)
    assert "constant until step 110" in describe_schedule(constant, total, 20)
    assert "linear decay to" in describe_schedule(linear, total, 20)


def test_schedule_changes_cover_the_new_fields() -> None:
    base = load_recipe(TINY, ["snapshots.run_uri=x"])
    saved = schedule_of(base)
    wsd = load_recipe(TINY, ["snapshots.run_uri=x", 'optim.schedule="wsd"'])
    assert [c[0] for c in schedule_changes(saved, wsd)] == ["optim.schedule"]
    shorter = load_recipe(TINY, ["snapshots.run_uri=x", 'optim.schedule="wsd"',
                                 "optim.decay_fraction=0.5"])
    assert [c[:2] for c in schedule_changes(schedule_of(wsd), shorter)] == [
        ("optim.decay_fraction", 0.2)]
    # A session logged before these fields existed trained with cosine.
    old = {k: v for k, v in saved.items() if k not in ("optim.schedule", "optim.decay_fraction")}
    from trainer.train.continuation import _from_config

    assert _from_config({"steps": 24, "optim": {"lr": 3e-3, "warmup_steps": 4,
                                                "min_lr_ratio": 0.1}}) == {
        **old, "optim.schedule": "cosine", "optim.decay_fraction": 0.2}
