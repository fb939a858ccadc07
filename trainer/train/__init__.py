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
    from trainer.train.continuation import (
        HF_MODEL_CONFIG_KEY,
        SESSIONS_NAME,
        TENSOR_SHAPE_FIELDS,
        RunDirError,
        bounded_number,
        check_continuation,
        model_config_record,
        read_sessions,
        saved_schedule,
        schedule_changes,
        schedule_of,
        shape_value,
    )
    from trainer.train.hf import export_hf
    from trainer.train.loop import WorkerEnv, run_worker
    from trainer.train.model import GPT, SKETCH_LAYERS
    from trainer.train.model_build import build_model, next_token_loss
    from trainer.train.optim import describe_schedule, lr_at, optimizer_change
    from trainer.train.session import (
        Session,
        UsageError,
        WorkerContext,
        open_session,
        run_directory,
        worker_context,
    )
    from trainer.train.sketch_measure import MIB, PlanReport, plan_and_measure, train_dtype
    from trainer.train.story import ORIGIN_KEY, StoryRule

# Loaded on first use (PEP 562): the module that defines each name.
_LAZY = {
    "HF_MODEL_CONFIG_KEY": "trainer.train.continuation",
    "RunDirError": "trainer.train.continuation",
    "SESSIONS_NAME": "trainer.train.continuation",
    "TENSOR_SHAPE_FIELDS": "trainer.train.continuation",
    "bounded_number": "trainer.train.continuation",
    "check_continuation": "trainer.train.continuation",
    "model_config_record": "trainer.train.continuation",
    "read_sessions": "trainer.train.continuation",
    "saved_schedule": "trainer.train.continuation",
    "schedule_changes": "trainer.train.continuation",
    "schedule_of": "trainer.train.continuation",
    "shape_value": "trainer.train.continuation",
    "export_hf": "trainer.train.hf",
    "WorkerEnv": "trainer.train.loop",
    "run_worker": "trainer.train.loop",
    "GPT": "trainer.train.model",
    "SKETCH_LAYERS": "trainer.train.model",
    "build_model": "trainer.train.model_build",
    "next_token_loss": "trainer.train.model_build",
    "describe_schedule": "trainer.train.optim",
    "lr_at": "trainer.train.optim",
    "optimizer_change": "trainer.train.optim",
    "Session": "trainer.train.session",
    "UsageError": "trainer.train.session",
    "WorkerContext": "trainer.train.session",
    "open_session": "trainer.train.session",
    "run_directory": "trainer.train.session",
    "worker_context": "trainer.train.session",
    "MIB": "trainer.train.sketch_measure",
    "PlanReport": "trainer.train.sketch_measure",
    "plan_and_measure": "trainer.train.sketch_measure",
    "train_dtype": "trainer.train.sketch_measure",
    "ORIGIN_KEY": "trainer.train.story",
    "StoryRule": "trainer.train.story",
}

__all__ = ["GPT", "HF_MODEL_CONFIG_KEY", "MIB", "ORIGIN_KEY", "PlanReport", "RunDirError",
           "SESSIONS_NAME", "SKETCH_LAYERS", "Session", "StoryRule", "TENSOR_SHAPE_FIELDS",
           "UsageError", "WorkerContext", "WorkerEnv", "bounded_number", "build_model",
           "check_continuation", "describe_schedule", "export_hf", "lr_at", "model_config_record",
           "next_token_loss", "open_session", "optimizer_change", "plan_and_measure",
           "read_sessions", "run_directory", "run_worker", "saved_schedule", "schedule_changes",
           "schedule_of", "shape_value", "train_dtype", "worker_context"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer.train' has no attribute {name!r}")
    # Looked up each time, not cached here: the name stays its module's (a patch is seen).
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
