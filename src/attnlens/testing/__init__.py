"""Helpers for testing attnlens and code built on it: :mod:`.tiny_models` (tiny random models of every
architecture family)."""
