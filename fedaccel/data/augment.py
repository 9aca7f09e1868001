"""CIFAR-style training augmentation on tensors (no torchvision needed)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PAD = 4


def random_crop_flip(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Pad 4 with zeros, random-crop back to HxW, flip horizontally with p=0.5.

    ``x`` is a (B, C, H, W) batch; every sample gets its own crop offset and
    flip, drawn from ``generator`` (so a seeded generator gives the same
    result). Hand-written: torchvision's RandomCrop/RandomHorizontalFlip do
    this but torchvision is an optional dependency here and its transforms
    use the global RNG per sample.
    """
    if x.dim() != 4:
        raise ValueError(f"random_crop_flip expects a (B, C, H, W) batch, got shape {tuple(x.shape)}")
    b, _, h, w = x.shape
    if b == 0:
        return x.clone()
    gdev = generator.device
    dy = torch.randint(0, 2 * PAD + 1, (b,), generator=generator, device=gdev).to(x.device)
    dx = torch.randint(0, 2 * PAD + 1, (b,), generator=generator, device=gdev).to(x.device)
    flip = (torch.rand(b, generator=generator, device=gdev) < 0.5).to(x.device)
    padded = F.pad(x, (PAD, PAD, PAD, PAD))  # zeros
    rows = dy[:, None] + torch.arange(h, device=x.device)[None, :]  # (B, H)
    cols = dx[:, None] + torch.arange(w, device=x.device)[None, :]  # (B, W)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    bidx = torch.arange(b, device=x.device)[:, None, None]
    # (B, H+8, W+8, C)[b, rows, cols] -> (B, H, W, C)
    out = padded.permute(0, 2, 3, 1)[bidx, rows[:, :, None], cols[:, None, :]]
    return out.permute(0, 3, 1, 2).contiguous()
