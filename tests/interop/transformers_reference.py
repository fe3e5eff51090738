"""Hugging Face transformers as the independent reference for spes's interop tests
(transformers_reference_test.cpp). Runs on CPU in float32.

  score HFDIR (--text STR | --tokens 1,2,3)
      Loads HFDIR with AutoModelForCausalLM.from_pretrained (and its tokenizer.json through
      Hugging Face `tokenizers` for --text); prints {"class", "tokens", "logprobs"}: the model's
      class name and log p(tokens[i+1] | tokens[..i]) for every position.
  make CLASS OUTDIR SEED
      Creates a tiny model of CLASS (olmoe, qwen3_moe, llama, qwen3) with transformers' own
      random initialisation (norm weights drawn too, so a misplaced tensor shows) and saves it
      with save_pretrained (safetensors). Prints {"class", "vocab_size"}.
"""
import argparse
import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

VOCAB = 96


def tiny_config(kind: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=VOCAB - 1, pad_token_id=None)
    if kind == "olmoe":
        return transformers.OlmoeConfig(intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                        num_key_value_heads=2, rope_theta=10000.0,
                                        norm_topk_prob=False, **common)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24,
                                           num_experts=4, num_experts_per_tok=2,
                                           num_key_value_heads=2, head_dim=8,
                                           decoder_sparse_step=1, mlp_only_layers=[],
                                           norm_topk_prob=True, rope_theta=1000000.0, **common)
    if kind == "llama":
        return transformers.LlamaConfig(intermediate_size=48, num_key_value_heads=2,
                                        rope_theta=500000.0, attention_bias=False,
                                        mlp_bias=False, **common)
    if kind == "qwen3":
        return transformers.Qwen3Config(intermediate_size=48, num_key_value_heads=2, head_dim=8,
                                        rope_theta=1000000.0, attention_bias=False, **common)
    raise SystemExit(f"unknown class {kind!r}: use olmoe, qwen3_moe, llama or qwen3")


def make(kind: str, out: str, seed: int) -> None:
    torch.manual_seed(seed)
    config = tiny_config(kind)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms start at 1: perturb them so that a swapped norm shows
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    print(json.dumps({"class": type(model).__name__, "vocab_size": VOCAB}))


def score(hf_dir: str, text, tokens) -> None:
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    model.eval()
    if text is not None:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
        ids = tok.encode(text, add_special_tokens=False).ids
    else:
        ids = [int(t) for t in tokens.split(",")]
    with torch.no_grad():
        logits = model(torch.tensor([ids], dtype=torch.long)).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    out = [logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    print(json.dumps({"class": type(model).__name__, "tokens": ids, "logprobs": out}))


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("score")
    s.add_argument("hf_dir")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--text")
    g.add_argument("--tokens")
    m = sub.add_parser("make")
    m.add_argument("kind")
    m.add_argument("out")
    m.add_argument("seed", type=int)
    a = ap.parse_args()
    transformers.logging.set_verbosity_error()
    if a.cmd == "score":
        score(a.hf_dir, a.text, a.tokens)
    else:
        make(a.kind, a.out, a.seed)


if __name__ == "__main__":
    sys.exit(main())
