"""One adapter per architecture family: which attention stream tensors are explained and from which query rows.

Families:
- ``encoder`` (BERT, DistilBERT, RoBERTa, ALBERT, ELECTRA, MiniLM, ...): one self-attention stream; the head
  reads position 0 ([CLS] / <s>), or the mean over the real tokens (ModernBERT with ``classifier_pooling="mean"``).
- ``decoder`` (GPT-2, Llama, Mistral, Qwen, ...): one causal self-attention stream; the head reads the last
  real token (inputs are right-padded, so padding never reaches a real token).
- ``encoder-decoder`` (BART, mBART, T5): three streams. ``encoder`` self-attention is explained by the mean over
  its real query rows (no single position feeds the head there); ``decoder`` self-attention and ``cross``
  attention by the decoder position of the last EOS, whose state feeds the head. The decoder reads the input
  shifted right by one (position 0 is the decoder start token), so decoder key ``i + 1`` is input token ``i``;
  the final EOS itself is never a decoder key and scores 0 in that stream.

Which model type uses which adapter (and how its head pools) is declared in :mod:`attnlens.models.architectures`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import InputError, ModelError
from .prefixes import last_positions


@dataclass
class StreamTensors:
    """The (non-detached) tensors of one attention stream, as the model returned them."""

    attentions: list[torch.Tensor]  # L x (B, H, Q, K)
    hidden: list[torch.Tensor]  # L+1 x (B, K, D), aligned with the keys
    query_mask: torch.Tensor  # (B, Q) bool
    key_mask: torch.Tensor  # (B, K) bool
    query_weights: torch.Tensor  # (B, Q)
    self_attention: bool
    # whether the queries are the positions the task head reads (the rows a QA span or a token names); False for
    # an encoder-decoder's encoder stream, whose rows are always the mean over its real queries
    head_queries: bool = True


def _one_hot(index: torch.Tensor, n: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(index, n).float()


def _uniform(mask: torch.Tensor) -> torch.Tensor:
    m = mask.double()  # 1/n exact to float64 (a float64 model's rows); each use casts to the model's dtype
    return m / m.sum(1, keepdim=True).clamp_min(1.0)


# Where the classification head reads the final hidden states (an architecture entry's ``pooling``).
FIRST = "first"  # position 0: [CLS] / <s>
LAST = "last"  # the last real token (right padding)
EOS = "eos"  # the decoder state at the input's last EOS token
MEAN = "mean"  # the mean over the real tokens
POOLINGS = (FIRST, LAST, EOS, MEAN)


class Adapter:
    """Base adapter; subclasses describe one architecture family."""

    family: str = ""
    streams: tuple[str, ...] = ("self",)
    default_stream: str = "self"
    pooling: str = FIRST
    poolings: tuple[str, ...] = (FIRST, LAST, MEAN)  # the poolings :meth:`select` can explain
    # whether the head finds its token by the pad id (so padding, and an input token equal to the pad id, matter)
    head_reads_pad_id: bool = False

    def with_pooling(self, pooling: str) -> Adapter:
        """This adapter for a head that pools by ``pooling`` (one of :data:`POOLINGS`)."""
        if pooling == self.pooling:
            return self
        if pooling not in self.poolings:
            raise ModelError(f"{self.family} adapter cannot explain a head with pooling {pooling!r}")
        clone = copy.copy(self)
        clone.pooling = pooling
        return clone

    def check_stream(self, stream: str | None) -> str:
        """The stream to explain: ``None`` picks the family's default; single-stream families also accept their
        family name (``"encoder"`` for an encoder, ``"decoder"`` for a decoder)."""
        if stream is None:
            return self.default_stream
        if stream in self.streams:
            return stream
        if self.streams == ("self",) and stream == self.family:
            return "self"
        choices = ", ".join(self.streams if self.streams != ("self",) else ("self", self.family))
        raise InputError(f"attention={stream!r} is not available for {self.family} models; choose one of {choices}")

    def causal(self, stream: str) -> bool:
        """Whether ``stream``'s query rows attend causally (row i reads the positions up to i), so that the rows
        after the last one a head reads feed nothing it reads."""
        return False

    def check_model(self, model: nn.Module) -> None:
        """:class:`ModelError` if ``model`` lacks what this family's streams read (nothing to check by default)."""

    def embedding_module(self, model: nn.Module) -> nn.Module:
        """The module whose output is the input-token embeddings (hooked for gradient baselines)."""
        return model.get_input_embeddings()

    def decoder_embedding_module(self, model: nn.Module) -> nn.Module | None:
        """An encoder-decoder's module whose output is the decoder inputs' embeddings (its second call where the
        encoder's and the decoder's are one module); ``None`` for single-stream families."""
        return None

    def classification_index(self, input_ids: torch.Tensor, token_mask: torch.Tensor, config: Any,
                             skip_pad: bool = False) -> torch.Tensor:
        """``(B,)`` position whose final state feeds the classification head (0 for ``MEAN``, which reads all).

        ``skip_pad``: the head finds its last token as transformers' decoder classifiers do, the last whose id
        is not ``config.pad_token_id`` (a model fine-tuned with its EOS as padding reads the token before an
        input's final EOS); else the last real token."""
        if self.pooling == LAST:
            pad = getattr(config, "pad_token_id", None)
            if not skip_pad or pad is None:
                return last_positions(token_mask)
            kept = token_mask.bool() & (input_ids != int(pad))
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            return (positions * kept).argmax(1)  # as transformers' heads: position 0 when every id is the pad id
        if self.pooling == EOS:
            eos = config.eos_token_id
            is_eos = (input_ids == eos) & token_mask.bool()
            if not bool(is_eos.any(1).all()):
                raise InputError(f"every input must contain the EOS token (id {eos}) that feeds the head")
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            return torch.where(is_eos, positions, torch.full_like(positions, -1)).max(1).values
        return torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)

    def query_weights(self, query_mask: torch.Tensor, cls: torch.Tensor) -> torch.Tensor:
        """``(B, Q)`` weights of the query rows the head reads: uniform over the real rows for ``MEAN`` pooling,
        else one-hot at ``cls``."""
        return _uniform(query_mask) if self.pooling == MEAN else _one_hot(cls, query_mask.shape[1])

    def select(self, outputs: Any, stream: str, token_mask: torch.Tensor, cls: torch.Tensor) -> StreamTensors:
        """Pick the attention stream's tensors out of the model outputs."""
        raise NotImplementedError

    def keys_to_tokens(self, values: torch.Tensor, stream: str) -> torch.Tensor:
        """Map the last axis from key positions to input-token positions (identity unless the stream is shifted)."""
        return values

    def position_tokens(self, tokens: list[str], special: list[bool], stream: str,
                        start_token: str) -> tuple[list[str], list[bool]]:
        """The tokens at the stream's positions (rows and columns of its maps), and which are special: the input's,
        unless the stream reads it shifted (``start_token``: the decoder start token's text)."""
        return tokens, special

    def pad_token_id(self, tokenizer: Any, config: Any) -> int:
        """Id used to pad batches (the head of some families locates tokens by it)."""
        for value in (getattr(config, "pad_token_id", None), getattr(tokenizer, "pad_token_id", None)):
            if value is not None:
                return int(value)
        return 0


