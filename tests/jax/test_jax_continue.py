"""Continue a Baton run in JAX, and back (issue 33 points 2, 3 and 5). CPU, fp32.

The built-in GPT of recipes/tiny.toml (exact backprop) is trained with Baton's real worker
loop in PyTorch: 15 steps uninterrupted (the reference), 10 steps, and 5 steps.

* 10 in PyTorch + 5 in JAX/Optax from the step-10 snapshot ends within 1e-5 (relative, over
  the model and over each moment) of the 15-step reference, with optax's count at 15;
* 5 in PyTorch + 5 in JAX, committed as a snapshot, + 5 more by Baton's PyTorch loop ends
  within 1e-5 of the reference too (JAX -> snapshot -> PyTorch);
* the JAX continuation reads exactly the microbatches a PyTorch worker reads from that
  cursor, and the samples the reference run trained on in steps 11-15;
* the AdamW maths, one update at a time: eps placement, bias correction, decoupled weight
  decay, torch's gradient clipping and the schedule's value at every step;
* the ready Llama map: a Hugging Face LlamaForCausalLM (grouped-query attention, tied and
  untied embeddings) gives the same logits through the map and FlaxLlama, and maps back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from data_state.dataset import TokenDataset
from data_state.loader import ResumableLoader
from elastic.catalog import verify
from elastic.portable import PortableRun
from elastic.store.snapshot_store import SnapshotStore
from trainer.config import OptimConfig, load_recipe
from trainer.on_jax import JaxTrainState, load_train_state, save_train_state
from trainer.on_jax.layout_map import gpt_map
from trainer.on_jax.llama import FlaxLlama, llama_map_for
from trainer.on_jax.optim import AdamWSettings, adam_state, baton_adamw, set_adam_state
from trainer.train.loop import WorkerEnv, run_worker
from trainer.train.optim import LrSchedule, lr_at

ROOT = Path(__file__).resolve().parents[2]
STEPS = 15


def _train(run: Path, dataset: str, stop_after: int | None) -> tuple[Any, list[list[int]]]:
    torch.set_num_threads(1)
    cfg = load_recipe(ROOT / "recipes" / "tiny.toml", [
        f'snapshots.run_uri="{run}"', f'data.uri="{dataset}"', f"steps={STEPS}",
        "eval.every=0", "sketch.rank=0", "snapshots.snapshot_every=5"])
    records: list[dict[str, Any]] = []
    result = run_worker(cfg, WorkerEnv(stop_after=stop_after, record_samples=True,
                                       on_metrics=records.append))
    return result, [r["samples"] for r in records]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: str) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("jax-runs")
    out: dict[str, Any] = {"dataset": tiny_dataset, "root": root}
    _, out["reference_samples"] = _train(root / "reference", tiny_dataset, None)
    _train(root / "torch10", tiny_dataset, 10)
    _train(root / "torch5", tiny_dataset, 5)
    return out


def _continue_in_jax(state: JaxTrainState, steps: int) -> list[list[int]]:
    """The loop a JAX user writes: the run's loader, one update per global batch."""
    loader = state.loader()
    read = []
    try:
        for _ in range(steps):
            microbatches = loader.next_step()
            read.append([i for mb in microbatches for i in mb.sample_indices])
            state.train_step(np.concatenate([mb.tokens for mb in microbatches]))
            loader.advance()
        state.data = loader.state_dict()
    finally:
        loader.close()
    return read


def _relative(ref: dict[str, np.ndarray], got: dict[str, np.ndarray], suffix: str) -> float:
    keys = sorted(k for k in ref if k.endswith(suffix) if k.startswith(("model.", "optim.")))
    assert keys, suffix
    x = np.concatenate([ref[k].ravel().astype(np.float64) for k in keys])
    y = np.concatenate([got[k].ravel().astype(np.float64) for k in keys])
    return float(np.linalg.norm(x - y) / np.linalg.norm(x))


