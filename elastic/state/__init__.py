"""What a snapshot holds: the registered state of a run and how it is cut into chunks.

* ``registry``: ``StateRegistry``, every stateful component under one fixed key, flattened
  into tensors and JSON and loaded back (``SnapshotMismatchError`` for another model).
* ``module_state``: a model and its optimizer as state dicts keyed by parameter FQN, as DCP
  keys them.
* ``layout``: who writes which chunk at save time (``owned_pieces``) and which rectangle each
  rank needs at load time (``Target``, ``target_piece``).

Imports ``elastic.format`` and below; never the rooms that write, read or commit.
"""

from __future__ import annotations

from elastic.state.layout import (
    DEFAULT_SPLIT_MIN_BYTES,
    OwnedPiece,
    Piece,
    Target,
    owned_pieces,
    storage_owners,
    target_piece,
    with_fill,
)
from elastic.state.module_state import ModelState, OptimizerState
from elastic.state.registry import (
    FlatState,
    SnapshotMismatchError,
    Stateful,
    StateRegistry,
    encode_tree,
)

__all__ = ["DEFAULT_SPLIT_MIN_BYTES", "FlatState", "ModelState", "OptimizerState", "OwnedPiece",
           "Piece", "SnapshotMismatchError", "StateRegistry", "Stateful", "Target", "encode_tree",
           "owned_pieces", "storage_owners", "target_piece", "with_fill"]
