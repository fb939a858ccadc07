"""Hugging Face causal LMs from a recipe (issue 16, points 1, 5 and 6: `trainer.train.hf`).

Models come from local `config.json` files written here (tiny `LlamaConfig` / `Qwen2Config`:
hidden 64, 2 layers, the dataset's vocabulary) or a local safetensors model directory; nothing
is downloaded. Training runs the real worker loop (`trainer.train.loop.run_worker`): one worker in
this process, two on gloo processes (`elastic.testing.run_group`), no Ray. What is compared is
read back through the public snapshot format, as in tests/train/test_trainer_loop.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from snapshot_compare import assert_same_state, final_state

pytest.importorskip("transformers")

from elastic.catalog import export_model  # noqa: E402
from elastic.errors import FatalRunError  # noqa: E402
from elastic.store.snapshot_store import SnapshotStore  # noqa: E402
from elastic.testing import run_group  # noqa: E402
from trainer.cli import main  # noqa: E402
from trainer.config import ConfigError, load_recipe  # noqa: E402
from trainer.train.loop import WorkerEnv, run_worker  # noqa: E402
from trainer.train.model_build import build_model  # noqa: E402
from trainer.train.parallel import shard_units  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "llama-tiny.toml"
STEPS = 8
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def write_config(directory: Path, family: str, vocab_size: int) -> Path:
    """A tiny config.json of `family` ("llama" or "qwen2", the latter with tied embeddings)."""
    from transformers import LlamaConfig, Qwen2Config

    if family == "llama":
        config = LlamaConfig(vocab_size=vocab_size, **SHAPE)
    else:
        config = Qwen2Config(vocab_size=vocab_size, tie_word_embeddings=True, **SHAPE)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    return directory / "config.json"


def _overrides(run: Path, dataset: str, config: Path | None, *more: str) -> list[str]:
    out = [f'snapshots.run_uri="{run}"', f'data.uri="{dataset}"', f"steps={STEPS}",
           "eval.every=0", *more]
    return out + ([f'model.hf_config="{config}"'] if config is not None else [])


def _train(rank: int, world_size: int, overrides: list[str], stop_after: int | None) -> None:
    torch.set_num_threads(1)
    cfg = load_recipe(RECIPE, overrides)
    run_worker(cfg, WorkerEnv(rank=rank, world_size=world_size, stop_after=stop_after))


def _run(tmp: Path, overrides: list[str], world_size: int, stop_after: int | None = None) -> None:
    if world_size == 1:
        threads = torch.get_num_threads()
        try:
            _train(0, 1, overrides, stop_after)  # in this process: no start-up cost
        finally:
            torch.set_num_threads(threads)
    else:
        run_group(_train, world_size, overrides, stop_after, tmp_dir=str(tmp))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_resumes_at_another_world_size_and_layout(family: str, tmp_path: Path,
                                                  tiny_dataset: str) -> None:
    """Stopped at step 3 on 1 worker, continued on 2 FSDP2 workers (one shard per decoder
    layer; the Llama first on 2 DDP workers to step 6): the same final model and optimizer
    as an uninterrupted single-worker run, to 1e-5 (P1 and the resharding restore)."""
    config = write_config(tmp_path / family, family, vocab_size=256)
    reference = tmp_path / "reference"
    _run(tmp_path, _overrides(reference, tiny_dataset, config), 1)
    moved = tmp_path / "moved"
    _run(tmp_path, _overrides(moved, tiny_dataset, config), 1, stop_after=3)
    if family == "llama":  # each process group costs start-up time: one DDP leg is enough
        _run(tmp_path, _overrides(moved, tiny_dataset, config), 2, stop_after=6)
    _run(tmp_path, _overrides(moved, tiny_dataset, config, 'parallelism="fsdp"'), 2)
    store = SnapshotStore(str(moved))
    assert store.load_manifest(STEPS).layout == "fsdp"
    one, other = final_state(reference, tmp_path, STEPS), final_state(moved, tmp_path, STEPS)
    assert_same_state(one, other)
    assert any(k.startswith("model.model.layers.1.") for k in one), sorted(one)[:5]
    assert any(k.endswith("exp_avg_sq") for k in one), "optimizer moments are in the snapshot"


def test_fsdp_shards_each_decoder_layer(tmp_path: Path) -> None:
    cfg = load_recipe(RECIPE, [f'snapshots.run_uri="{tmp_path / "run"}"'])
    model = build_model(cfg)
    units = shard_units(model)
    assert [type(u).__name__ for u in units] == ["LlamaDecoderLayer"] * 2
    assert units[1] is model.get_submodule("model.layers.1")


def test_the_recipe_trains_and_every_rank_builds_the_same_model(tmp_path: Path,
                                                                 tiny_dataset: str) -> None:
    """recipes/llama-tiny.toml (its config.json found relative to the recipe, BASIS on every
    nn.Linear) trains a few steps; the initial model is a function of the seed only."""
    cfg = load_recipe(RECIPE, _overrides(tmp_path / "run", tiny_dataset, None, "steps=3"))
    assert cfg.model.hf_config == str(ROOT / "recipes" / "llama-tiny" / "config.json")
    first, second = build_model(cfg), build_model(cfg)
    assert type(first).__name__ == "LlamaForCausalLM"
    assert type(first.get_submodule("model.layers.0.mlp.down_proj")).__name__ == "SketchedLinear"
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    losses: list[float] = []
    run_worker(cfg, WorkerEnv(on_metrics=lambda m: losses.append(m["loss"])))
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert SnapshotStore(cfg.snapshots.run_uri).committed_steps()[-1] == 3


def test_init_from_starts_from_the_saved_weights(tmp_path: Path, tiny_dataset: str) -> None:
    from transformers import AutoModelForCausalLM

    config = write_config(tmp_path / "cfg", "llama", vocab_size=256)
    torch.manual_seed(123)
    saved = AutoModelForCausalLM.from_config(
        __import__("transformers").AutoConfig.from_pretrained(config.parent))
    saved.save_pretrained(tmp_path / "pretrained")
    cfg = load_recipe(RECIPE, _overrides(tmp_path / "run", tiny_dataset, None, "steps=2",
                                         'model.hf_config=""', "sketch.rank=0",
                                         f'model.init_from="{tmp_path / "pretrained"}"'))
    assert cfg.model.vocab_size == 256
    model = build_model(cfg)
    for name, tensor in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    run_worker(cfg, WorkerEnv())
    trained = load_file(_export_baton(tmp_path / "run", 2, tmp_path))
    assert not torch.equal(trained["lm_head.weight"], saved.state_dict()["lm_head.weight"])


def _export_baton(run: Path, step: int, tmp: Path) -> Path:
    out = tmp / f"{run.name}-{step}.safetensors"
    export_model(SnapshotStore(str(run)), step, str(out))
    return out


def test_export_hf_round_trip_with_tied_weights_and_the_datasets_tokenizer(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Qwen2 (tied embeddings) trained on a BPE dataset, exported with `baton snapshots export
    --format hf`, loads with `from_pretrained`: logits equal the trained model's, the tied
    weight is stored once, and the tokenizer is the dataset's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_state import TokenDataset, prepare_corpus

    data = str(tmp_path / "bpe")
    prepare_corpus(None, data, seq_len=32, max_bytes=150_000, train_tokenizer=300,
                   progress=False)
    vocab = TokenDataset(data, split="train").vocab_size
    config = write_config(tmp_path / "qwen2", "qwen2", vocab_size=vocab)
    run = tmp_path / "run"
    cfg = load_recipe(RECIPE, _overrides(run, data, config, "steps=2"))
    run_worker(cfg, WorkerEnv())

    out = tmp_path / "exported"
    assert main(["snapshots", "export", str(run), "--format", "hf", "--out", str(out)]) == 0
    assert "as a Hugging Face model" in capsys.readouterr().out
    exported = AutoModelForCausalLM.from_pretrained(out)
    stored = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored

    trained = build_model(cfg)  # the run's model (sketched layers and all) ...
    trained.load_state_dict(load_file(_export_baton(run, 2, tmp_path)))  # ... at step 2
    trained.eval()
    tokens = TokenDataset(data, split="val").batch(range(2))
    with torch.no_grad():
        expected = trained(input_ids=tokens).logits
        got = exported(input_ids=tokens).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)

    tokenizer = AutoTokenizer.from_pretrained(out)
    dataset_tokenizer = TokenDataset(data, split="train").tokenizer
    text = "The quick brown fox jumps over the lazy dog."
    assert tokenizer(text)["input_ids"] == list(dataset_tokenizer.encode_documents([text])[:-1])
    assert tokenizer.eos_token_id == dataset_tokenizer.eos_id == exported.config.eos_token_id


def test_export_hf_of_a_byte_run_writes_a_byte_tokenizer(tmp_path: Path,
                                                         tiny_dataset: str) -> None:
    from transformers import AutoTokenizer

    run = tmp_path / "run"
    run_worker(load_recipe(RECIPE, _overrides(run, tiny_dataset, None, "steps=1",
                                              "snapshots.snapshot_every=1")), WorkerEnv())
    out = tmp_path / "exported"
    assert main(["snapshots", "export", str(run), "1", "--format", "hf", "--out", str(out)]) == 0
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "héllo, wörld"
    assert tokenizer(text)["input_ids"] == list(text.encode())
    assert tokenizer.decode(list(text.encode())) == text
    assert tokenizer.eos_token_id == 0


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str], code: int,
              *needles: str) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_export_hf_refuses_a_run_of_the_built_in_gpt(tmp_path: Path, tiny_dataset: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "gpt"
    cfg = load_recipe(ROOT / "recipes" / "tiny.toml",
                      [f'snapshots.run_uri="{run}"', f'data.uri="{tiny_dataset}"', "steps=1",
                       "snapshots.snapshot_every=1", "eval.every=0"])
    run_worker(cfg, WorkerEnv())
    _one_line(capsys, ["snapshots", "export", str(run), "--format", "hf", "--out",
                       str(tmp_path / "out")], 1, "--format hf", "not a run of a Hugging Face")


def test_recipe_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub name, a remote-code model type, pickled weights, init_from with a vocab: one line
    naming the field, before anything is built or downloaded."""
    base = ["fit", str(RECIPE), "--run-dir", str(tmp_path / "run"), "--set"]
    _one_line(capsys, [*base, 'model.hf_config="meta-llama/Llama-3.1-8B"'], 2,
              "model.hf_config", "nothing is downloaded")
    _one_line(capsys, [*base, 'model.hf_config="https://example.com/config.json"'], 2,
              "model.hf_config", "nothing is downloaded")
    pickled = tmp_path / "pickled"
    write_config(pickled, "llama", 256)
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    _one_line(capsys, [*base, 'model.hf_config=""', "--set",
                       f'model.init_from="{pickled}"'], 2, "model.init_from", "safetensors")
    with pytest.raises(ConfigError, match="model.init_from: cannot be set together"):
        load_recipe(RECIPE, [f'model.init_from="{pickled}"',
                             f'snapshots.run_uri="{tmp_path}"'])

    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({
        "model_type": "my_custom_lm", "vocab_size": 256,
        "auto_map": {"AutoModelForCausalLM": "modeling_custom.MyLM"}}))
    (remote / "modeling_custom.py").write_text("raise SystemExit('remote code ran')\n")
    cfg = load_recipe(RECIPE, [f'model.hf_config="{remote}"', f'snapshots.run_uri="{tmp_path}"'])
    with pytest.raises(FatalRunError, match="trust_remote_code"):
        build_model(cfg)

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    _one_line(capsys, base[:-1], 2, "model.hf_config", "pip install baton-train[hf]")


