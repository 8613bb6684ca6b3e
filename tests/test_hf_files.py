"""Hugging Face directories from elsewhere: nothing outside the checkpoint is copied into OUT,
``--force`` replaces only what dsdmerge writes, OUT reads back (by dsdmerge and by
transformers), and a directory is read as transformers reads it. Each attacker's directory is
built here; the victim must survive and never reach OUT; the CLI's exit code and one-line
message are checked."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import hostile_files as hf
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_cli import assert_error, run_here

import dsdmerge as dm
from dsdmerge.integrations import load_checkpoint, read_metadata
from dsdmerge.integrations.writing import HFPlan, is_hf_file

SECRET = "AWS_SECRET_ACCESS_KEY=hunter2-do-not-leak"


def sd(scale: float = 1.0, layers: int = 2) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    out = {f"model.layers.{i}.w": torch.randn(4, 4) * scale for i in range(layers)}
    out["lm_head.weight"] = torch.randn(8, 4) * scale
    return out


def hf_dir(path: Path, state: dict[str, torch.Tensor], *, shards: int = 1) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if shards == 1:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    keys = list(state)
    per = -(-len(keys) // shards)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in keys[i * per : (i + 1) * per]}
        save_file(part, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def no_secret_under(root: Path, *, but: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and path != but:
            assert SECRET.encode() not in path.read_bytes(), path


@pytest.fixture
def victim(tmp_path) -> Path:
    v = tmp_path / "home" / ".ssh" / "id_rsa"
    v.parent.mkdir(parents=True)
    v.write_text(SECRET)
    return v


# -- nothing from outside the checkpoint --------------------------------------------------


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer.model", "config.json"])
@pytest.mark.parametrize("side", ["reference", "checkpoint"])
def test_a_small_file_linked_out_of_the_directory_is_refused_by_name(tmp_path, victim, name, side):
    ckpt = hf_dir(tmp_path / "ckpt", sd(2.0))
    ref = hf_dir(tmp_path / "ref", sd())
    attacked = ref if side == "reference" else ckpt
    (attacked / name).unlink(missing_ok=True)
    (attacked / name).symlink_to(os.path.relpath(victim, attacked))
    if side == "checkpoint":  # small files come from the reference when it is a directory
        ref = tmp_path / "ref.pt"
        torch.save(sd(), ref)
    out = tmp_path / "out"
    proc = run_here("merge", str(ckpt), str(ref), "-o", str(out))
    assert_error(proc, name, "outside the directory", "nothing was written")
    assert not out.exists()
    assert victim.read_text() == SECRET
    no_secret_under(tmp_path, but=victim)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_proc_self_environ_never_reaches_out(tmp_path):
    """The environment (tokens, cloud keys) of the process, through a link to /proc."""
    ckpt = hf_dir(tmp_path / "ckpt", sd(2.0))
    ref = hf_dir(tmp_path / "ref", sd())
    (ref / "generation_config.json").symlink_to("/proc/self/environ")
    out = tmp_path / "out"
    proc, _ = hf.run_cli_bounded(
        "merge", str(ckpt), str(ref), "-o", str(out), seconds=60, env={"LEAKED_TOKEN": SECRET}
    )
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "generation_config.json" in line, line
    assert "/proc/" in line, line
    assert not out.exists()
    no_secret_under(tmp_path, but=tmp_path / "none")


def test_links_inside_the_directory_and_into_the_hub_cache_are_copied(tmp_path):
    ckpt = hf_dir(tmp_path / "ckpt", sd(2.0))
    ref = hf_dir(tmp_path / "ref", sd())
    (ref / "tokenizer.json").write_text('{"real": 1}')
    (ref / "tokenizer_config.json").symlink_to("tokenizer.json")  # inside: fine
    out = tmp_path / "out"
    proc = run_here("merge", str(ckpt), str(ref), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "tokenizer_config.json").read_text() == '{"real": 1}'
    assert not (out / "tokenizer_config.json").is_symlink()
    # the hub cache: models--org--name/snapshots/<rev>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "models--org--name"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(ref.iterdir())):
        (blobs / f"blob{i}").write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(os.path.relpath(blobs / f"blob{i}", snapshot))
    out2 = tmp_path / "out2"
    proc = run_here("merge", str(ckpt), str(snapshot), "-o", str(out2))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out2 / "config.json").read_text()) == {"model_type": "llama"}
    # ... but a snapshot's link out of its repository's blobs is refused
    (snapshot / "generation_config.json").symlink_to(os.path.relpath(tmp_path, snapshot))
    assert_error(run_here("merge", str(ckpt), str(snapshot), "-o", str(tmp_path / "o3")))


def test_a_fifo_or_a_directory_as_a_small_file_is_refused_without_blocking(tmp_path):
    ckpt = hf_dir(tmp_path / "ckpt", sd(2.0))
    ref = hf_dir(tmp_path / "ref", sd())
    os.mkfifo(ref / "tokenizer.model")  # opening it to copy would block for a writer
    (ref / "vocab.json").mkdir()
    proc, seconds = hf.run_cli_bounded(
        "merge", str(ckpt), str(ref), "-o", str(tmp_path / "out"), seconds=60
    )
    assert proc.returncode == 2, proc.stderr
    assert "tokenizer.model" in proc.stderr
    assert "not a regular file" in proc.stderr
    assert seconds < 60


def test_only_the_listed_small_files_are_copied(tmp_path):
    ckpt = hf_dir(tmp_path / "ckpt", sd(2.0))
    ref = hf_dir(tmp_path / "ref", sd())
    for name in ("train.py", "notes.md", "README.md", "secrets.txt", "adapter_config.json"):
        (ref / name).write_text("not a model file")
    (ref / "modeling_llama_custom.py").write_text("# the model's own code")
    out = tmp_path / "out"
    assert run_here("merge", str(ckpt), str(ref), "-o", str(out)).returncode == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "modeling_llama_custom.py",
    ]


# -- --force replaces only what dsdmerge writes ---------------------------------------------


def test_force_never_replaces_a_project_folder(tmp_path):
    ckpt = hf_dir(tmp_path / "ckpt", sd(2.0))
    ref = hf_dir(tmp_path / "ref", sd())
    project = tmp_path / "project"
    project.mkdir()
    files = {
        "train.py": "import torch\n",
        "notes.md": "precious notes",
        "config.json": "{}",
        "adapter_config.json": '{"peft_type": "LORA"}',
    }
    for name, text in files.items():
        (project / name).write_text(text)
    save_file({"w": torch.ones(1)}, str(project / "adapter_model.safetensors"))
    save_file({"w": torch.ones(1)}, str(project / "model.safetensors"))
    before = {p.name: p.read_bytes() for p in project.iterdir()}
    proc = run_here("merge", str(ckpt), str(ref), "-o", str(project), "--force")
    assert_error(proc, "--force replaces only", "adapter_config.json", "nothing was replaced")
    assert {p.name: p.read_bytes() for p in project.iterdir()} == before
    # one file at a time: every name dsdmerge does not write is refused
    for keep in ("train.py", "notes.md", "adapter_model.safetensors", "adapter_config.json"):
        d = tmp_path / f"only_{keep}"
        shutil.copytree(ref, d)
        shutil.copy(project / keep, d / keep)
        assert_error(run_here("merge", str(ckpt), str(ref), "-o", str(d), "--force"), keep)
        assert (d / keep).read_bytes() == before[keep]


def test_force_replaces_what_dsdmerge_wrote(tmp_path):
    ckpt = hf_dir(tmp_path / "ckpt", sd(2.0), shards=2)
    ref = hf_dir(tmp_path / "ref", sd())
    (ref / "tokenizer.json").write_text("{}")
    (ref / "modeling_x.py").write_text("")
    out = tmp_path / "out"
    for _ in range(2):
        proc = run_here("merge", str(ckpt), str(ref), "-o", str(out), "--force")
        assert proc.returncode == 0, proc.stderr
    assert all(is_hf_file(p.name) for p in out.iterdir())
    # DCP: only .metadata and DCP's data files; a stray file keeps it
    dcp = tmp_path / "dcp"
    torch.save(sd(2.0), tmp_path / "ckpt.pt")
    args = [str(tmp_path / "ckpt.pt"), str(tmp_path / "ckpt.pt"), "-o", str(dcp), "--force"]
    assert run_here("merge", *args).returncode == 0
    assert run_here("merge", *args).returncode == 0
    (dcp / "model.distcp").write_text("not DCP's")
    assert_error(run_here("merge", *args), "model.distcp")


# -- OUT reads back ---------------------------------------------------------------------------


def test_no_stale_index_next_to_an_unsharded_result(tmp_path):
    """An unsharded checkpoint over a sharded reference: one model.safetensors, no index."""
    ckpt = hf_dir(tmp_path / "ckpt", sd(2.0))
    ref = hf_dir(tmp_path / "ref", sd(), shards=2)
    out = tmp_path / "out"
    assert run_here("merge", str(ckpt), str(ref), "-o", str(out)).returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert run_here("inspect", str(out)).returncode == 0
    torch.save(sd(2.0), tmp_path / "plain.pt")
    out2 = tmp_path / "out2"
    proc = run_here(
        "merge", str(tmp_path / "plain.pt"), str(ref), "-o", str(out2), "--format", "hf"
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out2.iterdir()) == ["config.json", "model.safetensors"]
    assert set(load_checkpoint(out2)) == set(sd())


def test_a_sharded_result_has_the_index_of_what_was_written(tmp_path):
    """Shards of any name are written as save_pretrained names them, with their index."""
    ckpt = hf_dir(tmp_path / "ckpt", sd(2.0, layers=4), shards=3)
    # rename the checkpoint's shards to names save_pretrained does not write
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    names = sorted(set(index["weight_map"].values()))
    new = {n: f"weights_part{i}.safetensors" for i, n in enumerate(names)}
    for old, name in new.items():
        (ckpt / old).rename(ckpt / name)
    index["weight_map"] = {k: new[v] for k, v in index["weight_map"].items()}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    assert run_here("merge", str(ckpt), str(ckpt), "-o", str(out)).returncode == 0
    written = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(written["weight_map"].values()))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for shard in shards:  # the index says exactly what each shard holds
        assert set(load_file(str(out / shard))) == {
            k for k, v in written["weight_map"].items() if v == shard
        }
    total = sum(v.numel() * v.element_size() for v in sd().values()) + 2 * 64
    assert written["metadata"]["total_size"] == total
    assert run_here("inspect", str(out)).returncode == 0


def test_a_shard_in_a_sub_directory_is_refused_when_read_and_never_written(tmp_path):
    ckpt = hf_dir(tmp_path / "ckpt", sd(2.0), shards=2)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (ckpt / "a").mkdir()
    (ckpt / first).rename(ckpt / "a" / first)
    index["weight_map"] = {k: f"a/{v}" if v == first else v for k, v in index["weight_map"].items()}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    for command in (["inspect", str(ckpt)], ["merge", str(ckpt), str(ckpt), "-o", "x"]):
        assert_error(run_here(*command), f"'a/{first}'", "not a file name inside")
    assert not Path("x").exists()
    with pytest.raises(dm.CheckpointWriteError, match="plain"):
        HFPlan({"w": "a/m.safetensors"}, {}, "model.safetensors.index.json", {}, {})
    with pytest.raises(dm.CheckpointWriteError, match="without an index"):
        HFPlan({"w": "a.safetensors", "v": "b.safetensors"}, {}, None, {}, {})


def test_a_directory_with_both_weights_and_an_index_reads_model_safetensors(tmp_path):
    """As transformers' from_pretrained does (model.safetensors first), and says so."""
    both = hf_dir(tmp_path / "both", sd(1.0))
    sharded = hf_dir(tmp_path / "sharded", sd(3.0, layers=3), shards=2)
    for f in sharded.iterdir():
        if f.name != "config.json":
            shutil.copy(f, both / f.name)
    with pytest.warns(dm.DSDMergeWarning, match="reading model.safetensors, as transformers"):
        loaded = load_checkpoint(both)
    assert set(loaded) == set(sd())
    assert all(torch.equal(loaded[k], v) for k, v in sd().items())
    proc = run_here("inspect", str(both))
    assert proc.returncode == 0, proc.stderr
    [warning] = proc.stderr.strip().splitlines()
    assert warning.startswith("dsdmerge: warning: ")
    assert "model.safetensors.index.json" in warning
    assert "  keys: 3\n" in proc.stdout
    with pytest.warns(dm.DSDMergeWarning):
        assert set(read_metadata(both)) == set(sd())


