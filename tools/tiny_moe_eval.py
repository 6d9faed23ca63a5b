"""Measuring a tools/train_tiny_moe.py checkpoint: loss, perplexity and per-layer expert load in non-overlapping
windows (`evaluate`), the committed-slice evaluation that eval.json holds and tests/test_bundled_model.py recomputes
(`slice_eval`), and samples. Loaded by path from train_tiny_moe.py (no package needed)."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
import torch.nn.functional as F

SLICE_WINDOW = 1024          # window length for the committed-slice perplexity (eval.json, the test)


@torch.no_grad()
def evaluate(model, ids: torch.Tensor, window: int, batch_windows: int = 4, count_experts: bool = True,
             autocast_dtype=None) -> dict:
    """Loss/perplexity over ``ids`` in non-overlapping windows of ``window`` tokens (a shorter tail window too).

    Every token but the first of each window is predicted from the tokens before it in its window. Optionally
    counts, per layer, how many routed token-slots (top-k choices) each expert receives.
    """
    model.eval()
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    cfg = model.config
    n_layers, n_exp, k = cfg.num_hidden_layers, cfg.num_local_experts, cfg.num_experts_per_tok
    n_full = ids.numel() // window
    batches = [ids[: n_full * window].view(n_full, window)[i:i + batch_windows]
               for i in range(0, n_full, batch_windows)]
    tail = ids[n_full * window:]
    if tail.numel() >= 2:
        batches.append(tail[None])
    nll, n_pred = 0.0, 0
    counts = torch.zeros(n_layers, n_exp, dtype=torch.long)
    ctx = (torch.autocast(dev.type, dtype=autocast_dtype) if autocast_dtype is not None
           else contextlib.nullcontext())
    for x in batches:
        with ctx:
            out = model(input_ids=x, output_router_logits=count_experts, use_cache=False)
        logits = out.logits[:, :-1].float()
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                               reduction="sum").double().item()
        n_pred += x[:, 1:].numel()
        if count_experts:
            for layer, g in enumerate(out.router_logits):
                top = g.float().topk(k, dim=-1).indices.reshape(-1)
                counts[layer] += torch.bincount(top, minlength=n_exp).cpu()
    loss = nll / n_pred
    res = {"window": window, "tokens": int(ids.numel()), "predicted_tokens": n_pred,
           "windows": n_full + (1 if tail.numel() >= 2 else 0), "loss": loss, "perplexity": math.exp(loss)}
    if count_experts:
        load = counts.double() / counts.sum(dim=1, keepdim=True).double()
        res["expert_counts"] = counts.tolist()
        res["expert_load"] = [[round(v, 5) for v in row] for row in load.tolist()]
        res["expert_load_min"] = float(load.min())
        res["expert_load_max"] = float(load.max())
    return res


def encode(tok, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (tokenizers.Tokenizer or a transformers tokenizer)."""
    from tokenizers import Tokenizer

    if isinstance(tok, Tokenizer):
        return tok.encode(text).ids
    return tok(text, add_special_tokens=False, verbose=False)["input_ids"]


def load_checkpoint(folder: Path, device: str = "cpu", dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    model.eval()
    return model, AutoTokenizer.from_pretrained(folder)


def slice_eval(folder: Path, device: str = "cpu") -> dict:
    """What eval.json holds and the test recomputes: fp32 perplexity + expert load on validation_slice.txt."""
    model, tok = load_checkpoint(folder, device)
    text = (folder / "validation_slice.txt").read_text(encoding="utf-8")
    ids = torch.tensor(encode(tok, text), dtype=torch.long)
    res = evaluate(model, ids, SLICE_WINDOW, batch_windows=4)
    res.update({"text": "validation_slice.txt", "chars": len(text), "dtype": "float32", "device": device})
    return res


@torch.no_grad()
def sample(model, tok, prompt: str, n_tokens: int, temperature: float, seed: int) -> str:
    dev = next(model.parameters()).device
    ids = encode(tok, prompt) if prompt else [model.config.bos_token_id]
    torch.manual_seed(seed)
    out = model.generate(torch.tensor([ids], device=dev), do_sample=True, temperature=temperature, top_k=0,
                         top_p=1.0, max_new_tokens=n_tokens, pad_token_id=model.config.pad_token_id,
                         eos_token_id=None)
    return tok.decode(out[0].tolist(), skip_special_tokens=True)
