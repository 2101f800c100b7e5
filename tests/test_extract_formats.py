"""extract's prompt files (z-lab turns jsonl, prompt jsonl, txt), the target's chat template (--chat-template,
--enable-thinking), multi-turn conversations with the target's own replies, and how cache.json records them.

On the trained tiny Qwen3 fixture target, copied to tmp with a tokenizer_config.json carrying a small Qwen3-like
Jinja chat template (it reads enable_thinking as Qwen3's does). Expected renderings are written out by hand."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from remote_payload.__main__ import main as payload_main
from remote_payload.contract.errors import PayloadError
from remote_payload.eval.cache import open_cache
from remote_payload.extract.command import extract
from remote_payload.prompts.files import read_prompts
from tests.runtools import stop_after

LAYERS = [1, 3]
NEW = 6
# '<|mask|>' stands for <|im_start|> and '<|eos|>' for <|im_end|> (the fixture vocabulary has no such tokens;
# role names and think tags tokenize to <|unk|>, which is still one token each).
TEMPLATE = ("{%- for m in messages -%}{{- '<|mask|> ' + m.role + ' ' + m.content + ' <|eos|> ' -}}{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{- '<|mask|> assistant ' -}}"
            "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think> </think> ' -}}{%- endif -%}"
            "{%- endif -%}")
SPECIAL_IDS = {0, 1, 2, 3}  # <|pad|> <|eos|> <|mask|> <|unk|>


def user(text):
    return f"<|mask|> user {text} <|eos|> "


def gen(thinking=False):
    return "<|mask|> assistant " + ("" if thinking else "<think> </think> ")


@pytest.fixture(scope="module")
def t(trained_fixtures, tmp_path_factory):
    """plain: the fixture target (no chat template); chat: + tokenizer_config.json with TEMPLATE; jinja: + a
    tokenizer_config.json without one and chat_template.jinja."""
    from tokenizers import Tokenizer
    d = tmp_path_factory.mktemp("targets")
    src = trained_fixtures / "target"
    for name in ("plain", "chat", "jinja"):
        shutil.copytree(src, d / name)
    (d / "plain" / "tokenizer_config.json").unlink()  # the fixture target's own template (CHAT_TEMPLATE) gone
    base = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
    (d / "chat" / "tokenizer_config.json").write_text(json.dumps({**base, "chat_template": TEMPLATE}))
    (d / "jinja" / "tokenizer_config.json").write_text(json.dumps(base))
    (d / "jinja" / "chat_template.jinja").write_text(TEMPLATE)
    return SimpleNamespace(plain=d / "plain", chat=d / "chat", jinja=d / "jinja",
                           tok=Tokenizer.from_file(str(src / "tokenizer.json")))


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _extract(target, prompts, out, log=lambda line: None, **kw):
    return extract(target, prompts, out, **{"max_new_tokens": NEW, "layer_ids": LAYERS, "device": "cpu",
                                            "log": log, **kw})


def _cli(target, prompts, out, *extra):
    return payload_main(["extract", "--target", str(target), "--prompts", str(prompts), "--out", str(out),
                         "--max-new-tokens", str(NEW), "--layers", ",".join(map(str, LAYERS)), "--device", "cpu",
                         *extra])


def _prompt_ids(cache, i):
    return cache.load(i)[0][:cache.prompts[i].prompt_len].tolist()


def _same_cache(a, b):
    assert [vars(p) for p in a.prompts] == [vars(p) for p in b.prompts]
    for i in range(len(a)):
        (ia, fa), (ib, fb) = a.load(i), b.load(i)
        assert ia.tolist() == ib.tolist()
        torch.testing.assert_close(fa, fb, rtol=1e-5, atol=1e-5)


# ---- the prompt files --------------------------------------------------------------------------------
def test_each_prompt_file_shape_parses(tmp_path):
    turns = _jsonl(tmp_path / "mt.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["count n01 n02", "skip n03 n06 n09"]},
        {"id": "b", "turns": ["pattern p1 moon"]},
        {"name": "c", "turns": ["countdown n15 n14", "count n07 n08"]},
        {"turns": ["fizzbuzz n01 n02"]}, ""])
    assert read_prompts(turns) == ("turns", [("81", ["count n01 n02", "skip n03 n06 n09"]),
                                             ("b", ["pattern p1 moon"]),
                                             ("c", ["countdown n15 n14", "count n07 n08"]),
                                             ("prompt-003", ["fizzbuzz n01 n02"])])
    assert read_prompts(turns, 2)[1] == read_prompts(turns)[1][:2]  # --num-prompts counts conversations
    prompt = _jsonl(tmp_path / "p.jsonl", [{"name": "x", "prompt": "count n01"}, {"prompt": "skip n03 n06"}])
    assert read_prompts(prompt) == ("prompt", [("x", ["count n01"]), ("prompt-001", ["skip n03 n06"])])
    txt = tmp_path / "p.txt"
    txt.write_text("count n01\n\nskip n03 n06\n")
    assert read_prompts(txt) == ("txt", [("prompt-000", ["count n01"]), ("prompt-001", ["skip n03 n06"])])
    # turn entries are named <name>/t<k>, so a prompt named like one collides
    dup = _jsonl(tmp_path / "dup.jsonl", [{"name": "a", "turns": ["count n01", "count n02"]},
                                          {"name": "a/t2", "turns": ["count n03"]}])
    with pytest.raises(PayloadError, match=r"duplicate names \['a/t2'\]"):
        read_prompts(dup)


@pytest.mark.parametrize("line, why", [
    ('{"turns": "count n01"}', '"turns" is not a non-empty list of non-empty strings'),
    ('{"turns": [], "question_id": 3}', '"turns" is not a non-empty list'),
    ('{"turns": ["count n01", 7]}', '"turns" is not a non-empty list'),
    ('{"prompt": ["count n01"]}', '"prompt" is not a non-empty string'),
    ('{"text": "count n01", "id": 1}', 'no "turns" or "prompt" (keys: id, text)'),
    ('{"turns": ["a"], "prompt": "b"}', 'both "turns" and "prompt"'),
    ('["count n01"]', "a JSON list, not an object"),
    ("count n01", "not JSON"),
    ('{"prompt": "count n01"}', "a 'prompt' line after 'turns' lines; use one shape per file"),
])
def test_a_bad_line_is_one_line_naming_file_line_and_shapes(t, tmp_path, capsys, line, why):
    prompts = _jsonl(tmp_path / "bad.jsonl", [{"turns": ["count n01"]}, "", line])
    rc = _cli(t.chat, prompts, tmp_path / "c")
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 3 and len(out) == 1, out
    assert out[0].startswith(f"error: --prompts {prompts} line 3: ") and why in out[0]
    if "shape per file" not in why:
        assert '{"turns": ["...", ...]}' in out[0] and '{"prompt": "..."}' in out[0] and ".txt" in out[0]
    assert not (tmp_path / "c").exists()


# ---- the chat template -------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["chat", "jinja"])
def test_prompt_ids_are_the_tokenized_rendering(t, tmp_path, which):
    texts = ["count n07 n08", "pattern p3 three"]
    prompts = _jsonl(tmp_path / "p.jsonl", [{"name": f"q{i}", "prompt": x} for i, x in enumerate(texts)])
    c = _extract(getattr(t, which), prompts, tmp_path / "c")
    assert [p.name for p in c.prompts] == ["q0", "q1"]
    for i, x in enumerate(texts):
        want = t.tok.encode(user(x) + gen(), add_special_tokens=False).ids
        assert _prompt_ids(c, i) == want
        assert c.prompts[i].seq_len == len(want) + NEW
    assert c.meta["prompt_format"] == {"source": "p.jsonl", "shape": "prompt", "chat_template": True,
                                       "chat_template_sha256": hashlib.sha256(TEMPLATE.encode()).hexdigest(),
                                       "enable_thinking": False}


def test_enable_thinking_changes_the_rendering_and_is_recorded(t, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("count n07 n08\n")
    assert _cli(t.chat, prompts, tmp_path / "off") == 0
    assert _cli(t.chat, prompts, tmp_path / "on", "--enable-thinking") == 0
    assert "chat template on" in capsys.readouterr().out
    off, on = open_cache(tmp_path / "off"), open_cache(tmp_path / "on")
    assert _prompt_ids(off, 0) == t.tok.encode(user("count n07 n08") + gen(False), add_special_tokens=False).ids
    assert _prompt_ids(on, 0) == t.tok.encode(user("count n07 n08") + gen(True), add_special_tokens=False).ids
    assert _prompt_ids(off, 0) != _prompt_ids(on, 0)
    assert (off.meta["prompt_format"]["enable_thinking"], on.meta["prompt_format"]["enable_thinking"]) == (False, True)
    assert on.meta["prompt_format"]["shape"] == "txt" and on.meta["prompt_format"]["source"] == "p.txt"
    assert on.prompts[0].name == "prompt-000"


def test_off_and_auto_without_a_template_are_raw_text(t, tmp_path):
    texts = ["count n07 n08", "skip n03 n06 n09"]
    prompts = _jsonl(tmp_path / "p.jsonl", [{"prompt": x} for x in texts])
    for target, mode in ((t.chat, "off"), (t.plain, "auto")):
        c = _extract(target, prompts, tmp_path / f"c-{mode}", chat_template=mode)
        assert [_prompt_ids(c, i) for i in range(2)] == [t.tok.encode(x).ids for x in texts]
        assert c.meta["prompt_format"] == {"source": "p.jsonl", "shape": "prompt", "chat_template": False,
                                           "chat_template_sha256": None, "enable_thinking": None}


@pytest.mark.parametrize("case, match", [
    ("on_without_template", "--chat-template on: --target {plain} has no chat template"),
    ("multi_turn_without_template", ("'q' has 2 turns, and multi-turn prompts need a chat template (--target "
                                     "{plain} has none); add a chat template to {plain} (a chat_template.jinja "
                                     "file, or \"chat_template\" in its tokenizer_config.json)")),
    ("multi_turn_off", ("multi-turn prompts need a chat template (--chat-template off applies none); leave "
                        "--chat-template off out (auto applies the target's template)")),
    ("thinking_without_template", "--enable-thinking: no chat template is applied"),
])
def test_refusals_are_one_line_before_loading(t, tmp_path, capsys, case, match):
    multi = case.startswith("multi")
    prompts = _jsonl(tmp_path / "p.jsonl", [{"name": "q", "turns": ["count n01", "count n05"] if multi
                                             else ["count n01"]}])
    target = t.chat if case == "multi_turn_off" else t.plain
    extra = {"on_without_template": ["--chat-template", "on"], "multi_turn_off": ["--chat-template", "off"],
             "thinking_without_template": ["--enable-thinking"]}.get(case, [])
    rc = _cli(target, prompts, tmp_path / "c", *extra)
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 3 and len(out) == 1 and match.format(plain=t.plain) in out[0], out
    assert not (tmp_path / "c").exists()
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".")] == []


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
@pytest.mark.parametrize("thinking", [False, True])
def test_the_advice_for_a_multi_turn_file_is_one_path_that_works(t, tmp_path, capsys, mode, thinking):
    """Multi-turn prompts, a target without a template: whatever --chat-template says, the error's advice is never
    a --chat-template value that the next run refuses (it was: auto -> "or --chat-template on" -> "or pass
    --chat-template off" -> "or --chat-template on"); following it (adding chat_template.jinja, then leaving
    --chat-template off out) extracts."""
    prompts = _jsonl(tmp_path / "mt.jsonl", [{"name": "q", "turns": ["count n01 n02", "skip n03 n06"]}])
    target = tmp_path / "target"
    shutil.copytree(t.plain, target)
    args = ["--chat-template", mode] + (["--enable-thinking"] if thinking else [])
    for step in range(4):
        rc = _cli(target, prompts, tmp_path / f"c{step}", *args)
        out = capsys.readouterr().out.strip().splitlines()
        if rc == 0:
            break
        assert rc == 3 and len(out) == 1, out
        advised = re.findall(r"(?:pass|try|or) --chat-template (\w+)", out[0])
        assert advised == [], out[0]  # a value to pass is the circle: for multi-turn prompts only a template works
        if "add a chat template to" in out[0]:
            (target / "chat_template.jinja").write_text(TEMPLATE)
        elif "leave --chat-template off out" in out[0]:
            args = [a for a in args if a not in ("--chat-template", "off")]
        else:
            raise AssertionError(f"no way out: {out[0]}")
    assert rc == 0 and step == (1 if mode != "off" else 2), (step, out)
    c = open_cache(tmp_path / f"c{step}")
    assert [p.name for p in c.prompts] == ["q/t1", "q/t2"] and c.meta["prompt_format"]["chat_template"] is True


def test_the_fixture_target_has_a_template_under_which_a_single_turn_prompt_is_itself(trained_fixtures, tmp_path):
    """The shipped demo target (tools/fixtures.py CHAT_TEMPLATE): z-lab's multi-turn format extracts on it as
    shipped, and the fixture cache's single-turn prompts are their raw text, as before it had a template."""
    from tokenizers import Tokenizer
    target = trained_fixtures / "target"
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    fixture_cache = open_cache(trained_fixtures / "cache")
    assert fixture_cache.meta["prompt_format"]["chat_template"] is True
    prompts = [json.loads(x) for x in (trained_fixtures / "prompts.jsonl").read_text().splitlines()]
    assert [_prompt_ids(fixture_cache, i) for i in range(len(prompts))] == [tok.encode(p["prompt"]).ids
                                                                            for p in prompts]
    c = _extract(target, _jsonl(tmp_path / "mt.jsonl", MT[:1]), tmp_path / "c")
    said = tok.decode(c.load(0)[0][c.prompts[0].prompt_len:].tolist(), skip_special_tokens=True)
    assert _prompt_ids(c, 1) == tok.encode(f"count n01 n02 {said} skip n03 n06 n09", add_special_tokens=False).ids


