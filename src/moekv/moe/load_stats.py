"""Expert load statistics: routed token-slots per expert and layer, hot and cold experts.

The model counts routed slots in `expert_load [L, E]` (int64, on the device, since start or the last
reset). `ExpertLoadTracker` adds an exponentially decayed window over steps (recent load, what an
expert-parallel balancer should act on). The functions below take any [L, E] or [E] load tensor.
"""

from __future__ import annotations

import torch


def _as_2d(load: torch.Tensor) -> torch.Tensor:
    return load.unsqueeze(0) if load.dim() == 1 else load                  # [L, E]


def _new_slots(current: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Slots counted since `last` (an element below `last` was reset: all of it is new)."""
    return torch.where(current >= last, current - last, current)


def hot_experts(load: torch.Tensor, k: int) -> torch.Tensor:
    """The k most loaded experts of each layer, most loaded first (ties: lower id first).

    load [L, E] (or [E]) -> int64 ids [L, k] (or [k]).
    """
    rows = _as_2d(load).double()                                           # [L, E]
    k = min(k, rows.shape[1])
    ids = torch.argsort(-rows, dim=1, stable=True)[:, :k]                  # [L, k]
    return ids[0] if load.dim() == 1 else ids


def cold_experts(load: torch.Tensor, k: int) -> torch.Tensor:
    """The k least loaded experts of each layer, least loaded first (ties: lower id first)."""
    rows = _as_2d(load).double()                                           # [L, E]
    k = min(k, rows.shape[1])
    ids = torch.argsort(rows, dim=1, stable=True)[:, :k]                   # [L, k]
    return ids[0] if load.dim() == 1 else ids


def load_share(load: torch.Tensor) -> torch.Tensor:
    """Each expert's share of its layer's routed slots (rows sum to 1; all-zero rows stay 0)."""
    rows = _as_2d(load).double()                                           # [L, E]
    share = rows / rows.sum(dim=1, keepdim=True).clamp_min(1e-12)
    return share[0] if load.dim() == 1 else share


def load_imbalance(load: torch.Tensor) -> torch.Tensor:
    """max / mean load per layer: 1.0 is perfectly balanced, E means one expert takes everything.

    Layers with no routed slots report 1.0. load [L, E] -> float64 [L].
    """
    rows = _as_2d(load).double()                                           # [L, E]
    mean = rows.mean(dim=1)                                                # [L]
    ratio = torch.where(mean > 0, rows.max(dim=1).values / mean.clamp_min(1e-12), torch.ones_like(mean))
    return ratio


class ExpertLoadTracker:
    """A decayed window over a cumulative load counter: window = decay * window + (new slots).

    `update()` runs on the device without host synchronisation (call it once per step, e.g. from a
    forward pre-hook; a CUDA-graph step captures its device half, `fold()`, and counts `steps` on the host);
    read with `snapshot()` outside the step. A reset of the source counter
    (model.reset_expert_load()) is detected per element and counted as a fresh start.
    """

    def __init__(self, expert_load: torch.Tensor, decay: float = 0.99):
        self.source = expert_load                                          # [L, E] int64, cumulative
        self.decay = decay
        self.window = torch.zeros(expert_load.shape, dtype=torch.float32, device=expert_load.device)   # [L, E]
        self._last = expert_load.detach().clone()                          # [L, E]
        self.steps = 0

    def update(self) -> None:
        self.fold()
        self.steps += 1

    def fold(self, live: torch.Tensor | None = None) -> None:
        """The device half of update(): the slots routed since the last fold into the window. Device ops only,
        no host state, so a CUDA-graph decode step captures it (engine/cuda_graphs.py); the host half is the
        `steps` count. live [1] int64 (a graph step's first token-valid entry): when given, a step of padding
        rows only (live 0: an idle rank's collective step) leaves the window undecayed, as a step that runs no
        pre-hook would."""
        current = self.source.detach()
        delta = _new_slots(current, self._last)                                     # [L, E]
        decay = self.decay if live is None else torch.where(live > 0, self.decay, 1.0)   # float or [1]
        self.window.mul_(decay).add_(delta.float())
        self._last.copy_(current)

    def snapshot(self, k: int = 2) -> dict:
        """Cumulative and windowed load, shares, hot / cold experts (k each) and imbalance per layer."""
        total = self.source.detach().cpu()
        window = self.window.detach().cpu()
        window_now = window * self.decay + _new_slots(total, self._last.cpu()).float()   # include the last step
        return {
            "total": total.tolist(),
            "window": [[round(v, 3) for v in row] for row in window_now.tolist()],
            "window_decay": self.decay,
            "share": [[round(v, 5) for v in row] for row in load_share(total).tolist()],
            "hot_experts": hot_experts(window_now, k).tolist(),
            "cold_experts": cold_experts(window_now, k).tolist(),
            "imbalance": [round(v, 4) for v in load_imbalance(total).tolist()],
            "steps": self.steps,
        }
