"""Language-model training data, all local: text / JSONL files and HF datasets saved on disk, tokenized once
into a cached memmap; packing into fixed windows that keep document boundaries (cu_seqlens); chat/SFT
examples with the loss masked on prompt tokens. (Classification data: ``classification.py``.)

Every dataset is a map-style list of items; ``StepSampler`` decides which items each optimizer step takes,
deterministically from the seed, and its ``state_dict`` is the data position saved in checkpoints.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .config import DataSection

log = logging.getLogger(__name__)

IGNORE = -100


# ------------------------------------------------------------------------------------------------------------
# Tokenizers
class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255 plus EOS = 256: offline runs and tests without a tokenizer file."""

    vocab_size = 257
    eos_token_id = 256
    pad_token_id = 256
    chat_template = None
    name_or_path = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def __call__(self, texts: list[str], pairs: list[str] | None = None, *, truncation: bool = True,
                 max_length: int | None = None) -> dict[str, list[list[int]]]:
        """HF's batch-encoding call, for text classification: each text, then EOS and its pair when given, cut to
        max_length when truncating; token_type_ids mark the pair's tokens, as a BERT tokenizer's do."""
        rows = {"input_ids": [], "attention_mask": [], "token_type_ids": []}
        for text, pair in zip(texts, pairs if pairs is not None else [None] * len(texts)):
            first = self.encode(text)
            second = [self.eos_token_id, *self.encode(pair)] if pair is not None else []
            cut = max_length if truncation and max_length is not None else None
            ids, types = (first + second)[:cut], ([0] * len(first) + [1] * len(second))[:cut]
            rows["input_ids"].append(ids)
            rows["attention_mask"].append([1] * len(ids))
            rows["token_type_ids"].append(types)
        return rows

    def __len__(self) -> int:
        return self.vocab_size


def load_tokenizer(name: str):
    """"bytes", an alias ("smollm2", "minilm"), an HF folder or a .gguf file."""
    if name == "bytes":
        return ByteTokenizer()
    from ..checkpoint.tokenizer import load_tokenizer as load_hf_tokenizer
    from ..embedded import resolve_alias

    return load_hf_tokenizer(resolve_alias(name))


def encode(tokenizer, text: str) -> list[int]:
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.encode(text)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _tokenizer_fingerprint(tokenizer) -> str:
    probe = "Hello world, 1234 tokens: ünïcode!"
    return f"{type(tokenizer).__name__}|{getattr(tokenizer, 'name_or_path', '')}|{len(tokenizer)}|{encode(tokenizer, probe)}"


# ------------------------------------------------------------------------------------------------------------
# Raw records
def resolve_files(spec: str) -> list[Path]:
    """A file, a folder (every file inside, sorted) or a glob."""
    path = Path(spec)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    else:
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
    if not files:
        raise FileNotFoundError(f"no data files match {spec!r}")
    return files


def iter_records(fmt: str, spec: str) -> Iterator[dict]:
    """Rows as dicts. text: documents are separated by blank lines, one ``{"text": ...}`` each; jsonl: one
    object per line; csv/tsv by extension for classification; hf_disk: ``datasets.load_from_disk(path)``
    (``path:split`` picks a split of a DatasetDict)."""
    if fmt == "hf_disk":
        yield from _iter_hf_disk(spec)
        return
    for path in resolve_files(spec):
        if fmt == "text":
            for doc in re.split(r"\n\s*\n", path.read_text(encoding="utf-8-sig")):
                if doc.strip():
                    yield {"text": doc.strip("\n")}
        elif path.suffix in (".csv", ".tsv"):
            with path.open(newline="", encoding="utf-8-sig") as f:
                yield from csv.DictReader(f, delimiter="\t" if path.suffix == ".tsv" else ",")
        else:
            with path.open(encoding="utf-8-sig") as f:
                for line_no, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)
                        except json.JSONDecodeError as err:
                            raise ValueError(f"{path}:{line_no} is not valid JSON: {err}") from None


def _iter_hf_disk(spec: str) -> Iterator[dict]:
    try:
        import datasets
    except ImportError:
        raise ImportError("data.format='hf_disk' needs the datasets package: pip install datasets") from None
    path, _, split = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        split = split or "train"
        if split not in ds:
            raise ValueError(f"{path} has splits {list(ds)}, not {split!r}; write PATH:SPLIT")
        ds = ds[split]
    yield from ds


