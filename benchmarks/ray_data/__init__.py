"""A Ray Data pipeline read by Baton (units, a feeder, a (seed, epoch) order) against Ray's
`iter_torch_batches`: throughput, the first batch after a resume mid-epoch, memory
(`python -m benchmarks.ray_data.run --help`)."""
