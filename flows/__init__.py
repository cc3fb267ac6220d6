"""Prefect flows and tasks, pipeline config, MLflow glue and the rlhf CLI."""
