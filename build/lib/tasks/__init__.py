"""Prefect tasks, one per pipeline stage, with the MLflow and Great Expectations glue."""
