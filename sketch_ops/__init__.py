"""sketch_ops."""
