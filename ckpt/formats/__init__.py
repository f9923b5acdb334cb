"""What reads and writes tensors on disk, per checkpoint format.

- ``safe_pickle``: the ONE allow-list unpickler; ``torchzip``: the ONE torch.save zip record reader. Every file
  read from a run directory goes through them.
- ``dcp`` (safe DCP reader), ``direct_io`` (hashing O_DIRECT writer): FSDP2's format.
- ``deepspeed`` (ZeRO shard reader/writer), ``deepspeed_convert`` (universal layout, DCP <-> DeepSpeed).
- ``dcp_format``, ``deepspeed_format``: each format's entry in the registry (``ckpt.registry``): path rules,
  layout check, fingerprint recomputation, reshard. Importing this package registers both.
"""

from ckpt.formats.dcp import format as dcp_format  # noqa: F401  (registers the formats)
from ckpt.formats.deepspeed import format as deepspeed_format  # noqa: F401  (registers the formats)
from ckpt.registry import FORMATS, get_format

__all__ = ["FORMATS", "get_format"]
