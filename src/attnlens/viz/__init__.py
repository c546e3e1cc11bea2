"""Renderers of explanations and benchmark results: terminal (rich), HTML pages and matplotlib figures.

``attnlens.viz.terminal`` and ``attnlens.viz.html`` are light; ``attnlens.viz.plots`` imports matplotlib, so
it is imported only when a figure is asked for.
"""

from __future__ import annotations

from .html import explanations_html
from .terminal import print_explanations, render_terminal

__all__ = ["explanations_html", "print_explanations", "render_terminal"]
