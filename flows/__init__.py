"""Prefect flows: ``train-and-export`` and ``resume``. They compose tasks only; no torch here."""
