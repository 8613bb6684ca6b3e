"""Hugging Face model directories on the command line: save_pretrained's layouts, made with
safetensors exactly as transformers writes them (weights, shards and index, config.json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_cli import ROOT, assert_error, run, run_here

from dsdmerge.integrations import detect_format, load_checkpoint, read_metadata


def model_sd(layers: int, vocab: int, *, trained: bool = False) -> dict[str, torch.Tensor]:
    """A Llama-like state dict as ``LlamaForCausalLM.state_dict()`` names it."""
    torch.manual_seed(0)
    sd = {"model.embed_tokens.weight": torch.randn(vocab, 8)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for w in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{w}.weight"] = torch.randn(8, 8)
        for w in ("gate_proj", "up_proj", "down_proj"):
            sd[p + f"mlp.{w}.weight"] = torch.randn(8, 8)
        sd[p + "input_layernorm.weight"] = torch.ones(8)
    sd["model.norm.weight"] = torch.ones(8)
    sd["lm_head.weight"] = torch.randn(vocab, 8)
    return {k: v + 1 for k, v in sd.items()} if trained else sd


def save_pretrained(directory: Path, sd: dict[str, torch.Tensor], *, shards: int) -> None:
    """What ``save_pretrained(safe_serialization=True, max_shard_size=...)`` writes."""
    directory.mkdir()
    (directory / "config.json").write_text(
        json.dumps({"model_type": "llama", "vocab_size": sd["lm_head.weight"].shape[0]})
    )
    (directory / "generation_config.json").write_text("{}")
    if shards == 1:
        save_file(sd, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    keys = list(sd)
    per = -(-len(keys) // shards)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k] for k in keys[i * per : (i + 1) * per]}
        save_file(part, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    total = sum(v.numel() * v.element_size() for v in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf")
    save_pretrained(d / "old", model_sd(2, 10, trained=True), shards=3)  # the checkpoint
    save_pretrained(d / "new", model_sd(3, 12), shards=4)  # a layer more, a larger vocabulary
    save_pretrained(d / "single", model_sd(2, 10, trained=True), shards=1)
    return d


def test_formats_and_views(hf):
    for path in (hf / "old", hf / "old" / "model.safetensors.index.json", hf / "single"):
        assert detect_format(path) == "hf"
    view = read_metadata(hf / "old")
    assert view.format == "hf"
    assert set(view) == set(model_sd(2, 10))
    assert view.metadata["format"] == "pt"
    assert json.loads(view.metadata["total_size"]) == view.nbytes
    assert read_metadata(hf / "old", key="model").keys() == {
        k.removeprefix("model.") for k in model_sd(2, 10) if k.startswith("model.")
    }
    loaded = load_checkpoint(hf / "old" / "model.safetensors.index.json")
    for key, value in model_sd(2, 10, trained=True).items():
        assert torch.equal(loaded[key], value), key


@pytest.mark.parametrize("target", ["old", "old/model.safetensors.index.json", "single"])
def test_inspect_reads_headers_only(hf, target, tmp_path):
    proc = run_here("inspect", str(hf / target), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["format"] == "hf"
    assert report["keys"] == report["tensors"] == len(model_sd(2, 10))
    assert report["bytes"] == sum(v.numel() * 4 for v in model_sd(2, 10).values())
    assert {
        "pattern": "model.layers.{0,1}.mlp.{down_proj,gate_proj,up_proj}.weight",
        "count": 6,
    } in (report["patterns"])
    assert report["metadata"]["format"] == "pt"


def test_diff_and_check_between_hf_directories(hf):
    proc = run_here("diff", str(hf / "old"), str(hf / "new"), "--json")
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert sorted(report["missing"]) == sorted(k for k in model_sd(3, 12) if ".layers.2." in k)
    assert {m["key"] for m in report["mismatched"]} == {
        "model.embed_tokens.weight",
        "lm_head.weight",
    }
    assert report["changed"] == []
    proc = run_here(
        "check",
        str(hf / "old"),
        str(hf / "new" / "model.safetensors.index.json"),
        "--policy",
        "strict",
        "--allow-missing",
        "model.layers.2.*",
        "--on-shape-mismatch",
        "resize",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "policy 'strict' accepts the merge" in proc.stdout


def test_merge_writes_the_checkpoints_sharded_layout(hf, tmp_path):
    out = tmp_path / "merged"
    args = [str(hf / "old"), str(hf / "new"), "-o", str(out), "--on-shape-mismatch", "resize"]
    proc = run("merge", *args)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out} (hf, " in proc.stdout
    old_index = json.loads((hf / "old" / "model.safetensors.index.json").read_text())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(old_index["weight_map"].values()))
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*shards, "model.safetensors.index.json", "config.json", "generation_config.json"]
    )
    # the checkpoint's keys stay in their shards; the new layer goes into the last one
    for key, shard in index["weight_map"].items():
        assert shard == old_index["weight_map"].get(key, shards[-1]), key
    # the index is correct: every key in the shard it names, total_size the tensor bytes
    merged = {}
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                assert index["weight_map"][key] == shard
                merged[key] = f.get_tensor(key)
    assert set(merged) == set(index["weight_map"]) == set(model_sd(3, 12))
    assert index["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for v in merged.values()
    )
    # the config is the reference's (the model you have now): vocab 12
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 12
    trained = model_sd(2, 10, trained=True)
    assert torch.equal(merged["lm_head.weight"][:10], trained["lm_head.weight"])
    assert torch.equal(
        merged["model.layers.2.mlp.up_proj.weight"],
        model_sd(3, 12)["model.layers.2.mlp.up_proj.weight"],
    )
    # what dsdmerge wrote, it reads back as the reference's keys and shapes
    assert run_here("diff", str(out), str(hf / "new"), "--ignore-values").returncode == 0
    # --force replaces an HF directory it wrote, and nothing else
    proc = run_here("merge", *args)
    assert_error(proc, "--force")
    assert run_here("merge", *args, "--force").returncode == 0
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"")
    (junk / "notes.docx").write_bytes(b"precious")
    proc = run_here(
        "merge",
        str(hf / "old"),
        str(hf / "new"),
        "-o",
        str(junk),
        "--force",
        "--on-shape-mismatch",
        "resize",
    )
    assert_error(proc, "notes.docx", "nothing was replaced")
    assert (junk / "notes.docx").read_bytes() == b"precious"


def test_merge_unsharded_and_into_other_formats(hf, tmp_path):
    out = tmp_path / "single_out"
    proc = run_here("merge", str(hf / "single"), str(hf / "single"), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert set(load_file(str(out / "model.safetensors"))) == set(model_sd(2, 10))
    # into a torch file (the name says so) and, with --format, a DCP directory
    proc = run_here("merge", str(hf / "old"), str(hf / "old"), "-o", str(tmp_path / "m.pt"))
    assert proc.returncode == 0, proc.stderr
    assert set(torch.load(tmp_path / "m.pt", weights_only=True)) == set(model_sd(2, 10))
    proc = run_here(
        "merge", str(hf / "old"), str(hf / "old"), "-o", str(tmp_path / "dcp"), "--format", "dcp"
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "dcp" / ".metadata").is_file()
    # a torch checkpoint merged into an HF directory (--format hf): one model.safetensors
    torch.save(model_sd(2, 10), tmp_path / "plain.pt")
    proc = run_here(
        "merge",
        str(tmp_path / "plain.pt"),
        str(hf / "single"),
        "-o",
        str(tmp_path / "as_hf"),
        "--format",
        "hf",
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "as_hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


def test_bad_hf_directories_are_refused_naming_the_problem(hf, tmp_path):
    import shutil

    empty = tmp_path / "empty"
    empty.mkdir()
    assert_error(run_here("inspect", str(empty)), "empty", ".metadata", "model.safetensors")
    # an index whose shard is missing (an incomplete download)
    partial = tmp_path / "partial"
    shutil.copytree(hf / "old", partial)
    (partial / "model-00002-of-00003.safetensors").unlink()
    assert_error(run_here("inspect", str(partial)), "model-00002-of-00003.safetensors")
    # an index naming a file outside the directory
    outside = tmp_path / "outside"
    shutil.copytree(hf / "old", outside)
    index = json.loads((outside / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "../old/model-00003-of-00003.safetensors"
    (outside / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_error(run_here("diff", str(outside), str(hf / "new")), "not a file name inside")
    # an index that disagrees with the shards' headers
    moved = tmp_path / "moved"
    shutil.copytree(hf / "old", moved)
    index = json.loads((moved / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00003.safetensors"
    (moved / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_error(run_here("inspect", str(moved)), "lm_head.weight", "not where")
    # not JSON
    broken = tmp_path / "broken"
    shutil.copytree(hf / "old", broken)
    (broken / "model.safetensors.index.json").write_text("{")
    assert_error(run_here("inspect", str(broken)), "not valid JSON")


def test_hub_cache_symlinks_are_followed(hf, tmp_path):
    """The hub cache's snapshots link every file to a blob outside the snapshot."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted((hf / "old").iterdir())):
        blob = blobs / f"blob{i}"
        blob.write_bytes(f.read_bytes())
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    proc = run_here("diff", str(snapshot), str(hf / "old"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_inspect_of_safetensors_and_hf_never_imports_torch(hf, tmp_path):
    save_file({"w": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    code = (
        "import sys\n"
        "from dsdmerge.cli import main\n"
        "for path in sys.argv[1:]:\n"
        "    assert main(['inspect', path, '--stat']) == 0\n"
        "assert main(['inspect', sys.argv[1], '--only', 'w']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "w.safetensors"), str(hf / "old")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, dsdmerge.cli; dsdmerge.cli.build_parser(); "
            "assert 'torch' not in sys.modules",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
