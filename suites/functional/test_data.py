"""Data: the byte tokenizer, the indexed dataset built from the shipped text, and megatron-core's
dataset builder over it and over its mock dataset (in-process, no torchrun)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from harness.training.data import (
    DATA_DIR,
    ByteTokenizer,
    build_indexed_dataset,
    build_train_dataset,
    ensure_indexed_dataset,
    microbatches,
    text_documents,
)
from harness.training.model_args import parse_model_args

TEXT = DATA_DIR / "declaration.txt"
ARGS = {
    "--num-layers": 1,
    "--hidden-size": 8,
    "--num-attention-heads": 1,
    "--seq-length": 32,
    "--micro-batch-size": 2,
    "--global-batch-size": 8,
    "--train-iters": 3,
    "--lr": 0.1,
}


def _digest(prefix) -> tuple[str, str]:
    return tuple(hashlib.sha256(open(f"{prefix}{s}", "rb").read()).hexdigest() for s in (".bin", ".idx"))


def test_shipped_text_is_small_plain_and_has_no_eod_byte():
    """The shipped text is a few KB of UTF-8 paragraphs without the EOD byte (NUL)."""
    text = TEXT.read_text(encoding="utf-8")
    assert 2_000 < len(text.encode()) < 16_000
    assert len(text_documents(text)) > 10
    assert ByteTokenizer().tokenize(text)[:2] == [ord("I"), ord("n")]


def test_byte_tokenizer_round_trips_and_rejects_nul():
    """Tokens are the UTF-8 bytes (vocab 256, EOD 0); NUL in the text is an error."""
    tok = ByteTokenizer()
    assert tok.detokenize(tok.tokenize("Liberty é")) == "Liberty é"
    assert max(tok.tokenize("é")) < tok.vocab_size == 256 and tok.eod == 0
    with pytest.raises(ValueError, match="NUL byte at offset 1"):
        tok.tokenize("a\x00b")


def test_indexed_dataset_holds_the_documents_plus_eod(tmp_path):
    """megatron-core's IndexedDataset reads back every paragraph's bytes followed by EOD."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = build_indexed_dataset(TEXT, tmp_path / "declaration_text_document")
    ds = IndexedDataset(str(prefix))
    docs = text_documents(TEXT.read_text(encoding="utf-8"))
    assert len(ds) == len(docs)
    for i in (0, len(docs) - 1):
        assert ds[i].tolist() == list(docs[i].encode()) + [0]


def test_indexed_dataset_build_is_deterministic(tmp_path):
    """Two builds give byte-identical .bin and .idx files."""
    a = build_indexed_dataset(TEXT, tmp_path / "a" / "declaration_text_document")
    b = build_indexed_dataset(TEXT, tmp_path / "b" / "declaration_text_document")
    assert _digest(a) == _digest(b)


def test_unknown_data_path_names_the_shipped_texts(tmp_path):
    """A --data-path without a shipped text says which texts exist."""
    with pytest.raises(ValueError, match=r"no shipped text nope\.txt .* \(shipped: declaration\)"):
        ensure_indexed_dataset(tmp_path / "nope_text_document")


@pytest.mark.parametrize("source", ["indexed", "mock"])
def test_dataset_builder_yields_megatron_gpt_batches(tmp_path, source):
    """BlendedMegatronDatasetBuilder gives [b, s] tokens / labels (shifted by one) and a causal mask."""
    if source == "indexed":
        prefix = ensure_indexed_dataset(tmp_path / "declaration_text_document")
        args = parse_model_args({**ARGS, "--data-path": str(prefix), "--split": "100,0,0"}, source="test")
    else:
        args = parse_model_args({**ARGS, "--mock-data": True}, source="test")
    ds = build_train_dataset(args, num_samples=24, cache_dir=tmp_path / "cache")
    batches = list(microbatches(ds, step=2, args=args, dp_rank=1, dp_size=2, num_microbatches=2))
    assert len(batches) == 2
    b = batches[0]
    assert b["tokens"].shape == b["labels"].shape == (2, 32)
    assert b["attention_mask"].shape == (2, 1, 32, 32) and b["attention_mask"].dtype == torch.bool
    assert torch.equal(b["tokens"][:, 1:], b["labels"][:, :-1])
    assert int(b["tokens"].max()) < 256
    # MegatronPretrainingSampler order: step 2, microbatch 0 of DP rank 1 starts at sample 8 + 2.
    assert torch.equal(b["tokens"][0], ds[10]["tokens"])
