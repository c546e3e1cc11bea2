"""Tiny random models of every architecture family, for tests (as captum's ``testing/helpers``): one recipe per
``config.model_type`` (:class:`Tiny`: 2 layers, 2 heads, hidden size 16) and :func:`build_tiny`, which builds a
classifier, another task's model or a language model of the type from it. Not used by the library itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import InputError
from ..models.heads import TASKS


class _Slot:
    """A placeholder in a :class:`Tiny` recipe, filled by :func:`build_tiny` (token ids, init scale)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name.upper()


PAD_ID, BOS, EOS_ID, STD = _Slot("pad"), _Slot("bos"), _Slot("eos"), _Slot("std")


@dataclass(frozen=True)
class Tiny:
    """How to build a tiny random classifier of a model type: transformers config and model class names and the
    config's size arguments (``vocab_size``, ``pad_token_id`` and ``num_labels`` are always passed)."""

    config: str
    model: str
    kwargs: dict[str, Any] = field(default_factory=dict)


_ENC = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24)
_DEC = dict(_ENC, num_key_value_heads=1, max_position_embeddings=64)
_SEQ2SEQ = dict(d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=64,
                bos_token_id=BOS, eos_token_id=EOS_ID, decoder_start_token_id=EOS_ID)
_ROBERTA = dict(_ENC, max_position_embeddings=70)  # positions start after the padding index


def _tiny(name: str, **kwargs: Any) -> Tiny:
    """``Tiny("<name>Config", "<name>ForSequenceClassification", kwargs)``."""
    return Tiny(f"{name}Config", f"{name}ForSequenceClassification", kwargs)


# model_type -> its recipe; every type of attnlens.models.architectures has one (a test checks it)
TINY: dict[str, Tiny] = {
    "bert": _tiny("Bert", **_ENC, max_position_embeddings=64, initializer_range=STD),
    "roberta": _tiny("Roberta", **_ROBERTA, initializer_range=STD, bos_token_id=BOS, eos_token_id=EOS_ID),
    "distilbert": _tiny("DistilBert", dim=16, n_layers=2, n_heads=2, hidden_dim=24, max_position_embeddings=64,
                        initializer_range=STD),
    "albert": _tiny("Albert", **_ENC, embedding_size=8, max_position_embeddings=64, initializer_range=STD),
    "electra": _tiny("Electra", **_ENC, embedding_size=8, max_position_embeddings=64, initializer_range=STD),
    "xlm-roberta": _tiny("XLMRoberta", **_ROBERTA),
    "camembert": _tiny("Camembert", **_ROBERTA),
    # DeBERTa's released layout: relative positions in both directions, none added to the input embeddings
    "deberta": _tiny("Deberta", **_ENC, max_position_embeddings=64, relative_attention=True,
                     pos_att_type=["c2p", "p2c"], position_biased_input=False),
    "deberta-v2": _tiny("DebertaV2", **_ENC, max_position_embeddings=64, relative_attention=True,
                        pos_att_type=["p2c", "c2p"], position_buckets=8, max_relative_positions=16),
    "mpnet": _tiny("MPNet", **_ENC, max_position_embeddings=70),
    "ernie": _tiny("Ernie", **_ENC, max_position_embeddings=64),
    "modernbert": _tiny("ModernBert", **_ENC, max_position_embeddings=64, cls_token_id=BOS, sep_token_id=EOS_ID,
                        bos_token_id=BOS, eos_token_id=EOS_ID, global_attn_every_n_layers=1, local_attention=16),
    "xlm-roberta-xl": _tiny("XLMRobertaXL", **_ROBERTA),
    "gpt2": _tiny("GPT2", n_embd=16, n_layer=2, n_head=2, n_positions=64, initializer_range=STD, bos_token_id=BOS,
                  eos_token_id=EOS_ID),
    "gpt_neo": _tiny("GPTNeo", hidden_size=16, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
                     max_position_embeddings=64, initializer_range=STD),
    "gpt_neox": _tiny("GPTNeoX", **_ENC, max_position_embeddings=64, initializer_range=STD),
    "gptj": _tiny("GPTJ", n_embd=16, n_layer=2, n_head=2, n_positions=64, rotary_dim=4, initializer_range=STD),
    "llama": _tiny("Llama", **_ENC, num_key_value_heads=2, max_position_embeddings=64, initializer_range=STD,
                   bos_token_id=BOS, eos_token_id=EOS_ID),
    "mistral": _tiny("Mistral", **_DEC),
    "mixtral": _tiny("Mixtral", **_DEC, num_local_experts=2, num_experts_per_tok=1, initializer_range=STD),
    "qwen2": _tiny("Qwen2", **_DEC),
    "qwen3": _tiny("Qwen3", **_DEC, head_dim=8, initializer_range=STD),
    "gemma": _tiny("Gemma", **_DEC, head_dim=8, initializer_range=STD),
    "gemma2": _tiny("Gemma2", **_DEC, head_dim=8, initializer_range=STD),
    "phi": _tiny("Phi", **_ENC, max_position_embeddings=64, initializer_range=STD),
    "phi3": _tiny("Phi3", **_ENC, max_position_embeddings=64, num_key_value_heads=1, initializer_range=STD),
    "opt": _tiny("OPT", hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=24,
                 max_position_embeddings=64, word_embed_proj_dim=16, init_std=STD),
    "bloom": _tiny("Bloom", hidden_size=16, n_layer=2, n_head=2, initializer_range=STD),
    "falcon": _tiny("Falcon", hidden_size=16, num_hidden_layers=2, num_attention_heads=2),
    "bart": _tiny("Bart", **_SEQ2SEQ, init_std=STD, forced_eos_token_id=None),
    "mbart": _tiny("MBart", **_SEQ2SEQ, init_std=STD),
    "t5": _tiny("T5", d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2, eos_token_id=EOS_ID,
                decoder_start_token_id=PAD_ID),
}


