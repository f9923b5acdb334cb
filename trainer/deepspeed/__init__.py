"""The DeepSpeed ZeRO 1/2/3 backend.

- ``backend``: the segment's loop on a DeepSpeed engine; ``checkpointer``: DeepSpeed's files under the commit protocol.
- ``staging``: saves in two halves (capture now, write later); ``zero3``: ZeRO-3 from pretrained weights.
- ``shm``: CPU ranks skip DeepSpeed's shared-memory all-reduce.
"""
