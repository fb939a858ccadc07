"""``baton snapshots export --format orbax|npz``: a snapshot for JAX users' own tools.

Contract
--------
* ``export_npz(run_uri, step, out)`` writes every logical tensor of snapshot ``step`` under its
  snapshot key (``model.<fqn>``, ``optim.state.<fqn>.exp_avg``, ...) in PyTorch layout into
  one ``.npz`` file, plus ``__state__``: the snapshot's JSON state as a 0-d string array (its
  ``{"__tensor__": key}`` leaves name the arrays). ``numpy.load(out)`` reads it with
  ``allow_pickle=False``; no framework is needed. torch-free (``elastic.portable``).
* ``export_orbax(run_uri, step, out)`` writes the run's JAX train state
  (``trainer.on_jax.state.load_train_state``: the run's ready layout map) as an Orbax checkpoint
  in ``out/state`` — ``{"params": <Flax tree>, "opt_state": {"count", "mu", "nu"}, "step"}``,
  restored by ``orbax.checkpoint.StandardCheckpointer().restore(out / "state")`` with no
  Baton import — and ``out/baton.json``: the step, the data cursor, the seed, the AdamW
  settings (b1, b2, eps, weight decay and its mask per Flax path, grad clip), the learning
  rate of every update (``lrs``), the layout map's name and the recipe. ``out`` must not exist.
  It is written as a directory beside ``out``, renamed at the end; any failure (a full disk:
  Orbax's ``RESOURCE_EXHAUSTED``) removes it and raises one ``OSError`` line (Orbax's own
  logged tracebacks held back), so nothing is left and a retry is not refused.
* ``export_npz`` writes a file beside ``out`` and renames it over ``out`` at the end
  (``elastic.storage.replaced_file``): a link at ``out`` is replaced, never written through.

Both read through the neutral reader (every byte verified) and write only to ``out``, after
everything was read: a snapshot that fails a check writes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from elastic.portable import PortableRun
from elastic.storage import new_directory, replaced_file


def export_npz(run_uri: str, step: int, out: str) -> int:
    """Write snapshot ``step`` as one ``.npz`` file; returns the number of tensors."""
    snap = PortableRun(run_uri).read(step)
    arrays: dict[str, Any] = dict(snap.tensors)
    arrays["__state__"] = np.array(json.dumps(snap.state))
    with replaced_file(out) as tmp, open(tmp, "wb") as fh:  # renamed over out at the end
        np.savez(fh, **arrays)  # a file object: numpy appends no ".npz" to the name
    return len(snap.tensors)


def export_orbax(run_uri: str, step: int, out: str) -> int:
    """Write snapshot ``step`` as an Orbax checkpoint of the JAX train state (contract);
    returns the number of parameter arrays."""
    import jax
    import orbax.checkpoint as ocp

    from trainer.on_jax.load_checks import SketchNotCarriedWarning
    from trainer.on_jax.optim import adam_state
    from trainer.on_jax.state import load_train_state

    with warnings.catch_warnings():
        # An export trains nothing: that a sketched run continues with exact gradients is
        # for whoever trains on, not a line on the export's stderr.
        warnings.simplefilter("ignore", SketchNotCarriedWarning)
        state = load_train_state(run_uri, step)
    adam = adam_state(state.opt_state)
    tree = {"params": state.params,
            "opt_state": {"count": adam.count, "mu": adam.mu, "nu": adam.nu},
            "step": np.asarray(state.step, dtype=np.int64)}
    mask = state.layout.decayed({n for n in state.layout.torch_names
                                 if _decays(state.skeleton, n)})
    info = {"format": "baton-jax-export", "step": state.step, "data": state.data,
            "seed": state.seed, "layout": state.layout.name,
            "adamw": {"b1": state.settings.b1, "b2": state.settings.b2,
                      "eps": state.settings.eps, "weight_decay": state.settings.weight_decay,
                      "grad_clip": state.settings.grad_clip,
                      "decayed": sorted("/".join(p) for p, on in _leaves(mask) if on)},
            "lrs": list(state.settings.lrs), "config": state.config}
    # Written in a directory beside out and renamed at the end: a failure (a full disk)
    # leaves nothing, so the retry is not refused as "exists".
    try:
        with new_directory(out) as root, _quiet():
            with ocp.StandardCheckpointer() as checkpointer:
                checkpointer.save(os.path.join(root, "state"), tree)
                checkpointer.wait_until_finished()
            with open(os.path.join(root, "baton.json"), "w") as fh:
                json.dump(info, fh, indent=1)
    except Exception as err:  # Orbax's own errors (RESOURCE_EXHAUSTED) included
        raise OSError(f"cannot write the Orbax checkpoint {out} ({_reason(err)}); nothing "
                      "was left there: free space or name another --out") from err
    return len(jax.tree.leaves(state.params))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Orbax's background threads log each failure with its traceback (four of them for one
    full disk) and print more to stderr: held back while it writes, shown again only when it
    succeeded (a failure is the one line of ``export_orbax``'s error)."""
    held: list[logging.LogRecord] = []
    absl = logging.getLogger("absl")

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    absl.addFilter(hold)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            yield
    finally:
        absl.removeFilter(hold)
    for record in held:
        absl.handle(record)
    sys.stderr.write(printed.getvalue())


def _reason(err: BaseException) -> str:
    """One line for a failed write: the errno's name where there is one."""
    text = " ".join(str(err).split())
    code = err.errno if isinstance(err, OSError) else None
    if code is not None and code in errno.errorcode:
        return f"{errno.errorcode[code]}: {getattr(err, 'strerror', None) or text}"
    if "No space left on device" in text or "os_error_code='28'" in text:
        return "ENOSPC: no space left on device"
    return text[:300]


def _decays(skeleton: dict[str, Any], name: str) -> bool:
    groups = skeleton["optim"]["param_groups"]
    return any(name in g["params"] and g["weight_decay"] > 0 for g in groups)


def _leaves(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...],
                                                                             Any]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _leaves(value, (*prefix, key))
        else:
            out.append(((*prefix, key), value))
    return out
