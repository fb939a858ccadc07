"""Tokenizers in corpus preparation: exact round trips (bytes, trained BPE, a tokenizer.json),
dtype from the vocabulary, the tokenizer in the manifest and the fingerprint, bad tokenizers.

Real text: files and docstrings of the Python standard library (nothing is downloaded)."""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from data_state import ResumableLoader
from data_state.corpus import prepare_corpus
from data_state.dataset import TokenDataset
from data_state.manifest import MANIFEST_NAME, DatasetError
from data_state.tokenizer import ENDOFTEXT, dtype_for_vocab, load_tokenizer

pytest.importorskip("tokenizers")

STDLIB = Path(sysconfig.get_paths()["stdlib"])
FILES = [STDLIB / n for n in ("textwrap.py", "shlex.py", "colorsys.py", "bisect.py",
                              "json/encoder.py")]


def documents_of(ds: TokenDataset) -> list[str]:
    """The documents of a split: its token stream cut at the end-of-document id (the stream's
    last token, an EOS, may have been dropped with the partial last sequence)."""
    stream = ds.read(np.arange(len(ds))).reshape(-1)
    ends = [int(e) for e in np.flatnonzero(stream == ds.eod_token)]
    if not ends or ends[-1] != len(stream) - 1:
        ends.append(len(stream))
    starts = [0, *(e + 1 for e in ends[:-1])]
    return [ds.decode(stream[s:e]) for s, e in zip(starts, ends, strict=True)]


