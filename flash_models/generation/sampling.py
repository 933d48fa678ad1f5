"""From logits to the next token: repetition penalty, repeated n-grams banned, EOS suppression before
min_new_tokens, temperature, top-k, top-p and min-p filtering, then greedy or seeded sampling. All batched, no
host sync."""

from __future__ import annotations

import torch


def seen_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """(B, V) bool: the tokens each prompt row holds, padding excluded (what the repetition penalty starts from)."""
    real = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    counts = torch.zeros(input_ids.shape[0], vocab_size, dtype=torch.long, device=input_ids.device)
    return counts.scatter_add_(1, input_ids, real) > 0


class NgramHistory:
    """Each row's real tokens so far (padding excluded), for ``no_repeat_ngram_size``: HF's rule bans every token
    that would complete an n-gram the row already holds. Kept on the device, one column written per step."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int, n: int):
        B, S = input_ids.shape
        real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        width = S + max_new_tokens
        self.n = n
        self.tokens = torch.zeros(B, width + 1, dtype=torch.long, device=input_ids.device)  # the last column takes the padding
        slots = torch.where(real, real.long().cumsum(1) - 1, width)
        self.tokens.scatter_(1, slots, input_ids)
        self.lengths = real.sum(1)  # (B,)

    def push(self, token: torch.Tensor) -> None:
        """Append each row's new token (B,)."""
        self.tokens.scatter_(1, self.lengths.unsqueeze(1), token.unsqueeze(1))
        self.lengths += 1

    def banned(self, vocab_size: int) -> torch.Tensor:
        """(B, V) bool: the tokens that would repeat an n-gram of the row."""
        n, rows = self.n, self.tokens[:, :-1]
        windows = rows.unfold(1, n, 1)  # (B, W, n): every n-gram position of the buffer
        inside = torch.arange(windows.shape[1], device=rows.device) + n <= self.lengths.unsqueeze(1)  # (B, W)
        last = (self.lengths.unsqueeze(1) - (n - 1) + torch.arange(n - 1, device=rows.device)).clamp(min=0)
        match = (windows[..., :-1] == rows.gather(1, last).unsqueeze(1)).all(-1) & inside  # prefix = the row's last n-1
        counts = torch.zeros(rows.shape[0], vocab_size, dtype=torch.long, device=rows.device)
        return counts.scatter_add_(1, windows[..., -1], match.long()) > 0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's rule for every token already in the row (prompt or generated): divide a positive logit by the
    penalty, multiply a negative one. ``seen`` (B, V) bool."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def filter_logits(logits: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Set to -inf every logit outside the top-k, outside the smallest set whose probability reaches top_p
    (HF's rule: the token that crosses the threshold is kept), and below min_p times the top probability.
    logits (B, V) in float32, already divided by the temperature."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1 - top_p  # ascending: the low-probability tail
        drop_sorted[..., -1] = False  # always keep the most likely token
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(dim=-1)
        threshold = min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def process_logits(logits: torch.Tensor, settings, *, seen: torch.Tensor | None, step: int | torch.Tensor,
                   banned: torch.Tensor | None = None) -> torch.Tensor:
    """The scores the next token is chosen from (float32, (B, V)), as HF's logits processors compute them.
    ``step``: how many tokens the rows have generated before this one, for all rows or per row ((B,)).
    ``banned`` (B, V) bool: tokens that would repeat an n-gram (``NgramHistory.banned``)."""
    logits = logits.float()
    if settings.repetition_penalty != 1.0 and seen is not None:
        logits = apply_repetition_penalty(logits, seen, settings.repetition_penalty)
    if banned is not None:
        logits = logits.masked_fill(banned, float("-inf"))
    if settings.min_new_tokens and settings.eos_ids:
        eos = list(settings.eos_ids)
        if not isinstance(step, torch.Tensor):
            if step < settings.min_new_tokens:
                logits[:, eos] = float("-inf")
        else:
            logits[:, eos] = logits[:, eos].masked_fill((step < settings.min_new_tokens).unsqueeze(1), float("-inf"))
    if settings.do_sample:
        logits = filter_logits(logits / settings.temperature, top_k=settings.top_k, top_p=settings.top_p, min_p=settings.min_p)
    return logits


def choose(scores: torch.Tensor, *, do_sample: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """scores (B, V) -> token ids (B,): argmax, or a draw from softmax(scores)."""
    if not do_sample:
        return scores.argmax(dim=-1)
    return torch.multinomial(scores.softmax(dim=-1), num_samples=1, generator=generator).squeeze(-1)
