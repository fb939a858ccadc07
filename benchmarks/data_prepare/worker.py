"""The fresh process of `benchmarks/data_prepare/run.py`'s worker-scaling part: one
`prepare_corpus` timed in an interpreter whose tokenizer uses one thread.

    RAYON_NUM_THREADS=1 python -m benchmarks.data_prepare.worker prepare - < PAYLOAD_JSON

PAYLOAD_JSON: {"paths", "out", "seq_len", "tokenizer", "workers"}. Prints {"seconds", "start",
"end"} (perf-counter seconds, wall-clock start and end). RAYON_NUM_THREADS must be set before
`tokenizers` loads, hence a fresh interpreter. Nothing beyond the standard library is imported
at module level: `workers=2` spawns processes that import this module again, inside the time.
"""

from __future__ import annotations

import time
from typing import Any


def prepare(args: dict[str, Any]) -> dict[str, float]:
    from data_state.corpus import prepare_corpus

    start, wall_start = time.perf_counter(), time.time()
    prepare_corpus(args["paths"], args["out"], seq_len=args["seq_len"], val_fraction=0.0,
                   tokenizer=args["tokenizer"], workers=args["workers"], progress=False)
    return {"seconds": time.perf_counter() - start, "start": wall_start, "end": time.time()}


if __name__ == "__main__":  # not in the spawned workers, which import this as __mp_main__
    from benchmarks.common import worker_main

    raise SystemExit(worker_main({"prepare": prepare}))
