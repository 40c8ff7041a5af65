"""Prefect flows: the pipeline, deployments and the command line."""
