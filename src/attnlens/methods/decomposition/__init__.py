"""Norm-based and decomposition methods: attnnorm, globenc, alti, decompx.

All four read a layer's output as a sum of vectors, one per source token j. With x the layer's input, A^h the
attention of head h and f^h(a_j) = (a_j W_V^h + b_V^h) W_O^h the value of token j through the output projection:

    z_ij = Σ_h A^h_ij f^h(a_j) + δ_ij x_i         (attention block + residual: Σ_j z_ij + b_O = x_i + Attn_i)

- post-LN encoders (BERT): ``h = LN2(y + FFN(y))``, ``y = LN1(x + Attn(x))``, a_j = x_j, and a LayerNorm applied
  to one summand is LN(v)_i = γ ⊙ (v − mean_d v) / s_i (s_i: the std of the real sum);
- pre-LN decoders (GPT-2, Llama): ``h = y + FFN(LN2(y))``, ``y = x + Attn(LN1(x))``, a_j = LN1(x_j) (a norm of
  token j alone, so z_ij is token j's share), and the residual stream y_i = Σ_j z_ij + b_O is a plain sum.

Nothing beyond the hidden states and attention of the shared pass is captured: each layer's value and output
projections, norm statistics and FFN activations are recomputed from its input h^{l-1} with the model's own
modules (an architecture's :class:`~attnlens.models.architectures.Anatomy` says where they are), and the recomputed
output is checked against the captured h^l, so a wrong anatomy is an error, never a silently wrong score.

The modules: :mod:`.layers` (each layer recomputed from the model's modules, and checked), :mod:`.pair_norms`
(each source token's norm at each row), :mod:`.norm_based` (attnnorm, GlobEnc, ALTI), :mod:`.alti_plus` (ALTI+ on
encoder-decoders), :mod:`.linearised` (the network DecompX differentiates), :mod:`.decompx` and
:mod:`.decompx_seq2seq`; :mod:`.value_zeroed` (a layer's output with each attended token's value vector zeroed, for
value zeroing). Importing the package registers the four methods in that order.
"""

from . import norm_based  # noqa: F401  (registers attnnorm, globenc, alti)
from .decompx import BIAS_MODES, decompx_logits, decompx_token_scores
from .decompx_seq2seq import seq2seq_decompx
from .layers import Layer, model_layers
from .norm_based import ATTNNORM_VARIANTS
from .value_zeroed import ValueZeroedLayer

__all__ = ["ATTNNORM_VARIANTS", "BIAS_MODES", "Layer", "ValueZeroedLayer", "decompx_logits", "decompx_token_scores",
           "model_layers", "seq2seq_decompx"]
