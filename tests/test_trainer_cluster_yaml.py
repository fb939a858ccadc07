"""cluster.yaml is a valid Ray autoscaler config whose worker type matches the GPU recipe."""

from __future__ import annotations

from pathlib import Path

import yaml
from ray.autoscaler._private.util import validate_config

from trainer.config import load_recipe

ROOT = Path(__file__).resolve().parents[1]


def test_cluster_yaml_passes_rays_own_validation() -> None:
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(config)  # raises on a schema error
    assert config["provider"]["type"] == "aws"
    head = config["available_node_types"][config["head_node_type"]]
    assert "InstanceMarketOptions" not in head["node_config"], "the head must be on-demand"


def test_spot_gpu_workers_match_the_gpu_recipe() -> None:
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    recipe = load_recipe(ROOT / "recipes" / "gpu.toml", ["snapshots.run_uri=s3://b/r"])
    workers = [
        t for name, t in config["available_node_types"].items() if name != config["head_node_type"]
    ]
    assert len(workers) == 1
    worker = workers[0]
    assert worker["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"
    assert worker["min_workers"] == recipe.scaling.min_workers
    assert worker["max_workers"] == recipe.scaling.max_workers
    assert worker["resources"]["GPU"] == 1 and recipe.scaling.use_gpu
    assert worker["resources"]["CPU"] >= recipe.scaling.cpus_per_worker
    assert config["max_workers"] >= recipe.scaling.max_workers
    assert any("baton-train" in cmd for cmd in config["setup_commands"])
