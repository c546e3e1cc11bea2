"""attnlens: explain Transformer predictions through their attention, and measure how faithful that is.

>>> from attnlens import Explainer
>>> ex = Explainer.from_pretrained("distilbert/distilbert-base-uncased-finetuned-sst-2-english")
>>> exps = ex.explain(["a charming journey"], methods=["attcat", "rollout"])
>>> exps[0].top_k("attcat", 3)
"""

__version__ = "0.1.0"

from .errors import AttnLensError, InputError, ModelError, UnknownMethodError  # noqa: E402
from .explainer import Explainer  # noqa: E402
from .methods import get_method, list_methods, register  # noqa: E402
from .models.architectures import Architecture, register_adapter, register_architecture  # noqa: E402
from .results.explanation import Explanation, load_explanations, save_explanations  # noqa: E402
from .results.generation import Generation, load_generations  # noqa: E402

__all__ = [
    "Architecture",
    "AttnLensError",
    "Explainer",
    "Explanation",
    "Generation",
    "InputError",
    "ModelError",
    "UnknownMethodError",
    "get_method",
    "list_methods",
    "load_explanations",
    "load_generations",
    "register",
    "register_adapter",
    "register_architecture",
    "save_explanations",
]
