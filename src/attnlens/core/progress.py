"""Progress of :meth:`Explainer.explain`: work measured in estimated cost, so that the bar moves inside long
batches and its ETA holds when inputs come shortest first (the engine sorts them by length).

An input of ``n`` tokens costs :func:`input_cost` per pass; a batch plans one pass for the shared capture and its
methods plus the work of the methods that run their own, in passes (:func:`method_passes`: ``n_steps`` for
integrated gradients, about one per token for value zeroing). The bar counts that cost, normalised to the number
of inputs, and shows the inputs finished beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

UNITS = 1000  # bar units per input of average cost
ProgressCallback = Callable[[float, int], None]  # (fraction of the estimated work done, inputs finished)
Plan = Callable[[int], float]  # an own-pass method's work on an input of n tokens, in passes over it


def input_cost(n_tokens: int, hidden: int) -> float:
    """Relative cost of one pass over ``n_tokens`` tokens: per layer the linear maps take ~12·n·D² and attention
    ~2·n²·D multiply-adds, i.e. ∝ n·(6D + n) (the layer count is the same for every input)."""
    return float(n_tokens) * (6 * hidden + n_tokens)


def planned_passes(options: Mapping[str, Any]) -> float:
    """Passes over its batch a method that runs its own plans: its ``n_steps`` option when it has one (an
    adaptive run may take more or fewer; the bar is topped up or capped per batch), else one."""
    steps = options.get("n_steps")
    if steps is None and "n_steps" in options:  # an adaptive schedule: plan what it typically takes
        from ..methods.gradient import TYPICAL_STEPS

        steps = TYPICAL_STEPS
    # unchecked here (the method checks its options and raises): a bad value plans one pass
    return float(steps) if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else 1.0


def method_passes(method: Any, model: Any, options: Mapping[str, Any]) -> Plan:
    """``n ↦`` the planned work of own-pass ``method`` (a registered :class:`~attnlens.methods.registry.Method`)
    with ``options`` on an input of ``n`` tokens, in passes: its ``passes`` estimate where it has one (at least
    a tenth of a pass), else :func:`planned_passes`."""
    estimate = getattr(method, "passes", None)
    if estimate is None:
        fixed = planned_passes(options)
        return lambda n: fixed
    return lambda n: max(0.1, float(estimate(model, n, options)))


class ExplainProgress:
    """Reports the work of one ``explain`` call to a tqdm bar and/or a callback.

    Args:
        lengths: token counts of the inputs.
        hidden: the model's hidden size (for :func:`input_cost`).
        own_passes: the planned work of each method that runs its own, by method id: passes per input, or a
            :data:`Plan` of the input's length.
        bar: show a tqdm bar (on stderr unless ``file`` is given).
        callback: called with (fraction of the estimated work done, inputs finished) after every update.
        desc, unit: the bar's label and what it counts (a generation's steps are its inputs).

    A batch's steps are announced with :meth:`begin_step` (the shared pass, a method reading it) or
    :meth:`begin_method` (one that runs its own), and each reports the share of its work done with :meth:`advance`.
    """

    def __init__(
        self, lengths: Sequence[int], hidden: int, own_passes: Mapping[str, float | Plan], *, bar: bool = False,
        callback: ProgressCallback | None = None, file: Any = None, desc: str = "explaining", unit: str = "inputs",
    ) -> None:
        plans = {m: p if callable(p) else (lambda n, p=p: float(p)) for m, p in own_passes.items()}
        self.own = [{m: plan(n) for m, plan in plans.items()} for n in lengths]  # per input, per method
        costs = [input_cost(n, hidden) for n in lengths]
        passes = [1.0 + sum(own.values()) for own in self.own]  # per input: the shared pass and the own work
        total = sum(c * p for c, p in zip(costs, passes, strict=True)) or 1.0
        self.n_inputs = len(costs)
        # one pass over input i, in inputs of average work: the whole work sums to the number of inputs
        self.weights = [self.n_inputs * c / total for c in costs]
        self.work = [w * p for w, p in zip(self.weights, passes, strict=True)]  # each input's, summing to n_inputs
        self.done = 0.0
        self.finished = 0
        self.callback = callback
        self.unit = unit
        # the bar counts integer units (no float drift past its total): UNITS per input of average cost
        self.bar = tqdm(total=self.n_inputs * UNITS, disable=not bar, desc=desc, file=file,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]")
        self._postfix()
        self._batch: list[int] = []
        self._batch_start = self._batch_end = 0.0
        self._step = 0.0  # the work of the current step
        self._left = 0.0  # the share of it not reported yet

    def announce(self) -> str | None:
        """A line stating the planned work of methods that run their own, and their share of the work."""
        if not self.own or not self.n_inputs:
            return None
        parts = []
        for m in self.own[0]:
            planned = [own[m] for own in self.own]
            if max(planned) <= 1:
                continue
            share = sum(w * p for w, p in zip(self.weights, planned, strict=True)) / self.n_inputs
            total = sum(planned)
            if min(planned) == max(planned):
                parts.append(f"{m}: {planned[0]:g} passes x {self.n_inputs} {self.unit} = {total:g} forward+backward "
                             f"passes, ~{share:.0%} of the work")
            else:
                parts.append(f"{m}: the work of about {total:.0f} forward+backward passes over {self.n_inputs} "
                             f"{self.unit}, ~{share:.0%} of the work")
        return "; ".join(parts) or None

    def start(self) -> None:
        line = self.announce()
        if line and not self.bar.disable:
            self.bar.write(line, file=self.bar.fp)

    # -- per batch
    def begin_batch(self, indices: Sequence[int]) -> None:
        self._batch = list(indices)
        self._batch_start = self.done
        end = self.done + sum(self.work[i] for i in self._batch)
        self._batch_end = float(self.n_inputs) if self._close(end, self.n_inputs) else end

    def begin_step(self, passes: float) -> None:
        """The next step of the batch is worth ``passes`` passes over each of its inputs."""
        self._step = passes * sum(self.weights[i] for i in self._batch)
        self._left = 1.0

    def begin_method(self, name: str) -> None:
        """The next step of the batch is own-pass method ``name``'s work, as planned."""
        self._step = sum(self.weights[i] * self.own[i].get(name, 1.0) for i in self._batch)
        self._left = 1.0

    def advance(self, share: float) -> None:
        """A ``share`` of the current step's work is done (the step's shares are capped at the whole)."""
        step = min(max(share, 0.0), self._left)
        self._left -= step
        self._move(self._step * step)

    def end_batch(self) -> None:
        self.finished += len(self._batch)
        self._reach(self._batch_end)  # top up what the plan did not cover

    def _move(self, amount: float) -> None:
        self._reach(self.done + max(amount, 0.0))

    def _reach(self, done: float) -> None:
        if self._close(done, self._batch_end):  # the batch's shares summed, up to rounding
            done = self._batch_end
        self.done = min(max(self.done, done), float(self.n_inputs))
        self._postfix()
        self.bar.update(min(round(self.done * UNITS), self.bar.total) - self.bar.n)
        if self.callback is not None:
            self.callback(self.done / max(self.n_inputs, 1), self.finished)

    def _close(self, a: float, b: float) -> bool:
        return abs(a - b) <= 1e-9 * max(1, self.n_inputs)

    def _postfix(self) -> None:
        if not self.bar.disable:
            self.bar.set_postfix_str(f"{self.finished}/{self.n_inputs} {self.unit} done", refresh=False)

    def close(self) -> None:
        self.bar.close()
