"""`baton snapshots export RUN --format orbax|npz` (issue 33 point 4).

* orbax: a new directory whose `state` Orbax restores in a fresh interpreter that imports no
  Baton module (nor torch), holding the Flax params and the AdamW moments and count of the
  snapshot through the run's layout map; `baton.json` beside it has the data cursor, the
  AdamW settings, the decay mask and the learning rates.
* npz: every logical tensor and the JSON state, loaded with `allow_pickle=False`.
* bad `--out` values are one line, exit 2, and nothing is written; a corrupt snapshot writes
  nothing either (exit 1).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from elastic.portable import PortableRun
from trainer.cli import main as baton_main
from trainer.config import load_recipe
from trainer.on_jax.layout_map import gpt_map
from trainer.train.loop import WorkerEnv, run_worker

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: str) -> Path:
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("export") / "run"
    cfg = load_recipe(ROOT / "recipes" / "tiny.toml", [
        f'snapshots.run_uri="{path}"', f'data.uri="{tiny_dataset}"', "steps=4",
        "eval.every=0", "sketch.rank=0", "snapshots.snapshot_every=4"])
    run_worker(cfg, WorkerEnv())
    return path


def test_orbax_export_restores_without_baton(run: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ckpt"
    assert baton_main(["snapshots", "export", str(run), "--format", "orbax", "--out",
                       str(out)]) == 0
    assert "Orbax checkpoint" in capsys.readouterr().out
    code = textwrap.dedent(f"""
        import json, sys
        import numpy as np
        import orbax.checkpoint as ocp
        tree = ocp.StandardCheckpointer().restore({str(out / "state")!r})
        flat = {{}}
        def walk(node, prefix):
            for key, value in node.items():
                if isinstance(value, dict):
                    walk(value, prefix + (key,))
                else:
                    flat["/".join(prefix + (key,))] = np.asarray(value)
        walk(tree, ())
        np.savez({str(tmp_path / "restored.npz")!r}, **flat)
        print(json.dumps(sorted(m for m in sys.modules
                                if m.split(".")[0] in ("elastic", "trainer", "data_state",
                                                       "sketch_ops", "torch"))))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, timeout=180)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
    restored = dict(np.load(tmp_path / "restored.npz", allow_pickle=False))
    snap = PortableRun(str(run)).read(4)
    layout = gpt_map(1)
    model = {k[len("model."):]: v for k, v in snap.tensors.items() if k.startswith("model.")}
    for prefix, source in (("params", model),
                           ("opt_state/mu", {k: snap.tensors[f"optim.state.{k}.exp_avg"]
                                             for k in model}),
                           ("opt_state/nu", {k: snap.tensors[f"optim.state.{k}.exp_avg_sq"]
                                             for k in model})):
        for rule in layout.rules:
            want = layout.to_flax(source)
            for key in rule.path:
                want = want[key]
            assert np.array_equal(restored[f"{prefix}/{'/'.join(rule.path)}"], want), rule.path
    assert int(restored["opt_state/count"]) == 4 and int(restored["step"]) == 4
    info = json.loads((out / "baton.json").read_text())
    assert info["step"] == 4 and info["data"] == snap.component("data")
    assert info["adamw"]["weight_decay"] == 0.1 and info["adamw"]["grad_clip"] == 1.0
    assert "lm_head/kernel" in info["adamw"]["decayed"]
    assert "ln_f/scale" not in info["adamw"]["decayed"]
    assert len(info["lrs"]) > 4 and info["lrs"][0] < info["lrs"][3]  # warmup


def test_npz_export_holds_every_tensor_and_the_state(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "state.npz"
    assert baton_main(["snapshots", "export", str(run), "--format", "npz", "--out",
                       str(out)]) == 0
    snap = PortableRun(str(run)).read(4)
    with np.load(out, allow_pickle=False) as data:
        assert sorted(data.files) == sorted([*snap.tensors, "__state__"])
        for key, value in snap.tensors.items():
            assert np.array_equal(data[key], value) and data[key].dtype == value.dtype, key
        assert json.loads(str(data["__state__"])) == snap.state


@pytest.mark.parametrize("fmt, make, match", [
    ("orbax", lambda p: p.mkdir(), "exists: name a new directory"),
    ("npz", lambda p: p.mkdir(), "is a directory"),
])
def test_bad_out_is_one_line(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                             fmt: str, make: Callable[[Path], None], match: str) -> None:
    out = tmp_path / "out"
    make(out)
    assert baton_main(["snapshots", "export", str(run), "--format", fmt, "--out",
                       str(out)]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1, err
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("fmt", ["orbax", "npz"])
def test_inside_the_run_or_corrupt_writes_nothing(run: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str],
                                                  fmt: str) -> None:
    assert baton_main(["snapshots", "export", str(run), "--format", fmt, "--out",
                       str(run / "snapshots" / "x")]) == 2
    assert not (run / "snapshots" / "x").exists()
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    shard = next((broken / "snapshots" / "000000004").glob("shard-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = tmp_path / f"out.{fmt}"
    capsys.readouterr()
    assert baton_main(["snapshots", "export", str(broken), "--format", fmt, "--out",
                       str(out)]) == 1
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and err.count("\n") == 1, err
    assert not out.exists()
