"""CIFAR-style training augmentation on tensors (no torchvision needed)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PAD = 4


def random_crop_flip(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Pad 4 with zeros, random-crop back to HxW, flip horizontally with p=0.5.

    ``x`` is a (B, C, H, W) batch; every sample gets its own crop offset and
    flip, drawn from ``generator`` (so a seeded generator gives the same
    result): :func:`crop_flip_draws`, then :func:`crop_flip`. Hand-written:
    torchvision's RandomCrop/RandomHorizontalFlip do this but torchvision is
    an optional dependency here and its transforms use the global RNG per
    sample.
    """
    if x.dim() != 4:
        raise ValueError(f"random_crop_flip expects a (B, C, H, W) batch, got shape {tuple(x.shape)}")
    b = x.shape[0]
    if b == 0:
        return x.clone()
    dy, dx, flip = crop_flip_draws(b, generator)
    return crop_flip(x, dy.to(x.device), dx.to(x.device), flip.to(x.device))


def crop_flip_draws(b: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The random numbers :func:`random_crop_flip` draws for a batch of ``b``
    samples, in its order (each sample's row offset, then each one's column
    offset, in ``0 .. 2 * PAD``, then each one's flip), on the generator's
    device. The cohort trainer draws a round's ahead of its steps, in the
    order the per-client loop draws them, so its crops are the same."""
    gdev = generator.device
    dy = torch.randint(0, 2 * PAD + 1, (b,), generator=generator, device=gdev)
    dx = torch.randint(0, 2 * PAD + 1, (b,), generator=generator, device=gdev)
    flip = torch.rand(b, generator=generator, device=gdev) < 0.5
    return dy, dx, flip


def crop_flip(x: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """``x`` (..., C, H, W) padded by ``PAD`` zeros on each side, each image
    cropped back to HxW at row offset ``dy`` and column offset ``dx`` (in
    ``0 .. 2 * PAD``) and mirrored where ``flip``; ``dy``, ``dx``, ``flip``
    have ``x``'s leading shape. Indexing only: an image's values are copied,
    never computed, so any batch of images gives each one the same bits."""
    *lead, c, h, w = x.shape
    x = x.reshape(-1, c, h, w)
    dy, dx, flip = dy.reshape(-1), dx.reshape(-1), flip.reshape(-1)
    b = x.shape[0]
    padded = F.pad(x, (PAD, PAD, PAD, PAD))  # zeros
    rows = dy[:, None] + torch.arange(h, device=x.device)[None, :]  # (B, H)
    cols = dx[:, None] + torch.arange(w, device=x.device)[None, :]  # (B, W)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    bidx = torch.arange(b, device=x.device)[:, None, None]
    # (B, H+8, W+8, C)[b, rows, cols] -> (B, H, W, C)
    out = padded.permute(0, 2, 3, 1)[bidx, rows[:, :, None], cols[:, None, :]]
    return out.permute(0, 3, 1, 2).contiguous().reshape(*lead, c, h, w)
