"""The driver: what `baton fit` (or `trainer.fit`) does around the workers, before, during and
after Ray.

The room's modules
------------------
* ``run_dir``: the run directory's checks before Ray starts (reachable, writable, a run this
  recipe may continue: ``check_run_dir``); ``preflight``: the dataset and a place for the
  workers; ``fork``: a new run from a committed snapshot of another (``--from``).
* ``session_log``: the sessions a run was trained in (``RUN/sessions.json``), ``--time-limit``
  and its budget.
* ``commit_watch``: the newest committed step as the driver sees it; ``metrics``: the
  run's metric records; ``sinks``: where they go (JSONL, TensorBoard, W&B).
* ``terminal``: the progress display; ``report``: a run's metrics as a PNG and a summary.

Import rule (``tests/project/test_imports.py``): the driver imports the worker
(``trainer.train``), ``trainer.config`` and the layers below, never Ray or a command: the
Ray side (``trainer.on_ray``) and the commands (``trainer.cli``) call into it.
"""
