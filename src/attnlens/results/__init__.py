"""Result types: :class:`~attnlens.results.explanation.Explanation` (one input), :class:`~attnlens.results.generation.Generation`
(one generated continuation) and the text of tokens (:mod:`~attnlens.results.tokentext`)."""
