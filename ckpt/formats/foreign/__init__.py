"""Checkpoints other tools wrote (DeepSpeed, the HF Trainer, Accelerate, torchtitan, plain DCP), taken in.

- ``readers``: which layout a folder holds, and a reader per layout yielding whole tensors one at a time.
- ``_dcp`` (private): DCP checkpoints of other tools; ``commit``: the import's commit as a shardkeeper checkpoint.
"""
