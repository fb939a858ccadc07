"""Recipes and FitConfig: every shipped recipe loads; bad values fail fast naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.config import ConfigError, FitConfig, SnapshotConfig, apply_override, load_recipe

RECIPES = sorted(Path(__file__).resolve().parents[2].joinpath("recipes").glob("*.toml"))
RUN = ["snapshots.run_uri=runs/test"]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_shipped_recipes_load(recipe: Path) -> None:
    cfg = load_recipe(recipe, RUN)
    assert cfg.data.global_batch % cfg.data.microbatch_size == 0
    assert cfg.scaling.max_workers <= cfg.data.num_microbatches
    assert cfg.to_dict()["snapshots"]["run_uri"] == str(Path("runs/test").resolve())


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
        ("snapshots.ram_replicas=-1", "snapshots.ram_replicas"),
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
    """The built-in GPT sketches SKETCH_LAYERS — the MLP's proj only: every other layer's input
    is kept for free — with the recipe's estimator; a memory budget becomes per-layer ranks;
    `model.mlp_recompute` reaches the MLP."""
    from torch import nn

    from sketch_ops import SketchedLinear
    from trainer.train.model_build import build_model

    cfg = load_recipe(RECIPES[0], RUN + ["sketch.rank=8"])
    model = build_model(cfg)
    sketched = {n: m for n, m in model.named_modules() if isinstance(m, SketchedLinear)}
    assert set(sketched) == {f"blocks.{i}.mlp.proj" for i in range(cfg.model.n_layers)}
    for name in ("blocks.0.mlp.fc", "blocks.0.attn.qkv", "blocks.0.attn.proj", "lm_head"):
        assert type(model.get_submodule(name)) is nn.Linear
    assert {m.estimator for m in sketched.values()} == {cfg.sketch.estimator} == {"centered"}
    assert build_model(load_recipe(RECIPES[0], RUN)).blocks[0].mlp.recompute is None  # auto
    never = load_recipe(RECIPES[0], RUN + ["model.mlp_recompute='never'"])
    assert build_model(never).blocks[0].mlp.recompute is False
    with pytest.raises(ConfigError, match="model.mlp_recompute"):
        load_recipe(RECIPES[0], RUN + ["model.mlp_recompute='sometimes'"])
    wider = ["sketch.include=['blocks.*.attn.*', 'blocks.*.mlp.proj']"]
    budget = load_recipe(
        RECIPES[0], RUN + wider + ["sketch.rank=0", "sketch.memory_budget_mib=0.05"]
    )
    ranks = {
        n: m.rank for n, m in build_model(budget).named_modules() if isinstance(m, SketchedLinear)
    }
    assert {n.split(".", 2)[2] for n in ranks} == {"attn.qkv", "attn.proj", "mlp.proj"}
    widths = {n: m.in_features for n, m in build_model(budget).named_modules() if n in ranks}
    assert sum(r * widths[n] * 4 for n, r in ranks.items()) <= 0.05 * 2**20
    assert min(ranks.values()) < max(ranks.values())  # wide layers get fewer rows


def test_local_run_and_data_paths_are_made_absolute_on_the_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A driver's relative paths would name other places in its workers, whose working
    directory is Ray Train's: the config holds them absolute (s3:// and file:// as given)."""
    import dataclasses

    from trainer.config import DataConfig

    monkeypatch.chdir(tmp_path)
    root = Path(__file__).resolve().parents[2]
    cfg = load_recipe(root / "recipes" / "tiny.toml",
                      ['snapshots.run_uri="runs/a"', 'data.uri="data/corpus"'])
    assert cfg.snapshots.run_uri == str(tmp_path / "runs" / "a")
    assert cfg.data.uri == str(tmp_path / "data" / "corpus")
    moved = dataclasses.replace(cfg.snapshots, run_uri="b")
    assert moved.run_uri == str(tmp_path / "b")
    assert SnapshotConfig(run_uri="s3://bucket/runs/a").run_uri == "s3://bucket/runs/a"
    assert DataConfig(uri="file:///data/x").uri == "file:///data/x"
    assert DataConfig().uri == ""  # the embedded corpus


def test_the_snapshots_section_gives_a_worker_s_snapshot_settings() -> None:
    cfg = SnapshotConfig(run_uri="s3://bucket/runs/a", snapshot_every=5, keep_last=4,
                         ram_copy_mib=2.0, storage_timeout_s=7.0, storage_retry_s=9.0)
    settings = cfg.snapshot_settings("fsdp")
    assert (settings.layout, settings.snapshot_every, settings.keep_last) == ("fsdp", 5, 4)
    assert settings.ram and settings.ram_cap_bytes == 2 << 20
    assert (settings.storage_timeout_s, settings.storage_retry_s) == (7.0, 9.0)
    assert not SnapshotConfig(run_uri="r", ram_copy_mib=0).snapshot_settings("ddp").ram
    assert not SnapshotConfig(run_uri="r", ram_replicas=0).snapshot_settings("ddp").ram
