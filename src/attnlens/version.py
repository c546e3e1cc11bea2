"""The version of attnlens (the same number as pyproject.toml's), in a module of its own so that every layer can
name it without importing the package face."""

__version__ = "0.1.0"
