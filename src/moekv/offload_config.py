"""Expert offloading switches (OffloadConfig) and the expert-cache size spelling; re-exported by config.py."""

from __future__ import annotations

from dataclasses import dataclass

from moekv.errors import ConfigError

EVICTION_POLICIES = ("lru", "lfu")
HOST_FORMATS = ("native", "fp8")
STAGING_MODES = ("host", "device")
PREFETCH_GATES = ("measured", "estimate")
_CACHE_SIZE_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_expert_cache_size(value: int | str | None) -> tuple[str, float] | None:
    """expert_cache_size -> ("slots", n per MoE layer) | ("share", fraction of each layer's experts)
    | ("bytes", total device bytes for expert slots), or None (the default share, 50%).

    Accepted: a positive int (slots per MoE layer), "4" (the same), "50%", "12GB" / "12GiB" / "512MB".
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"expert_cache_size must be an int, a percentage or a size in GB/GiB, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"expert_cache_size must be at least 1 expert slot per layer, got {value!r}")
        return ("slots", float(value))
    text = str(value).strip().lower().replace(" ", "")
    try:
        if text.isdigit():
            return parse_expert_cache_size(int(text))
        if text.endswith("%"):
            share = float(text[:-1]) / 100.0
            if not 0.0 < share <= 1.0:
                raise ValueError
            return ("share", share)
        unit = next(u for u in sorted(_CACHE_SIZE_UNITS, key=len, reverse=True) if text.endswith(u))
        size = float(text[:-len(unit)]) * _CACHE_SIZE_UNITS[unit]
        if size <= 0:
            raise ValueError
        return ("bytes", size)
    except (ValueError, StopIteration):
        raise ConfigError(f"expert_cache_size {value!r} is not understood; give slots per MoE layer (4), a share of "
                          f"each layer's experts (50%) or device bytes for all expert slots (12GB, 12GiB)") from None


def parse_prefetch_threshold(text: str | None) -> float | str | None:
    """The --prefetch-threshold spelling: "auto", a margin ("0.1"), or "none" / None (every guess copied)."""
    if text is None or str(text).strip().lower() == "none":
        return None
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"--prefetch-threshold takes auto, none or a router probability margin in [-1, 1], "
                          f"got {text!r}") from None


OFFLOAD_FLAGS_HELP = {
    "prefetch_threshold": "with --cpu-offload-experts: staged prefetch, only guesses whose router probability margin "
                          "clears this (auto: from the measured copy / compute ratio; none: copy every guess, the "
                          "default)",
    "host_format": "with --cpu-offload-experts: host copies of the experts in the model's dtype (native) or FP8 "
                   "(half the bytes to copy)",
    "cpu_compute_fraction": "with --cpu-offload-experts: compute this share (in [0, 1), 0 = off) of each expert "
                            "missed at decode (at most 4 rows) on the CPU from its host copy and copy only the rest "
                            "(16-bit host experts, host staging, no --prefetch-threshold; docs/expert-offload.md)",
    "prefetch_guard": "with --cpu-offload-experts: keep prefetch on only while decode steps measure faster with it "
                      "than loading on demand (windows of steps alternate; default on)",
    "expert_staging": "with --cpu-offload-experts: host (one host read of routing per layer) or device (slot table "
                      "and copies on the device: decode replays CUDA graphs; loads on demand)",
}


@dataclass(frozen=True)
class OffloadConfig:
    """Expert offloading to host memory with a bounded device expert cache, and expert prediction.

    The cache is per MoE layer (every layer gets the same number of slots; see docs/expert-offload.md).
    """

    cpu_offload_experts: bool = False   # keep routed experts in host memory, a device cache of slots per layer
    expert_cache_size: int | str | None = None   # slots per MoE layer (int), "50%" of each layer's experts, or
                                        # "12GB"/"12GiB" of device memory for all slots; None: 50%
    prefetch: bool = True               # stage predicted experts ahead (offloading); False: load on demand only
    lookahead: int = 1                  # predict the experts of the next 1 or 2 layers
    extra_candidates: int = 0           # experts predicted per token beyond top_k (higher recall, more copies)
    eviction: str = "lru"               # expert-cache eviction: lru | lfu (predicted experts are protected)
    track_prediction: bool = False      # run the predictor for recall statistics even without offloading
    load_decay: float = 0.99            # per-step decay of the windowed expert load (routing_stats)
    prefetch_threshold: float | str | None = None   # None: copy every guess into the slot it evicts (the first
                                        # prefetch); a router probability margin in [-1, 1] or "auto": the staged
                                        # policy (guesses in staging slots, only in idle copy time, never evicting)
    staging_slots: int = 2              # staged policy: device slots for guesses in flight (shared by all layers)
    prefetch_gate: str = "measured"     # staged policy, how much copy time guesses may take: measured (per layer,
                                        # from CUDA events: the copy stream's window, guess chunks' cost per byte,
                                        # halved on overruns) | estimate (session 19's host-clock estimate)
    host_format: str = "native"         # host copies of the experts: native (the model's dtype) | fp8 (e4m3 with
                                        # per-channel scales: half the bytes to move; FP8 models stay as they are)
    staging: str = "host"               # host: one host read of routing per layer | device: slot table and copies
                                        # on the device, no host reads (CUDA-graph capturable; loads on demand)
    prefetch_guard: bool = True         # prefetch stays on only while decode steps measure faster with it than
                                        # loading on demand (alternating windows, per batch size: guard.py)
    cpu_compute_fraction: float = 0.0   # 0: off. f in (0, 1): a decode miss (<= 4 rows) is split: the CPU computes
                                        # f of its intermediate channels from the host copy while only the other
                                        # 1 - f are copied and computed on the device; not made resident
                                        # (moe/prefetch/cpu_split.py; host staging, native host experts only)

    def __post_init__(self) -> None:
        parse_expert_cache_size(self.expert_cache_size)
        threshold = self.prefetch_threshold
        if threshold is not None and threshold != "auto" and (
                isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not -1.0 <= threshold <= 1.0):
            raise ConfigError(f"prefetch_threshold must be None, 'auto' or a router probability margin in [-1, 1], "
                              f"got {threshold!r}")
        if not isinstance(self.staging_slots, int) or isinstance(self.staging_slots, bool) or self.staging_slots < 1:
            raise ConfigError(f"staging_slots must be an integer >= 1, got {self.staging_slots!r}")
        if self.prefetch_gate not in PREFETCH_GATES:
            raise ConfigError(f"prefetch_gate must be one of {PREFETCH_GATES}, got {self.prefetch_gate!r}")
        if self.host_format not in HOST_FORMATS:
            raise ConfigError(f"host_format must be one of {HOST_FORMATS}, got {self.host_format!r}")
        if self.staging not in STAGING_MODES:
            raise ConfigError(f"staging must be one of {STAGING_MODES}, got {self.staging!r}")
        if self.staging == "device" and threshold is not None:
            raise ConfigError("staging='device' loads experts on demand; its guesses are not implemented yet, so "
                              "prefetch_threshold needs staging='host'")
        if not isinstance(self.prefetch_guard, bool):
            raise ConfigError(f"prefetch_guard must be True or False, got {self.prefetch_guard!r}")
        fraction = self.cpu_compute_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction < 1.0:
            raise ConfigError(f"cpu_compute_fraction must be a number in [0, 1) (0: off), got {fraction!r}")
        if fraction > 0 and self.staging != "host":
            raise ConfigError("cpu_compute_fraction needs staging='host' (the CPU half reads the token's hidden "
                              "state on the host); staging='device' keeps everything on the device")
        if fraction > 0 and self.host_format != "native":
            raise ConfigError("cpu_compute_fraction splits 16-bit host experts only; not with host_format='fp8'")
        if fraction > 0 and threshold is not None:
            raise ConfigError("cpu_compute_fraction is not combined with the staged prefetch policy yet; "
                              "leave prefetch_threshold None")
        if self.lookahead not in (1, 2):
            raise ConfigError(f"lookahead must be 1 or 2 layers, got {self.lookahead!r}")
        if not isinstance(self.extra_candidates, int) or isinstance(self.extra_candidates, bool) \
                or self.extra_candidates < 0:
            raise ConfigError(f"extra_candidates must be an integer >= 0, got {self.extra_candidates!r}")
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(f"eviction must be one of {EVICTION_POLICIES}, got {self.eviction!r}")
        if not 0.0 < self.load_decay <= 1.0:
            raise ConfigError(f"load_decay must be in (0, 1], got {self.load_decay!r}")

    @property
    def prefetches(self) -> bool:
        """Whether offloaded experts are prefetched from predictions (host staging only)."""
        return self.cpu_offload_experts and self.prefetch and self.staging == "host"

    @property
    def predicts(self) -> bool:
        """Whether the expert predictor runs (prefetching needs it; stats may ask for it alone)."""
        return self.track_prediction or self.prefetches
