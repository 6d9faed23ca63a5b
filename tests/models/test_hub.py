"""Model ids resolved from a fake local Hugging Face cache (never a download)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from moekv.errors import ConfigError, ModelLoadError
from moekv.models.hub import resolve_model_dir
from moekv.paths import default_model_dir

MAIN, V2 = "a" * 40, "b" * 40


def fake_cache(root: Path, repo_id: str = "org/tiny-moe", link_model: bool = False) -> Path:
    """The hub cache layout: models--org--name/{refs/main, refs/v2, snapshots/<hash>/...}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(V2)
    for commit in (MAIN, V2):
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        if link_model:
            for file in Path(default_model_dir()).iterdir():
                os.symlink(file, snapshot / file.name)
        else:
            (snapshot / "config.json").write_text(f'{{"revision": "{commit[:1]}"}}')
    return repo


@pytest.fixture()
def clean_hf_env(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))   # the default cache is under a fresh home
    return monkeypatch


def test_folder_is_returned_as_given(tmp_path, clean_hf_env):
    assert resolve_model_dir(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ConfigError, match="is a local folder"):
        resolve_model_dir(str(tmp_path), revision="main")


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME", "default"])
def test_id_resolves_in_the_cache_the_environment_names(tmp_path, clean_hf_env, variable):
    if variable == "HF_HUB_CACHE":
        cache = tmp_path / "custom-cache"
        clean_hf_env.setenv("HF_HUB_CACHE", str(cache))
    elif variable == "HF_HOME":
        clean_hf_env.setenv("HF_HOME", str(tmp_path / "hf"))
        cache = tmp_path / "hf" / "hub"
    else:
        cache = tmp_path / "home" / ".cache" / "huggingface" / "hub"
    repo = fake_cache(cache)
    assert Path(resolve_model_dir("org/tiny-moe")) == repo / "snapshots" / MAIN


def test_revision_branch_and_commit(tmp_path, clean_hf_env):
    repo = fake_cache(tmp_path / "c")
    clean_hf_env.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert Path(resolve_model_dir("org/tiny-moe", revision="v2")) == repo / "snapshots" / V2
    assert Path(resolve_model_dir("org/tiny-moe", revision=MAIN)) == repo / "snapshots" / MAIN
    with pytest.raises(ModelLoadError, match="at revision 'v9'"):
        resolve_model_dir("org/tiny-moe", revision="v9")


def test_download_dir_overrides_the_environment(tmp_path, clean_hf_env):
    repo = fake_cache(tmp_path / "dl")
    clean_hf_env.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert Path(resolve_model_dir("org/tiny-moe", download_dir=str(tmp_path / "dl"))) == repo / "snapshots" / MAIN


def test_missing_id_names_the_folders_searched(tmp_path, clean_hf_env):
    clean_hf_env.setenv("HF_HOME", str(tmp_path / "hf"))
    clean_hf_env.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as info:
        resolve_model_dir("Qwen/Qwen3-30B-A3B")
    message = str(info.value)
    assert str(tmp_path / "hf" / "hub") in message and "(HF_HOME)" in message
    assert "never downloads (HF_HUB_OFFLINE is set)" in message and "huggingface-cli download Qwen/Qwen3-30B-A3B" in message


@pytest.mark.parametrize("name", ["./nope", "/abs/nope", "a/b/c", "bad name!"])
def test_paths_that_are_not_ids_say_no_such_folder(name, clean_hf_env):
    with pytest.raises(ModelLoadError, match="no such folder"):
        resolve_model_dir(name)


def test_llm_loads_a_cached_id_with_a_separate_tokenizer(tmp_path, clean_hf_env):
    from moekv import LLM, SamplingParams

    fake_cache(tmp_path / "c", "org/tiny-moe", link_model=True)
    clean_hf_env.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    llm = LLM("org/tiny-moe", tokenizer=default_model_dir(), device="cpu", max_model_len=128, num_pages=8, max_num_seqs=2,
              max_num_batched_tokens=64)
    assert llm.engine.config.model.model.endswith(MAIN)
    assert llm.engine.config.model.tokenizer == default_model_dir()
    reference = LLM(default_model_dir(), device="cpu", max_model_len=128, num_pages=8, max_num_seqs=2, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=8, temperature=0)
    assert llm.generate("ROMEO:", params)[0].outputs[0].token_ids == \
        reference.generate("ROMEO:", params)[0].outputs[0].token_ids
