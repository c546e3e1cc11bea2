"""Token classification (``…ForTokenClassification``, e.g. NER): logits ``(B, N, C)``, a target is one token's
label, the token given by its position or by a word of the input."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...errors import InputError, ModelError
from .classification import Head


class TokenHead(Head):
    """Token classification (NER, POS tagging): one label per token; an explanation is of one token's label.

    Internal targets are ``(position, label)`` pairs, ``label`` :data:`PREDICTED` for the label the model
    predicts at ``position``. :class:`~attnlens.results.explanation.Explanation` shows the label as ``target`` and
    ``predicted`` (as for sequence classifiers), the token in ``meta["position"]`` / ``meta["token"]``, and every
    token's predicted label in ``meta["predicted_labels"]``.
    """

    task = "token"
    model_suffix = "ForTokenClassification"
    auto_class = "AutoModelForTokenClassification"
    kind = "a token classifier"

    def predicted(self, logits: torch.Tensor, token_mask: torch.Tensor,
                  answer_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, N)`` the predicted label of every token."""
        return logits.detach().argmax(-1)

    def prediction(self, logits: torch.Tensor, token_mask: torch.Tensor,
                   answer_mask: torch.Tensor | None = None) -> list[Any]:
        """The predicted label of every real token, one list per example."""
        labels = self.predicted(logits, token_mask).cpu()
        return [row[: int(n)].tolist() for row, n in zip(labels, token_mask.long().sum(1).cpu(), strict=True)]

    def scalar(self, logits: torch.Tensor, targets: torch.Tensor, kind: str, token_mask: torch.Tensor) -> torch.Tensor:
        """The value of label ``targets[:, 1]`` at token ``targets[:, 0]``."""
        rows = torch.arange(logits.shape[0], device=logits.device)
        return self.values(logits, kind, token_mask)[rows, targets[:, 0], targets[:, 1]]

    def read_rows(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Label ``targets[:, 1]`` at token ``targets[:, 0]``, one per example."""
        return torch.arange(targets.shape[0], device=targets.device), targets[:, 0], targets[:, 1]

    # ---------------------------------------------------------------- targets
    def resolve_targets(self, target: Any, n: int, labels: list[str]) -> list[Any]:
        """A user target (a token position or word, a ``(token, label)`` pair, or a list with one per input) as
        ``n`` ``(token, label)`` pairs; words stay strings until :meth:`locate` sees the tokens."""
        if target is None:
            raise InputError("a token classifier explains one token's label: pass the token as target= (its "
                             "position among the tokens, or a word of the input), or a (token, label) pair")
        if isinstance(target, (int, str, np.integer)) or (isinstance(target, tuple) and len(target) == 2):
            return [self._pair(target, labels)] * n
        if isinstance(target, torch.Tensor):
            target = target.tolist()
        if not isinstance(target, Sequence) or len(target) != n:
            raise InputError(f"target must be a token (position or word), a (token, label) pair, or a list with one "
                             f"per input ({n} inputs)")
        return [self._pair(t, labels) for t in target]

    def _pair(self, t: Any, labels: list[str]) -> tuple[int | str, int]:
        token, label = (t if isinstance(t, (tuple, list)) and len(t) == 2 else (t, None))  # a string is a word
        if isinstance(token, bool) or not isinstance(token, (int, str, np.integer)) or (
                not isinstance(token, str) and token < 0):
            raise InputError(f"the explained token is a position (>= 0) or a word of the input, got {token!r}")
        return (token if isinstance(token, str) else int(token), self._resolve_one(label, labels))

    def locate(self, encoded: list[Any], targets: list[Any]) -> list[Any]:
        """Words as the position of their first token; positions checked: within the input and not a special
        token (a token classifier is not trained on their labels)."""
        out = []
        for i, (e, (token, label)) in enumerate(zip(encoded, targets, strict=True)):
            position = _word_position(e, token, i) if isinstance(token, str) else token
            n = len(e.ids)
            if position >= n:
                raise InputError(f"token position {position} is beyond input {i}'s {n} tokens (0..{n - 1})")
            if e.special[position]:
                raise InputError(f"token {position} of input {i} is the special token {e.tokens[position]!r}, whose "
                                 "label a token classifier is not trained on: pick a token of the text")
            out.append((position, label))
        return out

    def check_targets(self, lengths: list[int], targets: list[Any]) -> None:
        for i, (n, (position, _)) in enumerate(zip(lengths, targets, strict=True)):
            if not isinstance(position, int) or position >= n:
                raise InputError(f"token position {position} is beyond input {i}'s {n} tokens (0..{n - 1})")

    def pending(self, targets: list[Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        wanted = torch.tensor(targets, dtype=torch.long, device=device).view(-1, 2)
        return wanted, torch.stack([torch.zeros_like(wanted[:, 0], dtype=torch.bool), wanted[:, 1] < 0], 1)

    def resolve(self, wanted: torch.Tensor, unresolved: torch.Tensor, logits: torch.Tensor,
                token_mask: torch.Tensor, answer_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted labels at the explained positions (the positions are always given)."""
        at = self.predicted(logits, token_mask).gather(1, wanted[:, :1])
        return torch.where(unresolved, torch.cat([wanted[:, :1], at], 1), wanted)

    def explained_positions(self, targets: torch.Tensor | None) -> torch.Tensor | None:
        return None if targets is None else targets[:, 0]

    # ---------------------------------------------------------------- display
    def shown_probabilities(self, probs: np.ndarray, target: Any) -> list[float]:
        """Every label's probability at the explained token."""
        return [float(p) for p in probs[target[0]]]

    def annotate(self, explanation: Any) -> None:
        """The explained token moves from ``target`` to ``meta``: ``target`` and ``predicted`` become that token's
        explained and predicted labels; every token's predicted label is kept by name in the metadata."""
        position, label = explanation.target
        per_token = list(explanation.predicted)
        explanation.target, explanation.predicted = int(label), int(per_token[position])
        explanation.meta.update(position=int(position), token=explanation.tokens[position],
                                predicted_labels=[explanation.label_name(int(k)) for k in per_token])

    # ------------------------------------------------------------------ checks
    def check_predict_proba(self) -> None:
        raise ModelError("predict_proba is for sequence classifiers; this is a token classifier")


def _word_position(e: Any, word: str, index: int) -> int:
    """The position of the first token of the first word of input ``e`` equal to ``word`` (case-insensitive); a
    warning where the word occurs more than once."""
    wanted = word.strip().lower()
    groups: dict[Any, list[int]] = {}
    for i, w in enumerate(e.word_ids or []):
        if w is not None and not e.special[i]:
            groups.setdefault((None if e.sequence_ids is None else e.sequence_ids[i], w), []).append(i)
    words = []
    found: list[int] = []
    for (seq, _), positions in groups.items():
        source = e.text[seq or 0] if isinstance(e.text, list) else e.text
        # a byte-level or SentencePiece token's offsets may hold the space before its word
        text = source[e.offsets[positions[0]][0]:e.offsets[positions[-1]][1]].strip() if e.offsets else ""
        if text.lower() == wanted:
            found.append(positions[0])
        words.append(text)
    if found:
        if len(found) > 1:
            warnings.warn(f"input {index}: the word {word!r} occurs {len(found)} times (tokens "
                          f"{', '.join(map(str, found))}); explaining the first, token {found[0]} (give a token "
                          "position to explain another)", stacklevel=4)
        return found[0]
    if not groups:
        raise InputError("words can be explained only with a fast tokenizer (it knows where words are): pass the "
                         "token position instead")
    raise InputError(f"input {index} has no word {word!r}; its words: {' '.join(words)}")


TOKEN = TokenHead()
