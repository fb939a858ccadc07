"""`elastic.coord.receipts.manifest_from_receipts`: the checks between "every rank reported" and the
commit. Each broken receipt set must raise (the step is then aborted, never committed); a
whole one becomes the manifest the restore reads."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from elastic.coord.receipts import manifest_from_receipts
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
                          "generation": GENERATION, "file": file, "chunks": {"model.w": [chunk]},
                          "versions": {"baton": "1"}}
    receipts[0].update(catalog={"model.w": {"dtype": "F32", "shape": [2, 4]}},
                       skeletons={"model": {"w": {"__tensor__": "model.w"}}}, layout="ddp")
    return receipts


Receipts = dict[int, dict[str, Any]]


def _build(receipts: Receipts) -> Manifest:
    manifest, data = manifest_from_receipts(STEP, WORLD, GENERATION, receipts,
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