def test_a_model_vocabulary_smaller_than_the_datasets_is_refused(tmp_path: Path,
                                                                 tiny_dataset: str) -> None:
    config = write_config(tmp_path / "small", "llama", vocab_size=200)
    cfg = load_recipe(RECIPE, _overrides(tmp_path / "run", tiny_dataset, config))
    assert cfg.model.vocab_size == 200
    with pytest.raises(FatalRunError, match="has 200 token ids but the dataset's vocabulary "
                                            "has 256"):
        build_model(cfg)
    # hf_config (random init) may take another vocabulary: the recipe's model.vocab_size
    cfg = load_recipe(RECIPE, _overrides(tmp_path / "run", tiny_dataset, config,
                                         "model.vocab_size=256"))
    assert build_model(cfg).get_input_embeddings().weight.shape[0] == 256


def test_continuing_with_another_model_config_is_refused(tmp_path: Path, tiny_dataset: str,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    """run.json records the model's config.json content: a continued run whose
    `model.hf_config` holds other content (here a change no tensor shape shows), or that
    switches to the built-in GPT, is refused before Ray starts (and by the workers) in one
    line naming the field and the fix; the same content under another path continues."""
    from trainer.run.preflight import dataset_fingerprint
    from trainer.run.run_dir import RunDirError, check_run_dir
    from trainer.train.loop import refuse_other_run

    config = write_config(tmp_path / "llama", "llama", vocab_size=256)
    run = tmp_path / "run"
    _run(tmp_path, _overrides(run, tiny_dataset, config, "eval.every=0"), 1, stop_after=2)
    recorded = SnapshotStore(str(run)).read_run_json()["hf_model_config"]
    assert recorded == json.loads(config.read_text())
    copied = write_config(tmp_path / "elsewhere", "llama", vocab_size=256)  # same content
    assert check_run_dir(load_recipe(RECIPE, _overrides(run, tiny_dataset, copied))) == 2

    changed = {**recorded, "rms_norm_eps": 1e-3}
    (tmp_path / "elsewhere" / "config.json").write_text(json.dumps(changed))
    cfg = load_recipe(RECIPE, _overrides(run, tiny_dataset, copied))
    with pytest.raises(RunDirError) as err:
        check_run_dir(cfg)
    line = str(err.value)
    assert line.startswith("model.hf_config: ") and "\n" not in line, line
    assert "rms_norm_eps = 1e-06" in line and "has 0.001" in line and "--from" in line, line
    with pytest.raises(FatalRunError, match="^model.hf_config: .*rms_norm_eps"):
        refuse_other_run(cfg, dataset_fingerprint(tiny_dataset) or "")
    _one_line(capsys, ["fit", str(RECIPE), "--run-dir", str(run), "--set",
                       f'data.uri="{tiny_dataset}"', "--set", f"steps={STEPS}", "--set",
                       f'model.hf_config="{copied}"'], 2, "model.hf_config", "rms_norm_eps")
    builtin = load_recipe(RECIPE, _overrides(run, tiny_dataset, None, 'model.hf_config=""'))
    with pytest.raises(RunDirError, match="^model.hf_config: .* a Hugging Face model "
                                          '\\(model_type "llama"\\), this recipe builds the '
                                          "built-in GPT"):
        check_run_dir(builtin)
