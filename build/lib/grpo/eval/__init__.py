"""Evaluation: pure metrics (metrics) and runs that generate and score (run)."""
