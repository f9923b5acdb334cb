"""Prefect tasks, one per pipeline stage (tasks.stage_tasks) plus the lineage mirror (tasks.lineage)."""
