"""Update manifests of model shapes without tensors: what the converter emits for a Qwen3-MoE
checkpoint, for plan and sync benchmarks and tests (`server.plan.TransferPlan.build` takes them as
`TensorEntry(name=, layout=, dtype=, shape=)`)."""
from __future__ import annotations

# Qwen3-30B-A3B (hidden 2048, 32 q / 4 kv heads of 128, 128 experts of 768, vocab 151936, 48 layers)
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1e6,
                 "max_position_embeddings": 4096, "tie_word_embeddings": False, "vocab_size": 151936,
                 "num_hidden_layers": 48, "bos_token_id": 0, "eos_token_id": 0, "dtype": "bfloat16"}


def qwen3_moe_nvfp4_manifest(cfg: dict) -> list[tuple[str, str, str, list[int]]]:
    """(name, layout, dtype, shape) per checkpoint tensor of an NVFP4 update of `cfg` as the converter
    emits it: per-expert triplets of every quantized projection ("nvfp4"), everything else dense BF16."""
    h, hd, e, inter, v = (cfg["hidden_size"], cfg["head_dim"], cfg["num_experts"], cfg["moe_intermediate_size"],
                          cfg["vocab_size"])
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def nv(name, n, k):
        return (name, "nvfp4", "nvfp4", [n, k])

    def bf(name, *shape):
        return (name, "dense", "bfloat16", list(shape))

    out = [bf("model.embed_tokens.weight", v, h)]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out += [nv(f"{p}.self_attn.q_proj.weight", q, h), nv(f"{p}.self_attn.k_proj.weight", kv, h),
                nv(f"{p}.self_attn.v_proj.weight", kv, h), nv(f"{p}.self_attn.o_proj.weight", h, q),
                bf(f"{p}.self_attn.q_norm.weight", hd), bf(f"{p}.self_attn.k_norm.weight", hd),
                bf(f"{p}.input_layernorm.weight", h), bf(f"{p}.post_attention_layernorm.weight", h),
                bf(f"{p}.mlp.gate.weight", e, h)]
        for x in range(e):
            out += [nv(f"{p}.mlp.experts.{x}.gate_proj.weight", inter, h),
                    nv(f"{p}.mlp.experts.{x}.up_proj.weight", inter, h),
                    nv(f"{p}.mlp.experts.{x}.down_proj.weight", h, inter)]
    return out + [bf("model.norm.weight", h), bf("lm_head.weight", v, h)]
