"""Speculative expert routing: at layer l, guess the experts layers l+1 (and l+2) will route to.

The guess applies the target layer's own router to a hidden state that is already known at layer l
(the residual stream changes slowly from layer to layer):

    source "attn":      x = the residual after layer l's attention (the input of its post_attn_norm),
                        known before layer l's MoE block runs -> copies overlap with that block.
    source "layer_out": x = the residual after all of layer l (including its MoE output): a little
                        more accurate, but only known one MoE block later.
    norm "next":        logits = (x * g_target) W_target^T  with g_target the target layer's
                        post_attn_norm weight. RMSNorm's 1/rms(x) is one positive number per token,
                        which never changes a token's top-k, so it is left out.
    norm "current":     use layer l's own normed hidden (the MoE input) with the target router.
    norm "none":        logits = x W_target^T.

The token embeddings (the residual before layer 0) predict layer 0 (and layer 1 two ahead).

Each token's prediction is its top (top_k + extra_candidates) experts. Recall (the share of routed
(token, expert) pairs that were predicted for that token) is counted per layer and distance in
device tensors; nothing here synchronises with the host. `listeners` receive every prediction
(the offload manager turns them into copies).

Confidence (`margins=True`): each guessed expert also gets its **router probability margin**, from the
target router's softmax over the guess logits with RMSNorm's 1/rms(x) put back (the router's own
probabilities, up to the change of the residual between the layers): for the guess of rank j < top_k,
p_j - p_top_k (how far above the first expert left out), for the extra candidates p_j - p_(top_k - 1)
(<= 0: how far below the cut). The staged prefetch policy (policy.py) issues only guesses above a
margin threshold.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moekv.layers.moe import MoEBlock

SOURCES = ("attn", "layer_out")
NORMS = ("next", "current", "none")

# listener(source_layer, target_layer, distance, predicted_ids [T, P] int64, margins [T, P] float32 or None),
# all on the device
PredictionListener = Callable[[int, int, int, torch.Tensor, "torch.Tensor | None"], None]


def recall_counts(predicted: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    """How many routed (token, expert) pairs were predicted for their token.

    predicted [T, P], routed [T, k] (expert ids) -> 0-dim int64 tensor on their device (no sync).
    """
    hit = (routed.unsqueeze(-1) == predicted.unsqueeze(1)).any(dim=-1)    # [T, k] bool
    return hit.sum()


def recall_counts_by_width(predicted: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    """Routed pairs inside each prefix of the guess: [W] int64, entry w-1 = pairs in the top-w
    (predicted [T, W] most likely first, routed [T, k]; no sync). Entry W-1 equals recall_counts."""
    match = (routed.unsqueeze(-1) == predicted.unsqueeze(1))               # [T, k, W]
    return match.to(torch.int64).cummax(dim=-1).values.sum(dim=(0, 1))      # [W]


def probability_margins(probs: torch.Tensor, ids: torch.Tensor, top_k: int) -> torch.Tensor:
    """Router probability margins of the guesses `ids` [T, W] (most likely first) under `probs` [T, E]:
    rank j < top_k: p_j - p_top_k; rank j >= top_k: p_j - p_(top_k - 1). -> [T, W] float32 (no sync)."""
    chosen = probs.float().gather(1, ids)                                         # [T, W] descending
    sorted_probs = probs.float().topk(min(top_k + 1, probs.shape[1]), dim=-1).values   # [T, k + 1]
    first_out = sorted_probs[:, -1:] if sorted_probs.shape[1] > top_k else torch.zeros_like(sorted_probs[:, :1])
    last_in = sorted_probs[:, top_k - 1:top_k]
    rank = torch.arange(ids.shape[1], device=ids.device)
    return torch.where(rank < top_k, chosen - first_out, chosen - last_in)          # [T, W]


def moe_layer_ids(model: nn.Module) -> list[int]:
    """Indices of the layers whose MLP is a routed MoE block."""
    return [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoEBlock)]


class ExpertPredictor:
    """Predicts upcoming layers' experts from forward hooks on a built MoEForCausalLM.

    Counters (device, int64, [num_layers, lookahead]): `hits[l, d-1]` routed pairs of layer l that
    the prediction made d layers earlier contained; `routed[l, d-1]` routed pairs of layer l that
    had such a prediction. `predicted[l, d-1]` counts predicted pairs (for precision).
    """

    def __init__(self, model: nn.Module, lookahead: int = 1, extra_candidates: int = 0,
                 source: str = "attn", norm: str = "next", margins: bool = False):
        assert lookahead in (1, 2) and source in SOURCES and norm in NORMS and extra_candidates >= 0
        arch = model.arch
        self.model = model
        self.lookahead = lookahead
        self.source = source
        self.norm = norm
        self.margins = margins          # hand listeners the router probability margins of the guesses too
        self._paused = False            # `paused`: hooks detached (guard.PrefetchGuard's "off" steps)
        self.top_k = arch.top_k
        self.width = min(arch.num_experts, arch.top_k + extra_candidates)   # P: experts predicted per token
        # the guess is computed one expert wider than P for statistics only (what recall one more
        # candidate would give); listeners receive the top P
        self.stat_width = min(arch.num_experts, self.width + 1)
        self.moe_layers = set(moe_layer_ids(model))
        device = model.device
        shape = (arch.num_layers, lookahead)
        self.hits = torch.zeros(shape, dtype=torch.int64, device=device)
        self.routed = torch.zeros(shape, dtype=torch.int64, device=device)
        self.predicted = torch.zeros(shape, dtype=torch.int64, device=device)
        self.hits_by_width = torch.zeros(shape + (self.stat_width,), dtype=torch.int64, device=device)
        self.guessed_tokens = torch.zeros(shape, dtype=torch.int64, device=device)   # tokens with a guess
        self.listeners: list[PredictionListener] = []
        self._pending: dict[tuple[int, int], torch.Tensor] = {}   # (target layer, distance) -> [T, P]
        self._handles: list = []
        self._attach()

    def _attach(self) -> None:
        """Register the forward hooks (the embedding predicts layer 0; each layer's norm or output the next)."""
        model = self.model
        self._handles = [model.embed_tokens.register_forward_hook(self._layer_hook(-1))]
        for index, layer in enumerate(model.layers):
            if self.source == "attn":
                hook = layer.post_attn_norm.register_forward_hook(self._norm_hook(index))
            else:
                hook = layer.register_forward_hook(self._layer_hook(index))
            self._handles.append(hook)
            if index in self.moe_layers:
                self._handles.append(layer.mlp.router.register_forward_hook(self._router_hook(index)))

    @property
    def paused(self) -> bool:
        """No hooks, no guesses, no statistics while set (guard.PrefetchGuard's "off" steps): the model runs exactly
        as without a predictor (its fused paths included, which forward hooks would turn off). Between steps."""
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        value = bool(value)
        if value == self._paused:
            return
        self._paused = value
        if value:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._pending.clear()
        else:
            self._attach()

    # -- hooks -----------------------------------------------------------------------------------
    def _norm_hook(self, index: int):
        def hook(module, inputs, output):
            self._on_hidden(index, inputs[0], output)
        return hook

    def _layer_hook(self, index: int):
        def hook(module, inputs, output):
            self._on_hidden(index, output, None)
        return hook

    def _router_hook(self, index: int):
        def hook(module, inputs, output):
            self._on_routed(index, output[1])
        return hook

    def _on_hidden(self, layer: int, residual: torch.Tensor, normed: torch.Tensor | None) -> None:
        """residual [T, H] (and layer's normed MoE input [T, H] for source "attn")."""
        for distance in range(1, self.lookahead + 1):
            target = layer + distance
            if target not in self.moe_layers:
                continue
            wide = self.predict(layer, target, residual, normed)               # [T, <= P + 1] (None: no guess)
            if wide is None:
                continue
            ids = wide[:, :self.width]                                          # [T, P]
            self._pending[(target, distance)] = wide
            margins = self.confidence(layer, target, residual, normed, ids) if self.margins else None
            for listener in self.listeners:
                listener(layer, target, distance, ids, margins)

    def _on_routed(self, layer: int, routed_ids: torch.Tensor) -> None:
        """routed_ids [T, k]: what layer's router chose; compare with the pending predictions."""
        num_pairs = routed_ids.numel()
        for distance in range(1, self.lookahead + 1):
            wide = self._pending.pop((layer, distance), None)
            if wide is None or wide.shape[0] != routed_ids.shape[0]:
                continue
            ids = wide[:, :self.width]                                          # [T, P]
            by_width = recall_counts_by_width(wide, routed_ids)                 # [W]
            self.hits[layer, distance - 1] += by_width[ids.shape[1] - 1]
            self.routed[layer, distance - 1] += num_pairs
            self.predicted[layer, distance - 1] += ids.numel()
            self.hits_by_width[layer, distance - 1, :by_width.shape[0]] += by_width
            self.guessed_tokens[layer, distance - 1] += wide.shape[0]

    # -- the guess (subclasses may replace it, e.g. a routing-trace replay) ------------------------
    def logits(self, layer: int, target: int, residual: torch.Tensor, normed: torch.Tensor | None) -> torch.Tensor:
        """The target router's logits [T, E] on hidden states at `layer` (without RMSNorm's 1/rms(x))."""
        router_weight = self.model.layers[target].mlp.router.weight                # [E, H]
        if self.norm == "current" and normed is not None:
            x = normed                                                              # [T, H]
        elif self.norm == "none":
            x = residual
        else:
            x = residual * self.model.layers[target].post_attn_norm.weight          # [T, H]
        return F.linear(x.to(router_weight.dtype), router_weight)                  # [T, E]

    def predict(self, layer: int, target: int, residual: torch.Tensor,
                normed: torch.Tensor | None) -> torch.Tensor | None:
        """-> predicted expert ids [T, stat_width] int64 for `target` (most likely first; the top P
        are the guess), from hidden states at `layer`."""
        logits = self.logits(layer, target, residual, normed)
        return torch.topk(logits.float(), self.stat_width, dim=-1).indices          # [T, P + 1]

    def confidence(self, layer: int, target: int, residual: torch.Tensor, normed: torch.Tensor | None,
                   ids: torch.Tensor) -> torch.Tensor:
        """Router probability margins [T, P] float32 of the guess `ids` [T, P] (module docstring)."""
        logits = self.logits(layer, target, residual, normed).float()              # [T, E]
        if self.norm != "current" or normed is None:                                # put 1/rms(x) back
            norm = self.model.layers[target].post_attn_norm
            eps = getattr(norm, "eps", 1e-6)
            logits = logits * torch.rsqrt(residual.float().pow(2).mean(-1, keepdim=True) + eps)
        return probability_margins(torch.softmax(logits, dim=-1), ids, self.top_k)

    # -- stats (these read the device counters: call outside the step) ----------------------------
    def reset(self) -> None:
        for counter in (self.hits, self.routed, self.predicted, self.hits_by_width, self.guessed_tokens):
            counter.zero_()

    def recall(self) -> dict:
        """{"per_layer": {distance: [recall or None per layer]}, "overall": {distance: recall}, ...}."""
        hits, routed, predicted, by_width, tokens = (t.detach().cpu() for t in (
            self.hits, self.routed, self.predicted, self.hits_by_width, self.guessed_tokens))
        out = {"experts_predicted_per_token": self.width, "top_k": self.top_k, "lookahead": self.lookahead,
               "source": self.source, "norm": self.norm, "per_layer": {}, "overall": {}, "precision": {},
               "routed_pairs": {}, "by_width": {}}
        for d in range(self.lookahead):
            total, guessed = int(routed[:, d].sum()), int(tokens[:, d].sum())
            width_hits = by_width[:, d].sum(0)                                  # [W]
            # recall and precision had each token been guessed its top-w (w = 1 .. P + 1)
            out["by_width"][d + 1] = {w + 1: {"recall": float(width_hits[w] / total) if total else None,
                                              "precision": float(width_hits[w] / (guessed * (w + 1)))
                                              if guessed else None}
                                      for w in range(width_hits.shape[0])}
        for d in range(self.lookahead):
            h, r, p = hits[:, d], routed[:, d], predicted[:, d]
            out["per_layer"][d + 1] = [float(h[l] / r[l]) if r[l] > 0 else None for l in range(len(r))]
            total = int(r.sum())
            out["overall"][d + 1] = float(h.sum() / total) if total else None
            out["precision"][d + 1] = float(h.sum() / p.sum()) if p.sum() > 0 else None
            out["routed_pairs"][d + 1] = total
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending.clear()
        self._paused = True             # removed for good: `paused = False` would attach again
