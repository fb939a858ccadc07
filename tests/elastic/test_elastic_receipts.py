"""`elastic.coord.receipts`: a receipt's JSON form (what a store group writes to disk and
Ray carries) read back checked, and `manifest_from_receipts`, the checks between "every rank
reported" and the commit. Each broken receipt set must raise (the step is then aborted,
never committed); a whole one becomes the manifest the restore reads."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from elastic.coord.receipts import Receipt, TensorSpec, manifest_from_receipts
from elastic.format.records import Manifest, shard_filename

STEP, WORLD, GENERATION = 7, 2, 3


def _receipts() -> dict[int, dict[str, Any]]:
    """Two ranks, each holding one row of a 2 x 4 fp32 tensor `model.w`; rank 0 carries the
    catalog."""
    receipts = {}
    for rank in range(WORLD):
        file = shard_filename(rank, WORLD, GENERATION)
        chunk = {"file": file, "name": f"model.w@{rank},0", "offsets": [rank, 0], "shape": [1, 4],
                 "byte_range": [64, 80], "crc32": [rank + 1]}
        receipts[rank] = {"step": STEP, "rank": rank, "world_size": WORLD,
                          "generation": GENERATION, "layout": "ddp", "file": file,
                          "chunks": {"model.w": [chunk]}, "versions": {"baton": "1"}}
    receipts[0].update(catalog={"model.w": {"dtype": "F32", "shape": [2, 4]}},
                       skeletons={"model": {"w": {"__tensor__": "model.w"}}})
    return receipts


Receipts = dict[int, dict[str, Any]]


def _build(receipts: Receipts) -> Manifest:
    manifest, data = manifest_from_receipts(STEP, WORLD, GENERATION,
                                            {r: Receipt.from_json(x) for r, x in receipts.items()},
                                            block_bytes=1 << 20, versions={"coordinator": "c"})
    assert data == manifest.to_bytes()  # the bytes the commit writes
    return manifest


def test_whole_receipts_become_the_manifest() -> None:
    manifest = _build(_receipts())
    assert manifest.step == STEP and manifest.world_size == WORLD and manifest.layout == "ddp"
    assert manifest.files == [shard_filename(r, WORLD, GENERATION) for r in range(WORLD)]
    chunks = manifest.tensors["model.w"].chunks
    assert [(c.offsets, c.crc32) for c in chunks] == [((0, 0), (1,)), ((1, 0), (2,))]
    assert manifest.versions == {"coordinator": "c", "baton": "1"}
    assert manifest.state == {"model": {"w": {"__tensor__": "model.w"}}}


def _broken(edit: Callable[[Receipts], Any]) -> Receipts:
    receipts = copy.deepcopy(_receipts())
    edit(receipts)
    return receipts


@pytest.mark.parametrize(("edit", "message"), [
    (lambda r: r[0].pop("catalog"), "rank 0's receipt lacks the tensor catalog"),
    (lambda r: r[1].update(versions={"baton": "2"}), "install the same Baton on every node"),
    (lambda r: r[1].update(file=shard_filename(1, WORLD, GENERATION - 1)),
     "not its generation-3 shard"),
    (lambda r: r[1]["chunks"].update(v=r[1]["chunks"].pop("model.w")), "unknown tensor 'v'"),
    (lambda r: r[1]["chunks"].clear(), "chunks of 'model.w' cover 4 of 8 elements"),
    (lambda r: r[1]["chunks"]["model.w"].append(dict(r[1]["chunks"]["model.w"][0])),
     "chunks of 'model.w' cover 12 of 8 elements"),
    (lambda r: r[1]["chunks"]["model.w"][0].update(offsets=[0, 0], name="model.w@0,0"),
     "overlap each other"),
    (lambda r: r[0].update(skeletons={"model": {"w": {"__tensor__": "model.v"}}}),
     "refers to tensor 'model.v'"),
])
def test_a_broken_receipt_set_is_refused_with_one_line(edit: Callable[[Receipts], Any],
                                                       message: str) -> None:
    with pytest.raises(ValueError, match=f"^step {STEP}: ") as err:
        _build(_broken(edit))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_receipt_s_json_form_is_the_one_on_disk() -> None:
    # A store group's receipt file (and a receipt over Ray) is this JSON object: the same
    # keys and values as before receipts were typed, read back equal.
    obj = {"step": 7, "rank": 0, "world_size": 2, "generation": 3, "layout": "ddp",
           "file": shard_filename(0, 2, 3), "ram": ["node-a"],
           "chunks": {"model.w": [{"file": shard_filename(0, 2, 3), "name": "model.w@0,0",
                                   "offsets": [0, 0], "shape": [1, 4],
                                   "byte_range": [64, 80], "crc32": [1]}]},
           "versions": {"baton": "1"},
           "skeletons": {"model": {"w": {"__tensor__": "model.w"}}},
           "catalog": {"model.w": {"dtype": "F32", "shape": [2, 4]}}}
    receipt = Receipt.from_json(obj)
    assert receipt.ram == ("node-a",) and receipt.catalog == {"model.w": TensorSpec("F32", (2, 4))}
    assert receipt.chunks["model.w"][0].offsets == (0, 0)
    assert json.loads(json.dumps(receipt.to_json())) == obj
    assert list(receipt.to_json()) == list(obj)  # the same keys, in the same order
    other = {k: v for k, v in obj.items() if k not in ("skeletons", "catalog")}
    assert json.loads(json.dumps(Receipt.from_json(other).to_json())) == other  # rank > 0


@pytest.mark.parametrize(("edit", "message"), [
    (lambda r: r.pop("step"), "no 'step'"),
    (lambda r: r.update(rank="0"), "rank: expected int, got str"),
    (lambda r: r.update(generation=True), "generation: expected int, got bool"),
    (lambda r: r.update(file=None), "file: expected str, got null"),
    (lambda r: r.update(chunks=[]), "chunks: expected dict, got list"),
    (lambda r: r["chunks"]["model.w"][0].pop("crc32"), "a malformed chunk"),
    (lambda r: r["chunks"].update(v={}), "chunks of 'v'"),
    (lambda r: r.update(versions={"baton": 1}), "expected str, got int"),
    (lambda r: r.update(ram="node"), "expected list, got str"),
    (lambda r: r.update(catalog={"model.w": {"dtype": "F32", "shape": [2, "4"]}}),
     "catalog 'model.w': shape"),
])
def test_a_malformed_receipt_is_refused_with_one_line(edit: Callable[[dict[str, Any]], Any],
                                                      message: str) -> None:
    obj = copy.deepcopy(_receipts()[0])
    edit(obj)
    with pytest.raises(ValueError) as err:
        Receipt.from_json(obj)
    assert message in str(err.value) and "\n" not in str(err.value)
    for junk in (None, [], "receipt"):
        with pytest.raises(ValueError, match="^receipt: expected an object"):
            Receipt.from_json(junk)
