"""Rewinding a run to an older snapshot, and bringing set-aside snapshots back.

A restore never moves a newer committed snapshot aside because it does not fit the running
code (``elastic.snapshotter``: it refuses in one line, naming the newest snapshot, what does
not fit and the newest one that does). Going back is a person's decision, made here:

* ``rewind(store, to_step)`` first reads and verifies every chunk of committed snapshot
  ``to_step`` (``elastic.catalog.verify``), then moves every committed snapshot newer than it to
  ``RUN/quarantine/`` (one rename each, never a delete), each with a ``reason.json`` recording
  the step rewound to and the first generation that may not be part of their history (the
  run's ``generation.json`` + 1: the next session's). Returns ``[(step, where)]`` of what was
  set aside. Refuses in one ``ValueError`` line a step that is not committed, or the newest one.
* ``restore_quarantined(store, step=None)`` moves quarantined snapshots (all, or those of
  ``step``) back into ``snapshots/``, oldest first, each only when
  - its ``reason.json`` records the generation it was set aside at (a quarantine by an older
    Baton, or by hand, stays: the message gives the ``mv`` to do if you are sure);
  - its step is not committed now;
  - no snapshot committed now was written by that generation or a later one (the run trained
    on from the older step: bringing a snapshot of the other history back would mix the two;
    a manifest that cannot be read counts as such a snapshot: doubt never mixes);
  - it verifies where it lies: every chunk read and checked (a snapshot quarantined for a
    definite integrity failure fails here and stays).
  The manifest arrives last (``SnapshotStore.unquarantine``). Returns ``(restored steps,
  [(step, why it stayed)])``; each reason is one line.
* The caller holds the run lease through ``elastic.lease.held_lease`` (``baton snapshots
  rewind`` / ``restore-quarantined``: renewed while the command lasts, since verifying a large
  snapshot may outlast its ttl), so neither runs beside a live driver (``LeaseHeldError``
  names it). Given that ``lease``, both check it is still held before each move
  (``LeaseLostError`` otherwise: nothing more is moved).
"""

from __future__ import annotations

from typing import Any

from elastic.catalog import verify
from elastic.coord import read_generation
from elastic.format import parse_shard_name
from elastic.lease import LeaseLostError, RunLease
from elastic.store import SnapshotStore


def _still_held(lease: RunLease | None) -> None:
    """Before each move: stop if the lease was taken over meanwhile (``LeaseLostError``)."""
    if lease is not None and lease.lost:
        raise LeaseLostError(lease.lost)


def rewind(store: SnapshotStore, to_step: int, lease: RunLease | None = None
           ) -> list[tuple[int, str]]:
    """Set aside every committed snapshot newer than ``to_step`` (module contract)."""
    committed = store.committed_steps()
    if to_step not in committed:
        raise ValueError(f"{store.run_uri}: step {to_step} is not a committed snapshot "
                         f"(committed: {committed or 'none'}); rewind to one of them")
    newer = [s for s in committed if s > to_step]
    if not newer:
        raise ValueError(f"{store.run_uri}: {to_step} is the newest committed snapshot; "
                         "there is nothing newer to set aside")
    verify(store, to_step)  # a rewind onto a corrupt snapshot would go back further still
    since = read_generation(store) + 1  # the next session's generation and later ones
    moved = []
    for step in newer:
        _still_held(lease)
        moved.append((step, store.quarantine_step(
            step, f"set aside by a rewind to step {to_step}", generation=since,
            rewound_to=to_step)))
    return moved


def restore_quarantined(store: SnapshotStore, step: int | None = None,
                        lease: RunLease | None = None
                        ) -> tuple[list[int], list[tuple[int, str]]]:
    """Bring quarantined snapshots back where that is safe (module contract)."""
    rows = [r for r in store.quarantined() if step is None or r["step"] == step]
    if step is not None and not rows:
        raise ValueError(f"{store.run_uri}: no quarantined snapshot of step {step}")
    committed = {c: _generation_of(store, c) for c in store.committed_steps()}
    restored: list[int] = []
    kept: list[tuple[int, str]] = []
    for row in rows:
        why = _why_it_stays(store, row, committed)
        if why is not None:
            kept.append((row["step"], why))
            continue
        _still_held(lease)
        store.unquarantine(row["where"], row["step"])
        committed[row["step"]] = -1  # back from before the rewind: part of the old history
        restored.append(row["step"])
    return restored, kept


def _why_it_stays(store: SnapshotStore, row: dict[str, Any],
                  committed: dict[int, int | None]) -> str | None:
    """Why the quarantined snapshot ``row`` must stay where it is, or None."""
    step, where, since = row["step"], row["where"], row["generation"]
    if since is None:
        return (f"{where} has no record of when it was set aside (quarantined by hand or by an "
                "older Baton); if you are sure it belongs to the run's history: mv "
                f"{where} {store.step_path(step)}")
    if step in committed:
        return f"step {step} is committed again: the run trained past it since"
    newer = sorted(c for c, gen in committed.items() if gen is None or gen >= since)
    if newer:
        return (f"snapshot {newer[-1]} was committed after it was set aside (the run trained "
                f"on from an older step): bringing it back would mix two histories, so it "
                f"stays in {where}")
    try:
        verify(store.viewing(step, where), step)
    except (ValueError, OSError) as err:
        return f"it does not verify: {' '.join(str(err).split())}"
    return None


def _generation_of(store: SnapshotStore, step: int) -> int | None:
    """The newest generation that wrote committed snapshot ``step`` (-1 for a snapshot of
    the format before generations), None when its manifest cannot be read."""
    try:
        manifest = store.load_manifest(step)
    except (ValueError, OSError):
        return None
    generations = [parsed[2] for parsed in map(parse_shard_name, manifest.files)
                   if parsed is not None and parsed[2] is not None]
    return max(generations, default=-1)