def _assert_close_state(ref: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> None:
    """Parameters and both moments each within 1e-5 relative (and no element off by 1e-4)."""
    model = {k: v for k, v in ref.items() if k.startswith("model.")}
    for name, part, suffix in (("parameters", model, "weight"), ("parameters", model, "bias"),
                               ("exp_avg", ref, ".exp_avg"), ("exp_avg_sq", ref, ".exp_avg_sq")):
        rel = _relative(part, got, suffix)
        assert rel <= 1e-5, f"{name} (*{suffix}): relative difference {rel:.2e}"
    for key, value in ref.items():
        worst = float(np.abs(value.astype(np.float64) - got[key].astype(np.float64)).max())
        assert worst <= 1e-4, f"{key}: an element differs by {worst:.2e}"


def _as_snapshot_tensors(state: JaxTrainState) -> dict[str, np.ndarray]:
    adam = adam_state(state.opt_state)
    out = {f"model.{k}": v for k, v in
           state.layout.to_torch(jax.tree.map(np.asarray, state.params)).items()}
    for moment, tree in (("exp_avg", adam.mu), ("exp_avg_sq", adam.nu)):
        out.update({f"optim.state.{k}.{moment}": v for k, v in
                    state.layout.to_torch(jax.tree.map(np.asarray, tree)).items()})
    return out


# ------------------------------------------------------------------ PyTorch -> JAX


def test_pytorch_10_then_jax_5_ends_where_pytorch_15_does(runs: dict[str, Any]) -> None:
    state = load_train_state(str(runs["root"] / "torch10"))
    assert state.step == 10
    read = _continue_in_jax(state, STEPS - 10)
    assert state.step == STEPS and int(adam_state(state.opt_state).count) == STEPS
    reference = PortableRun(str(runs["root"] / "reference")).read(STEPS)
    got = _as_snapshot_tensors(state)
    ref = {k: v for k, v in reference.tensors.items() if k in got}
    assert len(ref) == len(got) == 17 * 3
    _assert_close_state(ref, got)
    # The samples: those the reference trained on in steps 11-15 (its records are sorted).
    assert [sorted(s) for s in read] == runs["reference_samples"][10:STEPS]
    assert state.data == reference.component("data")


def test_jax_reads_the_microbatches_a_pytorch_worker_reads(runs: dict[str, Any]) -> None:
    """Microbatch by microbatch, the same indices and the same token values as PyTorch's
    ResumableLoader restored from the same cursor."""
    state = load_train_state(str(runs["root"] / "torch10"))
    cfg = state.config["data"]
    mine = state.loader()
    dataset = TokenDataset(runs["dataset"], "train")
    theirs = ResumableLoader(dataset, global_batch=cfg["global_batch"],
                             microbatch_size=cfg["microbatch_size"], seed=state.data["seed"])
    theirs.load_state_dict(state.data)
    try:
        for _ in range(STEPS - 10):
            ours, torch_mbs = mine.next_step(), theirs.next_step()
            assert [m.sample_indices for m in ours] == [m.sample_indices for m in torch_mbs]
            for a, b in zip(ours, torch_mbs, strict=True):
                assert isinstance(a.tokens, np.ndarray) and a.tokens.dtype == np.int64
                assert np.array_equal(a.tokens, b.tokens.numpy())
            mine.advance()
            theirs.advance()
        assert mine.state_dict() == theirs.state_dict()
    finally:
        mine.close()
        theirs.close()
        dataset.close()


# ------------------------------------------------------------------ JAX -> PyTorch


def test_jax_state_committed_and_continued_by_pytorch(runs: dict[str, Any],
                                                     tmp_path: Path) -> None:
    run = tmp_path / "torch5"
    shutil.copytree(runs["root"] / "torch5", run)
    state = load_train_state(str(run))
    assert state.step == 5
    _continue_in_jax(state, 5)
    manifest = save_train_state(str(run), state)
    store = SnapshotStore(str(run))
    assert manifest.step == 10 and store.committed_steps()[-1] == 10
    assert verify(store, 10)["tensors"] == len(manifest.tensors)
    result, samples = _train(run, runs["dataset"], None)
    assert result.start_step == 10 and result.step == STEPS
    assert samples == runs["reference_samples"][10:STEPS]
    reference = PortableRun(str(runs["root"] / "reference")).read(STEPS).tensors
    continued = PortableRun(str(run)).read(STEPS).tensors
    keys = [k for k in reference if not k.endswith(".step")]
    _assert_close_state({k: reference[k] for k in keys}, {k: continued[k] for k in keys})


def test_refuses_a_run_of_another_optimizer(runs: dict[str, Any], tmp_path: Path) -> None:
    run = tmp_path / "sgd"
    shutil.copytree(runs["root"] / "torch5", run)
    info = json.loads((run / "run.json").read_text())
    info["config"]["optim"]["name"] = "sgd"
    (run / "run.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match="optim.name is 'sgd'") as err:
        load_train_state(str(run))
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ the AdamW maths


def _torch_adamw_steps(params0: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]],
                       cfg: OptimConfig, total: int) -> tuple[dict[str, torch.Tensor], Any]:
    """Baton's update in torch: decay groups, AdamW, clip_grad_norm_, LrSchedule."""
    params = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in params0.items()}
    groups = [{"params": [p for p in params.values() if p.dim() >= 2],
               "weight_decay": cfg.weight_decay},
              {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
    optim = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                              foreach=False)
    schedule = LrSchedule(optim, cfg, total)
    lrs = []
    for g in grads:
        for name, p in params.items():
            p.grad = torch.from_numpy(g[name].copy())
        torch.nn.utils.clip_grad_norm_(list(params.values()), cfg.grad_clip)
        lrs.append(optim.param_groups[0]["lr"])
        optim.step()
        schedule.step()
    return params, (optim, lrs)


@pytest.mark.parametrize("scale", [1e-9, 1.0, 50.0], ids=["eps-dominated", "plain", "clipped"])
def test_optax_update_is_torch_adamw_step_by_step(scale: float) -> None:
    rng = np.random.default_rng(0)
    params0 = {"w": rng.normal(size=(6, 4)).astype(np.float32),
               "b": rng.normal(size=(4,)).astype(np.float32)}
    grads = [{k: (scale * rng.normal(size=v.shape)).astype(np.float32)
              for k, v in params0.items()} for _ in range(7)]
    cfg = OptimConfig(lr=1e-2, warmup_steps=3, weight_decay=0.1, grad_clip=1.0, eps=1e-8)
    total = 7
    params_t, (optim, lrs) = _torch_adamw_steps(params0, grads, cfg, total)
    settings = AdamWSettings(b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip,
                             lrs=tuple(lr_at(cfg, total, t) for t in range(total + 1)))
    # The schedule's value at every step is the one torch's LrSchedule set (fp32 of it).
    assert [settings.lr(t) for t in range(total)] == lrs
    tx = baton_adamw(settings, {"w": True, "b": False})
    params = jax.tree.map(jnp.asarray, params0)
    opt_state = tx.init(params)
    for g in grads:
        updates, opt_state = tx.update(jax.tree.map(jnp.asarray, g), opt_state, params)
        params = optax.apply_updates(params, updates)
    adam = adam_state(opt_state)
    assert int(adam.count) == total
    for name, p in params_t.items():
        state = optim.state[p]
        for ours, theirs in ((params[name], p.detach()), (adam.mu[name], state["exp_avg"]),
                             (adam.nu[name], state["exp_avg_sq"])):
            np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), rtol=2e-6,
                                       atol=1e-7 * float(np.abs(theirs.numpy()).max()))


