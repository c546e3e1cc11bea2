"""Which head explains a model: by its class name (and config), and the heads by task name."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ...errors import ModelError
from .classification import CLASSIFICATION, MULTI_LABEL, Head
from .lm import CAUSAL_LM, SEQ2SEQ_LM
from .qa import QA, qa_head
from .token import TOKEN

# from_pretrained's task=, by name
TASKS: dict[str, Head] = {"classification": CLASSIFICATION, "qa": QA, "token": TOKEN}


TASKS.update({"causal-lm": CAUSAL_LM, "seq2seq-lm": SEQ2SEQ_LM})


GENERATION_HEADS = (CAUSAL_LM, SEQ2SEQ_LM)


def task_of(architectures: Sequence[str]) -> str:
    """The task whose model classes a config's ``architectures`` name (default ``"classification"``)."""
    return next(iter(tasks_named(architectures)), "classification")


def tasks_named(architectures: Sequence[str]) -> list[str]:
    """The tasks whose model classes a config's ``architectures`` name (none for a base model, a masked LM ...)."""
    return [t for t, h in TASKS.items() if any(_matches(h, a) for a in architectures)]


def _matches(head: Head, model_class: str) -> bool:
    matches = getattr(head, "matches", None)
    return matches(model_class) if matches else model_class.endswith(head.model_suffix)


def head_for(model: nn.Module, max_answer_length: int = 30) -> Head:
    """The head of ``model``: sequence classification (multi-label where ``config.problem_type`` says so), token
    classification or extractive QA (spans of at most ``max_answer_length`` tokens); anything else is an error."""
    name = type(model).__name__
    if name.endswith(CLASSIFICATION.model_suffix):
        problem = getattr(model.config, "problem_type", None)
        if problem == "regression" or (getattr(model.config, "num_labels", 2) == 1
                                       and problem != "multi_label_classification"):
            n = getattr(model.config, "num_labels", 1)
            raise ModelError(f"{name} is a regression model ({n} output{'s' * (n != 1)}, problem_type "
                             "'regression'): attnlens explains classifiers' class logits and probabilities, not "
                             "regression outputs")
        multi = problem == "multi_label_classification"
        return MULTI_LABEL if multi else CLASSIFICATION
    if name.endswith(QA.model_suffix):
        return qa_head(max_answer_length)
    if name.endswith(TOKEN.model_suffix):
        if getattr(model.config, "is_encoder_decoder", False):
            raise ModelError(f"token classifiers are explained for encoder and decoder models; {name} is an "
                             "encoder-decoder type")
        return TOKEN
    for generative in GENERATION_HEADS:
        if generative.matches(name):
            return type(generative)(int(model.get_output_embeddings().weight.shape[0]))
    raise ModelError(
        f"attnlens explains sequence classifiers (…ForSequenceClassification), token classifiers "
        f"(…ForTokenClassification), extractive QA models (…ForQuestionAnswering) and language models "
        f"(…ForCausalLM, …ForConditionalGeneration); got {name}. "
        "Load the model with AutoModelForSequenceClassification or AutoModelForCausalLM."
    )
