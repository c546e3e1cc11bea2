"""``attnlens serve``: a local web app to explore explanations in the browser (docs/serve.md).

:func:`create_app` builds the ASGI app from loaded explainers; :mod:`.routes` holds the JSON API, whose answers
are the library's own JSON (``attnlens explain --format json``); :mod:`.jobs` runs one computation per model at a
time, with progress, cancellation and a cache; the page (``static/``) is plain HTML, CSS and JavaScript.
"""

from .app import create_app
from .requests import Limits

__all__ = ["Limits", "create_app"]
