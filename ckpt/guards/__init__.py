"""Who may touch a run directory, and for how long.

- ``flock``: the flock primitives the locks below (and the plan, memory tier and export locks) are built on.
- ``lock``: one writer per run directory for as long as any process of its segment lives.
- ``lease``: one writer per run on an object store.
- ``pin``: a checkpoint a live reader still reads, kept by retention until it is done.
- ``retired``: was a directory a reader started on retired by the writer (rather than a wrong path)?
"""
