"""benchmarks/ab_decode_kernel.py: the baseline kernel module loads from a folder of its own (no build on a CPU)."""

import pathlib
import shutil

import pytest

from benchmarks import ab_decode_kernel
from moekv.ops.cuda import lowbit_decode


def test_baseline_loads_from_its_folder(tmp_path):
    src = pathlib.Path(lowbit_decode.__file__)
    shutil.copy(src, tmp_path / "lowbit_decode.py")
    shutil.copytree(src.with_name("csrc"), tmp_path / "csrc")
    module = ab_decode_kernel.load_baseline(tmp_path)
    assert module is not lowbit_decode
    assert module._CSRC == tmp_path / "csrc"                 # it builds from the baseline's own sources
    assert module.plan_splits(32, 8, 128, 132) == lowbit_decode.plan_splits(32, 8, 128, 132)


def test_needs_a_baseline_folder():
    with pytest.raises(SystemExit):
        ab_decode_kernel.main(["--out", "x"])


def test_parse_shapes():
    assert ab_decode_kernel.parse_shapes("1x16392:3,4; 32X16448 ;") == [(1, 16392, (3, 4)), (32, 16448, (3,))]
    assert ab_decode_kernel.parse_shapes("8x32776:2") == [(8, 32776, (2,))]


@pytest.mark.parametrize("bad", ["16384", "1x:3", "axb"])
def test_bad_shapes_are_refused(bad):
    with pytest.raises(ValueError):
        ab_decode_kernel.parse_shapes(bad)


def test_b_kwargs_must_be_an_object():
    """--b-kwargs: launch arguments for this checkout's kernel (e.g. '{"work_split": true}'), a JSON object."""
    for bad in ("[1]", "not json"):
        with pytest.raises(SystemExit):
            ab_decode_kernel.main(["--a-dir", "x", "--out", "y", "--b-kwargs", bad])