# -- transformers itself ------------------------------------------------------------------------


def tiny_llama(seed: int):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_transformers_reads_what_dsdmerge_reads_and_writes(tmp_path):
    transformers = pytest.importorskip("transformers")
    single, sharded = tiny_llama(0), tiny_llama(1)
    single.save_pretrained(tmp_path / "both")
    sharded.save_pretrained(tmp_path / "sharded", max_shard_size="2KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    for f in (tmp_path / "sharded").glob("model*"):
        shutil.copy(f, tmp_path / "both" / f.name)
    # a directory holding both: transformers loads model.safetensors, so does dsdmerge
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "both")
    with pytest.warns(dm.DSDMergeWarning):
        ours = load_checkpoint(tmp_path / "both")
    theirs = {k: v for k, v in loaded.state_dict().items() if k in ours}
    assert same_weights(theirs, dict(ours))
    assert same_weights(dict(ours), load_file(str(tmp_path / "both" / "model.safetensors")))
    # what dsdmerge writes, transformers loads: sharded, and unsharded over a sharded reference
    for ckpt, ref, name in (
        (tmp_path / "sharded", tmp_path / "sharded", "out_sharded"),
        (tmp_path / "single_only", tmp_path / "sharded", "out_single"),
    ):
        if not ckpt.exists():
            single.save_pretrained(ckpt)
        out = tmp_path / name
        proc = run_here("merge", str(ckpt), str(ref), "-o", str(out))
        assert proc.returncode == 0, proc.stderr
        model = transformers.LlamaForCausalLM.from_pretrained(out)
        written = load_checkpoint(out)
        state = {k: v for k, v in model.state_dict().items() if k in written}
        assert same_weights(state, dict(written))
        assert same_weights(dict(written), dict(load_checkpoint(ckpt)))
