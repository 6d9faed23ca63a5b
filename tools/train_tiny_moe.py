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

Pieces, next to this file and loaded by path: tiny_moe_model.py (tokenizer, Mixtral config, experts kernel choice,
dropout hooks, balance loss), tiny_moe_eval.py (evaluate, slice_eval, samples), tiny_moe_card.py (MODEL_CARD.md).
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
SAMPLE_PROMPTS = ["ROMEO:\n", "First Citizen:\n", ""]   # "" = unconditional (from <|endoftext|>)


def _load_module(path: Path, name: str):
    """A module by path: neither moekv nor tools need be importable (this script runs as `python
    tools/train_tiny_moe.py`, and tests load it by path)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load_datasets_module():
    """src/moekv/datasets.py by path (stdlib only), so the split is defined in one place."""
    return _load_module(REPO / "src" / "moekv" / "datasets.py", "_moekv_datasets")


# the pieces next to this file: tokenizer + model (tiny_moe_model.py), evaluation (tiny_moe_eval.py), the model
# card (tiny_moe_card.py)
_model = _load_module(Path(__file__).with_name("tiny_moe_model.py"), "_tiny_moe_model")
_eval = _load_module(Path(__file__).with_name("tiny_moe_eval.py"), "_tiny_moe_eval")
_card = _load_module(Path(__file__).with_name("tiny_moe_card.py"), "_tiny_moe_card")
log, SPECIAL_TOKENS, CHAT_TEMPLATE = _model.log, _model.SPECIAL_TOKENS, _model.CHAT_TEMPLATE
train_tokenizer, hf_tokenizer, save_tokenizer = _model.train_tokenizer, _model.hf_tokenizer, _model.save_tokenizer
build_config, choose_experts_implementation = _model.build_config, _model.choose_experts_implementation
count_params, add_dropout_hooks, per_layer_balance_loss = (_model.count_params, _model.add_dropout_hooks,
                                                           _model.per_layer_balance_loss)
SLICE_WINDOW, evaluate, encode = _eval.SLICE_WINDOW, _eval.evaluate, _eval.encode
load_checkpoint, slice_eval, sample = _eval.load_checkpoint, _eval.slice_eval, _eval.sample
folder_sizes = _card.folder_sizes


def write_model_card(folder: Path) -> None:
    """MODEL_CARD.md of `folder` (tiny_moe_card.py), listing the settings that differ from this script's defaults."""
    _card.write_model_card(folder, vars(parse_args([])), SLICE_WINDOW)


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
