"""Positions read from masks, the one reading of each shared by the model layer (reward pooling, the
turn-end append) and the RL layer (PPO's score credit, generation's position ids)."""

import torch


def last_position(mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last nonzero entry of a [B, T] mask -> [B]; 0 for a row with none.
    The one reading of "the last real token": reward pooling, PPO's score credit, turn-end append."""
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return (positions * (mask != 0)).argmax(-1)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids [B, T] from a [B, T] attention mask, left or right padded: each row counts its
    attended tokens from 0, so left padding does not shift them (padding gets position 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
