"""bench_decode's rows: the scenarios (--scenarios "BxL:kv,kv;..."), their prompts, and the per-row switches.

A per-row switch is an on/off field of the engine's config that bench_decode can run both ways side by side:
`--<name> on,off` runs every moekv row once per value (rows tagged `<name>`: "on" / "off"), `--<name> on` or
`off` runs them one way, no flag keeps the configured default. Every registered switch gets its CLI flag, its
key in each moekv row (what the engine actually ran) and its column in the markdown, from SWITCHES alone.

To add one, append a RowSwitch to SWITCHES: the EngineConfig section and field it sets (the field lives in
src/moekv/config.py like every switch), and, where the engine can end up running something other than the
configured value, how to read what it installed.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import torch

DEFAULT_SCENARIOS = "1x16384:bf16,int3;16x4096:bf16,int3;64x16384:int3"
TINY_SCENARIOS = "1x96:bf16,int3;4x48:bf16,int3;8x64:int3"


def parse_scenarios(text: str) -> list[tuple[int, int, str]]:
    """"1x16384:bf16,int3;64x16384:int3" -> [(1, 16384, "bf16"), (1, 16384, "int3"), (64, 16384, "int3")]."""
    out = []
    for part in filter(None, text.split(";")):
        size, kinds = part.split(":")
        batch, context = (int(v) for v in size.lower().split("x"))
        out += [(batch, context, kind) for kind in kinds.split(",")]
    return out


def prompts(batch: int, context: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`batch` random prompts of `context` tokens (ids 3 .. vocab - 1), the same for moekv and transformers."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, context), generator=gen).tolist()


# ---------------------------------------------------------------- per-row switches
def _fused_decode_layer_installed(engine) -> bool:
    from moekv.ops import dispatch

    return dispatch.fused_decode_layer()        # KernelConfig's fused_decode_layer and fused_layer_ops together


def _attention_combine_installed(engine) -> bool | str:
    from moekv.ops import dispatch

    if engine.config.cache.is_low_bit:
        return "n/a (low-bit)"                  # the v7 low-bit kernel always combines in its own launch
    return dispatch.kernel_config().fused_attention_combine


def _fused_moe_combine_installed(engine) -> bool:
    from moekv.ops import dispatch

    return dispatch.fused_moe_combine()         # KernelConfig's fused_moe_combine, on top of the fused decode layer


def _route_fold_installed(engine) -> bool:
    from moekv.ops import dispatch

    # KernelConfig's fused_route_fold, on top of the fused decode layer; changes nothing for a router that one
    # program per token reads (Mixtral's): those are routed in the add + norm launch either way
    return dispatch.kernel_config().fused_route_fold and dispatch.fused_decode_layer()


def _pdl_installed(engine) -> bool | str:
    import torch

    from moekv.ops import dispatch

    if not dispatch.kernel_config().pdl:
        return False
    from moekv.ops.triton import pdl

    probe = torch.empty(0, device="cuda") if torch.cuda.is_available() else torch.empty(0)
    return True if pdl.launch_kwargs(probe)["USE_PDL"] else "off (needs compute capability >= 9.0 and Triton's PDL)"


def _overlap_installed(engine) -> str:
    if engine.overlap is not None:
        return "on"
    return "off (no graph steps)" if engine.config.device.overlap_decode else "off"


@dataclasses.dataclass(frozen=True)
class RowSwitch:
    """One on/off engine setting run side by side: flag `--<name>`, row key and markdown column `<name>`."""

    name: str
    section: str                                 # the EngineConfig field holding it ("kernels", "scheduler", ...)
    field: str                                   # the boolean field of that section
    help: str
    installed: Callable[[object], bool | str] | None = None   # what the built engine runs (default: the config's
    #                                                         value; a string says more, e.g. "off (no graph steps)")

    @property
    def dest(self) -> str:
        """The argparse attribute of its flag ("attention-combine" -> attention_combine)."""
        return self.name.replace("-", "_")

    def value_of(self, engine) -> str:
        on = self.installed(engine) if self.installed else getattr(getattr(engine.config, self.section), self.field)
        return on if isinstance(on, str) else "on" if on else "off"


SWITCHES: tuple[RowSwitch, ...] = (
    RowSwitch("fusion", "kernels", "fused_decode_layer",
              "on, off or on,off: moekv rows with the fused decode layer (KernelConfig.fused_decode_layer) on / off, "
              "side by side ('' = as configured)", installed=_fused_decode_layer_installed),
    RowSwitch("attention-combine", "kernels", "fused_attention_combine",
              "on, off or on,off: moekv rows whose full-precision decode attention merges its split-K partials inside "
              "the decode launch (KernelConfig.fused_attention_combine) / in a second launch",
              installed=_attention_combine_installed),
    RowSwitch("moe-combine", "kernels", "fused_moe_combine",
              "on, off or on,off: moekv rows with the MoE decode combine summed by the next add + RMSNorm "
              "(KernelConfig.fused_moe_combine; needs the fused decode layer, so 'on' under --fusion off runs off) "
              "on / off", installed=_fused_moe_combine_installed),
    RowSwitch("route-fold", "kernels", "fused_route_fold",
              "on, off or on,off: moekv rows whose routers of several programs per token (Qwen3's E = 128) are routed "
              "in the add + norm + router launch by each token's last program (KernelConfig.fused_route_fold) / by a "
              "second launch; needs the fused decode layer", installed=_route_fold_installed),
    RowSwitch("pdl", "kernels", "pdl",
              "on, off or on,off: moekv rows whose decode-step Triton kernels launch with programmatic dependent "
              "launch (KernelConfig.pdl, ops/triton/pdl.py: each may be scheduled while the one before it finishes) "
              "on / off", installed=_pdl_installed),
    RowSwitch("overlap", "device", "overlap_decode",
              "on, off or on,off: moekv rows with overlapped decode steps (DeviceConfig.overlap_decode, "
              "engine/overlap.py: the host launches step n + 1 before it reads step n) on / off; 'outside' is then "
              "what the host still leaves the GPU idle", installed=_overlap_installed),
)


def switch_values(text: str) -> list[bool]:
    """'' -> [] (as configured), 'on' -> [True], 'off' -> [False], 'on,off' -> [True, False]; else ValueError."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    if any(w not in ("on", "off") for w in words) or len(set(words)) != len(words):
        raise ValueError(f"takes on, off or on,off; got {text!r}")
    return [w == "on" for w in words]