def _is_saved_dataset(spec: str) -> bool:
    """A folder written by ``datasets.save_to_disk`` (a Dataset or a DatasetDict), optionally with ``:split``."""
    path = Path(spec if Path(spec).exists() else spec.rpartition(":")[0] or spec)
    return path.is_dir() and any((path / name).is_file() for name in ("dataset_dict.json", "dataset_info.json", "state.json"))


def _field(record: dict, name: str, where: str):
    if name not in record:
        raise ValueError(f"{where}: record has no field {name!r} (fields: {sorted(record)}); set the data.*_field key")
    if record[name] is None:  # str(None) would train on the text "None"
        raise ValueError(f"{where}: a record's field {name!r} is null ({repr(record)[:200]}); fill it in or drop the record")
    return record[name]


# ------------------------------------------------------------------------------------------------------------
# Tokenized store: tokens (+ loss mask) in one memmap, documents as offsets
@dataclass
class TokenStore:
    tokens: np.ndarray  # (total,) uint16/uint32 memmap
    doc_offsets: np.ndarray  # (num_docs + 1,) int64
    loss_mask: np.ndarray | None  # (total,) uint8 memmap: 1 where the token is trained on (SFT)
    path: Path

    @property
    def num_docs(self) -> int:
        return len(self.doc_offsets) - 1


def _sft_example(tokenizer, record: dict, cfg: DataSection, eos: int | None) -> tuple[list[int], list[int]]:
    """(tokens, mask): the mask is 1 on assistant tokens only. With a chat template each assistant turn is
    found as the difference between the rendering up to that turn and the rendering with the generation
    prompt before it."""
    if cfg.messages_field in record:
        messages = record[cfg.messages_field]
    else:
        messages = [{"role": "user", "content": _field(record, cfg.prompt_field, "sft")},
                    {"role": "assistant", "content": _field(record, cfg.response_field, "sft")}]
    if getattr(tokenizer, "chat_template", None):
        def render(msgs, gen):
            out = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=True)
            return list(out["input_ids"])

        tokens: list[int] = []
        mask: list[int] = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prefix, full = render(messages[:i], True), render(messages[:i + 1], False)
            if full[:len(tokens)] != tokens or full[:len(prefix)] != prefix:
                raise ValueError("the chat template does not render conversations as prefixes of each other; "
                                 "cannot locate the assistant tokens for loss masking")
            mask += [0] * (len(prefix) - len(tokens)) + [1] * (len(full) - len(prefix))
            tokens = full
        if not tokens:
            raise ValueError("an SFT example needs at least one assistant message")
        return tokens, mask
    prompt = "".join(f"{m['role']}: {m['content']}\n" for m in messages[:-1]) + "assistant: "
    if messages[-1]["role"] != "assistant":
        raise ValueError("without a chat template, an SFT example must end with the assistant's answer")
    p, a = encode(tokenizer, prompt), encode(tokenizer, messages[-1]["content"])
    a = a + ([eos] if eos is not None else [])
    return p + a, [0] * len(p) + [1] * len(a)


def build_token_store(spec: str, tokenizer, cfg: DataSection, *, sft: bool = False) -> TokenStore:
    """Tokenize every document once and cache it under ``cfg.cache_dir``, keyed by the files (size, mtime),
    the tokenizer and the settings; a later run (or another rank) opens the memmap directly."""
    fmt = cfg.format
    if sft:  # SFT rows come from JSONL files or from a saved HF dataset (``path`` or ``path:split``)
        fmt = "hf_disk" if _is_saved_dataset(spec) else "jsonl"
    sources = [spec] if fmt == "hf_disk" else [f"{p.resolve()}|{p.stat().st_size}|{p.stat().st_mtime_ns}" for p in resolve_files(spec)]
    key_text = json.dumps([fmt, sources, _tokenizer_fingerprint(tokenizer), cfg.append_eos, cfg.text_field,
                           cfg.messages_field, cfg.prompt_field, cfg.response_field, sft])
    key = hashlib.sha256(key_text.encode()).hexdigest()[:20]
    root = Path(cfg.cache_dir) / key
    if not (root / "meta.json").is_file():
        _write_store(root, fmt, spec, tokenizer, cfg, sft)
    return open_token_store(root)


