"""The training loop: ``Trainer(config).fit()`` or ``train(config)``.

One optimizer step = one global batch, split into micro-batches per data-parallel rank. The loss of each
micro-batch is weighted by its share of the global batch's loss tokens (or rows), so accumulation and data
parallelism give the same gradient as one big batch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ..backward import backward_on_this_thread
from ..checkpoint.atomic import atomic_folder
from ..checkpoint.files import owned_by_model_save
from ..modules.recompute import checkpoint_blocks
from . import distributed as D
from .build import DataBundle, build_data, build_model
from .checkpoint import (check_no_checkpoints, find_checkpoint, load_checkpoint, raise_unless_every_rank_succeeded,
                         save_checkpoint)
from .config import ExperimentConfig, load_config
from .data import IGNORE, StepSampler
from ..runtime.train_graphs import GraphedLoss, check_graphable
from .metrics import EMA, MetricsLog, clip_coefficient, clip_grad_norm, flops_per_token, grad_norm, measure_matmul_peak
from .optim import MasterWeights, build_optimizer, build_scheduler, param_groups
from .preflight import check_paths
from .prefetch import StepPrefetcher

log = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """A training step's loss or gradient norm was NaN or inf (``train.stop_on_nonfinite``)."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def block_list(model: nn.Module) -> nn.ModuleList | None:
    """The model's transformer blocks: ours keep them in ``.blocks`` (BERT's task heads in ``.bert.blocks``); HF
    decoders in ``.model.layers`` or ``.transformer.h``."""
    for path in ("blocks", "bert.blocks", "model.layers", "transformer.h", "encoder.layers", "bert.encoder.layer",
                 "vit.encoder.layer"):
        try:
            found = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(found, nn.ModuleList):
            return found
    return None


def blocks_for(model: nn.Module, setting: str) -> nn.ModuleList:
    """``block_list``, or an error naming the setting that needs the blocks."""
    blocks = block_list(model)
    if blocks is None:
        raise ValueError(f"{setting}: cannot find the transformer blocks of {type(model).__name__}")
    return blocks


def apply_activation_checkpointing(model: nn.Module, every: int) -> None:
    """Recompute every ``every``-th block's activations in backward (modules.recompute.checkpoint_blocks)."""
    checkpoint_blocks(blocks_for(model, "train.activation_checkpointing"), every=every)


@dataclass
class _QueuedStep:
    """An optimizer step whose work is queued on the device; ``Trainer._finish`` reads its metrics."""

    record: dict  # what the host knows already: step, lr, tokens, rows
    metrics: torch.Tensor  # (loss sum, grad norm): on the host once ``copied`` has completed
    copied: torch.cuda.Event | None  # None: metrics were computed on the CPU, readable now
    total: float  # what the loss averages over (tokens or rows), summed over micro-batches and ranks


