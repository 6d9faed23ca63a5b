"""bench_decode's transformers side: Hugging Face's MixtralForCausalLM over moekv's own weights (built on the
meta device, every parameter a view of moekv's: Mixtral-8x7B twice would not fit one H200), its decode rows
(model(next_token, cache=DynamicCache) + argmax per step) and the last-token logits parity with moekv."""

from __future__ import annotations

import inspect
import time

import torch

from benchmarks.decode_moekv import moekv_logits
from benchmarks.decode_scenarios import prompts
from benchmarks.decode_steps import busy_fraction, free_memory, sync


def hf_model_sharing(model):
    """transformers' MixtralForCausalLM whose parameters are views of moekv's `model` (no copy)."""
    import transformers

    arch = model.arch
    if arch.architecture != "mixtral":
        raise ValueError("the transformers side-by-side is written for Mixtral-shaped models")
    config = transformers.MixtralConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.expert_intermediate_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim, num_local_experts=arch.num_experts, num_experts_per_tok=arch.top_k,
        rms_norm_eps=arch.rms_norm_eps, max_position_embeddings=arch.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta}, tie_word_embeddings=False,
        sliding_window=None)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = transformers.MixtralForCausalLM(config)
    share = lambda tensor: torch.nn.Parameter(tensor.detach(), requires_grad=False)
    hf.model.embed_tokens.weight = share(model.embed_tokens.weight)
    q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    for theirs, ours in zip(hf.model.layers, model.layers):
        q, k, v = ours.attn.qkv_proj.weight.split([q_size, kv_size, kv_size], dim=0)
        attn = theirs.self_attn
        attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight = share(q), share(k), share(v)
        attn.o_proj.weight = share(ours.attn.o_proj.weight)
        theirs.input_layernorm.weight = share(ours.input_norm.weight)
        theirs.post_attention_layernorm.weight = share(ours.post_attn_norm.weight)
        theirs.mlp.gate.weight = share(ours.mlp.router.weight)
        theirs.mlp.experts.gate_up_proj = share(ours.mlp.experts.w_gate_up)
        theirs.mlp.experts.down_proj = share(ours.mlp.experts.w_down)
    hf.model.norm.weight = share(model.norm.weight)
    hf.lm_head.weight = share(model.lm_head.weight)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config).to(model.device)       # fp32 inv_freq buffers
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"transformers tensors not shared with moekv: {left[:5]}")
    return hf.eval()


@torch.inference_mode()
def run_hf(hf, implementation: str, batch: int, context: int, args, device: torch.device) -> dict:
    from transformers import DynamicCache

    hf.set_experts_implementation(implementation)
    ids = torch.tensor(prompts(batch, context, hf.config.vocab_size), device=device)      # [B, L]
    cache = DynamicCache(config=hf.config)
    # transformers >= 5.2x names the argument `cache` (`past_key_values` deprecated); older ones the latter
    cache_arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    sync(device)
    start = time.perf_counter()
    chunk = max(1, args.prefill_chunk // batch)
    for first in range(0, context, chunk):
        logits = hf(input_ids=ids[:, first:first + chunk], **{cache_arg: cache}, use_cache=True,
                    logits_to_keep=1).logits
    sync(device)
    prefill_s = time.perf_counter() - start
    state = {"next": logits[:, -1].argmax(-1, keepdim=True)}                              # [B, 1]

    def step():
        out = hf(input_ids=state["next"], **{cache_arg: cache}, use_cache=True, logits_to_keep=1)
        state["next"] = out.logits[:, -1].argmax(-1, keepdim=True)

    for _ in range(args.warmup):
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    step_ms = (time.perf_counter() - start) * 1e3 / args.steps
    busy = busy_fraction(step, args.profile_steps, device)
    del cache, state
    free_memory(device)
    return {"system": f"transformers-{implementation}", "kv": "bf16", "batch": batch, "context": context,
            "tpot_ms": step_ms, "tokens_per_s": batch * 1e3 / step_ms, "gpu_busy": busy,
            "prefill_tokens_per_s": batch * context / prefill_s, "kv_bits_per_value": 16.0}


@torch.inference_mode()
def parity(model, hf, length: int) -> dict:
    tokens = prompts(1, length, model.arch.vocab_size, seed=7)[0]
    ours = moekv_logits(model, tokens).float()
    hf.set_experts_implementation("eager")
    theirs = hf(input_ids=torch.tensor([tokens], device=model.device), logits_to_keep=1).logits[0, -1].float()
    cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=0).item()
    return {"prompt_tokens": length, "logits_cosine": cosine, "logits_max_abs_diff": (ours - theirs).abs().max().item(),
            "same_argmax": bool(ours.argmax() == theirs.argmax())}
