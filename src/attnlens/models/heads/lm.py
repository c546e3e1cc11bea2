"""Language models: the next token of a causal LM, a whole answer's log-probability, a seq2seq LM's tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ...errors import InputError, ModelError
from ..prefixes import last_positions
from .classification import PREDICTED, TARGET_KINDS, Head


class LMHead(Head):
    """Next-token prediction of a causal language model (``…ForCausalLM``, GPT-2's ``…LMHeadModel``).

    Logits are ``(B, N, V)``; the prediction read is the one at each input's last real token (inputs are
    right-padded), a target is a token id, and the explained scalar is that token's logit (probability,
    log-probability) there. A generation step is such an input: the prompt plus the tokens generated before it
    (:mod:`attnlens.results.generation`). ``vocab_size`` bounds the token ids a user may give.
    """

    task = "causal-lm"
    model_suffix = "ForCausalLM"
    model_suffixes: tuple[str, ...] = ("ForCausalLM", "LMHeadModel")
    auto_class = "AutoModelForCausalLM"
    finds_last_by_pad_id = False  # the next token is predicted at the last real token, whatever its id
    kind = "a causal language model"

    def __init__(self, vocab_size: int = 0, decode: Callable[[int], str] | None = None) -> None:
        self.vocab_size = int(vocab_size)
        self.decode = decode  # token id -> its text, to name the explained and predicted tokens

    def annotate(self, explanation: Any) -> None:
        """The explained and the greedy next token as text (``meta["target_token"]``, ``"predicted_token"``, and
        ``"contrast_token"`` where a contrast is explained against)."""
        if self.decode is not None:
            explanation.meta["target_token"] = self.decode(int(explanation.target))
            explanation.meta["predicted_token"] = self.decode(int(explanation.predicted))
            if explanation.meta.get("contrast") is not None:
                explanation.meta["contrast_token"] = self.decode(int(explanation.meta["contrast"]))

    def matches(self, model_class: str) -> bool:
        """Whether ``model_class`` (a class or ``config.architectures`` name) is one of this head's models."""
        return model_class.endswith(self.model_suffixes)

    def last(self, logits: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        """``(B, V)`` logits at each input's last real position (the prediction of the next token)."""
        rows = torch.arange(logits.shape[0], device=logits.device)
        return logits[rows, last_positions(token_mask).to(logits.device)]

    logit_positions_per_input = 1

    def logit_positions(self, token_mask: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
        """Each input's last real position (distinct ones, ascending): the only logits a next token is read from."""
        return torch.unique(last_positions(token_mask))

    def predicted(self, logits: torch.Tensor, token_mask: torch.Tensor,
                  answer_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The greedy next token of each input."""
        return self.last(logits.detach(), token_mask).argmax(-1)

    def values(self, logits: torch.Tensor, kind: str, token_mask: torch.Tensor) -> torch.Tensor:
        return super().values(self.last(logits, token_mask), kind, token_mask)

    def probabilities(self, logits: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        return self.last(logits, token_mask).float().softmax(-1)

    def labels(self, config: Any) -> list[str]:
        return []  # the vocabulary is not a list of class names (and far too long to store per explanation)

    def _resolve_one(self, t: Any, labels: list[str]) -> int:
        if t is None:
            return PREDICTED
        if isinstance(t, (int, np.integer)) and not isinstance(t, bool):
            if not 0 <= int(t) < self.vocab_size:
                raise InputError(f"target token id {t} is out of range: the vocabulary has {self.vocab_size} tokens")
            return int(t)
        raise InputError(f"a language model's target is a token id, got {t!r}; to explain a continuation given "
                         "as text, use explain_generation(prompt, target=...) (on the command line: --generate "
                         "--target TEXT)")

    def shown_probabilities(self, probs: np.ndarray, target: Any) -> list[float]:
        """The probability of the explained token only (not the whole vocabulary)."""
        return [float(probs[target])]

    def check_predict_proba(self) -> None:
        raise ModelError("predict_proba is for sequence classifiers; this is a language model")


class AnswerHead(LMHead):
    """A causal language model's answer as a whole: the explained scalar is the sum, over the answer's tokens,
    of each token's log-probability (``target_kind="loss"``; ``"logit"``: the sum of their logits;
    ``"probability"``: the answer's probability, the exponential of that sum) given everything before it.

    The input is prompt + answer; an internal target is one example's ``labels``: for each input position ``p``
    the id of the answer token at ``p + 1`` that the logits at ``p`` predict, or ``-1`` where nothing is read,
    as a causal LM's training labels (shifted). Gradient, LRP and decomposition methods then cost one pass for
    the whole answer; attention-row methods read the mean of the rows that predict the answer's tokens.
    Targets always come from the caller (:func:`answer_labels`): nothing is predicted. ``answer_tokens``: the
    answer's length where known (the memory estimates count the logits of its positions only).
    """

    task = "causal-lm"

    def __init__(self, vocab_size: int = 0, decode: Callable[[int], str] | None = None,
                 answer_tokens: int = 0) -> None:
        super().__init__(vocab_size, decode)
        self.logit_positions_per_input = answer_tokens + 1 if answer_tokens else 0
        self.query_rows_per_input = max(1, answer_tokens)

    def explained_rows(self, targets: torch.Tensor | None) -> torch.Tensor | None:
        """The positions that predict an answer token."""
        return None if targets is None else torch.nonzero(targets >= 0, as_tuple=True)[1]

    def pending(self, targets: list[Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        n = max(len(t) for t in targets)
        wanted = torch.full((len(targets), n), -1, dtype=torch.long, device=device)
        for b, t in enumerate(targets):
            wanted[b, : len(t)] = torch.as_tensor(list(t), dtype=torch.long, device=device)
        return wanted, torch.zeros(len(targets), 1, dtype=torch.bool, device=device)

    def resolve(self, wanted: torch.Tensor, unresolved: torch.Tensor, logits: torch.Tensor,
                token_mask: torch.Tensor, answer_mask: torch.Tensor | None = None) -> torch.Tensor:
        return wanted

    def read_rows(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        example, position = torch.nonzero(targets >= 0, as_tuple=True)
        return example, position, targets[example, position]

    def explained_positions(self, targets: torch.Tensor | None) -> torch.Tensor | None:
        """The last position that predicts an answer token (where the adapters read one row)."""
        if targets is None:
            return None
        index = torch.arange(targets.shape[1], device=targets.device).expand_as(targets)
        return torch.where(targets >= 0, index, torch.full_like(index, -1)).max(1).values

    def query_weights(self, targets: torch.Tensor | None, n_queries: int) -> torch.Tensor | None:
        if targets is None:
            return None
        read = (targets[:, :n_queries] >= 0).to(torch.float64)
        return read / read.sum(1, keepdim=True).clamp_min(1.0)

    def logit_positions(self, token_mask: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
        """The positions that predict an answer token, and each input's last position (its greedy next token is
        shown)."""
        last = last_positions(token_mask)
        if targets is None:
            return torch.unique(last)
        return torch.unique(torch.cat([last, torch.nonzero(targets >= 0, as_tuple=True)[1].to(last.device)]))

    def targets_at(self, targets: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The labels at the kept positions (a label is indexed by the position that predicts it)."""
        return targets[:, positions.to(targets.device)]

    def token_values(self, logits: torch.Tensor, targets: torch.Tensor, kind: str) -> torch.Tensor:
        """``(B, N)`` each answer token's value (its logit or log-probability) at the position predicting it;
        0 elsewhere."""
        example, position, label = self.read_rows(targets)
        rows = logits[example, position]  # (R, V): only the rows that predict answer tokens
        if kind == "logit":
            read = rows.gather(-1, label[:, None])[:, 0]
        elif kind in ("loss", "probability"):
            read = rows.log_softmax(-1).gather(-1, label[:, None])[:, 0]
        else:
            raise ValueError(f"unknown target kind {kind!r}; choose one of {', '.join(TARGET_KINDS)}")
        out = torch.zeros(targets.shape, dtype=read.dtype, device=read.device)
        return out.index_put((example, position), read)

    def scalar(self, logits: torch.Tensor, targets: torch.Tensor, kind: str, token_mask: torch.Tensor) -> torch.Tensor:
        total = self.token_values(logits, targets, kind).sum(1)
        return total.exp() if kind == "probability" else total

    def predicted(self, logits: torch.Tensor, token_mask: torch.Tensor,
                  answer_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Each input's greedy next token (an answer is always given, so this is only shown)."""
        return self.last(logits.detach(), token_mask).argmax(-1)

    def prediction(self, logits: torch.Tensor, token_mask: torch.Tensor,
                   answer_mask: torch.Tensor | None = None) -> list[Any]:
        return self.predicted(logits, token_mask).cpu().tolist()

    def shown(self, logits: torch.Tensor, token_mask: torch.Tensor, targets: torch.Tensor) -> list[list[float]]:
        """Each answer token's probability given everything before it, in answer order."""
        with torch.no_grad():
            logp = self.token_values(logits.double(), targets, "loss")
        return [[float(np.exp(v)) for v, t in zip(row, labels) if t >= 0]
                for row, labels in zip(logp.cpu().tolist(), targets.cpu().tolist())]

    def annotate(self, explanation: Any) -> None:
        """The target as the answer's token span ``[start, end)`` (``meta["answer_span"]``), its text and
        log-probability."""
        labels = list(explanation.target)
        read = [p for p, t in enumerate(labels) if t >= 0]
        start, end = read[0] + 1, read[-1] + 2
        explanation.target = [start, end]
        explanation.meta["answer_span"] = [start, end]
        explanation.meta["answer_logprob"] = float(np.log(np.clip(explanation.probabilities, 1e-300, None)).sum())
        if self.decode is not None:
            explanation.meta["answer"] = "".join(self.decode(int(t)) for t in labels if t >= 0)
            explanation.meta["predicted_token"] = self.decode(int(explanation.predicted))

    def meta(self) -> dict[str, Any]:
        return {"task": "causal-lm", "explained": "answer"}


def answer_labels(n_prompt: int, answer_ids: Sequence[int]) -> list[int]:
    """An :class:`AnswerHead` target for the input ``prompt + answer`` (``n_prompt`` prompt tokens): position
    ``p`` predicts the token at ``p + 1``."""
    labels = [-1] * (n_prompt + len(answer_ids))
    for i, t in enumerate(answer_ids):
        labels[n_prompt - 1 + i] = int(t)
    return labels


def decode_token(tokenizer: Any, token_id: int) -> str:
    """One token id as its text, exactly (``" Paris"``: no special tokens skipped, no spaces cleaned up)."""
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


class Seq2SeqLMHead(LMHead):
    """Next-token prediction of an encoder-decoder language model (BART, T5 ``…ForConditionalGeneration``):
    logits ``(B, N_decoder, V)``. Only generation (:mod:`attnlens.results.generation`) feeds these models: every row of
    a batch holds the whole teacher-forced decoder input, so a target says where it is read, as a
    ``(token, decoder position, contrast token or -1)`` triple; the explained scalar is the token's value at
    that position, minus the contrast token's when there is one."""

    task = "seq2seq-lm"
    model_suffix = "ForConditionalGeneration"
    model_suffixes = ("ForConditionalGeneration",)
    auto_class = "AutoModelForSeq2SeqLM"
    kind = "a sequence-to-sequence language model"

    def resolve_targets(self, target: Any, n: int, labels: list[str]) -> list[Any]:
        raise ModelError("explain() reads one prediction per input; a sequence-to-sequence language model is "
                         "explained by what it generates: use explain_generation(prompt) (on the command line: "
                         "--generate)")

    def pending(self, targets: list[Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        wanted = torch.tensor(targets, dtype=torch.long, device=device)
        return wanted, torch.zeros(len(targets), 1, dtype=torch.bool, device=device)

    logit_positions_per_input = 0

    def logit_positions(self, token_mask: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
        """``None``: the decoder's logits are read where each target says, and decoder inputs are short."""
        return None

    def predicted(self, logits: torch.Tensor, token_mask: torch.Tensor,
                  answer_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The greedy token after the last decoder position, as a target triple (generation gives every target,
        so this is never what is explained)."""
        last = torch.full((logits.shape[0],), logits.shape[1] - 1, dtype=torch.long, device=logits.device)
        return torch.stack([logits.detach()[:, -1].argmax(-1), last, torch.full_like(last, -1)], -1)

    def at(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``(B, V)`` logits at each target's decoder position."""
        return logits[torch.arange(logits.shape[0], device=logits.device), targets[:, 1]]

    def scalar(self, logits: torch.Tensor, targets: torch.Tensor, kind: str, token_mask: torch.Tensor) -> torch.Tensor:
        values = Head.values(self, self.at(logits, targets), kind, token_mask)
        token, contrast = targets[:, 0:1], targets[:, 2:3]
        value = values.gather(-1, token)
        other = torch.where(contrast >= 0, values.gather(-1, contrast.clamp_min(0)), torch.zeros_like(value))
        return (value - other).squeeze(-1)


CAUSAL_LM = LMHead()


SEQ2SEQ_LM = Seq2SeqLMHead()