class Trainer:
    def __init__(self, config: ExperimentConfig, *, model: nn.Module | None = None, data: DataBundle | None = None):
        self.cfg = cfg = config
        t = cfg.train
        if data is None:
            check_paths(cfg)  # before anything loads: the key whose data or tokenizer path is missing
        resume_from = find_checkpoint(t.resume, Path(t.output_dir)) if t.resume is not None else None
        if resume_from is None:
            check_no_checkpoints(Path(t.output_dir))  # a new run would interleave its checkpoints with them
        self.dist = D.setup(cfg.distributed.strategy, t.device)
        self.device = self.dist.device
        per_rank = t.global_batch_size // self.dist.dp_world
        if t.global_batch_size % self.dist.dp_world or per_rank % t.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size={t.global_batch_size} must split into {self.dist.dp_world} data-parallel "
                f"ranks x micro_batch_size={t.micro_batch_size} x accumulation steps; set train.global_batch_size to "
                f"a multiple of {self.dist.dp_world * t.micro_batch_size} (or change train.micro_batch_size)"
            )
        self.accum_steps = per_rank // t.micro_batch_size
        if t.cuda_graphs:  # refused before any data or model is built
            check_graphable(device=self.device, task=cfg.model.task, packing=cfg.data.packing, compile=t.compile,
                            activation_checkpointing=t.activation_checkpointing, strategy=self.dist.strategy)
        if t.deterministic:  # on CUDA this also needs CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment
            torch.use_deterministic_algorithms(True)
        seed_everything(t.seed)  # same on every rank: identical initial weights
        self.output_dir = Path(t.output_dir)
        raw = model if model is not None else build_model(cfg)
        if self.dist.strategy == "tp":  # before the data is read: every rank refuses alike
            D.check_tp(raw, self.dist.world)
        if self.dist.dp_world > 1:
            # The shared seed gave every rank the same initial weights. From here on each data-parallel rank
            # draws its own dropout masks, augmentations and mixup: with the shared seed, rank r's k-th row
            # would take rank 0's k-th row's draws. (Tensor-parallel ranks read one batch: one stream.)
            seed_everything((t.seed + self.dist.dp_rank) % 2**32)
        if t.export and hasattr(raw.config, "to_hf"):  # known now, not after the last step
            try:
                raw.config.to_hf()
            except ValueError as err:
                raise ValueError(f"train.export=true saves the final model in HF layout, and {err}; set "
                                 "train.export=false (train.save_every checkpoints keep the weights)") from None
        self.task = cfg.model.task
        # Our decoder LMs can skip the logits (fused LM head + loss); HF models and classifiers cannot.
        self.ours_lm = self.task == "causal_lm" and hasattr(raw, "fused_loss")
        self.fused_loss = t.fused_loss and self.ours_lm
        limit = _position_limit(raw)
        if limit is not None and self.task != "image_classification" and cfg.data.seq_len > limit:
            # a row (or a document) that long would stop the run at the batch that holds it
            raise ValueError(f"data.seq_len={cfg.data.seq_len} is longer than the {limit} positions of the model's "
                             f"position table; set data.seq_len={limit} (or less)")
        if self.task == "causal_lm" and not self.ours_lm and (cfg.data.packing == "documents" or cfg.data.format == "sft"):
            # An HF model takes the packed row's cu_seqlens as an unused keyword: its documents would attend
            # to each other, with positions running on across them.
            raise ValueError(f"{type(raw).__name__} takes no document boundaries (cu_seqlens), which "
                             f"data.packing='documents' and data.format='sft' pack rows with; use data.packing=stream "
                             "(format text/jsonl/hf_disk), or one of our models (flash_models.from_pretrained)")
        # What the throughput and MFU count as tokens: text tokens, or a ViT's patches and prefix tokens per image.
        self.tokens_per_image = _tokens_per_image(raw) if self.task == "image_classification" else None
        vocab = _vocab_size(raw)
        if data is None:
            if self.dist.is_main:  # one rank tokenizes into the cache, the others open it
                data = build_data(cfg, vocab_size=vocab)
            D.barrier(self.dist)
            if data is None:
                data = build_data(cfg, vocab_size=vocab)
        self.data = data
        if len(data.train) < t.global_batch_size:
            log.warning("the training data holds %d items (windows of data.seq_len tokens, or rows), fewer than "
                        "train.global_batch_size=%d: every step takes some of them more than once",
                        len(data.train), t.global_batch_size)
        self.sampler = StepSampler(len(data.train), global_batch=t.global_batch_size, seed=t.seed,
                                   shuffle=cfg.data.shuffle, rank=self.dist.dp_rank, world=self.dist.dp_world)
        self.batches = StepPrefetcher(self.sampler, data.train, t.micro_batch_size, data.collate, self.device,
                                      units=lambda batch: self.loss_units(batch, self.task))
        self.raw_model = raw.to(self.device)
        self.model, self.master = self._wrap(raw)
        groups = self.master.groups if self.master is not None else param_groups(self.model, cfg.optim.weight_decay)
        self.optimizer = build_optimizer(self.model, cfg.optim, params=groups)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, t.max_steps)
        self.ema = EMA(self.model, t.ema_decay) if t.ema_decay is not None else None
        self.mixup = self._mixup()
        self.graphs = None
        if t.cuda_graphs:
            self.graphs = GraphedLoss(self.model, lambda model, batch: self.loss_of(model, batch, train=True)[0],
                                      autocast_dtype=torch.bfloat16 if t.precision == "bf16_autocast" else None)
        self.step = 0
        self.first_nonfinite_step: int | None = None  # from then on the weights are not trusted: never saved
        self.tokens_seen = 0  # over all ranks, since the start of the run (kept across resumes)
        self.history: list[dict] = []
        if resume_from is not None:
            self.step, extra = load_checkpoint(resume_from, model=self.model, optimizer=self.optimizer,
                                               scheduler=self.scheduler, sampler=self.sampler, dist_state=self.dist,
                                               ema=self.ema, master=self.master, config=cfg.to_dict())
            self.tokens_seen = int(extra.get("tokens_seen", 0))
            log.info("resumed from %s at step %d", resume_from, self.step)
        self.metrics = MetricsLog(self.output_dir, enabled=self.dist.is_main, tensorboard=t.tensorboard,
                                  fresh=self.step == 0)
        self.model.train()

    # --------------------------------------------------------------------------------------------------------
    def _wrap(self, model: nn.Module) -> tuple[nn.Module, MasterWeights | None]:
        """Precision, tensor parallel, activation checkpointing, compile, then DDP/FSDP (torchtitan's order)."""
        cfg, dist_state = self.cfg, self.dist
        pure_bf16 = cfg.train.precision == "bf16"
        if pure_bf16 and dist_state.strategy != "fsdp":
            model.to(torch.bfloat16)
        if dist_state.strategy == "tp":
            D.apply_tp(model, dist_state)
        if cfg.train.activation_checkpointing:
            apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
        if cfg.train.compile:
            backend = cfg.train.compile_backend
            if dist_state.strategy in ("fsdp", "tp"):
                for block in blocks_for(model, "train.compile"):
                    block.compile(backend=backend)
            else:
                model.compile(backend=backend)
        master = None
        if dist_state.strategy == "ddp":
            model = D.apply_ddp(model, dist_state, bf16_compress=cfg.distributed.ddp_bf16_compress)
        elif dist_state.strategy == "fsdp":
            model = D.apply_fsdp(model, list(blocks_for(model, "distributed.strategy='fsdp'")), dist_state, bf16=pure_bf16,
                                 reshard_after_forward=cfg.distributed.fsdp_reshard_after_forward)
        if pure_bf16 and dist_state.strategy != "fsdp":  # FSDP's sharded fp32 parameters are the masters
            master = MasterWeights(model, param_groups(model, cfg.optim.weight_decay))
        return model, master

    def _mixup(self):
        d = self.cfg.data
        if self.task != "image_classification" or not (d.mixup_alpha or d.cutmix_alpha):
            return None
        from timm.data import Mixup

        return Mixup(mixup_alpha=d.mixup_alpha, cutmix_alpha=d.cutmix_alpha, label_smoothing=d.label_smoothing,
                     num_classes=self.cfg.model.num_labels)

    def _autocast(self):
        if self.cfg.train.precision == "bf16_autocast":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # --------------------------------------------------------------------------------------------------------
    def _backward_thread(self):
        """Where the backward runs. One process: on this thread (``flash_models.backward_on_this_thread``; GPT-2
        124M's step 52-60 -> 34-37 ms on an H200). Under torchrun, on autograd's worker thread as usual: on two
        H200s DDP fell from 656k to 408k tokens/s on this thread (FSDP2 223k vs 214k, TP 318k vs 328k), so
        distributed runs keep the default until that is understood."""
        return backward_on_this_thread() if self.dist.world == 1 else contextlib.nullcontext()

    @staticmethod
    def loss_units(batch: dict, task: str) -> int:
        """What the loss averages over: predicted tokens (labels shifted by one, -100 ignored) or rows."""
        if task == "causal_lm":
            return int((batch["labels"][..., 1:] != IGNORE).sum())
        return int(batch["labels"].shape[0])

    def forward(self, batch: dict, *, train: bool) -> tuple[torch.Tensor, dict]:
        """Mean loss of one micro-batch and side metrics (correct predictions when classifying eval data)."""
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        if train and self.mixup is not None:  # mixup/cutmix: soft (B, classes) targets replace the labels
            batch["pixel_values"], batch["labels"] = self.mixup(batch["pixel_values"], batch["labels"])
        if train and self.graphs is not None:
            return self.graphs(batch), {}
        with self._autocast():
            loss, logits = self.loss_of(self.model, batch, train=train)
        if train or logits is None:  # counting correct rows reads the device: only for evaluation
            return loss, {}
        return loss, {"correct": int((logits.argmax(-1) == batch["labels"]).sum())}

    def loss_of(self, model: nn.Module, batch: dict, *, train: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mean loss, logits or None) of ``model`` on a batch already on the device. No host reads, so that
        CUDA graphs can capture it."""
        if self.task == "causal_lm":
            kwargs = {"cu_seqlens": batch["cu_seqlens"]} if "cu_seqlens" in batch else {}
            if self.ours_lm:  # explicit: the model's default would fuse in training whatever the config says
                kwargs["return_logits"] = not self.fused_loss
            return model(batch["input_ids"], labels=batch["labels"], **kwargs).loss.float(), None
        targets = batch["labels"]
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        if "cu_seqlens" in inputs:  # packed text rows (train.cuda_graphs): one logit row per sequence
            logits = model(**inputs, max_seqlen=self.cfg.data.seq_len).logits.float()
            logits = logits[: targets.shape[0]]  # the rows come first, the bucket's padding sequences after them
        else:
            logits = model(**inputs).logits.float()
        if targets.dim() == 2:  # mixup/cutmix soft targets
            loss = torch.sum(-targets * torch.log_softmax(logits, dim=-1), dim=-1).mean()
        else:
            loss = nn.functional.cross_entropy(logits, targets, label_smoothing=self.cfg.data.label_smoothing if train else 0.0)
        return loss, logits

    def train_step(self) -> dict:
        """One optimizer step; returns its metrics, which waits for the GPU to finish the step's backward."""
        return self._finish(self._queue_step())

    def _queue_step(self) -> _QueuedStep:
        """Queue one optimizer step's work on the device; nothing here waits for the GPU (except an
        all-reduce of the loss units across data-parallel ranks)."""
        step = self.batches.next_step()
        indices, batches, units = step.indices, step.batches, step.units
        total = float(sum(units))  # counted on the host: no device sync unless ranks must agree
        if self.dist.dp_world > 1:
            total = D.all_reduce_sum(torch.tensor(total, device=self.device), self.dist).item()
        if self.graphs is not None:
            self.graphs.prepare_grads(len(batches))  # the graphs' gradient buffers are reused (graphs.py)
        else:
            for p in self.model.parameters():
                p.grad = None
        loss_sum = torch.zeros((), device=self.device)
        for i, (batch, n) in enumerate(zip(batches, units)):
            last = i == len(batches) - 1
            sync = contextlib.nullcontext() if last or self.dist.strategy != "ddp" else self.model.no_sync()
            if self.dist.strategy == "fsdp":
                self.model.set_requires_gradient_sync(last)
            with sync:
                loss, _ = self.forward(batch, train=True)
                with self._backward_thread():
                    (loss * (n * self.dist.dp_world / max(total, 1.0))).backward()
            # A micro-batch with no labelled token has a NaN mean loss (as torch's and HF's) and zero gradients:
            # it has no weight in the step's average, so it is left out of the sum rather than poison it.
            if n:
                loss_sum += loss.detach() * n
        loss_sum = D.all_reduce_sum(loss_sum, self.dist)  # read after the optimizer step is queued
        if self.master is not None:
            self.master.grads_to_master()
            params = self.master.masters()
        else:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
        max_norm = self.cfg.optim.grad_clip
        if self._clips_in_optimizer():
            norm = grad_norm(params)
            # The fused kernel divides each gradient by grad_scale (the hook torch.amp.GradScaler uses): the
            # clipped update without a pass of its own over every gradient (0.27 ms of GPT-2 124M's step on an
            # H200). The .grad tensors themselves stay unclipped.
            self.optimizer.grad_scale = 1.0 / clip_coefficient(norm, max_norm)
        else:
            norm = clip_grad_norm(params, max_norm)
        metrics = self._copy_to_host(loss_sum, norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.grad_scale = None
        self.scheduler.step()
        if self.master is not None:
            self.master.master_to_model()
        if self.ema is not None:
            self.ema.update(self.model)
        self.step += 1
        tokens = sum(self._tokens_of(b) for b in batches) * self.dist.dp_world
        self.tokens_seen += tokens
        self.batches.prefetch()  # while the GPU still runs this step
        record = {"step": self.step, "lr": lr, "tokens": tokens, "tokens_seen": self.tokens_seen,
                  "rows": len(indices) * self.dist.dp_world}
        return _QueuedStep(record, *metrics, total)

    def _tokens_of(self, batch: dict) -> int:
        if "input_ids" in batch:
            return int(batch["input_ids"].numel())
        if self.tokens_per_image is not None:
            return int(batch["pixel_values"].shape[0]) * self.tokens_per_image
        return 0

    def _clips_in_optimizer(self) -> bool:
        """Whether clipping can ride on the optimizer: fused AdamW over plain (not DTensor) parameters, no
        float32 master copies, and a clip norm set."""
        max_norm = self.cfg.optim.grad_clip
        return (max_norm is not None and max_norm > 0 and self.master is None
                and self.dist.strategy not in ("fsdp", "tp")
                and all(group.get("fused") for group in self.optimizer.param_groups))

    def _copy_to_host(self, loss_sum: torch.Tensor, norm: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying (loss sum, grad norm) to the host now, in stream order right behind this step's work.

        A plain ``.tolist()`` later would queue its copy behind everything queued by then, the next step
        included, and so wait for that step too: the pipeline of ``iter_steps`` would drain at every read.
        """
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a collective: every rank, now
        values = torch.stack([loss_sum.float(), norm.float().to(loss_sum.device)])
        if values.device.type != "cuda":
            return values, None
        host = torch.empty(2, dtype=torch.float32, pin_memory=True)
        host.copy_(values, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def _finish(self, queued: _QueuedStep) -> dict:
        """The step's record with its loss and gradient norm (waits for the step's copy of them, no longer)."""
        if queued.copied is not None:
            queued.copied.synchronize()
        loss_sum, norm = queued.metrics.tolist()
        record = {**queued.record, "loss": loss_sum / max(queued.total, 1.0), "grad_norm": norm}
        self._check_finite(record)
        return record

    def _check_finite(self, record: dict) -> None:
        """A non-finite loss or gradient norm: the step's update has (or soon will have) poisoned the weights.
        Stop the run (``train.stop_on_nonfinite``), or remember the step so nothing is saved from it on."""
        names = {"loss": "loss", "grad_norm": "gradient norm"}
        bad = [f"{label} is {record[key]}" for key, label in names.items() if not math.isfinite(record[key])]
        if not bad:
            return
        message = (f"step {record['step']}: the training {' and the '.join(bad)}; check optim.lr, the data and "
                   "train.precision, or resume from the last checkpoint")
        if self.cfg.train.stop_on_nonfinite:
            raise NonFiniteLossError(message)
        if self.first_nonfinite_step is None:
            self.first_nonfinite_step = record["step"]
            log.warning("%s (train.stop_on_nonfinite is off: the run goes on, and nothing is saved from here)", message)

    def _needs_model_after(self, step: int) -> bool:
        """Whether ``fit`` evaluates or saves after ``step``: then the next step must not be queued before."""
        t = self.cfg.train
        return bool((t.eval_every and step % t.eval_every == 0) or (t.save_every and step % t.save_every == 0))

    def iter_steps(self, until: int) -> Iterator[dict]:
        """Run optimizer steps until ``self.step == until``, yielding each step's record (``train_step``'s, plus
        ``seconds``: the step's wall time, from the end of the previous step to the end of this one).

        Reading a step's loss waits for the GPU. The next step is queued before that read, so the host's
        work between steps (batches, Python, launches) overlaps the GPU's, except after a step that ``fit``
        evaluates or saves at, which needs the model as that step left it. Consume the records before the
        model: while a record is handled, the following step may already be queued.
        """
        pending: tuple[float, _QueuedStep, float] | None = None  # (queued at, step, queuing returned at)
        last_done: float | None = None
        while self.step < until or pending is not None:
            queued = None
            if self.step < until and (pending is None or not self._needs_model_after(pending[1].record["step"])):
                begun = time.perf_counter()
                work = self._queue_step()
                queued = (begun, work, time.perf_counter())
            if pending is not None:
                started, step, returned = pending
                record = self._finish(step)
                # On the CPU queuing a step runs it: it was done when queuing returned, before the next one ran.
                done = time.perf_counter() if step.copied is not None else returned
                record["seconds"] = done - (started if last_done is None else max(started, last_done))
                last_done = done
                yield record
            pending = queued

    # --------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, *, use_ema: bool = False) -> dict:
        if self.data.eval is None:
            return {}
        if use_ema:
            self.ema.swap(self.model)
        self.model.eval()
        try:
            t = self.cfg.train
            ds = self.data.eval
            n_batches = min(t.eval_batches, math.ceil(len(ds) / t.micro_batch_size))
            # Data-parallel ranks take every dp_world-th batch and add up their totals. Each runs as many forwards,
            # a rank past the last batch running the first again, uncounted: DDP broadcasts buffers and FSDP2
            # gathers parameters inside every forward, collectives every rank must join. Tensor-parallel ranks
            # (dp_world 1) all run every batch, as they train.
            ranks, rank = self.dist.dp_world, self.dist.dp_rank
            totals = torch.zeros(3, device=self.device)  # loss * units, units, correct predictions
            for k in range(rank, ranks * math.ceil(n_batches / ranks), ranks):
                counted = k < n_batches
                first = (k if counted else 0) * t.micro_batch_size
                batch = self.data.collate([ds[i] for i in range(first, min(len(ds), first + t.micro_batch_size))])
                n = self.loss_units(batch, self.task) if counted else 0
                loss, extra = self.forward(batch, train=False)
                if n:  # no labelled token: a NaN mean loss with no weight (as in training)
                    totals += torch.stack([loss * n, torch.tensor(float(n), device=self.device),
                                           torch.tensor(float(extra.get("correct", 0)), device=self.device)])
            if ranks > 1:
                torch.distributed.all_reduce(totals)  # (every rank is a data-parallel one: ddp, fsdp)
        finally:
            D.reshard(self.model)
            self.model.train()
            if use_ema:
                self.ema.swap(self.model)
        loss_sum, units, correct = totals.tolist()
        loss = loss_sum / max(units, 1.0)
        prefix = "eval_ema_" if use_ema else "eval_"
        out = {prefix + "loss": loss}
        if self.task == "causal_lm":
            out[prefix + "perplexity"] = math.exp(min(loss, 50.0))
        else:
            out[prefix + "accuracy"] = correct / max(1.0, units)
        return out

    def evaluate_all(self) -> dict:
        out = self.evaluate()
        if self.ema is not None and self.data.eval is not None:
            out.update(self.evaluate(use_ema=True))
        return out

    # --------------------------------------------------------------------------------------------------------
    def _weights_untrusted(self, what: str) -> bool:
        if self.first_nonfinite_step is None:
            return False
        log.error("not saving the %s at step %d: step %d had a non-finite loss or gradient norm, so the weights may "
                  "hold NaN or inf; the last good checkpoint is kept", what, self.step, self.first_nonfinite_step)
        return True

    def save(self) -> Path | None:
        """Write a training checkpoint (None: skipped, after a non-finite step)."""
        if self._weights_untrusted("checkpoint"):
            return None
        return save_checkpoint(self.output_dir / "checkpoints", step=self.step, model=self.model, optimizer=self.optimizer,
                               scheduler=self.scheduler, sampler=self.sampler, dist_state=self.dist, ema=self.ema,
                               master=self.master, keep=self.cfg.train.keep_checkpoints or None,
                               extra={"config": self.cfg.to_dict(), "tokens_seen": self.tokens_seen, "world": self.dist.world})

    def export(self, directory: Path | None = None) -> Path | None:
        """save_pretrained the trained model (and the EMA weights into ``final_ema``) in HF layout, with the
        tokenizer, each folder atomically (a crash leaves the previous export whole)."""
        if self._weights_untrusted("export"):
            return None
        directory = Path(directory or self.output_dir / "final")
        state = D.export_state_dict(self.model, self.dist)
        ema_state = None
        if self.ema is not None:
            self.ema.swap(self.model)
            ema_state = D.export_state_dict(self.model, self.dist)
            self.ema.swap(self.model)
        failure = None
        if self.dist.is_main:
            try:
                self._export_folder(state, directory)
                if ema_state is not None:
                    self._export_folder(ema_state, directory.with_name(directory.name + "_ema"))
            except Exception as err:  # noqa: BLE001 (every rank raises, below: none waits at a barrier for rank 0)
                failure = err
        raise_unless_every_rank_succeeded(self.dist, failure, f"exporting {directory}",
                                          kept="an earlier export there is kept")
        return directory if self.dist.is_main else None

    def _export_folder(self, state: dict, directory: Path) -> None:
        with atomic_folder(directory, owned=owned_by_model_save) as tmp:
            _save_pretrained(self.raw_model, state, tmp, label_names=self.data.label_names)
            if self.data.tokenizer is not None and hasattr(self.data.tokenizer, "save_pretrained"):
                self.data.tokenizer.save_pretrained(tmp)

    # --------------------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        t = self.cfg.train
        seq_len = self.cfg.data.seq_len
        if self.task == "causal_lm":
            fpt = flops_per_token(D.unwrap(self.model), seq_len)
        elif self.tokens_per_image:
            fpt = flops_per_token(D.unwrap(self.model), self.tokens_per_image)
        else:  # text classification: padded lengths vary by batch
            fpt = 0.0
        peak = t.peak_tflops * 1e12 if t.peak_tflops else (measure_matmul_peak(self.device) if fpt else 0.0)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        bar = tqdm(total=t.max_steps, initial=self.step, disable=not (t.progress and self.dist.is_main), desc="train", unit="step")
        profiler = self._profiler()
        timed_tokens, timed_rows, timed_seconds = 0, 0, 0.0
        self.model.train()
        try:
            for record in self.iter_steps(t.max_steps):
                elapsed = record.pop("seconds")
                if record["step"] > 1 or record["step"] == t.max_steps:  # the first step pays for compilation
                    timed_tokens += record["tokens"]
                    timed_rows += record["rows"]
                    timed_seconds += elapsed
                record["tokens_per_s"] = record["tokens"] / elapsed
                record["rows_per_s"] = record["rows"] / elapsed
                record["mfu"] = record["tokens_per_s"] * fpt / peak / self.dist.world if peak else 0.0
                if profiler is not None:
                    profiler.step()
                step = record["step"]  # self.step may be one ahead: the next step can be queued already
                if t.eval_every and step % t.eval_every == 0:
                    record.update(self.evaluate_all())
                self.history.append(record)
                if step % t.log_every == 0 or step == t.max_steps or "eval_loss" in record:
                    self.metrics.log(record)
                speed = ({"img_s": f"{record['rows_per_s']:.0f}"} if self.task == "image_classification"
                         else {"tok_s": f"{record['tokens_per_s']:.0f}"})
                bar.set_postfix(loss=f"{record['loss']:.4f}", **speed, lr=f"{record['lr']:.2e}")
                bar.update(1)
                if t.save_every and step % t.save_every == 0 and step < t.max_steps:
                    self.save()
        finally:
            bar.close()
            if profiler is not None:
                profiler.__exit__(None, None, None)
        final_eval = self.evaluate_all()
        if t.save_every:
            self.save()
        exported = self.export() if t.export else None
        summary = self._summary(timed_tokens, timed_rows, timed_seconds, fpt, peak, final_eval, exported)
        self.metrics.log({"summary": True, **summary})
        self.metrics.close()
        if self.dist.is_main:
            log.info("summary: %s", json.dumps(summary))
        return summary

    def _profiler(self):
        t = self.cfg.train
        if not t.profile_steps or not self.dist.is_main:
            return None
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        prof = profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=t.profile_steps, repeat=1),
                       on_trace_ready=tensorboard_trace_handler(str(self.output_dir / "profile")), record_shapes=True)
        prof.__enter__()
        return prof

    def _summary(self, tokens, rows, seconds, fpt, peak, final_eval, exported) -> dict:
        tokens_per_s = tokens / seconds if seconds else 0.0
        if self.device.type == "cuda":
            peak_mem = torch.cuda.max_memory_allocated(self.device)
        else:
            peak_mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # process RSS high-water mark
        return {
            "steps": self.step, "tokens_seen": self.tokens_seen,
            "final_loss": self.history[-1]["loss"] if self.history else None,
            "tokens_per_s": tokens_per_s, "rows_per_s": rows / seconds if seconds else 0.0,
            "mfu": tokens_per_s * fpt / peak / self.dist.world if peak else 0.0,
            "flops_per_token": fpt, "peak_flops": peak, "peak_memory_bytes": peak_mem, **final_eval,
            "exported": str(exported) if exported else None,
        }

    def close(self, *, failed: bool = False) -> None:
        """Leave the process group of a distributed run (every rank calls it; a no-op in one process).
        ``failed=True`` after an error: no closing barrier, which the other ranks may never reach."""
        D.teardown(self.dist, failed=failed)


def _tokens_per_image(model: nn.Module) -> int | None:
    """Sequence length of a ViT (patches + class/register tokens), ours or HF's; None if it is not one."""
    config = getattr(model, "config", None)
    if hasattr(config, "num_patches") and hasattr(config, "num_prefix_tokens"):  # ours
        return config.num_patches + config.num_prefix_tokens
    if hasattr(config, "image_size") and hasattr(config, "patch_size"):  # HF ViTConfig: one class token
        return (config.image_size // config.patch_size) ** 2 + 1
    return None


def _position_limit(model: nn.Module) -> int | None:
    """The longest sequence the learned position table of our decoder or BERT takes; None without one."""
    from ..models.bert.model import BertPreTrainedModel

    if hasattr(model, "decoder_config"):
        return model.decoder_config.max_position_embeddings if model.decoder_config.learned_positions else None
    if isinstance(model, BertPreTrainedModel):
        return model.config.max_position_embeddings
    return None


def _vocab_size(model: nn.Module) -> int | None:
    """The vocabulary of an LM (ours: the token table; HF: its input embeddings); None for vision models."""
    if hasattr(model, "decoder_config"):
        return model.decoder_config.vocab_size
    table = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    # A vision model's input embeddings are its patch tokens (ours, and HF's ViTPatchEmbeddings): no vocabulary.
    return table.num_embeddings if isinstance(table, nn.Embedding) else None


def _save_pretrained(model: nn.Module, state: dict, directory: Path, *, label_names: list[str] | None = None) -> None:
    """Write ``state`` (full, canonical rows) in HF layout: for our models through a fresh, unwrapped copy of
    the family's class (no DDP/FSDP/TP/compile/checkpoint wrappers); an HF model saves it directly. A classifier's
    config names its classes (``id2label``) after the data's labels, where the data named them."""
    if hasattr(model.config, "to_hf"):
        from ..checkpoint.loader import build_model as build_from_hf

        hf = model.config.to_hf()
        if label_names:
            hf.id2label = {i: label_names[i] if i < len(label_names) else name for i, name in hf.id2label.items()}
        clean = build_from_hf(hf, attn_impl=model.attn_impl, kernel_backend=model.kernel_backend, device="meta")
        clean.load_state_dict(state, strict=True, assign=True)
        clean.save_pretrained(directory)
    else:
        model.save_pretrained(directory, state_dict=state)


def train(config: ExperimentConfig | str | Path | dict, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """Run a whole experiment from a config object, a YAML path or a dict; returns the end summary."""
    cfg = config if isinstance(config, ExperimentConfig) else load_config(config, overrides)
    trainer = Trainer(cfg)
    try:
        summary = trainer.fit()
    except BaseException:
        trainer.close(failed=True)
        raise
    trainer.close()
    return summary
