"""The built-in model of diloco-learner in plain PyTorch: a port of core/model/transformer.{h,cc}.

A character-level decoder-only transformer (GPT-2 shape):

    token embedding + learned position embedding
    -> layers x pre-LN block: x += attn(LN(x))  (causal multi-head self-attention)
                              x += mlp(LN(x))   (width -> 4*width, GELU (tanh), -> width)
    -> final LN -> output head (no bias, untied from the token embedding)

C++ and Python learners of this model share one run, so the parameter names, shapes and the order
of named_parameters() are exactly those of the C++ model, and so are the initialisation (one
generator seeded with run.seed, parameters drawn in list order) and the forward math.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, context: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        # Added to the scores: -inf above the diagonal, so position t sees positions <= t only.
        self.register_buffer("causal_mask", torch.full((context, context), -math.inf).triu(1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        head_dim = width // self.heads
        # [batch, time, 3, heads, head_dim] -> three [batch, heads, time, head_dim]
        q, k, v = self.qkv(x).view(batch, time, 3, self.heads, head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(head_dim)) + self.causal_mask[:time, :time]
        y = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(batch, time, width)
        return self.out(y)


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    # Attribute order is parameter order: attn_norm, attn.qkv, attn.out, mlp_norm, mlp.up, mlp.down.
    def __init__(self, width: int, heads: int, context: int):
        super().__init__()
        self.attn_norm = nn.LayerNorm(width, eps=1e-5)
        self.attn = Attention(width, heads, context)
        self.mlp_norm = nn.LayerNorm(width, eps=1e-5)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class BuiltinTransformer(nn.Module):
    """named_parameters(), in this order: token_embedding, position_embedding, then per block i
    blocks.i.attn_norm.{weight,bias}, blocks.i.attn.qkv.{weight,bias}, blocks.i.attn.out.{weight,bias},
    blocks.i.mlp_norm.{weight,bias}, blocks.i.mlp.up.{weight,bias}, blocks.i.mlp.down.{weight,bias};
    then final_norm.{weight,bias} and head.weight."""

    def __init__(self, vocab: int, layers: int, width: int, heads: int, context: int, seed: int):
        super().__init__()
        if min(vocab, layers, width, heads, context) < 1 or width % heads:
            raise ValueError(f"invalid model options: vocab={vocab} layers={layers} width={width} "
                             f"heads={heads} context={context} (width must be a multiple of heads)")
        self.context = context
        self.token_embedding = nn.Parameter(torch.empty(vocab, width))
        self.position_embedding = nn.Parameter(torch.empty(context, width))
        self.blocks = nn.ModuleList(Block(width, heads, context) for _ in range(layers))
        self.final_norm = nn.LayerNorm(width, eps=1e-5)
        self.head = nn.Linear(width, vocab, bias=False)
        self.initialise(seed)

    @classmethod
    def from_config(cls, config: dict, vocab: int) -> BuiltinTransformer:
        """The model of a run config's [model] section, seeded with run.seed."""
        m = config["model"]
        return cls(vocab, m["layers"], m["width"], m["heads"], m["context"], config["run"]["seed"])

    @torch.no_grad()
    def initialise(self, seed: int) -> None:
        """Weights N(0, 0.02), the two residual projections of each block N(0, 0.02 / sqrt(2 * layers))
        so the residual stream does not grow with depth, biases 0, layer-norm gains 1; drawn from
        one generator in parameter order, so the values depend only on the options and the seed."""
        generator = torch.Generator().manual_seed(seed)
        residual_std = INIT_STD / math.sqrt(2.0 * len(self.blocks))
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith(("attn.out.weight", "mlp.down.weight")):
                p.normal_(0.0, residual_std, generator=generator)
            else:
                p.normal_(0.0, INIT_STD, generator=generator)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: int64 [batch, time] with time <= context; returns logits [batch, time, vocab]."""
        x = F.embedding(tokens, self.token_embedding) + self.position_embedding[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))
