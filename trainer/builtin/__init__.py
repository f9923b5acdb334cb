"""The built-in language-model trainer.

- ``loop``: the model, data and optimizer, and the segment policy around them, for both backends.
- ``data``: data whose global sample order depends only on (seed, step), never on the world size.
- ``prepare``: a dataset to a cached, memory-mapped token file.
"""
