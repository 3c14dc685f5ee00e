"""The second example model (examples/pytorch/conv_lm.py): causal, sized by [model], and it learns."""
from __future__ import annotations

import torch

import kjv
from conv_lm import ConvLM
from inner_optimizer import InnerOptimizer
from train import heldout_loss, next_token_loss


def test_a_position_sees_only_the_past(tiny: dict) -> None:
    model = ConvLM.from_config(tiny, kjv.VOCAB_SIZE)
    tokens = torch.randint(0, kjv.VOCAB_SIZE, (2, 64), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % kjv.VOCAB_SIZE
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :40], after[:, :40])
    assert not torch.allclose(before[:, 40:], after[:, 40:])


def test_layers_are_stacks_covering_the_context(tiny: dict) -> None:
    model = ConvLM.from_config(tiny, kjv.VOCAB_SIZE)
    assert [b.dilation for b in model.blocks] == [1, 2, 4, 8, 16, 32] * tiny["model"]["layers"]
    assert torch.equal(model.head.weight, ConvLM.from_config(tiny, kjv.VOCAB_SIZE).head.weight)  # seeded


def test_standalone_training_lowers_the_heldout_loss(tiny: dict, corpus: kjv.Corpus) -> None:
    torch.set_num_threads(1)
    t, context = tiny["train"], tiny["model"]["context"]
    model = ConvLM.from_config(tiny, kjv.VOCAB_SIZE)
    batches = kjv.training_batches(corpus, tiny["data"], kjv.ShardSpec(), t["batch"], context, tiny["run"]["seed"])
    heldout = kjv.heldout_batches(corpus, tiny["data"], t["batch"], context)
    optimizer = InnerOptimizer(model.parameters(), t)
    start = heldout_loss(model, heldout, t["eval_batches"])
    for step in range(40):
        next_token_loss(model, *batches.next()).backward()
        optimizer.step(step)
        optimizer.zero_grad()
    end = heldout_loss(model, heldout, t["eval_batches"])
    assert start > 4.4  # about ln(96) = 4.56: uniform over the vocabulary
    assert end < 3.2, f"held-out loss {start:.3f} -> {end:.3f} after 40 steps"
