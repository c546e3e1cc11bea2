"""The batch engine: which methods run, and per padded batch one shared pass (:func:`compute_batch`) whose
captured tensors every method reads, turned into :class:`~attnlens.results.explanation.Explanation` objects
(:func:`explain_batch`). Task-specific parts (targets, probabilities, metadata) are the head's
(:mod:`attnlens.models.heads`); architecture facts are the adapter's."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from ..errors import AttnLensError, InputError, MethodError, exception_line
from ..methods import check_option_owners, get_method, resolve_methods
from ..methods.lrp_methods import (
    ATTENTION_READERS,
    fused_lrp,
    fused_over_prefixes,
    kept_activation_passes,
    kept_pass_dims,
    last_layer_passes,
)
from ..methods.registry import GRADIENTS, LAYER_GRAPH, OWN_PASS, SPACES, Method, MethodOutput, capture_request
from ..models.heads import PREDICTED
from ..results.explanation import Explanation
from ..results.tokentext import encoding_meta
from ..version import __version__
from .allocator import release_free_memory
from .batch_state import TARGET_KINDS, BatchContext
from .batching import batch_groups, keeps_logits
from .capture import planned_storage, run_capture
from .capture_kept import capture_pass_dims
from .encoding import Encoded
from .fused_attention import FUSED
from .logit_rows import LogitRows
from .memory import (
    DEFAULT_BUDGET,
    LRP_STORAGE,
    VALUE_ZEROING_STORAGE,
    Dims,
    Storage,
    budget_chunks,
    fitting,
    lrp_storage,
    model_dims,
    pass_row_bytes,
    refuse_over_budget,
)
from .model_runner import ModelRunner
from .modelstate import explaining, runs_sdpa, without_cache
from .progress import ExplainProgress, ProgressCallback, method_passes

ANSWER = "answer"  # select_methods' target for a whole answer (core/answer_engine.py)


def _asks_all(methods: str | Sequence[str] | None) -> bool:
    """Whether a methods request includes ``"all"`` (every method that applies)."""
    words = [m.strip() for m in methods.split(",")] if isinstance(methods, str) else list(methods or ["all"])
    return "all" in words


def select_methods(
    runner: ModelRunner, methods: str | Sequence[str] | None, target: Any, target_kind: str,
    options: Mapping[str, Mapping[str, Any]] | None, contrast: bool = False,
) -> tuple[list[Method], dict[str, dict[str, Any]]]:
    """The methods to run and their checked options. ``"all"`` skips (with a warning) the methods that do not
    apply to this model (with ``contrast``: nor those that do not depend on the target); a named method that
    does not apply, or an option for a method not requested, is an :class:`InputError`. ``target`` is
    :data:`ANSWER` for a whole answer (whose log-probabilities the logit-only methods explain too)."""
    if target_kind not in TARGET_KINDS:
        raise InputError(f"target_kind={target_kind!r}; choose one of {', '.join(TARGET_KINDS)}")
    method_ids = resolve_methods(methods)
    requested = list(method_ids)
    specs = [get_method(m) for m in method_ids]
    asked_all = _asks_all(methods)
    reasons = {s.name: s.unsupported(runner.model, runner.stream, runner.head.task)
               or s.unsupported_kind(target_kind, answer=target == ANSWER) for s in specs}
    if contrast:
        reasons.update({s.name: f"{s.name} does not depend on the explained target, so a contrast does not "
                                "apply to it" for s in specs if not s.class_specific and not reasons[s.name]})
    if asked_all:  # "all" means every method that applies to this model
        skipped = {m: r for m, r in reasons.items() if r}
        if skipped:
            warnings.warn(f"skipping {', '.join(skipped)}: " + "; ".join(dict.fromkeys(skipped.values())),
                          stacklevel=3)
        specs = [s for s in specs if s.name not in skipped]
    else:
        for s in specs:
            if reasons[s.name]:
                raise InputError(reasons[s.name])
    checked = _check_options_mapping(options)
    check_option_owners(checked, requested)
    method_options = {s.name: s.check_options(dict(checked.get(s.name, {}))) for s in specs}
    for s in specs:
        reason = s.unsupported_options(runner.model, runner.stream, runner.head.task, method_options[s.name])
        if reason:
            raise InputError(reason)
    if target_kind == "loss" and target is None:
        raise InputError("target_kind='loss' explains the loss against given labels: pass them as target=")
    return specs, method_options


def check_loss_labels(target_kind: str, targets: Sequence[Any]) -> None:
    """``target_kind="loss"`` is the loss against given labels: a resolved target left to the model's prediction
    (a ``None`` among per-input targets, a token classifier's token without its label) is refused."""
    if target_kind == "loss" and any(PREDICTED in (t if isinstance(t, (tuple, list)) else (t,)) for t in targets):
        raise InputError("target_kind='loss' explains the loss against given labels: pass every input's label as "
                         "target= (a token classifier's as a (token, label) pair)")


LONG_INPUT = 128  # tokens from which a method running a pass per token is worth a notice under "all"


def warn_per_token_methods(specs: list[Method], methods: str | Sequence[str] | None, lengths: list[int]) -> None:
    """Under ``"all"``, a notice when a method that runs passes per input token (value zeroing) meets long inputs:
    it then costs far more than every other method together, and the user did not name it."""
    slow = [s.name for s in specs if s.per_token_passes]
    longest = max(lengths, default=0)
    if _asks_all(methods) and slow and longest >= LONG_INPUT:
        warnings.warn(f"{', '.join(slow)} reruns every layer once per input token: inputs of up to {longest} tokens "
                      f"here cost about {longest} layer passes each, more than all the other methods together; "
                      "name the methods without it when speed matters", stacklevel=3)


@dataclass
class PassCost:
    """Bytes the batch's passes hold per row of ``n`` tokens: the shared pass (``shared``, what batches are sized
    by) and the largest own pass a method runs beside it (``own``); ``alone``: each method's total on its own."""

    dims: Dims
    shared_storage: Storage | None
    own_storages: dict[str, Storage]
    alone: dict[str, Callable[[int], int]]
    budget: int = DEFAULT_BUDGET
    fusable: frozenset[str] = frozenset()  # methods whose LRP pass runs fused where the eager one would not fit
    last_layer: frozenset[str] = frozenset()  # methods whose fused LRP pass keeps the last layer's factors alone
    # what methods hold beside the shared pass outside any Storage, bytes per row of n tokens (Method.own_memory)
    own_memories: dict[str, Callable[[int], int]] = field(default_factory=dict)
    longest: int | None = None  # the most tokens the model takes (what a refusal's lengths are capped at)
    kept: frozenset[str] = frozenset()  # methods whose fused LRP pass keeps every layer's activations where they fit

    def storage(self, n: int) -> Storage | None:
        """The shared pass's storage at ``n`` tokens: recomputing layers where keeping them would not fit, or would
        not leave the methods' own passes (which run beside what it keeps) enough of the budget."""
        if self.shared_storage is None:
            return None
        storage = fitting(self.dims, n, self.shared_storage, self.budget)
        if (self.own_storages or self.own_memories) and storage.backward and not storage.eager \
                and not storage.recompute and self.dims.recomputable:
            held = pass_row_bytes(self.dims, n, storage)
            if held + self._own(n, self._left(held)) > self.budget:
                return dataclasses.replace(storage, recompute=True)
        return storage

    def shared(self, n: int) -> int:
        storage = self.storage(n)
        return 0 if storage is None else pass_row_bytes(self.dims, n, storage)

    def own(self, n: int) -> int:
        return self._own(n, self._left(self.shared(n)))

    def own_storage(self, name: str, n: int) -> Storage:
        """What method ``name``'s own pass holds at ``n`` tokens, in what the budget leaves beside the shared
        pass."""
        return self._own_storage(name, n, self._left(self.shared(n)))

    def _left(self, shared: int) -> int:
        """What the budget leaves the own passes beside a shared pass of ``shared`` bytes, as
        :meth:`BatchContext.budget_left` finds it at run time."""
        return max(self.budget - shared, self.budget // 4)

    def _own(self, n: int, left: int) -> int:
        own = (pass_row_bytes(self.dims, n, self._own_storage(name, n, left)) for name in self.own_storages)
        return max([*own, *(bytes_at(n) for bytes_at in self.own_memories.values()), 0])

    def _own_storage(self, name: str, n: int, left: int) -> Storage:
        storage = self.own_storages[name]
        if name in self.fusable:
            return lrp_storage(self.dims, n, left, True, storage.logit_rows, name in ATTENTION_READERS,
                               name in self.last_layer, name in self.kept)
        return fitting(self.dims, n, storage, left)  # fused passes recompute layers where needed

    def total(self, n: int) -> int:
        return self.shared(n) + self.own(n)

    def refuse_over(self, n: int, budget: int, what: str = "an input") -> None:
        """An :class:`InputError` (one line) before anything runs when ``n`` tokens need more than ``budget``."""
        refuse_over_budget(n, budget, self.total(n), self.alone, what, self.longest)


def _own_pass_storage(spec: Method, logit_rows: int = 0, fused: bool = False) -> Storage:
    """What a method running its own passes holds: LRP a forward+backward with every map and its gradient kept;
    value zeroing eager forwards, one layer's maps at a time, and every layer's input (the layers are rerun from
    them); integrated gradients a forward+backward, with fused attention
    where the model has it (``fused``) (a language model's logits at ``logit_rows`` positions per row, as the
    shared pass)."""
    if spec.lrp:
        return dataclasses.replace(LRP_STORAGE, logit_rows=logit_rows)
    if spec.per_token_passes:
        return VALUE_ZEROING_STORAGE
    return Storage(eager=not fused, backward=True, logit_rows=logit_rows)


def pass_cost(runner: ModelRunner, specs: list[Method], budget: int = DEFAULT_BUDGET,
              options: Mapping[str, Mapping[str, Any]] | None = None, prefixes: bool = False,
              steps: int = 0) -> PassCost:
    """The memory the passes serving ``specs`` (with ``options`` per method; default: their defaults) hold within
    ``budget``, as a function of the length (:class:`PassCost`). ``prefixes``: the rows are prefixes of one
    sequence (a generation's steps), at most ``steps`` of them in a batch (0: any number)."""
    dims = model_dims(runner.model)
    positions_known = runner.head.explained_positions(torch.zeros(1, 2, dtype=torch.long)) is not None
    # a language model's logits where its head reads them (LogitRows), where the model can
    logit_rows = runner.head.logit_positions_per_input if keeps_logits(runner.model) else 0

    def shared(group: list[Method]) -> Storage | None:
        keep, differentiate = capture_request(group)
        gradients = any(GRADIENTS in s.needs for s in group)
        if not keep and not gradients:
            return None
        storage = planned_storage(runner.model, runner.adapter, runner.stream, keep, differentiate, gradients,
                                  positions_known, runner.head.query_rows_per_input)
        return dataclasses.replace(storage, logit_rows=logit_rows,
                                   layer_graph=any(LAYER_GRAPH in s.needs for s in group))

    # an LRP pass over a generation's prefixes reads the logits from its first step's last token on
    prefix_logits = steps + 1 if steps and keeps_logits(runner.model) else 0
    fused = not prefixes and runs_sdpa(runner.model)  # integrated gradients' passes (methods/gradient.py)
    own = {s.name: _own_pass_storage(s, prefix_logits if prefixes and s.lrp else logit_rows, fused) for s in specs
           if OWN_PASS in s.needs}
    if prefixes:  # what a method holds for the batch's first step beside its passes (each further step's:
        # generation_engine._steps_per_batch)
        step_vectors = {s.name: s.step_vectors for s in specs}
        own = {name: dataclasses.replace(storage, held_vectors=step_vectors[name]) for name, storage in own.items()}
    settings = {s.name: {**s.options, **(options or {}).get(s.name, {})} for s in specs}
    # AttnLRP's own pass, alone or beside the others: what its rules keep, counted on the model
    if any(kept_activation_passes({name: opts}, prefixes) for name, opts in settings.items()):
        dims = kept_pass_dims(runner.model, dims)

    def fusable(group: list[Method]) -> frozenset[str]:
        if prefixes:  # over a generation's prefixes AttnLRP's and PartialLRP's own passes run fused (a backward
            # per step)
            return fused_over_prefixes(runner.model, {s.name: settings[s.name] for s in group})
        return frozenset(s.name for s in group if fused_lrp(runner.model, s.name, settings))

    memories = {s.name: functools.partial(s.own_memory, runner.model, runner.stream) for s in specs
                if s.own_memory is not None}

    def counted(storage: Storage | None) -> Dims:  # what the shared pass's forward keeps, counted on the model
        return capture_pass_dims(runner.model, runner.adapter, dims, storage)

    def alone(spec: Method) -> Callable[[int], int]:
        @functools.cache
        def cost() -> PassCost:  # built when a refusal asks: its shared pass alone is counted on the model then
            storage = shared([spec])
            return PassCost(counted(storage), storage, {spec.name: own[spec.name]} if spec.name in own else {}, {},
                            budget, fusable([spec]), last_layer_passes({spec.name: settings[spec.name]}, prefixes),
                            {spec.name: memories[spec.name]} if spec.name in memories else {},
                            kept=kept_activation_passes({spec.name: settings[spec.name]}, prefixes))

        return lambda n: cost().total(n)

    storage = shared(specs)
    return PassCost(counted(storage), storage, own, {s.name: alone(s) for s in specs}, budget, fusable(specs),
                    last_layer_passes(settings, prefixes), memories, getattr(runner, "max_length", None),
                    kept_activation_passes(settings, prefixes))


def explain_all(
    runner: ModelRunner, encoded: list[Encoded], targets: list[Any], specs: list[Method],
    method_options: dict[str, dict[str, Any]], target_kind: str, batch_size: int, progress: bool | ProgressCallback,
    memory_budget: int = DEFAULT_BUDGET,
) -> list[Explanation]:
    """Explanations of every input, in input order: length-sorted batches of at most ``batch_size`` inputs whose
    shared pass fits ``memory_budget`` bytes (long inputs go in smaller batches, one at least).

    ``progress``: ``True`` shows a bar (its ETA weights inputs by length, it moves inside a batch as methods and
    integrated gradients' steps finish); a callable is called with (fraction of the work done, inputs finished).
    """
    gradients = any(GRADIENTS in s.needs for s in specs)
    results: list[Explanation | None] = [None] * len(encoded)
    lengths = [len(e.ids) for e in encoded]
    dims = model_dims(runner.model)
    cost = pass_cost(runner, specs, memory_budget, method_options)
    if lengths:  # the longest input runs alone at worst: refuse before anything runs if even that does not fit
        cost.refuse_over(max(lengths), memory_budget)
    own = {s.name: method_passes(s, runner.model, method_options.get(s.name, {})) for s in specs
           if OWN_PASS in s.needs}
    tracker = ExplainProgress(lengths, dims.hidden, own, bar=progress is True,
                              callback=progress if callable(progress) else None)
    with explaining(runner.model):
        tracker.start()
        try:
            groups = batch_groups(runner.model, [e.ids for e in encoded])  # BART's EOS count; float64 windows
            for idx in budget_chunks(lengths, batch_size, memory_budget, cost.total, dims.hidden_bytes, groups):
                batch = [encoded[i] for i in idx]
                tracker.begin_batch(idx)
                for i, exp in zip(idx, explain_batch(runner, batch, [targets[i] for i in idx], specs, method_options,
                                                     target_kind, gradients, memory_budget, tracker), strict=True):
                    results[i] = exp
                tracker.end_batch()
        finally:
            tracker.close()
    return results  # type: ignore[return-value]


def batch_context(runner: ModelRunner, batch: list[Encoded], target_kind: str) -> BatchContext:
    """The padded inputs and masks of one batch (targets are filled in by :func:`compute_batch`)."""
    inputs, token_mask = runner.inputs([e.ids for e in batch], [e.type_ids for e in batch])
    special = torch.zeros_like(token_mask, dtype=torch.bool)
    for b, e in enumerate(batch):
        special[b, : len(e.special)] = torch.tensor(e.special)
    return BatchContext(
        model=runner.model,
        adapter=runner.adapter,
        inputs=inputs,
        token_mask=token_mask,
        special_mask=special,
        targets=torch.zeros(len(batch), dtype=torch.long),
        target_kind=target_kind,
        stream=runner.stream,
        tokenizer=runner.tokenizer,
        head=runner.head,
        answer_mask=runner.head.answer_mask(batch, token_mask),
    )


def compute_batch(
    runner: ModelRunner, batch: list[Encoded], targets: list[Any], specs: list[Any],
    method_options: dict[str, dict[str, Any]], target_kind: str = "logit", gradients: bool | None = None,
    ctx: BatchContext | None = None, memory_budget: int = DEFAULT_BUDGET, tracker: ExplainProgress | None = None,
) -> tuple[BatchContext, dict[str, tuple[torch.Tensor, torch.Tensor | None]]]:
    """Scores of one padded batch in token space: ``{method: (scores (B, N), layers (B, L, N) | None)}``;
    padding positions are exactly zero. ``targets`` are the head's resolved targets (negative: predicted).
    ``ctx``: the batch's inputs when they are not :func:`batch_context`'s (a seq2seq generation step adds the
    decoder's, a decoder-only generation the one sequence its rows are prefixes of, ``ctx.sequence``); its adapter
    and head must be ``runner``'s. Per-input figures the methods report are in ``ctx.meta``.
    ``tracker`` hears of each finished step."""
    if gradients is None:
        gradients = any(GRADIENTS in s.needs for s in specs)
    head = runner.head
    ctx = ctx or batch_context(runner, batch, target_kind)
    ctx.memory_budget = memory_budget
    ctx.plan = {s.name: {**s.options, **method_options.get(s.name, {})} for s in specs}
    capture_only = [s for s in specs if OWN_PASS not in s.needs]
    wanted, unresolved = head.pending(targets, ctx.token_mask.device)
    if bool(unresolved.any()) and (head.rows_from_targets or (gradients and not bool(unresolved.all()))):
        # The backward pass needs every target up front, and so does a pass that keeps the rows a target names:
        # resolve "predicted" entries with a cheap forward (fused attention where the model has it: no maps).
        read = LogitRows.of(runner.model, head, ctx.token_mask, None)
        with torch.no_grad(), explaining(runner.model, FUSED):
            logits = head.logits(runner.model(**ctx.inputs, **read.model_kwargs(), **without_cache(runner.model)))
        wanted = head.resolve(wanted, unresolved, logits, read.mask(ctx.token_mask), ctx.answer_mask)
        unresolved = torch.zeros_like(unresolved)
    with explaining(runner.model), runner.head_without_padding(ctx.token_mask):
        keep, differentiate = capture_request(specs)
        rows, n = ctx.token_mask.shape  # a generation's prefixes share the forward of one sequence
        storage = pass_cost(runner, specs, memory_budget // (1 if ctx.sequence is not None else rows)).storage(n)
        outputs = None
        serving = next((s for s in specs if s.forward is not None), None)
        if serving is not None and not keep and not gradients and ctx.sequence is None and not bool(unresolved.any()):
            # the shared pass would only compute the outputs, which this method's own pass computes anyway
            ctx.targets = wanted
            outputs = serving.forward(ctx)  # None: it cannot, and the shared pass runs
        capture, _ = run_capture(
            runner.model, runner.adapter, ctx.inputs, ctx.token_mask, runner.stream,
            None if bool(unresolved.all()) else wanted, target_kind, gradients=gradients, head=head,
            answer_mask=ctx.answer_mask, keep=keep, differentiate=differentiate, sequence=ctx.sequence,
            recompute=storage is not None and storage.recompute, outputs=outputs,
        )
        ctx.targets = head.resolve(wanted, unresolved, capture.logits, capture.logit_rows.mask(ctx.token_mask),
                                   ctx.answer_mask)
        ctx.capture = capture
        out: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        mask = ctx.token_mask.to(capture.logits.dtype)
        # the shared pass and the capture-only methods plan one pass over the batch together
        step = 1.0 / (1 + len(capture_only))
        if tracker is not None:
            tracker.begin_step(step)
            tracker.advance(1.0)
            ctx.progress = tracker.advance
        for spec in specs:
            opts = method_options.get(spec.name, {})
            if tracker is not None:
                if OWN_PASS in spec.needs:
                    tracker.begin_method(spec.name)
                else:
                    tracker.begin_step(step)
            with torch.set_grad_enabled(OWN_PASS in spec.needs):  # capture-only methods need no graph
                result = _run_method(spec, ctx, opts)
            if spec.many_passes:  # batches of perturbed inputs sized by each input's length leave holes in the
                release_free_memory()  # heaps that a session of varied lengths would keep growing (allocator.py)
            _check_output(spec.name, result, rows, n, capture.key_mask.shape[-1])
            if tracker is not None:
                tracker.advance(float("inf"))  # the step is done: whatever it did not report
            if result.meta:
                ctx.meta[spec.name] = result.meta
            scores, layers = result.scores.detach(), None if result.layers is None else result.layers.detach()
            if result.space == "keys":  # zero keys the explained row cannot see, then map keys to tokens
                key_mask = capture.key_mask.to(scores.dtype)
                scores = runner.adapter.keys_to_tokens(scores * key_mask, runner.stream)
                layers = None if layers is None else runner.adapter.keys_to_tokens(
                    layers * key_mask[:, None, :], runner.stream)
            keep = mask.bool()  # padding is 0 whatever the method left there (a nan times 0 stays nan)
            scores = torch.where(keep, scores, 0)
            layers = None if layers is None else torch.where(keep[:, None, :], layers, 0)
            _warn_if_not_finite(spec.name, scores, runner, capture.logits)
            out[spec.name] = (scores, layers)
    return ctx, out


def _run_method(spec: Any, ctx: BatchContext, options: Mapping[str, Any]) -> MethodOutput:
    """``spec.compute(ctx, **options)``. An exception from a method registered outside attnlens becomes one
    :class:`MethodError` line that names it (attnlens's own raise theirs as they are), except what the progress
    callback raised through it: a caller stopping the run (``serve`` cancelling a job) gets its own exception."""
    if getattr(spec.compute, "__module__", "").startswith("attnlens."):
        return spec.compute(ctx, **options)
    progress, raised = ctx.progress, []
    if progress is not None:
        def report(fraction: float) -> Any:
            try:
                return progress(fraction)
            except BaseException as exc:
                raised.append(exc)
                raise

        ctx.progress = report
    try:
        return spec.compute(ctx, **options)
    except AttnLensError:
        raise
    except Exception as err:
        chain, seen = err, set()
        while chain is not None and id(chain) not in seen:  # the callback's exception, or one raised from it
            if any(chain is r for r in raised):
                raise
            seen.add(id(chain))
            chain = chain.__cause__ or chain.__context__
        raise MethodError(f"method {spec.name!r} failed: {exception_line(err)}") from err
    finally:
        ctx.progress = progress


def _check_output(method: str, result: Any, rows: int, tokens: int, keys: int) -> None:
    """:class:`MethodError` where ``result`` is not a :class:`MethodOutput` whose scores are ``(rows, width)``
    (``width``: the batch's ``tokens`` or ``keys``, as its ``space`` says), whose layers are ``(rows, L,
    width)`` and whose meta holds one value per input: a wrong shape would otherwise be broadcast over the batch
    or read as other inputs' scores."""
    def fail(what: str) -> NoReturn:
        raise MethodError(f"method {method!r} returned {what}")

    if not isinstance(result, MethodOutput):
        fail(f"a {type(result).__name__}; a method returns a MethodOutput (attnlens.methods.registry)")
    if result.space not in SPACES:
        fail(f"space={result.space!r}; it is one of {', '.join(map(repr, SPACES))}")
    def real_tensor(name: str, value: Any) -> None:
        if not torch.is_tensor(value) or value.is_complex() or value.dtype == torch.bool:
            kind = f"{value.dtype} tensor" if torch.is_tensor(value) else type(value).__name__
            fail(f"{name} as a {kind}; they are a real-valued torch tensor")

    width = tokens if result.space == "tokens" else keys
    real_tensor("scores", result.scores)
    if tuple(result.scores.shape) != (rows, width):
        fail(f"scores of shape {tuple(result.scores.shape)}; expected {(rows, width)} (inputs × {result.space} of "
             "the batch)")
    if result.layers is not None:
        real_tensor("layers", result.layers)
        if result.layers.dim() != 3 or result.layers.shape[0] != rows or result.layers.shape[2] != width:
            fail(f"layers of shape {tuple(result.layers.shape)}; expected ({rows}, layers, {width})")
    for key, value in (result.meta or {}).items():
        if not torch.is_tensor(value) or tuple(value.shape) != (rows,):
            got = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
            fail(f"meta[{key!r}] of {got}; each meta value is a tensor of one value per input, ({rows},)")


def _warn_if_not_finite(method: str, scores: torch.Tensor, runner: ModelRunner,
                        logits: torch.Tensor | None = None) -> None:
    """A warning where a method's scores overflowed or divided 0 by 0 (they are written as they are, ``inf`` or
    ``nan``, and a JSON reader may refuse them): most often a half-precision model's range, or the model's own
    output not finite (``logits``, those of the pass the method read)."""
    bad = ~torch.isfinite(scores)
    if bool(bad.any()):
        dtype = next(runner.model.parameters()).dtype
        if logits is not None and not bool(torch.isfinite(logits.detach()).all()):
            why = " (the model's own output is not finite for these inputs)"
        elif dtype in (torch.float16, torch.bfloat16):
            why = (f" with this {str(dtype).removeprefix('torch.')} model; load it in float32 (--dtype float32) to "
                   "explain it")
        else:
            why = " (the method's own arithmetic: it divided 0 by 0 or overflowed)"
        warnings.warn(f"{method}: {int(bad.sum())} of its scores are not finite (inf or nan){why}", stacklevel=2)


def explain_batch(
    runner: ModelRunner, batch: list[Encoded], targets: list[Any], specs: list[Any],
    method_options: dict[str, dict[str, Any]], target_kind: str, gradients: bool,
    memory_budget: int = DEFAULT_BUDGET, tracker: ExplainProgress | None = None,
) -> list[Explanation]:
    """One :class:`Explanation` per input of one batch."""
    ctx, out = compute_batch(runner, batch, targets, specs, method_options, target_kind, gradients,
                             memory_budget=memory_budget, tracker=tracker)
    head = runner.head
    logit_mask, logit_targets = ctx.capture.logit_reading(head, ctx.token_mask, ctx.targets)
    shown = head.shown(ctx.capture.logits, logit_mask, logit_targets)
    predicted = head.prediction(ctx.capture.logits, logit_mask, ctx.answer_mask)
    chosen = ctx.targets.cpu().tolist()
    labels = runner.labels or None
    explanations = []
    meta = {
        "model": runner.name,
        "family": runner.adapter.family,
        "attention": runner.stream,
        "target_kind": target_kind,
        **head.meta(),
        **encoding_meta(runner.tokenizer),
        "options": {k: v for k, v in method_options.items() if v},
        "attnlens": __version__,
    }
    # one device->host copy per method and batch, then cheap numpy slices per example
    host = {m: (s.double().cpu().numpy(), None if lay is None else lay.double().cpu().numpy())
            for m, (s, lay) in out.items()}
    figures = {m: {k: v.cpu().tolist() for k, v in values.items()} for m, values in ctx.meta.items()}
    for b, e in enumerate(batch):
        n = len(e.ids)
        exp = Explanation(
            text=e.text,
            tokens=list(e.tokens),
            special=list(e.special),
            target=chosen[b],
            predicted=predicted[b],
            probabilities=shown[b],
            scores={m: s[b, :n].copy() for m, (s, _) in host.items()},
            layers={m: lay[b, :, :n].copy() for m, (_, lay) in host.items() if lay is not None},
            labels=labels,
            word_ids=e.word_ids,
            sequence_ids=e.sequence_ids,
            offsets=e.offsets,
            input_ids=list(e.ids),
            token_type_ids=e.type_ids,
            meta={**meta, "truncated_tokens": e.dropped} if e.dropped else dict(meta),
        )
        for m, values in figures.items():  # e.g. integrated gradients' completeness gap of this input
            exp.meta[m] = {k: v[b] for k, v in values.items()}
        head.annotate(exp)
        explanations.append(exp)
    return explanations


def _check_options_mapping(options: Any) -> dict[str, dict[str, Any]]:
    """``options`` as a dict of per-method option dicts; anything else is an :class:`InputError`."""
    if options is None:
        return {}
    example = 'e.g. {"attcat": {"alpha": "cls"}}'
    if not isinstance(options, Mapping):
        raise InputError(f"options must map method ids to option dicts ({example}), got {options!r:.80}")
    out: dict[str, dict[str, Any]] = {}
    for name, value in options.items():
        if not isinstance(name, str) or not isinstance(value, Mapping):
            raise InputError(f"options must map method ids to option dicts ({example}), got {name!r}: {value!r:.60}")
        out[name] = dict(value)
    return out
