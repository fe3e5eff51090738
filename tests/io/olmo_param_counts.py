"""Parameter counts of a reference (OLMo/SPES) training YAML, computed the way OLMo builds the
model, for tests/io/reference_config_test.cpp. Independent of the code under test: it reads the
YAML itself (PyYAML) with OLMo's defaults for absent keys and adds up the shapes of OLMo's
modules (spes/model.py and megablocks' dMoE in the reference):

  transformer.wte            [embedding_size or vocab_size, d_model]
  per block (OLMoEBlock)     att_proj [d_model + 2 n_kv head_dim, d_model], attn_out
                             [d_model, d_model], q_norm / k_norm (attention_layer_norm: d_model
                             and n_kv head_dim, or head_dim each when over the head), attn_norm
                             and ff_norm [d_model], router [E, d_model], experts w1, v1, w2
                             [E F, d_model] with F = int(0.5 (mlp_hidden_size or mlp_ratio
                             d_model)) for SwiGLU (config_to_moe_args: act.output_multiplier)
  transformer.ln_f           [d_model]
  transformer.ff_out         [embedding_size or vocab_size, d_model] unless weight_tying

Active parameters per token: OLMo's num_params(include_inactive_params=False) as written for
MegaBlocks' layout, each expert tensor cut to top_k x F of its E x F rows (every non-expert
tensor counts whole). Trainable per node: scripts/train.py of the reference, which freezes every
expert outside [peer_id m, min((peer_id + 1) m, E)) when using_spes and not using_dilico.

usage: olmo_param_counts.py CONFIG.yaml   -> one JSON object on stdout
"""
import json
import sys

import yaml

# OLMo's defaults (spes/config.py of the reference) for the keys read here.
MODEL_DEFAULTS = dict(d_model=768, n_heads=12, n_kv_heads=None, n_layers=12, mlp_ratio=4,
                      mlp_hidden_size=None, activation_type="swiglu", block_type="sequential",
                      attention_layer_norm=False, attention_layer_norm_over_head=False,
                      attention_layer_norm_with_affine=True, layer_norm_with_affine=True,
                      include_bias=True, bias_for_layer_norm=None, vocab_size=50257,
                      embedding_size=50304, weight_tying=True, moe_num_experts=8, moe_top_k=2)


def counts(cfg):
    m = dict(MODEL_DEFAULTS)
    m.update(cfg.get("model") or {})
    assert m["block_type"] == "moe" and m["activation_type"] == "swiglu"
    assert not m["include_bias"] and not m["bias_for_layer_norm"]
    D, H, L = m["d_model"], m["n_heads"], m["n_layers"]
    n_kv = m["n_kv_heads"] or H
    head_dim = D // H
    E, k = m["moe_num_experts"], m["moe_top_k"]
    hidden = m["mlp_hidden_size"] if m["mlp_hidden_size"] is not None else m["mlp_ratio"] * D
    F = int(0.5 * hidden)
    rows = m["embedding_size"] or m["vocab_size"]

    block = (D + 2 * n_kv * head_dim) * D + D * D  # att_proj, attn_out
    if m["attention_layer_norm"] and m["attention_layer_norm_with_affine"]:
        block += 2 * head_dim if m["attention_layer_norm_over_head"] else D + n_kv * head_dim
    if m["layer_norm_with_affine"]:
        block += 2 * D  # attn_norm, ff_norm
    block += E * D  # router
    expert_rows = E * F  # w1, v1, w2 each [E F, D]
    expert_tensors = 3 * expert_rows * D

    total = rows * D + L * (block + expert_tensors) + (D if m["layer_norm_with_affine"] else 0)
    if not m["weight_tying"]:
        total += rows * D
    active = total - L * 3 * (expert_rows - min(k * F, expert_rows)) * D

    s = cfg.get("spes_config") or {}
    peers = s.get("num_peers", 5)
    per_node = s.get("num_train_experts_per_node", 1)
    spes = bool(cfg.get("using_spes", False)) and not bool(cfg.get("using_dilico", False))
    trainable = []
    for peer in range(peers):
        if not spes:
            trainable.append(total)
            continue
        start = peer * per_node
        owned = len(range(start, min(start + per_node, E)))
        trainable.append(total - L * 3 * (E - owned) * F * D)
    return {"total": total, "active_per_token": active, "trainable_per_node": trainable,
            "ffn_hidden_size": F, "embedding_rows": rows}


def main():
    with open(sys.argv[1]) as f:
        cfg = yaml.safe_load(f)
    print(json.dumps(counts(cfg)))


if __name__ == "__main__":
    main()
