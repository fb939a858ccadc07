"""A Ray Data pipeline as units that can each be read on their own: where resuming starts.

Contract:
- `pipeline_units(ds, units=None)` checks the pipeline and lists its units: the files of a
  `read_parquet` (Ray Data's file reads, `ListFiles -> ReadFiles`); the read tasks of any
  other datasource read (`read_csv`, `read_text`, `read_json`, `range`, a custom
  `Datasource`), asked for at a fixed parallelism (`units`, else the read's
  `override_num_blocks`, else 64) so that the same data gives the same units on any cluster;
  the blocks of data held in memory (`from_items`, `from_pandas`, `materialize()`: how many
  depends on how it was made, so pass `override_num_blocks` to keep them across clusters).
  Returns `PipelineUnits`: `count` units, each with a `label` (its files, or its read task's
  metadata) that names it in errors and in the data's `fingerprint`.
- `PipelineUnits.dataset(k)` is the user's pipeline with only unit k as input: every
  operator after the read (`map`, `map_batches`, `filter`, `flat_map`, column selections) is
  kept and runs as Ray Data runs it (tasks or actors, on any node); the order of its output
  is kept (`preserve_order`). Unit k's output is the rows the whole pipeline makes from unit
  k's input, so the epoch's rows are the union of the units' and each can be read again, alone,
  to resume mid-epoch without reading what came before.
- Refused, in one `ValueError` line naming the operator and the fix: a pipeline whose rows
  depend on more than one unit or on chance (`random_shuffle`, `randomize_block_order`,
  `repartition`, `sort`, `groupby`, `limit`, `union`, `zip`, `join`, a file shuffle of the
  read): Baton orders the rows itself, by `(seed, epoch)` (`data_state.stream_order`).
It reaches into Ray Data's logical plan (`ray.data._internal.logical`), hence the pinned Ray
range; tests/ray/test_ray_data_units.py runs it on this Ray.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import ray
from ray.data import Dataset
from ray.data._internal.logical.interfaces import LogicalOperator, LogicalPlan
from ray.data._internal.logical.operators import (
    AbstractFrom,
    AbstractMap,
    FromArrow,
    InputData,
    ListFiles,
    Read,
    ReadFiles,
)
from ray.data._internal.util import get_table_block_metadata_schema
from ray.data.datasource import Datasource

DEFAULT_UNITS = 64

# Operators whose output row depends on rows of other units, or on chance: what to do instead.
_REFUSED = {
    "RandomShuffle": "random_shuffle() draws a new order at every read; remove it and pass "
                     "shuffle=True to data_loader (Baton shuffles by (seed, epoch))",
    "RandomizeBlocks": "randomize_block_order() draws a new order at every read; remove it "
                       "and pass shuffle=True to data_loader (Baton shuffles by (seed, epoch))",
    "Repartition": "repartition() mixes rows of several files; remove it (Baton reads each "
                   "file or read task as a unit) or write the repartitioned dataset first",
    "Sort": "sort() orders rows across files; sort when writing the dataset, or drop it",
    "Aggregate": "groupby()/aggregate() mixes rows of several files; aggregate when writing "
                 "the dataset",
    "Limit": "limit() depends on the order rows arrive in; drop it (train for fewer steps)",
    "Union": "union() of datasets: read every file in one read (a list of paths)",
    "Zip": "zip() pairs rows of two datasets; write the zipped dataset first",
    "Join": "join() mixes rows of two datasets; write the joined dataset first",
    "Mix": "mixing datasets: write the mixture first",
}


@dataclass(frozen=True)
class PipelineUnits:
    """The units of a checked pipeline (module contract)."""

    source: Dataset
    labels: tuple[str, ...]
    kind: str  # "files" (ListFiles -> ReadFiles), "read_tasks" (Read) or "blocks" (in memory)
    parallelism: int  # for "read_tasks": the parallelism the tasks were asked for
    paths: tuple[str, ...] = ()  # for "files": unit k reads paths[k]
    manifests: tuple[Any, ...] = ()  # for "files": unit k's row of the listing (pyarrow)
    bundles: tuple[Any, ...] = ()  # for "blocks": unit k's blocks (a Ray Data RefBundle)

    @property
    def count(self) -> int:
        return len(self.labels)

    @property
    def fingerprint(self) -> str:
        """What the data is: its operators and its units (a changed file list shows here)."""
        ops = [op.name for op in _chain(self.source._logical_plan.dag)]
        digest = hashlib.blake2b(json.dumps([ops, self.kind, list(self.labels)]).encode(),
                                 digest_size=12)
        return f"ray-data:{'>'.join(ops)}:{self.count}:{digest.hexdigest()}"

    def dataset(self, unit: int) -> Dataset:
        """The pipeline with unit `unit` alone as its input (module contract)."""
        if not 0 <= unit < self.count:
            raise IndexError(f"unit {unit} of {self.count}")
        if self.kind == "files":
            # The listing's row for this file stands in for the listing: listing a file again
            # costs a second Ray task (about a second) for each unit read. Its metadata is
            # computed here, not in a task (`from_arrow` asks for a CPU the trainers may hold).
            row = self.manifests[unit]
            listed = FromArrow([ray.put(row)],  # type: ignore[list-item]
                               [get_table_block_metadata_schema(row)])

            def one(op: LogicalOperator) -> LogicalOperator:
                return listed if isinstance(op, ListFiles) else op
        elif self.kind == "blocks":
            held = InputData(input_data=[self.bundles[unit]])

            def one(op: LogicalOperator) -> LogicalOperator:
                return held if isinstance(op, (AbstractFrom, InputData)) else op
        else:
            source = _OneReadTask(_read_op(self.source).datasource, self.parallelism, unit)

            def one(op: LogicalOperator) -> LogicalOperator:
                if isinstance(op, Read):
                    return dataclasses.replace(op, datasource=source,
                                               datasource_or_legacy_reader=source,
                                               parallelism=1)
                return op
        dag = self.source._logical_plan.dag._apply_transform(one)
        context = self.source.context.copy()
        context.execution_options.preserve_order = True
        return Dataset(LogicalPlan(dag, context), context, self.source._in_stats)


def pipeline_units(ds: Any, units: int | None = None) -> PipelineUnits:
    """Check `ds` and list its units (module contract)."""
    if not isinstance(ds, Dataset):
        raise ValueError(f"expected a ray.data.Dataset, got {type(ds).__name__}")
    if units is not None and (isinstance(units, bool) or not isinstance(units, int)
                              or units < 1):
        raise ValueError(f"units must be a positive integer, got {units!r}")
    chain = _chain(ds._logical_plan.dag)
    source = chain[0]
    if isinstance(source, ListFiles):
        paths, sizes, manifests = _files(ds, source)
        labels = tuple(f"{p} ({n} bytes)" for p, n in zip(paths, sizes, strict=True))
        return PipelineUnits(ds, labels, "files", 0, paths, manifests)
    if isinstance(source, Read):
        parallelism = units or (source.parallelism if source.parallelism > 0 else DEFAULT_UNITS)
        tasks = source.datasource.get_read_tasks(parallelism)
        labels = tuple(_task_label(i, t.metadata) for i, t in enumerate(tasks))
        return PipelineUnits(ds, labels, "read_tasks", parallelism)
    if isinstance(source, (AbstractFrom, InputData)):
        bundles = tuple(source.input_data)
        labels = tuple(f"block {i} ({b.num_rows()} rows)" for i, b in enumerate(bundles))
        return PipelineUnits(ds, labels, "blocks", 0, bundles=bundles)
    raise ValueError(f"Ray Data pipeline: it starts from {source.name}, which Baton cannot "
                     "read in units; read files or a datasource")


def _chain(dag: LogicalOperator) -> list[LogicalOperator]:
    """The operators from the source to `dag`, refusing all but one linear per-row chain."""
    chain: list[LogicalOperator] = []
    op: LogicalOperator | None = dag
    while op is not None:
        name = type(op).__name__
        if name in _REFUSED:
            raise ValueError(f"Ray Data pipeline: {_REFUSED[name]}")
        inputs = op.input_dependencies
        if len(inputs) > 1:
            raise ValueError(f"Ray Data pipeline: {name} reads several datasets; write the "
                             "combined dataset first")
        if inputs and not isinstance(op, AbstractMap):
            raise ValueError(f"Ray Data pipeline: {name} is not a per-row step (map, "
                             "map_batches, filter, flat_map, select_columns); Baton cannot "
                             "resume it mid-epoch")
        chain.append(op)
        op = inputs[0] if inputs else None
    chain.reverse()
    if isinstance(chain[0], ListFiles) and chain[0].shuffle_config_factory() is not None:
        raise ValueError("Ray Data pipeline: read_parquet(shuffle=...) draws a new file order "
                         "at every read; remove it and pass shuffle=True to data_loader")
    if isinstance(chain[0], ListFiles) and not (len(chain) > 1 and isinstance(chain[1],
                                                                           ReadFiles)):
        raise ValueError("Ray Data pipeline: a file listing that is not read")
    return chain


def _read_op(ds: Dataset) -> Read:
    source = _chain(ds._logical_plan.dag)[0]
    assert isinstance(source, Read)
    return source


def _files(ds: Dataset, listing: ListFiles) -> tuple[tuple[str, ...], tuple[int, ...],
                                                   tuple[Any, ...]]:
    """The listing's files sorted by path: paths, sizes and each file's row of the listing."""
    from ray.data._internal.datasource_v2.interfaces.file_manifest import (
        FILE_SIZE_COLUMN_NAME,
        PATH_COLUMN_NAME,
    )

    context = ds.context.copy()
    refs = Dataset(LogicalPlan(listing, context), context, ds._in_stats).to_arrow_refs()
    tables = [t for t in (ray.get(r) for r in refs) if t.num_rows]
    if not tables:
        return (), (), ()
    manifest = pa.concat_tables(tables).sort_by(PATH_COLUMN_NAME)
    paths = tuple(str(p) for p in manifest.column(PATH_COLUMN_NAME).to_pylist())
    sizes = tuple(int(n) for n in manifest.column(FILE_SIZE_COLUMN_NAME).to_pylist())
    return paths, sizes, tuple(manifest.slice(i, 1) for i in range(manifest.num_rows))


def _task_label(index: int, metadata: Any) -> str:
    files = ",".join(metadata.input_files or ())
    return (f"read task {index} ({metadata.num_rows} rows, {metadata.size_bytes} bytes"
            + (f", {files})" if files else ")"))


class _OneReadTask(Datasource):
    """A datasource's read task `index` (of those it gives at `parallelism`), alone."""

    def __init__(self, inner: Datasource, parallelism: int, index: int) -> None:
        self._inner, self._parallelism, self._index = inner, parallelism, index

    def get_name(self) -> str:
        return self._inner.get_name()

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[Any]:
        tasks = self._inner.get_read_tasks(self._parallelism)
        return [tasks[self._index]]
