"""Training data through megatron-core's own dataset pipeline.

* `ByteTokenizer` -- a trivial, deterministic byte-level tokenizer: token = UTF-8 byte (vocab 256);
  the end-of-document token is 0 (NUL never occurs in the shipped text).
* `NullTokenizer` -- a vocabulary size only (for mock data), EOD = vocab_size - 1.
* `build_indexed_dataset` -- tokenizes a shipped text (`data/<name>.txt`, one document per
  paragraph) with `ByteTokenizer` into `<prefix>.bin` / `.idx` with megatron-core's
  `IndexedDatasetBuilder` (the format `tools/preprocess_data.py` writes).
* `build_train_dataset` -- `BlendedMegatronDatasetBuilder` + `GPTDatasetConfig` over
  `MockGPTDataset` (`--mock-data`) or `GPTDataset` (`--data-path <prefix>`).
* `microbatches` -- the samples of one step for one data-parallel rank, in the order of
  Megatron-LM's `MegatronPretrainingSampler`.

megatron-core 0.16.1 ships `datasets/helpers_cpp` compiled in its wheel (listed in the wheel's
RECORD), so nothing is built at run time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.training.model_args import TrainArgs

__all__ = [
    "DATA_DIR",
    "ByteTokenizer",
    "NullTokenizer",
    "build_indexed_dataset",
    "build_train_dataset",
    "ensure_indexed_dataset",
    "make_tokenizer",
    "microbatches",
    "text_documents",
]

DATA_DIR = Path(__file__).resolve().with_name("corpus")
"""The corpus the functional recipes train on (package data of the harness, beside `recipes/`)."""
TEXT_SUFFIX = "_text_document"
"""`tools/preprocess_data.py` names its output `<prefix>_text_document.{bin,idx}`; so do we."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, EOD = 0; no pad token (megatron masks its own -1)."""

    vocab_size = 256
    eod = 0
    unique_identifiers = {"class": "ByteTokenizer", "vocab_size": 256, "eod": 0}
    """What megatron hashes into the names of its dataset index caches."""

    def tokenize(self, text: str) -> list[int]:
        """`text` -> its UTF-8 bytes; `ValueError` if it holds the EOD byte (NUL)."""
        data = text.encode("utf-8")
        if b"\x00" in data:
            raise ValueError(f"text holds a NUL byte at offset {data.index(0)}; NUL is the EOD token")
        return list(data)

    def detokenize(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class NullTokenizer:
    """A vocabulary size only, for mock data: EOD = vocab_size - 1."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.unique_identifiers = {"class": "NullTokenizer", "vocab_size": vocab_size}


def make_tokenizer(args: TrainArgs) -> ByteTokenizer | NullTokenizer:
    if args.tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    return NullTokenizer(args.vocab_size)


def text_documents(text: str) -> list[str]:
    """Documents of a text: its paragraphs (blank-line separated), stripped, empty ones dropped."""
    return [p.strip() for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]


def build_indexed_dataset(text_path: Path, prefix: Path) -> Path:
    """Tokenize `text_path` with `ByteTokenizer` into `<prefix>.bin` / `.idx` (uint16 tokens,
    EOD appended to every document); deterministic, written atomically. Returns `prefix`."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    docs = text_documents(Path(text_path).read_text(encoding="utf-8"))
    if not docs:
        raise ValueError(f"{text_path}: no documents (paragraphs) in the text")
    tok = ByteTokenizer()
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = prefix.with_name(f".{prefix.name}.{os.getpid()}.tmp")
    builder = IndexedDatasetBuilder(get_bin_path(str(tmp)), dtype=np.uint16)
    for doc in docs:
        ids = tok.tokenize(doc) + [tok.eod]
        builder.add_document(np.asarray(ids, dtype=np.int64), [len(ids)])
    builder.finalize(get_idx_path(str(tmp)))
    os.replace(get_bin_path(str(tmp)), get_bin_path(str(prefix)))
    os.replace(get_idx_path(str(tmp)), get_idx_path(str(prefix)))
    return prefix


def ensure_indexed_dataset(prefix: str | Path) -> Path:
    """Build `<dir>/<name>_text_document.{bin,idx}` from `DATA_DIR/<name>.txt` unless present."""
    prefix = Path(prefix)
    if not prefix.name.endswith(TEXT_SUFFIX):
        raise ValueError(
            f"--data-path {prefix}: expected <dir>/<name>{TEXT_SUFFIX} with <name>.txt in {DATA_DIR}"
        )
    text = DATA_DIR / (prefix.name[: -len(TEXT_SUFFIX)] + ".txt")
    if not text.is_file():
        known = ", ".join(p.stem for p in sorted(DATA_DIR.glob("*.txt")))
        raise ValueError(
            f"--data-path {prefix}: no shipped text {text.name} in {DATA_DIR} (shipped: {known})"
        )
    if not (Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file()):
        build_indexed_dataset(text, prefix)
    return prefix


def build_train_dataset(args: TrainArgs, *, num_samples: int, cache_dir: Path) -> Any:
    """The training split as megatron-core builds it (`MockGPTDataset` or `GPTDataset`).

    Built on every rank (each rank reads the same samples; megatron's trainer broadcasts them
    over TP instead). Index caches of a real dataset go to `cache_dir`, never next to the data.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    blend = None if args.mock_data else ([args.data_path], None)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        split=None if args.mock_data else args.split,
        path_to_cache=str(cache_dir),
        tokenizer=make_tokenizer(args),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=True,
        mid_level_dataset_surplus=0.005,
    )
    cls = MockGPTDataset if args.mock_data else GPTDataset
    train, _valid, _test = BlendedMegatronDatasetBuilder(
        cls, [num_samples, None, None], lambda: True, config
    ).build()
    if train is None or len(train) < num_samples:
        raise ValueError(
            f"dataset {args.data_path or 'mock'}: {0 if train is None else len(train)} training "
            f"samples, {num_samples} needed"
        )
    return train


def microbatches(
    dataset: Any, *, step: int, args: TrainArgs, dp_rank: int, dp_size: int, num_microbatches: int
) -> Iterator[dict[str, torch.Tensor]]:
    """The microbatches of `step` (1-based) for data-parallel rank `dp_rank`.

    Sample order of `MegatronPretrainingSampler`: step s consumes samples
    `[(s-1)*gbs, s*gbs)`; microbatch k of rank r holds `base + k*mbs*dp + r*mbs + [0, mbs)`.
    Each batch: `tokens`, `labels`, `loss_mask`, `position_ids` `[b, s]`, `attention_mask` `[b, 1, s, s]`.
    """
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    base = (step - 1) * gbs
    for k in range(num_microbatches):
        first = base + k * mbs * dp_size + dp_rank * mbs
        samples = [dataset[i] for i in range(first, first + mbs)]
        yield {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
