"""Tokenizers for corpus preparation: bytes, a Hugging Face `tokenizers` file, or a trained BPE.

Contract:
- `load_tokenizer(spec, eos_token=None)`: `"bytes"` is the byte tokenizer (a token is a byte
  of the UTF-8 text, vocab 256, byte 0 = end of document). Any other spec must be a local
  path: a `tokenizer.json` file (the `tokenizers` library's format) or a local model
  directory holding one. Nothing is ever downloaded: a hub name (`gpt2`,
  `meta-llama/Llama-3.1-8B`), a URL or a missing path is a `ValueError` that says so; a file
  that is not a valid tokenizer is a `ValueError` naming it.
- `train_bpe(texts, vocab_size)` trains a byte-level BPE (GPT-2 style: byte alphabet, the
  GPT-2 pre-tokenizing regex, no prefix space, byte-level decoder, so `decode(encode(t)) == t`
  for every text) with `<|endoftext|>` as special token 0. The same texts in the same order
  give a byte-identical `tokenizer.json`.
- Every tokenizer has `vocab_size` (largest id + 1), `eos_id`, `special_tokens` (text -> id),
  `dtype` (the smallest of uint8/uint16/uint32 holding every id), `name`,
  `encode_documents(texts)` (each text's ids followed by `eos_id`, concatenated, as `dtype`),
  `decode(ids)` and `file_bytes` (the `tokenizer.json` to store; None for bytes).
- End of document: the byte tokenizer uses byte 0 (NUL, absent from text). A loaded tokenizer
  uses `eos_token` if given, else the `eos_token` of a `tokenizer_config.json` beside the
  file (Hugging Face model directories have one), else the first of `KNOWN_EOS` among its
  special tokens. A tokenizer with none of these gets `<|endoftext|>` added as a special
  token (documented choice: the stored copy includes it, so its vocabulary is one larger
  than the original's and its SHA-256 differs from the original file's).
- Encoding never adds the tokenizer's own special tokens (a Llama post-processor's BOS, for
  example): documents are separated by EOS only. Nor does a document's text make one:
  special-token text inside a document ("<|endoftext|>", "</s>") is encoded as text, so text
  cannot forge a document boundary.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from elastic.storage import loads_json

BYTES = "bytes"
TOKENIZER_FILE = "tokenizer.json"
ENDOFTEXT = "<|endoftext|>"
KNOWN_EOS = (ENDOFTEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding ids `0 .. vocab_size - 1`."""
    for name in ("uint8", "uint16", "uint32"):
        if vocab_size <= np.iinfo(name).max + 1:
            return np.dtype(name)
    raise ValueError(f"vocab_size {vocab_size} does not fit 32-bit token ids")


