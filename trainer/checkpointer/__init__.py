"""The Checkpointer: saves and resumes under the commit protocol, for every backend.

- ``core``: the Checkpointer (its state, the commit protocol, close, the backend hooks; its public methods delegate).
- ``saver`` and ``resumer``: its collaborators that save (both tiers, async) and resume (newest valid, with fallback).
- ``node_tier``: its collaborator for the memory tier of a run on several nodes.
- ``dcp_backend``: the FSDP2 backend (DCP); ``common``: what the backends and the trainer share.
"""
