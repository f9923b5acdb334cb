"""Run directories on an object store (``s3://``, any fsspec URL), mirrored through a local cache.

- ``base``: store URLs, the local cache, opening a filesystem with bounded timeouts, one line per failure.
- ``objstore``: the mirrored run directory (uploads at commit, downloads for a resume).
"""
