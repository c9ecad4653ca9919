"""The embedded tiny models: written once per content into the user's cache."""
from __future__ import annotations

import json
import os
import tempfile

from vllm_kvguard.tools.tiny_models import MODELS, write_model


def test_the_embedded_models_share_one_cached_directory_and_leave_no_temp_dir(tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    first, second = write_model("llama"), write_model("llama")
    assert first == second and first.startswith(str(tmp_path / "cache"))
    with open(os.path.join(first, "config.json")) as fh:
        assert json.load(fh) == MODELS["llama"]
    assert write_model("nemotron_h") != first
    assert list(temp.iterdir()) == []          # nothing left in the temp dir
    assert os.listdir(first) == ["config.json"]


def test_an_unwritable_cache_falls_back_to_a_temp_dir(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")                     # a file where the cache dir should be
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = write_model("llama")
    assert path.startswith(str(tmp_path / "kvguard-llama-"))
    with open(os.path.join(path, "config.json")) as fh:
        assert json.load(fh) == MODELS["llama"]
