"""The loss benchmarks' shared cases: a synthetic vocabulary with the digits at fixed ids, batches with
the label mix numeric answers have (runs of 1-6 digits on ~29 % of the positions, 30 % ignored), and the
ntloss peer wrapped as one loss. Used by benchmarks/loss_speed.py (CPU) and loss_speed_cuda.py (GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

DIGIT_IDS = [15 + i for i in range(10)]  # ids of "0".."9" in the synthetic vocabulary


def make_batch(batch: int, length: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(100, vocab, (batch, length), generator=generator)
    for b in range(batch):  # digit runs of 1..6 digits: ~29 % of the positions before masking
        t = 0
        while t < length:
            if torch.rand((), generator=generator) < 0.12:
                run = int(torch.randint(1, 7, (), generator=generator))
                digits = torch.randint(0, 10, (run,), generator=generator)
                labels[b, t : t + run] = torch.tensor(DIGIT_IDS)[digits][: length - t]
                t += run + 1
            else:
                t += 1
    labels[torch.rand(batch, length, generator=generator) < 0.3] = -100
    logits = torch.randn(batch, length, vocab, generator=generator)
    return logits, labels


def ntloss_with_cross_entropy(vocab: int):
    """ntloss.NTLoss needs a Hugging Face tokenizer: a word-level one with "0".."9" at DIGIT_IDS."""
    from ntloss import NTLoss
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    for digit, token_id in enumerate(DIGIT_IDS):
        del words[f"w{token_id}"]
        words[str(digit)] = token_id
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="w0")))
    number_token_loss = NTLoss(tokenizer, vocab_size=vocab)

    def loss(logits, labels):
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return ce + number_token_loss(logits, labels)

    return loss


def make_batch_cuda(batch: int, length: int, vocab: int, dtype: torch.dtype, seed: int = 0, device="cuda"):
    """The CPU benchmark's label mix (digit runs of 1-6 digits ~29 %, 30 % ignored), drawn on the GPU."""
    generator = torch.Generator(device=device).manual_seed(seed)
    labels = torch.randint(100, vocab, (batch, length), device=device, generator=generator)
    # A run of 1-6 digits starts at 9 % of the positions: ~28 % digits (overlapping runs merge).
    starts = torch.rand(batch, length, device=device, generator=generator) < 0.09
    lengths = torch.randint(1, 7, (batch, length), device=device, generator=generator)
    covered = torch.zeros(batch, length, dtype=torch.bool, device=device)
    for offset in range(6):
        shifted = torch.zeros_like(covered)
        shifted[:, offset:] = (starts & (lengths > offset))[:, : length - offset]
        covered |= shifted
    digits = torch.tensor(DIGIT_IDS, device=device)[torch.randint(0, 10, (batch, length), device=device)]
    labels = torch.where(covered, digits, labels)
    labels[torch.rand(batch, length, device=device, generator=generator) < 0.3] = -100
    logits = torch.randn(batch, length, vocab, device=device, generator=generator).to(dtype)
    return logits, labels
