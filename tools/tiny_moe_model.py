"""The tokenizer and the model of tools/train_tiny_moe.py: a byte-level BPE tokenizer (tokenizers) with the chat
template, the Mixtral config, the experts kernel choice on CUDA, training-only dropout hooks and the per-layer
load-balancing loss. Loaded by path from train_tiny_moe.py (no package needed)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]   # ids 0 and 1; <|endoftext|> is bos and eos

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | upper }}:\n{{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)


def train_tokenizer(text: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    chunks = [text[i:i + 8192] for i in range(0, len(text), 8192)]
    tok.train_from_iterator(chunks, trainer=trainer, length=len(chunks))
    return tok


def hf_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[1],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tok, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json (chat template inline, class name readable by transformers 4 and 5)."""
    hf_tokenizer(tok).save_pretrained(out, save_jinja_files=False)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"   # v5 writes its own "TokenizersBackend", unknown to v4
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def build_config(args, vocab_size: int):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=args.max_position_embeddings,
        num_local_experts=8,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=args.aux_coef,
        router_jitter_noise=0.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        attention_dropout=0.0,
        use_cache=True,
    )


def choose_experts_implementation(model, dev, amp_dtype, vocab: int, batch_tokens: int, seq_len: int) -> str:
    """On CUDA pick the fastest working transformers experts kernel ("grouped_mm" or "eager") for training."""
    default = getattr(model.config, "_experts_implementation", None) or "default"
    if dev.type != "cuda" or not hasattr(model, "set_experts_implementation"):
        return default
    timings = {}
    x = torch.randint(2, vocab, (max(1, batch_tokens // seq_len), seq_len), device=dev)
    for impl in ["grouped_mm", "eager"]:
        try:
            model.set_experts_implementation(impl)
            for i in range(4):
                if i == 1:
                    torch.cuda.synchronize()
                    t0 = time.time()
                with torch.autocast("cuda", dtype=amp_dtype):
                    out = model(input_ids=x, output_router_logits=True, use_cache=False)
                loss = F.cross_entropy(out.logits.float().reshape(-1, vocab), x.reshape(-1))
                loss.backward()
            torch.cuda.synchronize()
            timings[impl] = (time.time() - t0) / 3
        except Exception as e:  # noqa: BLE001 - any failure means "not usable here"
            log(f"experts implementation {impl!r} unusable: {type(e).__name__}: {e}")
        model.zero_grad(set_to_none=True)
    if not timings:
        log("no experts implementation could be timed; keeping the default")
        return default
    best = min(timings, key=timings.get)
    model.set_experts_implementation(best)
    log("experts implementation: " + ", ".join(f"{k} {v * 1000:.0f} ms/step" for k, v in timings.items())
        + f" -> {best}")
    return best


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def add_dropout_hooks(model, p: float) -> list:
    """Training-only dropout on the embedding output and on each sublayer output (attention o_proj, MoE block)."""
    if p <= 0:
        return []

    def hook(mod, inp, out):
        if isinstance(out, tuple):
            return (F.dropout(out[0], p, mod.training),) + tuple(out[1:])
        return F.dropout(out, p, mod.training)

    mods = [model.model.embed_tokens]
    for layer in model.model.layers:
        mods += [layer.self_attn.o_proj, layer.mlp]
    return [m.register_forward_hook(hook) for m in mods]


def per_layer_balance_loss(router_logits, num_experts: int, top_k: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, computed per layer and averaged (1.0 * top_k when balanced).

    transformers' own ``load_balancing_loss_func`` pools the counts of all layers, which lets one layer starve an
    expert while another compensates; balancing each layer keeps every expert of every layer alive.
    """
    total = 0.0
    for g in router_logits:
        probs = torch.softmax(g.float(), dim=-1)                          # (tokens, E)
        top = probs.topk(top_k, dim=-1).indices
        frac = torch.zeros(num_experts, device=g.device).scatter_add_(
            0, top.reshape(-1), torch.ones(top.numel(), device=g.device)) / probs.shape[0]
        total = total + num_experts * (frac * probs.mean(0)).sum()
    return total / len(router_logits)
