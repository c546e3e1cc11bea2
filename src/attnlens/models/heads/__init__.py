"""What the model predicts and which scalar an explanation is of: one head per task.

- ``classification`` (``…ForSequenceClassification``): logits ``(B, C)``, a target is a class index
  (:mod:`.classification`).
- multi-label classification (``config.problem_type == "multi_label_classification"``): the same logits, but
  each label has its own independent probability ``sigmoid(logit)``; the predicted labels are those with
  p > 0.5 and the default explained target is the highest-scoring label.
- ``token`` (``…ForTokenClassification``, e.g. NER): logits ``(B, N, C)``; a target is one token's label: a
  ``(position, label)`` pair (the position a token index or a word of the input, the label defaulting to the
  label the model predicts there). Attention methods read that token's query row; the explained scalar is that
  token's label logit / probability / log-probability (:mod:`.token`).
- ``qa`` (``…ForQuestionAnswering``): logits ``(B, N, 2)`` (start, end), a target is a ``(start, end)`` pair of
  token positions; the explained scalar is start logit + end logit, which equals the sum of the two separate
  explanations for every method linear in the gradient (the AttCAT authors explain both and add them). The
  predicted span is decoded as SQuAD does (:func:`best_spans`, :mod:`.qa`).
- ``causal-lm`` and ``seq2seq-lm``: the next token, a whole answer, each generated token (:mod:`.lm`).

A contrast (:mod:`.contrast`) explains a target's logit minus another's; :func:`head_for` finds a model's head
(:mod:`.by_task`).
"""

from .by_task import GENERATION_HEADS, TASKS, head_for, task_of, tasks_named
from .classification import CLASSIFICATION, MULTI_LABEL, PREDICTED, TARGET_KINDS, Head, MultiLabelHead
from .contrast import ContrastHead, with_contrast
from .lm import CAUSAL_LM, SEQ2SEQ_LM, AnswerHead, LMHead, Seq2SeqLMHead, answer_labels, decode_token
from .qa import QA, QAHead, best_spans, context_positions, qa_head
from .token import TOKEN, TokenHead

__all__ = ["CAUSAL_LM", "CLASSIFICATION", "GENERATION_HEADS", "MULTI_LABEL", "PREDICTED", "QA", "SEQ2SEQ_LM",
           "TARGET_KINDS", "TASKS", "TOKEN", "AnswerHead", "ContrastHead", "Head", "LMHead", "MultiLabelHead", "QAHead",
           "Seq2SeqLMHead", "TokenHead", "answer_labels", "best_spans", "context_positions", "decode_token",
           "head_for", "qa_head", "task_of", "tasks_named", "with_contrast"]
