"""The worker: what runs in every training process, under Ray or not.

The room's modules
------------------
* ``session``: ``Session``, the public API of a training function (restore, snapshot at step
  boundaries, preemption, planned resizes, commit at the end); ``session_setup``: what a
  Session starts from (the worker context) and what it refuses; ``data_loader``: the elastic
  ``DataLoader`` a Session makes; ``step_checks``: the loop and the Session agree on what a
  step is (a batch not trained on, no step boundary, another global batch, a loop's own
  accumulation at an uneven split), or it fails in one line.
* ``loop``: Baton's own training loop over a Session (``run_worker``: build, train one step,
  record), the one ``baton fit`` runs on every worker; ``nonfinite``: what it does with a
  step whose loss is NaN or Inf (stop before the update, or skip it).
* ``model`` (the built-in GPT), ``hf`` (Hugging Face causal LMs from local files, and their
  export), ``optim`` (optimizers and learning-rate schedules), ``parallel`` (DDP / FSDP2),
  ``precision`` (autocast, loss scaling).
* ``continuation``: what a continued run must keep (the check every worker's rank 0 applies,
  as the driver does before Ray starts) and the records it reads (``run.json``, the session
  log's schedules).
* ``sketch_measure``: a recipe's model built as a run builds it, one step measured exact and
  with what ``sketch.include = "auto"`` chooses (``baton sketch-plan``).

Import rule (``tests/project/test_imports.py``): the worker imports ``trainer.config``,
``elastic``, ``data_state`` and ``sketch_ops``, never the driver (``trainer.run``), Ray
(``trainer.on_ray`` hands it its context) or a command. Nothing here imports Ray.

The names below are loaded on first use, so importing one module of the room does not load
the others.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.train.loop import WorkerEnv, WorkerResult, run_worker
    from trainer.train.session import Session, UsageError, WorkerContext, worker_context

_LAZY = {
    "Session": "trainer.train.session",
    "UsageError": "trainer.train.session",
    "WorkerContext": "trainer.train.session",
    "WorkerEnv": "trainer.train.loop",
    "WorkerResult": "trainer.train.loop",
    "run_worker": "trainer.train.loop",
    "worker_context": "trainer.train.session",
}

__all__ = ["Session", "UsageError", "WorkerContext", "WorkerEnv", "WorkerResult", "run_worker",
           "worker_context"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
