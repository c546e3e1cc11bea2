"""Per-architecture and per-task facts, and loading: one entry per model type (architectures), one adapter per
family, one head per task, checked loading, model shorthands."""
