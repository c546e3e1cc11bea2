"""Does a run stay within its memory budget at the longest input the budget admits? Per model and method.

Each case is a model (random weights from the configuration of a released model's size: memory does not depend
on the weights), a method and a budget. The case finds the longest input whose estimate fits the budget (up to
the model's positions and ``--max-tokens``), then explains it in a fresh process: load, warm up on a short input,
reset the peak (Linux ``VmHWM`` through ``/proc/self/clear_refs``), explain. Reported: the length, the estimate,
the peak resident memory beyond what the process held before the call (so the weights are outside both) and its
ratio to the budget. The promise is a ratio of at most 1.1; a run may also be refused up front, which the table
says. Attention flow on an encoder-decoder classifier explains every position (minutes per case): leave it out
there.

The work besides explaining is measured the same way under the names of :data:`OTHER_WORK`: ``headview`` (the
maps and page of ``--head-view`` at the longest input they fit) and ``scoring`` (copies of an input of up to
:data:`SCORED_TOKENS` tokens, one more than the largest batch the budget holds (at most 64), scored as the
faithfulness metrics score perturbed inputs).

``--kept`` measures a method whose backward keeps the layers' activations where they fit (AttnLRP's own pass, the
gradient methods' shared pass with fused attention) at the other limit its estimate draws: the longest input at
which its pass keeps every layer's activations (what its forward saves, counted on the model), where one more
token would have it recompute each layer in the backward.

Run: ``python bench/budget_promise.py [--models t5-base,bart-base,bert-base,llama] [--methods rawatt,...,headview,
scoring] [--budget 1GiB] [--kept] [--out bench/data/budget_promise.md]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from peak import ROOT, process_status, write_records  # noqa: E402

TOKENIZER = ROOT.parent / "shared" / "models" / "minilm-sst2"  # a WordPiece tokenizer: [PAD] 0, [CLS] 101, [SEP] 102
MODELS = ("bert-base", "gpt2", "llama", "modernbert-base", "deberta-v3-base", "bart-base", "bart-large", "t5-base",
          "flan-t5-base")
METHODS = ("rawatt", "rollout", "grads", "attgrads", "agrad", "gae", "cat", "attcat", "flow", "saliency",
           "inputxgradient", "integratedgradients", "partiallrp", "transatt", "attnlrp", "attnnorm", "globenc", "alti",
           "decompx", "valuezeroing")
# the other work a budget bounds: the head view's whole maps and its page (at the longest input they fit), and
# scoring perturbed copies of an input (faithfulness metrics, benchmarks), batched within the budget
OTHER_WORK = ("headview", "scoring")
SCORED_TOKENS = 1024


def build(kind: str, vocab: int) -> tuple[object, int]:
    """A random classifier of ``kind``'s sizes over ``vocab`` token ids, and the longest input it takes."""
    import torch
    import transformers

    torch.manual_seed(0)
    ids = dict(vocab_size=vocab, pad_token_id=0, bos_token_id=101, eos_token_id=102, num_labels=2)
    seq2seq = dict(ids, decoder_start_token_id=101)
    if kind == "bert-base":
        config = transformers.BertConfig(max_position_embeddings=4096, attn_implementation="eager", **ids)
        return transformers.BertForSequenceClassification(config), 4096
    if kind == "gpt2":  # its activation function (gelu_new) runs as several operations, each saving a wide tensor
        config = transformers.GPT2Config(n_positions=2048, **ids)
        return transformers.GPT2ForSequenceClassification(config), 2048
    if kind == "llama":
        config = transformers.LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                          num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=8192,
                                          **ids)
        return transformers.LlamaForSequenceClassification(config), 8192
    if kind == "modernbert-base":  # whole global and sliding-window masks
        config = transformers.ModernBertConfig(hidden_size=768, intermediate_size=1152, num_hidden_layers=22,
                                               num_attention_heads=12, max_position_embeddings=8192,
                                               attn_implementation="eager", cls_token_id=101, sep_token_id=102,
                                               **ids)
        return transformers.ModernBertForSequenceClassification(config), 8192
    if kind == "deberta-v3-base":  # disentangled attention: relative-position score terms
        config = transformers.DebertaV2Config(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                              intermediate_size=3072, max_position_embeddings=512,
                                              relative_attention=True, position_buckets=256,
                                              pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm",
                                              share_att_key=True, position_biased_input=False, **ids)
        return transformers.DebertaV2ForSequenceClassification(config), 512
    if kind in ("bart-base", "bart-large"):
        large = kind == "bart-large"
        width, layers, heads = (1024, 12, 16) if large else (768, 6, 12)
        config = transformers.BartConfig(d_model=width, encoder_layers=layers, decoder_layers=layers,
                                         encoder_attention_heads=heads, decoder_attention_heads=heads,
                                         encoder_ffn_dim=4 * width, decoder_ffn_dim=4 * width,
                                         max_position_embeddings=2048, attn_implementation="eager", **seq2seq)
        return transformers.BartForSequenceClassification(config), 2048
    if kind == "t5-base":
        config = transformers.T5Config(d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_decoder_layers=12,
                                       num_heads=12, attn_implementation="eager", **seq2seq)
        return transformers.T5ForSequenceClassification(config), 8192
    if kind == "flan-t5-base":  # T5 v1.1's gated feed-forward, gelu_new
        config = transformers.T5Config(d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_decoder_layers=12,
                                       num_heads=12, feed_forward_proj="gated-gelu", attn_implementation="eager",
                                       **seq2seq)
        return transformers.T5ForSequenceClassification(config), 8192
    raise SystemExit(f"unknown model {kind!r}; one of {', '.join(MODELS)}")


