"""The memory tier: checkpoints in host shared memory that outlive the rank processes.

- ``tier``: snapshots in a tmpfs (``/dev/shm``), their commit, lookup and retention.
- ``stage``: the rank side of a snapshot, staged straight into the snapshot's own files (one copy).
- ``recycle``: page reuse between snapshots; ``persist``: copying a snapshot to storage.
- ``nodes``: each node's memory dir, replication to a peer node and the restore plan; ``replicate``: moving the
  files between nodes over a gloo group.
"""
