"""Mamba-2 mixers as llama.cpp reads them (shared by Granite 4 hybrid and Nemotron-H).

convert_hf_to_gguf's Mamba2Model.modify_tensors: the conv kernel (channels, 1, K) becomes 2-D; A is
stored as A = -exp(A_log), and A and D as (heads, 1) (llama_model_*::load_arch_tensors: ssm_a and ssm_d
are {1, n_head}, with no .weight suffix); the gated RMS norm's weight is split in groups (n_group,
d_inner / n_group); `dt_bias` is the dt projection's bias. The keys are llama.cpp's ssm.* hparams.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from ..errors import ConversionError
from .base import Piece


@dataclass(frozen=True)
class Mixer:
    """One family's Mamba-2 shape: inner width, heads, groups, state size, conv kernel."""

    d_inner: int
    n_head: int
    n_group: int
    d_state: int
    d_conv: int

    def write(self, w: gguf.GGUFWriter) -> None:
        w.add_ssm_conv_kernel(self.d_conv)
        w.add_ssm_state_size(self.d_state)
        w.add_ssm_group_count(self.n_group)
        w.add_ssm_inner_size(self.d_inner)
        w.add_ssm_time_step_rank(self.n_head)  # llama.cpp's name for the head count (ssm_dt_rank)

    def check(self, family: str, head_dim: int | None = None) -> None:
        if self.d_inner % self.n_head or (head_dim and self.d_inner != head_dim * self.n_head):
            raise ConversionError(f"{family}: the Mamba inner width {self.d_inner} is not heads ({self.n_head}) "
                                  f"x head size ({head_dim}); the config does not describe one mixer")
        if self.d_inner % self.n_group:
            raise ConversionError(f"{family}: the Mamba inner width {self.d_inner} is not a multiple of its "
                                  f"{self.n_group} groups")


def rename(name: str) -> str:
    return name.removesuffix(".dt_bias") + ".dt_proj.bias" if name.endswith(".dt_bias") else name


def transform(name: str, shape: tuple[int, ...], mixer: Mixer) -> list[Piece] | None:
    """The Mamba-2 tensors llama.cpp's converter reshapes (names after `rename`), else None."""
    if name.endswith(".conv1d.weight") and len(shape) == 3:
        return [Piece(name, (shape[0], shape[2]), lambda x: x[:, 0, :])]
    if name.endswith(".A_log"):
        return [Piece(name, (*shape, 1), lambda x: -np.exp(x).reshape(*shape, 1))]
    if name.endswith(".D"):
        return [Piece(name, (*shape, 1), lambda x: x.reshape(*shape, 1))]
    if name.endswith((".mamba.norm.weight", ".mixer.norm.weight")) and len(shape) == 1:
        g = mixer.n_group
        return [Piece(name, (g, shape[0] // g), lambda x: x.reshape(g, -1))]
    return None