class EncoderAdapter(Adapter):
    """BERT-like encoders: the classifier reads position 0 (or the mean over the real tokens)."""

    family = "encoder"

    def select(self, outputs: Any, stream: str, token_mask: torch.Tensor, cls: torch.Tensor) -> StreamTensors:
        mask = token_mask.bool()
        return StreamTensors(
            attentions=list(outputs.attentions),
            hidden=list(outputs.hidden_states),
            query_mask=mask,
            key_mask=mask,
            query_weights=self.query_weights(mask, cls),
            self_attention=True,
        )


class DecoderAdapter(EncoderAdapter):
    """Causal decoders (GPT-2, Llama, ...): the classifier reads the last real token."""

    family = "decoder"
    pooling = LAST
    head_reads_pad_id = True

    def causal(self, stream: str) -> bool:
        return True


class EncoderDecoderAdapter(Adapter):
    """BART-like encoder-decoders: the classifier reads the decoder state at the last EOS."""

    family = "encoder-decoder"
    streams = ("encoder", "decoder", "cross")
    default_stream = "encoder"
    pooling = EOS
    poolings = (EOS,)

    def causal(self, stream: str) -> bool:
        return stream == "decoder"

    def check_model(self, model: nn.Module) -> None:
        """An encoder-decoder type's encoder-only classes (``T5ForTokenClassification``, ``T5EncoderModel``) have no
        decoder, whose streams and head this family reads."""
        if not hasattr(getattr(model, "base_model", model), "decoder"):
            raise ModelError(f"{type(model).__name__} runs only the encoder of a {model.config.model_type} model; "
                             "attnlens explains its encoder-decoder classes (sequence classification, question "
                             "answering, generation)")

    def embedding_module(self, model: nn.Module) -> nn.Module:
        encoder = model.get_encoder() if hasattr(model, "get_encoder") else None
        if encoder is None and hasattr(model, "model"):
            encoder = model.model.get_encoder()
        if encoder is not None and hasattr(encoder, "get_input_embeddings"):
            return encoder.get_input_embeddings()
        return model.get_input_embeddings()

    def decoder_embedding_module(self, model: nn.Module) -> nn.Module | None:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        if decoder is None and hasattr(model, "model"):
            decoder = model.model.get_decoder()
        if decoder is not None and hasattr(decoder, "get_input_embeddings"):
            return decoder.get_input_embeddings()
        return None

    def select(self, outputs: Any, stream: str, token_mask: torch.Tensor, cls: torch.Tensor) -> StreamTensors:
        enc_mask = token_mask.bool()
        n = enc_mask.shape[1]
        if stream == "encoder":
            return StreamTensors(
                attentions=list(outputs.encoder_attentions),
                hidden=list(outputs.encoder_hidden_states),
                query_mask=enc_mask,
                key_mask=enc_mask,
                query_weights=_uniform(enc_mask),
                self_attention=True,
                head_queries=False,
            )
        # Decoder position 0 holds the start token and position i the input token i - 1, so the real decoder
        # positions that can reach the head (at the last EOS) are 0 .. n-1: the same mask as the input's.
        dec_mask = enc_mask
        if stream == "decoder":
            return StreamTensors(
                attentions=list(outputs.decoder_attentions),
                hidden=list(outputs.decoder_hidden_states),
                query_mask=dec_mask,
                key_mask=dec_mask,
                query_weights=_one_hot(cls, n),
                self_attention=True,
            )
        if stream == "cross":
            # Every cross-attention layer reads the encoder's output: it is the hidden state of each layer's keys.
            layers = len(outputs.cross_attentions)
            return StreamTensors(
                attentions=list(outputs.cross_attentions),
                hidden=[outputs.encoder_last_hidden_state] * (layers + 1),
                query_mask=dec_mask,
                key_mask=enc_mask,
                query_weights=_one_hot(cls, n),
                self_attention=False,
            )
        raise InputError(f"unknown attention stream {stream!r}; choose one of {', '.join(self.streams)}")

    def position_tokens(self, tokens: list[str], special: list[bool], stream: str,
                        start_token: str) -> tuple[list[str], list[bool]]:
        if stream == "cross":  # rows are decoder positions, columns input tokens: no one list labels both
            raise InputError("the cross stream's maps have the decoder's positions as rows and the input's tokens "
                             "as columns; the attention view shows one stream's self-attention: choose attention "
                             "'encoder' or 'decoder'")
        if stream == "decoder":
            return [start_token, *tokens[:-1]], [True, *special[:-1]]
        return tokens, special

    def keys_to_tokens(self, values: torch.Tensor, stream: str) -> torch.Tensor:
        if stream != "decoder":
            return values
        out = torch.zeros_like(values)
        out[..., :-1] = values[..., 1:]
        return out


ENCODER = EncoderAdapter()
DECODER = DecoderAdapter()
ENCODER_DECODER = EncoderDecoderAdapter()
