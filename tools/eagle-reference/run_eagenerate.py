"""Run SafeAILab/EAGLE's own eagenerate (EAGLE-3 path) on reval's tiny EAGLE-3 fixture, CPU fp32, greedy.

Reference only: SafeAILab/EAGLE's own code, unmodified, from a checkout named by $EAGLE_DIR (the folder holding
its `eagle/` package; its commit in $EAGLE_DIR/EAGLE_COMMIT); nothing of it is in this repository. This driver
  * loads the fixture target as their KVLlamaForCausalLM (eagle/model/modeling_llama_kv.py),
  * builds their EaModel (eagle/model/ea_model.py) with their own __init__ (AutoTokenizer is stubbed in the
    ea_model module only because the fixture has no slow tokenizer; its eos_token_id is the target's),
  * adds the target's embed_tokens to the head's state dict (their Model skips load_emb when the config has
    target_hidden_size, and then load_state_dict(strict=False) would silently keep a random embedding),
  * wraps their evaluate_posterior (as bound in ea_model) to record each round's accept_length (drafts accepted),
  * runs eagenerate per prompt (prompt ids = the cache's first prompt_len ids) for the chain (top_k=1,
    depth=K-1, total_token=K+1) and the default tree (60, 7, 10).
Writes JSON: {mode: {prompt_name: {"accept": [A...], "tokens": [...generated ids...], "round_starts": [p...]}}}.
"""
import argparse
import json
import os
import sys
import types

import torch
from safetensors.torch import load_file

EAGLE_DIR = os.environ.get("EAGLE_DIR") or sys.exit("set EAGLE_DIR to a SafeAILab/EAGLE checkout (see README.md)")
sys.path.insert(0, EAGLE_DIR)

import eagle.model.ea_model as eam
from eagle.model.modeling_llama_kv import LlamaForCausalLM as KVLlamaForCausalLM


def build(target_dir, head_dir, total_token, depth, top_k, eos_id):
    base = KVLlamaForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32)
    base.eval()
    sd = load_file(os.path.join(head_dir, "model.safetensors"))
    if "embed_tokens.weight" not in sd:
        tsd = load_file(os.path.join(target_dir, "model.safetensors"))
        sd["embed_tokens.weight"] = tsd["model.embed_tokens.weight"]
    stub = types.SimpleNamespace(eos_token_id=eos_id)
    eam.AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: stub)
    model = eam.EaModel(True, base, target_dir, os.path.join(head_dir, "config.json"),
                        total_token, depth, top_k, 1.0, sd)
    model.eval()
    # sanity: every head weight came from the file (their load is strict=False)
    own = model.ea_layer.state_dict()
    for k, v in sd.items():
        assert k in own, f"key {k} unused by their Model"
        assert torch.equal(own[k].to(v.dtype), v), f"key {k} differs after load"
    return model


def _commit() -> str:
    try:
        return open(os.path.join(EAGLE_DIR, "EAGLE_COMMIT")).read().strip()
    except OSError:
        return "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                                        ".cache", "eagle3-fixtures"))
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=60)
    ap.add_argument("--chain", type=int, default=5)
    ap.add_argument("--tree", default="60,7,10")
    ap.add_argument("--modes", default="chain,tree")
    ap.add_argument("--out", required=True)
    ap.add_argument("--control-zero-d2t", action="store_true",
                    help="negative control: read draft id i as target id i (d2t zeroed); must NOT match reval")
    args = ap.parse_args()
    torch.set_num_threads(1)
    fx = args.fixtures
    target_dir, head_dir = os.path.join(fx, "target"), os.path.join(fx, "eagle3")
    cache = json.load(open(os.path.join(fx, "cache", "cache.json")))
    eos_id = json.load(open(os.path.join(target_dir, "config.json"))).get("eos_token_id")
    K = args.chain
    tt, td, tk = (int(x) for x in args.tree.split(","))
    setups = {"chain": (K + 1, K - 1, 1), "tree": (tt, td, tk)}
    log = []
    orig_eval = eam.evaluate_posterior

    def logged(logits, candidates, logits_processor):
        best, acc, p = orig_eval(logits, candidates, logits_processor)
        log.append({"accept": int(acc), "best_path": candidates[int(best)].tolist(),
                    "target_argmax": torch.argmax(logits[int(best)], dim=-1).tolist()})
        return best, acc, p

    eam.evaluate_posterior = logged
    out = {"eagle_commit": _commit(), "setups": {}}
    for mode in args.modes.split(","):
        total_token, depth, top_k = setups[mode]
        model = build(target_dir, head_dir, total_token, depth, top_k, eos_id)
        if args.control_zero_d2t:
            model.ea_layer.d2t.zero_()
        res = {}
        for pr in cache["prompts"][: args.num_prompts]:
            ids = load_file(os.path.join(fx, "cache", pr["file"]))["ids"]
            n = pr["prompt_len"]
            log.clear()
            gen, new_token, idx = model.eagenerate(ids[None, :n].clone(), temperature=0.0,
                                                   max_new_tokens=args.max_new_tokens, log=True)
            gen = gen[0].tolist()
            starts, p = [], n
            for r in log:
                starts.append(p)
                p += r["accept"] + 1
            res[pr["name"]] = {"prompt_len": n, "accept": [r["accept"] for r in log], "round_starts": starts,
                               "tokens": gen, "cache_ids": ids.tolist(), "rounds": len(log),
                               "idx": int(idx), "new_token": int(new_token), "log": log[:]}
            print(mode, pr["name"], "A:", res[pr["name"]]["accept"], flush=True)
        out["setups"][mode] = {"total_token": total_token, "depth": depth, "top_k": top_k, "prompts": res}
    json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
