"""Recipes and FitConfig: every shipped recipe loads; bad values fail fast naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import ConfigError, FitConfig, SnapshotConfig, apply_override, load_recipe

RECIPES = sorted(Path(__file__).resolve().parents[1].joinpath("recipes").glob("*.toml"))
RUN = ["snapshots.run_uri=runs/test"]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_shipped_recipes_load(recipe: Path) -> None:
    cfg = load_recipe(recipe, RUN)
    assert cfg.data.global_batch % cfg.data.microbatch_size == 0
    assert cfg.scaling.max_workers <= cfg.data.num_microbatches
    assert cfg.to_dict()["snapshots"]["run_uri"] == "runs/test"


def test_overrides_parse_toml_values_and_bare_strings() -> None:
    cfg = load_recipe(RECIPES[0], RUN + ["optim.lr=1e-4", "sketch.rank=0", "parallelism=fsdp"])
    assert cfg.optim.lr == pytest.approx(1e-4)
    assert cfg.sketch.rank == 0
    assert cfg.parallelism == "fsdp"
    raw: dict = {}
    apply_override(raw, "snapshots.run_uri=s3://bucket/runs/a")
    assert raw == {"snapshots": {"run_uri": "s3://bucket/runs/a"}}


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("optim.lr=-1", "optim.lr"),
        ("data.global_batch=10", "data.global_batch"),  # not a multiple of microbatch_size
        ("scaling.max_workers=64", "scaling.max_workers"),  # more workers than microbatches
        ("scaling.min_workers=0", "scaling.min_workers"),
        ("parallelism=tp", "parallelism"),
        ("sketch.rank=-2", "sketch.rank"),
        ("sketch.estimator=topk", "sketch.estimator"),
        ("sketch.memory_budget_mib=-1", "sketch.memory_budget_mib"),
        ("sketch.memory_budget_mib=2", "sketch.memory_budget_mib"),  # and sketch.rank > 0
        ("snapshots.snapshot_every=0", "snapshots.snapshot_every"),
        ("steps=0", "steps"),
    ],
)
def test_bad_values_name_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_recipe(RECIPES[0], RUN + [override])


def test_unknown_keys_list_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['lrr'\].*valid keys"):
        load_recipe(RECIPES[0], RUN + ["optim.lrr=1"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[optimiser]\nlr = 1\n")
    with pytest.raises(ConfigError, match="unknown key 'optimiser'"):
        load_recipe(bad, RUN)


def test_missing_run_uri_and_missing_or_broken_recipe(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="snapshots.run_uri"):
        load_recipe(RECIPES[0])
    with pytest.raises(ConfigError, match="no such file"):
        load_recipe(tmp_path / "nope.toml", RUN)
    broken = tmp_path / "broken.toml"
    broken.write_text("steps = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_recipe(broken, RUN)
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_recipe(RECIPES[0], RUN + ["optim.lr"])


def test_custom_model_needs_a_loss() -> None:
    with pytest.raises(ConfigError, match="model_factory"):
        FitConfig(snapshots=SnapshotConfig(run_uri="runs/x"), model_factory=lambda: None)


def test_sketch_policy_reaches_the_model() -> None:
    """The built-in GPT sketches SKETCH_LAYERS (its fc stays exact: the fused MLP keeps fc's
    input anyway; so does the LM head) with the recipe's estimator; a memory budget becomes
    per-layer ranks."""
    from torch import nn

    from sketch_ops import SketchedLinear
    from trainer.loop import build_model

    cfg = load_recipe(RECIPES[0], RUN + ["sketch.rank=8"])
    model = build_model(cfg)
    sketched = {n: m for n, m in model.named_modules() if isinstance(m, SketchedLinear)}
    assert sketched and not any(n.endswith("mlp.fc") for n in sketched)
    assert type(model.get_submodule("blocks.0.mlp.fc")) is nn.Linear
    assert type(model.get_submodule("lm_head")) is nn.Linear
    assert {m.estimator for m in sketched.values()} == {cfg.sketch.estimator} == {"centered"}
    budget = load_recipe(RECIPES[0], RUN + ["sketch.rank=0", "sketch.memory_budget_mib=0.05"])
    ranks = {
        n: m.rank for n, m in build_model(budget).named_modules() if isinstance(m, SketchedLinear)
    }
    assert set(ranks) == set(sketched)
    widths = {n: m.in_features for n, m in sketched.items()}
    assert sum(r * widths[n] * 4 for n, r in ranks.items()) <= 0.05 * 2**20
    assert min(ranks.values()) < max(ranks.values())  # wide layers get fewer rows
