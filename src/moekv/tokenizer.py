"""Tokenizer: `tokenizers` for the vocabulary, tokenizer_config.json for special tokens and the
chat template (rendered with jinja2), and incremental detokenization for streaming."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from moekv.errors import InvalidRequestError, ModelLoadError


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"no tokenizer.json in {model_dir}")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises bare Exceptions
            raise ModelLoadError(f"cannot read {path}: {exc}") from exc
        config = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except json.JSONDecodeError as exc:
                raise ModelLoadError(f"{config_path} is not valid JSON: {exc}") from exc
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.chat_template = _pick_chat_template(config.get("chat_template"))
        if self.chat_template is None and (model_dir / "chat_template.jinja").is_file():
            self.chat_template = (model_dir / "chat_template.jinja").read_text()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None and (
                not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of a rendered chat prompt: no second BOS when the template wrote one itself."""
        bos = self.bos_token
        return self.encode(text, add_special_tokens=not (bos and text.startswith(bos)))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def vocab_tokens(self) -> list[str | None]:
        """Every token's vocabulary string (as tokenizer.json spells it), indexed by id; None for gaps."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        tokens: list[str | None] = [None] * (max(vocab.values()) + 1 if vocab else 0)
        for token, token_id in vocab.items():
            tokens[token_id] = token
        return tokens

    def backend_json(self) -> str:
        """The tokenizer.json text (its model, normalizer, pre-tokenizer and decoder)."""
        return self._tok.to_str()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            template: str | None = None, tools: list[dict] | None = None) -> str:
        """Render chat messages to a prompt string with the checkpoint's (or the given) template;
        `tools` (function schemas, as transformers passes them) go to the template as `tools`."""
        template = self._template(template)
        import jinja2

        try:
            return _environment().from_string(template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools or None,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template failed: {exc}", param="messages") from exc

    def template_renders_tools(self, template: str | None = None) -> bool:
        """Whether the chat template reads the `tools` variable at all (else tools would be dropped)."""
        import jinja2.meta

        source = self._template(template)
        return "tools" in jinja2.meta.find_undeclared_variables(_environment().parse(source))

    def _template(self, template: str | None) -> str:
        template = template or self.chat_template
        if not template:
            raise InvalidRequestError("this model has no chat template; pass one with --chat-template "
                                      "or use the completions API", param="messages")
        return template


def _environment():
    """The sandboxed jinja2 environment chat templates run in, with the helpers HF templates call."""
    import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = tojson           # no HTML escaping, as templates written for transformers expect
    return env


def _token_text(token) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _pick_chat_template(template) -> str | None:
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return template


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting multi-byte characters.

    Each step decodes only a short window: the tokens since `prefix_offset` (the last token or two
    already turned into text, kept as context so tokenizers that treat a leading space specially
    decode the same as in the full sequence) against the same window without the new tokens. The
    cost per token stays constant instead of growing with the output.
    """

    tokenizer: Tokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0      # start of the decode window
    read_offset: int = 0        # tokens before this are already in `text`

    def add(self, token_id: int) -> str:
        """Append one token; returns the new text (may be empty while a character is incomplete)."""
        self.token_ids.append(token_id)
        if self.tokenizer is None:
            return ""
        before = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset])
        window = self.tokenizer.decode(self.token_ids[self.prefix_offset:])
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return ""                          # a special token, or a character still incomplete
        delta = window[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta
