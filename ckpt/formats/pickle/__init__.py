"""The only ways a pickle is read from a run directory.

- ``safe_pickle``: the allow-list unpickler.
- ``torchzip``: the reader of ``torch.save`` zip records (whole ``.pt`` files and DCP's one-tensor records).
"""