def one(kind: str, method: str, budget_text: str, max_tokens: int, kept: bool = False) -> dict:
    """The case, in this process."""
    import time
    import warnings

    from transformers import AutoTokenizer

    from attnlens import Explainer, InputError
    from attnlens.core import engine
    from attnlens.core.memory import longest_that_fits, parse_budget
    from attnlens.methods import get_method

    warnings.simplefilter("ignore")
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    model, positions = build(kind, len(tok))
    tok.model_max_length = positions
    budget = parse_budget(budget_text)
    if method in OTHER_WORK:
        return other_work(kind, method, model, tok, budget, min(positions, max_tokens))
    probe = Explainer(model.eval(), tok, max_length=positions)
    cost = engine.pass_cost(probe.runner, [get_method(method)], budget)
    if kept:  # the longest input whose pass keeps the layers' activations (a longer one recomputes them)
        def total(m: int) -> int:
            return budget + 1 if _recomputes(cost, method, m) else cost.total(m)
    else:
        total = cost.total
    n = min(longest_that_fits(budget, total), positions, max_tokens)
    ex = Explainer(model, tok, max_length=n)
    text = " ".join(["the film is a quiet , moving portrait of a family"] * (n // 8 + 2))
    assert len(ex.encode(text)[0].ids) == n
    # integrated gradients at a fixed step count: its internal batch, sized to the budget, sets its peak, and on
    # random weights its steps would grow to max_steps without converging
    options = {"integratedgradients": {"n_steps": 8}} if method == "integratedgradients" else None
    ex.explain(["a fine film"], methods=[method], memory_budget="64GiB", options=options)  # warm-up
    Path("/proc/self/clear_refs").write_text("5")
    before = process_status("VmRSS")
    start = time.perf_counter()
    refused = ""
    try:
        ex.explain([text], methods=[method], memory_budget=budget, options=options)
    except InputError as err:
        refused = str(err)
    peak = process_status("VmHWM") - before
    return {"model": kind, "method": method, "tokens": n, "budget_gib": budget / 2**30,
            "estimate_gib": cost.total(n) / 2**30, "peak_gib": peak / 2**30, "ratio": peak / budget,
            "seconds": time.perf_counter() - start, "refused": refused,
            "recomputed": _recomputes(cost, method, n)}


def _recomputes(cost: object, method: str, n: int) -> bool | None:
    """Whether the pass of ``method`` (its own, else the shared one) recomputes the layers at ``n`` tokens
    (``None``: no backward)."""
    storage = cost.own_storage(method, n) if method in cost.own_storages else cost.storage(n)
    return None if storage is None or not storage.backward else storage.recompute


def other_work(kind: str, what: str, model: object, tok: object, budget: int, longest: int) -> dict:
    """A case of :data:`OTHER_WORK`, in this process."""
    import time

    from attnlens import Explainer, InputError
    from attnlens.core.attention_view import attention_view_bytes
    from attnlens.core.batching import scoring_chunks
    from attnlens.core.memory import Storage, longest_that_fits, model_dims, pass_row_bytes
    from attnlens.core.modelstate import runs_sdpa
    from attnlens.evaluation import ModelPredictor
    from attnlens.evaluation.perturb import Variant
    from attnlens.viz.headview import attention_view_html, page_bytes

    model = model.eval()
    if what == "headview":
        n = min(longest, longest_that_fits(budget, lambda m: attention_view_bytes(model, m, page_bytes)))
    else:  # inputs of at most SCORED_TOKENS: enough copies to fill one batch the budget holds, and one more
        n = min(longest, SCORED_TOKENS)
    ex = Explainer(model, tok, max_length=n)
    text = " ".join(["the film is a quiet , moving portrait of a family"] * (n // 8 + 2))
    ids = ex.encode(text)[0].ids
    assert len(ids) == n
    predict = ModelPredictor(model, 0, batch_size=64, memory_budget=budget)
    if what == "headview":
        ex.attention_maps("a fine film", beside=page_bytes)  # warm-up
        estimate = attention_view_bytes(model, n, page_bytes)
    else:
        predict([Variant.of(ids[:7] + ids[-1:], [0] * 8)])  # warm-up (ending as the input does: BART's eos)
        fused = runs_sdpa(model)
        rows = len(next(scoring_chunks(model, [n] * 64, 64, budget)))  # the largest batch
        copies = min(64, rows + 1)
        estimate = rows * pass_row_bytes(model_dims(model), n, Storage(eager=not fused))
    Path("/proc/self/clear_refs").write_text("5")
    before = process_status("VmRSS")
    start = time.perf_counter()
    refused = ""
    try:
        if what == "headview":
            tokens, special, att = ex.attention_maps(text, memory_budget=budget, beside=page_bytes)
            attention_view_html(tokens, att, special)
        else:
            predict([Variant.of(ids, [0] * n) for _ in range(copies)])
    except InputError as err:
        refused = str(err)
    peak = process_status("VmHWM") - before
    return {"model": kind, "method": what, "tokens": n, "budget_gib": budget / 2**30, "estimate_gib": estimate / 2**30,
            "peak_gib": peak / 2**30, "ratio": peak / budget, "seconds": time.perf_counter() - start,
            "refused": refused}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--budget", default="1GiB")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--kept", action="store_true",
                        help="the longest input whose pass keeps every layer's activations")
    parser.add_argument("--out", required=True, help="the Markdown table; the records go beside it as .jsonl")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # internal: MODEL METHOD in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, args.budget, args.max_tokens, args.kept)))
        return
    from peak import measured

    rows = []
    for kind in args.models.split(","):
        for method in args.methods.split(","):
            if method == "flow" and kind.startswith(("bart", "t5")):
                continue
            record = {"model": kind, "method": method}
            out = measured(__file__, ["--one", kind, method, "--budget", args.budget, "--max-tokens",
                                      str(args.max_tokens), "--out", args.out, *(["--kept"] if args.kept else [])],
                           args.timeout, record)
            rows.append(out)
            print(json.dumps(out), file=sys.stderr, flush=True)
    out = Path(args.out)
    write_records(out, rows)
    limit = ("the longest input at which the pass keeps every layer's activations" if args.kept
             else "the longest input the estimate admits")
    lines = [f"Budget {args.budget}; {limit} (at most {args.max_tokens:,} tokens); "
             "peak = resident memory beyond the process's before the call.", "",
             "| model | method | tokens | estimate GiB | peak GiB | peak / budget | seconds |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r or "tokens" not in r:
            lines.append(f"| {r['model']} | {r['method']} | error: {r.get('error', '?')[:80]} | | | | |")
            continue
        over = " **over**" if r["ratio"] > 1.1 else ""
        verdict = "refused up front" if r["refused"] else f"{r['ratio']:.2f}{over}"
        lines.append(f"| {r['model']} | {r['method']} | {r['tokens']:,} | {r['estimate_gib']:.2f} | "
                     f"{r['peak_gib']:.2f} | {verdict} | {r['seconds']:.1f} |")
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