def _write_store(root: Path, fmt: str, spec: str, tokenizer, cfg: DataSection, sft: bool) -> None:
    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    eos = tokenizer.eos_token_id
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-tokens-", dir=root.parent))
    try:
        offsets = [0]
        with open(tmp / "tokens.bin", "wb") as ftok, open(tmp / "loss_mask.bin", "wb") as fmask:
            for record in iter_records(fmt, spec):
                if sft:
                    ids, mask = _sft_example(tokenizer, record, cfg, eos)
                else:
                    ids = encode(tokenizer, str(_field(record, cfg.text_field, spec)))
                    if cfg.append_eos and eos is not None:
                        ids = ids + [eos]
                    mask = None
                if not ids:
                    continue
                ftok.write(np.asarray(ids, dtype=dtype).tobytes())
                if mask is not None:
                    fmask.write(np.asarray(mask, dtype=np.uint8).tobytes())
                offsets.append(offsets[-1] + len(ids))
        if len(offsets) == 1:
            raise ValueError(f"{spec} holds no documents")
        if not sft:
            (tmp / "loss_mask.bin").unlink()
        np.save(tmp / "doc_offsets.npy", np.asarray(offsets, dtype=np.int64))
        meta = {"dtype": np.dtype(dtype).name, "num_tokens": offsets[-1], "num_docs": len(offsets) - 1,
                "source": spec, "tokenizer": getattr(tokenizer, "name_or_path", ""), "sft": sft}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.replace(tmp, root)  # atomic: a reader sees the whole store or none
        except OSError:  # another process finished first: keep theirs
            if not (root / "meta.json").is_file():
                raise
        log.info("tokenized %s: %d documents, %d tokens -> %s", spec, meta["num_docs"], meta["num_tokens"], root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def open_token_store(root: Path) -> TokenStore:
    meta = json.loads((root / "meta.json").read_text())
    tokens = np.memmap(root / "tokens.bin", dtype=meta["dtype"], mode="r")
    mask = np.memmap(root / "loss_mask.bin", dtype=np.uint8, mode="r") if meta["sft"] else None
    return TokenStore(tokens=tokens, doc_offsets=np.load(root / "doc_offsets.npy"), loss_mask=mask, path=root)


def synthetic_store(num_tokens: int, vocab_size: int, *, seed: int, doc_len: int) -> TokenStore:
    """Random tokens in documents of random length around ``doc_len`` (benchmarks, smoke tests)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab_size, num_tokens, dtype=np.int64).astype(np.uint32)
    lengths = rng.integers(max(1, doc_len // 4), 2 * doc_len, num_tokens // max(1, doc_len // 4) + 1)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    offsets = np.concatenate([offsets[offsets < num_tokens], [num_tokens]]).astype(np.int64)
    return TokenStore(tokens=tokens, doc_offsets=offsets, loss_mask=None, path=Path("<synthetic>"))


# ------------------------------------------------------------------------------------------------------------
# LM datasets: items of exactly seq_len tokens
class LMWindows:
    """Consecutive windows of ``seq_len`` tokens over the document stream (pretraining).

    An item is ``{input_ids, labels, seqlens}``; with packing="documents" ``seqlens`` lists the pieces of
    documents inside the window (the model gets cu_seqlens, so no token attends across a boundary and
    positions restart) and each piece's first label is ignored so no document predicts the next one's start.
    With "stream" the window is one sequence (nanoGPT style) and ``seqlens`` is None."""

    def __init__(self, store: TokenStore, seq_len: int, *, packing: str = "documents"):
        self.store, self.seq_len, self.packing = store, seq_len, packing
        self.n = len(store.tokens) // seq_len
        if self.n == 0:
            raise ValueError(f"the data has {len(store.tokens)} tokens, fewer than one window of seq_len={seq_len}")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        start, end = i * self.seq_len, (i + 1) * self.seq_len
        ids = torch.from_numpy(self.store.tokens[start:end].astype(np.int64))
        labels = ids.clone()
        if self.store.loss_mask is not None:
            labels[torch.from_numpy(self.store.loss_mask[start:end].astype(bool)).logical_not()] = IGNORE
        if self.packing == "stream":
            return {"input_ids": ids, "labels": labels, "seqlens": None}
        offs = self.store.doc_offsets
        inner = offs[(offs > start) & (offs < end)] - start  # document starts inside the window
        cuts = np.concatenate([[0], inner, [self.seq_len]])
        labels[torch.from_numpy(cuts[:-1])] = IGNORE
        return {"input_ids": ids, "labels": labels, "seqlens": np.diff(cuts).tolist()}


class PackedExamples:
    """Whole examples (SFT conversations) packed greedily, in order, into windows of ``seq_len``; an example
    longer than the window is truncated; the tail of a window is padding with ignored labels. Each example is
    its own document (cu_seqlens) and the labels keep the store's loss mask (prompt tokens ignored)."""

    def __init__(self, store: TokenStore, seq_len: int, *, pad_id: int):
        self.store, self.seq_len, self.pad_id = store, seq_len, pad_id
        lengths = np.minimum(np.diff(store.doc_offsets), seq_len)
        if (np.diff(store.doc_offsets) > seq_len).any():
            log.warning("%d examples are longer than seq_len=%d and are truncated", int((np.diff(store.doc_offsets) > seq_len).sum()), seq_len)
        # An example's first token predicts nothing (its label is ignored), so it trains on the answer tokens
        # after it that fit in the window: none, when a long prompt fills the window.
        untrained = sum(not store.loss_mask[start + 1:start + n].any() for start, n in zip(store.doc_offsets[:-1], lengths))
        if untrained == len(lengths):
            raise ValueError(f"no example has an answer token within data.seq_len={seq_len} (each one's prompt fills "
                             "the window): nothing would be trained; raise data.seq_len")
        if untrained:
            log.warning("%d of %d examples have no answer token within data.seq_len=%d and train nothing",
                        untrained, len(lengths), seq_len)
        self.windows: list[tuple[int, int]] = []  # (first doc, end doc)
        first, used = 0, 0
        for d, n in enumerate(lengths):
            if used + n > seq_len:
                self.windows.append((first, d))
                first, used = d, 0
            used += int(n)
        self.windows.append((first, len(lengths)))

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        first, end = self.windows[i]
        ids = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        labels = torch.full((self.seq_len,), IGNORE, dtype=torch.long)
        pos, seqlens = 0, []
        for d in range(first, end):
            a = int(self.store.doc_offsets[d])
            n = min(int(self.store.doc_offsets[d + 1]) - a, self.seq_len)
            tok = torch.from_numpy(self.store.tokens[a:a + n].astype(np.int64))
            ids[pos:pos + n] = tok
            keep = torch.from_numpy(self.store.loss_mask[a:a + n].astype(bool))
            labels[pos:pos + n] = torch.where(keep, tok, torch.full_like(tok, IGNORE))
            labels[pos] = IGNORE
            seqlens.append(n)
            pos += n
        if pos < self.seq_len:
            seqlens.append(self.seq_len - pos)
        return {"input_ids": ids, "labels": labels, "seqlens": seqlens}


def collate_lm(items: list[dict]) -> dict:
    """Stack items into (B, S); with document seqlens, one packed row (1, B*S) with int32 cu_seqlens."""
    ids = torch.stack([it["input_ids"] for it in items])
    labels = torch.stack([it["labels"] for it in items])
    if items[0]["seqlens"] is None:
        return {"input_ids": ids, "labels": labels}
    lengths = torch.tensor([n for it in items for n in it["seqlens"]], dtype=torch.int32)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    return {"input_ids": ids.reshape(1, -1), "labels": labels.reshape(1, -1), "cu_seqlens": cu}


# ------------------------------------------------------------------------------------------------------------
class StepSampler:
    """Which items each optimizer step reads: epoch e visits the items in a permutation seeded by
    (seed, e); a step takes the next ``global_batch`` of them across epochs, and data-parallel rank r
    keeps every ``world``-th. ``state_dict`` (epoch, cursor) is the data position in checkpoints."""

    def __init__(self, n_items: int, *, global_batch: int, seed: int, shuffle: bool = True, rank: int = 0, world: int = 1):
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} is not divisible by the {world} data-parallel ranks")
        self.n, self.global_batch, self.seed, self.shuffle = n_items, global_batch, seed, shuffle
        self.rank, self.world = rank, world
        self.epoch, self.cursor = 0, 0
        self._order: np.ndarray | None = None

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            self._order = (np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
                           if self.shuffle else np.arange(self.n))
        return self._order

    def next_step(self) -> list[int]:
        picked: list[int] = []
        while len(picked) < self.global_batch:
            order = self._epoch_order()
            take = min(self.global_batch - len(picked), self.n - self.cursor)
            picked += order[self.cursor:self.cursor + take].tolist()
            self.cursor += take
            if self.cursor == self.n:
                self.epoch, self.cursor, self._order = self.epoch + 1, 0, None
        return picked[self.rank::self.world]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor, self._order = int(state["epoch"]), int(state["cursor"]), None


def micro_batches(dataset, indices: list[int], micro_batch_size: int, collate) -> list[dict]:
    return [collate([dataset[i] for i in indices[k:k + micro_batch_size]]) for k in range(0, len(indices), micro_batch_size)]
