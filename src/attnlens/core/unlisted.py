"""Model types attnlens has no entry for: one short test pass learns what a generic entry needs, or refuses.

A model type outside :data:`attnlens.models.architectures.ARCHITECTURES` (and not an encoder-decoder, which is
refused) is explained through a generic encoder or decoder entry. Its config cannot say which: causal language
models do not set ``is_decoder``, and a decoder read as an encoder is explained at its first token, which under
causal masking sees nothing else. So before such a model is explained, one forward and backward over six tokens
checks what every method relies on:

- each layer returns one ``n × n`` map over the input (Funnel pools the sequence, Longformer returns windows);
- the attention is causal (every map's upper triangle is 0): a decoder, explained at the last token; or not: an
  encoder, explained at the first;
- a sequence classifier's logits depend on the last hidden state at exactly that position (XLNet's head reads the
  last token of a bidirectional model; a mean-pooling head reads all).

A model that passes is explained with the generic entry of its kind (methods that rerun or decompose layers need
an entry of their own and are skipped), with one warning that says so; one that does not is refused in one line.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ..errors import ModelError, exception_line
from ..models.adapters import DECODER, ENCODER
from ..models.architectures import ARCHITECTURES, Architecture, is_built_in, remember_unlisted
from .modelstate import EAGER, explaining

__all__ = ["check_unlisted"]

PROBE_TOKENS = 6
# a position the classifier's logits depend on: its gradient's norm above this share of the largest one
READ_SHARE = 1e-6


def check_unlisted(model: nn.Module) -> None:
    """For a model type attnlens has no entry for, learn from one test pass whether it is a causal decoder or an
    encoder and check that a generic entry explains it (module docstring); a :class:`ModelError` (one line) when
    not. Types with an entry are left alone."""
    config = model.config
    model_type = getattr(config, "model_type", "")
    entry = ARCHITECTURES.get(model_type)
    if getattr(config, "is_encoder_decoder", False) or (entry is not None and is_built_in(entry)):
        return
    if entry is not None:
        _check_registered_family(model, entry)
        return
    name = f"model type {model_type!r} has no attnlens entry"
    try:
        embeddings = model.get_input_embeddings()
    except (NotImplementedError, AttributeError) as err:
        raise ModelError(f"{name}, and its input embeddings cannot be found ({err})") from None
    vocabulary = int(getattr(config, "vocab_size", 0) or getattr(embeddings, "num_embeddings", 0))
    inputs = _probe_inputs(model, vocabulary)
    if inputs is None:
        raise ModelError(f"{name}, and its vocabulary of {vocabulary} ids is too small to test it")
    classifier = type(model).__name__.endswith("ForSequenceClassification")

    def differentiable(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        # frozen weights leave the graph without a leaf: the embeddings' output becomes one
        return output.requires_grad_(True) if classifier and not output.requires_grad else output

    try:
        with explaining(model, EAGER), torch.set_grad_enabled(classifier):
            embeddings.register_forward_hook(differentiable)  # removed with the block
            out = model(input_ids=inputs, attention_mask=torch.ones_like(inputs), output_attentions=True,
                        output_hidden_states=classifier, return_dict=True)
            read = _positions_read(out) if classifier else None
    except ModelError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of a foreign model's forward is this one line
        raise ModelError(f"{name}, and a test pass over {PROBE_TOKENS} tokens failed ({exception_line(err)})") from None
    n = PROBE_TOKENS
    maps = getattr(out, "attentions", None)
    causal = _causal(maps)
    if causal is None:
        shapes = [tuple(a.shape) for a in maps or ()]
        found = f"layer shapes {shapes[:2]}" if shapes else "none returned"
        raise ModelError(f"{name}, and its attention is not one {n} × {n} map per layer over a {n}-token input "
                         f"({found}), which every attnlens method reads")
    where = n - 1 if causal else 0
    kind = "a causal decoder" if causal else "a bidirectional encoder"
    if read is not None and read != [where]:
        found = (f"reads position(s) {', '.join(map(str, read))} of a {n}-token input" if read
                 else "does not read the last hidden states the model returns")
        raise ModelError(f"{name}: {kind}, whose classification head {found}, not the "
                         f"{'last' if causal else 'first'} token a generic {kind[2:]} entry explains")
    remember_unlisted(Architecture(model_type, DECODER if causal else ENCODER))
    warnings.warn(f"{name}: a test pass found {kind}, explained at its {'last' if causal else 'first'} token with "
                  "a generic entry (methods that rerun or decompose layers are skipped; "
                  "attnlens.models.architectures.register_architecture adds an entry)", stacklevel=3)


def _check_registered_family(model: nn.Module, entry: Architecture) -> None:
    """An entry registered outside attnlens is trusted in all but its family, which one forward over a few tokens
    tells: a causal decoder read as an encoder would be explained at its first token, which sees nothing else,
    and an encoder read as a decoder at its last. :class:`ModelError` (one line) when the family disagrees; a model
    whose maps this test cannot read is left to its entry."""
    if entry.family not in ("encoder", "decoder"):
        return
    inputs = _probe_inputs(model, int(getattr(model.config, "vocab_size", 0) or 0))
    if inputs is None:
        return
    try:
        with explaining(model, EAGER), torch.no_grad():
            maps = model(input_ids=inputs, attention_mask=torch.ones_like(inputs), output_attentions=True,
                         return_dict=True).attentions
    except Exception:  # noqa: BLE001 - the entry's own passes say what fails, as they do for any entry
        return
    causal = _causal(maps)
    if causal is not None and causal != (entry.family == "decoder"):
        found, give = ("causal attention", "DECODER") if causal else ("bidirectional attention", "ENCODER")
        raise ModelError(f"the {entry.model_type!r} entry registered for {type(model).__name__} is an {entry.family} "
                         f"entry, but a test pass found {found}: register it with attnlens.models.adapters.{give}")


def _probe_inputs(model: nn.Module, vocabulary: int) -> torch.Tensor | None:
    """``(1, PROBE_TOKENS)`` ids of ordinary tokens (past the first few ids, which are often special; not the pad
    id) on the model's device; ``None`` where the vocabulary has too few."""
    pad = getattr(model.config, "pad_token_id", None)
    ids = [i for i in range(4, vocabulary) if i != pad][:PROBE_TOKENS]
    return torch.tensor([ids], device=next(model.parameters()).device) if len(ids) == PROBE_TOKENS else None


def _causal(maps: Any) -> bool | None:
    """Whether every layer's map of the probe attends causally (its upper triangle is 0); ``None`` where the maps
    are not one ``n × n`` map per layer over the ``n`` probe tokens."""
    n = PROBE_TOKENS
    if not maps or any(a.dim() != 4 or tuple(a.shape[-2:]) != (n, n) for a in maps):
        return None
    return all(bool((torch.triu(a.detach()[0].float(), diagonal=1) == 0).all()) for a in maps)


def _positions_read(out: object) -> list[int]:
    """The positions whose last hidden state a sequence classifier's logits depend on."""
    hidden = out.hidden_states[-1]  # type: ignore[attr-defined]
    (grad,) = torch.autograd.grad(out.logits.float().sum(), hidden, allow_unused=True)  # type: ignore[attr-defined]
    if grad is None:
        return []
    norms = grad[0].float().norm(dim=-1)
    return [int(i) for i in torch.nonzero(norms > READ_SHARE * norms.max().clamp_min(1e-30)).flatten()]
