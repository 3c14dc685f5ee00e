#!/usr/bin/env python3
"""The tensor list of a Gemma-3-12B-shaped language model (text only), as the bench tools take it
(--tensors NAME=D0xD1,...): hidden 3840, 48 layers, 16 query heads and 8 key-value heads of 256,
MLP 15360, vocabulary 262208 with the embedding tied to the output (one 262208 x 3840 tensor,
1.0B parameters, larger than any fragment of a 16-way split). Shapes as PyTorch's Linear stores
them (out x in). About 11.8B parameters.

    python3 bench/layouts/gemma3_12b.py            # the --tensors spec
    python3 bench/layouts/gemma3_12b.py --count    # its parameter count
"""
import sys

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 3840, 48, 16, 8, 256, 15360, 262208


def tensors():
    yield "model.embed_tokens.weight", (VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (HIDDEN,)
        yield p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN)
        yield p + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)
        yield p + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)
        yield p + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM)
        yield p + "self_attn.q_norm.weight", (HEAD_DIM,)
        yield p + "self_attn.k_norm.weight", (HEAD_DIM,)
        yield p + "post_attention_layernorm.weight", (HIDDEN,)
        yield p + "pre_feedforward_layernorm.weight", (HIDDEN,)
        yield p + "mlp.gate_proj.weight", (MLP, HIDDEN)
        yield p + "mlp.up_proj.weight", (MLP, HIDDEN)
        yield p + "mlp.down_proj.weight", (HIDDEN, MLP)
        yield p + "post_feedforward_layernorm.weight", (HIDDEN,)
    yield "model.norm.weight", (HIDDEN,)


if __name__ == "__main__":
    if "--count" in sys.argv[1:]:
        total = 0
        for _, shape in tensors():
            n = 1
            for d in shape:
                n *= d
            total += n
        print(total)
    else:
        print(",".join(f"{name}={'x'.join(map(str, shape))}" for name, shape in tensors()))