def test_set_adam_state_sets_count_moments_and_schedule() -> None:
    settings = AdamWSettings(0.9, 0.95, 1e-8, 0.1, 1.0, lrs=(0.1, 0.2, 0.3))
    params = {"w": jnp.ones((2, 2))}
    tx = baton_adamw(settings, {"w": True})
    state = set_adam_state(tx.init(params), 2, {"w": jnp.full((2, 2), 3.0)},
                           {"w": jnp.full((2, 2), 4.0)})
    counts = [int(s.count) for s in jax.tree.leaves(
        state, is_leaf=lambda n: isinstance(n, optax.ScaleByScheduleState))
        if isinstance(s, optax.ScaleByScheduleState)]
    assert counts == [2] and int(adam_state(state).count) == 2
    assert float(adam_state(state).mu["w"][0, 0]) == 3.0


# ------------------------------------------------------------------ layout maps


def test_gpt_map_round_trips_and_decays_matrices_only(runs: dict[str, Any]) -> None:
    snap = PortableRun(str(runs["root"] / "torch10")).read()
    model = {k[len("model."):]: v for k, v in snap.tensors.items() if k.startswith("model.")}
    layout = gpt_map(1)
    tree = layout.to_flax(model)
    assert tree["blocks_0"]["attn"]["qkv"]["kernel"].shape == (32, 96)  # (in, out)
    back = layout.to_torch(tree)
    assert all(np.array_equal(back[k], v) for k, v in model.items())
    decayed = {n for g in snap.component("optim")["param_groups"] if g["weight_decay"] > 0
               for n in g["params"]}
    assert decayed == {k for k, v in model.items() if v.ndim >= 2}
    mask = layout.decayed(decayed)
    assert mask["lm_head"]["kernel"] and not mask["ln_f"]["scale"]
    with pytest.raises(ValueError, match="not mapped .*extra"):
        layout.to_flax({**model, "extra": model["ln_f.bias"]})


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_map_gives_hf_logits(tied: bool) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
        rope_theta=500.0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    # The state dict, as a snapshot holds it: a tied lm_head.weight is there too (an alias).
    tensors = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    hf = json.loads(config.to_json_string())
    layout = llama_map_for(hf)
    params = jax.tree.map(jnp.asarray, layout.to_flax(tensors))
    assert params["layers_0"]["attn"]["qkv"]["kernel"].shape == (32, 32 + 2 * 16)  # fused
    tokens = np.random.default_rng(1).integers(0, 64, (2, 12))
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    got = np.asarray(FlaxLlama.from_hf_config(hf).apply({"params": params}, jnp.asarray(tokens)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    back = layout.to_torch(jax.tree.map(np.asarray, params))
    assert sorted(back) == sorted(tensors)
    assert all(np.array_equal(back[k], v) for k, v in tensors.items())
