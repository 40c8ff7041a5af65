"""Launching stages: paths of models and configs (paths), this process or DeepSpeed ranks
(runner), and the entry point of one rank (worker)."""
