"""Prefect tasks, one per pipeline stage (tasks.stages) plus the lineage mirror (tasks.lineage)."""
