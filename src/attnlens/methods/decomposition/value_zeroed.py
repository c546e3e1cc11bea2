"""A layer recomputed for value zeroing: its output with one attended token's value vector zeroed, for each
(row, attended token) pair, from the layer's pieces (its :class:`~attnlens.models.architectures.Anatomy`),
without rerunning its attention.

Zeroing key j's value vector removes exactly δ_ij = Σ_h A^h_ij f^h_j from row i's attention branch. What follows
the branch is evaluated at every changed sum, so the work is one post-attention part per pair; two shortcuts make
that part cheaper without changing what it computes:

- A parallel layer (GPT-J, GPT-NeoX, Phi) feeds its input, not the branch, to its feed-forward, so the zeroed
  output is the output minus δ_ij: no feed-forward per pair.
- A sequential layer's gated feed-forward starts with two linear projections of a norm of the changed sum
  z_ij = z_i − δ_ij. The norm is linear up to its per-vector scale and mean, so the projections are
  W'z_i − Σ_h A^h_ij W'f^h_j scaled and shifted per pair (W' = the projections times the norm's gain): each
  head's W'f^h_j once per key, then H products per pair where the projections took D (the hidden size), where
  enough rows read a block of keys to repay the W'f^h_j. The rest of the feed-forward (its activation and output
  projection) still runs per pair.

Each layer recomputed so is compared with the model's before it is used (:meth:`ValueZeroedLayer.reproduces`, and
the zeroing of a token against a rerun in :mod:`attnlens.methods.valuezeroing`); the shortcut through the
projections is compared with the plain recomputation when the layer is built, and dropped where it differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ...models.architectures import Anatomy, architecture_for
from ...models.layer_modules import feed_forward_after_first, first_projection, run_feed_forward
from ...models.norms import is_rms_norm, rms_eps, rms_gain
from .layers import anatomy_of, attention_sum, layer_output, layer_parts, output_error, value_terms

# the projected values of a block of keys (H per key) are formed where at least this many rows per head read them
SHARING_ROWS_PER_HEAD = 4


@dataclass
class NormedProjection:
    """A feed-forward's first projections (:func:`~attnlens.models.layer_modules.first_projection`) of a norm of
    ``z``: ``u = (W'z − μ W'1) s + c`` with the norm's scale ``s`` (1/√(var + ε), or 1/√(mean z² + ε) for an
    RMSNorm, whose mean ``μ`` is 0), ``W' = W diag(g)`` and ``c = Wβ + b`` (g, β: the norm's gain and shift)."""

    weight: torch.Tensor  # (I, D): W'
    shift: torch.Tensor  # (I,): c
    ones: torch.Tensor | None  # (I,): W'1, a LayerNorm's mean term; None for an RMSNorm
    eps: float

    @classmethod
    def of(cls, mods: dict[str, nn.Module], norm: nn.Module, dtype: torch.dtype) -> NormedProjection | None:
        """The projections of the feed-forward in ``mods`` after ``norm`` (an ``nn.LayerNorm`` or an RMSNorm), in
        ``dtype``; ``None`` for a feed-forward without known first projections or another norm."""
        first = first_projection(mods)
        if first is None:
            return None
        weight, bias = (t if t is None else t.to(dtype) for t in first)
        if isinstance(norm, nn.LayerNorm) and norm.elementwise_affine:
            gain, shift = norm.weight.detach().to(dtype), norm.bias
            shift = None if shift is None else weight @ shift.detach().to(dtype)
            eps, mean = norm.eps, True
        elif is_rms_norm(norm):
            gain, shift, eps, mean = rms_gain(norm, weight[0]), None, rms_eps(norm), False
        else:
            return None
        scaled = weight * gain
        total = torch.zeros(weight.shape[0], dtype=dtype, device=weight.device)
        for part in (shift, bias):
            total = total if part is None else total + part
        return cls(scaled, total, scaled.sum(1) if mean else None, float(eps))

    def project(self, vectors: torch.Tensor) -> torch.Tensor:
        """``W'`` times each of ``vectors`` ``(..., D)``."""
        return vectors.to(self.weight.dtype) @ self.weight.T

    def finish(self, projected: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``u`` from ``W'z`` (``projected``, ``(..., I)``, overwritten) and ``z`` ``(..., D)`` itself (its
        statistics, in float32 or wider as the norms take them)."""
        z = z.to(torch.promote_types(z.dtype, torch.float32))
        if self.ones is None:
            scale = torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            mean = z.mean(-1, keepdim=True)
            scale = torch.rsqrt((z - mean).pow(2).mean(-1, keepdim=True) + self.eps)
            projected.sub_(mean.to(projected.dtype) * self.ones)
        return projected.mul_(scale.to(projected.dtype)).add_(self.shift)


@dataclass
class ValueZeroedLayer:
    """A layer recomputed from its pieces (its :class:`Anatomy`) at its input ``x`` ``(B, N, D)`` and attention
    ``attn`` ``(B, H, N, N)``, for value zeroing.

    Zeroing key j's value vector leaves every attention weight as it is (the weights do not read the values), so
    it removes exactly Σ_h A^h_ij f^h_j from row i's attention branch (f: the head's value vector through the
    output projection, the value bias included). The layer's output with it zeroed is then its post-attention part
    (the branch's own norm, Gemma 2's, the residual, norms, FFN) at that changed branch: nothing of the attention is
    rerun, and a pair with A_ij = 0 in every head is not changed at all. ``output`` is the layer's output
    recomputed the same way (compare with the model's before trusting the rest)."""

    mods: dict[str, nn.Module]
    anatomy: Anatomy
    x: torch.Tensor
    attn: torch.Tensor
    f: torch.Tensor
    pre1: torch.Tensor
    output: torch.Tensor
    branch: torch.Tensor | None = None  # the attention branch before a norm of its own (Gemma 2's), else None
    # a sequential layer's feed-forward projections read through their norm (module docstring), else None
    projection: NormedProjection | None = None
    _projected: tuple[tuple[int, int, int], torch.Tensor] | None = field(default=None, repr=False)

    @staticmethod
    def applies(model: nn.Module) -> bool:
        """Whether :meth:`of` recomputes ``model``'s layers: a known anatomy whose zeroed outputs are a function of
        the attention branch alone (not experts, which route each vector; not an encoder-decoder's layers)."""
        anatomy = anatomy_of(model)
        return not (anatomy is None or anatomy.moe or architecture_for(model.config).family == "encoder-decoder")

    @classmethod
    def of(cls, model: nn.Module, block: nn.Module, x: torch.Tensor, attn: torch.Tensor) -> ValueZeroedLayer | None:
        """The layer ``block`` of ``model`` at input ``x`` and attention ``attn``, or ``None`` where it does not
        apply (:meth:`applies`)."""
        if not ValueZeroedLayer.applies(model):
            return None
        anatomy = anatomy_of(model)
        entry = architecture_for(model.config)
        mods = layer_parts(block, model, anatomy)
        f, v = value_terms(mods, mods["ln1"](x) if anatomy.pre_ln else x, attn.shape[1], entry.layers)
        # the branch Σ_h (A^h v^h) W_O^h + b alone (no residual), once; a norm of its own (Gemma 2's) applies to it
        # before the residual sum, and the zeroing changes the branch inside that norm, so the branch is kept
        without_norm = {k: m for k, m in mods.items() if k != "post_attn_norm"}
        branch = attention_sum(without_norm, torch.zeros_like(x), attn, f, v)[0]
        norm = mods.get("post_attn_norm")
        pre1 = x + (branch if norm is None else norm(branch))
        layer = cls(mods, anatomy, x, attn, f, pre1, layer_output(mods, anatomy, x, pre1, ratio=False).got,
                    None if norm is None else branch)
        if norm is None and not anatomy.parallel:
            layer.projection = layer._checked_projection()
        return layer

    def _checked_projection(self) -> NormedProjection | None:
        """The feed-forward's projections through their norm, where they give this layer's output at every row."""
        if "gate" not in self.mods:
            # one input projection: it saves one product of two, and its elementwise steps cost about as much (an
            # ungated MiniLM at 64-256 tokens ran 10-50% slower with it); a gated one saves two of three
            return None
        norm = self.mods["ln2" if self.anatomy.pre_ln else "ln1"]
        projection = NormedProjection.of(self.mods, norm, torch.promote_types(self.f.dtype, torch.float32))
        if projection is None:
            return None
        got = self._output_at(self.pre1, projection.finish(projection.project(self.pre1), self.pre1))
        every = torch.ones(self.output.shape[:-1], dtype=torch.bool, device=self.output.device)
        err, tol = output_error(got, self.output, every)
        return projection if err <= tol else None

    def reproduces(self, want: torch.Tensor, real: torch.Tensor) -> bool:
        """Whether :attr:`output` is the model's layer output ``want`` at the ``real`` rows, to the rounding
        :func:`check_layer` allows."""
        err, tol = output_error(self.output, want.to(self.output.dtype), real)
        return err <= tol

    def zeroed(self, example: int, rows: slice | torch.Tensor, keys: int, start: int = 0,
               sharing: int | None = None) -> torch.Tensor:
        """``(R, K, D)``: the layer's output at ``rows`` (a slice or positions) of ``example`` with the value
        vector of each of the positions ``start`` … ``keys − 1`` zeroed (one at a time). ``sharing``: how many rows
        are asked about these keys in all, these and others (default: these): the keys' projected values
        (module docstring) are formed only where enough rows share them to repay their cost."""
        a = self.attn[example][:, rows, start:keys].to(self.f.dtype).permute(2, 1, 0)  # (K, R, H)
        delta = torch.bmm(a, self.f[example, :, start:keys].transpose(0, 1))  # (K, R, D)
        pre1 = self.pre1[example][rows][None]
        if self.branch is None:
            pre = pre1 - delta
        else:  # x + N(branch − δ)
            pre = self.x[example][rows][None] + self.mods["post_attn_norm"](self.branch[example][rows][None] - delta)
        if self.anatomy.parallel:  # the feed-forward reads the layer's input, which the zeroing leaves as it is
            return (self.output[example][rows][None] + (pre - pre1)).transpose(0, 1)
        p = self.projection
        if p is None or (a.shape[1] if sharing is None else sharing) < SHARING_ROWS_PER_HEAD * a.shape[2]:
            return self._output_at(pre).transpose(0, 1)
        projected = torch.baddbmm(p.project(pre1), a.to(p.weight.dtype), self._projected_values(example, start, keys),
                                  alpha=-1)  # W'(z_i − δ_ij), (K, R, I)
        return self._output_at(pre, p.finish(projected, pre)).transpose(0, 1)

    def _projected_values(self, example: int, start: int, keys: int) -> torch.Tensor:
        """``(K, H, I)``: W'f^h_j of the keys ``start`` … ``keys − 1`` (the last block asked for is kept: the rows
        that attend to one block of keys are asked for in turn)."""
        key = (example, start, keys)
        if self._projected is None or self._projected[0] != key:
            self._projected = (key, self.projection.project(self.f[example, :, start:keys]).transpose(0, 1))
        return self._projected[1]

    def _output_at(self, pre: torch.Tensor, projected: torch.Tensor | None = None) -> torch.Tensor:
        """A sequential layer's output from its attention block's residual sum ``pre``: its feed-forward run on the
        norm of ``pre``, or finished from its first projections ``projected`` (:class:`NormedProjection`)."""
        pre_ln = self.anatomy.pre_ln
        y = None if projected is not None and pre_ln else self.mods["ln2" if pre_ln else "ln1"](pre)
        ffn = (run_feed_forward(self.mods, y) if projected is None
               else feed_forward_after_first(self.mods, projected.to(pre.dtype))).output
        if pre_ln:
            return pre + (self.mods["post_ffn_norm"](ffn) if "post_ffn_norm" in self.mods else ffn)
        return self.mods["ln2"](y + ffn)
