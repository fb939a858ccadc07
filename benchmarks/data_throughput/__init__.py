"""Whether the data pipeline is ever the bottleneck: the loader's throughput, from local disk
and from S3, against the tokens/s training consumes.

- `run`: the benchmark (`python -m benchmarks.data_throughput.run --help`).

Report: benchmarks/reports/2026-12-02-data-throughput.md.
"""