class ByteTokenizer:
    """A token is a byte of the UTF-8 text; byte 0 ends each document."""

    name = BYTES
    vocab_size = 256
    eos_id = 0
    special_tokens: dict[str, int] = {}
    dtype = np.dtype("uint8")
    file_bytes: bytes | None = None

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        blob = b"".join(t.encode("utf-8") + b"\0" for t in texts)
        return np.frombuffer(blob, dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(np.asarray(list(ids), dtype=np.uint8)).decode("utf-8", "replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the end-of-document token chosen (module docstring)."""

    def __init__(self, tokenizer: Any, *, name: str, eos_token: str | None,
                 file_bytes: bytes | None = None) -> None:
        if eos_token is None:
            tokenizer.add_special_tokens([ENDOFTEXT])
            eos_token, file_bytes = ENDOFTEXT, None  # changed: store the changed tokenizer
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(
                f"--eos-token: {eos_token!r} (the end-of-document token) is not in the "
                f"vocabulary of {name}; pass --eos-token with one of its special tokens"
            )
        # A document's text never makes a special token: "<|endoftext|>" written in it is
        # encoded as text, so only the EOS that encode_documents appends ends a document
        # (the byte tokenizer refuses NUL for the same reason). Not part of to_str().
        tokenizer.encode_special_tokens = True
        self._tok, self.name, self.eos_id, self.eos_token = tokenizer, name, int(eos_id), eos_token
        self.file_bytes = file_bytes if file_bytes is not None else tokenizer.to_str().encode()
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self.special_tokens = {
            added.content: int(i)
            for i, added in sorted(tokenizer.get_added_tokens_decoder().items())
            if added.special
        }
        self.dtype = dtype_for_vocab(self.vocab_size)
        # encode_batch_fast skips offsets (faster); older tokenizers only have encode_batch.
        self._encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

    def encode_documents(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros(0, dtype=self.dtype)
        encodings = self._encode(list(texts), add_special_tokens=False)
        lengths = [len(e.ids) + 1 for e in encodings]
        out = np.empty(sum(lengths), dtype=self.dtype)
        position = 0
        for encoding, length in zip(encodings, lengths, strict=True):
            out[position : position + length - 1] = encoding.ids
            out[position + length - 1] = self.eos_id
            position += length
        return out

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))


Tokenizer = ByteTokenizer | HFTokenizer


def _tokenizers_module() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ValueError(
            "the 'tokenizers' package is needed for --tokenizer/--train-tokenizer and for "
            "datasets that store a tokenizer: pip install 'baton[data]'"
        ) from None
    return tokenizers


def _parse(data: bytes, name: str) -> Any:
    tokenizers = _tokenizers_module()
    try:
        return tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as err:  # noqa: BLE001 - tokenizers raises plain Exception subclasses
        reason = " ".join(str(err).split())[:200]
        raise ValueError(
            f"{name} is not a valid tokenizers file ({reason}): pass a tokenizer.json saved by "
            "the Hugging Face tokenizers library"
        ) from None


def from_file_bytes(data: bytes, *, name: str, eos_token: str | None) -> HFTokenizer:
    """A tokenizer from the bytes of a `tokenizer.json` whose EOS is known (a stored one)."""
    return HFTokenizer(_parse(data, name), name=name, eos_token=eos_token, file_bytes=data)


def from_stored(data: bytes, *, name: str, eos_id: int) -> HFTokenizer:
    """The tokenizer stored in a prepared dataset, whose end-of-document id is `eos_id`."""
    tok = _parse(data, name)
    eos = tok.id_to_token(eos_id)
    if eos is None:
        raise ValueError(f"{name}: the end-of-document id {eos_id} is not in its vocabulary")
    return HFTokenizer(tok, name=name, eos_token=eos, file_bytes=data)


def load_tokenizer(spec: str, *, eos_token: str | None = None) -> Tokenizer:
    """The tokenizer `spec` names (module docstring); `ValueError` in one line otherwise."""
    if spec == BYTES:
        if eos_token is not None:
            raise ValueError("--eos-token applies to --tokenizer PATH; bytes end with byte 0")
        return ByteTokenizer()
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        directory, path = path, os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise ValueError(
                f"--tokenizer {spec!r}: the directory holds no {TOKENIZER_FILE} (only "
                "tokenizers-format files are read; convert a slow/sentencepiece tokenizer "
                "with transformers' save_pretrained first)"
            )
    elif os.path.isfile(path):
        directory = os.path.dirname(path)
    else:
        raise ValueError(
            f"--tokenizer {spec!r} is not a local file or directory; Baton never downloads "
            "tokenizers: pass the path of a tokenizer.json or of a model directory holding one "
            "(download it yourself first, e.g. with `huggingface-cli download`)"
        )
    with open(path, "rb") as handle:
        data = handle.read()
    tok = _parse(data, path)
    chosen = eos_token or _configured_eos(directory)
    if chosen is None:
        present = tok.get_vocab(with_added_tokens=True)
        chosen = next((t for t in KNOWN_EOS if t in present), None)
    # With no EOS at all, HFTokenizer adds one and stores the changed file instead.
    return HFTokenizer(tok, name=path, eos_token=chosen, file_bytes=data)


def _configured_eos(directory: str) -> str | None:
    """`eos_token` from a `tokenizer_config.json` in `directory` (plain JSON), if any."""
    config = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(config):  # absent, or a FIFO whose open would block
        return None
    try:
        with open(config, "rb") as handle:
            raw = loads_json(handle.read(), config)  # bounded: a deep file is no traceback
    except (OSError, ValueError):
        return None
    eos = raw.get("eos_token") if isinstance(raw, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


MAX_TRAINED_VOCAB = 1 << 20  # the largest LLM vocabularies are ~256 Ki


def train_bpe(texts: Iterable[str] | Iterable[list[str]], vocab_size: int, *,
              length: int | None = None) -> HFTokenizer:
    """A byte-level BPE of `vocab_size` ids trained on `texts` (module docstring; batches of
    texts, as lists, are fine too)."""
    if not 257 <= vocab_size <= MAX_TRAINED_VOCAB:
        raise ValueError(
            f"--train-tokenizer {vocab_size}: a byte-level BPE needs at least 257 ids (256 "
            f"bytes and <|endoftext|>) and this one at most {MAX_TRAINED_VOCAB}; typical "
            "sizes are 4096 to 65536"
        )
    tokenizers = _tokenizers_module()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=length)
    return HFTokenizer(tok, name=f"byte-level BPE, {vocab_size} ids, trained on the train split",
                       eos_token=ENDOFTEXT)
