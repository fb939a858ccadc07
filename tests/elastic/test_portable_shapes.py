"""The neutral reader applies the PyTorch restore's shape rule to optimizer state (issue 36
point 10: 2): `Snapshot.check_optimizer_shapes`.

For each crafted optimizer state of tests/elastic/test_portable.py (a `step` of shape [1], a
transposed moment, a moment of one row, a scalar moment) the reader refuses the snapshot with
the words the PyTorch restore refuses it with (one line naming the state's path), reading
only the manifest; an untouched snapshot passes, and an optimizer that factors its second
moments (Adafactor) keeps the looser rule. The rule lives in the torch-free format layer
(`elastic.format.state_shapes`): a fresh interpreter checks a snapshot without importing
torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

# The PyTorch path's own run (committed snapshots 2 and 4 of elastic.testing's model).
from test_elastic_untrusted import pristine, run  # noqa: F401

from elastic.errors import SnapshotMisfitError
from elastic.portable import PortableRun, write_snapshot
from elastic.snapshotter import Snapshotter
from elastic.state import SnapshotMismatchError
from elastic.testing import build


def _crafted(run_dir: str, edit: str) -> str:
    """Snapshot 6: snapshot 4 with one optimizer state edited; returns the key edited."""
    source = PortableRun(run_dir).read(4)
    tensors = dict(source.tensors)
    if edit == "step":
        key = sorted(k for k in tensors if k.endswith(".step"))[0]
        tensors[key] = tensors[key].reshape(1)
    else:
        key = next(k for k, v in sorted(tensors.items()) if k.endswith(".exp_avg")
                   and v.ndim == 2 and v.shape[0] != v.shape[1])
        moment = tensors[key]
        tensors[key] = {"moment": np.ascontiguousarray(moment.T),
                        "row": np.ascontiguousarray(moment[:1]),
                        "scalar": np.asarray(moment.flat[0])}[edit]
    write_snapshot(run_dir, 6, tensors, json.loads(json.dumps(source.state)))
    return key


@pytest.mark.parametrize("edit", ["step", "moment", "row", "scalar"])
def test_reader_refuses_what_the_restore_refuses(run, edit: str) -> None:  # noqa: F811
    key = _crafted(str(run), edit)
    snap = PortableRun(str(run)).read(6)
    with pytest.raises(SnapshotMisfitError) as refused:
        snap.check_optimizer_shapes("optim", "AdamW")
    message = str(refused.value)
    assert "\n" not in message and "snapshot" in message, message
    path = "optim.state." + key[len("optim.state."):]
    assert f"state {path}:" in message, message
    with pytest.raises(SnapshotMismatchError) as torch_refused:
        Snapshotter(str(run), build(seed=11).registry).restore()
    # The same rule, in the same words: what follows the snapshot's name.
    assert message.split(": ", 1)[1] in str(torch_refused.value), (message, torch_refused.value)


def test_untouched_state_passes_and_factored_optimizers_keep_their_rule(run) -> None:  # noqa: F811
    PortableRun(str(run)).read(4).check_optimizer_shapes("optim", "AdamW")
    _crafted(str(run), "row")
    snap = PortableRun(str(run)).read(6)
    snap.check_optimizer_shapes("optim", "Adafactor")  # a row variance is Adafactor's shape
    with pytest.raises(SnapshotMisfitError, match="AdamW keeps it in the parameter's shape"):
        snap.check_optimizer_shapes("optim", "AdamW")


def test_the_check_imports_no_torch(pristine) -> None:  # noqa: F811
    code = textwrap.dedent(f"""
        import sys
        from elastic.portable import PortableRun
        PortableRun({str(pristine[0])!r}).read(4).check_optimizer_shapes("optim", "AdamW")
        print(sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out
