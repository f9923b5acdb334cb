"""The Checkpointer: saves and resumes under the commit protocol, for every backend.

- ``core``: the Checkpointer (construction, the commit protocol, wait/close, the backend hooks).
- ``save_side`` and ``resume_side``: saving (both tiers, async) and resuming (newest valid, with fallback).
- ``node_tier``: the memory tier of a run on several nodes.
- ``dcp_backend``: the FSDP2 backend (DCP); ``common``: what the backends and the trainer share.
"""