# ---- multi-turn --------------------------------------------------------------------------------------
MT = [{"question_id": 81, "turns": ["count n01 n02", "skip n03 n06 n09"]},
      {"turns": ["pattern p1 moon"]},
      {"name": "c", "turns": ["countdown n15 n14", "count n20 n21 n22 n23", "fizzbuzz n01 n02"]}]


def test_a_later_turn_carries_the_targets_own_earlier_reply(t, tmp_path):
    c = _extract(t.chat, _jsonl(tmp_path / "mt.jsonl", MT), tmp_path / "c")
    assert [p.name for p in c.prompts] == ["81/t1", "81/t2", "prompt-001", "c/t1", "c/t2", "c/t3"]
    pf = c.meta["prompt_format"]
    assert pf["shape"] == "turns" and pf["source"] == "mt.jsonl" and pf["chat_template"] is True

    def reply(i):
        ids, _ = c.load(i)
        return ids[c.prompts[i].prompt_len:].tolist()

    assert _prompt_ids(c, 0) == t.tok.encode(user("count n01 n02") + gen(), add_special_tokens=False).ids
    first = reply(0)
    words = [x for x in first if x not in SPECIAL_IDS]
    assert len(words) >= NEW - 1  # the trained target answers in its language
    second = _prompt_ids(c, 1)
    assert any(second[s:s + len(words)] == words for s in range(len(second)))  # turn 1's reply is in turn 2
    said = t.tok.decode(first, skip_special_tokens=True)
    assert second == t.tok.encode(user("count n01 n02") + f"<|mask|> assistant {said} <|eos|> "
                                  + user("skip n03 n06 n09") + gen(), add_special_tokens=False).ids
    third = _prompt_ids(c, 5)
    want = (user("countdown n15 n14") + f"<|mask|> assistant {t.tok.decode(reply(3), skip_special_tokens=True)} "
            "<|eos|> " + user("count n20 n21 n22 n23")
            + f"<|mask|> assistant {t.tok.decode(reply(4), skip_special_tokens=True)} <|eos|> "
            + user("fizzbuzz n01 n02") + gen())
    assert third == t.tok.encode(want, add_special_tokens=False).ids
    # a single-turn record keeps its name and is an ordinary prompt
    assert _prompt_ids(c, 2) == t.tok.encode(user("pattern p1 moon") + gen(), add_special_tokens=False).ids


