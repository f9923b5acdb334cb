"""DeepSpeed ZeRO's checkpoint format, read and converted without DeepSpeed.

- ``format``: its entry in the format registry; ``_state`` (private): shardkeeper's own files beside
  DeepSpeed's.
- ``zero``: ZeRO shard files read one parameter slice at a time.
- ``sources``: where a checkpoint's tensors are (ZeRO shards, the universal layout, DCP).
- ``universal``: DeepSpeed's universal layout, cached beside a checkpoint.
- ``convert``: to any world size, to DCP (FSDP2) and back.
"""
