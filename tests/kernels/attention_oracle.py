"""The float64 oracle of the attention kernels: plain causal attention of one sequence."""

from __future__ import annotations

import math

import torch


def dense_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Plain causal attention of one sequence, all in float64.

    Args:
        query: ``[Lq, Hq, D]``, the last ``Lq`` positions of the sequence.
        key, value: ``[L, Hkv, D]`` for all ``L >= Lq`` positions.
        scale: softmax scale; ``1 / sqrt(D)`` when ``None``.

    Returns:
        ``[Lq, Hq, D]`` float64.
    """
    lq, hq, d = query.shape
    length, hkv, _ = key.shape
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    g = hq // hkv
    k = key.double().repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, L, D]
    v = value.double().repeat_interleave(g, dim=1).transpose(0, 1)
    q = query.double().transpose(0, 1)  # [Hq, Lq, D]
    scores = q @ k.transpose(-1, -2) * scale
    qpos = torch.arange(length - lq, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > qpos, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1)
