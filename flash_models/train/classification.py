"""Classification data: text rows (and pairs) with labels for BERT, image folders with timm transforms for ViT."""

from __future__ import annotations

import torch

from .config import DataSection
from .data import _field, _is_saved_dataset, iter_records

# Packed text rows are rounded up to a multiple of 1/TOKEN_BUCKETS of the padded batch's tokens. With 4, a
# batch of 55% real tokens ran 75% of them (bench bert, seq 512 at 45% padding: 1.86x HF for BERT-base, 1.59x
# for BERT-large); with 16 it runs at most 1/16 of the padded batch more than its real tokens, for up to 16
# captured graphs.
TOKEN_BUCKETS = 16


class TextClassification:
    """Rows of text (and optional text pair) with a label, tokenized up front; string labels are mapped to
    ids in sorted order (``label_names``), integer labels are kept."""

    def __init__(self, spec: str, tokenizer, cfg: DataSection, *, label_names: list[str] | None = None):
        rows = list(iter_records("hf_disk" if _is_saved_dataset(spec) else "jsonl", spec))  # jsonl covers csv/tsv
        raw = [_field(r, cfg.label_field, spec) for r in rows]
        if all(isinstance(v, int) or (isinstance(v, str) and v.lstrip("-").isdigit()) for v in raw):
            self.labels = [int(v) for v in raw]
            self.label_names = label_names
        else:
            self.label_names = label_names or sorted({str(v) for v in raw})
            index = {name: i for i, name in enumerate(self.label_names)}
            unknown = sorted({str(v) for v in raw} - set(index))
            if unknown:
                raise ValueError(f"{spec}: labels {unknown} are not among the training labels {self.label_names}")
            self.labels = [index[str(v)] for v in raw]
        texts = [str(_field(r, cfg.text_field, spec)) for r in rows]
        pairs = [str(_field(r, cfg.text_pair_field, spec)) for r in rows] if cfg.text_pair_field else None
        enc = tokenizer(texts, pairs, truncation=True, max_length=cfg.seq_len)
        self.features = [{k: enc[k][i] for k in enc.keys()} for i in range(len(rows))]
        self.pad_id = tokenizer.pad_token_id or 0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {**self.features[i], "labels": self.labels[i], "pad_id": self.pad_id}


def collate_classification(items: list[dict]) -> dict:
    """Right-pad to the longest row: input_ids, attention_mask, token_type_ids (when given), labels."""
    longest = max(len(it["input_ids"]) for it in items)
    out: dict[str, torch.Tensor] = {}
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        if key not in items[0]:
            continue
        pad = items[0]["pad_id"] if key == "input_ids" else 0
        out[key] = torch.tensor([list(it[key]) + [pad] * (longest - len(it[key])) for it in items], dtype=torch.long)
    out["labels"] = torch.tensor([it["labels"] for it in items], dtype=torch.long)
    return out


def collate_packed_classification(items: list[dict], *, seq_len: int, token_buckets: int = TOKEN_BUCKETS) -> dict:
    """The rows packed into one, in fixed-shape buckets, for training replayed from CUDA graphs.

    A graph replays fixed shapes without reading anything back, so the packing (which a padded batch would
    do on the device, through a host read) happens here, on the host, and the packed row's length is rounded
    up to one of ``token_buckets`` sizes: multiples of rows x seq_len / token_buckets, so at most that fraction
    of the bucket is padding work (each size is one more captured graph: ``runtime.train_graphs.MAX_SIGNATURES``).
    The extra tokens form padding sequences of at most seq_len tokens (id ``pad_id``, positions from 0) that
    attend only to themselves; the sequence count is fixed per row count by trailing empty sequences. The
    rows' sequences come first, so ``labels`` (one per row) scores exactly them
    (``BertForSequenceClassification``).

    Returns input_ids, token_type_ids, position_ids (1, tokens), cu_seqlens (sequences + 1,) int32 and
    labels (rows,); pass ``max_seqlen=seq_len`` to the model with them.
    """
    rows = [list(it["input_ids"]) for it in items]
    longest = max(len(r) for r in rows)
    if longest > seq_len:
        raise ValueError(f"a row of {longest} tokens is longer than seq_len={seq_len}")
    quantum = -(-len(rows) * seq_len // token_buckets)
    total = sum(len(r) for r in rows)
    tokens = max(-(-total // quantum), 1) * quantum
    pad_lengths = [min(seq_len, tokens - total - k) for k in range(0, tokens - total, seq_len)]
    sequences = len(rows) + -(-quantum // seq_len)  # the most padding sequences any bucket needs
    lengths = [len(r) for r in rows] + pad_lengths
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    offsets += [tokens] * (sequences + 1 - len(offsets))
    pad_id = items[0]["pad_id"]
    types = [list(it.get("token_type_ids", [0] * len(r))) for it, r in zip(items, rows)]
    flat = lambda parts: torch.tensor([x for part in parts for x in part], dtype=torch.long)[None]  # noqa: E731
    return {
        "input_ids": flat(rows + [[pad_id] * n for n in pad_lengths]),
        "token_type_ids": flat(types + [[0] * n for n in pad_lengths]),
        "position_ids": flat([range(n) for n in lengths]),
        "cu_seqlens": torch.tensor(offsets, dtype=torch.int32),
        "labels": torch.tensor([it["labels"] for it in items], dtype=torch.long),
    }


class ImageFolderData:
    """An image folder (one subfolder per class) through timm's dataset and transforms."""

    def __init__(self, root: str, *, image_size: int, train: bool, class_to_idx: dict | None = None):
        from timm.data import ImageDataset, create_transform

        if class_to_idx is not None:  # timm leaves out, silently, the images of a class the map lacks
            unknown = sorted(set(ImageDataset(root).reader.class_to_idx) - set(class_to_idx))
            if unknown:
                raise ValueError(f"{root} has classes {unknown} that the training images lack "
                                 f"(training classes: {sorted(class_to_idx)})")
        self.ds = ImageDataset(root, class_map=class_to_idx or "")
        self.ds.transform = create_transform(input_size=image_size, is_training=train)
        self.classes = sorted(self.ds.reader.class_to_idx, key=self.ds.reader.class_to_idx.get)
        self.class_to_idx = dict(self.ds.reader.class_to_idx)

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        image, label = self.ds[i]
        return {"pixel_values": image, "labels": label}


def collate_images(items: list[dict]) -> dict:
    return {"pixel_values": torch.stack([it["pixel_values"] for it in items]),
            "labels": torch.tensor([it["labels"] for it in items], dtype=torch.long)}
