"""remote_payload.eval.cache: the reval layout, layer subsets, validation, and the seeds layout (read + import)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from remote_payload.__main__ import main as payload_main
from remote_payload.contract.errors import FeatureMismatchError, PayloadError
from remote_payload.eval.cache import CACHE_JSON, open_cache
from remote_payload.extract.writer import CacheWriter

H = 8
LAYERS = [1, 3, 5]


def _feature_stats(c, i: int) -> SimpleNamespace:
    """Mean/std over all cached features of prompt i (test-only; was eval/cache.py's Cache.stats)."""
    _, x = c.load(i)
    x = x.float()
    return SimpleNamespace(mean=x.mean().item(), std=x.std().item())


def _prompts(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = 10 + 3 * i
        out.append((f"p{i}", 4 + i, torch.randint(0, 50, (T,), generator=g),
                    torch.randn(T, len(LAYERS), H, generator=g)))
    return out


def _write(path, prompts, layers=LAYERS):
    with CacheWriter(path, layer_ids=layers, hidden_size=H, target_path="/t") as w:
        for name, pl, ids, feats in prompts:
            w.add(name, pl, ids, feats)
    return path


def test_roundtrip_any_layer_subset_in_requested_order(tmp_path):
    prompts = _prompts()
    c = open_cache(_write(tmp_path / "c", prompts))
    assert c.layer_ids == LAYERS and c.hidden_size == H and len(c) == 3
    assert [(p.name, p.prompt_len, p.seq_len) for p in c.prompts] == [("p0", 4, 10), ("p1", 5, 13), ("p2", 6, 16)]
    for i, (_, _, ids, feats) in enumerate(prompts):
        got_ids, got = c.load(i)
        assert got_ids.dtype == torch.long and torch.equal(got_ids, ids)
        assert torch.equal(got, feats.reshape(len(ids), -1))
        for sub in ([5], [3, 5], [5, 1], [1, 5], [5, 3, 1]):
            _, x = c.load(i, layer_ids=sub, dtype=torch.float64)
            want = torch.cat([feats[:, LAYERS.index(l)] for l in sub], -1).double()
            assert x.dtype == torch.float64 and torch.equal(x, want), sub
    st = _feature_stats(c, 0)
    assert st.mean == pytest.approx(prompts[0][3].mean().item(), abs=1e-6)
    assert st.std == pytest.approx(prompts[0][3].std().item(), abs=1e-6)


def test_fingerprint_stable_and_content_sensitive(tmp_path):
    a = _write(tmp_path / "a", _prompts(seed=0))
    fp = open_cache(a).fingerprint
    assert fp.startswith("sha256:") and fp == open_cache(a).fingerprint
    assert open_cache(_write(tmp_path / "b", _prompts(seed=1))).fingerprint != fp


def test_missing_layer_names_both_lists_and_the_fix(tmp_path):
    c = open_cache(_write(tmp_path / "c", _prompts()))
    with pytest.raises(FeatureMismatchError) as e:
        c.load(0, layer_ids=[1, 2])
    msg = str(e.value)
    assert "[1, 3, 5]" in msg and "[2]" in msg and "--layers 1,2,3,5" in msg


def test_corrupt_file_and_empty_layer_request(tmp_path):
    c = open_cache(_write(tmp_path / "c", _prompts()))
    (c.path / "p0002.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(PayloadError, match=r"cannot read prompt 'p2' from p0002.safetensors"):
        c.load(2)
    with pytest.raises(FeatureMismatchError, match="no layers requested"):
        c.load(0, layer_ids=[])


def test_nan_features_name_prompt_and_layer(tmp_path):
    prompts = _prompts()
    prompts[1][3][4, 2, 0] = float("nan")
    c = open_cache(_write(tmp_path / "c", prompts))
    c.load(1, layer_ids=[1, 3])  # the bad layer is not read
    with pytest.raises(PayloadError, match=r"'p1' layer 5 has NaN/inf"):
        c.load(1)


def test_writer_is_atomic_and_refuses_existing_out(tmp_path):
    out = tmp_path / "c"
    with pytest.raises(RuntimeError), CacheWriter(out, layer_ids=LAYERS, hidden_size=H) as w:
        name, pl, ids, feats = _prompts()[0]
        w.add(name, pl, ids, feats)
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []  # neither the cache nor its temp dir
    with pytest.raises(PayloadError, match="no prompts"), CacheWriter(out, layer_ids=LAYERS, hidden_size=H):
        pass
    assert list(tmp_path.iterdir()) == []
    _write(out, _prompts())
    with pytest.raises(PayloadError, match="already exists"):
        CacheWriter(out, layer_ids=LAYERS, hidden_size=H)


@pytest.mark.parametrize("breakage, match", [
    ("no_json", "cache.json nor completions.json"),
    ("bad_json", "not valid JSON"),
    ("prompt_len", "need 0 < prompt_len < seq_len"),
    ("empty", "holds no prompts"),
    ("missing_file", "file p0001.safetensors is missing"),
    ("format", "is not 'reval.cache/1'"),
])
def test_bad_caches_fail_with_one_clear_line(tmp_path, breakage, match):
    c = _write(tmp_path / "c", _prompts())
    meta = json.loads((c / CACHE_JSON).read_text())
    if breakage == "no_json":
        (c / CACHE_JSON).unlink()
    elif breakage == "bad_json":
        (c / CACHE_JSON).write_text("{not json")
    elif breakage == "missing_file":
        (c / "p0001.safetensors").unlink()
    else:
        if breakage == "prompt_len":
            meta["prompts"][2]["prompt_len"] = meta["prompts"][2]["seq_len"]
        elif breakage == "empty":
            meta["prompts"] = []
        else:
            meta["format"] = "other/9"
        (c / CACHE_JSON).write_text(json.dumps(meta))
    with pytest.raises(PayloadError, match=match) as e:
        open_cache(c)
    assert "\n" not in str(e.value)


# ---- seeds layout ----------------------------------------------------------------------------------
def _write_seeds(src, prompts, *, aliases=False, sidecar=True):
    """completions.json + <name>.pt holding aux_hidden [1, T, 2H] (layers 1, 3) and last_hidden [1, T, H] (5)."""
    src.mkdir()
    entries = []
    for name, pl, ids, feats in prompts:
        T = len(ids)
        torch.save({"aux_hidden": feats[:, :2].reshape(1, T, 2 * H).to(torch.bfloat16),
                    "last_hidden": feats[:, 2].reshape(1, T, H).to(torch.bfloat16)}, src / f"{name}.pt")
        if aliases:
            entries.append({"name": name, "prompt_length": pl, "ids": ids.tolist(), "hs_file": f"{name}.pt"})
        else:
            entries.append({"name": name, "prompt_len": pl, "token_ids": ids.tolist()})
    (src / "completions.json").write_text(json.dumps({"completions": entries} if aliases else entries))
    if sidecar:
        (src / "layers.json").write_text(json.dumps({"layer_ids": LAYERS}))
    return src


def test_seeds_layout_read_directly_equals_import(tmp_path, capsys):
    prompts = _prompts()
    src = _write_seeds(tmp_path / "seeds", prompts)
    seeds = open_cache(src)
    assert seeds.layout == "seeds" and seeds.layer_ids == LAYERS and seeds.hidden_size == H
    dst = tmp_path / "imported"
    assert payload_main(["import-cache", str(src), "--out", str(dst)]) == 0
    assert "[3/3] p2: 16 tokens" in capsys.readouterr().out
    imported = open_cache(dst)
    assert imported.layout == "reval" and imported.dtype == "bfloat16"
    for i, (_, _, ids, feats) in enumerate(prompts):
        for sub in (None, [1, 3, 5], [1, 3, 5][:2], [5], [5, 1]):
            a_ids, a = seeds.load(i, layer_ids=sub)
            b_ids, b = imported.load(i, layer_ids=sub)
            assert torch.equal(a_ids, ids) and torch.equal(b_ids, ids)
            assert a.dtype == torch.bfloat16 and torch.equal(a, b), sub
        # aux_hidden alone = the 4-layer-drafter case; matches the original features at bf16
        _, aux = seeds.load(i, layer_ids=[1, 3])
        assert torch.equal(aux, feats[:, :2].reshape(len(ids), -1).to(torch.bfloat16))


def test_seeds_aliases_and_layers_option(tmp_path):
    prompts = _prompts(2)
    src = _write_seeds(tmp_path / "seeds", prompts, aliases=True, sidecar=False)
    with pytest.raises(PayloadError, match="pass --layers"):
        open_cache(src)
    c = open_cache(src, seeds_layer_ids=LAYERS)
    assert [p.prompt_len for p in c.prompts] == [4, 5]
    assert torch.equal(c.load(1)[0], prompts[1][2])
    with pytest.raises(PayloadError, match="say 3 aux layers"):
        open_cache(src, seeds_layer_ids=[1, 3, 5, 7])
    assert payload_main(["import-cache", str(src), "--out", str(tmp_path / "x"), "--layers", "1,3"]) == 3
    assert not (tmp_path / "x").exists()


def test_a_resumed_cache_holds_only_what_its_books_list(tmp_path):
    """A writer killed mid-file leaves its temporary files in the work dir (safetensors' own `.tmpXXXXXX`, our
    `.part`, a prompt file it never recorded): the resumed, finished cache holds cache.json and the listed prompts'
    files alone (CI once found a `.tmpIDhJnE` in a finished cache)."""
    out, prompts = tmp_path / "c", _prompts()
    with pytest.raises(KeyboardInterrupt), CacheWriter(out, layer_ids=LAYERS, hidden_size=H, resume_key="k") as w:
        w.add(*prompts[0])
        raise KeyboardInterrupt
    partial = tmp_path / ".c.partial"
    strays = [".tmpIDhJnE", "p0001.safetensors.part", "p0002.safetensors", "partial.json.part"]
    for name in strays:
        (partial / name).write_bytes(b"half")
    (partial / ".tmpdir").mkdir()
    with CacheWriter(out, layer_ids=LAYERS, hidden_size=H, resume_key="k") as w:
        assert sorted(w.done) == [0]
        assert not any((partial / name).exists() for name in strays)  # gone before any worker writes again
        (partial / ".tmpXXXXXX").write_bytes(b"a worker stopped mid-file")
        for i, p in enumerate(prompts[1:], start=1):
            w.add(*p, index=i)
    assert sorted(f.name for f in out.iterdir()) == [CACHE_JSON, "p0000.safetensors", "p0001.safetensors",
                                                      "p0002.safetensors"]
    assert [p.seq_len for p in open_cache(out).prompts] == [len(p[2]) for p in prompts]