def test_batched_multi_turn_extraction_writes_the_batch_1_cache(t, tmp_path):
    prompts = _jsonl(tmp_path / "mt.jsonl", MT)
    one = _extract(t.chat, prompts, tmp_path / "one", batch_size=1)
    many = _extract(t.chat, prompts, tmp_path / "many", batch_size=8)
    split = _extract(t.chat, prompts, tmp_path / "split", batch_size=8, batch_tokens=80)
    _same_cache(one, many)
    _same_cache(one, split)



def test_resume_continues_the_conversations_and_refuses_other_settings(t, tmp_path):
    prompts = _jsonl(tmp_path / "mt.jsonl", MT)
    with pytest.raises(KeyboardInterrupt):  # turn 1 of all three (entries 0, 2, 3), then 81/t2 (entry 1)
        _extract(t.chat, prompts, tmp_path / "c", log=stop_after(4, 6), batch_size=2)
    partial = tmp_path / ".c.partial"
    state = json.loads((partial / "partial.json").read_text())
    assert sorted(e["index"] for e in state["prompts"]) == [0, 1, 2, 3]
    with pytest.raises(PayloadError, match="started with other inputs"):
        _extract(t.chat, prompts, tmp_path / "c", enable_thinking=True)
    # 81/t1's file cut short: it is extracted again, and so is 81/t2, whose prompt holds 81/t1's reply;
    # c/t2 needs c/t1's reply, read back from its file
    victim = partial / "p0000.safetensors"
    victim.write_bytes(victim.read_bytes()[:100])
    lines = []
    c = _extract(t.chat, prompts, tmp_path / "c", log=lines.append, batch_size=2)
    assert lines[0].startswith(f"resuming {partial}: 2 of 6 prompts already extracted")
    assert sorted(line.split()[1] for line in lines if line.startswith("[")) == ["81/t1:", "81/t2:", "c/t2:",
                                                                                  "c/t3:"]
    assert not partial.exists()
    _same_cache(c, _extract(t.chat, prompts, tmp_path / "fresh"))


