"""data_state."""
