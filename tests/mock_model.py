"""A weightless stand-in for a model: it drives the KV cache like a real one (every layer stores
and attends), and its logits make the next token `(token + 1) % vocab`, so engine and scheduler
outputs are predictable."""

from __future__ import annotations

import torch

from moekv.config import ArchConfig, CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig


def mock_arch(vocab_size: int = 64, num_layers: int = 2, max_position_embeddings: int = 512,
              eos_token_ids: tuple[int, ...] = ()) -> ArchConfig:
    return ArchConfig(architecture="mock", vocab_size=vocab_size, hidden_size=8, num_layers=num_layers,
                      num_heads=2, num_kv_heads=1, head_dim=4, num_experts=2, top_k=1,
                      expert_intermediate_size=4, norm_topk_prob=False,
                      max_position_embeddings=max_position_embeddings, eos_token_ids=eos_token_ids)


def mock_engine_config(max_model_len: int = 64, page_size: int = 4, num_pages: int = 64, max_num_seqs: int = 8,
                       max_num_batched_tokens: int = 64, **sections) -> EngineConfig:
    """An EngineConfig for a MockModel on the CPU: model "mock", an fp32 KV cache of `num_pages` pages of
    `page_size` tokens; `sections` replace whole EngineConfig fields (e.g. offload=OffloadConfig(...))."""
    return EngineConfig(model=ModelConfig(model="mock", max_model_len=max_model_len),
                        cache=CacheConfig(kv_cache_dtype="fp32", page_size=page_size, num_pages=num_pages),
                        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                  max_num_batched_tokens=max_num_batched_tokens),
                        device=DeviceConfig("cpu"), **sections)


class MockModel(torch.nn.Module):
    def __init__(self, arch: ArchConfig | None = None, dtype=torch.float32):
        super().__init__()
        self.arch = arch or mock_arch()
        self.anchor = torch.nn.Parameter(torch.zeros(1, dtype=dtype), requires_grad=False)
        self.register_buffer("expert_load", torch.zeros(self.arch.num_layers, self.arch.num_experts,
                                                        dtype=torch.long))
        self.forward_calls: list[int] = []   # tokens per forward, for scheduler tests

    def forward(self, input_ids, positions, kv_cache, meta):
        self.forward_calls.append(int(input_ids.shape[0]))
        arch = self.arch
        num_tokens = input_ids.shape[0]
        x = input_ids.to(self.anchor.dtype)
        q = x.view(-1, 1, 1).expand(num_tokens, arch.num_heads, arch.head_dim).contiguous() * 0.01
        k = x.view(-1, 1, 1).expand(num_tokens, arch.num_kv_heads, arch.head_dim).contiguous() * 0.01
        for layer in range(arch.num_layers):
            kv_cache.attention(layer, q, k, k.clone(), meta, 1.0)
        self.expert_load[:, 0] += num_tokens
        return input_ids.view(-1, 1).to(self.anchor.dtype)          # [T, 1]: the token id itself

    def compute_logits(self, hidden):
        ids = hidden[:, 0].round().long()
        logits = torch.full((hidden.shape[0], self.arch.vocab_size), -10.0)
        logits[torch.arange(hidden.shape[0]), (ids + 1) % self.arch.vocab_size] = 10.0
        return logits
