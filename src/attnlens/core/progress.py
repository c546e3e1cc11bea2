"""Progress of :meth:`Explainer.explain`: work measured in estimated cost, so that the bar moves inside long
batches and its ETA holds when inputs come shortest first (the engine sorts them by length).

An input of ``n`` tokens costs :func:`input_cost` per pass; a batch plans one pass for the shared capture and its
methods plus the passes of the methods that run their own (``n_steps`` for integrated gradients). The bar counts
that cost, normalised to the number of inputs, and shows the inputs finished beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

UNITS = 1000  # bar units per input of average cost
ProgressCallback = Callable[[float, int], None]  # (fraction of the estimated work done, inputs finished)


def input_cost(n_tokens: int, hidden: int) -> float:
    """Relative cost of one pass over ``n_tokens`` tokens: per layer the linear maps take ~12·n·D² and attention
    ~2·n²·D multiply-adds, i.e. ∝ n·(6D + n) (the layer count is the same for every input)."""
    return float(n_tokens) * (6 * hidden + n_tokens)


def planned_passes(options: dict[str, Any]) -> float:
    """Passes over its batch a method that runs its own plans: its ``n_steps`` option when it has one (an
    adaptive run may take more or fewer; the bar is topped up or capped per batch), else one."""
    steps = options.get("n_steps")
    if steps is None and "n_steps" in options:  # an adaptive schedule: plan what it typically takes
        from ..methods.gradient import TYPICAL_STEPS

        steps = TYPICAL_STEPS
    # unchecked here (the method checks its options and raises): a bad value plans one pass
    return float(steps) if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else 1.0


class ExplainProgress:
    """Reports the work of one ``explain`` call to a tqdm bar and/or a callback.

    Args:
        lengths: token counts of the inputs.
        hidden: the model's hidden size (for :func:`input_cost`).
        own_passes: planned passes of each method that runs its own, by method id.
        bar: show a tqdm bar (on stderr unless ``file`` is given).
        callback: called with (fraction of the estimated work done, inputs finished) after every update.
        desc, unit: the bar's label and what it counts (a generation's steps are its inputs).
    """

    def __init__(
        self, lengths: Sequence[int], hidden: int, own_passes: dict[str, float], *, bar: bool = False,
        callback: ProgressCallback | None = None, file: Any = None, desc: str = "explaining", unit: str = "inputs",
    ) -> None:
        costs = [input_cost(n, hidden) for n in lengths]
        total = sum(costs) or 1.0
        self.weights = [len(costs) * c / total for c in costs]  # sums to the number of inputs
        self.n_inputs = len(costs)
        self.own_passes = dict(own_passes)
        self.passes = 1.0 + sum(self.own_passes.values())  # per input: the shared pass + the own passes
        self.done = 0.0
        self.finished = 0
        self.callback = callback
        self.unit = unit
        # the bar counts integer units (no float drift past its total): UNITS per input of average cost
        self.bar = tqdm(total=self.n_inputs * UNITS, disable=not bar, desc=desc, file=file,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]")
        self._postfix()
        self._batch_weight = 0.0
        self._budget = 0.0  # what the current method may still advance

    def announce(self) -> str | None:
        """A line stating the planned passes of methods that run their own, and their share of the work."""
        if not self.own_passes or not self.n_inputs:
            return None
        parts = [f"{m}: {p:g} passes x {self.n_inputs} {self.unit} = {p * self.n_inputs:g} forward+backward passes, "
                 f"~{p / self.passes:.0%} of the work" for m, p in self.own_passes.items() if p > 1]
        return "; ".join(parts) or None

    def start(self) -> None:
        line = self.announce()
        if line and not self.bar.disable:
            self.bar.write(line, file=self.bar.fp)

    # -- per batch
    def begin_batch(self, indices: Sequence[int]) -> None:
        self._batch_weight = sum(self.weights[i] for i in indices)
        self._batch_start = self.done
        self._batch_size = len(indices)

    def begin_method(self, passes: float) -> None:
        """The next step of the batch is worth ``passes`` passes over it."""
        self._budget = passes

    def advance(self, passes: float) -> None:
        """``passes`` passes over the batch are done (capped by the current step's plan)."""
        step = min(max(passes, 0.0), self._budget)
        self._budget -= step
        self._move(self._batch_weight * step / self.passes)

    def end_batch(self) -> None:
        self.finished += self._batch_size
        self._move(self._batch_start + self._batch_weight - self.done)  # top up what the plan did not cover

    def _move(self, amount: float) -> None:
        self.done = min(self.done + max(amount, 0.0), float(self.n_inputs))
        self._postfix()
        self.bar.update(min(round(self.done * UNITS), self.bar.total) - self.bar.n)
        if self.callback is not None:
            self.callback(self.done / max(self.n_inputs, 1), self.finished)

    def _postfix(self) -> None:
        if not self.bar.disable:
            self.bar.set_postfix_str(f"{self.finished}/{self.n_inputs} {self.unit} done", refresh=False)

    def close(self) -> None:
        self.bar.close()
