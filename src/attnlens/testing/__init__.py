"""Helpers for testing attnlens and code built on it: :mod:`.tiny_models` (tiny random models of every
architecture family) and :mod:`.live_tensors` (the most tensor memory alive at once within a block, to check
memory estimates against)."""
