"""Their target's tapped states (their modeling_llama_kv.py: the input of layers {2, L//2, L-3}) vs reval's cache
features (cache layer_ids [1,3,4] = HF hidden_states[2,4,5]), full sequence, no KV cache. Also their d2t reading."""
import json
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.environ.get("EAGLE_DIR") or sys.exit("set EAGLE_DIR to a SafeAILab/EAGLE checkout"))
from eagle.model.modeling_llama_kv import LlamaForCausalLM

torch.set_num_threads(1)
fx = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".cache", "eagle3-fixtures")
m = LlamaForCausalLM.from_pretrained(fx + "/target", torch_dtype=torch.float32).eval()
cache = json.load(open(fx + "/cache/cache.json"))
print("cache layer_ids", cache["layer_ids"], "hf_hidden_states", cache.get("hf_hidden_states"))
worst = 0.0
for pr in cache["prompts"][:4]:
    d = load_file(f"{fx}/cache/{pr['file']}")
    with torch.no_grad():
        out = m.model(input_ids=d["ids"][None])
    theirs = torch.stack([h[0] for h in out["hidden_states"]], dim=1)  # [N,3,H]
    diff = (theirs - d["features"]).abs().max().item()
    worst = max(worst, diff)
    print(pr["name"], "taps", len(out["hidden_states"]), "max|diff|", diff)
print("worst", worst)
