"""On-disk formats: the one allow-list unpickler (``safe_pickle``) and the one torch.save zip record
reader (``torchzip``) that every file read from a run directory goes through."""
