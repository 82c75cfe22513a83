"""The model setting names a directory: a Hugging Face layout, a Hugging Face cache entry or
one of its snapshots; `alise model copy` fills a model volume once."""

from __future__ import annotations

import threading
from pathlib import Path

from services.common.models import copy_model, resolve, served_model_id
from services.launcher.admin_cli import _model_copy


def _hf_cache(root: Path) -> Path:
    """The layout huggingface_hub writes: snapshot files are links into blobs/."""
    entry = root / "models--acme--Tiny-Llama-7B"
    (entry / "blobs").mkdir(parents=True)
    (entry / "blobs" / "a1").write_text('{"model_type": "llama"}')
    (entry / "blobs" / "b2").write_text("weights")
    snap = entry / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap / "config.json").symlink_to("../../blobs/a1")
    (snap / "model.safetensors").symlink_to("../../blobs/b2")
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("0123abcd\n")
    return entry


def test_plain_directory_and_cache_snapshot_resolve(tmp_path: Path) -> None:
    plain = tmp_path / "Llama-3-8B-Instruct"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert resolve(str(plain)).hf_dir == plain
    assert served_model_id(str(plain)) == "Llama-3-8B-Instruct"
    entry = _hf_cache(tmp_path)
    snap = entry / "snapshots" / "0123abcd"
    assert resolve(str(snap)).hf_dir == snap
    assert served_model_id(str(snap)) == "Tiny-Llama-7B"  # not the revision hash
    assert resolve(str(entry)).hf_dir == snap  # the entry stands for refs/main
    assert served_model_id(str(entry)) == "Tiny-Llama-7B"


def test_copy_model_once_with_links_followed(tmp_path: Path, capsys) -> None:
    entry = _hf_cache(tmp_path / "cache")
    target = tmp_path / "volume" / "model"
    target.parent.mkdir()
    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda: results.append(copy_model(entry, target))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, False, False, True]  # one copier, the rest wait
    assert not (target / "config.json").is_symlink()
    assert (target / "model.safetensors").read_text() == "weights"
    assert served_model_id(str(target)) == "model"
    assert not (tmp_path / "volume" / ".model.partial").exists()

    class Args:
        source = str(entry)

    Args.target = str(target)  # type: ignore[attr-defined]
    assert _model_copy(Args()) == 0  # type: ignore[arg-type]
    assert "already there" in capsys.readouterr().out


def test_copy_model_refuses_a_non_model(tmp_path: Path) -> None:
    import pytest

    with pytest.raises(FileNotFoundError, match="no config"):
        copy_model(tmp_path, tmp_path / "out")


def test_the_id_needs_no_files(tmp_path: Path) -> None:
    """Schedulers name the model from the setting without mounting its directory; the id is
    the one the services that mount it compute."""
    entry = _hf_cache(tmp_path)
    for path in (entry, entry / "snapshots" / "0123abcd"):
        absent = tmp_path / "elsewhere" / path.relative_to(tmp_path)
        assert served_model_id(str(absent)) == served_model_id(str(path)) == "Tiny-Llama-7B"
    assert served_model_id("/srv/models/Llama-3-8B-Instruct") == "Llama-3-8B-Instruct"
    assert served_model_id("/srv/q/SmolLM2.Q4_1.gguf") == "SmolLM2.Q4_1"
    assert served_model_id("smollm2-135m-instruct") == "smollm2-135m-instruct"