def add_switch_flags(parser) -> None:
    for switch in SWITCHES:
        parser.add_argument(f"--{switch.name}", dest=switch.dest, default="", help=switch.help)


def parse_switch_flags(args, parser) -> dict[str, list[bool]]:
    """{switch name: values to run} for the switches given on the command line (a parser error on bad ones)."""
    chosen = {}
    for switch in SWITCHES:
        try:
            values = switch_values(getattr(args, switch.dest))
        except ValueError as exc:
            parser.error(f"--{switch.name} {exc}")
        if values:
            chosen[switch.name] = values
    return chosen


def switch_settings(chosen: dict[str, list[bool]]) -> list[dict[str, bool]]:
    """Every combination of the chosen switches' values, first switch outermost ([{}] when none is chosen)."""
    names = list(chosen)
    return [dict(zip(names, values)) for values in itertools.product(*(chosen[n] for n in names))]


def apply_switches(config, settings: dict[str, bool] | None):
    """The EngineConfig with each set switch's field replaced (a switch left out keeps its configured value)."""
    by_name = {s.name: s for s in SWITCHES}
    for name, value in (settings or {}).items():
        switch = by_name[name]
        section = dataclasses.replace(getattr(config, switch.section), **{switch.field: value})
        config = dataclasses.replace(config, **{switch.section: section})
    return config


def installed_settings(engine) -> dict[str, str]:
    """{switch name: "on" / "off"} as the built engine runs them, for its row."""
    return {switch.name: switch.value_of(engine) for switch in SWITCHES}
