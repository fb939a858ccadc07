"""Safetensors dtype names <-> numpy dtypes, and the JSON state of a snapshot decoded.

Contract
--------
* ``numpy_dtype(name)``: the little-endian numpy dtype of a safetensors dtype name the format
  allows (``elastic.format.records.DTYPE_NAMES``). ``BF16`` has no numpy dtype: it is
  ``ml_dtypes.bfloat16`` (installed with JAX); without ml_dtypes a BF16 tensor is refused in
  one line naming the tensor and the fix.
* ``dtype_name(dtype)``: the inverse, for the writer; an unsupported dtype (complex, uint16,
  object, ...) is ``ValueError`` naming it and the supported ones.
* ``decode_state(tree, tensors)``: a manifest's ``state`` (or one component of it) with every
  ``{"__tensor__": key}`` replaced by ``tensors[key]``, ``{"__tuple__": [...]}`` by a tuple and
  ``{"__items__": [[k, v], ...]}`` by a dict with non-string keys (the tags
  ``elastic.state.registry`` writes). The tree was checked by ``elastic.format.manifest_check`` when
  the manifest was parsed; nothing in it is executed.

numpy only: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from elastic.errors import ManifestError
from elastic.format import ITEMS_TAG, TENSOR_TAG, TUPLE_TAG

# Explicit little-endian: safetensors stores every element little-endian.
_NUMPY: dict[str, str] = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4",
                          "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}


def numpy_dtype(name: str, key: str = "") -> np.dtype[Any]:
    """The numpy dtype of safetensors dtype ``name`` (module contract)."""
    if name == "BF16":
        try:
            import ml_dtypes
        except ImportError:
            raise ManifestError(f"tensor {key!r} is BF16, which numpy cannot hold; "
                                "pip install ml-dtypes (JAX installs it)") from None
        return np.dtype(ml_dtypes.bfloat16)
    if name not in _NUMPY:
        raise ManifestError(f"tensor {key!r}: unknown dtype {name!r}")
    return np.dtype(_NUMPY[name])


def dtype_name(dtype: np.dtype[Any], key: str = "") -> str:
    """The safetensors name of numpy ``dtype`` (module contract)."""
    if dtype.name == "bfloat16":
        return "BF16"
    for name, code in _NUMPY.items():
        if np.dtype(code) == dtype.newbyteorder("<") or np.dtype(code) == dtype:
            return name
    raise ValueError(f"tensor {key!r} has dtype {dtype}, which a snapshot cannot hold; "
                     f"supported: {sorted([*_NUMPY, 'BF16'])}")


def decode_state(tree: Any, tensors: Mapping[str, Any]) -> Any:
    """``tree`` with tensor references, tuples and non-string-keyed dicts decoded."""
    if isinstance(tree, dict):
        if TENSOR_TAG in tree:
            return tensors[tree[TENSOR_TAG]]
        if TUPLE_TAG in tree:
            return tuple(decode_state(v, tensors) for v in tree[TUPLE_TAG])
        if ITEMS_TAG in tree:
            return {_key(k): decode_state(v, tensors) for k, v in tree[ITEMS_TAG]}
        return {k: decode_state(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [decode_state(v, tensors) for v in tree]
    return tree


def _key(key: Any) -> Any:
    # A key of an __items__ pair is a scalar or a {"__tuple__": [...]} of scalars.
    if isinstance(key, dict) and TUPLE_TAG in key:
        return tuple(_key(k) for k in key[TUPLE_TAG])
    return key
