"""`moekv eval weights` on a short context of the bundled model (skipped without it)."""

import argparse
import json

import pytest

from moekv.eval import weight_fidelity
from tests.helpers import needs_bundled_model


@needs_bundled_model
def test_eval_weights_writes_the_rows(tmp_path):
    parser = argparse.ArgumentParser()
    weight_fidelity.add_arguments(parser)
    out = tmp_path / "rows.json"
    assert weight_fidelity.run(parser.parse_args(["--context", "96", "--windows", "2", "--chunk", "48",
                                                  "--rows", "fp8,offload-fp8,fp8-w8a8", "--json", str(out)])) == 0
    reference, fp8, offloaded, w8a8 = json.loads(out.read_text())
    assert (reference["weights"], fp8["weights"], offloaded["weights"], w8a8["weights"]) == (
        "bf16", "fp8", "offload-fp8", "fp8-w8a8")
    # W8A8 experts: the same weights, e4m3 activations on top: another change, still small
    assert w8a8["kl"] != fp8["kl"] and 0 < w8a8["kl"] < 0.02 and w8a8["weight_bytes"] == fp8["weight_bytes"]
    # FP8 experts only (offloaded, computed from the FP8 host copies): a change, smaller than all-FP8's
    assert 0 < offloaded["kl"] <= fp8["kl"] and offloaded["top1_agreement"] > 90
    assert fp8["weight_bytes"] < offloaded["weight_bytes"] < reference["weight_bytes"]
    assert reference["kl"] == 0 and reference["ppl_delta_pct"] == 0 and reference["top1_agreement"] == 100
    assert 0 < fp8["kl"] < 0.01 and abs(fp8["ppl_delta_pct"]) < 2 and fp8["top1_agreement"] > 90
    assert fp8["weight_bytes"] < 0.7 * reference["weight_bytes"]


def test_eval_weights_argument_errors():
    from moekv.errors import ConfigError

    parser = argparse.ArgumentParser()
    weight_fidelity.add_arguments(parser)
    with pytest.raises(ConfigError, match="--context"):
        weight_fidelity.run(parser.parse_args(["--context", "1"]))
    with pytest.raises(ConfigError, match="unknown --rows"):
        weight_fidelity.run(parser.parse_args(["--rows", "int4"]))
