"""The commit protocol's building blocks: what a committed checkpoint is on disk and how it gets there.

- ``layout``: the run directory and checkpoint naming (the on-disk contract).
- ``manifest``: reading and writing ``manifest.json``; ``hashing``: xxh3-128 file checksums.
- ``fsutil``: durable steps (fsync of files and directories, atomic writes).
- ``state``: what a saved training state is made of; ``fingerprint``: its cheap digest, checked after every load.
- ``identity``: a checkpoint's identity from its tensors (names, shapes, dtypes), not from a config.
- ``lineage``: the run's append-only lineage file.
"""
