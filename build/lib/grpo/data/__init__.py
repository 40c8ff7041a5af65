"""Datasets: file reading (files), the sets of a config (sets), the synthetic task (synthetic),
and the per-step training order (order)."""
