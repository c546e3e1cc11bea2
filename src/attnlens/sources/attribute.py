"""Attributing a language model's answer to the sources of its context (:func:`attribute_context`).

Flow: split the context into sources (:mod:`.segment`); build and tokenize the prompt (:mod:`.prompt`);
take the answer (given, or generated greedily); explain the answer's summed log-probability once with every
requested token-level method (:func:`attnlens.core.answer_engine.explain_answer`, one pass per answer) and sum
each method's token scores per source; run the source-level methods (:mod:`.methods`: ablations, AT2).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np

from ..core.answer_engine import check_lm, methods_within_budget, refuse_answer_over_budget
from ..core.encoding import completing_spans, continuation_encoding, special_ids
from ..core.generation_engine import capped_new_tokens, eos_ids, greedy, token_ids_of
from ..core.memory import parse_budget, readable_size
from ..core.model_runner import ModelRunner
from ..core.progress import ProgressCallback, method_passes
from ..errors import InputError, UnknownMethodError
from ..methods import check_option_owners, get_method, list_methods, resolve_methods
from ..methods.registry import OWN_PASS
from ..results.context_attribution import ContextAttribution
from ..version import __version__
from .ablation import ABLATIONS, CiteJob, full_logprob
from .methods import SOURCE_METHODS, check_source_options
from .prompt import Prompt, build_prompt, token_sources
from .segment import split_sources
from .token_scores import token_source_scores

__all__ = ["DEFAULT_METHODS", "attribute_context", "check_options", "prepare_job", "score_job", "split_methods"]

# attention gates first: of the methods that need no ablations, the best at ranking random ablations and at finding
# the gold source on the context benchmark, and cheap on long prompts (docs/context-attribution.md)
DEFAULT_METHODS = ("attngate", "attnlrp", "loo")


LEARNED = ("at2", "at2lrp")  # source-level methods that read weights fitted per model


def split_methods(methods: str | Sequence[str] | None) -> tuple[list[str], list[str]]:
    """Requested methods as (token-level, source-level) ids, in the order given; ``"all"``: every token-level
    method that applies and every source-level one but the learned ones (at2, at2lrp), which need weights fitted
    for the model and are named, not implied."""
    if methods is None:
        methods = list(DEFAULT_METHODS)
    if isinstance(methods, str):
        if methods.strip() == "all":  # at2 and at2lrp need weights fitted for the model: named, not implied
            return ["all"], [m for m in SOURCE_METHODS if m not in LEARNED]
        methods = [m.strip() for m in methods.split(",") if m.strip()]
    methods = list(methods)
    if not methods:
        raise InputError("no methods given")
    source = [m for m in methods if m in SOURCE_METHODS]
    token = [m for m in methods if m not in SOURCE_METHODS]
    if token:
        unknown = [m for m in token if isinstance(m, str) and m != "all" and m not in list_methods()]
        if unknown:  # the token-level methods and the source-level ones
            raise UnknownMethodError(f"unknown method {unknown[0]!r}; available methods: "
                                     f"{', '.join([*SOURCE_METHODS, *list_methods()])}")
        resolve_methods(token)
    return token, source


def check_options(methods: str | Sequence[str] | None, options: Mapping[str, Mapping[str, Any]] | None
                  ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """A request's options, checked before any model runs: ``(token-level options, source-level options with
    their defaults)``. Each names a requested method and only options it has; token-level values are judged as
    far as no model is needed (:meth:`attnlens.methods.Method.check_options`)."""
    token_methods, source_methods = split_methods(methods)
    options = {k: dict(v) for k, v in (options or {}).items()}
    asked = set(token_methods) | set(source_methods) | (set(list_methods()) if "all" in token_methods else set())
    check_option_owners(options, asked)
    source_options = {m: check_source_options(m, options.pop(m, {})) for m in source_methods}
    for name, opts in options.items():
        get_method(name).check_options(opts)
    return options, source_options


def defaults_for(model: Any) -> list[str]:
    """:data:`DEFAULT_METHODS` without the source-level ones that cannot run on ``model`` at all (what the explorer
    offers checked)."""
    return [m for m in DEFAULT_METHODS if m not in SOURCE_METHODS or SOURCE_METHODS[m].unsupported(model) is None]


def default_methods(job: CiteJob) -> list[str]:
    """The default methods for ``job``, in :data:`DEFAULT_METHODS`' order, without those that cannot run on it: the
    token-level ones the memory budget cannot hold at this prompt's length, and the source-level ones whose check
    refuses the model or the length (one warning each way names them and why)."""
    token, source = split_methods(list(DEFAULT_METHODS))
    n = len(job.prompt.ids) + len(job.prefix_ids) + len(job.answer_ids)
    kept, left = methods_within_budget(job.runner, token, n, job.memory_budget, len(job.answer_ids))
    if left:
        need = ", ".join(f"{m} about {readable_size(v)}" for m, v in left.items())
        warnings.warn(f"left out of the default methods at {n:,} tokens, over the memory budget of "
                      f"{readable_size(parse_budget(job.memory_budget))}: {need} (name them with a larger "
                      "memory_budget / --memory-budget)", stacklevel=3)
    refused = {}
    for m in source:  # a default that cannot run on the model, or not at this length
        spec = SOURCE_METHODS[m]
        try:
            if spec.check is not None:
                spec.check(job, **spec.options)
        except InputError as err:
            refused[m] = str(err)
    if refused:
        warnings.warn("left out of the default methods: " + "; ".join(refused.values()), stacklevel=3)
    kept += [m for m in source if m not in refused]
    return [m for m in DEFAULT_METHODS if m in kept]


def _check_source_passes(job: CiteJob, source_options: Mapping[str, Mapping[str, Any]]) -> None:
    """Refuse, before anything runs, a source method whose options or own passes (e.g. at2lrp's AttnLRP) the
    memory budget cannot hold at this prompt's length."""
    n = len(job.prompt.ids) + len(job.prefix_ids) + len(job.answer_ids)
    for m, options in source_options.items():
        spec = SOURCE_METHODS[m]
        if spec.check is not None:
            spec.check(job, **options)
        if not spec.token_methods:
            continue
        needs = list(spec.token_methods)
        _, left = methods_within_budget(job.runner, needs, n, job.memory_budget, len(job.answer_ids))
        if left:
            need = ", ".join(f"{t} about {readable_size(v)}" for t, v in left.items())
            raise InputError(f"{m} runs {', '.join(needs)} over the prompt: at {n:,} tokens {need}, more than the "
                             f"memory budget of {readable_size(parse_budget(job.memory_budget))} (shorten the "
                             "context or raise --memory-budget / memory_budget=)")


def _check_budget(job: CiteJob, methods: str | Sequence[str], options: Mapping[str, Mapping[str, Any]] | None
                 = None) -> None:
    """Refuse ``methods`` (one :class:`InputError` line) when their passes over the job's prompt and answer would
    not fit its memory budget, without a model pass."""
    token_methods, _ = split_methods(methods)
    options, source_options = check_options(methods, options)
    _check_source_passes(job, source_options)
    if token_methods:
        n = len(job.prompt.ids) + len(job.prefix_ids) + len(job.answer_ids)
        refuse_answer_over_budget(job.runner, n, len(job.answer_ids), token_methods, options, job.memory_budget)


REPLACEMENT = "\ufffd"  # what a tokenizer decodes the bytes of an unfinished character to
MAX_CHARACTER_TOKENS = 3  # a UTF-8 character has at most 4 bytes: at most 3 tokens end before it is complete


def _decode(runner: ModelRunner, ids: list[int]) -> str:
    return runner.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _whole_characters(runner: ModelRunner, ids: list[int]) -> list[int]:
    """``ids`` without the trailing tokens that stop inside a character (a generation cut off by its token limit
    within a byte-level character), so that the answer's text is exactly the tokens explained; a warning says how
    many were left out. (A text that itself ends in U+FFFD reads the same: give it as the answer to keep it.)"""
    if not ids or not _decode(runner, ids).endswith(REPLACEMENT):
        return ids
    for k in range(1, min(MAX_CHARACTER_TOKENS, len(ids)) + 1):
        if not _decode(runner, ids[:-k]).endswith(REPLACEMENT):
            warnings.warn(f"the generated answer's last {k} token{'s' * (k > 1)} stop inside a character: left "
                          "out of the answer (raise max_new_tokens / --max-new-tokens to keep the character)",
                          stacklevel=5)
            return ids[:-k]
    return ids  # more unfinished tokens than a character has: the text's own U+FFFD


ANCHOR_TOKENS = 8  # the prompt's last tokens, decoded before an answer's so that it reads as it continues them


def _answer_offsets(runner: ModelRunner, ids: list[int], before: Sequence[int] = ()
                    ) -> tuple[str, list[tuple[int, int]]]:
    """The text of ``ids`` as it continues the tokens ``before`` (the prompt's), and each token's character span
    in it (by decoding growing prefixes; a token that begins a character a later token completes gets an empty
    span, and the completing token the character).

    The answer is decoded after the last :data:`ANCHOR_TOKENS` of ``before``, less their own text: a tokenizer
    whose decoder strips the leading space of a text's first word (Llama's and Mistral's SentencePiece ``▁``)
    would drop the answer's own leading space if it were decoded alone. Where those tokens' text is not a prefix
    of the longer one (they end inside a character the answer completes), the answer is decoded alone."""
    anchor = list(before[-ANCHOR_TOKENS:])
    lead = _decode(runner, anchor) if anchor else ""
    decoded = [_decode(runner, anchor + ids[:k]) for k in range(1, len(ids) + 1)]
    if anchor and not all(t.startswith(lead) for t in decoded):
        lead, decoded = "", [_decode(runner, ids[:k]) for k in range(1, len(ids) + 1)]
    spans, prev = [], 0
    text = ""
    for k, full in enumerate(decoded, 1):
        text = full[len(lead):]
        # a character whose bytes are not complete yet belongs to the token that completes it
        end = max(len(text.rstrip(REPLACEMENT)) if k < len(ids) else len(text), prev)
        spans.append((prev, end))
        prev = end
    return text, spans


def _answer_ids(runner: ModelRunner, answer: str) -> list[int]:
    if not isinstance(answer, str) or not answer.strip():
        raise InputError("the answer is empty (or only whitespace): give the text the model answered, or none to "
                         "generate it")
    ids = continuation_encoding(runner.tokenizer, answer)[0]  # as it continues the prompt
    if not ids:
        raise InputError(f"the answer {answer!r} tokenizes to nothing")
    return ids


def _explained_tokens(offsets: list[tuple[int, int]], span: tuple[int, int] | None, n_chars: int) -> tuple[int, int]:
    """The answer tokens ``[i, j)`` overlapping the character span ``span`` of the answer (all: ``None``)."""
    if span is None:
        return 0, len(offsets)
    if (not isinstance(span, Sequence) or len(span) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in span)):
        raise InputError(f"answer_span must be a (start, end) pair of character offsets, got {span!r:.60}")
    start, end = span
    if not 0 <= start < end <= n_chars:
        raise InputError(f"answer_span ({start}, {end}) is empty or outside the answer (0..{n_chars})")
    hit = [k for k, (a, b) in enumerate(offsets) if a < end and b > start]
    if not hit:
        raise InputError(f"answer_span ({start}, {end}) covers none of the answer tokens' characters")
    first = hit[0]
    # the tokens that spell the first bytes of the first character (empty spans at it) are explained with it
    while first > 0 and offsets[first - 1][0] == offsets[first - 1][1] == offsets[first][0]:
        first -= 1
    return first, hit[-1] + 1


