"""MODEL_CARD.md of a tools/train_tiny_moe.py checkpoint, from its train_report.json and eval.json. Loaded by path
from train_tiny_moe.py (no package needed)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def folder_sizes(folder: Path) -> dict:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}


def _non_default(rep: dict, defaults: dict) -> str:
    diff = [f"`--{k.replace('_', '-')} {v}`" for k, v in rep["hparams"].items() if defaults.get(k) != v]
    if rep["planned_steps"] != defaults["steps"]:
        diff.append(f"`--steps {rep['planned_steps']}`")
    return ", ".join(diff) or "none besides `--data/--out/--device`"


def write_model_card(folder: Path, defaults: dict, slice_window: int) -> None:
    """MODEL_CARD.md from train_report.json and eval.json in `folder`; `defaults`: the training script's argument
    defaults (the card lists the settings that differ), `slice_window`: the committed-slice window."""
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
        f"Settings that differ from the script's defaults: {_non_default(rep, defaults)}.",
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
        f"{slice_window}-token windows) and stored in `eval.json`; the test asserts it within 1%.",
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