def test_resume_with_other_enable_thinking_refuses_via_the_cli(t, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("count n07 n08\nskip n03 n06 n09\n")
    with pytest.raises(KeyboardInterrupt):
        _extract(t.chat, prompts, tmp_path / "c", batch_size=1, log=stop_after(1, 2))
    capsys.readouterr()
    rc = _cli(t.chat, prompts, tmp_path / "c", "--enable-thinking")
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 3 and len(out) == 1 and "started with other inputs" in out[0], out
    assert _cli(t.chat, prompts, tmp_path / "c", "--no-enable-thinking") == 0
    assert "resuming" in capsys.readouterr().out
    assert open_cache(tmp_path / "c").meta["prompt_format"]["enable_thinking"] is False


def test_lines_end_at_newline_only(tmp_path):
    """A .txt splits at \\n and \\r\\n, never at U+2028, NEL, form feed or \\v (str.splitlines() does); a jsonl line
    with a raw U+2028 inside a string is valid JSON."""
    txt = tmp_path / "p.txt"
    txt.write_bytes("count n01\u2028n02\x85n03\r\nskip n03\x0cn06\x0bn09\n\n".encode())
    assert read_prompts(txt) == ("txt", [("prompt-000", ["count n01\u2028n02\x85n03"]),
                                         ("prompt-001", ["skip n03\x0cn06\x0bn09"])])
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_bytes('{"name": "a", "prompt": "count n01\u2028n02"}\r\n{"name": "b", "prompt": "x\x85y"}\n'
                      .encode())
    assert read_prompts(jsonl) == ("prompt", [("a", ["count n01\u2028n02"]), ("b", ["x\x85y"])])
