"""The public API for one's own training loop (re-exported lazily by ``shardkeeper``).

- ``segment``: ``Segment``, ``SegmentPreempted``, ``SegmentStopped``.
- ``_tracked`` (private): what ``Segment.track`` builds for the user's model, optimizer and other objects.
- ``script``: running a user's script as the ranks of a segment.
- ``adopt``: another tool's checkpoint adopted as a run's first checkpoint.
"""
