"""Shared fixtures: a tiny WordPiece tokenizer and tiny random models of every supported family (offline)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import (
    AlbertConfig,
    AlbertForSequenceClassification,
    BartConfig,
    BartForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    BertTokenizerFast,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    ElectraConfig,
    ElectraForSequenceClassification,
    GPT2Config,
    GPT2ForSequenceClassification,
    LlamaConfig,
    LlamaForSequenceClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
)

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
torch.set_num_threads(1)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
MODELS = SHARED / "models"
DATA = SHARED / "data"

WORDS = (
    "the a movie film was is not very good bad great awful i really didn ' t like this it and but "
    "charming journey boring plot actors story , . ! funny dull loved hated never ever best worst"
).split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = SPECIALS + WORDS + ["##s", "##ly", "##ing", "##ed"]
PAD, UNK, CLS, SEP, MASK = range(5)
V = 64  # embedding rows (>= len(VOCAB))

FAMILIES = ["bert", "distilbert", "roberta", "albert", "electra", "gpt2", "llama", "bart"]
ENCODERS = ["bert", "distilbert", "roberta", "albert", "electra"]


def make_tokenizer() -> BertTokenizerFast:
    """A fast WordPiece tokenizer over the tiny vocabulary (``[PAD]`` = 0, ``[CLS]`` = 2, ``[SEP]`` = 3)."""
    tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(VOCAB)}, do_lower_case=True, model_max_length=48)
    assert len(tok) == len(VOCAB) and tok.convert_tokens_to_ids("movie") == VOCAB.index("movie")
    return tok


@pytest.fixture(scope="session")
def tokenizer() -> BertTokenizerFast:
    return make_tokenizer()


def make_model(family: str, num_labels: int = 2, seed: int = 0, attn: str = "eager") -> torch.nn.Module:
    """A tiny random classifier of ``family`` (2 layers, 2 heads, hidden 16) over the tiny vocabulary."""
    torch.manual_seed(seed)
    common = dict(num_labels=num_labels, pad_token_id=PAD)
    std = 0.3  # larger than HF's 0.02 so attention is far from uniform and every method has signal
    if family == "bert":
        cfg = BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=24, max_position_embeddings=64, initializer_range=std, **common)
        model = BertForSequenceClassification(cfg)
    elif family == "distilbert":
        cfg = DistilBertConfig(vocab_size=V, dim=16, n_layers=2, n_heads=2, hidden_dim=24,
                               max_position_embeddings=64, initializer_range=std, **common)
        model = DistilBertForSequenceClassification(cfg)
    elif family == "roberta":
        cfg = RobertaConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=24, max_position_embeddings=70, initializer_range=std,
                            bos_token_id=CLS, eos_token_id=SEP, **common)
        model = RobertaForSequenceClassification(cfg)
    elif family == "albert":
        cfg = AlbertConfig(vocab_size=V, embedding_size=8, hidden_size=16, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=24, max_position_embeddings=64,
                           initializer_range=std, **common)
        model = AlbertForSequenceClassification(cfg)
    elif family == "electra":
        cfg = ElectraConfig(vocab_size=V, embedding_size=8, hidden_size=16, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=24, max_position_embeddings=64,
                            initializer_range=std, **common)
        model = ElectraForSequenceClassification(cfg)
    elif family == "gpt2":
        cfg = GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=64, initializer_range=std,
                         bos_token_id=CLS, eos_token_id=SEP, **common)
        model = GPT2ForSequenceClassification(cfg)
    elif family == "llama":
        cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                          initializer_range=std, bos_token_id=CLS, eos_token_id=SEP, **common)
        model = LlamaForSequenceClassification(cfg)
    elif family == "bart":
        cfg = BartConfig(vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                         decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24,
                         max_position_embeddings=64, init_std=std, bos_token_id=CLS, eos_token_id=SEP,
                         decoder_start_token_id=SEP, forced_eos_token_id=None, **common)
        model = BartForSequenceClassification(cfg)
    else:
        raise ValueError(family)
    model.set_attn_implementation(attn)
    return model.eval()


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def minilm_sst2():
    """The real reference classifier (BERT MiniLM-L6 fine-tuned on SST-2), loaded once."""
    from attnlens import Explainer

    path = MODELS / "minilm-sst2"
    if not path.is_dir():
        pytest.skip(f"reference model not found at {path}")
    return Explainer.from_pretrained(path)
