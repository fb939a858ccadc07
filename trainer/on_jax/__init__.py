"""Continue a Baton run in JAX, and back: Flax parameters, optax AdamW state, the data position.

    from trainer.on_jax import load_train_state, save_train_state
    state = load_train_state("runs/tiny")          # params, optax.adamw state, step, cursor
    loader = state.loader()                         # numpy batches, the run's sample order
    for _ in range(5):
        tokens = np.concatenate([mb.tokens for mb in loader.next_step()])
        state.train_step(tokens)
        loader.advance()
    state.data = loader.state_dict()
    save_train_state("runs/tiny", state)            # a PyTorch run continues from here

Modules: ``state`` (snapshot <-> ``JaxTrainState``), ``load_checks`` (what a load reads and
refuses; ``SketchNotCarriedWarning``), ``save_checks`` (what a save refuses before writing:
the trainer's story rule, the run's hyper-parameters, shapes), ``optim`` (Baton's AdamW as
optax), ``layout_map`` (declared name/layout maps, tied aliases, ready for the built-in GPT and
Llama), ``gpt`` and ``llama`` (their Flax forwards), ``models`` (which one a run has, or the
user's own through ``layout=``), ``export`` (``baton snapshots export --format orbax|npz``).
Needs the optional extra ``baton-train[jax]``.

Why under ``trainer``: the adapter composes the snapshot format (``elastic.portable``, which
needs no torch) with what the trainer knows — its models' parameter names, the optimizer's
param-group rule, the learning-rate schedule (``trainer.train.optim.lr_at``, used as is, not
re-implemented) — and DESIGN's import direction lets only ``trainer`` compose them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.on_jax.export import export_npz, export_orbax
    from trainer.on_jax.layout_map import LayoutMap, Rule
    from trainer.on_jax.load_checks import SketchNotCarriedWarning
    from trainer.on_jax.state import JaxTrainState, load_train_state, save_train_state

# Loaded on first use (PEP 562): the module that defines each name.
_LAZY = {
    "export_npz": "trainer.on_jax.export",
    "export_orbax": "trainer.on_jax.export",
    "LayoutMap": "trainer.on_jax.layout_map",
    "Rule": "trainer.on_jax.layout_map",
    "SketchNotCarriedWarning": "trainer.on_jax.load_checks",
    "JaxTrainState": "trainer.on_jax.state",
    "load_train_state": "trainer.on_jax.state",
    "save_train_state": "trainer.on_jax.state",
}

__all__ = ["JaxTrainState", "LayoutMap", "Rule", "SketchNotCarriedWarning", "export_npz",
           "export_orbax", "load_train_state", "save_train_state"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer.on_jax' has no attribute {name!r}")
    # Looked up each time, not cached here: the name stays its module's (a patch is seen).
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
