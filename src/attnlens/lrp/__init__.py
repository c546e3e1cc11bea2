"""Layer-wise relevance propagation on stock HuggingFace encoders and decoders, batched (see ``docs/lrp.md``).

:func:`lrp_pass` runs one forward with LRP rules patched into the model's own modules and one backward; the
model is restored afterwards; :func:`lrp_passes` runs the chefer and the attnlrp rule sets from one forward.
The methods ``partiallrp``, ``transatt`` and ``attnlrp`` read its result.
"""

from .patch import RULE_SETS, SUPPORTED, check_supported, runs_fused, supports
from .relevance import LRPResult, lrp_pass, lrp_passes

__all__ = ["RULE_SETS", "SUPPORTED", "LRPResult", "check_supported", "lrp_pass", "lrp_passes", "runs_fused", "supports"]
