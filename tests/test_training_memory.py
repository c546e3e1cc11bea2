"""Fine-tuning within a memory budget: the step's estimate, micro-batches that add up to the batch's update, and
refusals before training starts."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

from attnlens.cli import main
from attnlens.core import training_memory
from attnlens.core.training_memory import TrainingMemory, materialises_maps
from attnlens.models.feed_forward import saved_storages
from attnlens.train import TrainConfig, optimise


def tiny_bert(dropout: float = 0.1, implementation: str = "sdpa") -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=24, max_position_embeddings=512, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout, attn_implementation=implementation, pad_token_id=0)
    return BertForSequenceClassification(config)


def saved_bytes(model: torch.nn.Module, rows: int, n: int) -> int:
    """Bytes autograd saves for the backward of a training forward over ``rows`` examples of ``n`` tokens
    (parameters aside)."""
    model.train()
    torch.manual_seed(0)
    with saved_storages(model.parameters()) as saved:
        model(input_ids=torch.randint(5, 32, (rows, n)), labels=torch.zeros(rows, dtype=torch.long))
    return sum(saved.values())


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_the_row_estimate_covers_what_a_training_forward_saves(implementation):
    model = tiny_bert(implementation=implementation)
    plan = TrainingMemory.of(model, 2**30)
    n = 384
    saved = saved_bytes(model, 1, n)
    assert plan.maps  # attention dropout: the probabilities are materialised, with or without fused attention
    assert saved <= plan.row_bytes(n) <= 2 * saved
    dims = plan.dims
    dropout_term = dims.maps * dims.heads * n * n * (dims.itemsize + training_memory.DROPOUT_MASK_BYTES)
    assert plan.row_bytes(n) - dropout_term < saved  # the dropout mask and dropped probabilities are what it needs


def test_a_trained_score_bias_adds_one_map_per_attention():
    from transformers import T5Config, T5ForSequenceClassification

    config = T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=24, num_layers=1, num_decoder_layers=1, num_heads=2,
                      pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    plan = TrainingMemory.of(T5ForSequenceClassification(config), 2**30)
    assert plan.dims.bias_maps > 0
    n, dims = 64, plan.dims
    without = dataclasses.replace(plan, dims=dataclasses.replace(dims, bias_maps=0))
    biases = dims.bias_maps * dims.heads * n * n * dims.itemsize  # the biases a pass holds (memory.py)
    one_map_each = dims.maps * dims.heads * n * n * dims.itemsize
    assert plan.row_bytes(n) - without.row_bytes(n) == biases + training_memory.TRAINED_BIAS_MAPS * one_map_each


def test_states_count_the_trainable_parameters_only():
    model = tiny_bert()
    every = sum(p.numel() * 4 for p in model.parameters())
    assert TrainingMemory.of(model, 2**30).state_bytes == training_memory.STATE_COPIES * every
    for p in model.bert.embeddings.parameters():
        p.requires_grad_(False)
    frozen = sum(p.numel() * 4 for p in model.bert.embeddings.parameters())
    assert TrainingMemory.of(model, 2**30).state_bytes == training_memory.STATE_COPIES * (every - frozen)


def test_maps_are_counted_where_attention_is_eager_or_drops_out():
    assert materialises_maps(tiny_bert(implementation="eager"))
    assert materialises_maps(tiny_bert(dropout=0.1, implementation="sdpa"))
    assert not materialises_maps(tiny_bert(dropout=0.0, implementation="sdpa"))
    llama = LlamaForSequenceClassification(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24,
                                                       num_hidden_layers=1, num_attention_heads=2,
                                                       attn_implementation="sdpa", pad_token_id=0))
    assert not materialises_maps(llama)  # no attention dropout: fused attention holds no maps


def test_micro_batches_fit_the_budget_and_cover_the_batch():
    plan = TrainingMemory.of(tiny_bert(), 2**30)
    lengths = [5, 40, 12, 300, 7, 90, 33]
    parts = list(plan.micro_batches(lengths))
    assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
    assert parts == [list(range(len(lengths)))]  # a tiny model: the whole batch fits, in its order
    tight = TrainingMemory(plan.state_bytes + 3 * plan.row_bytes(300), plan.state_bytes, plan.update_bytes,
                           plan.dims, plan.maps)
    parts = list(tight.micro_batches(lengths))
    assert len(parts) > 1
    for part in parts:
        longest = max(lengths[i] for i in part)
        assert len(part) == 1 or tight.need(len(part), longest) <= tight.budget


def _examples(count: int, seed: int = 0) -> tuple[list[list[int]], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (count,), generator=generator).tolist()
    ids = [torch.randint(5, 32, (n,), generator=generator).tolist() for n in lengths]
    return ids, torch.randint(0, 2, (count,), generator=generator)


def _train(model, ids, labels, cfg, log=lambda _: None):
    def make_batch(idx):
        n = max(len(ids[i]) for i in idx)
        input_ids = torch.tensor([ids[i] + [0] * (n - len(ids[i])) for i in idx])
        mask = torch.tensor([[1] * len(ids[i]) + [0] * (n - len(ids[i])) for i in idx])
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels[idx]}

    return optimise(model, [len(x) for x in ids], make_batch, cfg, torch.device("cpu"), log)


def test_micro_batches_give_the_whole_batchs_update(monkeypatch, tmp_path):
    ids, labels = _examples(12)
    cfg = TrainConfig(model="m", out=str(tmp_path / "o"), data_file="f", batch_size=6, epochs=1.0, progress=False,
                      memory_budget="64MiB")
    whole = tiny_bert(dropout=0.0)
    split = copy.deepcopy(whole)
    calls = {"whole": 0, "split": 0}
    whole.register_forward_hook(lambda *_: calls.__setitem__("whole", calls["whole"] + 1))
    split.register_forward_hook(lambda *_: calls.__setitem__("split", calls["split"] + 1))
    whole_losses, _ = _train(whole, ids, labels, cfg)

    # rows of half of what is left beside the states: micro-batches of two examples
    monkeypatch.setattr(TrainingMemory, "row_bytes", lambda self, n: self.activation_budget // 2)
    said: list[str] = []
    split_losses, _ = _train(split, ids, labels, cfg, said.append)
    assert calls == {"whole": 2, "split": 6}
    assert len(said) == 1 and "micro-batches of at most 2 examples" in said[0]
    assert split_losses == pytest.approx(whole_losses, rel=1e-5)
    for (name, a), b in zip(whole.named_parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def _jsonl(path, rows: int) -> str:
    words = ["good", "bad", "film", "plot"]
    path.write_text("".join(json.dumps({"text": " ".join(words[(i + j) % 4] for j in range(3 + i % 5)),
                                        "label": i % 2}) + "\n" for i in range(rows)))
    return str(path)


@pytest.fixture
def tiny_dir(tmp_path) -> str:
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad", "film", "plot"]
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    path = tmp_path / "tiny"
    tiny_bert().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_an_example_the_budget_cannot_hold_is_refused_before_training(monkeypatch, tmp_path, tiny_dir, capsys):
    data = _jsonl(tmp_path / "d.jsonl", 20)
    # an example's activations: an eighth of the budget per token, so that up to 7 tokens fit beside the states
    monkeypatch.setattr(TrainingMemory, "row_bytes", lambda self, n: n * self.budget // 8)
    out = tmp_path / "o"
    args = ["train", "--model", tiny_dir, "--data-file", data, "--memory-budget", "64MiB", "--out", str(out),
            "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlens: error: training on examples of 9 tokens") and "\n" not in err
    assert "examples up to 7 tokens fit" in err and "64 MiB" in err
    assert not out.exists()


def test_states_beyond_the_budget_are_refused_in_one_line(monkeypatch, tmp_path, tiny_dir, capsys):
    data = _jsonl(tmp_path / "d.jsonl", 20)
    monkeypatch.setattr(training_memory, "STATE_COPIES", 10**6)
    out = tmp_path / "o"
    assert main(["train", "--model", tiny_dir, "--data-file", data, "--memory-budget", "64MiB", "--out", str(out),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "gradients, optimiser moments and update alone" in err and "--freeze-layers" in err and "\n" not in err
    assert not out.exists()


def test_a_bad_memory_budget_is_refused_before_the_model_loads(tmp_path, capsys):
    assert main(["train", "--model", str(tmp_path / "missing"), "--data-file", "f.jsonl", "--memory-budget", "lots",
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "memory budget" in err and "\n" not in err
