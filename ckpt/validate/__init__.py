"""Is a checkpoint trustworthy, and which checkpoints to keep.

- ``checks``: ``shardkeeper validate`` (quick and deep checks of a step directory).
- ``_verified`` (private): records that every byte of a commit was read back and matched its manifest.
- ``retention``: keep the newest k valid checkpoints and every n-th, never the newest valid or verified one.
"""
