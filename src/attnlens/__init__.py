"""attnlens: explain Transformer predictions through their attention, and measure how faithful that is.

Example (a hub id needs the hub; a local model directory works offline)::

    from attnlens import Explainer

    ex = Explainer.from_pretrained("distilbert/distilbert-base-uncased-finetuned-sst-2-english")
    exps = ex.explain(["a charming journey"], methods=["attcat", "rollout"])
    print(exps[0].top_k("attcat", 3))  # the three tokens with the highest scores, as (token, score)
"""

from .errors import AttnLensError, InputError, MethodError, ModelError, UnknownMethodError
from .explainer import Explainer
from .methods import get_method, list_methods, register
from .models.architectures import Architecture, register_adapter, register_architecture
from .results.context_attribution import ContextAttribution, load_attributions, save_attributions
from .results.explanation import Explanation, load_explanations, save_explanations
from .results.generation import Generation, load_generations
from .version import __version__ as __version__

__all__ = [
    "Architecture",
    "AttnLensError",
    "ContextAttribution",
    "Explainer",
    "Explanation",
    "Generation",
    "InputError",
    "MethodError",
    "ModelError",
    "UnknownMethodError",
    "get_method",
    "list_methods",
    "load_attributions",
    "load_explanations",
    "load_generations",
    "register",
    "register_adapter",
    "register_architecture",
    "save_attributions",
    "save_explanations",
]
