"""DCP, FSDP2's checkpoint format.

- ``format``: its entry in the format registry; ``reader``: safe access to a DCP checkpoint's tensors.
- ``_metadata`` (private): ``.metadata`` read through the allow-list, with every chunk's extents proven.
- ``onepass``: verified loads that hash every file as it comes off the disk.
- ``direct_io``: a storage writer that writes with O_DIRECT and hashes while it writes.
"""