def prepare_job(
    runner: ModelRunner,
    context: str,
    query: str,
    *,
    answer: str | Sequence[int] | None = None,
    sources: str | Sequence[Any] = "sentence",
    template: str | None = None,
    chat: bool | None = None,
    answer_span: tuple[int, int] | None = None,
    max_new_tokens: int = 64,
    ablation: str = "remove",
    memory_budget: str | int | None = None,
    before_generating: Callable[[CiteJob], None] | None = None,
) -> CiteJob:
    """Everything the methods of one attribution read: sources, tokenized prompt, the answer (generated when
    not given) and the explained stretch of it. :class:`InputError` for bad input, before any model pass but the
    answer's generation. ``before_generating``: called, when the answer is to be generated, with the job of a
    one-token answer (the shortest there can be) before the model generates; it raises to refuse."""
    if ablation not in ABLATIONS:
        raise InputError(f"ablation={ablation!r}; choose one of {', '.join(ABLATIONS)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    check_lm(runner, "attributing an answer to its context")  # before a classifier is asked to generate one
    found = split_sources(context, sources)
    if not found:
        raise InputError("the context has no sources to attribute to (only whitespace between separators?)")
    use_chat = bool(getattr(runner.tokenizer, "chat_template", None)) if chat is None else bool(chat)
    prompt: Prompt = build_prompt(runner.tokenizer, context, query, template, use_chat)
    if len(prompt.ids) >= runner.max_length:
        raise InputError(f"the prompt has {len(prompt.ids)} tokens: no room for an answer within the model's "
                         f"maximum of {runner.max_length}")
    owners = token_sources(prompt, found)
    _warn_about_tokens(runner, prompt, found, owners)
    if answer is None:
        if before_generating is not None:
            before_generating(CiteJob(runner, context, found, prompt, owners, [],
                                      [next(iter(eos_ids(runner)), 0)], ablation, parse_budget(memory_budget),
                                      query=query))
        ids = greedy(runner, prompt.ids, capped_new_tokens(runner, len(prompt.ids), max_new_tokens))
        eos = eos_ids(runner)
        while ids and ids[-1] in eos:  # the end-of-turn token is not part of the answer
            ids = ids[:-1]
        if not ids:
            raise InputError("the model answered nothing (its first token ends the turn): give an answer")
        ids = _whole_characters(runner, ids)
        if not ids:
            raise InputError("the generated answer stops inside its first character: raise max_new_tokens "
                             "(--max-new-tokens) or give an answer")
        answer_text, answer_offsets = _answer_offsets(runner, ids, prompt.ids)
    elif not isinstance(answer, str):  # token ids (a generated answer's meta["answer_ids"]): read as generated
        ids = token_ids_of(runner, answer, "answer")
        answer_text, answer_offsets = _answer_offsets(runner, ids, prompt.ids)
        if not answer_text.strip():
            raise InputError("the answer's token ids spell only whitespace: give the ids of the answer's text")
    else:  # the caller's text, with the tokenizer's character spans in it
        ids = _answer_ids(runner, answer)
        answer_text = answer
        answer_offsets = completing_spans(continuation_encoding(runner.tokenizer, answer)[1])
    if len(prompt.ids) + len(ids) > runner.max_length:
        raise InputError(f"prompt ({len(prompt.ids)} tokens) + answer ({len(ids)}) is longer than the model's "
                         f"maximum of {runner.max_length} tokens")
    first, last = _explained_tokens(answer_offsets, answer_span, len(answer_text))
    explained = _explained_span(answer_text, answer_offsets, first, last)
    return CiteJob(runner, context, found, prompt, owners, ids[:first], ids[first:last],
                   ablation, parse_budget(memory_budget), query=query, answer=answer_text,
                   answer_offsets=answer_offsets, answer_token_ids=ids, explained=explained,
                   generated=answer is None)


def _warn_about_tokens(runner: ModelRunner, prompt: Prompt, sources: Sequence[Any], owners: Sequence[int]) -> None:
    """Warn where the tokens do not map onto the sources as a reader would expect: a source that holds no token of
    its own (a span inside a word: its characters belong to a token of another source or of none), which the
    methods reading tokens score 0; text of the context that the tokenizer reads as a special token (chat markup
    such as ``<|im_end|>``), which the model then reads as that control token."""
    held = set(owners)
    empty = [i for i in range(len(sources)) if i not in held]
    if empty:
        shown = ", ".join(f"{i} ({sources[i].start}, {sources[i].end})" for i in empty[:5])
        warnings.warn(f"source{'s' * (len(empty) > 1)} {shown}{', ...' if len(empty) > 5 else ''} hold no token of "
                      "their own (a token belongs to the source holding its first non-space character): the "
                      "methods that read tokens (all but loo and contextcite) score them 0", stacklevel=5)
    special = special_ids(runner.tokenizer)  # not the unknown token, which stands for a word the vocabulary lacks
    marked = [prompt.text[a:b] for (a, b), i, k in zip(prompt.offsets, prompt.ids, owners, strict=True)
              if k >= 0 and i in special]
    if marked:
        warnings.warn(f"the context holds text the tokenizer reads as special tokens ({', '.join(sorted(set(marked)))})"
                      ": the model reads control tokens there", stacklevel=5)


def _explained_span(text: str, offsets: Sequence[tuple[int, int]], first: int, last: int) -> tuple[int, int]:
    """The character span of ``text`` that answer tokens ``first:last`` cover: the whole answer when they are all
    of its tokens; else from the first token's first character that is not a BPE token's leading space (a token
    of whitespace only, such as a newline, is part of the span: its log-probability is explained too)."""
    if first == 0 and last == len(offsets):
        return 0, len(text)
    start, end = offsets[first][0], offsets[last - 1][1]
    token = text[start:offsets[first][1]]
    if token.strip():
        start += len(token) - len(token.lstrip())
    return start, end


TOKEN_PASS_FORWARDS = 3.0  # the token-level methods' pass, counted as forwards for progress (forward + backward)


def token_forwards(job: CiteJob, token_methods: Sequence[str], options: Mapping[str, Mapping[str, Any]]) -> float:
    """The token-level methods' work on the job's whole sequence, in forwards for progress: their shared pass
    (:data:`TOKEN_PASS_FORWARDS`) and the passes of those that run their own
    (:func:`~attnlens.core.progress.method_passes`: value zeroing's grow with the length)."""
    if not token_methods:
        return 0.0
    n = len(job.prompt.ids) + len(job.prefix_ids) + len(job.answer_ids)
    own = [get_method(m) for m in resolve_methods(list(token_methods)) if OWN_PASS in get_method(m).needs]
    model = job.runner.model
    return TOKEN_PASS_FORWARDS * (1.0 + sum(method_passes(m, model, {**m.options, **options.get(m.name, {})})(n)
                                            for m in own))


@contextmanager
def _progress(job: CiteJob, token_methods: Sequence[str], methods: Sequence[str],
              options: Mapping[str, Mapping[str, Any]], token_options: Mapping[str, Mapping[str, Any]],
              progress: bool | ProgressCallback) -> Iterator[tuple[bool | ProgressCallback, Callable[[str], None]]]:
    """Within the block, the progress of one job's methods: ``(token_progress, advance)``.

    ``progress=True`` shows a bar of the source methods' forwards (the token-level pass shows its own); a callable
    is called with (fraction of the job's work done, jobs finished: 0, then 1), that work counted in forwards: the
    token-level methods as :func:`token_forwards` (with their ``token_options``), each source method as many as
    it plans. ``token_progress``
    goes to the token-level pass; the ablation forwards move the progress as their batches finish
    (``job.progress``), and ``advance(method)`` tops it up to what the method planned once it is done (forwards
    it did not need, and methods that do not report them)."""
    callback = progress if callable(progress) else None
    if callback is None and (progress is not True or not methods):
        yield progress, lambda method: None
        return
    planned = {m: int(SOURCE_METHODS[m].forwards(len(job.sources), **options[m])) for m in methods}
    before = token_forwards(job, token_methods, token_options)
    total = max(before + sum(planned.values()), 1.0)
    bar = None
    if progress is True:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(planned.values()), desc="source methods", unit="forwards")
    forwards = reached = 0
    finished = 0

    def report() -> None:
        if bar is not None:
            bar.update(max(0, forwards - bar.n))
        if callback is not None:
            callback(min((before + forwards) / total, 1.0), 0)

    def forwards_done(n: int) -> None:
        nonlocal forwards
        current = planned[methods[finished]] if finished < len(methods) else 0
        forwards = min(forwards + n, reached + current)
        report()

    def advance(method: str) -> None:
        nonlocal forwards, reached, finished
        reached += planned[method]
        forwards = max(forwards, reached)
        finished += 1
        report()

    def token_share(fraction: float, _done: int) -> None:
        if callback is not None:
            callback(min(fraction, 1.0) * before / total, 0)

    previous, job.progress = job.progress, forwards_done
    try:
        yield (token_share if callback is not None else progress is True), advance
    finally:
        job.progress = previous
        if bar is not None:
            bar.close()
    if callback is not None:  # only once every method is done (not after an error)
        callback(1.0, 1)