def _prepare(out: Path, **kwargs: object) -> None:
    # seq_len 2: at most one token of the stream is dropped, so every document but the
    # last one's EOS comes back.
    prepare_corpus([str(f) for f in FILES], str(out), seq_len=2, val_fraction=0.0,
                   progress=False, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    _prepare(out, train_tokenizer=600)
    return out


def _expected() -> list[str]:
    return [f.read_text(encoding="utf-8") for f in sorted(FILES, key=str)]


def test_byte_tokenizer_round_trip(tmp_path: Path) -> None:
    _prepare(tmp_path)
    with TokenDataset(str(tmp_path)) as ds:
        assert ds.tokenizer_sha256 is None and ds.vocab_size == 256 and ds.dtype == np.uint8
        assert documents_of(ds) == _expected()


def test_trained_bpe_round_trip_and_manifest(bpe_dir: Path) -> None:
    raw = json.loads((bpe_dir / MANIFEST_NAME).read_text())
    stored = (bpe_dir / "tokenizer.json").read_bytes()
    assert raw["tokenizer"] == "tokenizers" and raw["tokenizer_file"] == "tokenizer.json"
    assert raw["tokenizer_sha256"] == hashlib.sha256(stored).hexdigest()
    assert raw["vocab_size"] == 600 and raw["token_dtype"] == "uint16"
    assert raw["special_tokens"] == {ENDOFTEXT: 0} and raw["eod_token"] == 0
    assert "trained" in raw["made_by"]["tokenizer_source"]
    with TokenDataset(str(bpe_dir)) as ds:
        assert ds.vocab_size == 600 and ds.special_tokens == {ENDOFTEXT: 0}
        assert ds.tokenizer_sha256 == raw["tokenizer_sha256"]
        assert documents_of(ds) == _expected()
        # BPE merges happened: far fewer tokens than bytes.
        assert len(ds) * 2 < 0.6 * sum(len(t.encode()) for t in _expected())


def test_training_is_deterministic(bpe_dir: Path, tmp_path: Path) -> None:
    _prepare(tmp_path, train_tokenizer=600)
    for name in ("tokenizer.json", MANIFEST_NAME, "train/part-00000.parquet"):
        assert (tmp_path / name).read_bytes() == (bpe_dir / name).read_bytes()


def test_tokenizer_file_or_directory_and_its_eos(bpe_dir: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    model = tmp_path / "model"
    model.mkdir()
    base = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    base.add_special_tokens(["</s>"])  # a Llama-like EOS, named by tokenizer_config.json
    base.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    tok = load_tokenizer(str(model))
    assert tok.eos_id == base.token_to_id("</s>") == 600 and tok.vocab_size == 601
    # The file alone: no config beside it is read for a file in another directory, so the
    # first well-known EOS spelling present wins.
    (tmp_path / "alone.json").write_bytes((model / "tokenizer.json").read_bytes())
    assert load_tokenizer(str(tmp_path / "alone.json")).eos_id == 0  # <|endoftext|>
    # No EOS at all: <|endoftext|> is added (documented choice) and the changed file stored.
    bare = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    bare_json = json.loads(bare.to_str())
    bare_json["added_tokens"] = []
    bare_json["model"]["vocab"].pop(ENDOFTEXT)
    (tmp_path / "bare.json").write_text(json.dumps(bare_json))
    added = load_tokenizer(str(tmp_path / "bare.json"))
    assert added.special_tokens == {ENDOFTEXT: added.eos_id}
    assert added.file_bytes != (tmp_path / "bare.json").read_bytes()


def test_special_token_text_in_a_document_does_not_end_it(bpe_dir: Path) -> None:
    # Text is data: "<|endoftext|>" or "</s>" written in a document (a code comment, an HTML
    # page) is encoded as text; only the EOS appended after the document ends it.
    tok = load_tokenizer(str(bpe_dir / "tokenizer.json"))
    doc = f"before {ENDOFTEXT} after"
    ids = tok.encode_documents([doc, "next"])
    ends = [int(i) for i in np.flatnonzero(ids == tok.eos_id)]
    assert len(ends) == 2 and ends[-1] == len(ids) - 1
    assert tok.decode(ids[: ends[0]]) == doc


def test_dtype_follows_the_vocabulary() -> None:
    assert [str(dtype_for_vocab(v)) for v in (256, 257, 65536, 65537)] == [
        "uint8", "uint16", "uint16", "uint32"
    ]


def test_a_changed_tokenizer_changes_the_fingerprint_and_a_cursor_refuses_it(
    bpe_dir: Path, tmp_path: Path
) -> None:
    from tokenizers import Tokenizer

    changed = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    changed.add_special_tokens(["<|unused|>"])  # absent from the text: same tokens
    changed.save(str(tmp_path / "changed.json"))
    out = tmp_path / "ds"
    _prepare(out, tokenizer=str(tmp_path / "changed.json"))
    with TokenDataset(str(bpe_dir)) as first, TokenDataset(str(out)) as second:
        shards = [m.manifest.splits["train"].shards[0].tokens_sha256 for m in (first, second)]
        assert shards[0] == shards[1]  # identical tokens...
        assert first.fingerprint != second.fingerprint  # ...through another tokenizer
        with ResumableLoader(first, global_batch=4, microbatch_size=4, seed=0) as a, \
                ResumableLoader(second, global_batch=4, microbatch_size=4, seed=0) as b:
            with pytest.raises(ValueError, match="data cursor is for dataset"):
                b.load_state_dict(a.state_dict())


def test_a_replaced_stored_tokenizer_is_refused(bpe_dir: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(bpe_dir, copy)
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text() + " ")
    with TokenDataset(str(copy)) as ds, pytest.raises(DatasetError, match="SHA-256"):
        ds.decode([1, 2])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gpt2", "'gpt2' is not a local file or directory; Baton never downloads"),
        ("meta-llama/Llama-3.1-8B", "never downloads"),
    ],
)
def test_a_hub_name_is_refused(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_tokenizer(spec)


def test_an_invalid_tokenizer_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with pytest.raises(ValueError, match="tokenizer.json is not a valid tokenizers file"):
        load_tokenizer(str(bad))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="holds no tokenizer.json"):
        load_tokenizer(str(tmp_path / "empty_dir"))


def test_the_trainer_takes_the_vocab_from_the_dataset_and_refuses_a_smaller_one(
    bpe_dir: Path, tmp_path: Path
) -> None:
    """Pre-flight, before Ray starts: `model.vocab_size` 0 (default) becomes the dataset's;
    a recipe whose model has fewer ids than the dataset's vocabulary is refused, naming both."""
    from trainer.config import ConfigError, load_recipe
    from trainer.run.preflight import ensure_dataset
    from trainer.run.run_dir import check_run_dir

    run = f'snapshots.run_uri="{tmp_path / "run"}"'
    data = [f'data.uri="{bpe_dir}"', "data.seq_len=2", "data.global_batch=4",
            "data.microbatch_size=2", "scaling.min_workers=1", "scaling.max_workers=1"]
    cfg = load_recipe("recipes/default.toml", [run, *data])
    assert cfg.model.vocab_size == 0
    assert ensure_dataset(cfg).model.vocab_size == 600
    small = load_recipe("recipes/default.toml", [run, *data, "model.vocab_size=256"])
    with pytest.raises(ConfigError, match="model.vocab_size: the recipe's model has 256 token "
                                          "ids but .* has a vocabulary of 600"):
        check_run_dir(small)
    check_run_dir(load_recipe("recipes/default.toml", [run, *data, "model.vocab_size=640"]))
