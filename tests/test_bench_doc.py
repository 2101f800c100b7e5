"""benchdoc (`make bench-doc`): the generated section of docs/benchmarks.md from a run's readings, and the rule
that no doc cites a speed figure outside that section and the dated history; the eval process's timeline.

The readings here are a fake run's (the seam between measuring, GPU-only, and writing); the stamped eval process
is a real one on the CPU (slow)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from remote_payload.contract import protocol
from remote_payload.tools import bench_process, benchdoc
from remote_payload.tools.benchrows import AFTER_IMPORTS, DEFAULT_ROW, T_EVAL, T_PROCESS, Sample

ROOT = Path(__file__).resolve().parents[1]
ENV = {"date": "2031-01-02 03:04 UTC", "gpu": "NVIDIA H200", "driver": "580.1", "cuda": "13.0",
       "torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0", "python": "3.12.3"}
PAGE = "# Benchmarks\n\nIntro.\n\n" + benchdoc.HISTORY + "\n\n### Old\n\nH200, 2026-12-01: 1.19x the floor.\n"


def fake_run() -> list[Sample]:
    proc = f"{T_PROCESS}: the seeds run"
    out = []
    for wall, off, rtc, pct, pct_off in ((6.0, 7.0, 6.1, 80.0, 64.0), (6.2, 7.3, 5.9, 79.0, 63.0),
                                        (5.9, 7.1, 6.3, 81.0, 65.5)):
        out += [Sample(proc, DEFAULT_ROW, "wall (s)", wall), Sample(proc, DEFAULT_ROW, AFTER_IMPORTS, wall - 3),
                Sample(proc, "REVAL_WARMUP=off", "wall (s)", off),
                Sample(proc, "REVAL_WARMUP=off", AFTER_IMPORTS, off - 3),
                Sample(proc, "REVAL_RTC=0", "wall (s)", rtc), Sample(proc, "REVAL_RTC=0", AFTER_IMPORTS, rtc - 3),
                Sample(T_EVAL, "seeds 10x30", "% of peak", pct), Sample(T_EVAL, "seeds 10x30, REVAL_RTC=0",
                                                                        "% of peak", pct_off)]
    return out


def test_the_section_carries_the_header_and_every_row_with_its_spread(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(PAGE)
    samples = fake_run()
    benchdoc.write_section(doc, benchdoc.render_section(ENV, samples, benchdoc.process_verdicts(samples)))
    text = doc.read_text()
    for field in ENV.values():
        assert field in text
    assert text.index(benchdoc.BEGIN) < text.index(benchdoc.END) < text.index(benchdoc.HISTORY)
    assert text.startswith("# Benchmarks\n\nIntro.\n\n") and text.endswith(PAGE[PAGE.index(benchdoc.HISTORY):])
    # the default's wall: 5.9, 6.0, 6.2 -> median 6.00 [5.90-6.20], n = 3
    assert re.search(r"\| default \(warm caches\) \| 6\.00 \[5\.90-6\.20\] \| 3\.00 \[2\.90-3\.20\] \|", text)
    assert "(n = 3)" in text
    assert "REVAL_WARMUP: the default wins (wall s 6.00 vs 7.10 off, the ranges apart)" in text
    assert "REVAL_RTC: within the spread (wall s 6.00 default vs 6.10 off" in text
    assert "seeds 10x30: REVAL_RTC: the default wins (% of peak 80.0 vs 64.0 off, the ranges apart)" in text
    # written again: the section replaced, not added
    benchdoc.write_section(doc, benchdoc.render_section(ENV, samples[:2]))
    again = doc.read_text()
    assert again.count(benchdoc.BEGIN) == 1 and again.count(benchdoc.END) == 1 and "REVAL_WARMUP" not in again


def test_verdict_needs_the_ranges_apart():
    assert "the default wins" in benchdoc.verdict("K", [1.0, 1.1, 1.2], [1.3, 1.4, 1.5], "s")
    assert "turning it off wins" in benchdoc.verdict("K", [1.3, 1.4, 1.5], [1.0, 1.1, 1.2], "s")
    assert "within the spread" in benchdoc.verdict("K", [1.0, 1.2, 1.4], [1.1, 1.3, 1.5], "s")
    assert "the default wins" in benchdoc.verdict("K", [80, 81, 82], [60, 61, 62], "%", higher_better=True)


def test_from_json_writes_the_page_and_bad_input_is_exit_3(tmp_path, capsys):
    doc, readings = tmp_path / "b.md", tmp_path / "m.json"
    doc.write_text(PAGE)
    later = {**ENV, "date": "2031-01-03 00:00 UTC"}
    readings.write_text(json.dumps({"env": ENV, "samples": [list(s.__dict__.values()) for s in fake_run()]}))
    (tmp_path / "m2.json").write_text(json.dumps({"env": later, "samples": [[T_EVAL, "seeds 10x30", "% of peak",
                                                                              70.0]] * 3}))
    assert benchdoc.main(["--from-json", str(readings), "--from-json", str(tmp_path / "m2.json"),
                          "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "session 1, 2031-01-02" in text and "session 2, 2031-01-03" in text
    assert f"### {T_EVAL} (n = 3; session 2)" in text and "| seeds 10x30 | 70.0 [70.0-70.0] |" in text
    fresh = tmp_path / "new" / "page.md"  # a page not written yet (a GPU host's --doc $OUT/x.md): the section
    fresh.parent.mkdir()
    assert benchdoc.main(["--from-json", str(readings), "--doc", str(fresh)]) == 0
    assert fresh.read_text().startswith(benchdoc.BEGIN) and fresh.read_text().rstrip().endswith(benchdoc.END)
    (tmp_path / "bad.json").write_text("{}")
    assert benchdoc.main(["--from-json", str(tmp_path / "bad.json"), "--doc", str(doc)]) == 3
    assert benchdoc.main(["--repeats", "2", "--doc", str(doc)]) == 3
    assert "error: --repeats must be >= 3" in capsys.readouterr().err
    assert benchdoc.main(["--knobs", "REVAL_SDPA=torch,REVAL_FAST=1", "--doc", str(doc)]) == 3
    assert "error: --knobs REVAL_SDPA=torch,REVAL_FAST=1: each one of REVAL_WARMUP=off" in capsys.readouterr().err


# A speed claim: a number followed by one of these (what the docs used to cite by hand).
SPEED = re.compile(r"\d[\d,.]*\s*(?:x (?:the )?floor|tokens/s|tok/s|TFLOP/s|GB/s|TB/s|rounds/s|"
                   r"% of (?:the )?(?:bf16 )?(?:matmul )?(?:peak|floor))", re.IGNORECASE)


def uncited_speed_figures(name: str, text: str) -> list[str]:
    """Lines citing a speed figure outside the generated section and the history (a page named *history*,
    or the benchmarks page's history section)."""
    if "history" in name:
        return []
    if benchdoc.BEGIN in text:
        text = text[:text.index(benchdoc.BEGIN)] + text[text.index(benchdoc.END) + len(benchdoc.END):]
    if benchdoc.HISTORY in text:
        head, _, rest = text.partition(benchdoc.HISTORY)
        nxt = re.search(r"^## ", rest, re.MULTILINE)
        text = head + (rest[nxt.start():] if nxt else "")
    return [line for line in text.splitlines() if SPEED.search(line)]


def test_no_doc_cites_a_speed_figure_outside_the_generated_tables_and_the_history():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = {p.name: bad for p in pages if (bad := uncited_speed_figures(p.name, p.read_text()))}
    assert not found, f"speed figures cited by hand (make bench-doc writes them): {found}"
    # the check catches one: a figure in the README, and one in benchmarks.md above its generated section
    assert uncited_speed_figures("README.md", "extract runs 2,011 tokens/s end to end")
    page = "# B\n\nThe eval is at 1.04x the floor.\n\n" + benchdoc.BEGIN + "\n| 3,223 tokens/s |\n" + benchdoc.END
    assert uncited_speed_figures("benchmarks.md", page) == ["The eval is at 1.04x the floor."]
    assert not uncited_speed_figures("benchmarks.md", PAGE + "\n68% of peak, 2026-12-02\n")


def test_the_timeline_splits_a_process_from_spawn_to_exit(tmp_path):
    events = tmp_path / "events.jsonl"
    for stage, step, msg in (("tokenizer", 1, "Loading tokenizer..."), ("load_cache", 3, "[1/2] a"),
                             ("load_drafter", 4, "Loading drafter d..."), ("load_drafter", 4, "loaded in 1.2s"),
                             ("eval", 5, "Evaluating 2 prompts"), ("done", 5, "")):
        protocol.append_event(events, {"stage": stage, "step": step, "message": msg})
    ev = protocol.read_events(events)
    t = bench_process.timeline(ev[0]["t"] - 4, ev[-1]["t"] + 0.5, {"main": ev[0]["t"] - 3.9,
                               "torch": ev[0]["t"] - 1, "imports": ev[0]["t"] - 0.9}, ev, ev[-1]["t"] + 0.1)
    seg = bench_process.segments(t)
    assert [s for s, _, _ in bench_process.SEGMENTS] == list(seg)
    assert seg["import torch"] == pytest.approx(2.9) and seg["exit path"] == pytest.approx(0.4)
    parts = sum(v for k, v in seg.items() if k != "whole process")
    assert parts == pytest.approx(seg["whole process"])
    assert "results.json written" not in bench_process.segments({k: v for k, v in t.items() if k != "written"})


@pytest.mark.slow
def test_a_stamped_eval_process_reports_every_segment(random_eval_inputs, tmp_path):
    d = random_eval_inputs
    argv = ["--drafter", str(d / "drafter"), "--target", str(d / "target"), "--cache", str(d / "cache"),
            "--max-blocks", "2", "--device", "cpu", "--num-prompts", "1"]
    (wall, timing), = bench_process.process_runs(argv, tmp_path, runs=1)
    seg = timing["segments"]
    assert [s for s, _, _ in bench_process.SEGMENTS] == list(seg)
    assert all(v >= 0 for v in seg.values()) and seg["whole process"] == pytest.approx(wall, abs=0.05)
    assert seg["import torch"] > 0.05 and timing["eval_s"] > 0
