"""A second model to bring to a run: a character-level language model of gated, dilated causal
convolutions (the WaveNet / ByteNet family), no attention and no recurrence.

    token embedding
    -> layers x stack, each a sequence of residual blocks with dilations 1, 2, 4, ... < context:
         x += out(tanh(a) * sigmoid(b)),  [a, b] = causal_conv(LN(x), kernel 2, dilation d)
    -> final LN -> output head

Each stack sees exactly the last 2^n >= context characters (kernel 2, dilations doubling), so one
stack already covers a whole training window; more stacks make the model deeper, not wider-seeing.

The run config's [model] section sizes it, so the file stays readable by the C++ binaries:
model.width is the number of channels, model.layers the number of stacks, model.context the
training window; model.heads is not used. On configs/tiny.toml (width 64, 2 stacks of 6 blocks,
context 64) it has 262,112 parameters and takes about 50 ms per step on one CPU thread.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedConvBlock(nn.Module):
    def __init__(self, width: int, dilation: int):
        super().__init__()
        self.dilation = dilation
        self.norm = nn.LayerNorm(width)
        self.conv = nn.Conv1d(width, 2 * width, kernel_size=2, dilation=dilation)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Conv1d wants [batch, channels, time]; padding on the left only keeps it causal: the
        # output at t sees the inputs at t and t - dilation.
        h = self.conv(F.pad(self.norm(x).transpose(1, 2), (self.dilation, 0)))
        a, b = h.transpose(1, 2).chunk(2, dim=-1)
        return x + self.out(torch.tanh(a) * torch.sigmoid(b))


class ConvLM(nn.Module):
    def __init__(self, vocab: int, layers: int, width: int, context: int):
        super().__init__()
        dilations = [2 ** i for i in range(max(1, (context - 1).bit_length()))]
        self.embedding = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(GatedConvBlock(width, d) for _ in range(layers) for d in dilations)
        self.final_norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    @classmethod
    def from_config(cls, config: dict, vocab: int) -> ConvLM:
        """The model of a run config's [model] section, initialised (PyTorch's default
        initialisation) from run.seed without touching the global random state."""
        m = config["model"]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config["run"]["seed"])
            return cls(vocab, m["layers"], m["width"], m["context"])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: int64 [batch, time]; returns logits [batch, time, vocab]."""
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))
