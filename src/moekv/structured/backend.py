"""The xgrammar side of structured outputs: the tokenizer's vocabulary as xgrammar sees it, compiled
grammars (cached by xgrammar's compiler), per-request matchers, and the per-step bitmask.

The bitmask is filled on the host (xgrammar walks its grammar on the CPU) for the constrained rows
only, in one batched call, and copied to the device once per step; the sampler unpacks and applies
it there (moekv.sampling.process_logits). After the draw each constrained request's matcher accepts
its token; a matcher that reaches the end of its grammar ends the request ("stop").
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Sequence

import torch

from moekv.core.sampling_params import StructuredOutputParams
from moekv.errors import InvalidRequestError, NotAvailableError
from moekv.tokenizer import Tokenizer

logger = logging.getLogger("moekv.structured")


def xgrammar_available() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


def _import_xgrammar():
    if not xgrammar_available():
        raise NotAvailableError("structured outputs need the xgrammar package: pip install 'moekv[structured]'")
    import xgrammar

    return xgrammar


def vocab_metadata(tokenizer_json: dict) -> tuple[str, bool]:
    """(vocab type, add_prefix_space) of a tokenizer.json: "byte_level" for GPT-2-style byte tokens,
    "byte_fallback" for SentencePiece-style tokens with <0xNN> byte pieces, else "raw"."""
    def kinds(component) -> list[dict]:
        if not isinstance(component, dict):
            return []
        parts = component.get("decoders") or component.get("normalizers") or component.get("pretokenizers")
        return [c for c in parts if isinstance(c, dict)] if parts else [component]

    decoders = kinds(tokenizer_json.get("decoder"))
    types = {d.get("type") for d in decoders}
    if "ByteLevel" in types:
        return "byte_level", False
    if "ByteFallback" in types or (tokenizer_json.get("model") or {}).get("byte_fallback"):
        normalizers = kinds(tokenizer_json.get("normalizer"))
        pretokenizers = kinds(tokenizer_json.get("pre_tokenizer"))
        prepends = any(n.get("type") == "Prepend" for n in normalizers) or any(
            p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never" for p in pretokenizers)
        return "byte_fallback", prepends
    return "raw", False


class GrammarBackend:
    """Compiles grammars for one tokenizer + vocabulary and fills the step's bitmask."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        xgr = _import_xgrammar()
        self._xgr = xgr
        self.vocab_size = vocab_size
        vocab = tokenizer.vocab_tokens()
        if len(vocab) > vocab_size:
            raise NotAvailableError(f"the tokenizer has {len(vocab)} tokens, more than the model's {vocab_size}")
        encoded = [token if token is not None else "" for token in vocab]
        vocab_type, add_prefix_space = vocab_metadata(json.loads(tokenizer.backend_json()))
        info = xgr.TokenizerInfo(encoded, getattr(xgr.VocabType, vocab_type.upper()), vocab_size=vocab_size,
                                 stop_token_ids=sorted(eos_token_ids), add_prefix_space=add_prefix_space)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self.batch_matcher = xgr.BatchGrammarMatcher(max_threads=1)
        self.bitmask_words = (vocab_size + 31) // 32

    # -- per request ----------------------------------------------------------------------------------
    def compile(self, spec: StructuredOutputParams):
        """The compiled grammar of a spec; a schema or regex xgrammar rejects is the request's error."""
        kind, text = spec.key
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
            if kind == "json_object":       # any object, compact (the builtin grammar lets a weak model loop on
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)  # whitespace)
            if kind == "regex":
                return self.compiler.compile_regex(text)
            return self.compiler.compile_grammar(_choice_grammar(spec.choice))
        except (RuntimeError, ValueError, TypeError) as exc:
            what = {"json": "JSON schema", "regex": "regex", "choice": "choice list"}.get(kind, kind)
            raise InvalidRequestError(f"structured outputs: the {what} cannot be compiled: {exc}",
                                      param="structured_outputs") from None

    def matcher(self, spec: StructuredOutputParams):
        """A fresh matcher for one request (its position in the grammar)."""
        return self._xgr.GrammarMatcher(self.compile(spec))

    # -- per step ---------------------------------------------------------------------------------------
    def bitmask(self, matchers: Sequence, device: torch.device) -> torch.Tensor:
        """[S, ceil(V / 32)] int32 on `device`: row i constrained by matchers[i], or all ones when it is None."""
        host = torch.full((len(matchers), self.bitmask_words), -1, dtype=torch.int32,
                          pin_memory=device.type == "cuda")
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if rows:
            self.batch_matcher.batch_fill_next_token_bitmask([matchers[i] for i in rows], host, indices=rows)
        return host.to(device, non_blocking=True)

    @staticmethod
    def accept(matcher, token: int) -> str | None:
        """Advance a matcher by the sampled token. Returns "stop" when its grammar is complete, "error"
        when the token breaks it (it cannot: the mask allowed only grammar tokens), else None."""
        if not matcher.accept_token(token):
            return "error"
        return "stop" if matcher.is_terminated() else None


def _choice_grammar(choices: Sequence[str]):
    """An EBNF grammar whose only sentences are the given strings."""
    import xgrammar as xgr

    alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
    return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
