"""Result types: :class:`~attnlens.results.explanation.Explanation` (one input),
:class:`~attnlens.results.generation.Generation` (one generated continuation),
:class:`~attnlens.results.context_attribution.ContextAttribution` (an answer over its sources) and the text of
tokens (:mod:`~attnlens.results.tokentext`)."""
