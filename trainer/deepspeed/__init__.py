"""The DeepSpeed ZeRO 1/2/3 backend.

- ``backend``: the segment's loop on a DeepSpeed engine; ``checkpointer``: DeepSpeed's files under the commit protocol.
- ``_staging`` (private): saves in two halves (capture now, write later); ``_zero3`` (private): ZeRO-3 from
  pretrained weights.
- ``shm``: CPU ranks skip DeepSpeed's shared-memory all-reduce.
"""
