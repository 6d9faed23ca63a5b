"""The outlier-correction passes of the token-major decode kernel (ops.triton.lowbit.decode_fix) vs their
references (ops.reference.lowbit_decode_fix); the whole decode with them is in test_lowbit_decode_tm.py
(outliers="passes")."""

from __future__ import annotations

import pytest
import torch

from moekv.ops.reference import lowbit_decode_fix as ref
from moekv.ops.triton.lowbit import decode_fix as fix
from moekv.testing.attention_cases import build_case, to_device
from tests.ops.test_lowbit_decode_tm import plant_outliers

QK_SCALE = 0.125 * 1.4426950408889634
UNSET = 123.0                                   # tiles the passes must not touch keep this


def _case(device, kind="outlier_channels", planted=False, context=(0, 1, 40, 100, 64), page_size=16, group=4,
          sink_pages=1, seed=0):
    case = build_case(list(context), [1] * len(context), 2, group, 64, 3, page_size, dtype=torch.float32, kind=kind,
                      sink_pages=sink_pages, outlier_fraction=0.05, seed=seed)
    if planted:
        plant_outliers(case.key_pages, case.key_spec, seed + 7, 1e3)
        plant_outliers(case.value_pages, case.value_spec, seed + 8, 1e3)
    return to_device(case, device)


def _tiles(case):
    batch, kv_heads = case.meta.context_lens.shape[0], case.key_pages.codes.shape[1]
    group = case.query.shape[1] // kv_heads
    return fix.fix_tiles(batch, kv_heads, case.meta.block_tables.shape[1], case.key_spec.page_size, group,
                         case.query.device).fill_(UNSET)


@pytest.mark.parametrize("kind,planted", [("normal", False), ("outlier_channels", False), ("large", True)])
def test_key_fixes(device, kind, planted):
    """Random outliers, planted ones (a token with an outlier in every channel, a channel at every token,
    counts 0 and the full capacity), residuals up to ~1e3; ragged lengths incl. 0 and 1, a staged sink page."""
    case = _case(device, kind, planted)
    got = fix.key_fixes(case.query, case.key_pages, case.key_spec, case.slot_of_page, case.meta, QK_SCALE,
                        _tiles(case))
    want = ref.key_fixes(case.query, case.key_pages, case.key_spec, case.slot_of_page, case.meta, QK_SCALE,
                         _tiles(case))
    assert (want != UNSET).any() and (want == UNSET).any()          # some tiles written, some left alone
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-5, atol=1e-5)   # fp32 sums, other order


@pytest.mark.parametrize("kind,planted", [("normal", False), ("outlier_channels", False), ("large", True)])
@pytest.mark.parametrize("pages", [1, 4])
def test_value_fixes(device, kind, planted, pages):
    """Scores (finite, -inf for masked tokens) and split lse (one split empty: -inf) from random numbers; one or
    four pages per program."""
    case = _case(device, kind, planted, seed=1)
    gen = torch.Generator().manual_seed(5)
    scores = _tiles(case).cpu()
    scores.copy_(torch.randn(scores.shape, generator=gen) * 4)
    scores[..., 3, :] = float("-inf")                                # a masked token row
    scores = scores.to(case.query.device)
    batch, num_heads, head_dim = case.query.shape
    lse = (torch.randn(batch, num_heads, 3, generator=gen) * 3 + 8).to(case.query.device)
    lse[:, :, 2] = float("-inf")
    group = num_heads // case.key_pages.codes.shape[1]
    got = fix.value_fixes(scores, lse, case.value_pages, case.value_spec, case.slot_of_page, case.meta, PAGES=pages)
    want = ref.value_fixes(scores, lse, case.value_pages, case.value_spec, case.slot_of_page, case.meta, PAGES=pages)
    assert got.shape == want.shape and want.abs().sum() > 0
    torch.testing.assert_close(got.sum(2)[:, :, :group].cpu(), want.sum(2)[:, :, :group].cpu(), rtol=1e-5,
                               atol=1e-5)


def test_no_outlier_capacity_touches_nothing(device):
    case = build_case([40], [1], 2, 4, 64, 3, 16, outlier_fraction=0.0)
    case = to_device(case, device)
    tiles = _tiles(case)
    assert fix.key_fixes(case.query, case.key_pages, case.key_spec, case.slot_of_page, case.meta, QK_SCALE,
                         tiles) is tiles and bool((tiles == UNSET).all())
    assert fix.value_fixes(tiles, torch.zeros(1, 8, 1, device=device), case.value_pages, case.value_spec,
                           case.slot_of_page, case.meta) is None
