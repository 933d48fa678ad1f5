"""Classification data: text rows (and pairs) with labels for BERT, image folders with timm transforms for ViT."""

from __future__ import annotations

import torch

from .config import DataSection
from .data import _field, iter_records


class TextClassification:
    """Rows of text (and optional text pair) with a label, tokenized up front; string labels are mapped to
    ids in sorted order (``label_names``), integer labels are kept."""

    def __init__(self, spec: str, tokenizer, cfg: DataSection, *, label_names: list[str] | None = None):
        fmt = "hf_disk" if cfg.format == "hf_disk" else "jsonl"
        rows = list(iter_records(fmt, spec))
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


class ImageFolderData:
    """An image folder (one subfolder per class) through timm's dataset and transforms."""

    def __init__(self, root: str, *, image_size: int, train: bool, class_to_idx: dict | None = None):
        from timm.data import ImageDataset, create_transform

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
