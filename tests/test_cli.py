"""The CLI's boundary: help everywhere, clear one-line errors (exit 2) instead of tracebacks."""

from __future__ import annotations

import pytest

from moekv.cli import build_parser, main
from tests.helpers import needs_bundled_model


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("generate", "serve", "eval", "bench"):
        assert command in out


@pytest.mark.parametrize("argv", [["generate", "--help"], ["serve", "--help"], ["eval", "kv", "--help"],
                                  ["bench", "serve", "--help"]])
def test_every_command_has_help(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    assert "usage: moekv" in capsys.readouterr().out


def test_missing_model_path_is_a_clear_error(tmp_path, capsys):
    code = main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and "nope" in err and "Traceback" not in err


def test_unknown_kv_cache_dtype_is_a_clear_error(tmp_path, capsys):
    code = main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--kv-cache-dtype", "int9"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown kv_cache_dtype 'int9'" in err


def test_invalid_sampling_parameter_is_a_clear_error(tmp_path, capsys):
    code = main(["generate", "--model", str(tmp_path), "--prompt", "hi", "--temperature", "-1"])
    err = capsys.readouterr().err
    assert code == 2 and "temperature must be a finite number >= 0" in err


def test_parser_builds_without_optional_dependencies():
    assert build_parser().prog == "moekv"


def parser_for(command: list[str]):
    """The CLI parser, skipping the test where `command` needs the serve dependencies and they are missing."""
    parser = build_parser()
    if getattr(parser.parse_args(command), "_missing", None):
        pytest.skip("the serve dependencies are not installed")
    return parser


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_enforce_eager_flag(command):
    parser = parser_for(command)
    assert parser.parse_args(command).enforce_eager is False
    assert parser.parse_args(command + ["--enforce-eager"]).enforce_eager is True


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_prefix_caching_flag_defaults_on(command):
    parser = parser_for(command)
    assert parser.parse_args(command).enable_prefix_caching is True
    assert parser.parse_args(command + ["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parser.parse_args(command + ["--enable-prefix-caching"]).enable_prefix_caching is True


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_offload_flags_of_both_commands(command):
    from moekv.entrypoints.offload_args import offload_kwargs

    parser = parser_for(command)
    defaults = offload_kwargs(parser.parse_args(command))
    assert defaults["prefetch_guard"] is True and defaults["prefetch"] is True and "expert_cache_size" not in defaults
    given = offload_kwargs(parser.parse_args(command + ["--cpu-offload-experts", "--no-prefetch-guard",
                                                        "--expert-cache-size", "4", "--prefetch-threshold", "auto"]))
    assert given["cpu_offload_experts"] and given["prefetch_guard"] is False
    assert given["expert_cache_size"] == "4" and given["prefetch_threshold"] == "auto"


@needs_bundled_model
def test_generate_prints_the_prefetch_guard(capsys):
    assert main(["generate", "--prompt", "ROMEO:", "--max-tokens", "40", "--temperature", "0", "--device", "cpu",
                 "--cpu-offload-experts"]) == 0
    out = capsys.readouterr().out
    assert "prefetch guard (batch 1)" in out and "ms/step with" in out
