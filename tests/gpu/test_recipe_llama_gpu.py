"""recipes/llama-gpu.toml (issue 16, point 6): a ~1B Hugging Face Llama for the cluster of
cluster.yaml. The recipe loads through the normal loader, the model its config.json describes
is built on the meta device (no weights allocated) and counted, and what the recipe asks of
the cluster is what cluster.yaml's GPU worker type offers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers")

from trainer.config import FitConfig, load_recipe  # noqa: E402
from trainer.train.hf import build_hf_model  # noqa: E402
from trainer.train.parallel import shard_units  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "llama-gpu.toml"
# The count the recipe's comment derives (TinyLlama-1.1B's shape): 22 layers of 44 044 288,
# embedding and lm_head of 32 000 x 2048 each, the final norm.
PARAMETERS = 22 * (2 * 2048**2 + 2 * 2048 * 256 + 3 * 2048 * 5632 + 2 * 2048) \
    + 2 * 32_000 * 2048 + 2048


def _recipe() -> FitConfig:
    return load_recipe(RECIPE, ["snapshots.run_uri=s3://bucket/runs/llama-1b"])


def test_the_recipe_describes_a_1b_llama_in_bf16_on_fsdp2_with_auto_sketching() -> None:
    cfg = _recipe()
    assert cfg.model.hf_config == str(ROOT / "recipes" / "llama-gpu" / "config.json")
    assert cfg.model.vocab_size == 32_000  # from its config.json
    assert (cfg.precision.dtype, cfg.parallelism) == ("bf16", "fsdp")
    assert cfg.sketch.include == "auto" and cfg.sketch.rank > 0
    rows = cfg.data.microbatch_size * (cfg.data.seq_len - 1)  # inputs of a linear layer
    assert cfg.sketch.rank <= rows // 8
    assert cfg.data.uri.startswith("s3://"), "every node must reach the prepared dataset"

    with torch.device("meta"):  # the shapes only: no 4.4 GB of weights
        model = build_hf_model(cfg.model)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert all(p.is_meta for p in model.parameters())
    count = sum(p.numel() for p in model.parameters())
    assert count == PARAMETERS == 1_100_048_384
    assert 0.9e9 < count < 1.3e9
    assert model.config.max_position_embeddings >= cfg.data.seq_len
    units = shard_units(model)  # FSDP2: one shard per decoder layer, then the root
    assert [type(u).__name__ for u in units] == ["LlamaDecoderLayer"] * 22


def test_its_cluster_needs_match_the_gpu_worker_type_of_cluster_yaml() -> None:
    cfg = _recipe()
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    workers = [t for name, t in config["available_node_types"].items()
               if name != config["head_node_type"]]
    assert len(workers) == 1
    worker = workers[0]
    scaling = cfg.scaling
    assert scaling.use_gpu and worker["resources"]["GPU"] == 1
    assert worker["resources"]["CPU"] >= scaling.cpus_per_worker
    assert worker["min_workers"] <= scaling.min_workers
    assert scaling.max_workers <= min(worker["max_workers"], config["max_workers"])
    assert scaling.max_workers <= cfg.data.num_microbatches
