"""Launchers: how a segment's ranks are started (local torchrun today), and the seam to them."""
