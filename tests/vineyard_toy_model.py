# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A small Llama checkpoint with seeded random weights, made locally.

Test support (not shipped in the wheel), for the tests and the benchmark:
no download, and (unlike ``load_format="dummy"``) non-degenerate outputs,
so loading the wrong KV changes what the model generates.
"""

import json
import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ToyLlamaConfig:
    num_layers: int = 4
    hidden_size: int = 512
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    vocab_size: int = 32000
    max_position_embeddings: int = 8192
    dtype: str = "float32"
    seed: int = 0
    #: Tokens every layer attends back to (a Mistral-7B-v0.1 style model:
    #: vLLM frees a request's blocks once they leave the window); None: a
    #: Llama with full attention.
    sliding_window: int | None = None


def make_toy_llama(path: str, config: ToyLlamaConfig | None = None) -> str:
    """Write the checkpoint to ``path`` (reused if it already matches)."""
    import torch
    from safetensors.torch import save_file

    config = config or ToyLlamaConfig()
    stamp = os.path.join(path, "toy_llama.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == asdict(config):
                return path
    os.makedirs(path, exist_ok=True)
    c = config
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **(
            {
                "architectures": ["MistralForCausalLM"],
                "model_type": "mistral",
                "sliding_window": c.sliding_window,
            }
            if c.sliding_window
            else {}
        ),
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": c.dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    gen = torch.Generator().manual_seed(c.seed)
    dtype = getattr(torch, c.dtype)

    def rand(*shape: int) -> torch.Tensor:
        scale = shape[-1] ** -0.5
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    weights = {
        "model.embed_tokens.weight": rand(c.vocab_size, c.hidden_size),
        "model.norm.weight": torch.ones(c.hidden_size, dtype=dtype),
        "lm_head.weight": rand(c.vocab_size, c.hidden_size),
    }
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(c.hidden_size, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(
                c.hidden_size, dtype=dtype
            ),
            p + "self_attn.q_proj.weight": rand(q, c.hidden_size),
            p + "self_attn.k_proj.weight": rand(kv, c.hidden_size),
            p + "self_attn.v_proj.weight": rand(kv, c.hidden_size),
            p + "self_attn.o_proj.weight": rand(c.hidden_size, q),
            p + "mlp.gate_proj.weight": rand(c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": rand(c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": rand(c.hidden_size, c.intermediate_size),
        }
    save_file(weights, os.path.join(path, "model.safetensors"))
    with open(stamp, "w") as f:
        json.dump(asdict(config), f)
    return path


def make_toy_lora(
    path: str, config: ToyLlamaConfig | None = None, seed: int = 1, rank: int = 8
) -> str:
    """A LoRA adapter of the toy Llama in PEFT's layout (every attention
    projection, seeded random A and B: it changes the KV), written to
    ``path`` (replacing what is there: an adapter retrained in place)."""
    import torch
    from safetensors.torch import save_file

    c = config or ToyLlamaConfig()
    os.makedirs(path, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "base_model_name_or_path": "toy-llama",
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f, indent=2)
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, c.dtype)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"q_proj": (q, c.hidden_size), "k_proj": (kv, c.hidden_size)}
    shapes |= {"v_proj": (kv, c.hidden_size), "o_proj": (c.hidden_size, q)}
    weights = {}
    for i in range(c.num_layers):
        for name, (out, inp) in shapes.items():
            p = f"base_model.model.model.layers.{i}.self_attn.{name}."
            a = torch.randn(rank, inp, generator=gen) * inp**-0.5
            b = torch.randn(out, rank, generator=gen) * rank**-0.5
            weights[p + "lora_A.weight"] = a.to(dtype)
            weights[p + "lora_B.weight"] = b.to(dtype)
    save_file(weights, os.path.join(path, "adapter_model.safetensors"))
    return path