def register_tiny(model_type: str, recipe: Tiny) -> None:
    """Add (or replace) the recipe of ``model_type``, e.g. beside a new :func:`register_architecture` entry."""
    TINY[model_type] = recipe


def build_tiny(
    model_type: str,
    *,
    vocab_size: int,
    pad_token_id: int,
    bos_token_id: int,
    eos_token_id: int,
    num_labels: int = 2,
    init_std: float = 0.3,
    seed: int = 0,
    attn: str = "eager",
    task: str = "classification",
    model_suffix: str = "ForSequenceClassification",
) -> nn.Module:
    """A tiny random classifier of ``model_type`` from its :class:`Tiny` recipe, in eval mode;
    ``task="causal-lm"`` / ``"seq2seq-lm"`` builds the type's language model from the same config instead.

    ``init_std`` replaces the config's ``initializer_range`` where the recipe asks for it (larger than HF's 0.02,
    so attention is far from uniform and every method has signal). ``model_suffix`` picks another task's model
    class of the type (e.g. ``"ForTokenClassification"``)."""
    import transformers

    recipe = TINY.get(model_type)
    if recipe is None:
        raise InputError(f"no tiny-model recipe for model type {model_type!r}")
    slots = {PAD_ID: pad_token_id, BOS: bos_token_id, EOS_ID: eos_token_id, STD: init_std}
    kwargs = {k: slots[v] if isinstance(v, _Slot) else v for k, v in recipe.kwargs.items()}
    torch.manual_seed(seed)
    config = getattr(transformers, recipe.config)(  # attn at construction: Falcon cannot switch afterwards
        vocab_size=vocab_size, num_labels=num_labels, pad_token_id=pad_token_id, attn_implementation=attn, **kwargs
    )
    if task != "classification":
        if task not in TASKS:
            raise InputError(f"task={task!r}; choose one of {', '.join(TASKS)}")
        return getattr(transformers, TASKS[task].auto_class).from_config(config).eval()
    model_class = recipe.model.removesuffix("ForSequenceClassification") + model_suffix
    if not hasattr(transformers, model_class):
        raise InputError(f"transformers has no {model_class}")
    return getattr(transformers, model_class)(config).eval()
