"""Integrations of ``shardkeeper.Segment`` with other training frameworks (rank-side code, run under
``shardkeeper train --script``):

- ``shardkeeper.integrations.transformers``: a Hugging Face ``Trainer`` whose saves are shardkeeper commits and
  whose resume is shardkeeper's (DeepSpeed, FSDP2 or a single process);
- ``shardkeeper.integrations.accelerate``: track an ``Accelerator``-prepared model, optimizer and scheduler.

Each module imports its framework when imported; ``import shardkeeper`` does not import them.
"""
