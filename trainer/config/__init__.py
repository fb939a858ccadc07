"""The recipe: `FitConfig`, its sections and their checks, loaded from TOML.

The room's modules
------------------
* ``recipe``: ``FitConfig`` (the whole run), ``load_recipe`` (TOML + ``key=value``
  overrides), ``from_dict``, ``apply_override``; its docstring is the room's contract.
* ``model``: the model-side sections, ``[model]`` (the built-in GPT or a Hugging Face model
  from local files) and ``[sketch]`` (BASIS).
* ``training``: ``[data]``, ``[optim]``, ``[snapshots]``, ``[scaling]``, ``[eval]``,
  ``[logging]``, ``[precision]``.
* ``recovery``: ``[recovery]`` (in-process recovery of a lost worker's survivors).
* ``checks``: ``ConfigError`` and the validation every section shares.
* ``recipe_doc``: ``docs/recipes.md``, generated from the fields' own comments
  (``python -m trainer.config.recipe_doc``).

Import rule (``tests/project/test_imports.py``): the config room is the lowest of
``trainer``'s rooms; it imports ``elastic.storage`` and ``sketch_ops``, never the worker
(``trainer.train``), the driver (``trainer.run``), Ray or the commands. Nothing here starts a
process or reads anything a recipe names beyond local model config files.

Callers outside the room import the names below from here.
"""

from __future__ import annotations

from trainer.config.checks import ConfigError
from trainer.config.model import (
    ModelConfig,
    SketchConfig,
    check_local_source,
    hf_source_field,
    raw_hf_config,
    require_transformers,
)
from trainer.config.recipe import FitConfig, apply_override, from_dict, load_recipe
from trainer.config.recovery import RecoveryConfig
from trainer.config.training import (
    PRECISIONS,
    SCHEDULES,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    OptimConfig,
    PrecisionConfig,
    ScalingSettings,
    SnapshotConfig,
)

__all__ = ["ConfigError", "DataConfig", "EvalConfig", "FitConfig", "LoggingConfig", "ModelConfig",
           "OptimConfig", "PRECISIONS", "PrecisionConfig", "RecoveryConfig", "SCHEDULES",
           "ScalingSettings", "SketchConfig", "SnapshotConfig", "apply_override",
           "check_local_source", "from_dict", "hf_source_field", "load_recipe", "raw_hf_config",
           "require_transformers"]
