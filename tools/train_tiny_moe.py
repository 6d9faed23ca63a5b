#!/usr/bin/env python3
"""Train the bundled tiny Mixtral-architecture MoE LM (``models/tiny-shakespeare-moe``) from a text file.

Pipeline (one command, deterministic seed):

1. Split the corpus by characters: the first 90% is training text, the last 10% is validation text
   (the same split as :func:`moekv.datasets.validation_text`).
2. Train a byte-level BPE tokenizer (``tokenizers``) on the training text only.
3. Train ``transformers.MixtralForCausalLM`` (8 experts, top-2, GQA 8 query / 2 KV heads, head_dim 64) with AdamW,
   linear warmup + cosine decay, bf16 autocast on CUDA (fp32 on CPU), a Switch-style load-balancing aux loss per
   layer (``output_router_logits=True``, ``router_aux_loss_coef``), residual/embedding dropout (training-only
   forward hooks: the architecture and the checkpoint are plain Mixtral). Sequences of ``--seq-len`` tokens, a
   fraction ``--long-frac`` of the steps at ``--long-seq-len`` so that every position up to
   ``max_position_embeddings`` has been trained. The validation loss is measured every ``--eval-every`` steps and
   the weights with the lowest validation loss are kept (early stopping).
4. Save an HF checkpoint folder (bf16 safetensors, tokenizer with chat template, generation config), then reload it
   and measure: validation loss/perplexity over the whole validation split (non-overlapping windows of
   ``--eval-window`` tokens), eval-mode loss on a training subset of the same size, per-layer expert load on the
   validation text, samples at temperature 0.8, and the perplexity on the committed 64 kB validation slice
   (``eval.json``, recomputed by ``tests/test_bundled_model.py`` with :func:`evaluate`). Writes
   ``train_report.json``, ``eval.json``, ``validation_slice.txt`` and ``MODEL_CARD.md``.

Examples::

    python tools/train_tiny_moe.py --device cuda        # the shipped settings: 700 steps, ~2 min on one H200
    python tools/train_tiny_moe.py --device cpu --steps 20 --batch-tokens 2048 --seq-len 256 --out /tmp/tiny
    python tools/train_tiny_moe.py --eval-only --out models/tiny-shakespeare-moe   # recompute eval.json + card
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import math
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "models" / "tiny-shakespeare-moe"
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]   # ids 0 and 1; <|endoftext|> is bos and eos
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | upper }}:\n{{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)
SLICE_WINDOW = 1024          # window length for the committed-slice perplexity (eval.json, the test)
SAMPLE_PROMPTS = ["ROMEO:\n", "First Citizen:\n", ""]   # "" = unconditional (from <|endoftext|>)


def _load_datasets_module():
    """src/moekv/datasets.py by path (stdlib only), so the split is defined in one place."""
    spec = importlib.util.spec_from_file_location("_moekv_datasets", REPO / "src" / "moekv" / "datasets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------------- tokenizer
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


# --------------------------------------------------------------------------------------------------------- model
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


# ----------------------------------------------------------------------------------------------------- reporting
def folder_sizes(folder: Path) -> dict:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}


def _non_default(rep: dict) -> str:
    defaults = vars(parse_args([]))
    diff = [f"`--{k.replace('_', '-')} {v}`" for k, v in rep["hparams"].items() if defaults.get(k) != v]
    if rep["planned_steps"] != defaults["steps"]:
        diff.append(f"`--steps {rep['planned_steps']}`")
    return ", ".join(diff) or "none besides `--data/--out/--device`"


def write_model_card(folder: Path) -> None:
    rep = json.loads((folder / "train_report.json").read_text())
    ev = json.loads((folder / "eval.json").read_text())
    cfg = rep["config"]
    val, trn = rep["validation"], rep["train_eval"]
    L = len(val["expert_load"])
    lines = [
        "# tiny-shakespeare-moe",
        "",
        "A tiny Mixtral-architecture Mixture-of-Experts causal LM trained from scratch on tinyshakespeare by",
        "`tools/train_tiny_moe.py`. It is the default model of the moekv engine and the fixture for KV-fidelity and",
        "expert-routing measurements. Loads with stock `transformers` (`MixtralForCausalLM`), no custom code.",
        "",
        "## Architecture",
        "",
        "| field | value |",
        "|---|---|",
        f"| architecture | `MixtralForCausalLM` |",
        f"| layers | {cfg['num_hidden_layers']} |",
        f"| hidden size | {cfg['hidden_size']} |",
        f"| experts / top-k | {cfg['num_local_experts']} / {cfg['num_experts_per_tok']} |",
        f"| expert intermediate size | {cfg['intermediate_size']} |",
        f"| attention | GQA: {cfg['num_attention_heads']} query heads, {cfg['num_key_value_heads']} KV heads, "
        f"head_dim {cfg['head_dim']} |",
        f"| vocab | {cfg['vocab_size']} (byte-level BPE, specials `<\\|endoftext\\|>`=0 bos/eos, "
        f"`<\\|pad\\|>`=1) |",
        f"| max_position_embeddings | {cfg['max_position_embeddings']} (RoPE, theta {rep['rope_theta']:,.0f}) |",
        f"| parameters | {rep['params']:,} total, ~{rep['active_params']:,} active per token |",
        f"| weights dtype | bfloat16 (safetensors), untied embeddings |",
        "",
        "## Data and split",
        "",
        f"- Corpus: tinyshakespeare (`../shared/data/tinyshakespeare.txt`, {rep['data']['chars']:,} characters, "
        f"sha256 `{rep['data']['sha256'][:16]}…`).",
        "- Split by characters: the first 90% (`text[:int(0.9 * len(text))]`) is training text, the last 10% is "
        f"validation text ({rep['data']['val_chars']:,} characters, {rep['data']['val_tokens']:,} tokens). "
        "`moekv.datasets.validation_text()` returns exactly this split.",
        f"- The tokenizer was trained on the training text only ({rep['data']['train_tokens']:,} training tokens, "
        f"{rep['data']['chars_per_token']:.2f} characters per token).",
        "- `validation_slice.txt` is the committed copy of the first 64 kB of the validation split (cut at a line "
        "end); `moekv.datasets.validation_slice()` returns it.",
        "",
        "## Training",
        "",
        "```",
        rep["command"],
        "```",
        "",
        f"Settings that differ from the script's defaults: {_non_default(rep)}.",
        "",
        f"- Hardware: {rep['hardware']}; torch {rep['versions']['torch']}, transformers "
        f"{rep['versions']['transformers']}, tokenizers {rep['versions']['tokenizers']}.",
        f"- {rep['steps_done']} steps in {rep['train_seconds'] / 60:.1f} min of training "
        f"({rep['total_seconds'] / 60:.1f} min wall incl. tokenizer and evaluation); "
        f"{rep['hparams']['batch_tokens']:,} tokens per step "
        f"({rep['tokens_seen'] / 1e6:.1f} M tokens, {rep['epochs']:.0f} passes over the training tokens).",
        f"- AdamW (betas 0.9/0.95, weight decay {rep['hparams']['weight_decay']}), peak LR {rep['hparams']['lr']}, "
        f"{rep['hparams']['warmup']} warmup steps, cosine decay to {rep['hparams']['min_lr_frac']}x; "
        f"{'bf16 autocast' if rep['hardware'].startswith('1x') else 'fp32'}; grad clip 1.0; "
        f"seed {rep['hparams']['seed']}; experts kernel `{rep.get('experts_implementation')}`.",
        f"- Sequences of {rep['hparams']['seq_len']} tokens ({rep['hparams']['long_frac']:.0%} of the steps at "
        f"{rep['hparams']['long_seq_len']}), random offsets; 10% of the sequences start with `<|endoftext|>` "
        "at a speech boundary.",
        f"- Router load-balancing aux loss on (`output_router_logits=True`), coefficient "
        f"{rep['hparams']['aux_coef']}, applied per layer. Dropout {rep['hparams']['dropout']} on embeddings and "
        "sublayer outputs (training-time hooks only).",
        f"- Early stopping on validation loss (evaluated every {rep['hparams']['eval_every']} steps): kept "
        f"step {rep['best_step']}. Note that the validation text therefore selected the checkpoint.",
        "- The shipped `config.json` has `output_router_logits: false` (inference does not need the aux loss; pass "
        "`output_router_logits=True` to get router logits).",
        "",
        "## Results",
        "",
        "Measured after saving, on the reloaded bf16 checkpoint computed in fp32, non-overlapping windows:",
        "",
        "| split | window | tokens | loss (nats/token) | perplexity | bits/char |",
        "|---|---|---|---|---|---|",
        f"| train (first {trn['tokens']:,} train tokens) | {trn['window']} | {trn['tokens']:,} | {trn['loss']:.4f} | "
        f"{trn['perplexity']:.2f} | {trn['bits_per_char']:.3f} |",
        f"| validation (whole split) | {val['window']} | {val['tokens']:,} | {val['loss']:.4f} | "
        f"{val['perplexity']:.2f} | {val['bits_per_char']:.3f} |",
        f"| committed 64 kB validation slice | {ev['window']} | {ev['tokens']:,} | {ev['loss']:.4f} | "
        f"{ev['perplexity']:.2f} | – |",
        "",
        f"Final training loss (mean of the last {rep['last_train_loss_steps']} steps, dropout on): "
        f"{rep['last_train_loss']:.4f} (perplexity {math.exp(rep['last_train_loss']):.2f}).",
        "",
        "The committed-slice row is computed exactly as `tests/test_bundled_model.py` does (CPU, fp32, "
        f"{SLICE_WINDOW}-token windows) and stored in `eval.json`; the test asserts it within 1%.",
        "",
        "## Expert load on validation text",
        "",
        "Fraction of routed token-slots (top-2 choices) per expert and layer over the whole validation split "
        f"(uniform = {1 / cfg['num_local_experts']:.3f}). Minimum {val['expert_load_min']:.3f}, maximum "
        f"{val['expert_load_max']:.3f}.",
        "",
        "| layer | " + " | ".join(f"e{e}" for e in range(cfg["num_local_experts"])) + " |",
        "|---|" + "---|" * cfg["num_local_experts"],
    ]
    for layer in range(L):
        lines.append(f"| {layer} | " + " | ".join(f"{v:.3f}" for v in val["expert_load"][layer]) + " |")
    if rep.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in rep["notes"]]
    lines += ["", "## Samples (temperature 0.8, no top-k/top-p)", ""]
    for s in rep["samples"]:
        shown = repr(s["prompt"]) if s["prompt"] else "`<|endoftext|>` (unconditional)"
        lines += [f"Prompt {shown}, {s['new_tokens']} new tokens, seed {s['seed']}:", "", "```", s["text"], "```", ""]
    sizes = folder_sizes(folder)
    sizes.pop("MODEL_CARD.md", None)
    lines += ["## Files", "", "| file | bytes |", "|---|---|"]
    lines += [f"| {k} | {v:,} |" for k, v in sizes.items()]
    lines += [f"| **total (without this card)** | **{sum(sizes.values()):,}** ({sum(sizes.values()) / 1e6:.2f} MB) |",
              "", "## Chat template", "", "Play format: each message as `ROLE:` on its own line, then the text, then a "
              "blank line; the generation prompt is `ASSISTANT:`.", "",
              "## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "tok = AutoTokenizer.from_pretrained('models/tiny-shakespeare-moe')",
              "model = AutoModelForCausalLM.from_pretrained('models/tiny-shakespeare-moe')",
              "ids = tok('ROMEO:\\n', return_tensors='pt').input_ids",
              "print(tok.decode(model.generate(ids, do_sample=True, temperature=0.8, max_new_tokens=64)[0]))",
              "```", "", "License of the text: public domain (Shakespeare); the weights follow the repository license.",
              ""]
    (folder / "MODEL_CARD.md").write_text("\n".join(lines), encoding="utf-8")


# ------------------------------------------------------------------------------------------------------- training
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="corpus text file (default: $MOEKV_TRAIN_TEXT or "
                    "<repo>/../shared/data/tinyshakespeare.txt)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output checkpoint folder")
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=192, help="per-expert FFN size")
    ap.add_argument("--max-position-embeddings", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=700, help="planned optimizer steps (LR schedule length)")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="training time budget: after a short warm-up the step count is shrunk to fit")
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--long-seq-len", type=int, default=4096)
    ap.add_argument("--long-frac", type=float, default=0.25, help="fraction of steps at --long-seq-len")
    ap.add_argument("--bos-frac", type=float, default=0.1, help="fraction of sequences starting with bos")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=0.3)
    ap.add_argument("--aux-coef", type=float, default=0.02)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-window", type=int, default=2048)
    ap.add_argument("--sample-tokens", type=int, default=160)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-only", action="store_true",
                    help="only recompute eval.json on the committed slice and rewrite MODEL_CARD.md for --out")
    return ap.parse_args(argv)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def hardware_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"1x {torch.cuda.get_device_name(dev)}"
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    dev = pick_device(args.device)
    if args.eval_only:
        res = slice_eval(out, str(dev))
        (out / "eval.json").write_text(json.dumps(res, indent=1) + "\n")
        log(f"slice ppl {res['perplexity']:.3f} (loss {res['loss']:.4f}), min expert load "
            f"{res['expert_load_min']:.4f}")
        if (out / "train_report.json").is_file():
            write_model_card(out)
        return 0

    t_start = time.time()
    import tokenizers
    import transformers
    from transformers import GenerationConfig, MixtralForCausalLM

    ds = _load_datasets_module()
    data_path = Path(args.data) if args.data else ds.default_corpus_path()
    raw = data_path.read_bytes()
    text = raw.decode("utf-8")
    train_text, val_text = ds.split_text(text)
    log(f"data {data_path}: {len(text):,} chars -> train {len(train_text):,} / val {len(val_text):,}")

    torch.manual_seed(args.seed)
    tok = train_tokenizer(train_text, args.vocab_size)
    vocab = tok.get_vocab_size()
    train_enc = tok.encode(train_text)
    train_ids = torch.tensor(train_enc.ids, dtype=torch.long)
    val_ids = torch.tensor(tok.encode(val_text).ids, dtype=torch.long)
    log(f"tokenizer: vocab {vocab}, train {train_ids.numel():,} tokens, val {val_ids.numel():,} tokens, "
        f"{len(train_text) / train_ids.numel():.2f} chars/token")
    # token indices that start a speech (right after a blank line): candidates for bos-prefixed sequences
    starts = sorted({train_enc.char_to_token(m.end()) for m in re.finditer(r"\n\n", train_text)
                     if m.end() < len(train_text)} - {None})
    speech_starts = torch.tensor(starts, dtype=torch.long)

    config = build_config(args, vocab)
    model = MixtralForCausalLM(config).to(dev)
    n_params = count_params(model)
    per_expert = 3 * args.hidden * args.intermediate * args.layers
    active = n_params - per_expert * (config.num_local_experts - config.num_experts_per_tok)
    log(f"model: {n_params:,} params ({n_params * 2 / 1e6:.1f} MB bf16), ~{active:,} active/token")
    hooks = add_dropout_hooks(model, args.dropout)

    use_amp = dev.type == "cuda"
    amp_dtype = torch.bfloat16 if use_amp else None
    if use_amp:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    experts_impl = choose_experts_implementation(model, dev, amp_dtype, vocab, args.batch_tokens, args.seq_len)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")

    gen = torch.Generator().manual_seed(args.seed)
    train_dev = train_ids.to(dev)

    def get_batch(seq_len: int):
        bsz = max(1, args.batch_tokens // seq_len)
        hi = train_ids.numel() - seq_len - 1
        s = torch.randint(0, hi, (bsz,), generator=gen)
        with_bos = torch.rand(bsz, generator=gen) < args.bos_frac
        if with_bos.any() and speech_starts.numel():
            pick = speech_starts[torch.randint(0, speech_starts.numel(), (bsz,), generator=gen)]
            s = torch.where(with_bos, (pick - 1).clamp(0, hi), s)   # seq = [bos] + tokens from the speech start
        idx = s[:, None] + torch.arange(seq_len + 1)[None]
        seq = train_dev[idx.to(dev)]
        x, y = seq[:, :-1].clone(), seq[:, 1:]
        x[with_bos.to(dev), 0] = config.bos_token_id
        return x, y

    total_steps = args.steps

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = min(1.0, (step - args.warmup) / max(1, total_steps - args.warmup))
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))

    budget_s = args.max_minutes * 60 if args.max_minutes else None
    history, train_losses = [], []
    best = {"loss": float("inf"), "step": -1, "state": None}
    t_train = time.time()
    eval_seconds = 0.0
    timing_mark = None
    step = 0
    tokens_seen = 0
    while step < total_steps:
        model.train()
        seq_len = args.long_seq_len if torch.rand(1, generator=gen).item() < args.long_frac else args.seq_len
        x, y = get_batch(seq_len)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        ctx = torch.autocast("cuda", dtype=amp_dtype) if use_amp else contextlib.nullcontext()
        with ctx:
            out_ = model(input_ids=x, output_router_logits=True, use_cache=False)
        ce = F.cross_entropy(out_.logits.float().reshape(-1, vocab), y.reshape(-1))
        aux = per_layer_balance_loss(out_.router_logits, config.num_local_experts, config.num_experts_per_tok)
        loss = ce + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += x.numel()
        train_losses.append(ce.item() if (step % args.log_every == 0 or step > total_steps - 100) else None)

        if step == 10:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            timing_mark = (time.time(), step, eval_seconds)
        if budget_s and timing_mark and step == 60:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            sps = (time.time() - timing_mark[0] - (eval_seconds - timing_mark[2])) / (step - timing_mark[1])
            eval_cost = eval_seconds / max(1, step // args.eval_every) if step >= args.eval_every else 1.0
            per_step = sps + eval_cost / args.eval_every
            remaining = budget_s - (time.time() - t_train)
            fit = step + int(0.97 * remaining / per_step)
            if fit < total_steps:
                log(f"time budget {args.max_minutes} min at {sps * 1000:.0f} ms/step: steps {total_steps} -> {fit}")
                total_steps = fit
            else:
                log(f"time budget ok: {sps * 1000:.0f} ms/step, {total_steps} steps")
        if step % args.log_every == 0 or step == 1:
            el = time.time() - t_train
            log(f"step {step}/{total_steps} loss {ce.item():.4f} aux {aux.item():.4f} lr {lr_at(step - 1):.2e} "
                f"gnorm {float(gnorm):.2f} seq {seq_len} {tokens_seen / el / 1e3:.0f}k tok/s")
        if step % args.eval_every == 0 or step == total_steps:
            te = time.time()
            r = evaluate(model, val_ids, args.eval_window, batch_windows=16 if use_amp else 2,
                         count_experts=True, autocast_dtype=amp_dtype)
            eval_seconds += time.time() - te
            history.append({"step": step, "val_loss": r["loss"], "val_ppl": r["perplexity"],
                            "min_load": r["expert_load_min"], "train_loss": ce.item()})
            mark = ""
            if r["loss"] < best["loss"]:
                best = {"loss": r["loss"], "step": step,
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
                mark = " *"
            log(f"eval step {step}: val loss {r['loss']:.4f} ppl {r['perplexity']:.2f} "
                f"min expert load {r['expert_load_min']:.3f}{mark}")
        if budget_s and time.time() - t_train > budget_s:
            log("time budget exhausted, stopping")
            break
    train_seconds = time.time() - t_train
    last = [v for v in train_losses[-100:] if v is not None]
    for h in hooks:
        h.remove()
    log(f"training done: {step} steps in {train_seconds:.0f}s; best val loss {best['loss']:.4f} at step "
        f"{best['step']}")

    # ---- save (bf16) ----
    model.load_state_dict(best["state"])
    out.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        do_sample=True, temperature=0.8, top_k=0, top_p=1.0, max_new_tokens=256)
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, safe_serialization=True)
    save_tokenizer(tok, out)
    slice_text = ds.make_slice(val_text)
    (out / "validation_slice.txt").write_text(slice_text, encoding="utf-8")
    del model, best

    # ---- measure the saved checkpoint ----
    model, tok2 = load_checkpoint(out, str(dev))
    r_val = evaluate(model, val_ids, args.eval_window, batch_windows=8)
    r_val["bits_per_char"] = r_val["loss"] * r_val["predicted_tokens"] / len(val_text) / math.log(2)
    sub = train_ids[: val_ids.numel()]
    r_trn = evaluate(model, sub, args.eval_window, batch_windows=8, count_experts=False)
    r_trn["bits_per_char"] = (r_trn["loss"] * r_trn["predicted_tokens"] / len(tok.decode(sub.tolist()))
                              / math.log(2))
    log(f"final (saved bf16 weights, fp32 compute): val loss {r_val['loss']:.4f} ppl {r_val['perplexity']:.2f}; "
        f"train-subset loss {r_trn['loss']:.4f} ppl {r_trn['perplexity']:.2f}; min expert load "
        f"{r_val['expert_load_min']:.4f}")
    samples = []
    for i, prompt in enumerate(SAMPLE_PROMPTS):
        txt = sample(model, tok2, prompt, args.sample_tokens, 0.8, seed=args.seed + i)
        samples.append({"prompt": prompt, "seed": args.seed + i, "new_tokens": args.sample_tokens,
                        "temperature": 0.8, "text": txt})
        log(f"sample {prompt!r}:\n{txt}\n")
    del model
    ev = slice_eval(out, str(dev))
    (out / "eval.json").write_text(json.dumps(ev, indent=1) + "\n")
    log(f"committed slice: {ev['tokens']} tokens, ppl {ev['perplexity']:.3f}, min load {ev['expert_load_min']:.4f}")

    cfg_json = json.loads((out / "config.json").read_text())
    data_arg = str(data_path)
    report = {
        "command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, Path.cwd())]
                                        + (sys.argv[1:] if argv is None else list(argv))),
        "hardware": hardware_name(dev),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__, "python": platform.python_version()},
        "data": {"path": data_arg, "chars": len(text), "sha256": hashlib.sha256(raw).hexdigest(),
                 "train_chars": len(train_text), "val_chars": len(val_text),
                 "train_tokens": int(train_ids.numel()), "val_tokens": int(val_ids.numel()),
                 "chars_per_token": len(train_text) / train_ids.numel(), "split": "last 10% of characters = val"},
        "config": {k: cfg_json.get(k) for k in ["vocab_size", "hidden_size", "intermediate_size",
                                                "num_hidden_layers", "num_attention_heads",
                                                "num_key_value_heads", "head_dim", "max_position_embeddings",
                                                "num_local_experts", "num_experts_per_tok",
                                                "router_aux_loss_coef"]},
        "rope_theta": float((cfg_json.get("rope_parameters") or {}).get("rope_theta",
                                                                        cfg_json.get("rope_theta", 1e6))),
        "params": n_params, "active_params": active, "experts_implementation": experts_impl,
        "hparams": {k: getattr(args, k) for k in ["vocab_size", "layers", "hidden", "intermediate",
                                                  "max_position_embeddings", "seed", "batch_tokens", "seq_len", "long_seq_len", "long_frac",
                                                  "bos_frac", "lr", "min_lr_frac", "warmup", "weight_decay",
                                                  "dropout", "aux_coef", "eval_every", "eval_window",
                                                  "max_minutes"]},
        "planned_steps": args.steps, "steps_done": step, "best_step": history and min(
            history, key=lambda h: h["val_loss"])["step"],
        "tokens_seen": tokens_seen, "epochs": tokens_seen / train_ids.numel(),
        "train_seconds": train_seconds, "total_seconds": time.time() - t_start,
        "last_train_loss": sum(last) / max(1, len(last)), "last_train_loss_steps": len(last),
        "validation": r_val, "train_eval": r_trn, "slice_eval": {k: ev[k] for k in ["window", "tokens", "loss",
                                                                                    "perplexity"]},
        "samples": samples, "history": history,
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    write_model_card(out)
    sizes = folder_sizes(out)
    log(f"wrote {out}: {sum(sizes.values()) / 1e6:.2f} MB " + ", ".join(f"{k} {v:,}" for k, v in sizes.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
