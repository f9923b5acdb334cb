"""The checkpoint library: commit protocol, manifests, validation, retention, lineage, export.

Imports torch lazily where it can; never imports prefect.
"""

__version__ = "0.1.0"
