"""cluster.yaml is a valid Ray autoscaler config whose worker type matches the GPU recipe,
whose nodes all install the pinned release, and whose image is one Ray resolves."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml
from ray.autoscaler._private.util import validate_config

from trainer.config import load_recipe

ROOT = Path(__file__).resolve().parents[2]


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


def _install_commands(config: dict) -> list[str]:
    keys = ("setup_commands", "head_setup_commands", "worker_setup_commands",
            "initialization_commands")
    return [cmd for key in keys for cmd in config.get(key) or [] if "baton" in cmd]


def test_every_node_installs_the_pinned_release() -> None:
    """A spot node that joins later must install the head's code: the tag of this version."""
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    installs = _install_commands(config)
    assert installs, "no setup command installs Baton"
    for cmd in installs:
        refs = re.findall(r"git\+\S+?\.git(@[^\s\"']+)?", cmd)
        assert refs, f"not a git install: {cmd}"
        assert all(ref == f"@v{version}" for ref in refs), (
            f"install not pinned to the release tag v{version}: {cmd}"
        )
    assert not any(re.search(r"@(main|master)\b", cmd) for cmd in installs)


def test_images_are_rays_latest_dlami() -> None:
    """An AMI id nobody can trace is replaced by the keyword Ray's AWS provider resolves."""
    from ray.autoscaler._private.aws import config as aws_config

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    for name, node_type in config["available_node_types"].items():
        assert node_type["node_config"]["ImageId"] == "latest_dlami", name
    # The provider's own resolution, on a copy (no AWS call): every node type gets its table's
    # image for the region.
    resolved = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    aws_config._check_ami(resolved)
    expected = aws_config.DEFAULT_AMI[config["provider"]["region"]]
    for node_type in resolved["available_node_types"].values():
        assert node_type["node_config"]["ImageId"] == expected