def score_job(
    job: CiteJob,
    methods: str | Sequence[str] | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    progress: bool | ProgressCallback = False,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
    """Every requested method's scores of the job's sources: ``(scores, token_scores, figures)``; ``figures``
    holds the answer's log-probability, per method the seconds it took, the share of its token scores outside
    every source, and what the methods report. ``progress``: bars, or a callable called with (fraction of the
    job's work done, jobs finished)."""
    token_methods, source_methods = split_methods(methods)
    options, source_options = check_options(methods, options)
    _check_source_passes(job, source_options)
    scores: dict[str, np.ndarray] = {}
    token_scores: dict[str, np.ndarray] = {}
    seconds: dict[str, float] = {}
    outside: dict[str, float] = {}
    method_meta: dict[str, Any] = {}
    logprob = None
    with _progress(job, token_methods, source_methods, source_options, options, progress) as (token_progress,
                                                                                               advance):
        if token_methods:
            shared = token_source_scores(job, token_methods, options, token_progress)
            scores, token_scores, outside = dict(shared.scores), shared.token_scores, shared.outside
            seconds, method_meta, logprob = dict(shared.seconds), dict(shared.meta), shared.answer_logprob
        for m in source_methods:
            start = time.perf_counter()
            scores[m], figures = SOURCE_METHODS[m].compute(job, **source_options[m])
            seconds[m] = time.perf_counter() - start
            advance(m)
            if figures:
                method_meta[m] = figures
    if logprob is None and "full" in job.cache:
        logprob = job.cache["full"]
    named = [m.strip() for m in methods.split(",")] if isinstance(methods, str) else list(methods or DEFAULT_METHODS)
    scores = {m: scores[m] for m in [*(m for m in named if m in scores), *(m for m in scores if m not in named)]}
    figures = {"answer_logprob": logprob, "seconds": seconds, "outside_share": outside,
               "options": {**{k: v for k, v in options.items() if v}, **source_options}}
    if method_meta:
        figures["methods"] = method_meta
    return scores, token_scores, figures


def _part(progress: bool | ProgressCallback, k: int, parts: int) -> bool | ProgressCallback:
    """The progress of part ``k`` of ``parts`` equal ones: a bar for the first part only; a callable reports each
    part's fraction within the whole (jobs finished: 1 once the last part is done)."""
    if not callable(progress):
        return progress and k == 0

    def report(fraction: float, done: int) -> None:
        progress((k + fraction) / parts, int(done == 1 and k == parts - 1))

    return report


def attribute_context(
    runner: ModelRunner,
    context: str,
    query: str,
    *,
    answer: str | Sequence[int] | None = None,
    sources: str | Sequence[Any] = "sentence",
    methods: str | Sequence[str] | None = None,
    template: str | None = None,
    chat: bool | None = None,
    answer_span: tuple[int, int] | None = None,
    max_new_tokens: int = 64,
    ablation: str = "remove",
    options: Mapping[str, Mapping[str, Any]] | None = None,
    memory_budget: str | int | None = None,
    progress: bool | ProgressCallback = False,
    per_token: bool = False,
) -> ContextAttribution:
    """See :meth:`attnlens.Explainer.attribute_context`."""
    if methods is None:  # a typo fails before the answer is generated
        split_methods(methods)
    else:
        check_options(methods, options)
    job = prepare_job(runner, context, query, answer=answer, sources=sources, template=template, chat=chat,
                      answer_span=answer_span, max_new_tokens=max_new_tokens, ablation=ablation,
                      memory_budget=memory_budget,
                      before_generating=None if methods is None else partial(_check_budget, methods=methods,
                                                                             options=options))
    if methods is None:
        methods = default_methods(job)
    first = len(job.prefix_ids)
    steps = list(range(first, first + len(job.answer_ids))) if per_token else []
    scores, token_scores, figures = score_job(job, methods, options, _part(progress, 0, 1 + len(steps)))
    if figures["answer_logprob"] is None:  # source methods that read no log-probability of the whole prompt
        figures["answer_logprob"] = full_logprob(job)
    rows: dict[str, np.ndarray] = {}
    if per_token:  # each explained answer token on its own: one more attribution per token
        per_step = [score_job(replace(job, prefix_ids=job.answer_token_ids[:k], answer_ids=[job.answer_token_ids[k]],
                                      cache={}), methods, options, _part(progress, i + 1, 1 + len(steps)))[0]
                    for i, k in enumerate(steps)]
        rows = {m: np.vstack([r[m] for r in per_step]) for m in scores}
    prompt = job.prompt
    if job.generated and continuation_encoding(runner.tokenizer, job.answer)[0] != job.answer_token_ids:
        warnings.warn(f"the generated answer {job.answer!r:.40} is tokenized otherwise when its text is read again: "
                      "the scores explain the generated tokens (meta answer_ids; pass them as answer= to explain "
                      "them again), the same text as answer= explains the other tokens", stacklevel=3)
    meta = {
        "model": runner.name,
        "context_start": prompt.context_start,
        "chat_template": prompt.chat,
        "generated": job.generated,
        "answer_ids": list(job.answer_token_ids),
        "explained": list(job.explained),
        "explained_text": job.answer[job.explained[0]:job.explained[1]],
        "target": "sum of the explained answer tokens' log-probabilities",
        "ablation": job.ablation,
        **figures,
        "attnlens": __version__,
    }
    shown = completing_spans(prompt.offsets)  # the sources were assigned by the tokenizer's own spans
    return ContextAttribution(
        context=context, query=query, prompt=prompt.text, answer=job.answer, sources=job.sources, scores=scores,
        token_scores=token_scores, prompt_tokens=[prompt.text[a:b] for a, b in shown],
        token_offsets=shown, token_source=job.token_source,
        answer_tokens=[job.answer[a:b] for a, b in job.answer_offsets], answer_offsets=job.answer_offsets,
        token_rows=rows, token_row_steps=steps, meta=meta,
    )
